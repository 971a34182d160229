"""Recomputation by module (parallel.ac_modules, hpctrain.parallel.activation): the same loss and gradients
as without it, bit for bit (the reruns are the same ops on the same inputs); what a forward leaves alive for
backward, measured, against the planner (hpctrain.plan.memory.activations); the recompute time and FLOPs
the planner prices; the refusals; and one launch of two ranks (TP, FSDP2, EP) against the same layouts
without it."""
from __future__ import annotations

import copy
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hpctrain.core.compose import compose
from hpctrain.core.rules import problems
from hpctrain.core.spec import engine_spec
from hpctrain.models.llama import Llama
from hpctrain.models.moe import moe_modules
from hpctrain.parallel.activation import apply_ac
from hpctrain.plan.memory import activations, job_of
from hpctrain.plan.throughput import throughput

DENSE = [("attention",), ("mlp",), ("norm",), ("attention", "mlp", "norm")]
MOE = [("attention",), ("norm",), ("moe_act",), ("moe",), ("norm", "moe"), ("attention", "moe_act", "norm")]
CASES = [("tiny", m) for m in DENSE] + [("moe_tiny", m) for m in MOE]


def _model(name: str, seq: int, *extra: str):
    cfg = compose(["+experiment=tiny", f"model={name}", f"data.seq_len={seq}", *extra])
    torch.manual_seed(0)
    model = Llama(cfg.model, seq)
    for p in model.parameters():  # not the tiny init's ones and zeros: every gradient nonzero
        torch.nn.init.normal_(p, std=0.05)
    return cfg, model


def _step(base, mods, tokens, documents=None, ac="none"):
    model = copy.deepcopy(base)
    apply_ac(model, ac, 2, mods)
    logits = model(tokens, documents=documents) if documents is not None else model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, [m.stats.passes for m in moe_modules(model)]


@pytest.mark.parametrize("name,mods", CASES, ids=[f"{n}-{'+'.join(m)}" for n, m in CASES])
def test_loss_and_every_gradient_equal_no_recomputation(name, mods):
    """Bit for bit, in fp32, on one process: the reruns are the forward's own ops on the same inputs.
    With a document mask too (the attention then takes the chunked kernel, whose output is laid out
    otherwise). MoE layers count their routing once per micro-batch (the moe rerun is not recorded).
    Mutants caught: a rerun under another autocast state or from the wrong tensor (a norm rerun from its
    output, a SwiGLU with gate and up swapped), a rerun view at the wrong offset, and routing counted
    twice (passes 2)."""
    cfg, base = _model(name, 64)
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64))
    documents = torch.cat([torch.zeros(2, 40, dtype=torch.long), torch.ones(2, 24, dtype=torch.long)], 1)
    for docs in (None, documents):
        ref_loss, ref, ref_passes = _step(base, (), tokens, docs)
        loss, grads, passes = _step(base, mods, tokens, docs)
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref.keys()
        for k in ref:
            assert torch.equal(grads[k], ref[k]), (k, (grads[k] - ref[k]).abs().max())
        assert passes == ref_passes == [1] * len(passes)


def test_the_experts_loop_and_selective_checkpointing_compose():
    """moe_act on the experts' loop (model.moe.grouped_mm=false), and the modules in the blocks
    parallel.ac=selective leaves, equal the run without them."""
    cfg, base = _model("moe_tiny", 64, "model.moe.grouped_mm=false")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64))
    for mods, ac in ((("moe_act",), "none"), (("norm", "moe_act", "attention"), "selective")):
        ref_loss, ref, _ = _step(base, (), tokens, ac=ac)
        loss, grads, _ = _step(base, mods, tokens, ac=ac)
        assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref[k]) for k in ref)


class Made(TorchDispatchMode):
    """Weak references to every tensor an op makes (tests/regather_probe.py's, for one process)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def alive_bytes(self, skip: set) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(n for p, n in storages.items() if p not in skip)


# train.loss=full: the forward measured returns the logits (no targets), so the output layer keeps its input
# for backward as the full-logits path does (the chunked loss keeps none: tests/test_chunked_loss.py)
SHAPE = ["model.dim=256", "model.ffn_dim=768", "train.micro_batch=2", "train.global_batch=2", "launcher.nproc=1",
         "train.loss=full"]


def _saved(name: str, mods: tuple) -> tuple[float, float]:
    """(measured, predicted) bytes a forward of 2 x 512 tokens leaves alive for backward: every storage an
    op made that is still alive after the forward, less the weights (their transposed views) and the logits
    we hold; the planner's activations of the same job."""
    cfg, model = _model(name, 512, *SHAPE, f"parallel.ac_modules=[{','.join(mods)}]")
    assert engine_spec(cfg).ac_modules == tuple(mods)
    apply_ac(model, "none", 2, mods)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 512))
    made = Made()
    with made:
        logits = model(tokens)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {logits.untyped_storage().data_ptr()}
    return made.alive_bytes(skip), activations(job_of(cfg), 0)["activations"]


@pytest.mark.parametrize("name,mods", [("tiny", ())] + CASES
                         + [("moe_tiny", ())], ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
def test_what_a_forward_keeps_is_what_the_planner_says(name, mods):
    """2 blocks of dim 256, ffn (and expert) width 768, 1024 tokens in fp32: the bytes alive after the
    forward within 5% of the planner's activations (measured 0.96-1.02), and what each module set frees
    against no recomputation within 10% of what the planner says it frees. Mutants caught: a dropped
    tensor kept by the rerun's closure (norm: +2 MiB), the attention kernel's output still saved by its own
    node (+2 MiB), the planner without a module's term."""
    got, pred = _saved(name, mods)
    print(f"\n{name} {mods}: measured {got / 2**20:.2f} MiB, planned {pred / 2**20:.2f}")
    assert got == pytest.approx(pred, rel=0.05)
    if mods:
        base_got, base_pred = _saved(name, ())
        assert base_pred > pred
        assert base_got - got == pytest.approx(base_pred - pred, rel=0.10)


def test_the_planner_prices_the_recompute():
    """Each module set adds recompute time and, where it reruns GEMMs or attention, hardware FLOPs; the
    activations it drops lower the memory. Mutant caught: modules priced as none."""
    def priced(name, mods):
        cfg = compose(["+experiment=tiny", f"model={name}", "launcher.nproc=1",
                       f"parallel.ac_modules=[{','.join(mods)}]"])
        job = job_of(cfg)
        t = throughput(job)
        return t.breakdown["recompute"], t.hw_tflops_per_gpu / t.tflops_per_gpu, activations(job, 0)["activations"]

    for name, sets in (("tiny", DENSE), ("moe_tiny", MOE)):
        none_time, none_ratio, none_mem = priced(name, ())
        assert none_time == 0.0 and none_ratio == pytest.approx(1.0)
        for mods in sets:
            time, ratio, mem = priced(name, mods)
            assert time > 0 and mem < none_mem, (name, mods)
            assert (ratio > 1.0) == bool({"attention", "moe"} & set(mods)), (name, mods, ratio)


def _refused(*overrides: str) -> list[str]:
    cfg = compose(["+experiment=tiny", *overrides])
    return [p.message for p in problems(engine_spec(cfg))]


def test_what_cannot_be_recomputed_by_module_is_refused_with_the_fix():
    compiled = _refused("launcher.nproc=1", "train.compile=true", "parallel.ac_modules=[mlp]")
    assert any("parallel.ac_modules=[mlp] with train.compile" in m and "Fix:" in m for m in compiled), compiled
    tp = _refused("launcher.nproc=2", "parallel.tp=2", "parallel.dp_shard=1", "parallel.ac_modules=[norm,mlp]")
    assert any("parallel.ac_modules has norm with parallel.tp=2" in m and "Fix:" in m for m in tp), tp
    assert not _refused("launcher.nproc=2", "parallel.tp=2", "parallel.dp_shard=1", "parallel.ac_modules=[attention,mlp]")


LAUNCHED = {
    "tp": "parallel.tp=2 parallel.dp_shard=1",
    "fsdp": "parallel.dp_shard=2",
    "ep": "model=moe_tiny parallel.ep=2",
}
MODULES = {"tp": "[attention,mlp]", "fsdp": "[attention,mlp,norm]", "ep": "[norm,moe,attention]"}


@pytest.mark.slow
def test_two_ranks_equal_the_run_without_modules(tmp_path):
    """One launch of 2 ranks, 3 steps each of TP 2 (the attention's and w2's reruns under DTensor and the
    sequence-parallel re-gather), FSDP2 (the reruns with resharded weights) and EP 2 on moe_tiny (the MoE
    layer's rerun exchanges its rows again): the losses and gradient norms equal those without
    parallel.ac_modules, bit for bit. Mutants caught: a rerun whose all-to-all pairs with another layer's
    (a hang or other rows), a DTensor unpacked as its local tensor (TP fails in backward)."""
    from hpctrain.launch.local import launch

    worker = str(Path(__file__).with_name("layout_worker.py"))
    layouts = [v for k, v in LAUNCHED.items()] + [f"{v} parallel.ac_modules={MODULES[k]}" for k, v in LAUNCHED.items()]
    rc = launch(tmp_path, 2, cmd=[sys.executable, worker, str(tmp_path / "out.json"), "3", *layouts])
    assert rc == 0, (tmp_path / "logs").as_posix()
    got = json.loads((tmp_path / "out.json").read_text())
    for k, v in LAUNCHED.items():
        plain, recomputed = got[v], got[f"{v} parallel.ac_modules={MODULES[k]}"]
        assert recomputed["loss"] == plain["loss"], k
        assert recomputed["grad_norm"] == plain["grad_norm"], k
        assert recomputed["kernel"] == "RecomputedKernel", k
