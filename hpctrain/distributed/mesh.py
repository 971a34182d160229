"""One DeviceMesh for every parallel dimension, TP innermost so it stays inside a node.

With expert parallel, dp_shard is itself two dimensions, (efsdp, ep): the ep ranks of a group split
each MoE layer's experts and the efsdp groups shard each expert's weights, as FSDP2 wants (the
experts' DTensor mesh and the mesh FSDP shards them over must come from one root mesh). dp_shard is
then the flattened pair, so the dense parameters, data order and everything else see the same
ranks in the same order as without expert parallel. With context parallel the cp ranks join the
experts' sharding as they join the dense parameters' (efsdp x cp): they hold the same experts and
read the same samples, and sit ep x tp ranks apart (tp without expert parallel).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import init_device_mesh

from hpctrain.core.spec import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# cp before ep: FSDP2 lays the experts' weights out on (efsdp x cp, ep), and DTensor slices a mesh only
# in the root's dimension order
EP_DIMS = ("pp", "dp_replicate", "efsdp", "cp", "ep", "tp")


@dataclass
class Meshes:
    world: object  # the DeviceMesh of every dimension
    dp: object  # every rank of a different data-parallel or cp rank as one dimension (loss, gradients, DDP)
    fsdp: object  # what FSDP shards over: dp_shard (x cp), or (dp_replicate, dp_shard (x cp)) for HSDP
    ep: Optional[object] = None  # expert parallel: the ranks that split each MoE layer's experts
    efsdp: Optional[object] = None  # what FSDP shards each expert's weights over (HSDP: with dp_replicate)
    # The ranks that read different samples: dp without the cp ranks, who split each sample's sequence
    # (torchtitan's way: cp ranks are data-parallel ranks for the gradients and the parameter sharding).
    data: Optional[object] = None
    cp: Optional[object] = None  # context parallel: the ranks splitting each sequence


def build_mesh(layout: Layout, device_type: str) -> Meshes:
    if layout.ep > 1:
        return _expert_mesh(layout, device_type)
    shape = tuple(getattr(layout, d) for d in DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    if layout.cp == 1:
        dp = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        fsdp = mesh[("dp_replicate", "dp_shard")] if layout.dp_replicate > 1 else mesh["dp_shard"]
        return Meshes(world=mesh, dp=dp, fsdp=fsdp, data=dp)
    data = mesh[("dp_replicate", "dp_shard")]._flatten("data")
    dp = mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp")
    shard = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    # HSDP's 2-D mesh is sliced from the root by the flattened name (torch warns that this will change)
    fsdp = mesh[("dp_replicate", "dp_shard_cp")] if layout.dp_replicate > 1 else shard
    return Meshes(world=mesh, dp=dp, fsdp=fsdp, data=data, cp=mesh["cp"])


def _expert_mesh(layout: Layout, device_type: str) -> Meshes:
    shape = (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.cp, layout.ep, layout.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_DIMS)
    hsdp = layout.dp_replicate > 1
    dp = mesh[("dp_replicate", "efsdp", "cp", "ep")]._flatten("dp")
    # HSDP's 2-D meshes are sliced from the root by the flattened names (torch warns that this will change)
    if layout.cp == 1:
        dp_shard = mesh[("efsdp", "ep")]._flatten("dp_shard")
        fsdp = mesh[("dp_replicate", "dp_shard")] if hsdp else dp_shard
        efsdp = mesh[("dp_replicate", "efsdp")] if hsdp else mesh["efsdp"]
        return Meshes(world=mesh, dp=dp, fsdp=fsdp, ep=mesh["ep"], efsdp=efsdp, data=dp)
    data = mesh[("dp_replicate", "efsdp", "ep")]._flatten("data")
    shard = mesh[("efsdp", "cp", "ep")]._flatten("dp_shard_cp")
    expert_shard = mesh[("efsdp", "cp")]._flatten("efsdp_cp")
    fsdp = mesh[("dp_replicate", "dp_shard_cp")] if hsdp else shard
    efsdp = mesh[("dp_replicate", "efsdp_cp")] if hsdp else expert_shard
    return Meshes(world=mesh, dp=dp, fsdp=fsdp, ep=mesh["ep"], efsdp=efsdp, data=data, cp=mesh["cp"])
