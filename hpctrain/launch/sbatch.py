"""launcher=sbatch: a self-contained batch script the user submits with plain `sbatch`.

`sbatch_script(cfg, run_dir, python)` is pure (same input, same text; it reads no environment): the
`#SBATCH` lines ask for what launcher=slurm would (nodes x tasks, cluster.spare_nodes more nodes,
`--signal=USR2@<lead>` to every task, `--requeue`, `--no-kill`, `--open-mode=append`, the supervisor's log in
<run_dir>/logs/slurm-<jobid>.out), the body runs cluster.setup as written, exports cluster.env and
starts the run's supervisor (`python -m hpctrain.launch.supervise <run_dir>`), which starts one rank
per task with srun, restarts them after a failure and requeues the job after a preemption save
(hpctrain.launch.supervise), so the script has no logic of its own for any of it. With
cluster.container_image the ranks' srun step runs them in the image (pyxis; hpctrain.launch.container)
while the script and the supervisor stay on the batch host: the script only says so, in a comment.

Quoting: the shell never reads `#SBATCH` lines, sbatch's own parser does (see
hpctrain.launch.allocation.sbatch_line). A newline cannot be written in a `#SBATCH` line at all and
is refused. Everything in the body that comes from
the config is shlex.quote()d, except cluster.setup, which is the user's own shell. Paths in Slurm's
filename patterns (`--output`) have their % doubled (slurm_filename). What no quoting can carry is
refused by hpctrain.checks.cluster_checks.script_problems: a NUL anywhere, a line break in an `#SBATCH`
value, a cluster.env name bash gives a meaning of its own (`export RANDOM=...` evaluates the value).

A sweep's array script gives each task its own element's cluster.setup and cluster.env (they may differ
between elements, e.g. `+cluster.env.FOO=a,b`): where they do, a `case` on SLURM_ARRAY_TASK_ID runs
element i's in task i (per_task; submitit's array script under launcher=slurm takes the same lines).

`python -m hpctrain ... launcher=sbatch` writes <run_dir>/job.sbatch and prints the `sbatch` command;
with dry_run=true it prints the script it would write and writes nothing (no run directory either).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

from hpctrain.core.compose import ConfigError
from hpctrain.launch import container
from hpctrain.launch.allocation import allocation, sbatch_lines
from hpctrain.launch.chain import chain_script
from hpctrain.checks.cluster_checks import container_problems, script_problems
from hpctrain.core.spec import ranks_per_node
from hpctrain.core.schema import Config

SCRIPT_NAME = "job.sbatch"
CHAIN_SCRIPT = "chain.sh"


def slurm_filename(path: str | Path) -> str:
    """`path` as a literal in a Slurm filename pattern (sbatch's and srun's --output), where %j, %t, ...
    stand for ids: every % doubled. (A backslash would turn the patterns off altogether; run.dir is
    refused with one.)"""
    return str(path).replace("%", "%%")


def directives(cfg: Config, run_dir: str, array: Optional[str] = None) -> dict[str, Any]:
    """The `#SBATCH` options as an ordered mapping (value True = bare flag); `array`: a job array's
    `--array` (one task per sweep element, `run_dir` then the sweep's directory)."""
    # %A_%a = an array task's <array job>_<task>
    log = slurm_filename(Path(run_dir) / "logs") + ("/slurm-%A_%a.out" if array else "/slurm-%j.out")
    return allocation(cfg.cluster, cfg.run.name, more={**({"array": array} if array else {}),
        "signal": f"USR2@{cfg.cluster.signal_lead_s}",  # no B:, so that every task gets it, not only the batch shell
        "requeue": True,
        "no-kill": True,  # a node lost does not end the job: the supervisor goes on without it
        "open-mode": "append",  # a requeued job appends to the same log
        "output": log, "error": log})


def exports(cfg: Config, pythonpath: Optional[str] = None) -> list[str]:
    """`export` lines for the job's environment: hpctrain's source (when run from a checkout), then
    cluster.env, every value quoted."""
    lines = []
    if pythonpath:
        lines.append(f"export PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}")
    for key, value in dict(cfg.cluster.env or {}).items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        lines.append(f"export {key}={shlex.quote(text)}")
    return lines


def task_block(cfg: Config, pythonpath: Optional[str] = None, strict: bool = True) -> list[str]:
    """What a task runs before its supervisor: cluster.setup as written, then the exports. `strict`:
    in a script under `set -u`, which setup runs without (module and conda scripts read unset
    variables)."""
    setup = [str(s) for s in (cfg.cluster.setup or [])]
    if setup and strict:
        setup = ["set +u", *setup, "set -u"]
    return setup + exports(cfg, pythonpath)


def per_task(blocks: list[list[str]]) -> list[str]:
    """A `case` on SLURM_ARRAY_TASK_ID: array task i runs blocks[i]. Not indented: a setup line may
    open a here-document, whose end marker must start its line."""
    lines = ['case "${SLURM_ARRAY_TASK_ID-}" in']
    for i, block in enumerate(blocks):
        lines += [f"{i})", *block, ";;"]
    return lines + ["*)", 'echo "hpctrain: array task ${SLURM_ARRAY_TASK_ID-(unset)} is not an element of this sweep" >&2',
                    "exit 1", ";;", "esac"]


def array_setup(cfgs: list[Config], pythonpath: Optional[str] = None, strict: bool = True) -> Optional[list[str]]:
    """The per-task `case` for a sweep whose elements differ in cluster.setup or cluster.env; None
    where they are all the same (then every task runs the same lines)."""
    blocks = [task_block(c, pythonpath, strict) for c in cfgs]
    if all(b == blocks[0] for b in blocks):
        return None
    return per_task(blocks)


def _problems(cfg: Config, run_dir: str, pythonpath: Optional[str], array_dirs: Optional[list[str]],
              array_cfgs: Optional[list[Config]]) -> list[str]:
    found = script_problems(cfg, run_dir) + container_problems(cfg, run_dir, pythonpath)
    for c, d in zip(array_cfgs or [], array_dirs or []):
        found += [p for p in script_problems(c, d) if p not in found]
    return found


def spare_comment(spares: int) -> list[str]:
    """The script's word on cluster.spare_nodes (--nodes counts them): none without spares."""
    if spares <= 0:
        return []
    return [f"# --nodes holds {spares} spare node(s) besides, idle (their agents started) until a node is lost;",
            "# a spare then takes its ranks, restored from the replicas of their memory snapshots, in the same job."]


def sbatch_script(cfg: Config, run_dir: str, python: str, pythonpath: Optional[str] = None,
                  array_dirs: Optional[list[str]] = None, array_parallelism: int = 0,
                  array_cfgs: Optional[list[Config]] = None) -> str:
    """The batch script for this run, or with `array_dirs` for a sweep: a job array whose task i runs
    array_dirs[i] (`run_dir` is then the sweep's directory) with array_cfgs[i]'s cluster.setup and
    cluster.env (default: cfg's for every task). Raises ConfigError for values it cannot write safely."""
    if array_cfgs is not None and len(array_cfgs) != len(array_dirs or []):
        raise ValueError(f"{len(array_cfgs)} element configs for {len(array_dirs or [])} run directories")
    found = _problems(cfg, run_dir, pythonpath, array_dirs, array_cfgs)
    if found:
        raise ConfigError("cannot write the sbatch script:\n" + "\n".join(f"  - {p}" for p in found))
    c = cfg.cluster
    what = f"sweep {cfg.run.name} ({len(array_dirs)} runs, one array task each)" if array_dirs else f"run {cfg.run.name}"
    lines = ["#!/bin/bash",
             f"# hpctrain {what}: submit with `sbatch {shlex.quote(str(Path(run_dir) / SCRIPT_NAME))}`.",
             f"# Written by `python -m hpctrain {'-m ' if array_dirs else ''}... launcher=sbatch`; a requeued job reruns "
             "this script and",
             "# resumes from the newest complete checkpoint in the run directory."]
    array = None
    if array_dirs:
        array = f"0-{len(array_dirs) - 1}" + (f"%{array_parallelism}" if array_parallelism > 0 else "")
    lines += sbatch_lines(directives(cfg, run_dir, array))
    lines += ["", "set -euo pipefail"]
    each = array_setup(array_cfgs, pythonpath) if array_dirs and array_cfgs else None
    if each:
        lines += ["", "# cluster.setup, then the environment (hpctrain's source, cluster.env): the sweep's elements",
                  "# differ in them, so array task i runs element i's", *each]
    else:
        if c.setup:
            # The user's own shell, as written. Without -u: module and conda scripts read unset variables.
            lines += ["", "# cluster.setup", "set +u", *[str(s) for s in c.setup], "set -u"]
        env = exports(cfg, pythonpath)
        if env:
            lines += ["", "# environment: hpctrain's source, cluster.env", *env]
    in_image = container.describe(c, "RUN_DIR" if array_dirs else str(run_dir), pythonpath,
                                  array=bool(array_dirs))
    if in_image:
        lines += ["", *in_image]
    supervisor = " ".join(shlex.quote(a) for a in [python, "-u", "-m", "hpctrain.launch.supervise"])
    if array_dirs:
        lines += ["", "# the sweep's run directories: array task i runs element i",
                  "run_dirs=(", *[f"  {shlex.quote(str(d))}" for d in array_dirs], ")"]
        supervisor += ' "${run_dirs[$SLURM_ARRAY_TASK_ID]}"'
    else:
        supervisor += " " + shlex.quote(str(run_dir))
    lines += ["",
              f"# {c.nodes} node(s) x {ranks_per_node(c)} task(s), one rank per task, started by the supervisor",
              "# with srun; after a failure it starts them again from the newest checkpoint.",
              *spare_comment(c.spare_nodes), supervisor, ""]
    return "\n".join(lines)


def source_root() -> Optional[str]:
    """The checkout hpctrain runs from (to put on the job's PYTHONPATH), or None when installed."""
    root = Path(__file__).resolve().parent.parent.parent
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return str(root)
    return None


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")  # UTF-8 whatever the locale (a C locale refuses non-ASCII)
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def write_script(cfg: Config, run_dir: str, python: str, pythonpath: Optional[str] = None) -> Path:
    """<run_dir>/job.sbatch; with launcher.chain > 1 also <run_dir>/chain.sh, which submits the chain.
    Returns the path to run: the script, or chain.sh."""
    path = _write(Path(run_dir) / SCRIPT_NAME, sbatch_script(cfg, str(run_dir), python, pythonpath))
    if cfg.launcher.chain > 1:
        return _write(Path(run_dir) / CHAIN_SCRIPT, chain_script(path, cfg.launcher.chain))
    return path


def write_array_script(cfg: Config, sweep_dir: str | Path, run_dirs: list[str], python: str,
                       pythonpath: Optional[str] = None, cfgs: Optional[list[Config]] = None) -> Path:
    """<sweep_dir>/job.sbatch, one array task per run directory, task i with cfgs[i]'s setup and
    environment (and chain.sh, as write_script)."""
    (Path(sweep_dir) / "logs").mkdir(parents=True, exist_ok=True)
    text = sbatch_script(cfg, str(sweep_dir), python, pythonpath, array_dirs=run_dirs,
                         array_parallelism=cfg.launcher.array_parallelism, array_cfgs=cfgs)
    path = _write(Path(sweep_dir) / SCRIPT_NAME, text)
    if cfg.launcher.chain > 1:
        return _write(Path(sweep_dir) / CHAIN_SCRIPT, chain_script(path, cfg.launcher.chain, run_dirs))
    return path
