"""Sequence-parallel inputs re-gathered in backward instead of kept (Megatron-LM's behaviour with
sequence parallel; Korthikanti et al. 2022, sec. 4.2.2).

Under sequence parallel the inputs of the column-parallel linears (wq/wk/wv, w1/w3, the output layer)
are all-gathered over the TP group, and autograd keeps that gathered, full-sequence tensor for the
weight gradient: per block 2 x tokens x dim elements on every TP rank, about half of what a block saves
at TP 8. Here a saved-tensor hook keeps 1/tp of it instead and all-gathers it again when backward needs
it: 2 more all-gathers per block and micro-batch, (tp - 1)/tp of that memory freed.

The hook is active only while the module whose input was gathered runs (`attention`, `feed_forward`,
the output layer), and only packs tensors that alias that gathered input (the linears save 2-D views of
it), so weights, other activations and activation-checkpointed blocks are untouched. One shard is
kept per gathered input, and backward gathers it once for all the linears that share it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor, Replicate, Shard


class _Saved:
    """One gathered input, as the shard this rank keeps; gathered again on the first unpack, and kept
    until every linear that saved it has taken it back."""

    def __init__(self, t, shard, dim: int):
        self.mesh, self.shape, self.stride, self.dim = t.device_mesh, t.shape, t.stride(), dim
        self.shard = shard
        self.packs = 0
        self.full = None

    def unpack(self):
        if self.full is None:
            local = DTensor.from_local(self.shard, self.mesh, [Shard(self.dim)], run_check=False,
                                       shape=self.shape, stride=self.stride)
            self.full = local.redistribute(self.mesh, [Replicate()])
        full = self.full
        self.packs -= 1
        if self.packs <= 0:
            self.full = None
        return full


def _storage(t):
    return t._local_tensor.untyped_storage().data_ptr()


class _Hooks:
    """saved_tensors_hooks for one call of a module whose first input is the gathered DTensor."""

    def __init__(self, gathered):
        self.key = _storage(gathered)
        self.saved = {}  # (shape, stride) -> _Saved
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        if not (isinstance(t, DTensor) and t.ndim >= 1 and all(isinstance(p, Replicate) for p in t.placements)
                and _storage(t) == self.key):
            # Detached: a saved output kept with its grad_fn would hold its own node, a cycle no garbage
            # collector breaks when the graph is never run backward (torch's pipeline stages build one so
            # to infer shapes). Autograd restores the grad_fn on unpack.
            return t.detach()
        k = (tuple(t.shape), t.stride())
        s = self.saved.get(k)
        if s is None:
            dim = max(range(t.ndim), key=lambda d: t.shape[d])  # tokens: the one that splits evenly
            with torch.no_grad():
                shard = t.redistribute(t.device_mesh, [Shard(dim)]).to_local().clone()
            s = self.saved[k] = _Saved(t, shard, dim)
        s.packs += 1
        return s

    @staticmethod
    def unpack(x):
        return x.unpack() if isinstance(x, _Saved) else x


def apply_sp_regather(model: nn.Module) -> nn.Module:
    """On every tensor-parallel module whose input is gathered (apply_tp's PrepareModuleInput and the
    output layer's ColwiseParallel, both forward pre-hooks registered before these), and not inside an
    activation-checkpointed block (which keeps only its input anyway)."""
    def enter(mod, args):
        x = args[0] if args else None
        if isinstance(x, DTensor):
            mod._regather = _Hooks(x)
            mod._regather.ctx.__enter__()

    def leave(mod, args, out):
        h = mod.__dict__.pop("_regather", None)
        if h is not None:
            h.ctx.__exit__(None, None, None)
            # ctx holds h's bound methods: a cycle that would keep every shard until the garbage
            # collector runs. Autograd alone holds the shards from here on.
            h.ctx, h.saved = None, {}

    targets = [b for b in model.layers.values() if not isinstance(b, CheckpointWrapper)]
    # An MoE layer takes its sequence shard as it is (hpctrain.parallel.tensor): nothing gathered to keep.
    mods = [m for b in targets for m in (b.attention, getattr(b, "feed_forward", None)) if m is not None]
    if getattr(model, "output", None) is not None:
        mods.append(model.output)
    for m in mods:
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave, always_call=True)
    return model
