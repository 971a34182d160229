"""The supervisor on this machine (launcher=local, 2 ranks): a crashed rank, a hung rank and a failure
that repeats itself, as a user meets them through the CLI. The Slurm versions (a killed rank, a
stopped rank, a lost node, an unhealthy node) are in test_slurm_faults.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.core.rundir import list_complete, read_jsonl

from helpers import REPO, run_cli, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

COMMON = ("+experiment=tiny", "train.steps=8", "checkpoint.every=4", "optim.warmup_steps=2")


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    d = tmp_path_factory.mktemp("uninterrupted")
    run_cli(*COMMON, f"run.dir={d}")
    return losses(d)


def test_crashed_then_hung_rank_restarts_by_itself_bit_for_bit(tmp_path, uninterrupted):
    """One run, two failures (one launcher and three starts instead of two launchers and four starts; each
    failure is checked as when it had a run of its own). Rank 1 segfaults after step 6: it leaves its stack
    in its log (mutant: no faulthandler in the rank entry), the launcher says whom it stopped. The restart
    (attempt 1, from step 4) hangs on rank 1 at step 6: the watchdogs name it with every stack, and the second
    restart finishes. The losses match the uninterrupted run's to the last bit."""
    proc = run_cli(*COMMON, f"run.dir={tmp_path}", "launcher.hang_timeout_s=3",
                   env={"HPCTRAIN_FAULT": "crash:step=6,rank=1,signal=SEGV;hang:step=6,rank=1,attempt=1"})
    assert "crashed: rank 1 was killed by SIGSEGV" in proc.stderr and "completed at step 8" in proc.stderr, \
        proc.stderr[-3000:]
    log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log and "after_step" in log and "loop.py" in log, log[-3000:]
    assert losses(tmp_path) == uninterrupted  # resumed from step 4 twice, the same numbers to the last bit
    crashed, hung = read_jsonl(tmp_path / "interruptions.jsonl")
    assert (crashed["cause"], crashed["ranks"], crashed["checkpoint_step"]) == ("crashed", [1], 4), crashed
    assert crashed["steps_redone"] >= 1 and crashed["recover_s"] > 0 and crashed["first_step_at"] > crashed["restarted_at"]
    attempts = read_jsonl(tmp_path / "attempts.jsonl")
    assert len(attempts) == 3 and attempts[0]["rc"] == 128 + 11 and attempts[-1]["rc"] == 0, attempts

    assert (hung["cause"], hung["ranks"]) == ("hung", [1]), hung
    assert "rank(s) 1 had not reached collective" in hung["detail"] and "at step 6" in hung["detail"]
    hang = tmp_path / "attempts" / "1"
    # Found by the watchdogs with the configured silence (not by a collective timing out much later:
    # that would be an error on some rank, not a report from each).
    for r in (0, 1):
        report = json.loads((hang / f"hang-rank-{r}.json").read_text())
        assert report["timeout_s"] == 3.0 and report["silent_s"] >= 3.0
    for r in (0, 1):
        assert "no progress" in (hang / f"stacks-rank-{r}.txt").read_text()
    # The stuck rank's stack shows where it is stuck; the other waits in a collective.
    assert "faults.py" in (hang / "stacks-rank-1.txt").read_text()
    assert "distributed" in (hang / "stacks-rank-0.txt").read_text()
    assert json.loads((hang / "hang-rank-0.json").read_text())["collectives"]["world"] > \
        json.loads((hang / "hang-rank-1.json").read_text())["collectives"]["world"]


def test_a_failure_that_repeats_stops_with_its_rank_and_log(tmp_path):
    proc = run_cli(*COMMON, f"run.dir={tmp_path}", check=False, env={"HPCTRAIN_FAULT": "raise:step=3,rank=1"})
    assert proc.returncode == 1
    err = proc.stderr
    assert "the run failed the same way twice in a row (crashed); not restarting" in err
    assert "rank 1: RuntimeError: injected failure at step 3 on rank 1" in err
    assert f"its log: {tmp_path / 'logs' / 'rank-1.log'}" in err and "Traceback" in err.split("its log:")[-1]
    assert [r["attempt"] for r in read_jsonl(tmp_path / "interruptions.jsonl")] == [0, 1]


def test_max_restarts_zero_stops_at_the_first_failure(tmp_path):
    proc = run_cli(*COMMON, f"run.dir={tmp_path}", "launcher.max_restarts=0", check=False,
                   env={"HPCTRAIN_FAULT": "crash:step=6,rank=1"})
    assert proc.returncode == 1 and "0 restart(s) used up (launcher.max_restarts=0)" in proc.stderr
    assert [a["rc"] for a in read_jsonl(tmp_path / "attempts.jsonl")] == [128 + 9]
    echo = tmp_path / "attempts" / "0" / "error-rank-0.json"
    if echo.exists():  # rank 0 saw its peer go before the launcher stopped it (not always: a race)
        # One line on the terminal, before the supervisor's verdict; the whole traceback in the report.
        # Mutant: the old traceback.print_exc() for every error.
        assert "a peer rank went away" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert json.loads(echo.read_text())["traceback"][0].startswith("Traceback (most recent call last)")


def test_a_second_ctrl_c_stops_at_once_without_a_traceback_and_is_recorded(tmp_path):
    """Ctrl-C twice, as a person who will not wait for the save: SIGINT to the launcher (the process this
    test started, by its pid) once a step is logged, then again once the launcher has passed the first on,
    then a third. Steps of 1.5 s (slow_step) keep the ranks from reaching the save the first asked for.
    The ranks stop at once; the launcher says so once; no traceback; interruptions.jsonl has the stop.
    Mutant: the old launcher, which passed the second SIGINT on like the first (said twice; each rank
    raised KeyboardInterrupt, rank 0's traceback on the terminal)."""
    run, out, err = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCTRAIN_FAULT="slow_step:ms=1500")
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "+experiment=tiny", "train.steps=100",
                                 f"run.dir={run}"], cwd=REPO, env=env, stdout=o, stderr=e)
    try:
        wait_until(lambda: proc.poll() is not None or (run / "metrics.jsonl").exists()
                   and (run / "metrics.jsonl").read_text().strip(), "a logged step", timeout_s=300)
        assert proc.poll() is None, err.read_text()[-3000:]
        os.kill(proc.pid, signal.SIGINT)
        wait_until(lambda: proc.poll() is not None or "passing SIGINT" in err.read_text(),
                   "the launcher passing the first Ctrl-C on", timeout_s=60)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.2)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = out.read_text() + err.read_text()
    assert rc == 130, said[-3000:]
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert said.count("passing SIGINT") == 1
    assert said.count("hpctrain: second Ctrl-C (SIGINT): stopping rank(s) 0, 1 now, without saving") == 1, said[-3000:]
    (rec,) = read_jsonl(run / "interruptions.jsonl")
    assert rec["cause"] == "stopped" and "second Ctrl-C" in rec["detail"], rec
    assert list_complete(run / "checkpoints") == []  # it did not wait for the save
    assert "no checkpoint was written before the run ended" in said  # the summary of a run that ends so
    # No rank wrote an outcome (killed at once): the supervisor's says how it ended, with the summary.
    # Mutant: the summary written only into an outcome a rank left (none here).
    outcome = json.loads((run / "outcome.json").read_text())
    assert outcome["status"] == "stopped" and outcome["summary"]["checkpoint"] is None, outcome
    assert "nothing was saved yet: the same command starts again from step 1" in said, said[-3000:]
