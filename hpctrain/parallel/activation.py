"""What wraps each block: activation checkpointing (keep only each block's input, recompute the rest
in backward; full: every block, selective: every `every`-th), recomputation by module in the blocks it
leaves (parallel.ac_modules, Megatron's `--recompute-modules`) and torch.compile.

Module recomputation, in a block that is not checkpointed whole:

    attention  the core attention (hpctrain.models.attention's kernel, or context parallel's) runs without
               keeping anything; q, k and v after RoPE are kept. Its output, which wo reads, and its
               log-sum-exp are dropped; backward reruns the kernel once, for wo's weight gradient and for
               the kernel's own backward.
    mlp        the SwiGLU product silu(w1 x) * w3 x that w2 reads is dropped and recomputed from w1's and
               w3's outputs, which the SwiGLU keeps anyway (an elementwise rerun, no GEMM).
    moe_act    the same product in the routed experts (grouped GEMM or loop).
    norm       the two RMSNorms' outputs, which the linears after them (and the router) read, are dropped
               and recomputed from the norms' inputs, which the norms keep anyway.
    moe        the whole MoE layer (router, dispatch, experts, combine) checkpointed: only its input is
               kept, and backward reruns it, its all-to-alls included; the rerun's routing statistics are
               not counted (hpctrain.models.moe.recompute_contexts).

mlp, moe_act and norm are Megatron's "output-discarding" checkpoints: the recomputed tensor's producer
keeps only what it needs anyway, and every saved copy of the tensor (the consumers' saved inputs, views of
it) is replaced by a note, through a saved-tensor hook, that reruns the producer on the first unpack in
backward and keeps the result until the last consumer has taken it. A block's notes are open while the
block runs forward; the hooks are entered again around wo and w2, so that they, and not a saved-tensor hook
context entered in between (the sequence-parallel re-gather's on the attention and feed-forward modules,
hpctrain.parallel.regather), are the innermost for what those two layers save.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

from hpctrain.models.ffn import swiglu
from hpctrain.models.moe import moe_modules, recompute_contexts


def apply_ac(model: nn.Module, mode: str, every: int = 2, modules: tuple = ()) -> nn.Module:
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (mode == "selective" and i % every == 0):
            model.layers[name] = checkpointed(block)
        elif modules:
            recompute_modules(block, modules)
    return model


def checkpointed(block: nn.Module) -> nn.Module:
    """`block` recomputed in backward. Non-reentrant: composes with FSDP2 and DTensor; the wrapper's
    prefix is stripped from state dicts, so checkpoints keep the plain names. A block with MoE layers has
    its rerun marked (hpctrain.models.moe.recomputation), so that their routing statistics count each
    micro-batch once; the others keep torch's default context (which torch.compile turns into its own
    recompute-everything policy)."""
    marks = {"context_fn": recompute_contexts} if moe_modules(block) else {}
    return checkpoint_wrapper(block, preserve_rng_state=False, **marks)


# ---------------------------------------------------------------------------------------------
# Recomputation by module


def recompute_modules(block: nn.Module, modules: tuple) -> None:
    """parallel.ac_modules in one block (hpctrain.core.rules.recompute refuses what it cannot do)."""
    notes = Notes()
    if "attention" in modules:
        block.attention.kernel = RecomputedKernel(block.attention.kernel, notes)
        _hooks_around(block.attention.wo, notes)
    if "mlp" in modules and hasattr(block, "feed_forward"):
        block.feed_forward.act = partial(discarded_swiglu, notes)
        _hooks_around(block.feed_forward.w2, notes)
    if "moe_act" in modules and hasattr(block, "moe"):
        block.moe.experts.act = partial(discarded_swiglu, notes)
    if "norm" in modules:
        for norm in (block.attention_norm, block.ffn_norm):
            norm.register_forward_hook(partial(_discard_norm_output, notes))
    if "moe" in modules and hasattr(block, "moe"):
        block.moe = checkpoint_wrapper(block.moe, preserve_rng_state=False, context_fn=recompute_contexts)
    block.register_forward_pre_hook(lambda mod, args: notes.open())
    block.register_forward_hook(lambda mod, args, out: notes.close(), always_call=True)


class _Rerun:
    """One dropped tensor: rerun on the first unpack, kept until every saved copy has been unpacked."""

    def __init__(self, rerun, like: torch.Tensor):
        self.rerun, self.value, self.packs = rerun, None, 0
        self.offset, self.stride = like.storage_offset(), like.stride()
        self.autocast = autocast_now(like.device.type)

    def take(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad(), self.autocast():
                self.value = self.rerun()
            assert self.value.stride() == self.stride, "a rerun laid out otherwise than the forward's tensor"
        value = self.value
        self.packs -= 1
        if self.packs <= 0:
            self.value = None
        return value


class _Note:
    """What a pack hook keeps of a saved copy of a dropped tensor: where it sits in it (a view of it; the
    local tensor of a DTensor with its placements)."""

    def __init__(self, rerun: _Rerun, t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        self.rerun, self.shape, self.stride = rerun, local.shape, local.stride()
        self.offset = local.storage_offset() - rerun.offset
        self.dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        rerun.packs += 1

    def unpack(self) -> torch.Tensor:
        value = self.rerun.take()
        local = value.as_strided(self.shape, self.stride, value.storage_offset() + self.offset)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def autocast_now(device: str):
    """A context that reruns code under the autocast state of the forward (backward runs outside it)."""
    on = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if on else None
    return lambda: torch.autocast(device, dtype=dtype, enabled=on) if on else torch.autocast(device, enabled=False)


def _storage(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # wrappers without storage (collectives in flight)
        return 0


class Notes:
    """A block's dropped tensors during its forward: (weak reference, _Rerun) by storage. A weak
    reference, so that a storage freed and reused in the same forward is not taken for the dropped one."""

    def __init__(self):
        self.dropped: dict = {}
        self.depth = 0

    def open(self) -> None:
        self.dropped.clear()
        self.depth = 1
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self._ctx.__enter__()

    def close(self) -> None:
        if self.depth:
            self._ctx.__exit__(None, None, None)
            self._ctx, self.depth = None, 0
        self.dropped.clear()

    @property
    def active(self) -> bool:
        return bool(self.depth) and torch.is_grad_enabled()

    def drop(self, t: torch.Tensor, rerun) -> None:
        """`t`, just made, is not kept where saved from here to the block's end; `rerun()` remakes it."""
        ptr = _storage(t)
        if self.active and ptr and t.numel():
            self.dropped[ptr] = (weakref.ref(t), _Rerun(rerun, t))

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, t: torch.Tensor):
        hit = self.dropped.get(_storage(t)) if self.dropped else None
        if hit is None or hit[0]() is None:
            # Detached: a saved output kept with its grad_fn would hold its own node (a cycle; autograd
            # restores the grad_fn on unpack), as hpctrain.parallel.regather does.
            return t.detach()
        return _Note(hit[1], t)


def _unpack(x):
    return x.unpack() if isinstance(x, _Note) else x


def _hooks_around(module: nn.Module, notes: Notes) -> None:
    """The notes' hooks innermost while `module` runs (other modules' hooks may stand around it)."""
    def enter(mod, args):
        if notes.active:
            mod._notes_ctx = notes.hooks()
            mod._notes_ctx.__enter__()

    def leave(mod, args, out):
        ctx = mod.__dict__.pop("_notes_ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def discarded_swiglu(notes: Notes, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, dropped where saved (by w2, the experts' second GEMM) and recomputed from gate and
    up, which the SwiGLU keeps for its own backward."""
    out = swiglu(gate, up)
    notes.drop(out, partial(swiglu, gate.detach(), up.detach()))
    return out


def _discard_norm_output(notes: Notes, norm: nn.Module, args, out) -> None:
    """A forward hook on an RMSNorm: its output dropped where saved, recomputed from its input (which the
    norm keeps for its own backward) in the dtype it had (the norm casts to autocast's)."""
    x = args[0].detach()
    dtype = out.dtype  # (not `out`, which the closure would keep)
    notes.drop(out, lambda: norm.forward(x).to(dtype))


class _Attention:
    """The kernel's rerun, made once with its graph in backward: by wo's unpack of the output, or by the
    kernel's own backward if that comes first."""

    def __init__(self, kernel, q, k, v, documents):
        self.kernel, self.documents = kernel, documents
        self.inputs = tuple(t.detach() for t in (q, k, v))
        self.needs = tuple(t.requires_grad for t in (q, k, v))
        self.autocast = autocast_now(q.device.type)
        self.graph = None

    def rerun(self):
        if self.graph is None:
            with torch.enable_grad(), self.autocast():
                leaves = [t.detach().requires_grad_(n) for t, n in zip(self.inputs, self.needs)]
                self.graph = leaves, bshd(self.kernel(*leaves, self.documents))
        return self.graph


def bshd(out: torch.Tensor) -> torch.Tensor:
    """The attention output laid out (batch, seq, heads, dim) in memory, as the flash kernels make it, so
    that the model's transpose and reshape for wo is a view of it (the same values either way)."""
    return out if out.transpose(1, 2).is_contiguous() else out.transpose(1, 2).contiguous().transpose(1, 2)


class _NoSave(torch.autograd.Function):
    """The kernel run without autograd's record; its backward reruns it (once, shared with wo's unpack)."""

    @staticmethod
    def forward(ctx, q, k, v, run: _Attention):
        ctx.run = run
        return bshd(run.kernel(q, k, v, run.documents))

    @staticmethod
    def backward(ctx, grad):
        leaves, out = ctx.run.rerun()
        ctx.run.graph = None
        torch.autograd.backward(out, grad)
        return (*(t.grad if t.requires_grad else None for t in leaves), None)


class RecomputedKernel:
    """An attention kernel (q, k, v, documents) -> out whose output and log-sum-exp are not kept."""

    def __init__(self, kernel, notes: Notes):
        self.kernel, self.notes = kernel, notes

    def __call__(self, q, k, v, documents=None):
        if not self.notes.active:
            return self.kernel(q, k, v, documents)
        run = _Attention(self.kernel, q, k, v, documents)
        out = _NoSave.apply(q, k, v, run)
        self.notes.drop(out, lambda: run.rerun()[1].detach())
        return out


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile block by block (torchtitan's choice): every block has the same code, so one graph is
    compiled and reused, and FSDP's per-block hooks stay outside the graphs."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    return model
