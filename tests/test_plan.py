"""The planner (hpctrain.plan): memory, step time and layout search by arithmetic, no torch.

Anchors (docs/measurements.md): 16 bytes per parameter for mixed-precision Adam, Megatron-LM's
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

from hpctrain.core.compose import compose
from hpctrain.core.spec import Layout
from hpctrain.core.flops import param_counts
from hpctrain.plan.memory import (GiB, activations, in_flight, in_flight_with_grads, job_of, layer_activation_bytes,
                                  memory, model_state, stage_memory)
from hpctrain.plan.verdict import (MEGATRON_H100, calibration, calibration_table, explain, plan, plan_dict,
                                  save_plan_png, summary)
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
    assert job8.spec.layout.dp == 8
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
    assert job8.spec.layout.tp == 1 and job8.zero_group == 8
    # FSDP2 with offload (tp=1) keeps the fp32 parameter and gradient shards on the host too: the device
    # sheds master + moments (12P/8) and its bf16 parameter and gradient shards (4P/8) ...
    assert on.device_total - cpu.device_total == pytest.approx(16 * p / 8, rel=1e-6)
    assert "params" not in cpu.device and "grads" not in cpu.device
    # ... and the host holds fp32 parameters (the master weights), fp32 gradients and moments.
    assert {k: cpu.host_per_rank[k] for k in ("params_fp32", "grads_fp32", "moments")} == pytest.approx(
        {"params_fp32": 4 * p / 8, "grads_fp32": 4 * p / 8, "moments": 8 * p / 8})
    assert cpu.host_per_node > on.host_per_node
    assert nvme.nvme_per_node == pytest.approx(8 * p / 8 * 8) and "moments" not in nvme.host_per_rank
    assert nvme.host_per_rank["params_fp32"] == pytest.approx(4 * p / 8)
    # With tensor parallel the parameters stay on the device and only master + moments leave it.
    tp_on, tp_cpu = (memory(job8.with_(zero=3, offload=o, layout=Layout(pp=1, dp_replicate=1, dp_shard=4, tp=2))) for o in ("none", "cpu"))
    assert tp_cpu.device["params"] > 0 and tp_cpu.device["grads"] > 0
    assert tp_cpu.host_per_rank["master"] + tp_cpu.host_per_rank["moments"] == pytest.approx(12 * (p / 2) / 4, rel=0.02)
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


# The order in which torch's schedules run one stage's forwards (F) and backwards (B) over a step,
# by (schedule, pp, micro-batches, stage); test_schedule_orders_are_torchs regenerates them from torch.
TORCH_ORDERS = {
    ("1f1b", 2, 2, 0): "F0F1B0B1", ("1f1b", 2, 2, 1): "F0B0F1B1",
    ("1f1b", 2, 4, 0): "F0F1B0F2B1F3B2B3", ("1f1b", 2, 4, 1): "F0B0F1B1F2B2F3B3",
    ("1f1b", 4, 4, 0): "F0F1F2F3B0B1B2B3", ("1f1b", 4, 4, 1): "F0F1F2B0F3B1B2B3",
    ("1f1b", 4, 4, 3): "F0B0F1B1F2B2F3B3",
    ("1f1b", 4, 8, 0): "F0F1F2F3B0F4B1F5B2F6B3F7B4B5B6B7", ("1f1b", 4, 8, 2): "F0F1B0F2B1F3B2F4B3F5B4F6B5F7B6B7",
    ("gpipe", 2, 2, 0): "F0F1B0B1", ("gpipe", 4, 8, 1): "F0F1F2F3F4F5F6F7B0B1B2B3B4B5B6B7",
}


def _held(order: str) -> tuple[int, int]:
    """(most micro-batches alive, most alive once the first backward is done): gradients are None at
    the start of a step and exist from the first backward on, which frees its micro-batch."""
    alive = most = with_grads = 0
    grads = False
    for op in order[::2]:
        alive += 1 if op == "F" else -1
        grads = grads or op == "B"
        most = max(most, alive)
        with_grads = max(with_grads, alive) if grads else with_grads
    return most, with_grads


def test_pipeline_in_flight_follows_torch_schedules():
    for (sched, pp, m, stage), order in TORCH_ORDERS.items():
        assert (in_flight(sched, pp, m, 1, stage), in_flight_with_grads(sched, pp, m, 1, stage)) == _held(order), \
            (sched, pp, m, stage, order)
    # Stage 0 at m == pp runs every forward before its first backward: pp micro-batches without
    # gradients, pp - 1 with them. Stage 0 at m > pp and the last stage (m > 1) have a forward
    # after the first backward: as many with gradients as without.
    assert in_flight("1f1b", 2, 2, 1, 0) == 2 and in_flight_with_grads("1f1b", 2, 2, 1, 0) == 1
    assert in_flight_with_grads("1f1b", 2, 4, 1, 0) == 2 and in_flight_with_grads("1f1b", 2, 2, 1, 1) == 1
    # No pipeline: one micro-batch's backward frees its activations as it fills the gradients; a
    # second micro-batch's forward runs with the first one's gradients.
    assert in_flight_with_grads("1f1b", 1, 1, 1) == 0 and in_flight_with_grads("1f1b", 1, 4, 1) == 1


def test_schedule_orders_are_torchs():
    """TORCH_ORDERS is what torch's own schedule loops do: run them on a stage that only records."""
    import torch.distributed.pipelining.schedules as S

    class RecordingStage:
        def __init__(self, stage, pp):
            self.stage_index, self.num_stages, self.has_backward = stage, pp, True
            self.is_first, self.is_last = stage == 0, stage == pp - 1
            self.order = ""

        def forward_one_chunk(self, i, *args, **kw):
            self.order += f"F{i}"

        def backward_one_chunk(self, i, *args, **kw):
            self.order += f"B{i}"

        def __getattr__(self, name):  # p2p ops (none: one process), grad scaling and the rest
            return (lambda *a, **k: []) if name.endswith("_ops") else (lambda *a, **k: None)

    classes = {"1f1b": S.Schedule1F1B, "gpipe": S.ScheduleGPipe}
    for (sched, pp, m, stage), order in TORCH_ORDERS.items():
        st = RecordingStage(stage, pp)
        schedule = classes[sched](st, n_microbatches=m)
        schedule._initialize_stage = lambda *a, **k: None
        schedule._step_microbatches([()] * m, [{}] * m)
        assert st.order == order, (sched, pp, m, stage)


def test_pipeline_first_stage_peak_holds_one_microbatch_with_gradients():
    # benchmarks/layouts.py's pp2: the small model, 2 stages, 2 micro-batches of 2 x 128 tokens, fp32.
    job = job_of(compose(["+experiment=tiny", "model=small", "data.seq_len=128", "train.micro_batch=2",
                          "train.global_batch=4", "parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b",
                          "launcher.nproc=2"]), 2)
    assert job.microbatches == 2
    one = layer_activation_bytes(job.model, 2 * 128, 1, "fp32") * 4  # 4 blocks a stage
    dev0 = stage_memory(job, 0)[0]
    assert activations(job, 0)["activations"] == pytest.approx(2 * one)  # both forwards before B0
    # The peak is the end of B0: every gradient, one micro-batch (the old count held two).
    assert dev0["activations"] == pytest.approx(one) and dev0["grads"] == pytest.approx(4 * job_params(job, 0))
    # Gradients smaller than a micro-batch's activations (e.g. a 32k-token micro-batch): the peak is
    # the end of the warm-up instead, both micro-batches and no gradients.
    long = job.with_(seq_len=32768)
    dev_long = stage_memory(long, 0)[0]
    assert "grads" not in dev_long and dev_long["activations"] == pytest.approx(activations(long, 0)["activations"])
    # With 4 micro-batches a forward follows B0: both micro-batches and the gradients.
    four = stage_memory(job.with_(global_batch=8), 0)[0]
    assert four["activations"] == pytest.approx(2 * one) and four["grads"] == dev0["grads"]


def test_ddp_buckets_copy_every_gradient(job8):
    # DDP's reducer keeps a flat copy of every gradient (buckets of 25 MiB chunk it, all are allocated).
    ddp = memory(job8.with_(zero=0)).device
    assert ddp["ddp_buckets"] == pytest.approx(ddp["grads"])
    assert "ddp_buckets" not in memory(job8.with_(zero=2)).device


def job_params(job, stage: int) -> float:
    from hpctrain.plan.memory import stage_params

    return stage_params(job, stage).total


def test_infeasible_request_says_why():
    # 70B replicated (DDP) on one node: 16 bytes per parameter cannot fit.
    job = job_of(compose(["model=70b", "cluster=h100", "launcher.name=slurm", "cluster.nodes=1",
                          "train.precision=bf16", "parallel.zero=0", "train.global_batch=8", "train.micro_batch=1"]))
    p = plan(job)
    assert not p.fits
    assert "device memory" in p.problems[0] and "parallel.zero=1" in p.problems[0]
    assert p.memory.device_total > 1000 * GiB
    # Structure: 64 heads do not split over 3 ranks; 80 layers do over 3 stages (unevenly), not over 83.
    bad = evaluate(job.with_(layout=Layout(pp=3, dp_replicate=1, dp_shard=1, tp=3), zero=3))
    assert "model.n_heads % tp" in bad.reasons and not any("n_layers" in r for r in bad.reasons)
    assert "stages > n_layers + 2" in evaluate(job.with_(layout=Layout(pp=83, dp_replicate=1, dp_shard=1, tp=1))).reasons
    assert any("parallel.tp=3" in m for m in bad.problems)


# --- time -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_refusals_quote_the_problem_they_count():
    """Each refusal line's example quotes that refusal's own message, not the example's first problem
    (a layout refused for device and host memory counted under host memory quoted its device memory)."""
    job = job_of(compose(["+experiment=70b", "cluster.host_mem_gb=64"]))
    res = search(job, Space(zeros=(1, 3), offloads=("none", "cpu"), micro_batches=(1, 4)))
    text = explain(res)
    lines = [line for line in text.splitlines() if " x " in line and "(e.g. " in line]
    assert any(len(res.examples[r].reasons) > 1 for r in res.failures), res.failures  # the case exists
    for line in lines:
        reason = line.split(" x ", 1)[1].split("  (e.g. ")[0]
        ex = res.examples[reason]
        assert ex.problems[ex.reasons.index(reason)] in line, (reason, line)


@pytest.mark.slow
def test_pipeline_receive_buffers_refuse_a_long_sequence_pipeline_with_their_fix():
    """torch's pipeline stages keep a receive buffer per micro-batch and direction (plan/memory.
    pipeline_buffers): 256 micro-batches of 64K tokens, 256 MiB a buffer, 256 of them per direction for
    each of a rank's 2 stages: ~190 GiB on the worst rank, more than everything else there; the refusal
    names them and what shrinks them."""
    job = job_of(compose(["model=1b", "cluster=h100", "launcher=sbatch", "cluster.nodes=1", "cluster.gpus_per_node=8",
                          "parallel.pp=8", "parallel.dp_shard=1", "parallel.ac=full", "data.seq_len=65536",
                          "train.global_batch=256", "train.micro_batch=1", "train.precision=bf16",
                          "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"]))
    mem = memory(job)
    assert mem.device["pipeline_buffers"] == max(mem.device.values()) > 100 * GiB, mem.device
    assert any("largest part pipeline_buffers" in p and "fewer micro-batches a step" in p
               and "fewer parallel.pp_virtual_stages" in p for p in mem.problems), mem.problems


def test_search_refuses_pipelines_with_fewer_micro_batches_than_stages(job8):
    """As the login check does (torch's schedules refuse it): such a layout is never ranked."""
    from hpctrain.plan.search import layout_problems

    few = job8.with_(layout=Layout(pp=4, dp_replicate=1, dp_shard=2, tp=1), micro_batch=8, zero=1)
    assert few.microbatches < 4
    assert "micro-batches < pp" in [r for r, _ in layout_problems(few)]
    enough = few.with_(micro_batch=1)
    assert enough.microbatches >= 4 and "micro-batches < pp" not in [r for r, _ in layout_problems(enough)]
    res = search(job8, Space(zeros=(1,), micro_batches=(1, 8)))
    assert all(c.job.microbatches >= c.job.spec.layout.pp for c in res.ranked)


def test_calibration_against_megatron_h100(h100):
    rows = calibration(h100)
    print("\nMegatron-LM H100 table, TFLOP/s per GPU (Megatron-LM README):\n" + calibration_table(rows))
    assert len(rows) == len(MEGATRON_H100) == 9
    # Held out (the H100 constants are fitted on PyTorch FSDP runs), so the held-out bound: the worst is
    # 70B at -13% with these fixed knobs (micro-batch 1); tests/test_published.py, whose unpublished
    # knobs take the fastest value that fits, has the same row at +4%.
    off = [r["model"] for r in rows if abs(r["error"]) > 0.15]
    assert not off, "outside 15%: " + ", ".join(off) + "\n" + calibration_table(rows)


def test_step_time_parts(job8):
    t = throughput(job8)
    assert sum(t.breakdown.values()) == pytest.approx(t.step_time_s)
    assert t.tokens_per_s == pytest.approx(job8.spec.global_batch * job8.spec.seq_len / t.step_time_s)
    assert 0 < t.mfu < 1 and t.tflops_per_gpu == pytest.approx(t.mfu * job8.cluster.peak_tflops)
    # Full recompute costs about a third more compute, less the block's last linear (w2: 27% of a
    # 70B block's matmuls), which torch's checkpoint does not rerun; none costs nothing.
    m = job8.model
    w2 = m.ffn_dim * m.dim / (param_counts(m)["per_block"] - 2 * m.dim)
    assert t.breakdown["recompute"] / t.breakdown["compute"] == pytest.approx((1 - w2) / 3, abs=0.03)
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
    assert tcol["tp", "reduce_scatter"]["count"] == tp.microbatches * (4 * layers + 1)
    # parallel.sp_regather (the default): backward gathers each block's two inputs and the output layer's again
    assert tcol["tp", "all_gather"]["count"] == tp.microbatches * (6 * layers + 2)
    kept = {(c["dim"], c["op"]): c for c in throughput(tp.with_(sp_regather=False)).collectives}
    assert kept["tp", "all_gather"]["count"] == tp.microbatches * (4 * layers + 1)
    assert tcol["tp", "all_gather"]["busbw_gbps"] == tp.cluster.intra_node_gbps  # TP stays in the node


def test_zero1_is_priced_as_each_engine_runs_it(job8):
    """hpctrain's ZeRO-1 (DDP or FSDP2's replicate, then ZeroRedundancyOptimizer / ShardedOptimizer)
    all-reduces the fp32 gradients and broadcasts the updated fp32 parameters after the step, in line;
    Megatron's distributed optimizer reduce-scatters the gradients and all-gathers 16-bit parameters."""
    from hpctrain.plan.throughput import HPCTRAIN, MEGATRON

    p = param_counts(job8.model)["total"]
    for lay in (job8.spec.layout, Layout(pp=1, dp_replicate=1, dp_shard=4, tp=2)):
        job = job8.with_(layout=lay, zero=1, ac="none")
        mine = throughput(job, HPCTRAIN)
        by = {(c["dim"], c["op"]): c for c in mine.collectives}
        assert set(by) >= {("dp", "all_reduce"), ("dp_shard", "broadcast")}, set(by)
        assert by["dp", "all_reduce"]["bytes_per_step"] == pytest.approx(4 * p / lay.tp, rel=0.01)
        assert by["dp_shard", "broadcast"]["bytes_per_step"] == pytest.approx(4 * p / lay.tp, rel=0.01)
        assert mine.breakdown["dp_exposed"] >= by["dp_shard", "broadcast"]["time_s"]  # after the step: exposed
        meg = {(c["dim"], c["op"]): c for c in throughput(job, MEGATRON).collectives}
        assert meg["dp_shard", "all_gather"]["bytes_per_step"] == pytest.approx(2 * p / lay.tp, rel=0.01)
        assert ("dp_shard", "broadcast") not in meg


def test_zero3_under_pipelining_keeps_the_stage_gathered(job8):
    """With pipelining the engine does not reshard after forward (spec.sharding): each micro-batch gathers
    the stage's parameters once (not again for backward), and at the peak the whole stage is gathered,
    in bf16, beside the rank's shard. Measured on CPU: benchmarks/layouts.py zero3_pp2_dp2, 0.98-1.00."""
    from hpctrain.plan.memory import stage_params

    pp = job8.with_(layout=Layout(pp=2, dp_replicate=1, dp_shard=4, tp=1), zero=3, ac="none", schedule="1f1b")
    assert not pp.spec.sharding.reshard_after_forward
    dev = stage_memory(pp, 0)[0]
    assert dev["gathered_params"] == pytest.approx(2 * stage_params(pp, 0).total)
    # one all-gather per FSDP unit (each block, the embedding, the output layer) and micro-batch
    gathers = {(c["dim"], c["op"]): c for c in throughput(pp).collectives}["dp_shard", "all_gather"]
    # (of the slowest stage: the first holds the embedding, the last the output layer)
    units = {r: pp.stage_layers(r) + pp.first(r) + pp.last(r) for r in (0, 1)}
    r = next(r for r in units if gathers["count"] == pp.microbatches * units[r])
    assert gathers["bytes_per_step"] == pytest.approx(pp.microbatches * 2 * stage_params(pp, r).total)
    flat = job8.with_(zero=3, ac="none")  # without pipelining: resharded after forward, gathered twice
    assert "gathered_params" not in stage_memory(flat, 0)[0]
    assert {(c["dim"], c["op"]): c for c in throughput(flat).collectives}["dp_shard", "all_gather"]["count"] \
        == 2 * flat.microbatches * (flat.model.n_layers + 2)


@pytest.mark.slow
def test_tp_overlap_hides_no_more_than_the_gemm_it_pairs_with():
    """An overlapping engine (Megatron's userbuffers, torch's async TP) hides a sequence-parallel collective
    behind the GEMM it feeds, never more than that GEMM's time. Llama 3 8B at TP 8 has 512-wide
    attention shards, whose GEMMs are shorter than their all-gathers: more of its TP traffic stays exposed
    than the engine's nominal 10%, and more than on the 70B, whose wider shards hide it. torch's async
    TP hides the forward's collectives only (its authors: ~29% faster forward, ~8% end to end)."""
    from dataclasses import replace

    from hpctrain.plan.throughput import MEGATRON, TORCH_ASYNC_TP

    def exposed_share(model, sw=MEGATRON):
        job = job_of(compose([*H100_8B, f"model={model}", "parallel.tp=8", "cluster.nodes=2", "parallel.ac=none"]))
        inline, overlapped = throughput(job, replace(sw, tp_overlap=0.0, tp_overlap_bwd=None)), throughput(job, sw)
        assert inline.breakdown["tp_exposed"] == pytest.approx(sum(
            c["time_s"] for c in inline.collectives if c["dim"] == "tp"))  # nothing hidden in line
        return overlapped.breakdown["tp_exposed"] / inline.breakdown["tp_exposed"]

    small, large = exposed_share("8b"), exposed_share("70b")
    assert small > 1.5 * (1 - MEGATRON.tp_overlap), small  # uncapped: exactly 10%
    assert (1 - MEGATRON.tp_overlap) <= large < small, (large, small)
    # forward only: the backward's traffic (4 collectives a block, plus the re-gathers) stays exposed
    assert 0.5 < exposed_share("70b", TORCH_ASYNC_TP) < 0.75


def test_pipeline_bubble(job8):
    # A small vocabulary: the engine's parameter-balanced split then gives every schedule the same
    # blocks per rank, so the bubbles differ by the schedule alone.
    from dataclasses import replace

    job = job8.with_(layout=Layout(pp=4, dp_replicate=1, dp_shard=2, tp=1), zero=1, ac="none",
                     model=replace(job8.model, vocab_size=256))
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


@pytest.mark.slow
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
    assert near[0].job.spec.layout.tp == ddp.spec.layout.tp  # one knob away: the ZeRO stage


# --- outputs --------------------------------------------------------------------------------


def test_plan_json_and_png(job70, tmp_path):
    p = plan(job70)
    doc = json.loads(json.dumps(plan_dict(p)))
    for key in ("memory_per_gpu_bytes", "memory_breakdown_bytes", "host_memory_bytes", "step_time_s",
                "tokens_per_s", "tflops_per_gpu", "mfu"):
        assert key in doc
    assert doc["memory_per_gpu_bytes"] == pytest.approx(sum(doc["memory_breakdown_bytes"].values()))
    out = save_plan_png([("requested", p)], str(tmp_path / "memory.png"))
    assert os.path.getsize(out) > 1000


@pytest.mark.slow
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


@pytest.mark.slow
def test_hardware_flops_add_the_recomputed_forward():
    """hw_tflops_per_gpu = model FLOPs + recomputation. Megatron's checkpointing reruns a block's whole
    forward: 8 instead of 6 FLOPs per parameter and token (Korthikanti et al. 2022); torch's
    non-reentrant checkpoint, which hpctrain runs, stops before the block's last linear (w2)."""
    from hpctrain.plan.throughput import HPCTRAIN, MEGATRON

    base = ["+experiment=70b", "dry_run=true"]
    none, full, half = (job_of(compose([*base, *ac])) for ac in
                        (["parallel.ac=none"], ["parallel.ac=full"], ["parallel.ac=selective", "parallel.ac_every=2"]))
    t = throughput(none)
    assert t.hw_tflops_per_gpu == pytest.approx(t.tflops_per_gpu)
    m, s = full.model, full.spec.seq_len
    attn = 2 * m.n_layers * m.dim * s  # the forward's attention scores per token, over the causal half
    model = 6 * (param_counts(m)["total"] - m.vocab_size * m.dim) + 3 * attn
    for sw, rerun in ((MEGATRON, 2 * param_counts(m)["blocks"] + attn),
                      (HPCTRAIN, 2 * (param_counts(m)["blocks"] - m.n_layers * m.ffn_dim * m.dim) + attn)):
        f = throughput(full, sw)
        assert f.hw_tflops_per_gpu / f.tflops_per_gpu - 1 == pytest.approx(rerun / model, rel=1e-3), sw.name
        h = throughput(half, sw)
        assert h.hw_tflops_per_gpu / h.tflops_per_gpu - 1 == pytest.approx(rerun / model / 2, rel=0.02), sw.name
    # the rerun forward is also in the step time: less of it without w2
    assert throughput(full, HPCTRAIN).breakdown["recompute"] < throughput(full, MEGATRON).breakdown["recompute"]
    assert plan_dict(plan(full))["hw_tflops_per_gpu"] == pytest.approx(throughput(full).hw_tflops_per_gpu)


def test_checkpointed_block_reruns_what_the_planner_prices():
    """torch's own FLOP counter over backward, checkpointed block minus plain block: what activation
    checkpointing reruns. It stops once the last tensor backward needs is recomputed, so w2 never runs
    again (torch >= 2.1's non-reentrant checkpoint, which hpctrain.parallel.activation applies)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hpctrain.core.schema import ModelConfig
    from hpctrain.core.flops import recompute_flops_per_token
    from hpctrain.models.llama import Block, rope_tables
    from hpctrain.parallel.activation import apply_ac

    m = ModelConfig(name="t", dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=352, vocab_size=64)
    b, s = 2, 64
    rope = rope_tables(m, s)

    def backward_flops(ac: str) -> int:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": Block(m)})
        apply_ac(model, ac)
        x = torch.randn(b, s, m.dim, requires_grad=True)
        y = model.layers["0"](x, rope)
        with FlopCounterMode(display=False) as counter:
            y.sum().backward()
        # matmuls only: the CPU attention kernel has no FLOP formula registered, so it counts 0 either way
        return sum(v for k, v in counter.get_flop_counts()["Global"].items() if str(k) in ("aten.mm", "aten.bmm"))

    rerun = backward_flops("full") - backward_flops("none")
    attention = 2 * m.n_heads * (m.dim // m.n_heads) * s  # the forward's scores over the causal half
    priced = recompute_flops_per_token(m, s, 1, last_linear=False) - attention - 2 * 2 * m.dim  # less the norm weights
    assert rerun == pytest.approx(priced * b * s, rel=1e-9)
    whole = recompute_flops_per_token(m, s, 1) - attention - 2 * 2 * m.dim
    assert rerun < 0.8 * whole * b * s  # the mutant "checkpoint reruns the whole forward"


@pytest.mark.slow
def test_cpu_ranks_are_priced_as_cpu_processes_and_local_nvme_is_the_paths_free_space(tmp_path):
    # 8 local CPU ranks: ~0.35 GiB each (measured), not a GPU rank's 3 GiB of host state.
    cfg = compose(["launcher.nproc=8", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2"])
    p = plan(job_of(cfg))
    assert p.fits, p.problems
    assert p.memory.host_per_rank["process"] <= GiB
    gpu = plan(job_of(compose(["+experiment=70b"])))
    assert gpu.memory.host_per_rank["process"] >= 2 * GiB
    # offload=nvme on the local launcher: the capacity is what offload.path has free.
    cfg = compose(["offload=nvme", f"offload.path={tmp_path}"])
    job = job_of(cfg)
    assert job.cluster.nvme_gb == pytest.approx(__import__("shutil").disk_usage(tmp_path).free / GiB, rel=0.01)
    assert plan(job).fits
    slurm = job_of(compose(["offload=nvme", f"offload.path={tmp_path}", "launcher=slurm"]))
    assert slurm.cluster.nvme_gb == 0  # a cluster's nodes are not this machine: the preset speaks


@pytest.mark.slow
def test_grad_sync_is_priced_as_the_engine_runs_it():
    """The 70b experiment (tp 8, zero 3, 32 micro-batches of 1): reducing once per step saves the 31
    reduce-scatters but holds every gradient of the rank unsharded in fp32 (FSDP2's accumulated
    gradient): 70.6e9 / 8 x 4 bytes = 33 GiB, in place of the 1/8 of that the sharded gradients take."""
    base = ["+experiment=70b", "dry_run=true"]
    per_mb, per_step = (plan(job_of(compose([*base, f"parallel.grad_sync={s}"]))) for s in ("microbatch", "step"))
    auto = plan(job_of(compose(base)))
    assert auto.job.spec.grad_sync == "microbatch" and auto.memory.device_total == per_mb.memory.device_total
    extra = per_step.memory.device["unsharded_grads"]
    assert extra == pytest.approx(4 * 70_553_706_496 / 8, rel=0.01)  # blocks, embedding and output, /tp
    assert "unsharded_grads" not in per_mb.memory.device and "grads" not in per_step.memory.device
    # The sharded gradients (1/dp of them) appear only as the unsharded ones are reduced and freed.
    assert per_step.memory.device_total - per_mb.memory.device_total == \
        pytest.approx(extra - per_mb.memory.device["grads"], rel=0.01)

    def reduce_scatters(p):
        return sum(c["count"] for c in p.time.collectives if c["op"] == "reduce_scatter" and c["dim"] == "dp_shard")
    assert reduce_scatters(per_mb) == 32 * reduce_scatters(per_step)
    # DDP and ZeRO-1 reduce once per step anyway; pipelining always does (torch's stages).
    assert plan(job_of(compose([*base, "parallel.zero=1"]))).job.spec.grad_sync == "step"
    pp = plan(job_of(compose([*base, "parallel.pp=2", "parallel.tp=4"])))
    assert pp.job.spec.grad_sync == "step" and pp.memory.device.get("unsharded_grads", 0) > 0


@pytest.mark.slow
def test_grad_sync_microbatch_with_pipelining_is_refused():
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "parallel.pp=2", "parallel.dp_shard=1",
                           "parallel.grad_sync=microbatch", "dry_run=true"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "parallel.grad_sync=microbatch does not apply with pipelining" in proc.stderr
    assert "Fix: parallel.grad_sync=auto" in proc.stderr


# --- issue 42: the planner answers the question asked -----------------------------------------------


@pytest.mark.slow
def test_a_gpu_cluster_sizes_the_planners_world():
    """`python -m hpctrain.plan model=qwen3_30b_a3b cluster=h100 cluster.nodes=2` planned the 2 ranks of
    launcher=local's nproc, silently. Now the cluster's GPUs, said so; a launcher named stands. Mutant caught:
    the planner sized by the launcher (login.world_rule adding no launcher): a world of 2."""
    from hpctrain.plan.__main__ import request_of

    asked = ["model=qwen3_30b_a3b", "cluster=h100", "cluster.nodes=2"]
    cfg, note = request_of(asked)
    job = job_of(cfg)
    assert (job.world, job.cluster.nodes) == (16, 2)
    assert "16 GPUs, cluster.nodes=2 x cluster.gpus_per_node=8" in note and "launcher.nproc=N" in note
    cfg, note = request_of([*asked, "launcher.nproc=4"])  # asked for: 4 ranks on this machine
    assert job_of(cfg).world == 4 and "launcher.nproc=4" in note and "Fix: launcher=sbatch" in note
    cfg, note = request_of(["+experiment=tiny"])  # a CPU cluster: the local launcher's ranks, nothing to say
    assert job_of(cfg).world == 2 and not note


MASKED_128K = ["+experiment=llama31_8b_128k", "data.document_mask=true", "data.eos_id=2", "data.synthetic_doc_len=2048"]


def test_a_document_masked_plan_counts_the_flops_it_computes():
    """llama31_8b_128k with a document mask printed MFU 150%: its FLOPs counted all of attention (PaLM's
    whole s x s), its time only the pairs the mask keeps. The FLOPs counted are those computed, written
    out here: 6 per matmul parameter and token, and QK^T and PV (2 x 2 x heads x head_dim a pair forward,
    twice that backward) over the causal half of the keys times the share the mask keeps (documents of
    exponential length L: (2L/s)(1 - (L/s)(1 - e^(-s/L)))). Mutants caught: the mask's share left out of
    the FLOPs (MFU 150%); the whole s x s counted (the causal half not)."""
    import math

    job = job_of(compose(MASKED_128K))
    t = throughput(job)
    m, s, L = job.model, job.spec.seq_len, 2048
    kept = (2 * L / s) * (1 - (L / s) * (1 - math.exp(-s / L)))
    c = param_counts(m)
    matmuls = 6 * (c["total"] - c["embedding"])  # untied: the output projection is a matmul, the lookup is not
    attention = 3 * 2 * 2 * m.n_layers * m.n_heads * (m.dim // m.n_heads) * (s / 2) * kept
    counted = t.tflops_per_gpu * 1e12 * t.step_time_s * job.world
    assert counted == pytest.approx((matmuls + attention) * job.spec.global_batch * s, rel=1e-9)
    assert 0.05 < t.mfu <= 1.0
    assert "the causal half x the 3.1% the document mask keeps" in summary(plan(job))


def test_the_megatron_count_is_narayanan_eq3():
    """Beside its own FLOPs the plan prints Megatron-LM's: Narayanan et al. 2021 eq. (3),
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration (the whole s x s attention, the recompute
    forward counted), and the same without the recompute forward (72 for the blocks, as Megatron-LM r0.8
    logs it for its README's tables), computed here from their Table 1's GPT 1.7B row. Mutants caught: the causal half in
    Megatron's count, eq. (3) without its recompute term, the logits recomputed too."""
    import helpers  # noqa: F401  (the calibration, beside the package)
    from calibration import published as P
    from hpctrain.plan.throughput import megatron_flops_per_token

    row = next(p for p in P.load() if p.row["source"] == "narayanan2021_table1" and p.row["model"] == "GPT 1.7B")
    job = row.candidates[0]
    m, s = job.model, job.spec.seq_len
    h, l, v = 2304, 24, 51200
    assert (m.dim, m.n_layers, m.vocab_size, s) == (h, l, v, 2048)
    eq3 = 96 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)) / s  # per token (B s tokens an iteration)
    logged = eq3 - 96 * l * h * h * (1 + s / (6 * h)) / 4  # less the recomputed forward of the blocks
    assert megatron_flops_per_token(m, s, recompute=True) == pytest.approx(eq3, rel=1e-12)
    assert megatron_flops_per_token(m, s, recompute=False) == pytest.approx(logged, rel=1e-12)
    # the published TFLOP/s, converted with the source's own rule, come back through the planner's count
    assert row.tokens * megatron_flops_per_token(m, s) / 1e12 == pytest.approx(float(row.row["hw_tflops_per_gpu"]))
    p = plan(job)
    doc = plan_dict(p)
    per_gpu = p.time.tokens_per_s / job.world
    assert doc["megatron_eq3_tflops_per_gpu"] == pytest.approx(per_gpu * eq3 / 1e12)
    assert doc["megatron_tflops_per_gpu"] == pytest.approx(per_gpu * logged / 1e12)
    assert f"{per_gpu * logged / 1e12:.3g} TFLOP/s per GPU without its recompute term" in summary(p)
    assert f"{per_gpu * eq3 / 1e12:.3g} with it" in summary(p)


@pytest.mark.slow
def test_the_planner_refuses_a_document_mask_without_documents_as_the_dry_run_does(monkeypatch, capsys):
    """A document mask on synthetic data without data.eos_id: `hpctrain.plan` priced it (and ranked
    layouts, exit 0) where the dry run refused it. Both refuse it now, with the one check's words.
    Mutant caught: the planner without the refusal."""
    from hpctrain.__main__ import main as hpctrain_main
    from hpctrain.checks.config_checks import document_problems
    from hpctrain.plan.__main__ import main as plan_main

    monkeypatch.setattr("hpctrain.checks.cluster_checks.partition_facts", lambda *a, **k: None)
    asked = ["+experiment=llama31_8b_128k", "data.document_mask=true"]
    (why,) = document_problems(compose(asked))
    assert "needs data.eos_id" in why
    assert plan_main(asked) == 2
    assert why in capsys.readouterr().err
    assert hpctrain_main([*asked, "dry_run=true"]) == 2
    assert why in capsys.readouterr().err


@pytest.mark.slow
def test_masked_context_parallel_on_cuda_is_refused_not_priced():
    """On CUDA a document mask under cp runs hpctrain's chunk pairs as fp32 matmuls over whole 8K x 8K
    score matrices, which the planner prices neither in memory nor in time: the login node refuses it
    (config checks, hence dry runs and launches) and the search ranks no such layout. On CPU ranks (the
    CPU flash kernel, priced) it stands. Mutants caught: the check without the rule; the search without
    it (cp 8 layouts ranked)."""
    from hpctrain.checks.config_checks import problems

    cfg = compose(MASKED_128K)
    refused = [p for p in problems(cfg) if "on CUDA with hpctrain's attention kernel" in p]
    assert len(refused) == 1 and "8192 x 8192" in refused[0] and "Fix: data.document_mask=false" in refused[0]
    assert not [p for p in problems(compose([*MASKED_128K, "cluster=cpu"])) if "hpctrain's attention kernel" in p]
    assert not [p for p in problems(compose(MASKED_128K[:1])) if "hpctrain's attention kernel" in p]  # torch's ring
    job = job_of(cfg)
    res = search(job, Space(zeros=(3,), offloads=("none",), acs=("full",), micro_batches=(1,)))
    assert res.failures["cp on CUDA with hpctrain's kernel (unpriced)"] > 0
    assert all(c.job.spec.layout.cp == 1 for c in res.ranked)


# --- issue 45: the chunked loss, fp16 and fp8, searched --------------------------------------

# NeMo AutoModel's published Qwen3-30B-A3B layout (its performance summary, 2025-10: 8 H100, FSDP2 + EP 8,
# micro-batch 4, sequence 4096, global batch 512, bf16; 12,040 tokens/s per GPU, a fused linear cross-entropy)
QWEN3_30B = ["model=qwen3_30b_a3b", "cluster=h100", "launcher=sbatch", "parallel.dp_shard=8", "parallel.ep=8",
             "parallel.zero=3", "train.micro_batch=4", "data.seq_len=4096", "train.global_batch=512",
             "train.precision=bf16", "parallel.ac=full"]


def test_nemo_automodel_qwen3_30b_layout_fits_with_the_chunked_loss():
    """The whole logits of 4 x 4096 tokens over a 151,936 vocabulary (bf16 + fp32 copy + fp32 gradient,
    24.9 GB) took this layout to 92.6 GiB; the chunked loss (the default) holds one chunk's: tokens /
    ceil(vocab / dim) = 16384 / 75 -> 219, rounded up to 256 tokens (Liger's rule), at least 1024 tokens
    (hpctrain.core.shape.MIN_LOSS_CHUNK), in bf16 the matmul's output, its fp32 copy turned into the
    gradient in place, the gradient cast back and half a chunk of the weight gradient's GEMM (2 + 4 + 2 + 3
    bytes), plus the head input's gradient and the output weight's fp32 gradient until the head's
    backward. Mutants: the chunk's logits priced over the whole micro-batch; the held gradients left out;
    the floor left out."""
    chunked = job_of(compose(QWEN3_30B))
    mem = memory(chunked)
    assert mem.fits and mem.device_total < 80 * GiB, mem.problems
    V, d, tokens = 151936, 2048, 4 * 4096
    assert mem.device["logits"] == 1024 * V * (2 + 4 + 2 + 3)
    assert mem.device["loss_grads"] == tokens * d * 2 + V * d * 4
    full = memory(job_of(compose(QWEN3_30B + ["train.loss=full"])))
    assert full.device["logits"] == tokens * V * (2 + 4 + 4)
    assert not full.fits and "train.loss=chunked" not in full.problems[0]  # its largest part is the moments
    assert full.device_total - mem.device_total > 20 * GiB
    t = throughput(chunked)
    print(f"\nQwen3-30B-A3B, NeMo AutoModel's layout: {mem.device_total / GiB:.1f} GiB, "
          f"{t.tokens_per_s / chunked.world:,.0f} tokens/s per GPU predicted (12,040 published)")


def test_chunked_loss_costs_the_same_flops_in_thinner_gemms():
    """The chunked loss does the output layer's three GEMMs in the forward, chunk by chunk: the same FLOPs
    as the full logits, each chunk reading the whole output weight again. Priced slower than the full
    loss on the last stage, never faster (Llama 3 8B at 8K tokens: 8 chunks of 1024 tokens); under TP its
    two vocab-parallel all-reduces run per chunk. Mutants: the chunk GEMMs priced as one GEMM of the whole
    micro-batch (no slower), or with the backward's two GEMMs left out."""
    from hpctrain.plan import throughput as T

    job = job_of(compose(H100_8B + ["train.micro_batch=2"]))
    full = job.with_(loss="full")
    hw = T.Hardware.of(job)
    a, b = T.output_layer(job, hw, job.tokens), T.output_layer(full, hw, full.tokens)
    # 8192 / ceil(128256 / 4096) = 256 by Liger's rule, raised to the floor of 1024 tokens
    assert T.loss_chunk(job) == 1024 and T.loss_chunks(job) == 8
    assert a["fwd"] > 3 * 8 * hw.gemm(1024, 4096, 128256) >= 3 * hw.gemm(8192, 4096, 128256)
    assert b["fwd"] + b["bwd"] < a["fwd"] + a["bwd"] < 1.6 * (b["fwd"] + b["bwd"])
    tp = job.with_(layout=Layout(pp=1, dp_replicate=1, dp_shard=4, tp=2))
    ce = [c for c in throughput(tp).collectives if c["dim"] == "tp" and c["bytes"] == T.loss_chunk(tp) * 6]
    assert ce and ce[0]["count"] == 2 * tp.microbatches * T.loss_chunks(tp)


def test_fp16_prices_the_scaler_and_the_fp16_peak():
    """fp16 (V100, T4): bf16's bytes, the cluster's peak (the preset's fp16 figure), plus the GradScaler's
    unscale and inf check over the rank's fp32 gradients once a step (12 bytes each) and one flag
    all-reduce. Mutants: the scaler unpriced; fp16 priced at fp32's TF32 half rate."""
    v100 = job_of(compose(["model=1b", "cluster=v100", "launcher=sbatch", "train.precision=fp16",
                           "data.seq_len=2048", "train.global_batch=32", "train.micro_batch=1", "parallel.zero=3"]))
    t, c = throughput(v100), v100.cluster
    from hpctrain.plan import throughput as T
    grads = param_counts(v100.model)["total"] / v100.zero_group
    assert t.breakdown["loss_scaling"] == pytest.approx(grads * 12 / (c.hbm_gbps * 1e9), rel=0.2)
    assert t.breakdown["loss_scaling"] >= grads * 12 / (c.hbm_gbps * 1e9)
    assert T.Hardware.of(v100).flops == pytest.approx(c.peak_tflops * 1e12 * c.matmul_efficiency)
    assert "loss_scaling" not in throughput(v100.with_(precision="fp32")).breakdown


def test_search_tries_fp8_where_the_gpu_has_it_and_the_losses():
    """A bf16 request on H100 is also priced in fp8 (torchao's float8 linears) and each fitting layout with
    the other loss; on A100 (no FP8) never fp8, and a fp32 or fp16 request keeps its precision. The best's
    overrides reproduce it. Mutants: fp8 tried on A100 (the rule book refuses it there, so a fitting fp8
    row would mean the rules were skipped); precision missing from the choice (parallel=auto would not
    apply it)."""
    from hpctrain.core.spec import overrides_of, updated
    from hpctrain.plan.search import choice, knobs

    space = Space(zeros=(3,), offloads=("none",), acs=("full",), micro_batches=(1, 2))
    h100 = job_of(compose(H100_8B))
    res = search(h100, space)
    seen = {(knobs(c.job)["precision"], knobs(c.job)["loss"]) for c in res.ranked}
    assert seen == {("bf16", "chunked"), ("bf16", "full"), ("fp8", "chunked"), ("fp8", "full")}
    best = res.ranked[0]
    assert best.job.spec.precision == "fp8"
    chosen = updated(h100.spec.config, choice(best.job))
    assert "train.precision=fp8" in overrides_of(choice(best.job))
    again = job_of(chosen)
    assert knobs(again) == knobs(best.job)
    assert throughput(again).tokens_per_s == pytest.approx(best.time.tokens_per_s)
    a100 = job_of(compose([*H100_8B, "cluster=a100"]))
    assert {c.job.spec.precision for c in search(a100, space).ranked} == {"bf16"}
    fp32 = h100.with_(precision="fp32")
    assert {c.job.spec.precision for c in search(fp32, space).ranked} <= {"fp32"}
    forced = search(a100, replace_space(space, precisions=("bf16", "fp8")))
    assert {c.job.spec.precision for c in forced.ranked} == {"bf16"}  # the rules refuse fp8 on A100


def replace_space(space, **kw):
    from dataclasses import replace
    return replace(space, **kw)
