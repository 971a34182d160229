"""Expert parallel: each MoE layer's experts split over the ranks of the `ep` mesh dimension.

Every expert weight becomes a DTensor sharded along its first (expert) dimension, so that rank j of
an ep group holds experts [j E/ep, (j+1) E/ep) and checkpoints store the whole stacked tensor (DCP
reshards it onto another ep). A layer's tokens, sorted by expert on each rank, then go where their
expert lives (torchtitan's and Megatron's all-to-all token dispatcher):

    counts:  all_to_all_single of the routed rows per (destination rank, its expert)
    tokens:  all_to_all_single with those uneven splits (autograd's backward is the reverse exchange)
    compute: the rows regrouped by local expert, one grouped GEMM (or the loop)
    combine: regrouped back, all_to_all_single the reverse way

Gradients: a rank's expert weights see the tokens of all its ep peers, so their gradient is the sum
over ep data-parallel ranks' losses where every other weight's is one rank's; FSDP2 then averages over
efsdp only. `Experts.grad_scale` = 1/ep makes it the data-parallel mean (torchtitan sets FSDP2's
gradient divide factor instead, a PREMUL_SUM reduction that gloo lacks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hpctrain.models.moe import moe_modules


def apply_ep(model: nn.Module, ep_mesh, ep_tp_mesh=None) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (a meta-device model: nothing is allocated).
    With tensor parallel (`ep_tp_mesh`, the (ep, tp) mesh), each expert is also replicated over TP,
    where every rank computes the rows its own share of the sequence routed to it."""
    ep = ep_mesh.size()
    for moe in moe_modules(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            if ep_tp_mesh is not None:
                held = distribute_tensor(torch.empty(p.shape, dtype=p.dtype, device="meta"), ep_tp_mesh,
                                         [Shard(0), Replicate()])
            else:
                held = distribute_tensor(p, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(held))
        experts.grad_scale = 1.0 / ep
        moe.dispatcher = AllToAll(ep_mesh.get_group(), moe.num_experts)
    return model


class AllToAll:
    """Dispatch rows sorted by (global) expert to the ranks holding their experts, and combine back."""

    def __init__(self, group, experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = experts // self.ep

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.int64)
        got = torch.empty_like(counts)
        # got[src * local + e]: rows that rank src sends for this rank's expert e
        dist.all_to_all_single(got, counts, group=self.group)
        sent = counts.view(self.ep, self.local).sum(1).tolist()
        got = got.view(self.ep, self.local)
        received = got.sum(1).tolist()
        x = exchange(rows, received, sent, self.group)
        order = by_expert(got)
        y = experts(x[order], got.sum(0))
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
