"""Expert parallel's token dispatcher, and the one place a layer's dispatcher is chosen.

With expert parallel each rank holds experts [j E/ep, (j+1) E/ep) of every MoE layer (hpctrain.parallel.
expert). A layer's rows, sorted by expert on each rank, go where their expert lives (torchtitan's and
Megatron's all-to-all token dispatcher):

    counts:  all_to_all_single of the routed rows per (destination rank, its expert)
    tokens:  all_to_all_single with those uneven splits (autograd's backward is the reverse exchange)
    compute: the rows regrouped by local expert, one grouped GEMM (or the loop)
    combine: regrouped back, all_to_all_single the reverse way

Gradients: a rank's expert weights see the tokens of all its ep peers, so their gradient is the sum over
ep data-parallel ranks' losses where every other weight's is one rank's; FSDP2 then averages over efsdp
only. The dispatcher scales the expert weights' gradient by 1/ep, which makes it the data-parallel mean
(torchtitan sets FSDP2's gradient divide factor instead, a PREMUL_SUM reduction that gloo lacks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from hpctrain.models.dispatch import LocalDispatcher


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class AllToAllDispatcher(LocalDispatcher):
    """Dispatch rows sorted by (global) expert to the ranks of `group` (the ep ranks) holding their
    experts, and combine back; the token-group statistics as LocalDispatcher's."""

    def __init__(self, group, experts: int, token_group=None):
        super().__init__(token_group)
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = experts // self.ep

    def expert_weight(self, w: torch.Tensor) -> torch.Tensor:
        w = self.weight(w)
        return _ScaleGrad.apply(w, 1.0 / self.ep) if self.ep > 1 else w

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple:
        counts = counts.to(torch.int64)
        got = torch.empty_like(counts)
        # got[src * local + e]: rows that rank src sends for this rank's expert e
        dist.all_to_all_single(got, counts, group=self.group)
        sent = counts.view(self.ep, self.local).sum(1).tolist()
        got = got.view(self.ep, self.local)
        received = got.sum(1).tolist()
        x = exchange(rows, received, sent, self.group)
        order = by_expert(got)
        return x[order], got.sum(0), (order, sent, received)

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        order, sent, received = handle
        back = y[torch.argsort(order)]  # rows in the order they arrived (by source rank)
        return exchange(back, sent, received, self.group)


def exchange(rows: torch.Tensor, receive: list, send: list, group) -> torch.Tensor:
    """all_to_all_single with uneven splits, differentiable (backward: the reverse exchange)."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), receive, send, group))


def by_expert(got: torch.Tensor) -> torch.Tensor:
    """Rows arrive grouped by (source rank, local expert); the permutation grouping them by (local
    expert, source rank), so each expert's rows are contiguous."""
    ep, local = got.shape
    block = torch.repeat_interleave(torch.arange(ep * local, device=got.device), got.flatten())
    key = (block % local) * ep + block // local
    return torch.argsort(key, stable=True)


def token_dispatcher(experts: int, token_mesh=None, ep_mesh=None) -> LocalDispatcher:
    """The dispatcher of every MoE layer of a rank, from where its tokens and experts live together:
    `token_mesh` the ranks splitting each micro-batch's tokens (tp, cp or cp x tp; None: none do),
    `ep_mesh` the ranks splitting the experts (None: no expert parallel)."""
    token_group = token_mesh.get_group() if token_mesh is not None else None
    if ep_mesh is not None:
        return AllToAllDispatcher(ep_mesh.get_group(), experts, token_group)
    return LocalDispatcher(token_group)
