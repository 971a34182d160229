"""One DeviceMesh for every parallel dimension, TP innermost so it stays inside a node."""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from hpctrain.core.spec import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Meshes:
    world: object  # the 4-D DeviceMesh
    dp: object  # every data-parallel rank as one dimension (loss and token reductions, DDP)
    fsdp: object  # what FSDP shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP


def build_mesh(layout: Layout, device_type: str) -> Meshes:
    shape = tuple(getattr(layout, d) for d in DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    dp = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    fsdp = mesh[("dp_replicate", "dp_shard")] if layout.dp_replicate > 1 else mesh["dp_shard"]
    return Meshes(world=mesh, dp=dp, fsdp=fsdp)
