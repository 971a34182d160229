"""Data parallel: DDP (ZeRO-0 and, with a sharded optimizer, ZeRO-1), FSDP2's replicate (ZeRO-0 and -1
composed with tensor and pipeline parallel) or FSDP2 (ZeRO-2 and -3; HSDP when the mesh has a
replicate dimension)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from hpctrain.models.moe import moe_modules


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True, host_params: bool = False, pin_memory: bool = False,
               expert_mesh=None) -> nn.Module:
    """Shard every block, the embedding, the final norm with the output, then the root.

    `expert_mesh` (expert parallel): each MoE layer's experts, already split over the ep ranks, are
    sharded over these ranks (what ep leaves of dp_shard) as a unit of their own, before their block.

    `host_params` (optimizer offload): the sharded fp32 parameters and their gradients live in host
    memory. FSDP2 then copies each block's reduced gradient shard to the host as soon as its
    reduce-scatter is done (asynchronously into pinned memory), while backward goes on, and copies the
    updated shard to the device at the block's next all-gather: the host optimizer updates the
    parameters in place, with no transfer of its own."""
    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              offload_policy=CPUOffloadPolicy(pin_memory=pin_memory) if host_params else OffloadPolicy())
    blocks = list(model.layers.values())
    if not blocks:  # a pipeline stage with only the embedding or the output
        fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
        return model
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        if expert_mesh is not None:
            for moe in moe_modules(block):
                fully_shard(moe.experts, reshard_after_forward=reshard, **{**kw, "mesh": expert_mesh})
        fully_shard(block, reshard_after_forward=reshard, **kw)
    shard_ends(model, reshard_after_forward, kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    return model


def shard_ends(model: nn.Module, reshard_after_forward: bool, kw: dict) -> None:
    """The embedding, and the final norm with the output layer, as FSDP units of their own (torchtitan's
    split): left in the root, the two vocabulary-sized matrices would be gathered together, and again at
    the start of the backward although only the output is needed there. The output is needed at once by
    the backward: it stays gathered. Tied embeddings are one tensor: they stay in the root."""
    emb, norm, out = (getattr(model, k, None) for k in ("tok_embeddings", "norm", "output"))
    if emb is not None and out is not None and emb.weight is out.weight:
        return
    if emb is not None:
        fully_shard(emb, reshard_after_forward=reshard_after_forward, **kw)
    head = [m for m in (norm, out) if m is not None]
    if head:
        fully_shard(head, reshard_after_forward=False, **kw)


def apply_ddp(model: nn.Module, dp_mesh) -> nn.Module:
    device_ids = None if next(model.parameters()).device.type == "cpu" else [next(model.parameters()).device]
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)


def apply_replicate(model: nn.Module, dp_mesh) -> nn.Module:
    """Parameters replicated over data parallel, gradients all-reduced in fp32: FSDP2's `replicate`
    (torch's DDP built on FSDP2), per block then the root as apply_fsdp, so each block's all-reduce
    overlaps the rest of the backward. Unlike DDP it takes tensor-parallel DTensor parameters (they
    become DTensors over (dp, tp), replicated over dp) and pipeline stages drive it the way they drive
    FSDP2 (gradient sync on a step's last backward only)."""
    for block in model.layers.values():
        replicate(block, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model
