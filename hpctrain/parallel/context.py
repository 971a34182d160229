"""Context parallelism: each sequence split over the cp ranks, attention computed across them.

The sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (an early and a late one),
so that under a causal mask every rank has the same attention work (the load balancing of Megatron-Core
and torchtitan). Everything outside attention is per token and runs on the local chunks as it is; the
batch's positions (RoPE) and document ids follow the tokens (`shard_sequence`).

Attention gets K and V of the other chunks in one of two ways (parallel.cp_attention):
- allgather: K and V all-gathered over the cp ranks (autograd's backward reduce-scatters their gradients),
  then the local queries attend to every chunk they may see (Llama 3, section 3.3.2);
- ring: K and V passed to the next rank cp - 1 times, each step's transfer started before the attention
  on the chunks at hand; in backward they go round again with their gradients, which arrive back home
  after the last step (Liu et al. 2023, "Ring Attention").
Both merge the partial results by log-sum-exp (hpctrain.models.attention). The model knows nothing of
this: `apply_cp` swaps each attention's kernel for the one `cp_kernel` chooses, once: hpctrain's
(`ContextParallelAttention` with its all-gather or ring method) or torch's own (context_torch, the one
module that touches torch's private context-parallel API, imported only when chosen).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.models.attention import chunk_backward, chunk_forward, merge, pair, pair_backward, pair_forward


def chunk_ids(rank: int, cp: int) -> list[int]:
    """The global chunk indices rank `rank` holds, in its local order."""
    return [rank, 2 * cp - 1 - rank]


def sequence_index(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """Positions in the whole sequence of the tokens rank `rank` holds, in its local order."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This cp rank's part of a (batch, seq, ...) tensor."""
    if cp == 1:
        return t
    return t.index_select(1, sequence_index(t.shape[1], rank, cp).to(t.device))


def _gathered_ids(cp: int) -> list[int]:
    """Global chunk indices of an all-gather of every rank's two chunks, in rank order."""
    return [i for r in range(cp) for i in chunk_ids(r, cp)]


class ContextParallelAttention:
    """hpctrain's attention kernel of a context-parallel model: (q, k, v, documents) -> out on local
    chunks, K and V of the others reached by `method` (AllGatherAttention or RingAttention)."""

    def __init__(self, group, method: type[torch.autograd.Function]):
        self.group, self.method = group, method
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._docs: tuple = (None, None)  # (local documents, gathered) of the forward under way

    def _all_documents(self, documents: torch.Tensor) -> torch.Tensor:
        # every layer of a forward gets the same tensor: gather it once
        if self._docs[0] is not documents:
            parts = [torch.empty_like(documents) for _ in range(self.size)]
            dist.all_gather(parts, documents.contiguous(), group=self.group)
            self._docs = (documents, torch.cat(parts, 1))
        return self._docs[1]

    def __call__(self, q, k, v, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        docs = self._all_documents(documents) if documents is not None else None
        return self.method.apply(q, k, v, documents, docs, self.group, self.rank, self.size)


# torch 2.13 renamed the tensor-in, tensor-out collectives (the old names warn)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """Every cp rank's t (batch, heads, seq, dim), concatenated along seq in rank order."""
    out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather(out, t.contiguous(), group=group)
    return torch.cat(out.chunk(size, 0), 2)


def _reduce_scatter(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """The sum over cp ranks of each rank's part of t (gathered layout), this rank's part."""
    parts = torch.cat(t.chunk(size, 2), 0).contiguous()  # rank r's part as the r-th block of dim 0
    out = torch.empty((t.shape[0], t.shape[1], t.shape[2] // size, t.shape[3]), dtype=t.dtype, device=t.device)
    _reduce_scatter_into(out, parts, group=group)
    return out


class AllGatherAttention(torch.autograd.Function):
    """K and V all-gathered, attended, and dropped: backward gathers them again (as ring attention sends
    them round again), so a layer keeps only its own chunks for backward, not cp times as many."""

    @staticmethod
    def forward(ctx, q, k, v, local_docs, all_docs, group, rank, size):
        ids = chunk_ids(rank, size)
        out, lse, ctx.plan = chunk_forward(q, _gather(k, group, size), _gather(v, group, size), ids,
                                           _gathered_ids(size), local_docs, all_docs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.size = group, size
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, size = ctx.group, ctx.size
        dq, dk, dv = chunk_backward(dout, q, _gather(k, group, size), _gather(v, group, size), out, lse, ctx.plan)
        return dq, _reduce_scatter(dk, group, size), _reduce_scatter(dv, group, size), None, None, None, None, None


def _exchange(tensors: list[torch.Tensor], group, rank: int, size: int, tag: int = 0) -> tuple[list, list]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's (`tag`
    keeps two exchanges under way at once apart)."""
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prev = dist.get_global_rank(group, (rank - 1) % size)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(tensors)] + \
          [dist.P2POp(dist.irecv, b, prev, group, tag + i) for i, b in enumerate(bufs)]
    return dist.batch_isend_irecv(ops), bufs


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's two chunks over every rank's, K and V travelling round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, local_docs, all_docs, group, rank, size):
        q_ids = chunk_ids(rank, size)
        qs = list(q.chunk(2, 2))
        qd = list(local_docs.chunk(2, 1)) if local_docs is not None else [None, None]
        outs, lses = [None, None], [None, None]
        plan = []  # per ring step: [(q chunk, k chunk, Pair)]
        kv = [k.contiguous(), v.contiguous()]
        for step in range(size):
            reqs, nxt = _exchange(kv, group, rank, size) if step < size - 1 else ([], None)
            src = (rank - step) % size
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            kd = _source_docs(all_docs, src, size)
            pairs = []
            for i, qi in enumerate(q_ids):
                for j, kj in enumerate(chunk_ids(src, size)):
                    p = pair(qi, kj, qd[i], kd[j], q.dtype)
                    if p is not None:
                        outs[i], lses[i] = merge(outs[i], lses[i], *pair_forward(qs[i], ks[j], vs[j], p, None))
                        pairs.append((i, j, p))
            plan.append(pairs)
            _wait(reqs)
            kv = nxt
        out = torch.cat(outs, 2).to(q.dtype)
        lse = torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group, ctx.rank, ctx.size = plan, group, rank, size
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size = ctx.group, ctx.rank, ctx.size
        qs, outs, lses = q.chunk(2, 2), out.chunk(2, 2), lse.chunk(2, 2)
        douts = dout.contiguous().chunk(2, 2)
        dq = [torch.zeros_like(t) for t in qs]
        # K, V and the gradients gathered for them so far travel together; after `size` exchanges each
        # rank's own gradients are back with it.
        kv, grads = [k.contiguous(), v.contiguous()], [torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(size):
            # K and V are sent on while their pairs' gradients are computed; the gradients follow
            kv_reqs, kv_next = _exchange(kv, group, rank, size) if step < size - 1 else ([], None)
            ks, vs = kv[0].chunk(2, 2), kv[1].chunk(2, 2)
            dks, dvs = list(grads[0].chunk(2, 2)), list(grads[1].chunk(2, 2))
            for i, j, p in ctx.plan[step]:
                a, b, c = pair_backward(douts[i], qs[i], ks[j], vs[j], outs[i], lses[i], p, None)
                dq[i] += a
                dks[j] = dks[j] + b
                dvs[j] = dvs[j] + c
            reqs, grads = _exchange([torch.cat(dks, 2), torch.cat(dvs, 2)], group, rank, size, tag=2)
            _wait(reqs)
            _wait(kv_reqs)
            kv = kv_next
        dk, dv = grads
        return torch.cat(dq, 2), dk, dv, None, None, None, None, None


def _source_docs(all_docs: Optional[torch.Tensor], src: int, size: int) -> list:
    """The document ids of rank `src`'s two chunks, from the gathered (batch, seq) ids in rank order."""
    if all_docs is None:
        return [None, None]
    return list(all_docs.chunk(size, 1)[src].chunk(2, 1))


# parallel.cp_attention -> how hpctrain's kernel reaches the other ranks' K and V
METHODS = {"allgather": AllGatherAttention, "ring": RingAttention}


def cp_kernel(cp_mesh, kind: str, kernel: str = "hpctrain"):
    """The attention kernel every attention of a context-parallel model shares: hpctrain's (any mask, any
    device) or torch's (`kernel="torch"`: causal only; hpctrain.parallel.context_torch)."""
    if kernel == "torch":
        from hpctrain.parallel.context_torch import TorchContextParallelAttention

        return TorchContextParallelAttention(cp_mesh, kind)
    return ContextParallelAttention(cp_mesh.get_group(), METHODS[kind])


def apply_cp(model: nn.Module, cp_mesh, kind: str, kernel: str = "hpctrain") -> None:
    """Every attention of `model` computes across the cp ranks, by the kernel `cp_kernel` chooses. (MoE
    layers sum their routing statistics over the cp ranks through their token dispatcher, chosen with the
    tp and ep ranks in hpctrain.parallel.apply.)"""
    attention = cp_kernel(cp_mesh, kind, kernel)
    for block in model.layers.values():
        block.attention.kernel = attention
