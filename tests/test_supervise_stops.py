"""A person's Ctrl-C is its own cause ("stopped"), not a preemption, and goodput does not charge the time until
they start the run again. The runner starts nothing (no ranks): this runs in the quick loop."""
from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.core.rundir import prepare_run_dir, read_jsonl, write_outcome
from hpctrain.launch.local import Ended
from hpctrain.launch.supervise import Supervisor
from hpctrain.report.goodput import measure, report


class Runner:
    """Ranks that save at step 3 and stop, as they do when the launcher passes on `signum`."""

    def __init__(self, run_dir: Path, signum: int, saved: bool = True):
        self.run_dir, self.signum, self.saved = run_dir, signum, saved

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, attempt, nodes, env, poll) -> Ended:
        if self.saved:
            write_outcome(self.run_dir, {"status": "preempted", "step": 3, "checkpoint": "step-00000003"})
            return Ended(rc=0, interrupted=self.signum)
        return Ended(rc=130, failed={0: "exit code 130"}, first=0, interrupted=self.signum)

    def probe(self, nodes):
        return []

    def log_tail(self, rank, lines=20):
        return "above", ""


def causes(tmp_path: Path, signum: int, saved: bool = True) -> list[dict]:
    d = prepare_run_dir(compose(["+experiment=tiny", f"run.dir={tmp_path / 'run'}"]))
    Supervisor(d, Runner(d, signum, saved), slurm=False).run()
    return read_jsonl(d / "interruptions.jsonl")


@pytest.mark.parametrize("saved", [True, False])
def test_ctrl_c_is_recorded_as_a_stop_not_a_preemption(tmp_path, saved):
    """Mutant: a saved Ctrl-C recorded as "preempted" (as before); an unsaved one not recorded at all."""
    [rec] = causes(tmp_path, signal.SIGINT, saved)
    assert rec["cause"] == "stopped"
    assert ("Ctrl-C (SIGINT)" if saved else "SIGINT to the launcher") in rec["detail"]


def test_sigterm_that_saved_is_still_a_preemption(tmp_path):
    """scancel, a preemption, a time limit: the scheduler's SIGTERM stays "preempted"."""
    assert [r["cause"] for r in causes(tmp_path, signal.SIGTERM)] == ["preempted"]


def write_run(d: Path, interruption: dict) -> None:
    attempts = [{"attempt": 0, "start": 100.0, "end": 130.0, "rc": 0}, {"attempt": 1, "start": 1130.0, "end": 1160.0, "rc": 0}]
    metrics = [{"step": s, "step_time_s": 1.0, "time": 100.0 + s} for s in range(1, 41)]
    (d / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "interruptions.jsonl").write_text(json.dumps(interruption) + "\n")


def test_goodput_leaves_out_the_time_a_person_kept_the_run_stopped(tmp_path):
    """Stopped at 130 s, started again 1,000 s later: the wall time is the 60 s the run ran. Mutant: the
    old measure (wall 1,060 s, the 1,005 s to the next step charged as lost: goodput 3.8%)."""
    stop = {"cause": "stopped", "detail": "Ctrl-C (SIGINT) to the launcher: saved at step 30", "steps_redone": 0,
            "failed_at": 130.0, "time": 130.5, "restarted_at": 1130.0, "first_step_at": 1135.0, "recover_s": 1005.0}
    write_run(tmp_path, stop)
    g = measure(tmp_path)
    assert (g.wall_s, g.paused_s, g.lost_s, g.productive_s) == (60.0, 1000.0, 0.0, 40.0)
    assert g.goodput == pytest.approx(40 / 60)
    assert "not counted: 1000.0 s stopped by a person" in report(g)
    # The same gap after a preemption is the scheduler's doing: it stays in the wall time.
    write_run(tmp_path, {**stop, "cause": "preempted"})
    assert measure(tmp_path).wall_s == 1060.0
