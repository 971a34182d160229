"""Against the real single-machine Slurm (slurm/start.sh): a job requeued by hand saves collectively, goes back in the queue, resumes by itself and ends with the
same per-step losses as an uninterrupted run; a submitit job matches a local run of the same layout."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from hpctrain.train.metrics import read_metrics

from helpers import run_cli
from test_slurm_submit import rank_logs, wait_for

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

# 2 nodes x 1 task on cluster=local (ONE_PER_NODE; a rank costs seconds of CPU to start, and the tests
# here are about nodes: test_slurm_submit.py runs 2 tasks per node); the same 2-rank layout runs locally
# as the reference.
BASE = ["+experiment=tiny", "train.micro_batch=4", "optim.warmup_steps=5"]
ONE_PER_NODE = "cluster.tasks_per_node=1"


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


_REFERENCES: dict[int, list[float]] = {}  # steps -> losses: the Slurm tests run in one worker, one after another


def local_reference(tmp_path: Path, steps: int) -> list[float]:
    """Per-step losses of the same 2-rank layout on the local launcher, never interrupted (computed once
    per length: the requeue and the chain tests both compare with 60 steps)."""
    if steps not in _REFERENCES:
        d = tmp_path / "local"
        run_cli(*BASE, f"train.steps={steps}", "launcher.nproc=2", f"run.dir={d}", timeout=600)
        _REFERENCES[steps] = losses(d)
    return _REFERENCES[steps]


def submit_sbatch(run_dir: Path, *overrides: str, fault: str) -> str:
    # cluster.env reaches every task: the fault slows each step so that signals land mid-run.
    run_cli(*BASE, "cluster=local", ONE_PER_NODE, "launcher=sbatch", f"run.dir={run_dir}", *overrides,
            f"+cluster.env.HPCTRAIN_FAULT='{fault}'", timeout=60)
    script = run_dir / "job.sbatch"
    sub = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def restarts(job: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"Restarts=(\d+)", out)
    return int(m.group(1)) if m else -1


def slurm_log(run_dir: Path, job: str) -> str:
    """The supervisor's log (the batch script's), then every rank's."""
    p = run_dir / "logs" / f"slurm-{job}.out"
    return (p.read_text(errors="replace") if p.exists() else "") + "\n" + rank_logs(run_dir)


@pytest.mark.slurm
def test_manual_requeue_saves_resumes_and_matches(slurm, tmp_path):  # noqa: F811
    steps = 60
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, f"train.steps={steps}", fault="slow_step:ms=150")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= 15:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the job never reached step 15:\n" + slurm_log(run_dir, job)[-3000:])
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    state = wait_for(job, timeout_s=300)
    log = slurm_log(run_dir, job)
    assert state == "COMPLETED", log[-3000:]
    assert "saving step" in log and "resumed from checkpoint step" in log, log[-3000:]
    assert restarts(job) >= 1
    assert losses(run_dir) == local_reference(tmp_path, steps)


# The time limit's USR2 (save, then go on in the next job) is tested with job chains in
# test_slurm_sweep.py, which needs the same 3-minute job.
