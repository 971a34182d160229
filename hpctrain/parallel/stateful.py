"""The model's and the optimizer's tensors as checkpointable (Stateful) objects, named the same
whatever the layout, so DCP can reshard them:

    model.<fqn>               every parameter (a DTensor under FSDP/TP: DCP stores its shards)
    optim.<fqn>.<name>        the optimizer state of that parameter (exp_avg, exp_avg_sq, step)

<fqn> is the plain Llama's parameter name. With ZeRO-1 only the rank that owns a parameter holds its
optimizer state and saves it; with pipeline parallel each rank holds the stages it runs.

Each object's state_dict() returns the live tensors themselves, so DCP loads into them in place;
`key()` is the identity of those tensors: while it is unchanged, a state dict built earlier still
refers to the current (updated in place) values and can be saved again as it is.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns, get_model_state_dict, set_model_state_dict


def _plain_optimizer(optimizer):
    """The optimizer that owns per-parameter state (ZeroRedundancyOptimizer wraps a local one)."""
    return getattr(optimizer, "optim", optimizer)


def _named_params(parts: list[nn.Module]) -> dict[int, str]:
    names = {}
    for part in parts:
        for name, p in part.named_parameters():
            (fqn,) = _get_fqns(part, name)  # strips DDP's module. and checkpoint wrappers
            names[id(p)] = fqn
    return names


class ModelState:
    """Every parameter of this rank's model parts (pipeline stages), by its plain name."""

    sharded = True  # DCP saves and reshards it (hpctrain.checkpoint.manager)
    # A checkpoint holding a model.* tensor this model lacks is another model's: refused, not dropped.
    # (The optimizer's keys differ by layout and are not held to this.)
    exact_keys = True

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict:
        out = {}
        for part in self.parts:
            out.update(get_model_state_dict(part))
        return out

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, {k: state[k] for k in get_model_state_dict(part)})

    def key(self) -> tuple:
        return tuple(id(p) for part in self.parts for p in part.parameters())


class OptimizerState:
    """The optimizer's per-parameter tensors (moments, step counts, offloaded master weights)."""

    sharded = True

    def __init__(self, parts: list[nn.Module], optimizer):
        self.parts, self.optimizer = parts, optimizer

    def state_dict(self) -> dict:
        init_optimizer_state(self.parts, self.optimizer)
        names = _named_params(self.parts)
        out = {}
        for p, st in _plain_optimizer(self.optimizer).state.items():
            if id(p) in names and st:
                out[names[id(p)]] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        # DCP loaded into the tensors state_dict() returned, which are the optimizer's own: a copy is
        # needed only where a tensor was replaced since.
        live = self.state_dict()
        for name, tensors in state.items():
            for k, v in tensors.items():
                if live[name][k] is not v:
                    live[name][k].copy_(v)

    def key(self) -> tuple:
        opt = _plain_optimizer(self.optimizer)
        return tuple(id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


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
