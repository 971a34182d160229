"""The SwiGLU feed-forward layer of a Llama block, and of each expert of a Mixture-of-Experts layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.schema import ModelConfig


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for backward (Megatron's fused SwiGLU): autograd of the
    two ops would also keep silu(gate), one more ffn-wide tensor per token and block. The backward
    recomputes the sigmoid, in fp32 as torch's own silu backward does."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        g, x, u = grad.float(), gate.float(), up.float()
        sig = torch.sigmoid(x)
        d_gate = g * u * (sig * (1 + x * (1 - sig)))
        d_up = g * (x * sig)
        return d_gate.to(gate.dtype), d_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # the compiled graph's partitioner decides what to keep
        return F.silu(gate) * up
    return _SwiGLU.apply(gate, up)


class FeedForward(nn.Module):
    def __init__(self, a: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or a.ffn_dim
        self.w1 = nn.Linear(a.dim, width, bias=False)  # gate
        self.w3 = nn.Linear(a.dim, width, bias=False)  # up
        self.w2 = nn.Linear(width, a.dim, bias=False)  # down
        # (gate, up) -> the product w2 reads; module recomputation puts its own in place
        # (hpctrain.parallel.activation: parallel.ac_modules=[mlp])
        self.act = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))
