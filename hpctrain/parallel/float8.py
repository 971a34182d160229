"""train.precision=fp8: the blocks' linear layers (and, where torchao has it on this device, the MoE experts'
grouped GEMMs) computed in float8 through torchao, applied over the plain model as torchtitan's float8
model converter does. hpctrain writes no float8 kernel; on CPU torchao's emulation runs every recipe, so
the whole path (conversion, sharding, checkpoints) is exercised without a GPU.

    tensorwise | rowwise | rowwise_with_gw_hp   torchao.float8.convert_to_float8_training: nn.Linear ->
                                                Float8Linear (Float8LinearConfig.from_recipe_name)
    mxfp8                                       torchao.prototype.moe_training's MXFP8TrainingOpConfig
                                                (quantize_): each weight wrapped in a tensor subclass that
                                                runs its linear and grouped GEMM in MXFP8

Kept in bf16, each with its reason in the run's header: the output layer (the logits feed a softmax over
the whole vocabulary: torchtitan and torchao keep it high precision), the MoE routers (not nn.Linear: a
float8 error would move which experts are picked), every linear whose features (this rank's share under
tensor parallel) do not divide by 16 (the float8 GEMM's alignment), and the experts where torchao's float8
grouped GEMM does not run on this device.

Applied before tensor parallel (torchtitan's order: the converter runs before parallelize), so the float8
modules are what ColwiseParallel / RowwiseParallel, expert parallel and FSDP2 shard; their parameters keep
the names and the high-precision values of the plain model, so checkpoints and export are unchanged.
"""
from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from hpctrain.core.spec import EngineSpec

log = logging.getLogger("hpctrain")

# float8 GEMMs (torch._scaled_mm) need both dimensions of each operand divisible by 16; MXFP8 scales blocks of
# 32 elements along them
ALIGN = {"mxfp8": 32}
ALIGN_DEFAULT = 16
KEPT_LAYERS = {"output": "the output layer, whose logits feed the softmax over the whole vocabulary: torchtitan "
                         "and torchao keep it in high precision"}
ROUTER = ("MoE router: not an nn.Linear, and float8 error in its scores would change which experts are "
          "picked")
# Under tensor parallel: the layers whose output features are split (ColwiseParallel) and those whose input
# features are (RowwiseParallel), hpctrain.parallel.tensor's plan.
ROWWISE = ("wo", "w2")
FLOAT8_FORWARDS = "float8_forwards"  # attribute each converted module counts its forwards in


@dataclass
class Float8Report:
    """What apply_float8 did to one model part: the fqns of its float8 linears and experts, and what it
    kept in bf16 (fqn -> why)."""
    recipe: str
    emulated: bool
    linears: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    kept: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        how = "torchao emulation on CPU" if self.emulated else "torchao float8 kernels"
        out = [f"fp8 ({self.recipe}, {how}): {len(self.linears)} float8 linears"
               + (f", {len(self.experts)} float8 expert groups" if self.experts else "")]
        # one line per reason, the layers it applies to
        by_reason: dict = {}
        for fqn, why in self.kept.items():
            by_reason.setdefault(why, []).append(fqn)
        out += [f"fp8: kept in bf16: {', '.join(fqns)} ({why})" for why, fqns in by_reason.items()]
        return out


@contextmanager
def _quiet():
    """torchao's first import logs a warning for each CUDA extension it cannot load (every one, on CPU) and
    torch one per Enum torchao registers: noise in every rank's log that says nothing about the run."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def emulated(device: torch.device) -> bool:
    """torchao emulates float8 matmuls (dequantize, matmul in high precision) off CUDA."""
    return device.type != "cuda"


def linear_config(recipe: str, emulate: bool, all_gather: bool = False):
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def mx_config(emulate: bool):
    """One config for the linears and the experts (torchao refuses an op, such as the optimizer's foreach
    ops over every weight, on wrappers of different configs); the experts' groups of rows (tokens routed to
    each expert, any number under expert parallel) padded to the 32-row blocks MXFP8 scales."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulate else MXFP8TrainingRecipe.MXFP8_RCEIL
    return dataclasses.replace(MXFP8TrainingOpConfig.from_recipe(recipe), pad_token_groups_for_grouped_mm=True)


def grouped_config(recipe: str, device: torch.device):
    """torchao's training config for the experts' grouped GEMMs under `recipe`, or None, and why not.
    Probed with one small grouped GEMM forward and backward on `device`, in groups of uneven sizes as routing
    makes them: torchao's float8 grouped GEMM (a prototype) runs only where its kernels exist (fp8 rowwise:
    CUDA with Triton, SM90; mxfp8: emulated anywhere, real on SM100)."""
    try:
        if recipe == "mxfp8":
            config = mx_config(emulated(device))
        else:
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig

            config = Float8TrainingOpConfig()
        _probe_grouped(config, device)
        return config, ""
    except Exception as e:  # the probe's error is the reason given in the header
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return None, f"MoE experts: torchao's float8 grouped GEMM does not run on {device.type} ({first})"


def _probe_grouped(config, device: torch.device) -> None:
    from torchao.quantization import quantize_

    holder = nn.Module()
    holder.w = nn.Parameter(torch.randn(2, 32, 32, device=device, dtype=torch.bfloat16))
    quantize_(holder, config, filter_fn=lambda m, fqn: m is holder)
    x = torch.randn(64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([13, 64], device=device, dtype=torch.int32)  # groups of any size, as routing makes them
    torch._grouped_mm(x, holder.w.transpose(-2, -1), offs=offs).float().sum().backward()


def local_features(name: str, mod: nn.Linear, tp: int) -> tuple[int, int]:
    """(in, out) features of this rank's share of `mod` under tensor parallel `tp`."""
    leaf = name.rsplit(".", 1)[-1]
    if tp > 1 and leaf in ROWWISE:
        return mod.in_features // tp, mod.out_features
    if tp > 1:
        return mod.in_features, mod.out_features // tp
    return mod.in_features, mod.out_features


def choose(model: nn.Module, tp: int = 1, align: int = ALIGN_DEFAULT) -> tuple[list[str], dict[str, str]]:
    """The fqns of `model`'s nn.Linear layers to compute in float8, and those kept (fqn -> why)."""
    from hpctrain.models.moe import Router

    convert, kept = [], {}
    for name, mod in model.named_modules():
        top = name.split(".")[0]
        if top in KEPT_LAYERS:  # the layer itself (hpctrain.models.loss.OutputHead) and anything inside it
            if name == top:
                kept[name] = KEPT_LAYERS[top]
            continue
        if isinstance(mod, Router):
            kept[name] = ROUTER
        if not isinstance(mod, nn.Linear):
            continue
        fin, fout = local_features(name, mod, tp)
        if fin % align or fout % align:
            kept[name] = (f"features not divisible by {align}" + (" on each tensor-parallel rank" if tp > 1 else ""))
            continue
        convert.append(name)
    return convert, kept


def apply_float8(model: nn.Module, spec: EngineSpec, device: torch.device) -> Float8Report:
    """Convert `model` (a meta-device model or pipeline stage, before any parallelism) for train.precision=fp8:
    its chosen linears, and its experts where torchao's grouped GEMM runs here. Logs the report (the run's
    header) and returns it; each converted module counts its forwards (float8_forwards)."""
    from hpctrain.models.moe import Experts

    with _quiet():
        import torchao.float8  # noqa: F401 (imported once here, quietly; used below)
        import torchao.prototype.moe_training.config  # noqa: F401
    recipe = spec.fp8_recipe
    emulate = emulated(device)
    if not emulate:  # the login node checked cluster.compute_capability; this is the GPU the rank really has
        need = (10, 0) if recipe == "mxfp8" else (8, 9)
        have = torch.cuda.get_device_capability(device)
        if have < need:
            raise ValueError(f"train.precision=fp8 (train.fp8.recipe={recipe}) on {torch.cuda.get_device_name(device)}, "
                             f"compute capability {have[0]}.{have[1]}: its float8 GEMMs need {need[0]}.{need[1]} or "
                             "more. Fix: train.precision=bf16 (and cluster.compute_capability set to the GPUs', so "
                             "that the login node says so)")
    linears, kept = choose(model, spec.layout.tp, ALIGN.get(recipe, ALIGN_DEFAULT))
    report = Float8Report(recipe, emulate, linears, [], kept)
    chosen = set(linears)
    if recipe == "mxfp8":
        from torchao.quantization import quantize_

        quantize_(model, mx_config(emulate), filter_fn=lambda m, fqn: fqn in chosen)
    else:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=linear_config(recipe, emulate, spec.fp8_all_gather),
                                   module_filter_fn=lambda m, fqn: fqn in chosen)
    experts = {name: mod for name, mod in model.named_modules() if isinstance(mod, Experts)}
    if experts:
        config, why = grouped_config(recipe, device)
        from torchao.quantization import quantize_

        for name, mod in experts.items():
            if config is None:
                report.kept[name] = why
                continue
            quantize_(mod, config, filter_fn=lambda m, f, mod=mod: m is mod)
            report.experts.append(name)
    for fqn in report.linears + report.experts:
        _count_forwards(model.get_submodule(fqn))
    for line in report.lines():
        log.info("%s", line)
    return report


def _count_forwards(mod: nn.Module) -> None:
    """Each forward of `mod` outside torch.compile's tracing adds one to mod.float8_forwards: the evidence
    that a float8 module ran (a compiled block's graph runs without Python hooks)."""
    setattr(mod, FLOAT8_FORWARDS, 0)

    def counted(m, args, out):
        if not torch.compiler.is_compiling():
            setattr(m, FLOAT8_FORWARDS, getattr(m, FLOAT8_FORWARDS) + 1)

    mod.register_forward_hook(counted)


def float8_modules(parts) -> dict:
    """{fqn: forwards counted} of every float8 module (linear or experts) of the model parts."""
    out = {}
    for i, part in enumerate(parts):
        for name, mod in part.named_modules():
            if hasattr(mod, FLOAT8_FORWARDS):
                out[f"{i}:{name}"] = getattr(mod, FLOAT8_FORWARDS)
    return out


def is_float8(mod: nn.Module) -> bool:
    """`mod` computes in float8: a torchao Float8Linear, or a module whose own weights are torchao's
    float8 / MXFP8 training wrappers."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    if isinstance(mod, Float8Linear):
        return True
    for p in mod.parameters(recurse=False):
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, TrainingWeightWrapperBaseTensor) or isinstance(p, TrainingWeightWrapperBaseTensor):
            return True
    return False


def after_optimizer_step(parts, spec: EngineSpec) -> None:
    """Call after each optimizer.step(): with the float8 all-gather (train.fp8.all_gather) FSDP2 gathers
    weights already cast to float8, with their scales computed here for every weight at once (one
    all-reduce of the amaxes) instead of in each forward. Nothing otherwise."""
    if not spec.fp8_all_gather:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(getattr(part, "module", part))
