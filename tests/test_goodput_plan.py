"""The pure parts of `benchmarks/goodput.py --minutes M` (the failure schedule, whom each failure hits, the
matching of injected failures to interruptions.jsonl, the verdict against issue 47's targets) and the
goodput report's `restored from` column. The run itself needs the local Slurm for 15 minutes: not here."""
from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", REPO / "benchmarks" / "goodput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_schedule_is_crash_hang_node_in_turn_every_3_minutes(bench):
    # Mutants: the kinds not cycled (always crash); a failure in the last 30 s (no time left to recover);
    # counting from 0 s (a failure before the run has started).
    assert bench.schedule(15) == [(180.0, "crash"), (360.0, "hang"), (540.0, "node"), (720.0, "crash")]
    assert bench.schedule(6.5) == [(180.0, "crash"), (360.0, "hang")]  # 360 s + 30 s fit in 390 s
    assert bench.schedule(6.49) == [(180.0, "crash")]
    assert bench.schedule(3.4) == []  # 180 s + 30 s of recovery do not fit in 204 s


def test_steps_for_fills_the_minutes(bench):
    # Mutant: the snapshot cost or the recoveries left out (the run outlasts its minutes and Slurm's limit).
    steps = bench.steps_for(15, 0.15, failures=4)
    assert steps == int((900 - 20 - 20) / (0.15 * 1.08))
    with pytest.raises(ValueError, match="logged no usable step"):
        bench.steps_for(15, 0.0, 4)
    assert bench.cluster_time(15) == "00:30:00" and bench.cluster_time(60) == "01:15:00"


def test_newest_ranks_and_targets(bench, tmp_path):
    # Mutants: the first generation's ranks.json read (a rank already replaced is killed, so nothing
    # fails); rank 0 killed; a generation directory without ranks.json yet taken as the newest.
    for g, pids, hosts in [(0, [10, 11, 12, 13], ["n1", "n1", "n2", "n2"]),
                           (1, [10, 21, 12, 13], ["n1", "n1", "n2", "n2"])]:
        d = tmp_path / "attempts" / str(g)
        d.mkdir(parents=True)
        (d / "ranks.json").write_text(json.dumps({"pids": {str(r): p for r, p in enumerate(pids)},
                                                  "hosts": {str(r): h for r, h in enumerate(hosts)}}))
    (tmp_path / "attempts" / "2").mkdir()  # generation 2 starting: no ranks.json yet
    g, ranks = bench.newest_ranks(tmp_path)
    assert g == 1
    assert bench.target_of("crash", ranks) == {"kind": "crash", "rank": 1, "pid": 21, "node": "n1"}
    assert bench.target_of("hang", ranks) == {"kind": "hang", "rank": 3, "pid": 13, "node": "n2"}
    assert bench.target_of("node", ranks) == {"kind": "node", "node": "n2"}
    assert bench.newest_ranks(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="need 2 or more"):
        bench.target_of("crash", {"pids": {"0": 5}, "hosts": {"0": "n1"}})


def test_ready_waits_for_the_record_and_its_recovery(bench):
    # Mutant: the next failure injected while the previous one is still being recovered from.
    assert bench.ready([], 0)
    assert not bench.ready([], 1)  # injected, not yet recorded
    assert not bench.ready([{"cause": "crashed", "recover_s": None}], 1)
    assert bench.ready([{"cause": "crashed", "recover_s": 2.0}], 1)


def rec(cause, at, recover, redone=1, kind="memory"):
    return {"cause": cause, "failed_at": at, "detect_s": 0.2, "recover_s": recover, "steps_redone": redone,
            "restored_from": {"kind": kind, "step": 50, "source": {"0": "own", "1": "n1"}}}


def injected(*kinds_at):
    return [{"kind": k, "at": at, "since_start_s": at - 1000.0} for k, at in kinds_at]


def test_match_pairs_each_injection_with_its_record_and_shows_extras(bench):
    # Mutants: records paired by position (an unplanned failure before the first injection shifts every
    # pair); a record earlier than the injection taken for it; extras dropped.
    inj = injected(("crash", 1180.0), ("hang", 1360.0))
    records = [rec("crashed", 1100.0, 2.0), rec("crashed", 1180.1, 2.5), rec("hung", 1363.0, 4.0)]
    rows = bench.match(inj, records)
    assert [(r["kind"], r["cause"], r["recover_s"]) for r in rows] == [
        ("crash", "crashed", 2.5), ("hang", "hung", 4.0), (None, "crashed", 2.0)]
    missing = bench.match(injected(("node", 1540.0)), [])
    assert missing[0]["record"] is None and missing[0]["recover_s"] is None


def test_verdict_against_the_issues_targets(bench):
    # Mutants: each bound (crash 5 s, node 15 s, 1 step, goodput 0.9) dropped or compared with >=; the job
    # state or the requeue not checked; a wrong cause accepted; a missing record passing as met.
    inj = injected(("crash", 1180.0), ("hang", 1360.0), ("node", 1540.0))
    good = [rec("crashed", 1180.0, 5.0), rec("hung", 1361.0, 30.0), rec("node_lost", 1541.0, 15.0)]
    ok, why = bench.verdict(bench.match(inj, good), 0.9, "COMPLETED", False)
    assert ok and why == []  # the bounds are inclusive; a hang has no recovery bound

    def miss(records=good, goodput=0.95, state="COMPLETED", requeued=False, injections=inj):
        ok, why = bench.verdict(bench.match(injections, records), goodput, state, requeued)
        assert not ok
        return " | ".join(why)

    assert "recovered in 5.1 s, over 5 s" in miss([rec("crashed", 1180.0, 5.1), *good[1:]])
    assert "crash at 180 s" in miss([rec("crashed", 1180.0, 5.1), *good[1:]])
    assert "recovered in 15.2 s, over 15 s" in miss([*good[:2], rec("node_lost", 1541.0, 15.2)])
    assert "2 steps redone, over 1" in miss([rec("crashed", 1180.0, 1.0, redone=2), *good[1:]])
    assert "goodput 89.0% under 90%" in miss(goodput=0.89)
    assert "ended FAILED, not COMPLETED" in miss(state="FAILED")
    assert "requeued" in miss(requeued=True)
    assert "recorded as crashed, not node_lost" in miss([*good[:2], rec("crashed", 1541.0, 3.0)])
    assert "node at 540 s: no interruption recorded" in miss(good[:2])
    assert "never recovered" in miss([*good[:2], rec("node_lost", 1541.0, None)])
    assert "nobody injected (crashed)" in miss([*good, rec("crashed", 1600.0, 1.0)])
    assert "no failure was injected" in miss([], injections=[])


def test_step_stats(bench):
    # Mutants: the period taken across a restart (steps going back, or the recovery's gap counted);
    # snapshot_ms not read.
    m = [{"step": 1, "time": 10.0, "step_time_s": 0.1, "snapshot_ms": 2.0},
         {"step": 2, "time": 10.2, "step_time_s": 0.1, "snapshot_ms": 3.0},
         {"step": 3, "time": 10.4, "step_time_s": 0.1, "snapshot_ms": 2.0, "snapshot_waited": 1},
         {"step": 3, "time": 15.0, "step_time_s": 0.3},  # redone after a restart
         {"step": 4, "time": 15.2, "step_time_s": 0.1}]
    s = bench.step_stats(m)
    assert s["step_time_s"] == 0.1 and s["step_period_s"] == pytest.approx(0.2)
    assert s["snapshot_ms"] == 2.0 and s["snapshot_waited"] == 1
    assert bench.step_stats([]) == {"step_time_s": None, "step_period_s": None, "snapshot_ms": None,
                                    "snapshot_waited": 0}


def test_the_report_says_where_each_restart_restored_from(tmp_path):
    # Mutants: the column left out; the peer sources not named; ranks sorted as strings (r10 before r2);
    # a damaged restored_from (a string, a list) raising instead of '-'.
    from hpctrain.report.goodput import measure, report, restored_text

    assert restored_text({"restored_from": {"kind": "memory", "step": 120, "source": {"0": "own", "1": "own"}}}) \
        == "memory 120"
    assert restored_text({"restored_from": {"kind": "memory", "step": 120,
                                            "source": {"10": "n3", "2": "n1", "0": "own"}},
                          "replaced": {"n2": "n3"}}) == "memory 120 (r2 n1, r10 n3) n2->n3"
    assert restored_text({"restored_from": {"kind": "disk", "step": None, "why": "x"}}) == "disk -"
    for bad in ({}, {"restored_from": "memory"}, {"restored_from": [1]}, {"restored_from": {"kind": "tape"}},
                {"replaced": ["n2"]}):
        assert restored_text(bad) == "-"
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"attempt": 0, "start": 100.0, "end": 130.0}) + "\n")
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "step_time_s": 0.5, "time": 100.0 + s}) + "\n" for s in range(1, 20)))
    r = {"cause": "node_lost", "ranks": [2, 3], "nodes": ["n2"], "steps_redone": 1, "detect_s": 0.1,
         "recover_s": 3.0, "failed_at": 110.0, "replaced": {"n2": "n3"},
         "restored_from": {"kind": "memory", "step": 9, "source": {"0": "own", "1": "own", "2": "n1", "3": "n1"}}}
    (tmp_path / "interruptions.jsonl").write_text(json.dumps(r) + "\n")
    text = report(measure(tmp_path))
    assert "restored from" in text and "memory 9 (r2 n1, r3 n1) n2->n3" in text


def test_out_keeps_what_the_benchmark_did_not_write(bench, tmp_path):
    """--out is the user's directory. Mutant: the whole directory removed (rm -rf out, as it once was)."""
    out = tmp_path / "out"
    (out / "failures").mkdir(parents=True)
    (out / "failures" / "config.yaml").write_text("x")  # an earlier run of the benchmark
    (out / "results.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    bench.clear_out(out, ("baseline", "failures"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "baseline").mkdir()  # not a run: refused, kept
    (out / "baseline" / "data.bin").write_text("mine")
    with pytest.raises(SystemExit, match="is not a run this benchmark wrote"):
        bench.clear_out(out, ("baseline", "failures"))
    assert (out / "baseline" / "data.bin").read_text() == "mine"
