"""launcher=sbatch: a self-contained batch script the user submits with plain `sbatch`.

`sbatch_script(cfg, run_dir, python)` is pure (same input, same text; it reads no environment): the
`#SBATCH` lines ask for what launcher=slurm would (nodes x tasks, `--signal=USR2@<lead>` to every
task, `--requeue`, `--no-kill`, `--open-mode=append`, the supervisor's log in
<run_dir>/logs/slurm-<jobid>.out), the body runs cluster.setup as written, exports cluster.env and
starts the run's supervisor (`python -m hpctrain.launch.supervise <run_dir>`), which starts one rank
per task with srun, restarts them after a failure and requeues the job after a preemption save
(hpctrain.launch.supervise), so the script has no logic of its own for any of it.

Quoting: the shell never reads `#SBATCH` lines, sbatch's own parser does (see
hpctrain.launch.allocation.sbatch_line). A newline cannot be written in a `#SBATCH` line at all and
is refused. Everything in the body that comes from
the config is shlex.quote()d, except cluster.setup, which is the user's own shell.

`python -m hpctrain ... launcher=sbatch` writes <run_dir>/job.sbatch and prints the `sbatch` command;
with dry_run=true it prints the script it would write and writes nothing (no run directory either).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

from hpctrain.compose import ConfigError
from hpctrain.launch.allocation import allocation, sbatch_lines
from hpctrain.plan.cluster_check import script_problems
from hpctrain.spec import ranks_per_node

SCRIPT_NAME = "job.sbatch"


def directives(cfg: Any, run_dir: str) -> dict[str, Any]:
    """The `#SBATCH` options as an ordered mapping (value True = bare flag)."""
    log = str(Path(run_dir) / "logs").replace("%", "%%") + "/slurm-%j.out"  # %% = a literal % for Slurm
    return allocation(cfg.cluster, cfg.run.name, more={
        "signal": f"USR2@{cfg.cluster.signal_lead_s}",  # no B:, so that every task gets it, not only the batch shell
        "requeue": True,
        "no-kill": True,  # a node lost does not end the job: the supervisor goes on without it
        "open-mode": "append",  # a requeued job appends to the same log
        "output": log, "error": log})


def exports(cfg: Any, pythonpath: Optional[str] = None) -> list[str]:
    """`export` lines for the job's environment: hpctrain's source (when run from a checkout), then
    cluster.env, every value quoted."""
    lines = []
    if pythonpath:
        lines.append(f"export PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}")
    for key, value in dict(cfg.cluster.env or {}).items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        lines.append(f"export {key}={shlex.quote(text)}")
    return lines


def sbatch_script(cfg: Any, run_dir: str, python: str, pythonpath: Optional[str] = None) -> str:
    """The batch script for this run. Raises ConfigError for values it cannot write safely."""
    found = script_problems(cfg, run_dir)
    if found:
        raise ConfigError("cannot write the sbatch script:\n" + "\n".join(f"  - {p}" for p in found))
    c = cfg.cluster
    lines = ["#!/bin/bash",
             f"# hpctrain run {cfg.run.name}: submit with `sbatch {shlex.quote(str(Path(run_dir) / SCRIPT_NAME))}`.",
             "# Written by `python -m hpctrain ... launcher=sbatch`; a requeued job reruns this script and",
             "# resumes from the newest complete checkpoint in the run directory."]
    lines += sbatch_lines(directives(cfg, run_dir))
    lines += ["", "set -euo pipefail"]
    if c.setup:
        # The user's own shell, as written. Without -u: module and conda scripts read unset variables.
        lines += ["", "# cluster.setup", "set +u", *[str(s) for s in c.setup], "set -u"]
    env = exports(cfg, pythonpath)
    if env:
        lines += ["", "# environment: hpctrain's source, cluster.env", *env]
    supervisor = [python, "-u", "-m", "hpctrain.launch.supervise", str(run_dir)]
    lines += ["",
              f"# {c.nodes} node(s) x {ranks_per_node(c)} task(s), one rank per task, started by the supervisor",
              "# with srun; after a failure it starts them again from the newest checkpoint.",
              " ".join(shlex.quote(a) for a in supervisor), ""]
    return "\n".join(lines)


def source_root() -> Optional[str]:
    """The checkout hpctrain runs from (to put on the job's PYTHONPATH), or None when installed."""
    root = Path(__file__).resolve().parent.parent.parent
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return str(root)
    return None


def write_script(cfg: Any, run_dir: str, python: str, pythonpath: Optional[str] = None) -> Path:
    path = Path(run_dir) / SCRIPT_NAME
    text = sbatch_script(cfg, str(run_dir), python, pythonpath)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
    return path
