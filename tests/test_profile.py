"""Profiling on request: profile.steps=[a,b] writes a loadable Chrome trace per rank of exactly steps
a..b; profile.memory=true adds the peak memory of each phase to metrics.jsonl; both are off by
default and then leave no trace; bad windows are refused on the login node. The Profiler and the
phase meter alone in process; the whole through the CLI with 2 ranks (slow)."""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctrain.core.compose import ConfigError, compose
from hpctrain.checks.config_checks import check, compose_checked
from hpctrain.core.rundir import read_jsonl
from hpctrain.train.preempt import Preemption
from hpctrain.train.profile import STEP_NAME, Profiler

from helpers import run_cli

TINY = "+experiment=tiny"
PHASES = ("forward", "backward", "optimizer", "checkpoint", "forward_backward")


def traced_steps(trace: Path) -> list[int]:
    """The optimizer steps a Chrome trace annotates (it must load as JSON and hold events)."""
    events = json.loads(trace.read_text())["traceEvents"]
    assert events
    return sorted(int(e["name"][len(STEP_NAME):]) for e in events
                  if str(e.get("name", "")).startswith(STEP_NAME))


# --- the Profiler alone, driven as the loop drives it ---------------------------------------------


def drive(run_dir: Path, window, steps, events: list | None = None) -> Path:
    """Steps `steps` as fit() runs them: begin(n), the step, end(n); close() after the loop."""
    p = Profiler(SimpleNamespace(steps=list(window)), run_dir, rank=1, device=torch.device("cpu"),
                 event=None if events is None else events.append)
    x = torch.ones(64, 64)
    for n in steps:
        p.begin(n)
        x = x @ x / 64  # something to record
        p.end(n)
    p.close()
    return run_dir / "profile"


def test_exactly_the_window_is_traced(tmp_path):
    events: list = []
    out = drive(tmp_path, (3, 4), range(1, 7), events=events)
    assert [p.name for p in out.iterdir()] == ["steps-3-4"]
    assert sorted(p.name for p in (out / "steps-3-4").iterdir()) == ["rank-1.json"]  # no temporary left
    assert traced_steps(out / "steps-3-4" / "rank-1.json") == [3, 4]
    assert len(events) == 1 and "steps 3-4" in events[0] and str(out / "steps-3-4") in events[0]
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped after the window


def test_a_one_step_window_and_the_last_step(tmp_path):
    out = drive(tmp_path, (6, 6), range(1, 7))
    assert traced_steps(out / "steps-6-6" / "rank-1.json") == [6]


def test_resumed_after_the_window_traces_nothing(tmp_path):
    assert not drive(tmp_path, (3, 4), range(5, 7)).exists()


def test_resumed_inside_the_window_traces_the_rest(tmp_path):
    out = drive(tmp_path, (3, 4), range(4, 7))
    assert [p.name for p in out.iterdir()] == ["steps-4-4"]
    assert traced_steps(out / "steps-4-4" / "rank-1.json") == [4]


def test_preempted_inside_the_window_writes_what_it_recorded(tmp_path):
    # Steps 1..3 run; the loop leaves after step 3 without end(3) (the preemption break), then close().
    p = Profiler(SimpleNamespace(steps=[3, 5]), tmp_path, rank=0, device=torch.device("cpu"))
    for n in range(1, 4):
        p.begin(n)
        if n < 3:
            p.end(n)
    p.close()
    assert traced_steps(tmp_path / "profile" / "steps-3-3" / "rank-0.json") == [3]


def test_a_failed_run_stops_profiling_and_writes_nothing(tmp_path):
    p = Profiler(SimpleNamespace(steps=[3, 5]), tmp_path, rank=0, device=torch.device("cpu"))
    p.begin(3)
    p.close(export=False)
    assert not (tmp_path / "profile").exists()
    assert not torch.autograd.profiler._is_profiler_enabled


# --- the phase meter alone ------------------------------------------------------------------------


PHASE_SCRIPT = """
import torch
from hpctrain.train.profile import PhaseMemory

m = PhaseMemory(torch.device("cpu"))
m.begin_step()
big = 96 << 20
with m.phase("forward"):
    x = torch.ones(big // 4)  # touched: resident
del x
with m.phase("backward"):
    torch.ones(1 << 10)
with m.phase("forward"):  # a second micro-batch, smaller: the phase keeps its largest peak
    pass
v = m.take()
assert set(v) == {"mem_forward_bytes", "mem_backward_bytes"}, v
assert min(v.values()) > 0
assert v["mem_forward_bytes"] - v["mem_backward_bytes"] > big // 2, v  # the counter was reset between
assert m.peak_since_start() >= v["mem_forward_bytes"]  # mem_bytes keeps the run's peak
m.begin_step()
assert m.take() == {}
print("PHASES_OK")
"""


@pytest.mark.slow
def test_phase_peaks_are_per_phase_and_the_overall_peak_survives():
    # A fresh process: in a long-lived one (the test session), freed heap pages may hold the tensor
    # without the resident set growing, and the process's peak is whatever came before.
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PHASE_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "PHASES_OK" in proc.stdout, proc.stdout + proc.stderr


# --- fit() in process, one rank: preempted inside the window, then resumed ----------------------


class StopAt(Preemption):
    """A preemption request that arrives during step `step`, as a signal would."""

    def __init__(self, step: int, trainer):
        super().__init__()
        self.step, self.trainer = step, trainer

    def agreed(self, device=None, group=None) -> bool:
        self.requested_by = "test" if self.trainer.step == self.step else None
        return super().agreed(device, group)


@pytest.mark.slow
def test_fit_preempted_inside_the_window_then_resumed(world_of_one, tmp_path):
    from hpctrain.train.loop import Trainer

    def trainer():
        cfg = compose([TINY, "launcher.nproc=1", "train.global_batch=4", "train.micro_batch=2", "data.seq_len=16",
                       "train.steps=6", "checkpoint.every=0", "profile.steps=[2,5]", "profile.memory=true",
                       f"run.dir={tmp_path}"])
        return Trainer.of(cfg, str(tmp_path), torch.device("cpu"))

    t = trainer()
    first = t.fit(StopAt(3, t))
    assert (first.status, first.step) == ("preempted", 3)
    assert traced_steps(tmp_path / "profile" / "steps-2-3" / "rank-0.json") == [2, 3]
    assert trainer().fit().status == "completed"
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["steps-2-3", "steps-4-5"]
    assert traced_steps(tmp_path / "profile" / "steps-4-5" / "rank-0.json") == [4, 5]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["mem_forward_bytes"] > 0 and r["mem_backward_bytes"] > 0 for r in rows)
    # checkpoint.every=0: the saves are the preemption's and the last step's (checkpoint.final), each
    # measured with its step
    assert [r["step"] for r in rows if "mem_checkpoint_bytes" in r] == [3, 6]


# --- refused on the login node --------------------------------------------------------------------


@pytest.mark.parametrize("steps, expected", [
    ("[5,2]", "the first step must be at least 1 and at most the last"),
    ("[1]", "must name two steps"),
    ("[1,2,3]", "must name two steps"),
    ("[0,3]", "the first step must be at least 1"),
    ("[3,7]", "goes past the run's last step, train.steps=6"),
])
def test_bad_windows_are_refused_with_a_fix(steps, expected):
    with pytest.raises(ConfigError) as info:
        check(*compose_checked([TINY, "train.steps=6", f"profile.steps={steps}"]))
    msg = str(info.value)
    assert f"profile.steps={steps}" in msg and expected in msg
    assert "Fix: profile.steps=[first,last] with 1 <= first <= last <= train.steps=6" in msg


@pytest.mark.parametrize("steps", ["[]", "[1,6]", "[6,6]", "[1,1]"])
def test_windows_inside_the_run_pass(steps):
    cfg = compose([TINY, "train.steps=6", f"profile.steps={steps}"])
    check(cfg)
    assert cfg.profile.memory is False  # off by default


@pytest.mark.slow
def test_cli_refuses_a_reversed_window_with_exit_2(tmp_path):
    proc = run_cli(TINY, "profile.steps=[5,2]", "dry_run=true", f"run.dir={tmp_path / 'run'}", check=False,
                   timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("hpctrain: error: ")
    assert "profile.steps=[5,2]" in proc.stderr and "Fix: profile.steps=[" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


# --- through the CLI, 2 ranks ---------------------------------------------------------------------

COMMON = (TINY, "train.steps=6", "checkpoint.every=3")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiled")
    proc = run_cli(*COMMON, "profile.steps=[3,4]", "profile.memory=true", f"run.dir={d}")
    return d, proc


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    run_cli(*COMMON, f"run.dir={d}")
    return d


@pytest.mark.slow
def test_a_trace_per_rank_of_exactly_the_requested_steps(profiled):
    d, proc = profiled
    assert [p.name for p in (d / "profile").iterdir()] == ["steps-3-4"]
    files = sorted(p.name for p in (d / "profile" / "steps-3-4").iterdir())
    assert files == ["rank-0.json", "rank-1.json"]  # CPU: no CUDA memory snapshot
    for name in files:
        assert traced_steps(d / "profile" / "steps-3-4" / name) == [3, 4], name
    assert len(re.findall(r"profile: steps 3-4 traced into \S*steps-3-4", proc.stdout)) == 1


@pytest.mark.slow
def test_memory_per_phase_in_every_row(profiled):
    rows = read_jsonl(profiled[0] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        for phase in ("forward", "backward", "optimizer"):
            assert r[f"mem_{phase}_bytes"] > 0, r
        assert "mem_forward_backward_bytes" not in r  # only pipeline-parallel runs have that phase
        # The counters are reset for every phase; mem_bytes still is the run's peak so far.
        assert r["mem_bytes"] >= max(r[f"mem_{p}_bytes"] for p in PHASES if f"mem_{p}_bytes" in r), r
    assert [r["mem_bytes"] for r in rows] == sorted(r["mem_bytes"] for r in rows)
    # checkpoint.every=3: saves after step 3 and at the end (step 6), and only there.
    assert [r["step"] for r in rows if "mem_checkpoint_bytes" in r] == [3, 6]
    assert all(r["mem_checkpoint_bytes"] > 0 for r in rows if "mem_checkpoint_bytes" in r)


@pytest.mark.slow
def test_off_by_default_leaves_no_trace_and_changes_nothing(plain, profiled):
    assert not (plain / "profile").exists()
    rows = read_jsonl(plain / "metrics.jsonl")
    assert rows and not [k for r in rows for k in r if k.startswith("mem_") and k != "mem_bytes"]
    # Profiling and measuring do not change the training.
    assert [r["loss"] for r in rows] == [r["loss"] for r in read_jsonl(profiled[0] / "metrics.jsonl")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: nothing to check here")
def test_on_a_gpu_kernels_in_the_trace_a_memory_snapshot_and_allocator_peaks(tmp_path):
    run_cli(TINY, "cluster=h200", "launcher=local", "launcher.nproc=1", "cluster.device=cuda", "train.steps=4",
            "checkpoint.every=2", "profile.steps=[2,3]", "profile.memory=true", f"run.dir={tmp_path}", timeout=600)
    d = tmp_path / "profile" / "steps-2-3"
    assert sorted(p.name for p in d.iterdir()) == ["rank-0-memory.pickle", "rank-0.json"]
    assert traced_steps(d / "rank-0.json") == [2, 3]
    events = json.loads((d / "rank-0.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity, not only the CPU side
    snapshot = pickle.loads((d / "rank-0-memory.pickle").read_bytes())  # what pytorch.org/memory_viz reads
    assert snapshot["segments"] and any(snapshot["device_traces"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for r in rows:
        assert 0 < r["mem_forward_bytes"] <= r["mem_bytes"] and 0 < r["mem_optimizer_bytes"] <= r["mem_bytes"], r
    assert [r["step"] for r in rows if "mem_checkpoint_bytes" in r] == [2, 4]
