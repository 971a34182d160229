"""Materialize a meta-device model so that every layout starts from the same weights."""
from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, init_param_,
                param_device: torch.device | None = None) -> None:
    """Allocate this rank's shards and fill them from the full parameter each name would have.

    Each full parameter is generated from a generator seeded by (seed, name) and then cut to this
    rank's shard: the result is independent of how the model is split, at the cost of one full
    parameter of scratch memory at a time. `param_device` (host memory, for optimizer offload) holds
    the parameters; the values are still generated on `device`, so they do not depend on where they live.
    """
    model.to_empty(device=param_device or device)
    for name, p in model.named_parameters():
        # The plain model's name, whatever wraps the block (checkpointing, torch.compile).
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(p.shape, dtype=p.dtype, device=device)
        init_param_(name, full, gen)
        if isinstance(p, DTensor):
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full)
    if hasattr(model, "init_buffers"):
        model.init_buffers(device)
