"""Apply the configured parallelism to a meta-device model and materialize this rank's part."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hpctrain.parallel.data import apply_ddp, apply_fsdp
from hpctrain.parallel.init import materialize


def parallelize(model: nn.Module, meshes, cfg, device: torch.device, init_param_) -> nn.Module:
    """Returns the module to train. `model` must be on the meta device."""
    precision = cfg.train.precision
    param_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    init = partial(materialize, device=device, seed=cfg.train.seed, init_param_=init_param_)
    if cfg.parallel.zero == 3:
        apply_fsdp(model, meshes.fsdp, param_dtype=param_dtype, reduce_dtype=torch.float32)
        init(model)
        return model
    init(model)  # DDP needs real weights to wrap
    return apply_ddp(model, meshes.dp)
