"""Job chains (`launcher.chain=N`): N jobs on one run directory, each starting after the previous one
ends (`--dependency=afterany:<previous>`), for clusters whose time limit is shorter than the run.

Each link is an ordinary hpctrain job: its supervisor resumes from the newest complete checkpoint,
and the time limit's USR2 makes every rank save. What a chain changes (hpctrain.launch.supervise):
a link with a later link queued does not requeue itself after that save (the next link goes on; a
requeued job would hold the chain back, and many clusters forbid requeue), and the link that
completes the run cancels the links still queued, so a chain stops early. A link that starts on a
finished run ends at once.

<run.dir>/chain.json lists the links' job ids in order (`<array job>_<task>` for a sweep's task),
written at submission: by the submitit launcher, or by <run.dir>/chain.sh under launcher=sbatch.
"""
from __future__ import annotations

import json
import logging
import shlex
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hpctrain.launch.requeue import job_to_requeue

CHAIN_FILE = "chain.json"
log = logging.getLogger("hpctrain")


def write_chain(run_dir: str | Path, job_ids: Sequence[str]) -> Path:
    path = Path(run_dir) / CHAIN_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"jobs": [str(j) for j in job_ids]}))
    tmp.replace(path)
    return path


def read_chain(run_dir: str | Path) -> list[str]:
    try:
        return [str(j) for j in json.loads((Path(run_dir) / CHAIN_FILE).read_text())["jobs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def later_links(jobs: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The links after the one running here (pure); [] outside a chain or on its last link."""
    me = job_to_requeue(env)
    if me is None or me not in jobs:
        return []
    return list(jobs[jobs.index(me) + 1:])


def cancel(job_ids: Sequence[str]) -> bool:
    """Cancel the queued links (they have not started: afterany holds them)."""
    if not job_ids:
        return True
    proc = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scancel %s failed: %s", " ".join(job_ids), (proc.stderr or proc.stdout).strip())
    return proc.returncode == 0


def dependency(previous: Optional[str]) -> dict[str, str]:
    return {"dependency": f"afterany:{previous}"} if previous else {}


def chain_script(script: str | Path, links: int, run_dirs: Optional[Sequence[str | Path]] = None) -> str:
    """A shell script submitting `links` copies of the batch script `script`, each after the
    previous, and writing chain.json next to it (into every element's run directory for an array
    script, whose task i is element i). Pure."""
    script = Path(script)
    dirs = [Path(d) for d in run_dirs] if run_dirs is not None else [script.parent]
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"# Submits {links} jobs of {script.name}, each starting after the previous one ends, and writes",
             "# chain.json (the links' job ids) for the runs' supervisors. Written by `python -m hpctrain ...",
             "# launcher=sbatch launcher.chain=N`.",
             "set -euo pipefail",
             "ids=()",
             "prev=",
             f"for link in $(seq 1 {links}); do",
             f"  job=$(sbatch --parsable ${{prev:+--dependency=afterany:$prev}} {q(str(script))})",
             "  prev=${job%%;*}  # --parsable prints <id>[;<cluster>]",
             "  ids+=(\"$prev\")",
             "  echo \"submitted link $link of " + str(links) + ": job $prev\"",
             "done"]
    for i, d in enumerate(dirs):
        suffix = f"_{i}" if run_dirs is not None else ""
        lines.append(f"jobs=$(printf '\"%s{suffix}\",' \"${{ids[@]}}\")")
        lines.append(f"printf '{{\"jobs\": [%s]}}\\n' \"${{jobs%,}}\" > {q(str(d / CHAIN_FILE))}")
    return "\n".join(lines) + "\n"
