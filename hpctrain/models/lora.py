"""LoRA (Hu et al. 2021, arXiv:2106.09685): a frozen linear layer W plus a trained low-rank update,
y = W x + (alpha / rank) B A dropout(x), A of rank x in_features, B of out_features x rank, B starting at
zero so the model starts as the base model. PEFT's LoraModel is the reference (its initialization:
A Kaiming-uniform with a = sqrt(5), B zeros; the same parameter names, lora_A and lora_B, once
hpctrain's layer names are mapped to Hugging Face's, hpctrain.core.hf_format).

`apply_lora` turns the targeted nn.Linear layers of a (meta-device) model into LoRALinear in place and
freezes every other parameter. It runs after tensor parallel: a layer whose weight is split by output
features (colwise) gets a replicated A and B split the same way, one split by input features (rowwise)
A split by input features and a replicated B, so the update needs no communication of its own (its
partial sums join the base layer's reduce-scatter). The layer keeps its name and its weight's name:
checkpoints, Hugging Face import and export address the base weight as before.

QLoRA (model.lora.quantize=nf4, hpctrain.parallel.quantize) replaces the frozen weight by torchao's
NF4Tensor once the weights are loaded; the layer then computes its base product through `NF4Base`, which
dequantises the weight in the forward and again in the backward, so no full-precision copy of it lives
between the two (torchao's linear_nf4 does the same; this one also takes DTensor weights, under TP).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.shape import LORA_TARGETS as TARGETS


class LoRALinear(nn.Linear):
    """nn.Linear with a low-rank update; made by `apply_lora` from an existing layer."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    lora_dropout: nn.Module
    adapters_off = False  # set by adapters_disabled: the base layer alone (DPO's reference)

    nf4 = False  # set by hpctrain.parallel.quantize once the weight is torchao's NF4Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4:
            out = NF4Base.apply(x, self.weight)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.adapters_off:
            return out
        # one fused add (alpha): no output-sized temporary for the scaled update
        return torch.add(out, F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B), alpha=self.scaling)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """`model` as its base: every LoRALinear without its update (DPO's reference under LoRA, as PEFT's
    disable_adapter: the same weights, no second model)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapters_off = True
    try:
        yield model
    finally:
        for m in layers:
            m.adapters_off = False


def dequantize(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full-precision weight of an NF4 weight (torchao's NF4Tensor, or a DTensor of them: each rank's
    own tensor-parallel shard), in `dtype`."""
    from torch.distributed.tensor import DTensor

    if isinstance(w, DTensor):
        return DTensor.from_local(w.to_local().get_original_weight().to(dtype), w.device_mesh, w.placements,
                                  run_check=False, shape=w.shape, stride=w.stride())
    return w.get_original_weight().to(dtype)


class NF4Base(torch.autograd.Function):
    """x W^T for a frozen NF4 weight W: saves the 4-bit weight, not its dequantised copy, for the backward
    (which makes it again: a temporary full-precision weight per layer, in the forward and the backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return F.linear(x, dequantize(w, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (w,) = ctx.saved_tensors
        return grad @ dequantize(w, grad.dtype), None


def _new(like: torch.Tensor, shape: tuple, placement) -> nn.Parameter:
    """A parameter of `shape` on `like`'s device, a DTensor on its mesh with `placement` when `like` is one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    t = torch.empty(shape, device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        t = distribute_tensor(t, like.device_mesh, [placement], src_data_rank=None)
    return nn.Parameter(t)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets=TARGETS) -> list[str]:
    """Add adapters to the nn.Linear layers named in `targets` (the last part of their name) and freeze
    everything else. Returns the names of the adapted layers."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, m in model.named_modules():
        if not (type(m) is nn.Linear and name.rsplit(".", 1)[-1] in targets):
            continue
        w = m.weight
        placement = w.placements[0] if isinstance(w, DTensor) else None
        rowwise = isinstance(placement, Shard) and placement.dim == 1
        m.__class__ = LoRALinear  # keeps the layer's hooks (tensor parallel's) and its weight's name
        m.lora_A = _new(w, (rank, m.in_features), Shard(1) if rowwise else Replicate())
        m.lora_B = _new(w, (m.out_features, rank), Replicate() if rowwise or placement is None else Shard(0))
        m.scaling = alpha / rank
        m.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        done.append(name)
    return done


def store_frozen_as(model: nn.Module, dtype: torch.dtype) -> int:
    """Keep the frozen weights in `dtype` (bf16 when the run computes in it): no optimizer updates them,
    so they need no fp32 copy. Returns how many parameters were cast."""
    n = 0
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if not p.requires_grad and p.dtype != dtype:
                m.register_parameter(name, nn.Parameter(p.to(dtype), requires_grad=False))
                n += 1
    return n


def init_lora_(name: str, t: torch.Tensor, generator=None) -> bool:
    """PEFT's initialization of `name` when it is an adapter parameter; False otherwise."""
    if name.endswith("lora_A"):
        nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
        return True
    if name.endswith("lora_B"):
        nn.init.zeros_(t)
        return True
    return False
