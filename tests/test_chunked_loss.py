"""train.loss=chunked (the default): the output layer and the loss a chunk of tokens at a time, each chunk's
gradients made in its forward (hpctrain.models.loss), equal to the whole logits' loss: against torch's own
cross_entropy and logsumexp in one process, and against train.loss=full on every kind of layout."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpctrain.launch.local import launch
from hpctrain.models.loss import IGNORE, chunked_loss

PROBE = str(Path(__file__).with_name("loss_probe.py"))


def reference(h, w, t, z):
    """torch's cross_entropy (summed over the trained tokens) plus z x logsumexp^2 of each trained token."""
    logits = (h @ w.t()).flatten(0, 1)
    t = t.flatten()
    keep = t != IGNORE
    return F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="sum") + \
        z * (torch.logsumexp(logits, -1).pow(2) * keep).sum()


def inputs(seed: int, tokens: int = 37, dim: int = 16, vocab: int = 50, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens, dim, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (2, tokens), generator=g)
    t[0, :7] = IGNORE  # a prompt: not trained
    t[1, -3:] = IGNORE
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 74, 1000, 0])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_chunked_equals_torch_cross_entropy(chunk, z):
    """Loss and both gradients equal torch's, whatever the chunk (uneven last chunks, a chunk of one token,
    one chunk for all, automatic), with ignored targets inside and at the ends of chunks, with and without
    z-loss; the incoming gradient (here 3) scales them. Catches: ignored tokens counted, a chunk boundary
    that drops or repeats tokens, a wrong z-loss gradient (factor 2 lse), the target's -1 left out, the
    backward not scaling by its incoming gradient."""
    h, w, t = inputs(chunk)
    ref = reference(h, w, t, z)
    (3 * ref).backward()
    want = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = chunked_loss(h, w, t, chunk, z)
    (3 * got).backward()
    # float64 throughout: any difference beyond rounding is a defect
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(h.grad, want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-10, atol=1e-12)


def test_every_target_ignored_gives_zero_loss_and_gradients():
    h, w, t = inputs(1)
    t[:] = IGNORE
    loss = chunked_loss(h, w, t, 8)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_no_grad_computes_the_loss_only():
    """Evaluation runs under no_grad: the same loss, and nothing kept for a backward."""
    h, w, t = inputs(2)
    with torch.no_grad():
        loss = chunked_loss(h, w, t, 8, 1e-3)
    torch.testing.assert_close(loss, reference(h, w, t, 1e-3).detach(), rtol=1e-12, atol=0)
    assert loss.grad_fn is None


def test_bf16_hidden_states_with_fp32_weight_as_autocast_runs_them():
    """DDP/ZeRO-1 under bf16: h in bf16 (autocast's), the weight fp32: the matmuls run in bf16 as the full
    path's autocast linear does, the gradients come back in each input's dtype."""
    h, w, t = inputs(3, dtype=torch.float32)
    hb = h.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hb, w).flatten(0, 1).float(), t.flatten(), ignore_index=IGNORE,
                              reduction="sum")
    ref.backward()
    want = hb.grad.clone(), w.grad.clone()
    hb.grad = w.grad = None
    got = chunked_loss(hb, w, t, 8)
    got.backward()
    assert hb.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=0)
    torch.testing.assert_close(hb.grad.float(), want[0].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, want[1], rtol=2e-2, atol=2e-2)


# One step's forward and backward with train.loss=full and =chunked, from the same weights and batch: every
# engine that holds the output layer differently (DDP, FSDP2, TP's vocabulary-parallel split, the last
# pipeline stage, context parallel's chunks of the sequence), chat data's loss mask under TP, z-loss under TP
# (the full path then in loss_parallel), chunks of 24 tokens (uneven: 128 tokens a micro-batch).
CHUNK = "train.loss_chunk=24"
LAYOUTS = ["parallel.zero=0", "parallel.zero=3", "parallel.tp=2 parallel.dp_shard=1",
           "parallel.pp=2 parallel.dp_shard=1", "parallel.cp=2",
           "parallel.tp=2 parallel.dp_shard=1 train.z_loss_coef=0.001",
           "data.source=shards data.path=@chat model.vocab_size=512 parallel.tp=2 parallel.dp_shard=1"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("loss_probe")
    given = {}
    for layout in LAYOUTS:
        full = f"{CHUNK} {layout}"
        if "@chat" in full:
            full = full.replace("@chat", str(request.getfixturevalue("chat_shards")))
        given[full] = layout
    rc = launch(d, 2, cmd=[sys.executable, PROBE, str(d / "out.json"), *given])
    assert rc == 0, (d / "logs").as_posix()
    return {given[k]: v for k, v in json.loads((d / "out.json").read_text()).items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_equals_full_logits_on_every_engine(probed, layout):
    got = probed[layout]
    full, chunked = got["loss"]
    assert abs(chunked - full) <= 1e-6 * full, got
    assert got["params"] >= 4, got  # gradients were compared
    assert got["worst"] <= 1e-6, got  # fp32: measured 2e-7 to 6.4e-7


@pytest.mark.parametrize("overrides,words", [
    (["train.loss_kernel=liger"], "Liger-Kernel's kernels are Triton, CUDA only. Fix: train.loss_kernel=auto"),
    (["train.loss_kernel=liger", "train.loss=full"], "Fix: train.loss=chunked, or train.loss_kernel=auto"),
    (["train.loss_kernel=liger", "cluster=h100", "launcher=sbatch", "parallel.tp=2"],
     "its kernel needs the whole vocabulary on one rank"),
    (["train.loss_chunk=-1"], "train.loss_chunk"),
    (["train.loss_kernel=liger"], "Liger-Kernel, which is not installed. Fix: pip install liger-kernel"),
    (["train.loss=full", "train.loss_chunk=64"], "the whole logits are one chunk. Fix: train.loss=chunked"),
    # V100: fp16, but no flash attention for torch's ring with grouped-query K/V (the tiny model's 4 / 2 heads)
    (["cluster=v100", "launcher=sbatch", "train.precision=fp16", "parallel.cp=2"],
     "torch's ring takes grouped K/V through flash attention only, from SM80"),
    # options of a precision the run does not use: refused, not ignored
    (["train.fp8.recipe=rowwise"], "train.fp8.recipe=rowwise with train.precision=fp32: the recipe is fp8's"),
    (["train.fp16.growth_interval=10", "train.precision=bf16"], "train.fp16.growth_interval=10 with "
                                                                 "train.precision=bf16: only fp16 scales the loss"),
])
def test_loss_options_refused_on_the_login_node(overrides, words):
    from hpctrain.checks.config_checks import check, compose_checked
    from hpctrain.core.compose import ConfigError

    with pytest.raises(ConfigError) as info:
        check(*compose_checked(["+experiment=tiny", *overrides]))
    assert words in str(info.value), str(info.value)


def test_a_split_backward_gets_both_gradients():
    """torch's zero-bubble schedules run a stage's backward in two passes over one retained graph: the input
    gradients (stage_backward_input), then the weights' (stage_backward_weight). Both must come out as one
    backward gives them. Mutant: the kept gradients freed by the first pass (found by the layouts' zbv run)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    lin, w = torch.nn.Linear(8, 8, bias=False), torch.nn.Parameter(torch.randn(20, 8))
    x, t = torch.randn(1, 6, 8, requires_grad=True), torch.randint(0, 20, (1, 6))
    chunked_loss(lin(x), w, t, 4).backward()
    want = x.grad.clone(), lin.weight.grad.clone(), w.grad.clone()
    x.grad = lin.weight.grad = w.grad = None
    got, groups = stage_backward_input([chunked_loss(lin(x), w, t, 4)], None, [x], [lin.weight, w])
    stage_backward_weight([lin.weight, w], groups)
    for a, b in zip((got[0], lin.weight.grad, w.grad), want):
        torch.testing.assert_close(a, b)
