"""`python -m hpctrain -m optim.lr=1e-4,3e-4 train.micro_batch=1,2`: Hydra's multirun, as one sweep.

The command line is read with Hydra's own override grammar (comma lists, `range()`, `choice()`,
`glob()` over a config group's options); the sweep is the cartesian product of the sweeping
overrides, as Hydra's basic sweeper makes it. Every element gets its own run directory under the
sweep directory (run.dir of the plain overrides), named after its overrides, and is composed,
checked and planned here, on the login node, before anything starts: one bad element stops the whole
sweep with every problem named. Then:

- launcher=local: the elements run one after the other (each as `python -m hpctrain` would run it);
- launcher=slurm: one Slurm job array, one task per element (`launcher.array_parallelism` bounds how
  many run at once), each task the element's own supervisor (requeue and restart work per task);
- launcher=sbatch: one array batch script, <sweep dir>/job.sbatch, to submit with `sbatch`.

<sweep dir>/sweep.json lists the elements; `python -m hpctrain.report <sweep dir>` compares them.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from hydra.errors import HydraException

from hpctrain.core.compose import ConfigError, compose, conf_dir
from hpctrain.core.schema import Config
from hpctrain.launch.allocation import allocation
from hpctrain.plan.verdict import plan_dict
from hpctrain.plan.login import plan_one, write_plan
from hpctrain.core import outdir
from hpctrain.core.rundir import (RunLock, check_run_dir, overwrite_problem, own_run_dir, prepare_run_dir,
                                  run_dir_override_problem)
from hpctrain.launch.supervise import supervise
from hpctrain.launch.sbatch import source_root, write_array_script
from hpctrain.launch.slurm import submit_array

SWEEP_FILE = "sweep.json"
SWEEP_TOOL = "python -m hpctrain -m"  # the owner a sweep directory's marker names
# What a sweep writes at the top of its directory, besides one run directory per element.
SWEEP_ENTRIES = (SWEEP_FILE, "job.sbatch", "chain.sh", "logs", "submitit")
MAX_ELEMENTS = 1000  # Slurm's default MaxArraySize is 1001


@dataclass
class Element:
    index: int
    overrides: list[str]  # the sweeping overrides that make this element, as key=value
    name: str  # its run directory's name
    cfg: Optional[Config] = None
    plan: Any = None
    problems: list[str] = field(default_factory=list)


def expand(overrides: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """(the plain overrides, one list of key=value per element): Hydra's grammar and product order."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"cannot parse the sweep: {str(e).splitlines()[0]}. Hydra's multirun syntax: "
                          "key=a,b,c  key=range(1,4)  key=choice(a,b)  group=glob(*)") from None
    fixed, axes = [], []
    for o in parsed:
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        key = o.get_key_element()
        value = o.value()
        if isinstance(value, Glob):
            group = conf_dir() / o.key_or_group.replace(".", "/")
            if not group.is_dir():
                raise ConfigError(f"{o.input_line}: glob() sweeps over a config group's options, and "
                                  f"{o.key_or_group} is not a group. Fix: list the values, {key}=a,b")
            values = value.filter(sorted(p.stem for p in group.glob("*.yaml")))
        else:
            values = list(o.sweep_string_iterator())
        axes.append((o.input_line, [f"{key}={v}" for v in values]))
    if not axes:
        raise ConfigError("-m (multirun) was given, but no override sweeps: give one several values, "
                          "e.g. optim.lr=1e-4,3e-4 (or drop -m for a single run)")
    return fixed, expand_axes(axes)


def expand_axes(axes: Sequence[tuple[str, Sequence]]) -> list[list]:
    """A sweep's elements, one value of each axis per element, the first axis outermost (the order of
    Hydra's basic sweeper). `axes`: (the axis as its sweep names it, for the refusals; its values). One
    rule for every sweep hpctrain submits, `python -m hpctrain -m` and `python -m hpctrain.bench.sweep`:
    an axis over no values is refused, and so is a sweep larger than one Slurm job array."""
    for where, values in axes:
        if not values:
            raise ConfigError(f"{where}: sweeps over no values")
    count = math.prod(len(values) for _, values in axes)  # counted before any element is made
    if count > MAX_ELEMENTS:
        raise ConfigError(f"the sweep has {count} elements; at most {MAX_ELEMENTS} "
                          "(Slurm's MaxArraySize). Fix: sweep fewer values")
    return [list(p) for p in itertools.product(*(values for _, values in axes))]


def dir_name(element: Sequence[str]) -> str:
    """`optim.lr=0.001,train.micro_batch=2`, as Hydra's override_dirname, made safe for a path."""
    name = ",".join(o.lstrip("+~") for o in element)
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)
    if len(name) <= 200:
        return name
    return name[:180] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]


def elements_of(fixed: Sequence[str], sweep: list[list[str]], sweep_dir: str) -> list[Element]:
    out, seen = [], set()
    for i, element in enumerate(sweep):
        name = dir_name(element)
        if name in seen:  # two values that differ only in characters a path cannot hold
            name = f"{i:03d}-{name}"
        seen.add(name)
        out.append(Element(i, list(element), name))
    return out


def hydra_quoted(text: str) -> str:
    """`text` as a single-quoted value of Hydra's override grammar, which reads back as `text`: a quote
    is escaped by a backslash, and backslashes are escaped (doubled) only where they come before a
    quote or the end; elsewhere Hydra keeps them as they are. (The sweep's directory holds no `${`:
    compose() has resolved it.)"""
    return "'" + re.sub(r"(\\*)('|\Z)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def element_overrides(fixed: Sequence[str], e: Element, sweep_dir: str) -> list[str]:
    # quoted: the name holds '=' and ','
    return [*fixed, *e.overrides, f"run.dir={hydra_quoted(str(Path(sweep_dir) / e.name))}"]


def same_allocation_problems(elements: list[Element]) -> list[str]:
    """A job array asks Slurm for one shape for every task."""
    shapes = {}
    for e in elements:
        a = allocation(e.cfg.cluster, "x")
        shapes.setdefault(json.dumps(a, sort_keys=True, default=str), []).append(e)
    if len(shapes) <= 1:
        return []
    first, *others = shapes.values()
    return [f"the elements ask Slurm for different allocations ({' '.join(first[0].overrides)} vs "
            f"{' '.join(others[0][0].overrides)}), and a job array has one allocation for all its tasks. "
            "Fix: sweep cluster keys as separate sweeps, or run them with launcher=local"]


def write_sweep(sweep_dir: Path, fixed: Sequence[str], elements: list[Element], launcher: str) -> Path:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / SWEEP_FILE
    record = {"overrides": list(fixed), "launcher": launcher,
              "elements": [{"index": e.index, "name": e.name, "overrides": e.overrides} for e in elements]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def read_sweep(sweep_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------- the command

def _predicted(e: Element) -> str:
    d = plan_dict(e.plan)
    return (f"{d['step_time_s']:8.3f} s/step {d['tokens_per_s']:>12,.0f} tok/s "
            f"{d['memory_per_gpu_bytes'] / 2**30:6.2f} GiB/GPU (predicted)")


def multirun(overrides: list[str]) -> int:
    """`python -m hpctrain -m ...`; returns the exit code."""
    try:
        if "--cfg" in overrides:
            raise ConfigError("--cfg shows one config: drop -m, or give one element's values")
        empty = run_dir_override_problem(overrides)
        if empty:
            raise ConfigError(empty)
        fixed, sweep = expand(overrides)
        base = compose(fixed)
        sweep_dir = Path(base.run.dir)
        elements = elements_of(fixed, sweep, str(sweep_dir))
        print(f"sweep: {len(elements)} element(s) in {sweep_dir}", flush=True)
        for e in elements:
            try:
                e.cfg, e.plan = plan_one(element_overrides(fixed, e, str(sweep_dir)))
            except ConfigError as err:
                e.problems.append(str(err))
        bad = [e for e in elements if e.problems]
        if bad:
            raise ConfigError(f"{len(bad)} of {len(elements)} sweep elements cannot run; nothing was started:\n"
                              + "\n".join(f"[{e.index}] {' '.join(e.overrides)}: {e.problems[0]}" for e in bad))
        launcher = str(base.launcher.name)
        if launcher in ("slurm", "sbatch"):
            found = same_allocation_problems(elements)
            if found:
                raise ConfigError("\n".join(found))
        elif launcher == "k8s":
            raise ConfigError("launcher=k8s writes one manifest per run: sweep with launcher=local, slurm or "
                              "sbatch, or write each element's manifest without -m")
        for e in elements:
            print(f"  [{e.index}] {e.name:<40} {_predicted(e)}")
        if base.dry_run:
            print("dry run: nothing started")
            return 0
        for e in elements:
            problem = overwrite_problem(e.cfg.run.dir, e.cfg.checkpoint.resume)
            if problem:
                raise ConfigError(f"[{e.index}] {problem}")
        for e in elements:  # every directory checked before any is written
            check_run_dir(e.cfg.run.dir)
        own_sweep_dir(sweep_dir)
    except ConfigError as err:
        print(f"hpctrain: error: {err}", file=sys.stderr)
        return 2
    locks: list[RunLock] = []
    try:
        for e in elements:  # refused, before anything is written, while another start holds one of them
            locks.append(RunLock.take(own_run_dir(e.cfg.run.dir)))
        for e in elements:
            prepare_run_dir(e.cfg)
            write_plan(e.plan, e.cfg.run.dir)
        write_sweep(sweep_dir, fixed, elements, launcher)
        return launch(sweep_dir, elements, base, locks)
    except ConfigError as err:
        print(f"hpctrain: error: {err}", file=sys.stderr)
        return 2
    finally:
        for lock in locks:
            lock.release()


def own_sweep_dir(sweep_dir: Path) -> None:
    """The sweep's directory, checked (absent, empty, or a sweep's: its marker, or sweep.json from before
    markers), created and marked, as run directories are (hpctrain.core.rundir.own_run_dir)."""
    try:
        outdir.check_in_place(sweep_dir, SWEEP_TOOL, lambda d: (d / SWEEP_FILE).is_file())
        sweep_dir.mkdir(parents=True, exist_ok=True)
        outdir.mark(sweep_dir, SWEEP_TOOL, list(SWEEP_ENTRIES))
    except outdir.OutputDirError as e:
        raise ConfigError(f"run.dir={e}") from None
    except OSError as e:
        raise ConfigError(f"run.dir={sweep_dir} cannot be created or written ({e.strerror}: {e.filename}). "
                          "Fix: choose a run.dir in a directory you can write to") from None


def launch(sweep_dir: Path, elements: list[Element], base: Config, locks: list[RunLock]) -> int:
    """Run the elements one after the other here, each holding its lock (locks[i]) to its end, or
    submit them (each array task's supervisor takes its own element's lock)."""
    launcher = str(base.launcher.name)
    if launcher == "local":
        codes = []
        for e, lock in zip(elements, locks):
            print(f"hpctrain: sweep element {e.index + 1}/{len(elements)}: {' '.join(e.overrides)}", flush=True)
            codes.append(supervise(e.cfg.run.dir, lock))
        failed = [e for e, rc in zip(elements, codes) if rc != 0]
        print(f"sweep done: {len(elements) - len(failed)} of {len(elements)} completed"
              + (f"; failed: {', '.join(e.name for e in failed)}" if failed else "")
              + f"\ncompare them: python -m hpctrain.report {shlex.quote(str(sweep_dir))}")
        return 1 if failed else 0
    run_dirs = [str(e.cfg.run.dir) for e in elements]
    if launcher == "slurm":
        for lock in locks:  # before the array's tasks can start and take them
            lock.release()
        return submit_array(base, sweep_dir, [e.cfg for e in elements], run_dirs, sys.executable, source_root())
    path = write_array_script(elements[0].cfg, sweep_dir, run_dirs, sys.executable, source_root(),
                              [e.cfg for e in elements])
    how = f"bash {shlex.quote(str(path))}" if path.suffix == ".sh" else f"sbatch {shlex.quote(str(path))}"
    print(f"wrote {path}: one array task per element\nsubmit it with:\n  {how}\n"
          f"compare them: python -m hpctrain.report {shlex.quote(str(sweep_dir))}")
    return 0
