"""Apply the engine spec's parallelism to a meta-device model, torchtitan's order:
pipeline split -> float8 (train.precision=fp8) -> tensor parallel -> expert parallel -> context parallel -> MoE token dispatcher -> LoRA adapters
-> activation checkpointing -> sequence-parallel re-gather -> compile -> data parallel -> materialize.

Returns the model parts this rank trains (one, or several pipeline stages) and, with pipeline
parallel, the stages the schedule drives. Every decision (which engine, dtypes, resharding, where
parameters live, the blocks of each stage) comes from hpctrain.core.spec.EngineSpec.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from hpctrain.models.lora import apply_lora, store_frozen_as
from hpctrain.models.loss import set_loss
from hpctrain.models.moe import moe_modules
from hpctrain.parallel.activation import apply_ac, apply_compile
from hpctrain.parallel.context import apply_cp
from hpctrain.parallel.data_parallel import apply_ddp, apply_fsdp, apply_replicate
from hpctrain.parallel.float8 import apply_float8
from hpctrain.parallel.dispatch import token_dispatcher
from hpctrain.parallel.expert import apply_ep
from hpctrain.parallel.init import materialize
from hpctrain.parallel.pipeline import stage_module
from hpctrain.parallel.regather import apply_sp_regather
from hpctrain.parallel.tensor import apply_tp, keep_grads_like_params
from hpctrain.core.spec import EngineSpec


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


def parallelize(model: nn.Module, meshes, spec: EngineSpec, device: torch.device, init_param_, seed: int,
                pin_memory: bool = True) -> Parallelized:
    """`model` must be on the meta device."""
    init = partial(materialize, device=device, seed=seed, init_param_=init_param_)
    set_loss(model, spec.loss, spec.loss_chunk, spec.config.train.z_loss_coef, spec.loss_kernel,
             per_row=spec.config.train.objective == "dpo")
    pipe = spec.pipeline
    if pipe:
        ids = pipe.stage_ids(meshes["pp"].get_local_rank())
        parts = [stage_module(model, s, pipe.stages, pipe.blocks[s]) for s in ids]
    else:
        ids, parts = [0], [model]

    dispatcher = moe_dispatcher(model, meshes)
    out = []
    for part in parts:
        if spec.fp8_recipe:  # before TP (torchtitan's order): the float8 modules are what TP, EP and FSDP2 shard
            apply_float8(part, spec, device)
        if meshes.enabled("tp"):
            apply_tp(part, meshes["tp"])
        if meshes.enabled("ep"):
            apply_ep(part, meshes["ep"], meshes["ep_tp"] if meshes.enabled("tp") else None)
        if meshes.enabled("cp"):
            apply_cp(part, meshes["cp"], spec.cp_attention, spec.cp_kernel)
        for moe in moe_modules(part):
            moe.dispatcher = dispatcher
        if spec.lora:  # after TP: the adapters are split as their layer is
            apply_lora(part, spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.targets)
            if spec.dtypes.compute != "float32":  # frozen: no fp32 copy needed, computed in bf16 anyway
                store_frozen_as(part, getattr(torch, spec.dtypes.compute))
        if spec.ac != "none" or spec.ac_modules:
            apply_ac(part, spec.ac, spec.ac_every, spec.ac_modules)
        if spec.sp_regather:
            apply_sp_regather(part)
        if spec.compile:
            apply_compile(part)
        if spec.data_parallel == "fsdp":
            host = spec.placement.params == "host"
            apply_fsdp(part, meshes["fsdp"], param_dtype=getattr(torch, spec.dtypes.param),
                       reduce_dtype=getattr(torch, spec.dtypes.reduce),
                       reshard_after_forward=spec.sharding.reshard_after_forward, host_params=host,
                       pin_memory=host and device.type == "cuda" and pin_memory, expert_mesh=meshes["efsdp"] if meshes.enabled("ep") else None)
            init(part, param_device=torch.device("cpu") if host else None)
        elif spec.data_parallel in ("replicate", "replicate_zero1"):
            apply_replicate(part, meshes["dp"])
            init(part)
        else:
            init(part)  # DDP needs real weights to wrap
            if meshes.enabled("tp"):
                keep_grads_like_params(part)
            if meshes.enabled("dp"):
                part = apply_ddp(part, meshes["dp"])
        out.append(part)
    return Parallelized(out, ids, pipe.stages if pipe else 1)


def moe_dispatcher(model: nn.Module, meshes):
    """The token dispatcher of every MoE layer of `model` (None: it has none), chosen once from where
    the tokens and the experts live together: the ranks that split each micro-batch's tokens (tensor
    parallel's sequence shares, context parallel's chunks, or both), over which the layers sum their
    routing statistics, and the ep ranks that split the experts."""
    moes = moe_modules(model)
    if not moes:
        return None
    tokens = meshes["cp_tp"] if meshes.enabled("cp_tp") else None
    return token_dispatcher(moes[0].num_experts, tokens, meshes["ep"] if meshes.enabled("ep") else None)
