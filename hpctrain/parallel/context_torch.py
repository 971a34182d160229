"""Context parallelism through torch's own ring attention (parallel.cp_kernel=torch; the default on CUDA
without a document mask).

torch.distributed.tensor.experimental's CP runs scaled_dot_product_attention on query, key and value
sharded along the sequence: its DTensor dispatcher sends the flash, memory-efficient and cuDNN kernels to a
ring that merges the partial results by log-sum-exp, with the same load-balanced causal layout as ours
(rank r holds chunks r and 2cp-1-r: torch's head-tail balancer). The data loader already hands each rank
its chunks, so only the attention is wrapped, as torchtitan does (`_ContextParallel` on the module that
calls SDPA, and the dispatcher enabled once per process). `parallel.cp_attention` picks torch's rotation:
allgather all-gathers K and V, ring passes them to the next rank.

torch's handlers cover only CUDA's kernels; on CPU SDPA calls `_scaled_dot_product_flash_attention_for_cpu`,
which has the same (out, log-sum-exp) contract, so this module hands that kernel and its backward to the
same templated ring. The CPU path is what the CPU test suite checks; on CUDA torch's own handlers run.

The API is private and experimental in torch 2.13 (underscored names, as torchtitan uses them), and this
is the one module that touches it (hpctrain.parallel.context imports it only when parallel.cp_kernel=torch
is chosen): a torch upgrade that moves the names fails here at import with the name, one that changes
what they do fails tests/test_dispatch.py, and parallel.cp_kernel=hpctrain avoids both.

The change is process-wide: DTensor's op dispatcher gets torch's CP handlers and ours, and torch's ring its
rotation and load-balance options. It is made once, when this kernel is built (`enable`), and stays on: a
context manager around the attention call would not cover backward, where autograd dispatches the
kernel's backward through the same handlers outside any forward scope (torchtitan enables it once per
process too). No process that does not choose this kernel gets it; `disable` undoes it for a process that
goes on with other DTensor attention.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._attention import (
    _ContextParallel,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    set_rotate_method,
)
from torch.distributed.tensor.experimental._context_parallel import _attention as _torch_cp
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpctrain.models.attention import CPU_FLASH, CPU_FLASH_BACKWARD

SEQ_DIM = 2  # (batch, heads, seq, head_dim); torch's ring assumes it
ROTATION = {"allgather": "allgather", "ring": "alltoall"}  # parallel.cp_attention -> torch's rotate method
# The kernels the ring has handlers for. SDPA's math fallback would run on the DTensors as plain ops: the
# causal mask applied to the local chunks as if they were the whole sequence. Better an error (torchtitan
# restricts SDPA the same way under CP).
RING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


class _SDPA(nn.Module):
    """The causal attention torch's CP wraps: q (batch, heads, seq, dim), k/v with the same or fewer heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(RING_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _local(op_call, args, kwargs):
    """The local tensors of a CP dispatch, and the sequence-sharded placement the results get."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    spec = next(a for a in args if isinstance(a, DTensor))._spec
    if tuple(spec.placements) != (Shard(SEQ_DIM),):
        raise NotImplementedError(f"context-parallel attention on CPU takes tensors sharded along the sequence "
                                  f"only, not {spec.placements}")
    kwargs = dict(info.local_kwargs)
    if kwargs.pop("attn_mask", None) is not None:
        raise NotImplementedError("torch's ring attention takes no attention mask: parallel.cp_kernel=hpctrain")
    return info, list(info.local_args), kwargs, spec


def _wrap(results, spec) -> tuple:
    return tuple(DTensor.from_local(t, spec.mesh, spec.placements, run_check=False) for t in results)


def _cpu_flash(op_call, args, kwargs):
    info, (q, k, v, *rest), kw, spec = _local(op_call, args, kwargs)
    dropout_p = rest[0] if len(rest) > 0 else kw.pop("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kw.pop("is_causal", False)
    out = _torch_cp._templated_ring_attention(info.compute_mesh.get_group(), SEQ_DIM, CPU_FLASH, q, k, v,
                                              is_causal=is_causal, dropout_p=dropout_p, **kw)
    return _wrap(out, spec)


def _cpu_flash_backward(op_call, args, kwargs):
    info, (grad, q, k, v, out, lse, dropout_p, is_causal), kw, spec = _local(op_call, args, kwargs)
    grads = _torch_cp._templated_ring_attention_backward(
        info.compute_mesh.get_group(), SEQ_DIM, CPU_FLASH_BACKWARD, grad_out=grad, grad_out_name="grad_out",
        query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, **kw)
    return _wrap(grads, spec)


# DTensor's handlers for the CPU kernel, beside torch's for CUDA's
CPU_HANDLERS = {CPU_FLASH: _cpu_flash, CPU_FLASH_BACKWARD: _cpu_flash_backward}


def enable(kind: str) -> None:
    """torch's CP dispatcher for this process, with the CPU kernel beside CUDA's."""
    _enable_context_parallel_dispatcher()  # replaces DTensor's custom handlers: ours go in after it
    DTensor._op_dispatcher._custom_op_handlers.update(CPU_HANDLERS)
    # Our data layout is torch's head-tail one; its ring must know the chunks are paired.
    _torch_cp._cp_options.enable_load_balance = True
    set_rotate_method(ROTATION[kind])


def disable() -> None:
    """Undo `enable` for this process: DTensor's SDPA ops dispatch as before (torch's CP handlers and ours
    gone). The dispatcher and the rotation are per process, not per kernel: a training process keeps them
    to its end; a process that goes on with other DTensor attention calls this."""
    _disable_context_parallel_dispatcher()


class TorchContextParallelAttention:
    """The attention kernel (q, k, v, documents) -> out of a context-parallel model, by torch's CP.

    Not an nn.Module: every attention of the model shares it, and it holds no state to save."""

    def __init__(self, cp_mesh, kind: str = "allgather"):
        if kind not in ROTATION:
            raise ValueError(f"parallel.cp_attention={kind}: torch's context parallel rotates by {sorted(ROTATION)}")
        enable(kind)
        self.sdpa = parallelize_module(_SDPA(), cp_mesh,
                                       _ContextParallel(seq_dim=SEQ_DIM, attention_type=_ContextParallel.AttentionType.SDPA))

    def __call__(self, q, k, v, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        if documents is not None:  # the login node refuses this; here for a caller that bypasses it
            raise ValueError("torch's context parallel takes no document mask: parallel.cp_kernel=hpctrain")
        return self.sdpa(q, k, v)
