"""The supervisor checks the run's config.yaml again before every start (a person may edit it between
restarts), with a runner that starts nothing: no ranks, so it runs in the quick loop."""
from __future__ import annotations

import socket
from pathlib import Path

import yaml

from hpctrain.core.compose import compose
from hpctrain.core.rundir import prepare_run_dir
from hpctrain.launch.local import Ended
from hpctrain.launch.supervise import Supervisor, supervise


class Runner:
    """Each start "crashes" rank 1 after `edit` has changed config.yaml, as a person would."""

    def __init__(self, run_dir: Path, edit=None):
        self.run_dir, self.edit, self.starts = run_dir, edit, []

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, attempt, nodes, env, poll) -> Ended:
        self.starts.append(attempt)
        if self.edit:
            self.edit(self.run_dir / "config.yaml")
        return Ended(rc=137, failed={1: "killed by SIGKILL"}, first=1)

    def probe(self, nodes):
        return []

    def log_tail(self, rank, lines=20):
        return "above", ""


def run_dir(tmp_path: Path) -> Path:
    return prepare_run_dir(compose(["+experiment=tiny", f"run.dir={tmp_path / 'run'}", "launcher.max_restarts=3"]))


def set_lr(path: Path, value) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["optim"]["lr"] = value
    path.write_text(yaml.safe_dump(doc))


def negative_lr(path: Path) -> None:
    set_lr(path, -0.001)


def test_an_edit_between_restarts_stops_before_the_next_start(tmp_path, capsys):
    """Mutant: checking config.yaml only once, when the supervisor starts (the bad value reaches every
    rank of the second start, which crashed twice in the review)."""
    d = run_dir(tmp_path)
    runner = Runner(d, edit=negative_lr)
    assert Supervisor(d, runner, slurm=False).run() == 2
    assert runner.starts == [0]  # the crash of start 1 is not followed by a start with lr < 0
    err = capsys.readouterr().err
    assert f"{d / 'config.yaml'}" in err and "optim.lr=-0.001 must be positive" in err and "Fix" in err, err


def test_a_config_that_no_longer_loads_is_a_message(tmp_path, capsys):
    """A type the schema refuses, written into config.yaml before the supervisor starts: a message, no
    traceback. Mutant: supervise() without its ConfigError handler."""
    d = run_dir(tmp_path)
    set_lr(d / "config.yaml", "fast")
    assert supervise(d) == 2  # (a run that started would take a minute and return 0)
    err = capsys.readouterr().err
    assert err.startswith("hpctrain: error: ") and "config.yaml" in err and "optim.lr" in err, err


def test_an_unedited_config_starts_again_after_a_crash(tmp_path):
    d = run_dir(tmp_path)
    runner = Runner(d)
    Supervisor(d, runner, slurm=False).run()
    assert runner.starts[:2] == [0, 1]
