"""The planner (hpctrain.plan): memory, step time and layout search by arithmetic, no torch.

Anchors from DESIGN.md section 5: 16 bytes per parameter for mixed-precision Adam, Megatron-LM's
H100 table (the calibration set: every row within 10% with the one conf/cluster/h100.yaml).
Run `python -m pytest -q -s tests/test_plan.py` to see the calibration table and the 70B plan.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.compose import compose
from hpctrain.layout import Layout
from hpctrain.plan.flops import param_counts
from hpctrain.plan.memory import GiB, in_flight, job_of, memory, model_state
from hpctrain.plan.report import (MEGATRON_H100, calibration, calibration_table, explain, plan, plan_dict,
                                  save_memory_png, summary)
from hpctrain.plan.search import Space, evaluate, nearest, search
from hpctrain.plan.throughput import bubble_divisor, throughput

REPO = Path(__file__).resolve().parent.parent
H100_8B = ["model=8b", "cluster=h100", "launcher.name=slurm", "cluster.nodes=1", "train.precision=bf16",
           "data.seq_len=4096", "train.global_batch=32", "train.micro_batch=1", "parallel.ac=full"]


@pytest.fixture(scope="module")
def h100():
    return job_of(compose(["cluster=h100", "launcher.name=slurm"])).cluster


@pytest.fixture(scope="module")
def job70():
    return job_of(compose(["+experiment=70b"]))


@pytest.fixture(scope="module")
def job8():
    return job_of(compose(H100_8B))


# --- memory ---------------------------------------------------------------------------------


def test_70b_weights_and_adam_state():
    p = param_counts(compose(["model=70b"]).model)["total"]
    state, off = model_state(p, "bf16", zero=0, shard=1, offload="none")
    assert 138e9 < state["params"] < 145e9  # ~140 GB of bf16 weights
    total = sum(state.values())
    assert total == pytest.approx(16 * p) and total > 1.1e12  # 2 + 2 + 4 + 8 bytes per parameter
    assert not off


def test_zero_stages_shrink_device_memory(job8):
    assert job8.layout.dp == 8
    totals = [memory(job8.with_(zero=z)).device_total for z in (0, 1, 2, 3)]
    assert totals[0] > totals[1] > totals[2] > totals[3], [t / GiB for t in totals]
    # What each stage shards, per parameter on this rank: 12 -> 12/8, then grads, then params.
    p = param_counts(job8.model)["total"]
    s = {z: model_state(p, "bf16", z, 8, "none")[0] for z in (0, 1, 2, 3)}
    assert s[1]["master"] + s[1]["moments"] == pytest.approx(12 * p / 8)
    assert s[2]["grads"] == pytest.approx(2 * p / 8) and s[1]["grads"] == pytest.approx(2 * p)
    assert s[3]["params"] == pytest.approx(2 * p / 8) and s[2]["params"] == pytest.approx(2 * p)


def test_offload_moves_optimizer_state_off_device(job8):
    on, cpu, nvme = (memory(job8.with_(zero=3, offload=o)) for o in ("none", "cpu", "nvme"))
    assert on.device["master"] > 0 and on.device["moments"] > 0
    for m in (cpu, nvme):
        assert "master" not in m.device and "moments" not in m.device
    p = param_counts(job8.model)["total"]
    assert on.device_total - cpu.device_total == pytest.approx(12 * p / 8, rel=1e-6)
    assert cpu.host_per_rank["master"] + cpu.host_per_rank["moments"] == pytest.approx(12 * p / 8)
    assert cpu.host_per_node > on.host_per_node
    assert nvme.nvme_per_node == pytest.approx(12 * p / 8 * 8) and "moments" not in nvme.host_per_rank
    # DeepSpeed's estimator for ZeRO-2 + CPU offload keeps 2P on the GPU; we add the 2P/N gradient shard.
    state, off = model_state(p, "bf16", zero=2, shard=8, offload="cpu")
    assert sum(state.values()) == pytest.approx(2 * p * (1 + 1 / 8)) and sum(off.values()) == pytest.approx(16 * p / 8)


def test_activations_by_checkpointing_and_schedule(job8):
    acts = {ac: memory(job8.with_(ac=ac)).device["activations"] for ac in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"]
    assert acts["none"] > 10 * acts["full"]  # a block's saved tensors (~20 h per token) vs its input (h)
    # Sequence-parallel TP divides most of them.
    tp4 = job8.with_(layout=Layout(pp=1, dp_replicate=1, dp_shard=2, tp=4), ac="none")
    assert memory(tp4).device["activations"] < acts["none"] / 2
    # 1F1B's first stage holds pp micro-batches, GPipe all m, interleaving a bit more than 1F1B.
    assert in_flight("1f1b", 4, 16, 1) == 4 and in_flight("1f1b", 4, 16, 1, stage=3) == 1
    assert in_flight("gpipe", 4, 16, 1) == 16
    assert in_flight("interleaved_1f1b", 4, 16, 2) == pytest.approx(4 * (1 + 3 / 8))
    pp = job8.with_(layout=Layout(pp=4, dp_replicate=1, dp_shard=2, tp=1))
    assert memory(pp.with_(schedule="gpipe")).device_total > memory(pp.with_(schedule="1f1b")).device_total


def test_infeasible_request_says_why():
    # 70B replicated (DDP) on one node: 16 bytes per parameter cannot fit.
    job = job_of(compose(["model=70b", "cluster=h100", "launcher.name=slurm", "cluster.nodes=1",
                          "train.precision=bf16", "parallel.zero=0", "train.global_batch=8", "train.micro_batch=1"]))
    p = plan(job)
    assert not p.fits
    assert "device memory" in p.problems[0] and "parallel.zero=1" in p.problems[0]
    assert p.memory.device_total > 1000 * GiB
    # Structure: 64 heads do not split over 3 ranks, 80 layers not over 3 stages.
    bad = evaluate(job.with_(layout=Layout(pp=3, dp_replicate=1, dp_shard=1, tp=3), zero=3))
    assert "model.n_heads % tp" in bad.reasons and "n_layers % pp" in bad.reasons
    assert any("parallel.tp=3" in m for m in bad.problems)


# --- time -----------------------------------------------------------------------------------


def test_calibration_against_megatron_h100(h100):
    rows = calibration(h100)
    print("\nMegatron-LM H100 table, TFLOP/s per GPU (DESIGN.md section 5):\n" + calibration_table(rows))
    assert len(rows) == len(MEGATRON_H100) == 9
    off = [r["model"] for r in rows if abs(r["error"]) > 0.10]
    assert not off, "outside 10%: " + ", ".join(off) + "\n" + calibration_table(rows)


def test_step_time_parts(job8):
    t = throughput(job8)
    assert sum(t.breakdown.values()) == pytest.approx(t.step_time_s)
    assert t.tokens_per_s == pytest.approx(job8.global_batch * job8.seq_len / t.step_time_s)
    assert 0 < t.mfu < 1 and t.tflops_per_gpu == pytest.approx(t.mfu * job8.cluster.peak_tflops)
    # Full recompute costs about a third more compute; none costs nothing.
    assert t.breakdown["recompute"] / t.breakdown["compute"] == pytest.approx(1 / 3, abs=0.05)
    assert throughput(job8.with_(ac="none")).breakdown["recompute"] == 0


def test_communication_volume(job8):
    """ZeRO-3 gathers parameters twice and reduce-scatters fp32 gradients every micro-batch;
    TP moves 8 sequence-parallel collectives per block and micro-batch (4 forward, 4 backward)."""
    p = param_counts(job8.model)["total"]
    colls = throughput(job8.with_(zero=3, ac="none")).collectives
    by = {(c["dim"], c["op"]): c for c in colls}
    m = job8.microbatches
    assert by["dp_shard", "all_gather"]["bytes_per_step"] == pytest.approx(2 * m * 2 * p)
    assert by["dp_shard", "reduce_scatter"]["bytes_per_step"] == pytest.approx(m * 4 * p)
    ddp = {(c["dim"], c["op"]): c for c in throughput(job8.with_(zero=0)).collectives}
    assert ddp["dp", "all_reduce"]["count"] == 1
    tp = job8.with_(layout=Layout(pp=1, dp_replicate=1, dp_shard=2, tp=4), zero=1, ac="none")
    tcol = {(c["dim"], c["op"]): c for c in throughput(tp).collectives}
    layers = job8.model.n_layers
    assert tcol["tp", "all_gather"]["count"] == tp.microbatches * (4 * layers + 1)
    assert tcol["tp", "all_gather"]["busbw_gbps"] == tp.cluster.intra_node_gbps  # TP stays in the node


def test_pipeline_bubble(job8):
    job = job8.with_(layout=Layout(pp=4, dp_replicate=1, dp_shard=2, tp=1), zero=1, ac="none")
    m, p = job.microbatches, 4
    t = throughput(job)
    stage_work = t.breakdown["compute"] / m  # one micro-batch on the slowest stage
    # (p-1)/(m+p-1) of the pipeline time, up to the imbalance the embedding and output layer add.
    frac = t.breakdown["bubble"] / (t.breakdown["bubble"] + m * stage_work)
    assert frac == pytest.approx((p - 1) / (m + p - 1), rel=0.15)
    inter = throughput(job.with_(schedule="interleaved_1f1b", virtual_stages=2))
    assert inter.breakdown["bubble"] == pytest.approx(t.breakdown["bubble"] / 2, rel=0.01)
    assert bubble_divisor(job.with_(schedule="gpipe")) == 1


# --- search ---------------------------------------------------------------------------------


def test_search_70b_on_64_h100(job70):
    assert job70.world == 64 and job70.cluster.name == "h100"
    t0 = time.perf_counter()
    res = search(job70)
    elapsed = time.perf_counter() - t0
    assert res.ranked, explain(res)
    best = res.ranked[0]
    assert best.fits and best.memory.device_total <= 80 * GiB and best.job.world == 64
    speeds = [c.time.tokens_per_s for c in res.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert res.failures["device memory"] > 0  # e.g. DDP: 16 bytes x 70.6 B parameters per GPU
    print(f"\nsearched {res.considered} layouts in {elapsed:.2f} s; best:\n" + summary(plan(best.job)))
    text = explain(res, top=5, request=job70)
    assert "refused" in text and "ranks #" in text


def test_nearest_layouts_that_fit(job70):
    res = search(job70, Space(micro_batches=(1,), offloads=("none",)))
    ddp = job70.with_(zero=0)
    near = nearest(ddp, res.ranked)
    assert near and all(c.fits for c in near)
    assert near[0].job.layout.tp == ddp.layout.tp  # one knob away: the ZeRO stage


# --- outputs --------------------------------------------------------------------------------


def test_plan_json_and_png(job70, tmp_path):
    p = plan(job70)
    doc = json.loads(json.dumps(plan_dict(p)))
    for key in ("memory_per_gpu_bytes", "memory_breakdown_bytes", "host_memory_bytes", "step_time_s",
                "tokens_per_s", "tflops_per_gpu", "mfu"):
        assert key in doc
    assert doc["memory_per_gpu_bytes"] == pytest.approx(sum(doc["memory_breakdown_bytes"].values()))
    pytest.importorskip("matplotlib")
    out = save_memory_png([("requested", p)], str(tmp_path / "memory.png"))
    assert os.path.getsize(out) > 1000


def test_cli_prints_ranked_layouts_without_torch(tmp_path):
    script = ("import sys, runpy; sys.argv = ['hpctrain.plan', '+experiment=70b', 'cluster=h100', "
              f"'cluster.nodes=8', '--top', '5', '--json', {str(tmp_path / 'plan.json')!r}]\n"
              "try:\n    runpy.run_module('hpctrain.plan', run_name='__main__')\n"
              "except SystemExit as e:\n    assert not e.code, e.code\n"
              "assert 'torch' not in sys.modules, 'the planner imported torch'\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "best 5 by tokens/s" in proc.stdout and "requested layout" in proc.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["best"]["feasible"] and doc["best"]["tokens_per_s"] >= doc["requested"]["tokens_per_s"]
