"""What a block keeps for backward, measured (tests/regather_probe.py: the bytes of the tensors a forward
made that are still alive when backward starts), against the planner's per-block figure
(hpctrain.plan.memory.layer_activation_bytes); and what re-gathering the sequence-parallel inputs in
backward (parallel.sp_regather, hpctrain.parallel.regather) frees. The numerics are
tests/test_layouts.py's (the layouts match the Hugging Face reference with and without it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.launch.local import launch
from hpctrain.plan.memory import activations, boundary_bytes, job_of, layer_activation_bytes, pipeline_receives

WORKER = str(Path(__file__).with_name("regather_probe.py"))
TP = "parallel.tp=2 parallel.dp_shard=1"
# (blocks, re-gathered) -> layout; and data parallel only (dp 2, one micro-batch of 8 a rank)
LAYOUTS = {(n, again): f"{TP} model.n_layers={n}" + ("" if again else " parallel.sp_regather=false")
           for n in (2, 4) for again in (False, True)}
LAYOUTS.update({(n, "dp"): f"parallel=ddp train.global_batch=16 model.n_layers={n}" for n in (2, 4)})
PIPELINED = "parallel.tp=2 parallel.pp=2 parallel.dp_shard=1 parallel.pp_schedule=1f1b train.micro_batch=2"
PIPELINED_DDP = "parallel=ddp"  # no FSDP: autograd accumulates the gradients, a second one beside .grad
# bf16 over fp32 parameters (DDP, autocast), few tokens so that the weights' bf16 copies weigh
BF16 = "parallel=ddp train.precision=bf16 train.global_batch=2 train.micro_batch=1 data.seq_len=128"
LAYOUTS.update({(n, "bf16"): f"{BF16} model.n_layers={n}" for n in (2, 4)})


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("regather")
    rc = launch(d, 2, cmd=[sys.executable, WORKER, str(d / "out.json"), *LAYOUTS.values()])
    assert rc == 0, (d / "logs").as_posix()
    got = json.loads((d / "out.json").read_text())
    return {key: got[layout] for key, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """TP 2 x PP 2 (4 micro-batches), keeping and re-gathering: torch's pipeline stages infer their shapes
    with one forward the first stage never runs backward."""
    d = tmp_path_factory.mktemp("regather_pp")
    layouts = [f"{PIPELINED} parallel.sp_regather=false", PIPELINED, f"{PIPELINED} {PIPELINED_DDP}"]
    rc = launch(d, 4, cmd=[sys.executable, WORKER, str(d / "out.json"), *layouts])
    assert rc == 0, (d / "logs").as_posix()
    got = json.loads((d / "out.json").read_text())
    return tuple(got[layout] for layout in layouts)


@pytest.mark.slow
def test_the_embeddings_second_gradient_under_tp_is_what_the_planner_prices(pipelined):
    """Gradient accumulation under TP x PP without FSDP: the embedding's fresh gradient comes back
    replicated (vocab x dim), and adding it to the vocabulary-parallel .grad first copies out this rank's
    shard beside it. Mutant: the planner without that copy (accumulation_transient's 1 + 1/tp) reads
    2/3 of the measured bytes."""
    from hpctrain.plan.memory import accumulation_transient, stage_params
    from regather_probe import COMMON

    job = job_of(compose([*COMMON, "launcher.nproc=4", *PIPELINED.split(), PIPELINED_DDP]), 4)
    assert job.spec.data_parallel == "ddp" and job.spec.layout.tp == 2 and job.microbatches == 4
    want = accumulation_transient(job, stage_params(job, 0), 0.0)
    first_stage = [r for r in pipelined[2] if r["embedding_accumulation"] is not None]
    assert len(first_stage) == 2  # the two TP ranks of the first stage
    for r in first_stage:
        assert r["embedding_accumulation"] == pytest.approx(want, rel=0.02), (r, want)


@pytest.mark.slow
def test_nothing_is_left_behind_under_pipelining(pipelined):
    """A pack hook that kept a saved output with its grad_fn formed a cycle through the autograd graph,
    which that never-run-backward graph never breaks: the first stage kept one micro-batch of activations
    for the life of the process (+2.8 MiB here, +13 MiB with model=small)."""
    kept, again, _ = pipelined
    for k, a in zip(kept, again):
        assert k["loss"] == pytest.approx(a["loss"], rel=1e-6)
        for when in ("after_first", "after"):
            assert a[when] <= k[when] + 2**16, (when, k, a)


def test_pipeline_receive_buffers_are_what_the_planner_says(pipelined):
    """Between steps a TP 2 x PP 2 rank holds, beyond parameters and optimizer state, exactly the
    receive buffers torch's pipeline stages keep: one per micro-batch for the last stage's input and
    one per micro-batch for the first stage's output gradient, each 2 x 1024 tokens x 128 / 2 in
    fp32 (4 micro-batches: 2 MiB a rank). Caught: buffers not priced, or one per step."""
    from regather_probe import COMMON

    layout = "parallel.tp=2 parallel.pp=2 parallel.dp_shard=1 parallel.pp_schedule=1f1b train.micro_batch=2"
    job = job_of(compose([*COMMON, "launcher.nproc=4", *layout.split()]))
    for rank, got in enumerate(pipelined[1]):
        stage = rank // 2  # the mesh is pp-major: ranks 0-1 run the first stage
        buffers = pipeline_receives(job, stage) * boundary_bytes(job)
        assert buffers == 2 * 2**20
        assert got["beyond_state"] == pytest.approx(buffers, abs=2**16), (rank, got)


def predicted(layout: str) -> float:
    from regather_probe import COMMON

    job = job_of(compose([*COMMON, "launcher.nproc=2", *layout.split()]))
    return activations(job, 0)["activations"]


def freed(measured, n: int) -> list:
    return [kept["forward"] - again["forward"] for kept, again in zip(measured[n, False], measured[n, True])]


@pytest.mark.slow
def test_regather_frees_what_the_planner_says(measured):
    """Per rank, the bytes a forward leaves alive for backward fall by the gathered inputs of the
    column-parallel linears less this rank's half of them: 8 x 1024 tokens of dim 128 in fp32, 4 MiB
    per gathered input, 2 a block, each kept as a 2 MiB shard (8 MiB with 2 blocks, 16 with 4; the output
    layer, under the chunked loss, keeps no input). With hooks that pack nothing, or one shard per linear
    instead of per input, the figures differ."""
    pred = {n: predicted(LAYOUTS[n, False]) - predicted(LAYOUTS[n, True]) for n in (2, 4)}
    assert pred[2] == pytest.approx(8 * 2**20) and pred[4] == pytest.approx(16 * 2**20)
    for n in (2, 4):
        for kept, again in zip(measured[n, False], measured[n, True]):
            assert kept["loss"] == pytest.approx(again["loss"], rel=1e-6)
            assert kept["forward"] - again["forward"] == pytest.approx(pred[n], rel=0.02), (n, kept, again)

            # and nothing is left behind once a step is over (the shards go with the graph)
            for when in ("after_first", "after"):
                assert again[when] <= kept[when] + 2**16, (n, when, kept, again)


@pytest.mark.slow
def test_a_block_keeps_what_the_planner_says(measured):
    """Four blocks less two, per block: the planner's 6h + 2kv + 3ffn elements per token (h / tp
    where sequence- or tensor-parallel) within 3% (the rest: softmax statistics, RoPE slices). Caught:
    autograd's own RMSNorm (+ the fp32 copy and the normalized tensor, +12% in fp32) or SwiGLU
    (+ silu(w1), +19%), and TP keeping its gathered inputs while the plan says re-gathered."""
    from regather_probe import COMMON

    for tag in ("dp", True, False):
        per_block = [(b["forward"] - a["forward"]) / 2 for a, b in zip(measured[2, tag], measured[4, tag])]
        job = job_of(compose([*COMMON, "launcher.nproc=2", *LAYOUTS[4, tag].split()]))
        pred = layer_activation_bytes(job.model, 8 * 1024, job.spec.layout.tp, job.spec.precision, job.spec.sp_regather)
        print(f"\nper block, {tag}: measured/predicted", [round(x / pred, 4) for x in per_block])
        for x in per_block:
            assert x == pytest.approx(pred, rel=0.03), (tag, per_block, pred)


def test_autocast_blocks_keep_bf16_weight_copies_and_an_fp32_stream(measured):
    """Under autocast (bf16 over DDP's fp32 parameters) a block keeps, besides its bf16 activations,
    its norms' fp32 inputs (the residual stream stays fp32) and a bf16 copy of each of its weight
    matrices (autocast's cast, saved for backward): per block, measured within 3% of the planner's
    layer_activation_bytes(stream=4) + 2 bytes x the block's matrices (128 tokens, dim 128: the weight
    copies are ~40% of it). Caught: the weight copies not priced (-40%), the stream priced in bf16
    (-6%), and the norms leaving their outputs in fp32, which each linear then casts and keeps anew
    (wq, wk, wv: three copies; w1, w3: two; +10%)."""
    from hpctrain.core.flops import param_counts
    from regather_probe import COMMON

    job = job_of(compose([*COMMON, "launcher.nproc=2", *LAYOUTS[4, "bf16"].split()]))
    assert job.autocast
    m = job.model
    casts = 2 * (param_counts(m)["per_block"] - 2 * m.dim)
    pred = layer_activation_bytes(m, 128, 1, "bf16", stream=4) + casts
    per_block = [(b["forward"] - a["forward"]) / 2 for a, b in zip(measured[2, "bf16"], measured[4, "bf16"])]
    print("\nper block, bf16 autocast: measured/predicted", [round(x / pred, 4) for x in per_block],
          f"(weight copies {casts / pred:.0%})")
    for x in per_block:
        assert x == pytest.approx(pred, rel=0.03), (per_block, pred)


def test_a_later_micro_batch_makes_each_gradient_afresh_beside_grad():
    """What plan/memory.accumulation_transient prices, as autograd does it: the first micro-batch's
    gradient becomes .grad; a later one's is made afresh (seen by a tensor hook before AccumulateGrad
    adds it) while .grad is alive, a second gradient of the weight. For the tiny model with a 4096-word
    vocabulary the largest is the output layer's (and the embedding's, as large, comes last), and the
    planner's second gradient is its size. Caught: the second gradient not priced, or priced as a
    block's largest matrix."""
    import torch

    from hpctrain.models.llama import Llama
    from hpctrain.plan.memory import accumulation_transient, stage_params

    job = job_of(compose(["+experiment=tiny", "launcher.nproc=1", "parallel=ddp", "train.micro_batch=2",
                          "train.global_batch=4", "model.vocab_size=4096", "data.seq_len=64"]))
    assert job.microbatches == 2
    torch.manual_seed(0)
    model = Llama(job.model, 64)
    w = model.output.weight
    seen = []

    def fresh(g):
        grad = w.grad
        seen.append((g.untyped_storage().data_ptr(), g.nbytes,
                     None if grad is None else grad.untyped_storage().data_ptr()))

    w.register_hook(fresh)
    for _ in range(job.microbatches):
        tokens = torch.randint(0, job.model.vocab_size, (2, 64))
        model(tokens).float().logsumexp(-1).mean().backward()
    (_, _, before), (made, nbytes, kept) = seen
    assert before is None  # the first micro-batch's gradient becomes .grad
    assert kept is not None and made != kept and nbytes == w.nbytes  # the second comes beside it
    assert accumulation_transient(job, stage_params(job, 0), per_microbatch=0.0) == nbytes


def test_shared_autocast_casts_hold_each_weight_gradient_to_the_end_of_a_backward():
    """What plan/memory.cast_weight_grads prices, as autograd does it. Pipelined, one autocast region
    spans the step, so every micro-batch shares the weights' bf16 casts, made in the first one's
    forward. Autograd runs the latest-made ready node first, so in a later micro-batch's backward the
    casts' ToCopyBackward nodes come last and each bf16 weight gradient (made by aten.mm) waits for
    them: when the backward reaches the first layer's input every layer's is still alive. With a region
    per micro-batch (the engine without pipelining) at most one is. Caught: cast_grads not priced, or
    priced without pipelining."""
    import torch
    from regather_probe import Made

    torch.manual_seed(0)
    layers, dim = 4, 64
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])

    def weight_grad(func, t):  # a bf16 [dim, dim] matmul output: a weight gradient (tokens x dim inputs)
        return func is torch.ops.aten.mm.default and t.dtype == torch.bfloat16 and t.shape == (dim, dim)

    def alive_at_first_input(shared: bool) -> int:
        made, counts = Made(keep=weight_grad), []
        xs = [torch.randn(32, dim, requires_grad=True) for _ in range(2)]
        xs[1].register_hook(lambda g: counts.append(made.alive()))
        with made:
            if shared:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ys = [net(x) for x in xs]
                    for y in ys:
                        y.float().sum().backward()
            else:
                for x in xs:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        net(x).float().sum().backward()
        return counts[0]

    assert alive_at_first_input(shared=True) == layers
    assert alive_at_first_input(shared=False) <= 1

    from hpctrain.plan.memory import cast_weight_grads, stage_memory, stage_params, transients

    # model=small as benchmarks/layouts.py runs it, whose first stage peaks at the end of a backward
    # (bf16 measured/predicted 1.03 with cast_grads priced, 1.03-1.09 before)
    small = ["launcher.nproc=2", "parallel.zero=0", "train.precision=bf16", "model=small", "data.seq_len=128",
             "train.micro_batch=2", "train.global_batch=16"]
    piped = job_of(compose([*small, "parallel.dp_shard=1", "parallel.pp=2"]))
    assert piped.autocast and piped.microbatches > 1
    dev = stage_memory(piped, 0)[0]
    assert dev.get("cast_grads") == dev["weight_casts"] > 0
    flat = job_of(compose([*small, "parallel.dp_shard=2"]))
    assert flat.autocast and flat.microbatches > 1
    assert transients(flat, stage_params(flat, 0))["weight_casts"] > 0
    assert cast_weight_grads(flat, transients(flat, stage_params(flat, 0))) == 0.0
