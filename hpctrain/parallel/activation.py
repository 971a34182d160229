"""What wraps each block: activation checkpointing (keep only each block's input, recompute the rest
in backward; full: every block, selective: every `every`-th) and torch.compile."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hpctrain.models.moe import moe_modules, recompute_contexts


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (mode == "selective" and i % every == 0):
            model.layers[name] = checkpointed(block)
    return model


def checkpointed(block: nn.Module) -> nn.Module:
    """`block` recomputed in backward. Non-reentrant: composes with FSDP2 and DTensor; the wrapper's
    prefix is stripped from state dicts, so checkpoints keep the plain names. A block with MoE layers has
    its rerun marked (hpctrain.models.moe.recomputation), so that their routing statistics count each
    micro-batch once; the others keep torch's default context (which torch.compile turns into its own
    recompute-everything policy)."""
    marks = {"context_fn": recompute_contexts} if moe_modules(block) else {}
    return checkpoint_wrapper(block, preserve_rng_state=False, **marks)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile block by block (torchtitan's choice): every block has the same code, so one graph is
    compiled and reused, and FSDP's per-block hooks stay outside the graphs."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    return model
