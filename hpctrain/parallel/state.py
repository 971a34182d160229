"""The tensors a checkpoint holds, named the same whatever the layout, so DCP can reshard them:

    model.<fqn>               every parameter (a DTensor under FSDP/TP: DCP stores its shards)
    optim.<fqn>.<name>        the optimizer state of that parameter (exp_avg, exp_avg_sq, step)

<fqn> is the plain Llama's parameter name. With ZeRO-1 only the rank that owns a parameter holds its
optimizer state and saves it; with pipeline parallel each rank holds the stages it runs.
"""
from __future__ import annotations

import torch
from torch import nn


def _plain_optimizer(optimizer):
    """The optimizer that owns per-parameter state (ZeroRedundancyOptimizer wraps a local one)."""
    return getattr(optimizer, "optim", optimizer)


def _named_params(parts: list[nn.Module]) -> dict[int, str]:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names = {}
    for part in parts:
        for name, p in part.named_parameters():
            (fqn,) = _get_fqns(part, name)  # strips DDP's module. and checkpoint wrappers
            names[id(p)] = fqn
    return names


def model_state(parts: list[nn.Module]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out = {}
    for part in parts:
        out.update(get_model_state_dict(part))
    return out


def optimizer_state(parts: list[nn.Module], optimizer) -> dict:
    names = _named_params(parts)
    opt = _plain_optimizer(optimizer)
    out = {}
    for p, st in opt.state.items():
        if id(p) in names and st:
            out[names[id(p)]] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


@torch.no_grad()
def init_optimizer_state(parts: list[nn.Module], optimizer) -> None:
    """Create the optimizer's state (as its first step would) without changing any parameter, so a
    checkpoint can be loaded into it in place: a step with zero gradients and a learning rate of 0."""
    if _plain_optimizer(optimizer).state:
        return
    for part in parts:
        for p in part.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def state_key(parts: list[nn.Module], optimizer) -> tuple:
    """The identity of every tensor checkpoint_state would hold: while it is unchanged, a state dict
    built earlier refers to the same (updated in place) tensors and can be saved again as it is."""
    params = tuple(id(p) for part in parts for p in part.parameters())
    opt = _plain_optimizer(optimizer)
    states = tuple(id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return params, states


def checkpoint_state(parts: list[nn.Module], optimizer) -> dict:
    init_optimizer_state(parts, optimizer)
    return {"model": model_state(parts), "optim": optimizer_state(parts, optimizer)}


def load_checkpoint_state(parts: list[nn.Module], optimizer, state: dict) -> None:
    """After DCP loaded into `state` (from checkpoint_state): push the model tensors back into the
    parts (the optimizer tensors were loaded in place)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    names = set()
    for part in parts:
        mine = model_state([part])
        names |= set(mine)
        set_model_state_dict(part, {k: state["model"][k] for k in mine})
