"""Unplanned failures on the real single-machine Slurm (2 emulated nodes x 1 rank, launcher=sbatch):
a rank killed with SIGKILL, a rank stopped with SIGSTOP, a node lost with everything on it, a node
unhealthy at start, and a failure that repeats itself. Each job must end by itself, without a new
submission; where nothing changed the layout, its per-step losses equal an uninterrupted run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hpctrain.core.rundir import read_jsonl

from helpers import REPO, run_cli, wait_until
from test_slurm_requeue import BASE, losses, slurm_log, submit_sbatch
from test_slurm_submit import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
STEPS = 40
RUN = (f"train.steps={STEPS}", "checkpoint.every=10")
SLOW = "slow_step:ms=100"  # long enough a run to be hit mid-way


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The same 2-rank layout, on the local launcher, never interrupted."""
    d = tmp_path_factory.mktemp("uninterrupted")
    run_cli(*BASE, *RUN, "launcher.nproc=2", f"run.dir={d}", timeout=600)
    return losses(d)


def reach(run_dir: Path, job: str, step: int, attempt: int = 0) -> dict:
    """Wait until the run logged `step`; returns the attempt's ranks.json (hosts and pids)."""
    def there():
        rows = read_jsonl(run_dir / "metrics.jsonl")
        return bool(rows) and rows[-1]["step"] >= step and (run_dir / "attempts" / str(attempt) / "ranks.json").exists()
    try:
        wait_until(there, f"job {job} reaching step {step} in attempt {attempt}", timeout_s=240, poll_s=0.2)
    except AssertionError:
        subprocess.run(["scancel", job], timeout=30)
        raise AssertionError(slurm_log(run_dir, job)[-3000:]) from None
    return json.loads((run_dir / "attempts" / str(attempt) / "ranks.json").read_text())


def finished(run_dir: Path, job: str, steps: int = STEPS) -> list[dict]:
    state = wait_for(job, timeout_s=600)
    log = slurm_log(run_dir, job)
    assert state == "COMPLETED", log[-4000:]
    assert f"completed at step {steps}" in log, log[-4000:]
    return read_jsonl(run_dir / "interruptions.jsonl")


def test_killed_then_stopped_rank_restart_in_the_job_bit_for_bit(slurm, tmp_path, uninterrupted):
    """One job, two failures (one submission and one start instead of two of each; each failure is checked
    as when it had a job of its own): kill -9 of rank 1 at step 15, which the job restarts by itself from
    step 10's checkpoint; then SIGSTOP of rank 1 of the restarted ranks at step 25: the others' watchdogs
    fire, the stopped rank is named by its silence, and the job restarts again from step 20. Both losses
    runs together equal the uninterrupted run's bit for bit. (The watchdog's 8 s does not name the crash:
    a killed rank is seen by its exit, before any silence is long enough.)"""
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, *RUN, "launcher.hang_timeout_s=8", fault=SLOW)
    ranks = reach(run_dir, job, 15)
    os.kill(ranks["pids"]["1"], signal.SIGKILL)  # rank 1, on n2
    ranks = reach(run_dir, job, 25, attempt=1)
    os.kill(ranks["pids"]["1"], signal.SIGSTOP)  # rank 1 of the restarted ranks, on n2
    crashed, hung = finished(run_dir, job)
    assert (crashed["cause"], crashed["ranks"], crashed["nodes"]) == ("crashed", [1], ["n2"]), crashed
    assert crashed["checkpoint_step"] == 10 and crashed["recover_s"] is not None
    assert (hung["cause"], hung["ranks"], hung["nodes"]) == ("hung", [1], ["n2"]), hung
    # Named by its silence, or, when Slurm's SIGCONT before killing the step wakes it in time to
    # report, as the rank behind the others.
    assert "rank(s) 1 wrote no report (stopped or dead)" in hung["detail"] or \
        "rank(s) 1 had not reached collective" in hung["detail"], hung
    hang = run_dir / "attempts" / "1"
    stacks = {p.name for p in hang.glob("stacks-rank-*.txt")}
    assert "stacks-rank-0.txt" in stacks
    assert all(json.loads(p.read_text())["timeout_s"] == 8.0 for p in hang.glob("hang-rank-*.json"))
    assert losses(run_dir) == uninterrupted


def test_lost_node_run_finishes_on_the_rest(slurm, tmp_path, uninterrupted):
    """Node n2 dies with everything on it: the run goes on on n1 with half the data-parallel ranks (one)
    and the same global batch, so the losses stay with the uninterrupted run's."""
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, *RUN, fault=SLOW)
    reach(run_dir, job, 15)
    try:
        subprocess.run(["bash", str(REPO / "slurm" / "kill_node.sh"), "n2"], check=True, timeout=30)
        (rec,) = finished(run_dir, job)
    finally:
        subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), "2"], capture_output=True, timeout=300)
    assert (rec["cause"], rec["nodes"]) == ("node_lost", ["n2"]), rec
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    assert [(a["nodes"], a["world"]) for a in attempts] == [(["n1", "n2"], 2), (["n1"], 1)]
    got = losses(run_dir)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, uninterrupted), 1):
        assert abs(a - b) <= 1e-4, (step, a, b)


def test_unhealthy_node_at_start_is_left_out(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, "train.steps=6", fault="unhealthy:node=n2")
    (rec,) = finished(run_dir, job, steps=6)
    assert (rec["cause"], rec["nodes"]) == ("unhealthy", ["n2"]), rec
    assert "x the median node's" in rec["detail"]
    assert [a["nodes"] for a in read_jsonl(run_dir / "attempts.jsonl")] == [["n1", "n2"], ["n1"]]


def test_a_failure_that_repeats_ends_the_job(slurm, tmp_path):
    """An error that a restart cannot cure (here injected at step 3 on rank 1 in every attempt)."""
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, "train.steps=6", fault="raise:step=3,rank=1")
    state = wait_for(job, timeout_s=300)
    log = slurm_log(run_dir, job)
    assert state == "FAILED", log[-3000:]
    assert "the run failed the same way twice in a row (crashed); not restarting" in log
    assert "rank 1: RuntimeError: injected failure at step 3 on rank 1" in log
    assert f"its log: {run_dir / 'logs' / 'rank-1.log'}" in log
    assert [r["attempt"] for r in read_jsonl(run_dir / "interruptions.jsonl")] == [0, 1]
