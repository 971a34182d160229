"""Apply the configured parallelism to a meta-device model, torchtitan's order:
pipeline split -> tensor parallel -> activation checkpointing -> compile -> data parallel -> materialize.

Returns the model parts this rank trains (one, or several pipeline stages) and, with pipeline
parallel, the stages the schedule drives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from hpctrain.layout import params_on_host
from hpctrain.parallel.activation import apply_ac, apply_compile
from hpctrain.parallel.data import apply_ddp, apply_fsdp
from hpctrain.parallel.init import materialize
from hpctrain.parallel.pipeline import layer_ranges, stage_ids, stage_module, stages_per_rank
from hpctrain.parallel.tensor import apply_tp


@dataclass
class Parallelized:
    parts: list  # nn.Modules this rank trains, in stage order
    stage_indices: list = field(default_factory=lambda: [0])
    num_stages: int = 1

    @property
    def first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices


def parallelize(model: nn.Module, meshes, cfg, device: torch.device, init_param_) -> Parallelized:
    """`model` must be on the meta device."""
    p = cfg.parallel
    param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    init = partial(materialize, device=device, seed=cfg.train.seed, init_param_=init_param_)

    if p.pp > 1:
        pp_rank = meshes.world["pp"].get_local_rank()
        per_rank = stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
        num_stages = p.pp * per_rank
        ranges = layer_ranges(model, num_stages)
        ids = stage_ids(pp_rank, p.pp, per_rank, p.pp_schedule)
        parts = [stage_module(model, s, num_stages, ranges[s]) for s in ids]
    else:
        ids, num_stages, parts = [0], 1, [model]

    out = []
    for part in parts:
        if p.tp > 1:
            apply_tp(part, meshes.world["tp"])
        if p.ac != "none":
            apply_ac(part, p.ac, p.ac_every)
        if cfg.train.compile:
            apply_compile(part)
        if p.zero >= 2:
            # ZeRO-2 keeps parameters gathered from forward through backward; ZeRO-3 re-gathers them
            # per block in backward. With pipelining each block runs once per micro-batch: gather once.
            host = params_on_host(cfg.offload.target, p.zero, p.tp)
            apply_fsdp(part, meshes.fsdp, param_dtype=param_dtype, reduce_dtype=torch.float32,
                       reshard_after_forward=(p.zero == 3 and p.pp == 1), host_params=host,
                       pin_memory=host and device.type == "cuda" and bool(cfg.offload.pin_memory))
            init(part, param_device=torch.device("cpu") if host else None)
        else:
            init(part)  # DDP needs real weights to wrap
            if meshes.dp.size() > 1:
                part = apply_ddp(part, meshes.dp)
        out.append(part)
    return Parallelized(out, ids, num_stages)
