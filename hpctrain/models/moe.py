"""Mixture-of-Experts feed-forward layer: a router picks top_k of `experts` SwiGLU experts per token.

Like the Llama around it, the layer knows nothing of parallelism: it routes, asks its dispatcher
(hpctrain.models.dispatch; hpctrain.parallel.dispatch for expert parallel) and combines:

    route (router)  ->  permute (tokens sorted by expert)  ->  dispatcher: experts  ->  unpermute (weighted sum)

The dispatcher also owns what depends on where tokens and experts live: the weights as this rank computes
with them, and the routing statistics summed over the ranks that split a micro-batch's tokens.

The experts' weights are three 3-D tensors, expert first, so that a shard along dim 0 is a set of
whole experts. `Experts` computes them either as one grouped GEMM (`torch._grouped_mm`, which has a
CPU path for 16-byte-aligned shapes) or as a loop over experts, the reference the grouped path is
tested against. The balancing losses reach the gradient through `_AuxGrad` (the trick of DeepSeek's
and Megatron's MoE layers): the output is returned unchanged and the loss's gradient is injected in
backward, so the losses need no path to the training loss and work on any pipeline stage.
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.schema import ModelConfig
from hpctrain.core.shape import expert_ffn
from hpctrain.models.dispatch import LocalDispatcher
from hpctrain.models.ffn import FeedForward, swiglu


class _AuxGrad(torch.autograd.Function):
    """Identity on `out`; in backward, d(loss)/d(aux) = scale (the weight of the step's loss that the
    micro-batch carries), so aux's gradient flows into the router as if added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def _as_is(w: torch.Tensor) -> torch.Tensor:
    return w


class Router(nn.Module):
    """Scores every expert for every token and keeps top_k. `bias` (DeepSeek-V3's balancing bias, moved
    by hpctrain.train.router_stats outside the gradient) shifts only which experts are picked, never
    the weights the picked ones get."""

    def __init__(self, a: ModelConfig):
        super().__init__()
        e = a.moe
        self.experts, self.top_k, self.kind = e.experts, e.top_k, str(e.router)
        self.norm_topk, self.route_scale = e.norm_topk, e.route_scale
        self.weight = nn.Parameter(torch.empty(e.experts, a.dim))
        self.register_buffer("bias", torch.zeros(e.experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, view: Callable = _as_is):
        """x (tokens, dim) -> (expert index (tokens, top_k), weight (tokens, top_k) fp32, router logits
        fp32, the probabilities the balancing loss reads (tokens, experts) fp32). `view`: the weight as
        this rank computes with it (the dispatcher's `weight`)."""
        logits = F.linear(x, view(self.weight)).float()
        if self.kind == "softmax":
            scores = probs = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        idx = torch.topk(scores + self.bias, self.top_k, dim=-1).indices
        weight = scores.gather(-1, idx)
        if self.norm_topk:
            weight = weight / (weight.sum(-1, keepdim=True) + (1e-20 if self.kind == "sigmoid" else 0.0))
        return idx, weight * self.route_scale, logits, probs

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)


def aligned(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm needs every row of its operands to start on a 16-byte boundary."""
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


class Experts(nn.Module):
    """`experts` SwiGLU FFNs; w1 (gate) and w3 (up): (experts, ffn, dim), w2 (down): (experts, dim, ffn),
    the layout of each expert's nn.Linear weights stacked."""

    def __init__(self, a: ModelConfig, experts: int | None = None):
        super().__init__()
        e, f = experts if experts is not None else a.moe.experts, expert_ffn(a)
        self.grouped = bool(a.moe.grouped_mm)
        self.w1 = nn.Parameter(torch.empty(e, f, a.dim))
        self.w3 = nn.Parameter(torch.empty(e, f, a.dim))
        self.w2 = nn.Parameter(torch.empty(e, a.dim, f))
        # (gate, up) -> the product w2 reads, as FeedForward.act (parallel.ac_modules=[moe_act])
        self.act = swiglu

    def forward(self, x: torch.Tensor, counts: torch.Tensor, view: Callable = _as_is) -> torch.Tensor:
        """x: tokens sorted by expert, `counts[e]` rows for expert e of this module's weights. `view`: each
        weight as this rank computes with it (the dispatcher's `expert_weight`), taken here, once FSDP2
        has gathered the weights of this module (a unit of its own under expert parallel)."""
        w1, w2, w3 = (view(w) for w in (self.w1, self.w2, self.w3))
        if self.grouped and aligned(x, w1, w2) and x.shape[0] > 0:
            return grouped_swiglu(x, counts, w1, w2, w3, self.act)
        return looped_swiglu(x, counts, w1, w2, w3, self.act)


def looped_swiglu(x, counts, w1, w2, w3, act=swiglu) -> torch.Tensor:
    """The reference: one SwiGLU per expert over its rows."""
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):
        out.append(F.linear(act(F.linear(rows, w1[e]), F.linear(rows, w3[e])), w2[e]))
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def grouped_swiglu(x, counts, w1, w2, w3, act=swiglu) -> torch.Tensor:
    offs = counts.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    h = _contiguous_grad(act(gate, up))
    return _contiguous_grad(torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs))


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's CPU backward refuses a gradient with zero strides (an expanded one, as a
    sum's backward makes): each gradient reaching `t` is made contiguous first."""
    if t.requires_grad:
        t.register_hook(torch.Tensor.contiguous)
    return t


class Routed:
    """One micro-batch's routing of its tokens, kept from permute to unpermute."""

    def __init__(self, idx: torch.Tensor, weight: torch.Tensor, experts: int, capacity: int = 0):
        tokens, k = idx.shape
        flat = idx.flatten()
        self.order = torch.argsort(flat, stable=True)  # slot ids sorted by expert, token order within
        self.counts = torch.bincount(flat, minlength=experts)
        self.routed = self.counts
        self.keep = None
        if capacity:
            start = self.counts.cumsum(0) - self.counts
            rank_in_expert = torch.arange(flat.numel(), device=flat.device) - start[flat[self.order]]
            self.keep = rank_in_expert < capacity
            self.order = self.order[self.keep]
            self.counts = self.counts.clamp(max=capacity)
        self.token = self.order // k
        self.weight = weight.flatten()[self.order]
        self.tokens = tokens

    @property
    def dropped(self) -> torch.Tensor:
        """Routed slots over capacity, as a tensor (no wait for the device)."""
        return (self.routed - self.counts).sum() if self.keep is not None else self.routed.new_zeros(())

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.token]

    def unpermute(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.tokens, y.shape[-1], dtype=y.dtype, device=y.device)
        return out.index_add_(0, self.token, (y.float() * self.weight[:, None]).to(y.dtype))


def balance_losses(logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor, tokens: int | None = None):
    """(Switch load-balancing loss, router z-loss) of one micro-batch's tokens, unscaled: experts x
    sum_e f_e P_e, f_e = routed slots of expert e per token (summing to top_k) and P_e = its mean
    probability (transformers' load_balancing_loss_func for one layer); mean of logsumexp(logits)^2.
    `tokens` (tensor or context parallel): the micro-batch's tokens over every rank that splits them, of
    which `logits` and `probs` are this rank's share and `counts` the whole's; the results are then this
    rank's parts of the losses, which sum over those ranks to the whole micro-batch's."""
    tokens = max(1, tokens or logits.shape[0])
    f = counts.float() / tokens
    aux = probs.shape[-1] * (f * probs.sum(0) / tokens).sum()
    z = torch.logsumexp(logits, -1).pow(2).sum() / tokens
    return aux, z


class MoE(nn.Module):
    """Router + routed experts (+ shared experts) in place of a block's SwiGLU."""

    def __init__(self, a: ModelConfig):
        super().__init__()
        e = a.moe
        self.num_experts, self.top_k = e.experts, e.top_k
        self.capacity_factor = e.capacity_factor
        self.aux_coef, self.z_coef = e.aux_loss_coef, e.z_loss_coef
        self.router = Router(a)
        self.experts = Experts(a)
        self.shared = FeedForward(a, e.shared_experts * expert_ffn(a)) if e.shared_experts else None
        # Where this layer's tokens and experts live (hpctrain.parallel.apply sets it, once, for every
        # layer: hpctrain.parallel.dispatch.token_dispatcher): every expert here and this rank's tokens the
        # whole micro-batch's, until then.
        self.dispatcher = LocalDispatcher()
        # The weight of one micro-batch in the step's loss (1 / micro-batches; 1 under pipelining,
        # whose schedule scales the gradients itself): what the balancing losses' gradient is scaled by.
        self.aux_scale = 1.0
        self.stats = MoEStats(e.experts)

    def capacity(self, tokens: int) -> int:
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dispatcher
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, weight, logits, probs = self.router(x, d.weight)
        routing = Routed(idx, weight, self.num_experts, self.capacity(x.shape[0]))
        out = routing.unpermute(d.experts(self.experts, routing.permute(x), routing.counts))
        if self.shared is not None:
            s = self.shared
            w1, w2, w3 = d.weight(s.w1.weight), d.weight(s.w2.weight), d.weight(s.w3.weight)
            out = out + F.linear(swiglu(F.linear(x, w1), F.linear(x, w3)), w2)
        # Each rank of a token group routes its share: the losses count the whole micro-batch's slots
        counts, tokens = d.totals(routing.routed, x.shape[0])
        aux, z = balance_losses(logits, probs, counts, tokens)
        if self.training and torch.is_grad_enabled():
            loss = self.aux_coef * aux + self.z_coef * z
            if loss.requires_grad:
                out = _AuxGrad.apply(out, loss, self.aux_scale)
        if self.training:
            # aux and z: this rank's parts of the micro-batch's; dropped: its own slots over capacity
            parts = d.whole(torch.stack([aux.detach(), z.detach(), routing.dropped.to(aux.dtype)]))
            self.stats.record(counts, parts[0], parts[1], parts[2])
        return out.reshape(shape)

    def reset_parameters(self) -> None:
        self.router.reset_parameters()


class MoEStats:
    """What the router did over the micro-batches of a step on this rank, for the metrics and the
    balancing bias: routed slots per expert, balancing losses, dropped slots. Forward passes that
    activation checkpointing reruns in backward are not counted twice."""

    def __init__(self, experts: int):
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.load = None
        self.aux = self.z = 0.0
        self.passes = 0
        self.dropped = 0

    def record(self, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor) -> None:
        if _recomputations:
            return
        counts = counts.detach().float()
        self.load = counts if self.load is None else self.load + counts
        self.aux += aux.detach()
        self.z += z.detach()
        self.passes += 1
        self.dropped += dropped.detach()


# Activation checkpointing reruns a block's forward in backward to recompute its activations; the rerun
# routes the same tokens again and must not be counted. hpctrain.parallel.activation's wrapper enters
# `recomputation()` around it (torch.utils.checkpoint's context_fn): a count, not a flag, so that nested
# checkpoints compose.
_recomputations = 0


@contextmanager
def recomputation():
    global _recomputations
    _recomputations += 1
    try:
        yield
    finally:
        _recomputations -= 1


def recompute_contexts() -> tuple:
    """torch.utils.checkpoint's `context_fn`: nothing around the first forward, `recomputation()` around
    its rerun in backward."""
    return nullcontext(), recomputation()


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
