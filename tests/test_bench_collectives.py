"""Collective benchmark, sweep validation and report (no Slurm needed; tests/test_bench_sweep.py has the
end-to-end run on the local Slurm).

- bandwidth arithmetic against the nccl-tests conventions (doc/PERFORMANCE.md of NVIDIA/nccl-tests);
- the exact-check patterns in-process, and one 2-rank gloo run of every operation (+ one with a
  corrupted result, which must fail, not report a number);
- refusal of bad sweep settings before anything is submitted; the ready conf/sweep/*.yaml validate;
- the report on a recorded sweep (tests/data/bench_sweep_local_gloo, a real run of local_gloo on the
  2-node Slurm) and on a synthetic sweep with a known answer.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hpctrain.bench import collectives as C
from hpctrain.core import nccl_words as W
from hpctrain.report import nccl_report as R
from hpctrain.bench import sweep as S

REPO = Path(__file__).resolve().parent.parent
RECORDED = Path(__file__).resolve().parent / "data" / "bench_sweep_local_gloo"


# ----------------------------------------------------------------------------------------------
# Bandwidth formulas.

def test_bus_factors_follow_nccl_tests():
    assert C.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert C.bus_factor(op, 8) == pytest.approx(7 / 8)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert C.bus_factor(op, 8) == 1.0
    assert C.bus_factor("all_reduce", 2) == 1.0
    assert C.bus_factor("all_gather", 2) == 0.5
    assert C.bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing
    with pytest.raises(ValueError, match="all_reduce"):
        C.bus_factor("allreduce", 8)
    with pytest.raises(ValueError):
        C.bus_factor("all_reduce", 0)


def test_algbw_and_busbw():
    # 1 GiB all_reduce on 16 ranks in 50 ms: algbw 21.47 GB/s (1e9 B/s), busbw x 30/16.
    assert C.algbw(1 << 30, 0.05) == pytest.approx(21.474836, rel=1e-6)
    assert C.busbw("all_reduce", 1 << 30, 0.05, 16) == pytest.approx(21.474836 * 30 / 16, rel=1e-6)
    assert C.busbw("all_gather", 1 << 30, 0.05, 16) == pytest.approx(21.474836 * 15 / 16, rel=1e-6)
    assert C.busbw("sendrecv", 8e9, 1.0, 2) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        C.algbw(1, 0)


def test_sizes_and_element_counts():
    assert W.parse_size("8") == 8 and W.parse_size("64K") == 65536 and W.parse_size("1G") == 1 << 30
    assert W.parse_size("32MiB") == 32 << 20 and W.parse_size("1.5k") == 1536 and W.parse_size(4) == 4
    with pytest.raises(ValueError):
        W.parse_size("lots")
    assert C.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert C.sizes(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert len(C.sizes(8, 1 << 30, 2)) == 28  # nccl-tests -b 8 -e 1G -f 2
    with pytest.raises(ValueError):
        C.sizes(64, 8, 2)
    with pytest.raises(ValueError):
        C.sizes(8, 64, 1)
    # Split operations round down to whole chunks per rank; too small a message is skipped.
    assert C.element_count("all_gather", 100, 4, 8) == 24
    assert C.element_count("all_reduce", 100, 4, 8) == 25
    assert C.element_count("reduce_scatter", 8, 4, 8) == 0
    assert W.format_size(64 << 20) == "64MiB" and W.format_size(1536) == "1.5KiB" and W.format_size(8) == "8B"
    assert C.parse_ops("all") == list(W.OPS)
    with pytest.raises(ValueError, match="valid operations are all_reduce"):
        C.parse_ops("all_reduce,allgather")


# ----------------------------------------------------------------------------------------------
# The exact check.

def test_fill_and_mismatch_with_offsets():
    base = torch.tensor([float(x) for x in C._gather_pattern(3)])
    t = torch.empty(1000)
    C._fill(t, base, offset=7)
    assert t[0] == base[7] and t[251 - 7] == base[0] and t[999] == base[(999 + 7) % 251]
    assert C._first_mismatch(t, base, offset=7) is None
    assert C._first_mismatch(t, base, offset=8) == 0
    t[600] += 1
    assert C._first_mismatch(t, base, offset=7) == 600


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
@pytest.mark.parametrize("world", [2, 3, 8, 64, 1024])
def test_reduce_patterns_sum_exactly(dtype, world):
    """The all_reduce/reduce_scatter pattern's sum is exact in the dtype, summed in any order."""
    tdt = getattr(torch, C.DTYPES[dtype][0])
    limit = C.DTYPES[dtype][2]
    mine = [torch.tensor(C._reduce_patterns(r, world, limit)[0], dtype=tdt) for r in range(world)]
    want = torch.tensor(C._reduce_patterns(0, world, limit)[1], dtype=tdt)
    for order in (range(world), reversed(range(world))):
        acc = torch.zeros_like(want)
        for r in order:
            acc = acc + mine[r]  # rounding after every step, as a ring reduction does
        assert torch.equal(acc, want)


def test_patterns_tell_ranks_apart():
    assert C._gather_pattern(0) != C._gather_pattern(1)
    assert C._a2a_pattern(0, 1) != C._a2a_pattern(1, 0)
    assert max(C._gather_pattern(5)) <= 251 <= C.DTYPES["bfloat16"][2]  # exact even in bf16


def _run_bench(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "HPCTRAIN_FAULT"}
    full.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpctrain.bench.collectives", "--nproc", "2", "--out-dir",
                           str(tmp_path), *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_two_ranks_every_operation(tmp_path):
    p = _run_bench(tmp_path, "--ops", "all", "--min-bytes", "8", "--max-bytes", "64K", "--factor", "16",
                   "--warmup", "1", "--iters", "2", "--repeats", "2", "--dtype", "bfloat16",
                   env={"NCCL_ALGO": "Ring"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    # sizes 8, 128, 2K, 32K for each of the six operations
    assert sorted({r["op"] for r in rows}) == sorted(C.OPS)
    assert len(rows) == 6 * 4
    for r in rows:
        assert r["check"] == "ok" and r["world"] == 2 and r["backend"] == "gloo" and r["dtype"] == "bfloat16"
        assert r["env"]["NCCL_ALGO"] == "Ring" and r["env"]["GLOO_SOCKET_IFNAME"] == "lo"
        assert r["nodes"] == 1 and r["tasks_per_node"] == 2 and len(r["batches_us"]) == 2
        assert r["time_max_us"] >= r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * C.bus_factor(r["op"], 2))
    table = (tmp_path / "table.txt").read_text()
    assert "busbw(GB/s)" in table and "reduce_scatter" in table and "sendrecv" in table
    assert "busbw(GB/s)" in p.stdout  # rank 0 prints the table


@pytest.mark.slow
def test_a_wrong_result_is_an_error_not_a_number(tmp_path):
    p = _run_bench(tmp_path, "--ops", "reduce_scatter", "--min-bytes", "1K", "--max-bytes", "1K",
                   "--iters", "1", "--warmup", "0", env={"HPCTRAIN_FAULT": "bench_corrupt:rank=1"})
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert "returned a wrong result on 1 rank(s): rank 1: element" in err, err[-3000:]
    assert not (tmp_path / "results.jsonl").read_text().strip()  # no timing was recorded


# ----------------------------------------------------------------------------------------------
# Sweep validation: refused before submission.

def _sweep(**over) -> dict:
    raw = {"name": "t", "nodes": [2], "tasks_per_node": 1, "settings": {"default": {}},
           "bench": {"ops": ["all_reduce"], "max_bytes": "1M"}}
    for k, v in over.items():
        raw[k] = v
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("env,key,needle", [
    ({"NCCL_ALGO": "Rign"}, "NCCL_ALGO", "did you mean Ring?"),
    ({"NCCL_ALGO": "Ring,Bogus"}, "NCCL_ALGO", "Ring, Tree, CollnetDirect, CollnetChain, NVLS, NVLSTree, PAT"),
    ({"NCCL_ALGO": "allreduce:Tree;allgathr:Ring"}, "NCCL_ALGO", "unknown collective 'allgathr'"),
    ({"NCCL_PROTO": "LL256"}, "NCCL_PROTO", "Simple, LL, LL128"),
    ({"NCCL_PROTO": ""}, "NCCL_PROTO", "Simple, LL, LL128"),
    ({"NCCL_MIN_NCHANNELS": "many"}, "NCCL_MIN_NCHANNELS", "not an integer"),
    ({"NCCL_MIN_NCHANNELS": 16, "NCCL_MAX_NCHANNELS": 8}, "NCCL_MIN_NCHANNELS", "larger than NCCL_MAX_NCHANNELS"),
    ({"NCCL_IB_QPS_PER_CONNECTION": 0}, "NCCL_IB_QPS_PER_CONNECTION", "1..128"),
    ({"NCCL_CROSS_NIC": 3}, "NCCL_CROSS_NIC", "0, 1, 2"),
    ({"NCCL_NVLS_ENABLE": "yes"}, "NCCL_NVLS_ENABLE", "0, 1"),
    ({"NCCL_BUFFSIZE": -1}, "NCCL_BUFFSIZE", "out of range"),
    ({"NCCL_ALOG": "Ring"}, "NCCL_ALOG", "did you mean NCCL_ALGO?"),
    ({"NCCL_SOCKET_IFNAME": " "}, "NCCL_SOCKET_IFNAME", "must not be empty"),
    ({"NCCL_ALGO": ["Ring"]}, "NCCL_ALGO", "single value"),
])
def test_bad_settings_are_refused(tmp_path, env, key, needle):
    with pytest.raises(S.SweepConfigError) as e:
        S.build(_sweep(settings={"default": {}, "bad": env}), tmp_path)
    msg = str(e.value)
    assert f"settings.bad.{key}" in msg and needle in msg, msg
    assert isinstance(e.value, ValueError)


def test_good_nccl_values_pass(tmp_path):
    ok = {"a": {"NCCL_ALGO": "ring,TREE", "NCCL_PROTO": "^LL128"}, "b": {"NCCL_ALGO": "NVLSTree,PAT"},
          "c": {"NCCL_ALGO": "allreduce:Tree,Ring;allgather:Ring", "NCCL_PROTO": "Simple"},
          "d": {"NCCL_MIN_NCHANNELS": 4, "NCCL_MAX_NCHANNELS": "0x10", "NCCL_BUFFSIZE": 8388608,
                "NCCL_IB_QPS_PER_CONNECTION": 4, "NCCL_CROSS_NIC": 2, "NCCL_NVLS_ENABLE": 0,
                "NCCL_SOCKET_IFNAME": "=ib0", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_DEBUG": "WARN"},
          "e": {"NCCL_SOME_FUTURE_KNOB": 1, "MY_VAR": None}}
    sw = S.build(_sweep(settings={"default": {}, **ok}), tmp_path)
    assert [e.setting for e in sw.elements] == ["default", "a", "b", "c", "d", "e"]
    assert sw.settings["d"]["NCCL_BUFFSIZE"] == "8388608" and sw.settings["e"]["MY_VAR"] is None


@pytest.mark.parametrize("over,needle", [
    ({"bench": {"ops": ["all_reduce", "allgather"]}}, "bench.ops"),
    ({"bench": {"ops": ["all_reduce"], "dtype": "fp8"}}, "bench.dtype"),
    ({"bench": {"ops": ["all_reduce"], "itters": 3}}, "bench: unknown key(s) ['itters']"),
    ({"bench": {"ops": ["all_reduce"], "min_bytes": "1G", "max_bytes": "1M"}}, "min_bytes"),
    ({"baseline": "nope"}, "baseline: 'nope' is not one of the settings"),
    ({"nodes": [0]}, "nodes"),
    ({"settings": {}}, "no settings"),
    ({"settings": {"../x": {}}}, "becomes a directory"),
    ({"cluster": "dgx9000"}, "cluster: 'dgx9000' is not in conf/cluster/"),
    ({"nodez": [2]}, "unknown key(s) ['nodez']"),
    ({"grid": {"NCCL_PROTO": ["Simple", "LL1280"]}}, "grid.NCCL_PROTO"),
    ({"grid": {"NCCL_PROTO": []}}, "grid.NCCL_PROTO: sweeps over no values"),
])
def test_bad_sweeps_are_refused(tmp_path, over, needle):
    with pytest.raises(S.SweepConfigError) as e:
        S.build(_sweep(**over), tmp_path)
    assert needle in str(e.value), str(e.value)


def test_a_sweep_larger_than_a_job_array_is_refused(tmp_path):
    """One expansion for both kinds of sweep (hpctrain.launch.multirun.expand_axes), with one limit: the
    elements of one job array, settings x node counts (here 101 with the baseline x 10). Mutant: the sweep's
    own loops."""
    with pytest.raises(S.SweepConfigError, match=r"1010 elements; at most 1000 \(Slurm's MaxArraySize\)"):
        S.build(_sweep(settings={f"s{i}": {} for i in range(100)}, nodes=list(range(1, 11))), tmp_path)


@pytest.mark.slow
def test_cli_refuses_before_submitting(tmp_path):
    out = tmp_path / "sw"
    p = subprocess.run([sys.executable, "-m", "hpctrain.bench.sweep", "local_gloo", "--out", str(out),
                        "settings.bad.NCCL_PROTO=Fast"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "settings.bad.NCCL_PROTO" in p.stderr and "Simple, LL, LL128" in p.stderr
    assert not out.exists()  # nothing written, nothing submitted


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml")))
def test_ready_sweeps_validate(tmp_path, name):
    sw = S.build(S.load(name), tmp_path)
    assert sw.baseline in sw.settings and len(sw.elements) >= 4
    params = S.executor_parameters(sw)
    assert params["use_srun"] is False and params["additional_parameters"]["nodes"] == max(sw.nodes)
    text = S.sbatch_text(sw)
    assert f"#SBATCH --array=0-{len(sw.elements) - 1}" in text and f"#SBATCH --nodes={max(sw.nodes)}" in text
    for el in sw.elements:
        cmd = S.srun_command(el)
        assert cmd[0] == "srun" and f"--nodes={el.nodes}" in cmd and "hpctrain.bench.collectives" in cmd


def test_grid_and_node_counts_expand(tmp_path):
    sw = S.build(S.load("nccl_algo_proto", ["nodes=[1,2]"]), tmp_path)
    names = {Path(e.dir).name for e in sw.elements}
    assert len(sw.elements) == 7 * 2 and "algo-tree_proto-ll128_2n" in names and "default_1n" in names
    assert [(e.setting, e.nodes) for e in sw.elements[:3]] == [("default", 1), ("default", 2), ("algo-ring_proto-simple", 1)]
    assert sw.tasks_per_node == 8 and sw.gpus_per_node == 8  # from conf/cluster/h100.yaml
    el = next(e for e in sw.elements if Path(e.dir).name == "algo-ring_proto-simple_1n")
    env = S.element_env(el, {"PATH": "/bin", "NCCL_ALGO": "Tree", "NCCL_DEBUG": "INFO"})
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple" and env["NCCL_DEBUG"] == "INFO"
    assert env["HPCTRAIN_BENCH_SETTING"] == "algo-ring_proto-simple"


def test_null_unsets_a_variable(tmp_path):
    sw = S.build(_sweep(settings={"default": {}, "no_debug": {"NCCL_DEBUG": None}}), tmp_path)
    env = S.element_env(sw.elements[1], {"NCCL_DEBUG": "INFO"})
    assert "NCCL_DEBUG" not in env


# ----------------------------------------------------------------------------------------------
# Report.

@pytest.mark.slow
def test_report_on_recorded_sweep(tmp_path):
    d = tmp_path / "sweep"
    shutil.copytree(RECORDED, d)
    p = subprocess.run([sys.executable, "-m", "hpctrain.report.nccl_report", str(d)], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    md = (d / "report" / "report.md").read_text()
    assert "| op | range | sizes | best setting | busbw | baseline busbw | gain | runner-up |" in md
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        assert f"| {op} | large | >= 16MiB (1) |" in md
        png = d / "report" / "plots" / f"busbw_{op}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # NCCL_* does nothing on gloo: that setting is the baseline run again and may not win.
    assert "nccl_recorded (= baseline)" in md and "so it measures the noise" in md
    res = json.loads((d / "report" / "report.json").read_text())
    # In this recording no real setting beats the baseline on large messages: keep the defaults.
    assert res["winner"] == "default" and res["winner_nodes"] == 2
    v = res["node_counts"]["2"]
    assert v["replicas"] == ["nccl_recorded"] and v["noise"] == pytest.approx(0.071, abs=0.001)
    assert yaml.safe_load((d / "report" / "cluster_snippet.yaml").read_text()) == {"env": {}}
    text = (d / "report" / "cluster_snippet.yaml").read_text()
    assert "conf/cluster/<name>.yaml" in text and "The winner sets no variables" in text
    # The table's numbers are the recorded ones: all_reduce at 16 MiB, baseline.
    rec = [json.loads(x) for x in (d / "default" / "results.jsonl").read_text().splitlines()]
    ar = next(r for r in rec if r["op"] == "all_reduce" and r["bytes"] == 16 << 20)
    assert f"| all_reduce | large | >= 16MiB (1) | default | {ar['busbw_gbps']:.3g} |" in md
    assert "## Verdict" in p.stdout


def _rec(op, nbytes, busbw, backend="nccl", nodes=2, spread=0.0):
    t = nbytes / (busbw / C.bus_factor(op, 16) * 1e9) * 1e6
    return {"op": op, "bytes": nbytes, "busbw_gbps": busbw, "algbw_gbps": busbw / C.bus_factor(op, 16),
            "time_us": t, "time_max_us": t, "batches_us": [t * (1 - spread / 2), t, t * (1 + spread / 2)],
            "world": 16, "nodes": nodes, "tasks_per_node": 8, "backend": backend, "dtype": "bfloat16", "check": "ok"}


def _write_synthetic(root: Path, settings: dict, perf: dict, failed=(), backend="nccl") -> None:
    """perf: setting -> function(op, size) -> busbw."""
    elements = [{"setting": s, "nodes": 2, "dir": s} for s in settings]
    root.mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps({"name": "synthetic", "baseline": "default", "settings": settings,
                                                 "base_env": {}, "elements": elements}))
    for s in settings:
        (root / s).mkdir()
        (root / s / "setting.json").write_text(json.dumps({"setting": s, "nodes": 2, "rc": 1 if s in failed else 0}))
        if s in failed:
            continue
        lines = [json.dumps(_rec(op, b, perf[s](op, b), backend))
                 for op in ("all_reduce", "all_gather", "reduce_scatter") for b in C.sizes(1024, 256 << 20, 4)]
        (root / s / "results.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_report_chooses_the_large_message_winner(tmp_path):
    settings = {"default": {}, "ring_simple": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"},
                "ll": {"NCCL_PROTO": "LL"}, "tiny_gain": {"NCCL_BUFFSIZE": "8388608"},
                "again": {"GLOO_SOCKET_IFNAME": "lo"}, "broken": {"NCCL_ALGO": "Tree"}}
    base = lambda op, b: 40.0 * b / (b + (1 << 20))  # noqa: E731 - a bandwidth curve saturating at 40
    perf = {"default": base,
            "ring_simple": lambda op, b: base(op, b) * (1.20 if b >= 16 << 20 else 0.9),  # wins large, loses small
            "ll": lambda op, b: base(op, b) * (1.5 if b < 64 << 10 else 0.5),  # wins small only
            "tiny_gain": lambda op, b: base(op, b) * 1.01,  # below the 3% floor
            "again": lambda op, b: base(op, b) * 1.02}  # differs only in a variable NCCL does not read
    _write_synthetic(tmp_path / "s", settings, perf, failed=("broken",))
    data = R.load(tmp_path / "s")
    res = R.analyse(data)
    v = res["node_counts"][2]
    assert res["winner"] == "ring_simple" and v["replicas"] == ["again"]
    assert v["noise"] == pytest.approx(0.02)
    best = {(r["op"], r["range"]): r for r in v["best"]}
    assert best[("all_reduce", "small")]["best"] == "ll" and best[("all_reduce", "small")]["gain"] == pytest.approx(0.5)
    assert best[("all_gather", "large")]["best"] == "ring_simple"
    assert best[("all_gather", "large")]["gain"] == pytest.approx(0.2)
    assert ("broken", 2, ) == data.failed[0][:2]
    assert R.main([str(tmp_path / "s")]) == 0
    snip = yaml.safe_load((tmp_path / "s" / "report" / "cluster_snippet.yaml").read_text())
    assert snip == {"env": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}}
    md = (tmp_path / "s" / "report" / "report.md").read_text()
    assert "## Failed settings" in md and "- broken on 2 node(s): no results (exit 1)" in md
    assert "ring_simple beats the baseline 'default' by +20.0%" in md


def test_report_keeps_the_baseline_when_gains_are_noise(tmp_path):
    settings = {"default": {}, "a": {"NCCL_PROTO": "Simple"}, "b": {"NCCL_ALGO": "Ring"}}
    base = lambda op, b: 10.0  # noqa: E731
    perf = {"default": base, "a": lambda op, b: 10.2, "b": lambda op, b: 9.0}
    _write_synthetic(tmp_path / "s", settings, perf)
    res = R.analyse(R.load(tmp_path / "s"))
    assert res["winner"] == "default" and "below the 3.0% a winner needs" in res["why"]
    R.main([str(tmp_path / "s"), "--no-plots"])
    assert yaml.safe_load((tmp_path / "s" / "report" / "cluster_snippet.yaml").read_text()) == {"env": {}}


def test_report_writes_only_its_own_directory(tmp_path, capsys):
    """The report goes into <sweep>/report/, replaced whole by a rerun; a report/ holding someone
    else's files is refused with the fix, and nothing of theirs is touched (mutant: writing into the
    sweep directory, or into a foreign report/)."""
    settings = {"default": {}, "a": {"NCCL_PROTO": "Simple"}}
    _write_synthetic(tmp_path / "s", settings, {"default": lambda op, b: 10.0, "a": lambda op, b: 12.0})
    mine = tmp_path / "s" / "report.md"
    mine.write_text("my notes\n")  # a file of the user's beside the settings
    assert R.main([str(tmp_path / "s"), "--no-plots"]) == 0
    assert mine.read_text() == "my notes\n"
    first = (tmp_path / "s" / "report" / "report.md").read_text()
    assert "**a**" in first and f"Snippet: `{tmp_path / 's' / 'report' / 'cluster_snippet.yaml'}`" in first
    assert R.main([str(tmp_path / "s"), "--no-plots"]) == 0  # its own earlier report: replaced
    assert (tmp_path / "s" / "report" / "report.md").read_text() == first
    assert "report" not in {name for name, _, _ in R.load(tmp_path / "s").failed}  # not taken for a setting

    foreign = tmp_path / "t"
    _write_synthetic(foreign, settings, {"default": lambda op, b: 10.0, "a": lambda op, b: 12.0})
    (foreign / "report").mkdir()
    (foreign / "report" / "draft.md").write_text("theirs\n")
    capsys.readouterr()
    assert R.main([str(foreign), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "hpctrain.report.nccl_report:" in err and str(foreign / "report") in err and "draft.md" in err
    assert sorted(p.name for p in (foreign / "report").iterdir()) == ["draft.md"]
    assert not any(p.name.startswith(".") for p in foreign.iterdir())  # no partial report left behind


def test_split_ranges_falls_back_to_the_largest_sizes():
    r = R.split_ranges([1024, 4096, 65536, 1 << 20, 4 << 20, 8 << 20], 64 << 10, 16 << 20)
    assert r["small"][0] == [1024, 4096] and r["large"][0] == [4 << 20, 8 << 20]
    assert "none >= 16MiB" in r["large"][1] and r["medium"][0] == [65536, 1 << 20]
    assert R.geomean([2.0, 8.0]) == pytest.approx(4.0) and R.geomean([]) is None
    assert math.isclose(R.gain({1: {"busbw_gbps": 2.0}}, {1: {"busbw_gbps": 1.0}}, [1])[0], 1.0)
