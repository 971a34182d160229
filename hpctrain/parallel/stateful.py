"""The model's and the optimizer's tensors as checkpointable (Stateful) objects, named the same
whatever the layout, so DCP can reshard them:

    model.<fqn>               every parameter (a DTensor under FSDP/TP: DCP stores its shards); with
                              checkpoint.weights=adapters only the LoRA adapters (the frozen base is
                              model.init_from's, re-read on resume: hpctrain.checkpoint.base)
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _get_fqns, get_model_state_dict,
                                                     set_model_state_dict)

from hpctrain.core.shape import is_adapter


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


def in_base(name: str) -> bool:
    """A tensor model.init_from gives and training leaves as it is under LoRA: not an adapter, and not an MoE
    router's balancing bias (moved by model.moe.bias_update_rate, and in no Hugging Face format)."""
    return not is_adapter(name) and not name.endswith("moe.router.bias")


class ModelState:
    """Every parameter of this rank's model parts (pipeline stages), by its plain name; or, saving with
    checkpoint.weights=adapters, the LoRA adapters alone.

    What a checkpoint holds is written in its hpctrain.json (`record()`: "weights" and the base's
    fingerprint) and decides what is loaded from it, whatever this run saves: an adapter-only checkpoint
    gives the adapters, and the base is re-read from model.init_from (the trainer does it when
    `base_left_out`) after its fingerprint was found equal to the recorded one; a full checkpoint gives
    every weight. So checkpoint.weights may change between runs: full -> adapters resumes every weight
    and saves the adapters from then on, adapters -> full re-reads the base and saves everything."""

    sharded = True  # DCP saves and reshards it (hpctrain.checkpoint.manager)
    # A checkpoint holding a model.* tensor this model lacks is another model's: refused, not dropped.
    # (The optimizer's keys differ by layout and are not held to this.)
    exact_keys = True

    def __init__(self, parts: list[nn.Module], adapters_only: bool = False, base: str | None = None):
        """`base`: model.init_from, the frozen weights' source (None: the run starts from its own init)."""
        self.parts, self.base = parts, base
        self.saves = "adapters" if adapters_only else "full"
        self.holds = self.saves  # what state_dict() lists: the saved kind, or a checkpoint's while it loads
        self.base_left_out = False  # the last load was an adapter-only checkpoint's: the base is still to read
        self._record: dict | None = None

    def state_dict(self) -> dict:
        out = {}
        for part in self.parts:
            out.update(get_model_state_dict(part))
        if self.holds == "adapters":
            out = {k: v for k, v in out.items() if not in_base(k)}
        return out

    def load_state_dict(self, state: dict) -> None:
        for part in self.parts:
            set_model_state_dict(part, {k: state[k] for k in get_model_state_dict(part) if k in state},
                                 options=StateDictOptions(strict=self.holds == "full"))
        self.base_left_out, self.holds = self.holds == "adapters", self.saves

    def key(self) -> tuple:
        return (self.holds, *(id(p) for part in self.parts for p in part.parameters()))

    # ------------------------------------------------ what a checkpoint holds (hpctrain.json's records)

    def record(self) -> dict:
        """hpctrain.json's entries: the kind of checkpoint, and the base it was trained on (computed once)."""
        if self._record is None:
            from hpctrain.checkpoint.base import record

            self._record = {"weights": self.saves, "base": record(self.base) if self.base else None}
        return self._record

    def select(self, info: dict | None) -> None:
        """List the tensors the checkpoint of hpctrain.json `info` holds (None, unreadable: this run's own
        kind; the checks then say why it is unusable). A checkpoint without the record holds every weight."""
        self.holds = "adapters" if isinstance(info, dict) and info.get("weights") == "adapters" else "full"

    def checkpoint_problem(self, info: dict) -> str | None:
        """Why this run cannot take the checkpoint of hpctrain.json `info`: an adapter-only one needs the
        base it records as model.init_from; a full one resumed by a run that saves adapters only must
        have been trained on model.init_from too (those checkpoints will say it was). None when it can."""
        from hpctrain.checkpoint.base import difference

        recorded = info.get("base")
        at = recorded.get("init_from") if isinstance(recorded, dict) else None
        if info.get("weights") == "adapters":
            # (a run without LoRA is refused before: its tensors are not this model's, check_shapes)
            if not self.base:
                return (f"it holds only the LoRA adapters; the frozen base it was trained on, {at}, is re-read "
                        f"from model.init_from, which this run does not set. Fix: model.init_from={at}")
        elif self.saves != "adapters" or not self.base:
            return None  # every weight is in it, and every weight is saved again
        elif recorded is None:  # its base is loaded from it, and would be model.init_from's from then on
            return ("it holds every weight but records no base model (written by an older hpctrain, or by a "
                    "run without model.init_from), so nothing says that model.init_from is the base its "
                    "adapters were trained on, and this run saves the adapters alone. Fix: "
                    "checkpoint.weights=full to continue it")
        why = difference(recorded, self.base)
        if why is None:
            return None
        return (f"it was trained on the base model {at}, and model.init_from={self.base} is not that model: {why}. "
                f"Fix: model.init_from=<the base it was trained on> (a copy elsewhere is fine), or a new "
                f"run.dir to train on this base from the start")


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
