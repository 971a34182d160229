"""Unplanned failures, the pure parts: classifying what the ranks left behind, srun's report, the
health verdict, stragglers, fault selection, shrinking a run onto fewer nodes, the watchdog."""
from __future__ import annotations

import json
import time

import pytest

from hpctrain.core import faults
from hpctrain.core.compose import ConfigError, compose
from hpctrain.plan.elastic import micro_batch_for, shrink
from hpctrain.launch.failures import classify, read_reports, srun_failures

HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


def reports(**kw) -> dict:
    return {"hosts": dict(HOSTS), "health": None, "hangs": {}, "errors": {}, **kw}


def hang_report(rank: int, world_seq: int, step: int = 7, at: float = 100.0) -> dict:
    return {"rank": rank, "host": HOSTS[rank], "step": step, "phase": "step", "silent_s": 10.0, "time": at,
            "collectives": {"world": world_seq}}


# --- classify -------------------------------------------------------------------------------------

def test_unhealthy_node_wins():
    r = reports(health={"unhealthy": {"n2": "compute kernel 40 ms, 10.0x the median node's 4 ms"}, "time": 5.0})
    f = classify(r, {0: "exit code 76", 1: "exit code 76"}, 4, [], None)
    assert (f.cause, f.nodes, f.ranks) == ("unhealthy", ["n2"], [2, 3])
    assert "10.0x" in f.detail


def test_lost_node():
    f = classify(reports(), {0: "exit code 1"}, 4, ["n2"], 50.0)
    assert (f.cause, f.nodes, f.ranks, f.failed_at) == ("node_lost", ["n2"], [2, 3], 50.0)


def test_hang_blames_the_silent_rank():
    """A stopped rank (SIGSTOP) writes nothing; the others report from inside the collective."""
    hangs = {r: hang_report(r, 128) for r in (0, 1, 3)}
    f = classify(reports(hangs=hangs), {r: "exit code 75" for r in (0, 1, 3)}, 4, [], None)
    assert (f.cause, f.ranks, f.nodes) == ("hung", [2], ["n2"])
    assert "rank(s) 2 wrote no report" in f.detail and "at step 7" in f.detail


def test_hang_blames_the_stopped_rank_even_when_woken_to_report_late():
    """Slurm sends SIGCONT before it kills a step: the stopped rank may report after the others, from
    wherever it was stopped. It was silent when the others reported, and the others' sequence numbers
    (rank 3 one collective further than 0 and 2) only say where each of them waits."""
    hangs = {0: hang_report(0, 197, at=100.0), 2: hang_report(2, 197, at=100.4), 3: hang_report(3, 198, at=100.9),
             1: hang_report(1, 197, at=106.2)}
    f = classify(reports(hangs=hangs), {}, 4, [], None)
    assert (f.cause, f.ranks, f.nodes) == ("hung", [1], ["n1"]), f.detail


def test_hang_blames_the_rank_behind_on_the_world_group():
    hangs = {0: hang_report(0, 128), 1: hang_report(1, 127), 2: hang_report(2, 128), 3: hang_report(3, 128)}
    f = classify(reports(hangs=hangs), {}, 4, [], None)
    assert (f.cause, f.ranks, f.nodes) == ("hung", [1], ["n1"])
    assert "had not reached collective #128" in f.detail


def test_hang_with_nobody_behind_says_so():
    hangs = {r: hang_report(r, 128) for r in range(4)}
    f = classify(reports(hangs=hangs), {}, 4, [], None)
    assert f.cause == "hung" and "none stands out" in f.detail


def test_crash_blames_the_signal_not_its_echoes():
    echoes = {r: {"rank": r, "time": 10.0 + r, "error": "RuntimeError: Connection closed by peer [127.0.0.1]:4840"}
              for r in (0, 1, 3)}
    f = classify(reports(errors=echoes), {2: "was killed by SIGKILL", 0: "exit code 1"}, 4, [], 9.0)
    assert (f.cause, f.ranks, f.nodes) == ("crashed", [2], ["n2"])
    assert "killed by SIGKILL" in f.detail


def test_crash_with_only_echoes_blames_the_rank_that_said_nothing():
    """Rank 1 killed; rank 0 exits first with an echo, and srun reports rank 1's death only after it began
    tearing the step down (a Slurm test saw this). Mutant: blaming the echo's rank (the old fallback)."""
    echo = {0: {"rank": 0, "time": 10.0, "error": "RuntimeError: [pair.cc:534] Read error: Connection reset by peer"}}
    f = classify(reports(errors=echo), {0: "exit code 1"}, 2, [], 9.0)
    assert (f.cause, f.ranks, f.nodes) == ("crashed", [1], ["n1"]), f.detail
    assert f.detail.startswith("rank 1 ended without a word while rank(s) 0 lost their connection")


def test_crash_blames_the_earliest_own_error():
    errors = {1: {"rank": 1, "time": 12.0, "error": "RuntimeError: Connection reset by peer"},
              3: {"rank": 3, "time": 11.0, "error": "FileNotFoundError: data/shard-00001.bin"},
              0: {"rank": 0, "time": 10.5, "error": "RuntimeError: Connection closed by peer"}}
    f = classify(reports(errors=errors), {3: "exit code 1", 1: "exit code 1"}, 4, [], None)
    assert (f.ranks, f.detail) == ([3], "rank 3: FileNotFoundError: data/shard-00001.bin")


def test_same_failure_same_signature():
    errors = {1: {"rank": 1, "time": 3.0, "error": "RuntimeError: injected failure at step 3 on rank 1"}}
    a = classify(reports(errors=errors), {1: "exit code 1"}, 4, [], 1.0)
    b = classify(reports(errors={1: {**errors[1], "time": 99.0}}), {1: "exit code 1"}, 4, [], 50.0)
    other = classify(reports(errors={2: {**errors[1], "rank": 2}}), {2: "exit code 1"}, 4, [], 50.0)
    assert a.signature() == b.signature() != other.signature()


def test_read_reports_from_an_attempt_dir(tmp_path):
    (tmp_path / "ranks.json").write_text(json.dumps({"hosts": {"0": "n1", "1": "n2"}, "pids": {"0": 5, "1": 6}}))
    (tmp_path / "hang-rank-1.json").write_text(json.dumps(hang_report(1, 3)))
    (tmp_path / "error-rank-0.json").write_text(json.dumps({"rank": 0, "time": 1.0, "error": "x"}))
    (tmp_path / "error-rank-1.json").write_text("{torn")  # a rank killed mid-write
    r = read_reports(tmp_path)
    assert r["hosts"] == {0: "n1", 1: "n2"} and set(r["hangs"]) == {1} and set(r["errors"]) == {0}


# --- srun's own report ----------------------------------------------------------------------------

def test_srun_failures_stop_where_srun_tears_the_step_down():
    text = ("srun: error: n2: task 3: Killed\n"
            "srun: Terminating StepId=12.0\n"
            "slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2026-12-01T10:00:00 ***\n"
            "srun: error: n1: tasks 0-1: Killed\n")
    assert srun_failures(text) == {3: "was killed by SIGKILL"}
    # Slurm 22.05's own words (a rank raised; srun killed the rest): only the first line is a cause.
    text = ("srun: error: n1: task 1: Exited with exit code 1\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=156.3\n"
            "srun: error: n1: task 0: Exited with exit code 1\n"
            "srun: error: n2: task 3: Terminated\n"
            "srun: Force Terminated StepId=156.3\n")
    assert srun_failures(text) == {1: "exit code 1"}
    assert srun_failures("srun: error: n1: tasks 0,2-3: Exited with exit code 75\n") == \
        {0: "exit code 75", 2: "exit code 75", 3: "exit code 75"}
    assert srun_failures("srun: error: n1: task 1: Segmentation fault\n") == {1: "signal: Segmentation fault"}


# --- health ---------------------------------------------------------------------------------------

def test_health_kernel_on_cpu_is_not_stretched_by_waiting(monkeypatch):
    """Time a CPU rank is not running (here: asleep in each matmul, as when another process holds its
    core) does not make its node look slow. Mutant: the wall clock (perf_counter), which gives >= 0.4 s."""
    import torch

    from hpctrain.distributed import health

    cpu = torch.device("cpu")
    awake = min(health._kernel(cpu, repeats=1, iters=8) for _ in range(2))  # the same kernel, never asleep
    real = torch.tanh
    monkeypatch.setattr(health.torch, "tanh", lambda x: (time.sleep(0.05), real(x))[1])
    # 8 x 50 ms asleep: the wall clock would add 0.4 s; the CPU clock adds nothing (a margin of half
    # that for the noise of a busy machine, where the suite's other workers share the cores).
    assert health._kernel(cpu, repeats=1, iters=8) < awake + 0.2


def test_health_judge_names_a_slow_node_even_among_two():
    from hpctrain.distributed.health import judge

    v = judge([("n1", 0.004, True), ("n1", 0.005, True), ("n2", 0.040, True), ("n2", 0.041, True)], 2.0)
    assert list(v.unhealthy) == ["n2"] and "8.2x the median node's 5.0 ms" in v.unhealthy["n2"]
    assert judge([("n1", 0.004, True), ("n2", 0.006, True)], 2.0).ok  # 1.5x: noise, not sickness
    assert list(judge([("n1", 0.004, True), ("n2", 0.004, False)], 2.0).unhealthy) == ["n2"]


# --- stragglers -----------------------------------------------------------------------------------

def test_straggler_named_after_persisting():
    from hpctrain.train.stragglers import Stragglers

    s = Stragglers(ratio=1.5, steps=3)
    s.hosts = ["n1", "n1", "n2", "n2"]
    spread = s.judge([0.10, 0.10, 0.30, 0.11])
    assert spread["slowest_rank"] == 2 and spread["step_time_max"] == 0.30 and s.warning() is None
    s.judge([0.10, 0.10, 0.12, 0.11])  # a transient: the streak starts again
    for _ in range(2):
        s.judge([0.10, 0.10, 0.30, 0.11])
        assert s.warning() is None
    s.judge([0.10, 0.10, 0.30, 0.11])
    w = s.warning()
    assert w and "rank 2 on n2 is a straggler" in w and "3.0x" in w
    s.judge([0.10, 0.10, 0.30, 0.11])
    assert s.warning() is None  # named once


# --- fault injection ------------------------------------------------------------------------------

def test_faults_fire_where_and_when_asked(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_FAULT", "crash:step=5,rank=1;raise:step=3,rank=0;unhealthy:node=n2,slowdown=4")
    monkeypatch.setenv("HPCTRAIN_ATTEMPT", "0")
    assert faults.armed("crash", step=5, rank=1) == {"step": 5, "rank": 1}
    assert faults.armed("crash", step=5, rank=0) is None and faults.armed("crash", step=4, rank=1) is None
    assert faults.health_slowdown("n2") == 4.0 and faults.health_slowdown("n1") == 1.0
    monkeypatch.setenv("HPCTRAIN_ATTEMPT", "1")  # the restarted run gets past the one-off faults...
    assert faults.armed("crash", step=5, rank=1) is None and faults.health_slowdown("n2") == 1.0
    assert faults.armed("raise", step=3, rank=0) is not None  # ... not past one that is always there
    with pytest.raises(RuntimeError, match="injected failure at step 3 on rank 0"):
        faults.after_step(3, 0)


# --- elastic --------------------------------------------------------------------------------------

def test_micro_batch_for_a_smaller_world():
    assert micro_batch_for(16, 4, 4, 1) == 4
    assert micro_batch_for(16, 2, 4, 1) == 4  # 8 per rank: 2 micro-batches of 4
    assert micro_batch_for(24, 4, 4, 1) == 3  # 6 per rank: the largest divisor <= 4
    assert micro_batch_for(16, 2, 4, 4) == 2  # a 4-stage pipeline needs 4 micro-batches
    assert micro_batch_for(16, 3, 4, 1) is None


def test_shrink_keeps_the_global_batch():
    cfg = compose(["+experiment=tiny", "cluster=local", "launcher=sbatch", "dry_run=true"])
    new, change = shrink(cfg, 1)
    assert (new.cluster.nodes, new.parallel.dp_shard, new.train.global_batch) == (1, -1, cfg.train.global_batch)
    assert "data parallel 4 -> 2" in change and "global batch 16 kept" in change
    with pytest.raises(ConfigError, match="does not split over"):
        # 3 nodes x 2 ranks take 6 sequences; 2 nodes x 2 ranks cannot split them evenly
        shrink(compose(["+experiment=tiny", "cluster=local", "launcher=sbatch", "cluster.nodes=3",
                        "train.global_batch=6", "train.micro_batch=1", "dry_run=true"]), 2)


# --- the watchdog ---------------------------------------------------------------------------------

def test_watchdog_fires_with_stacks_and_a_report(tmp_path):
    from hpctrain.train.watchdog import EXIT_HUNG, Watchdog, auto_timeout

    exits = []
    wd = Watchdog(tmp_path, rank=3, hang_timeout_s=0.3, generous_s=60, exit_fn=exits.append, poll_s=0.05,
                  linger_s=0)
    wd.beat(7, "step")
    wd.start()
    deadline = time.monotonic() + 30  # a bound against a broken watchdog, not a speed claim
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [EXIT_HUNG]
    report = json.loads((tmp_path / "hang-rank-3.json").read_text())
    assert (report["rank"], report["step"], report["phase"]) == (3, 7, "step")
    stacks = (tmp_path / "stacks-rank-3.txt").read_text()
    assert "no progress" in stacks and "test_watchdog_fires_with_stacks_and_a_report" in stacks
    # The allowed silence: generous in slow phases; from the measured steps when not set.
    wd2 = Watchdog(tmp_path, 0, hang_timeout_s=0, generous_s=300)
    assert wd2.timeout() == 300
    wd2.beat(1, "step")
    assert wd2.timeout() == 300  # no step timed yet
    for _ in range(5):
        wd2.beat(2, "step", step_time=9.0)
    assert wd2.timeout() == 90.0 == auto_timeout([9.0] * 5)
    wd2.beat(3, "save")
    assert wd2.timeout() == 300


# --- goodput --------------------------------------------------------------------------------------

def test_goodput_charges_interruptions(tmp_path):
    from hpctrain.report.goodput import main, measure, report

    attempts = [{"attempt": 0, "start": 100.0, "end": 130.0, "rc": 137}, {"attempt": 1, "start": 131.0, "end": 160.0, "rc": 0}]
    metrics = [{"step": s, "step_time_s": 0.5, "time": 100.0 + s} for s in range(1, 41)]
    rec = {"cause": "crashed", "ranks": [2], "nodes": ["n2"], "detail": "rank 2 was killed by SIGKILL",
           "steps_redone": 4, "detect_s": 0.5, "recover_s": 9.0, "failed_at": 124.0}
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "interruptions.jsonl").write_text(json.dumps(rec) + "\n")
    g = measure(tmp_path)
    assert (g.wall_s, g.productive_s, g.steps) == (60.0, 20.0, 40)
    assert g.goodput == pytest.approx(1 / 3) and g.lost_s == 9.0 and g.redone_s == 2.0 and g.other_s == 29.0
    text = report(g)
    assert "goodput 33.3%" in text and "crashed" in text and "9.0" in text
    assert main([str(tmp_path / "nowhere")]) == 2


def test_an_echo_of_a_peers_death_is_one_line_and_a_whole_report(tmp_path):
    """What a surviving rank raised in gloo when its peer died is told apart from its own errors, and its
    report keeps the whole traceback (mutants: every error an echo; the report cut to 6 lines)."""
    from hpctrain.run import is_echo, report_error

    def deep(n):
        if n == 0:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22929")
        deep(n - 1)

    try:
        deep(10)
    except RuntimeError as e:
        echo = e
    assert is_echo(echo) and not is_echo(ValueError("optim.lr must be positive"))
    report_error(tmp_path, 0, echo)
    rep = json.loads((tmp_path / "error-rank-0.json").read_text())
    assert rep["error"].startswith("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert rep["traceback"][0].startswith("Traceback")  # from the top (the old report kept the last 6 lines)
    assert any("in test_an_echo_of_a_peers_death" in line for line in rep["traceback"])
