"""Data parallel: DDP (ZeRO-0 and, with a sharded optimizer, ZeRO-1) or FSDP2 (ZeRO-2 and -3; HSDP
when the mesh has a replicate dimension)."""
from __future__ import annotations

import torch
from torch import nn


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard every block, then the root (embeddings, final norm, output)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    if not blocks:  # a pipeline stage with only the embedding or the output
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        return model
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


def apply_ddp(model: nn.Module, dp_mesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if next(model.parameters()).device.type == "cpu" else [next(model.parameters()).device]
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
