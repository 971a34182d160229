"""Putting a Slurm job back in the queue: after a collective preemption save (the supervisor does it
once every rank has saved and exited), or, with a node excluded, when too few nodes of the
allocation are left to go on (hpctrain.launch.supervise).

The requeued job runs the same batch script on the same run directory and resumes from the newest
complete checkpoint by itself. `cluster.max_requeues` bounds the loop: a job that keeps getting
preempted (or whose time limit is too short to make progress) stops instead of cycling forever.
"""
from __future__ import annotations

import logging
import subprocess
from typing import Mapping

from hpctrain.core.rundir import slurm_job

log = logging.getLogger("hpctrain")


def job_to_requeue(env: Mapping[str, str]) -> str | None:
    """`scontrol requeue` target: `<array job>_<task>` for an array task (requeueing the plain job id
    of a task would requeue the whole array), else the job id; None outside Slurm."""
    return slurm_job(env)


def requeue_decision(env: Mapping[str, str], max_requeues: int) -> tuple[str | None, str]:
    """(job id to requeue or None, why) — pure, for tests."""
    job = job_to_requeue(env)
    if job is None:
        return None, "not running under Slurm: rerun the same command to resume"
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts >= max_requeues:
        return None, (f"job {job} was already requeued {restarts} times (cluster.max_requeues={max_requeues}): "
                      "not requeueing again; resubmit to continue from the saved checkpoint")
    return job, f"requeueing job {job} (restart {restarts + 1} of at most {max_requeues})"


def exclude_nodes(env: Mapping[str, str], nodes: list[str]) -> bool:
    """Keep the job's next start off `nodes` (Slurm's ExcNodeList, as `sbatch --exclude` sets it)."""
    job = job_to_requeue(env)
    if job is None or not nodes:
        return False
    proc = subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scontrol update ExcNodeList failed: %s", (proc.stderr or proc.stdout).strip())
    return proc.returncode == 0


def requeue(env: Mapping[str, str], max_requeues: int) -> bool:
    job, why = requeue_decision(env, max_requeues)
    log.info("%s", why)
    if job is None:
        return False
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, (proc.stderr or proc.stdout).strip())
        return False
    return True
