"""Recovery from peers' memory on the real single-machine Slurm (issue 47): node agents, memory
snapshots replicated to the next node, survivors that keep their process, and a spare node that takes a
lost node's place inside the same job. 3 emulated nodes (each with its own tmpfs at /dev/shm, as a
machine has its own RAM: slurm/start.sh), one rank per node, launcher=sbatch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from hpctrain.core.rundir import read_jsonl

from helpers import REPO
from test_slurm_faults import finished, reach
from test_slurm_requeue import losses, local_reference, slurm_log, submit_sbatch

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
STEPS = 40
SLOW = "slow_step:ms=100"


@pytest.fixture(scope="module")
def three_nodes(slurm):
    """slurm/start.sh 3 for this module (a node a test kills comes back with the next start), then the
    2 nodes the other Slurm tests use."""
    def start(n: int) -> None:
        proc = subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), str(n)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    start(3)
    yield start
    start(2)


def kill_node(*nodes: str) -> None:
    subprocess.run(["bash", str(REPO / "slurm" / "kill_node.sh"), *nodes], check=True, timeout=60)


def records_of_job(job: str) -> list[str]:
    """sacct's records of the job with its duplicates (-D): a requeued job has one per start. (A RESIZING
    row is Slurm's record of the allocation shrinking once the lost node is marked down, SlurmdTimeout
    after its loss, the job running on: not a start.)"""
    rows = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "JobID,State"], capture_output=True,
                          text=True, timeout=30).stdout.split()
    return [r for r in rows if not r.endswith("|RESIZING")]


def newest_ranks(run_dir: Path) -> dict:
    """The newest generation's ranks.json (hosts and pids)."""
    gens = sorted(int(p.name) for p in (run_dir / "attempts").iterdir() if p.name.isdigit()
                  and (p / "ranks.json").exists())
    return json.loads((run_dir / "attempts" / str(gens[-1]) / "ranks.json").read_text())


def test_crash_stop_and_lost_node_restore_from_memory_with_a_spare(three_nodes, tmp_path):
    """2 nodes train, n3 waits as a spare. kill -9 of rank 1 at step 8, SIGSTOP of rank 1 at step 16,
    n2 lost at step 24: each restored from the newest memory snapshot (the last from n1's replica of
    rank 1, on the spare n3), at most one step redone each, the survivor (rank 0) in the same process
    all along, the job never requeued, and the losses those of an uninterrupted run, bit for bit."""
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, f"train.steps={STEPS}", "checkpoint.every=10", "checkpoint.memory_every=1",
                        "cluster.spare_nodes=1", "launcher.hang_timeout_s=3", fault=SLOW)
    try:
        first = reach(run_dir, job, 8)
        os.kill(first["pids"]["1"], signal.SIGKILL)  # rank 1, on n2
        reach(run_dir, job, 16, attempt=1)
        stopped = newest_ranks(run_dir)["pids"]["1"]
        os.kill(stopped, signal.SIGSTOP)
        reach(run_dir, job, 24, attempt=2)
        kill_node("n2")
        records = finished(run_dir, job)
    finally:
        subprocess.run(["scancel", job], timeout=30)
        three_nodes(3)  # n2 back for the next test
    log = slurm_log(run_dir, job)
    assert [r["cause"] for r in records] == ["crashed", "hung", "node_lost"], log[-4000:]
    for rec in records:
        assert rec["restored_from"]["kind"] == "memory", rec
        assert rec["steps_redone"] <= 1, rec
    assert records[0]["ranks"] == [1] and records[1]["ranks"] == [1], records
    lost = records[2]
    assert lost["nodes"] == ["n2"] and lost["replaced"] == {"n2": "n3"}, lost
    assert lost["restored_from"]["source"] == {"0": "own", "1": "n1"}, lost
    assert "restored step" in log and "rank 1 from the replica on n1" in log
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    assert attempts[-1]["nodes"] == ["n1", "n3"] and attempts[-1]["world"] == 2, attempts
    # rank 0 (n1) survived every failure in its process: one pid in every generation
    pids = {json.loads((run_dir / "attempts" / str(a["attempt"]) / "ranks.json").read_text())["pids"]["0"]
            for a in attempts}
    assert len(pids) == 1, pids
    assert records_of_job(job) == [f"{job}|COMPLETED"]  # never requeued
    assert losses(run_dir) == local_reference(tmp_path, STEPS)


def test_a_node_and_its_replica_partner_lost_fall_back_to_disk(three_nodes, tmp_path):
    """3 nodes train (ring n1 -> n2 -> n3 -> n1: rank 1's replica is on n3); n2 and n3 die together, so
    both copies of rank 1's snapshot are gone: the run goes on on n1 from the disk checkpoint, and says
    why."""
    run_dir = tmp_path / "run"
    job = submit_sbatch(run_dir, "train.steps=24", "train.global_batch=12", "checkpoint.every=5",
                        "checkpoint.memory_every=1", "cluster.nodes=3", fault=SLOW)
    try:
        reach(run_dir, job, 12)
        kill_node("n2", "n3")  # one kill: both nodes die at once
        (rec,) = finished(run_dir, job, steps=24)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    assert rec["cause"] == "node_lost" and rec["nodes"] == ["n2", "n3"], rec
    got = rec["restored_from"]
    assert got["kind"] == "disk" and got["step"] == 10, got
    assert "rank 1's snapshots were on n2 (own) and n3 (replica), both lost" in got["why"], got
    assert "from disk" in slurm_log(run_dir, job)
    assert read_jsonl(run_dir / "attempts.jsonl")[-1]["nodes"] == ["n1"]
