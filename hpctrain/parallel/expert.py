"""Expert parallel: each MoE layer's experts split over the ranks of the `ep` mesh dimension.

Every expert weight becomes a DTensor sharded along its first (expert) dimension, so that rank j of
an ep group holds experts [j E/ep, (j+1) E/ep) and checkpoints store the whole stacked tensor (DCP
reshards it onto another ep). The tokens then travel to their experts through the all-to-all token
dispatcher, which also scales the expert weights' gradient by 1/ep (hpctrain.parallel.dispatch; chosen,
with the ranks splitting each micro-batch's tokens, by hpctrain.parallel.apply).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hpctrain.models.moe import moe_modules


def apply_ep(model: nn.Module, ep_mesh, ep_tp_mesh=None) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (a meta-device model: nothing is allocated).
    With tensor parallel (`ep_tp_mesh`, the (ep, tp) mesh), each expert is also replicated over TP,
    where every rank computes the rows its own share of the sequence routed to it."""
    for moe in moe_modules(model):
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            if ep_tp_mesh is not None:
                held = distribute_tensor(torch.empty(p.shape, dtype=p.dtype, device="meta"), ep_tp_mesh,
                                         [Shard(0), Replicate()])
            else:
                held = distribute_tensor(p, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(held))
    return model
