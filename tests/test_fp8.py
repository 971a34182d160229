"""train.precision=fp8 through torchao (hpctrain.parallel.float8), emulated on CPU.

One linear against torchao's own reference (the same layer computed in high precision: torchao documents
its float8 error, a few percent); what is kept in bf16 (the output layer, the MoE routers, features not
divisible by 16); and, in one launch per world size, 40 steps of the tiny model in bf16 and in fp8 from the
same initial weights on 1 rank (dense; MoE with MXFP8 experts) and on FSDP2 x 2, TP 2, PP 2 (with activation
checkpointing) and EP 2 (MoE):
the fp8 loss tracks the bf16 loss (every step within 10%, the last within 3%), every float8 module counted
as running, the state dict's names and high-precision values those of the bf16 model, resume bit-exact
(stopped after step 36 and resumed = uninterrupted), and the export of an fp8 checkpoint loaded by
transformers' LlamaForCausalLM giving the logits of the plain fp32 model on the same weights.

Also the worker of the launches: python tests/test_fp8.py OUT.json STEPS 'overrides' ...
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

STEPS, HALF = 40, 36  # stopped after step 36, resumed for the last 4
STEP_TOL, FINAL_TOL = 0.10, 0.03  # what the issue asks: every step within 10% of bf16, the last within 3%
# A learning rate that keeps the loss well above zero for 40 steps (the synthetic rule is learnt to ~0.02 at
# the tiny preset's 3e-3), so that 3% of it measures the float8 error, not the last digits of a memorised rule.
COMMON = ["+experiment=tiny", "train.global_batch=4", "train.micro_batch=2", "data.seq_len=64", "optim.lr=1e-3",
          "optim.warmup_steps=2", "checkpoint.every=0"]
MOE = "model=moe_tiny"
LAYOUTS = {
    1: ["parallel.zero=3", f"{MOE} train.fp8.recipe=mxfp8"],
    # (PP with activation checkpointing: the float8 layers' forward rerun in backward)
    2: ["parallel.zero=3", "parallel.tp=2 parallel.dp_shard=1", "parallel.pp=2 parallel.dp_shard=1 parallel.ac=full",
        f"{MOE} parallel.ep=2"],
}
EXPORTED = (1, "parallel.zero=3")  # the layout whose fp8 checkpoint is exported
WORKER = str(Path(__file__).resolve())


# ------------------------------------------------------------------ one process: torchao's float8 linear itself

E4M3_MAX = 448.0  # the largest float8 e4m3fn value


def _fp8_reference(x, w, rows: bool):
    """x @ w.T with x and w rounded to float8 e4m3fn as torchao's tensorwise (rows=False: one scale per
    tensor) or rowwise recipe (a scale per row of x and per row of w, rounded down to a power of 2) says,
    written with torch's own float8 dtype: the matmul torchao emulates on CPU."""
    import torch

    def cast(t):
        amax = t.float().abs().amax(dim=-1, keepdim=True) if rows else t.float().abs().amax()
        scale = E4M3_MAX / amax.clamp(min=1e-12)
        if rows:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale

    return cast(x) @ cast(w).T


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tiny_spec(*overrides: str, world: int = 1):
    from hpctrain.core.compose import compose
    from hpctrain.core.spec import engine_spec

    return engine_spec(compose(["+experiment=tiny", f"launcher.nproc={world}", "train.precision=fp8", *overrides]),
                       world)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_one_linear_is_float8_as_torchao_defines_it(recipe):
    """A block's linear converted by apply_float8 is torchao's float8 layer: its forward equals x @ w.T with x
    and w rounded to float8 by torch's own e4m3fn dtype at torchao's scales (tensorwise and rowwise; to the
    bf16 output's rounding), not the bf16 matmul; output, gradients of input and weight all within the
    few-percent error of float8 against the fp32 layer (measured: 3.7-5.7%), and rowwise_with_gw_hp's weight
    gradient within bf16's (0.2%). Mutants: no conversion (output equals the bf16 matmul: the float8 rounding
    is missing), the scale of the wrong granularity (tensorwise for rowwise: 5.3% off the reference, 0.17%
    with the right one), rowwise_with_gw_hp run as rowwise (weight gradient 3.8% off), emulate=False on CPU
    (torch._scaled_mm refuses)."""
    import torch
    from torch import nn

    from hpctrain.parallel.float8 import apply_float8, is_float8

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module()})
    model.layers["0"].w1 = lin = nn.Linear(128, 256, bias=False)
    ref = nn.Linear(128, 256, bias=False)
    ref.weight.data.copy_(lin.weight.data.bfloat16().float())
    lin.to(torch.bfloat16)
    report = apply_float8(model, _tiny_spec(f"train.fp8.recipe={recipe}"), torch.device("cpu"))
    conv = model.layers["0"].w1
    assert report.linears == ["layers.0.w1"] and is_float8(conv), (report, type(conv))
    x = (torch.randn(64, 128) * torch.linspace(0.1, 4, 64)[:, None]).bfloat16().requires_grad_()
    y = conv(x)
    xr = x.detach().float().requires_grad_()
    yr = ref(xr)
    (y.float() * torch.linspace(-1, 1, 256)).sum().backward()
    (yr * torch.linspace(-1, 1, 256)).sum().backward()
    plain = x.detach().float() @ ref.weight.detach().T
    assert _rel(y, plain.bfloat16()) > 1e-3, "the output is the bf16 matmul: nothing was rounded to float8"
    if recipe in ("tensorwise", "rowwise"):
        want = _fp8_reference(x.detach(), ref.weight.detach().bfloat16(), rows=recipe == "rowwise")
        assert _rel(y, want) < 4e-3, _rel(y, want)  # bf16 output rounding (2^-8) only
    for got, exact in ((y, yr), (x.grad, xr.grad), (conv.weight.grad, ref.weight.grad)):
        assert _rel(got, exact) < 0.08, (recipe, _rel(got, exact))
    if recipe == "rowwise_with_gw_hp":  # the weight gradient's GEMM in high precision: bf16's error, not float8's
        assert _rel(conv.weight.grad, ref.weight.grad) < 0.01


def test_what_stays_bf16_and_why():
    """apply_float8 on the meta-device MoE model (before any parallelism, as hpctrain.parallel.apply runs
    it): the output layer and the routers stay high precision (not torchao's float8), a layer whose
    features do not divide by 16 (alone, or on each tensor-parallel rank) stays with that reason, the
    experts' grouped GEMMs stay bf16 on CPU under tensorwise (torchao's fp8 grouped GEMM needs CUDA) and
    run in MXFP8 (emulated) under mxfp8; the report lists all of it. Mutants: the output layer converted,
    the divisibility check dropped or not divided by tp, the experts converted where the probe fails."""
    import torch

    from hpctrain.models.llama import build_meta
    from hpctrain.models.moe import Router
    from hpctrain.parallel.float8 import apply_float8, is_float8

    def converted(*over, world=1, recipe="tensorwise"):
        spec = _tiny_spec("model=moe_tiny", "model.moe.every=2", f"train.fp8.recipe={recipe}", *over, world=world)
        model = build_meta(spec.model, 64)
        return model, apply_float8(model, spec, torch.device("cpu"))

    model, rep = converted()
    assert not is_float8(model.output) and "output" in rep.kept
    routers = [n for n, m in model.named_modules() if isinstance(m, Router)]
    assert routers and all(not is_float8(model.get_submodule(n)) and n in rep.kept for n in routers)
    assert "layers.1.moe.experts" in rep.kept and "grouped GEMM" in rep.kept["layers.1.moe.experts"], rep.kept
    assert not rep.experts and not is_float8(model.get_submodule("layers.1.moe.experts"))
    # the dense block (moe.every=2: block 0) and the attention layers are float8, each counted
    assert {"layers.0.feed_forward.w1", "layers.1.attention.wq"} <= set(rep.linears)
    assert all(is_float8(model.get_submodule(n)) for n in rep.linears)
    # 200 features: not divisible by 16; 96 (ffn) at tp 2: 48 per rank, divisible by 16; 48 at tp 2: 24
    model, rep = converted("model.ffn_dim=200")
    assert rep.kept["layers.0.feed_forward.w2"] == "features not divisible by 16", rep.kept
    assert not is_float8(model.get_submodule("layers.0.feed_forward.w2"))
    _, rep = converted("model.ffn_dim=96", "parallel.tp=2", "parallel.dp_shard=1", world=2)
    assert "layers.0.feed_forward.w1" in rep.linears
    _, rep = converted("model.ffn_dim=48", "parallel.tp=2", "parallel.dp_shard=1", world=2)
    assert rep.kept["layers.0.feed_forward.w1"] == "features not divisible by 16 on each tensor-parallel rank"
    model, rep = converted(recipe="mxfp8")
    assert rep.experts == ["layers.1.moe.experts"] and is_float8(model.get_submodule("layers.1.moe.experts"))
    assert not is_float8(model.output) and all(not is_float8(model.get_submodule(n)) for n in routers)
    lines = "\n".join(rep.lines())
    assert "mxfp8" in lines and "float8 expert groups" in lines and "output" in lines, lines


def test_login_node_refusals():
    """What fp8 cannot run with is refused on the login node, naming the keys and the fix: LoRA (its adapters
    go on nn.Linear layers fp8 has replaced), the float8 all-gather on gloo, with another recipe than
    tensorwise, or without fp8; fp8 without torchao installed. Mutants: any of these rules removed."""
    import importlib.util

    from test_config import assert_mentions, refusal

    assert_mentions(refusal("train.precision=fp8", "model.lora.rank=4"), "train.precision=fp8", "model.lora.rank=4",
                    "Fix: train.precision=bf16")
    assert_mentions(refusal("train.precision=fp8", "train.fp8.all_gather=true"), "train.fp8.all_gather=true",
                    "gloo", "Fix: train.fp8.all_gather=false")
    assert_mentions(refusal("train.precision=fp8", "train.fp8.all_gather=true", "train.fp8.recipe=rowwise"),
                    "tensorwise")
    assert_mentions(refusal("train.fp8.all_gather=true"), "train.precision=fp8")
    from hpctrain.core import spec

    real = importlib.util.find_spec
    with pytest.MonkeyPatch().context() as mp:
        mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
        spec.installed.cache_clear()  # (cached: the planner asks for thousands of layouts)
        try:
            assert_mentions(refusal("train.precision=fp8"), "needs torchao", "pip install 'hpctrain[fp8]'")
        finally:
            spec.installed.cache_clear()


def test_after_optimizer_step_precomputes_scales_only_for_the_float8_all_gather(monkeypatch):
    """after_optimizer_step (the loop calls it after each optimizer.step()) runs torchao's
    precompute_float8_dynamic_scale_for_fsdp on every model part under train.fp8.all_gather (its NCCL run:
    tests/test_gpu.py), and nothing otherwise. Mutants: never called; called without the all-gather."""
    import torchao.float8
    from torch import nn

    from hpctrain.parallel.float8 import after_optimizer_step

    seen = []
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", seen.append)
    parts = [nn.Linear(16, 16), nn.Linear(16, 16)]
    after_optimizer_step(parts, _tiny_spec())
    after_optimizer_step(parts, _tiny_spec("train.precision=bf16", "train.fp8.all_gather=true"))
    assert seen == []
    after_optimizer_step(parts, _tiny_spec("train.fp8.all_gather=true"))
    assert seen == parts


# ------------------------------------------------------------------ launches: bf16 against fp8, 40 steps

@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict:
    """One launch per world size: {(world, layout): the worker's result}."""
    from hpctrain.launch.local import launch

    out = {}
    for world, layouts in LAYOUTS.items():
        d = tmp_path_factory.mktemp(f"fp8_world{world}")
        rc = launch(d, world, cmd=[sys.executable, WORKER, str(d / "out.json"), str(STEPS), *layouts])
        assert rc == 0, (d / "logs").as_posix()
        out.update({(world, k): v for k, v in json.loads((d / "out.json").read_text()).items()})
    return out


CASES = [(w, l) for w, ls in LAYOUTS.items() for l in ls]


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", CASES)
def test_fp8_tracks_bf16_and_resumes_bit_exact(launched, world, layout):
    """From the same initial weights, every fp8 step's loss within 10% of bf16's and the last within 3%;
    every float8 module of every rank ran (its forwards counted), as many as the run's header says, and the
    output layer and routers are not float8; the state dict has the bf16 model's names and fp32 values
    (the high-precision weights); stopped after step 36 and resumed, steps 37-40 equal the uninterrupted
    run's bit for bit. Mutants: fp8 not applied (no float8 module counted), the output layer converted, a
    float8 weight type in the state dict, the scale of a wrong recipe (loss off), a resume that drops the
    optimizer state (steps 37-40 differ)."""
    import re

    r = launched[(world, layout)]
    bf16, fp8 = r["bf16"], r["fp8"]
    assert len(bf16) == len(fp8) == STEPS
    worst = max(abs(a - b) / b for a, b in zip(fp8, bf16))
    assert worst <= STEP_TOL, (worst, fp8, bf16)
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] <= FINAL_TOL, (fp8[-1], bf16[-1])
    assert fp8 != bf16  # float8 changed the numbers: it ran
    print(f"FIGURES world {world} {layout}: largest step difference {worst:.2%}, last step {bf16[-1]:.4f} -> "
          f"{fp8[-1]:.4f} ({abs(fp8[-1] - bf16[-1]) / bf16[-1]:.2%})")
    for rank in r["ranks"]:
        counts = rank["counts"]
        said = int(re.search(r"(\d+) float8 linears", rank["header"][0]).group(1))
        groups = re.search(r"(\d+) float8 expert groups", rank["header"][0])
        assert counts and all(n > 0 for n in counts.values()), counts
        assert len(counts) == said + (int(groups.group(1)) if groups else 0), (rank["header"], counts)
        assert not any(rank["kept_is_float8"].values()), rank["kept_is_float8"]
    assert r["keys_fp8"] == r["keys_bf16"]
    assert r["dtypes"] == ["torch.float32"], r["dtypes"]
    assert r["resumed_from"] == HALF and r["resumed"] == fp8[HALF:], (r["resumed"], fp8[HALF:])


@pytest.mark.slow
def test_export_of_an_fp8_checkpoint_loads_in_transformers(launched, tmp_path):
    """The fp8 run's checkpoint exported with --format hf loads in transformers' LlamaForCausalLM, whose fp32
    logits equal the plain fp32 model's (no float8, no parallelism) on the trained weights. Mutant: the
    export writing float8-rounded or renamed weights."""
    import torch
    import transformers

    from helpers import run_cli

    r = launched[EXPORTED]
    step = Path(r["dir"]) / "checkpoints" / f"step-{STEPS:08d}"
    run_cli("export", str(step), str(tmp_path / "hf"), "--format", "hf", module="hpctrain.checkpoint")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=tokens()).logits
    want = torch.tensor(r["logits"])
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


# ------------------------------------------------------------------ the worker (each rank of a launch)

class Header(logging.Handler):
    """The fp8 lines of the run's header (hpctrain.parallel.float8 logs them as it converts)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("fp8"):
            self.lines.append(msg)


def _trainer(overrides: list, run: str, world: int):
    import torch

    from rank_worker import compose_once
    from hpctrain.train.loop import Trainer

    cfg = compose_once([*COMMON, f"launcher.nproc={world}", f"train.steps={STEPS}", *overrides], run)
    os.makedirs(run, exist_ok=True)
    return Trainer.of(cfg, run, torch.device("cpu"))


def _state(t) -> dict:
    """{name: (dtype, whole tensor)} of the trainer's model state (what checkpoints save)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for part in t.parts:
        for k, v in part.state_dict().items():
            whole = v.full_tensor() if isinstance(v, DTensor) else v
            out[k] = (str(v.dtype), type(v.to_local() if isinstance(v, DTensor) else v).__name__, whole.detach().float())
    return out


def _one(layout: str, d: str, de) -> dict:
    steps = int(sys.argv[2])
    print(f"layout {layout}: bf16 and fp8, {steps} steps", file=sys.stderr, flush=True)
    half = steps - (STEPS - HALF)
    import torch
    import torch.distributed as dist

    from rank_worker import train_steps
    from hpctrain.models.moe import Router
    from hpctrain.parallel.float8 import float8_modules, is_float8

    base = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), f"w{de.world}-" + "".join(
        c if c.isalnum() else "_" for c in layout))
    over = layout.split()
    header = Header()
    logging.getLogger("hpctrain").addHandler(header)
    logging.getLogger("hpctrain").setLevel(logging.INFO)
    # bf16 from the same initial weights (the same seed, the same init by name)
    tb = _trainer([*over, "train.precision=bf16"], os.path.join(base, "bf16"), de.world)
    bf16 = train_steps(tb, steps)["loss"]
    keys_bf16 = sorted(tb.parts[0].state_dict())
    del tb
    # fp8: saved after step `half`, run on to the last; then resumed from `half` by a new trainer
    run = os.path.join(base, "fp8")
    t = _trainer([*over, "train.precision=fp8"], run, de.world)
    first = train_steps(t, half)["loss"]
    t.save()
    last = train_steps(t, steps - half)["loss"]
    counts = float8_modules(t.parts)
    state = _state(t)
    kept = {name: is_float8(m) for part in t.parts for name, m in part.named_modules()
            if name.endswith("output") or isinstance(m, Router)}
    out = {"bf16": bf16, "fp8": first + last, "counts": counts, "header": list(header.lines),
           "keys_fp8": sorted(t.parts[0].state_dict()), "keys_bf16": keys_bf16,
           "dtypes": sorted({v[0] for v in state.values()}), "types": sorted({v[1] for v in state.values()}),
           "kept_is_float8": kept}
    if layout == EXPORTED[1] and de.world == EXPORTED[0]:
        out["logits"] = _plain_logits(t, state).tolist()
    del t
    header.lines.clear()
    t2 = _trainer([*over, "train.precision=fp8"], run, de.world)
    t2.resume(lambda *a: None)
    out["resumed_from"] = t2.resumed_from
    out["resumed"] = train_steps(t2, steps - half)["loss"]
    if layout == EXPORTED[1] and de.world == EXPORTED[0]:
        t2.save()  # the checkpoint the test exports (of the resumed run: the same weights, bit for bit)
    logging.getLogger("hpctrain").removeHandler(header)
    every = [None] * de.world
    dist.all_gather_object(every, {k: out[k] for k in ("counts", "header", "kept_is_float8")})
    out["ranks"] = every
    out["dir"] = run
    del t2
    torch.distributed.barrier()
    return out


def _plain_logits(t, state: dict):
    """The fp32 logits of the plain model (no float8, no parallelism) with the trained weights, on TOKENS."""
    import torch

    from hpctrain.models.llama import Llama

    m = Llama(t.cfg.model, t.cfg.data.seq_len)
    m.load_state_dict({k: v[2] for k, v in state.items()})
    m.init_buffers()
    with torch.no_grad():
        return m(tokens())


def tokens():
    import torch

    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))


def worker_main() -> None:
    from rank_worker import over_layouts, run_rank_of_layouts

    sys.path.insert(0, str(Path(__file__).parent))
    run_rank_of_layouts(lambda: over_layouts(sys.argv[1], sys.argv[3:], _one))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main()
