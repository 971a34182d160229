"""Causal attention over chunks of a sequence, with or without a document mask.

A sequence is cut into equal chunks; a query chunk attends fully to earlier chunks, causally to its own,
not at all to later ones, and with a document mask only to keys of its own document. Each (query chunk,
key chunk) pair is one call of the flash-attention kernel, which also returns the log-sum-exp of each
query row; the pairs' partial results are merged by their log-sum-exps (Milakov & Gimelshein 2018, the
rule ring attention uses: Liu et al. 2023). Pairs the mask leaves empty are skipped, so a document-masked
sequence costs the attention FLOPs its mask keeps.

Backward calls the kernel's backward once per pair with the merged output and log-sum-exp, which is exact:
flash attention's backward recomputes each pair's probabilities as exp(score - lse) and needs only the
final lse and rowsum(dout * out) (Dao 2023, Algorithm 2).

The same pair functions serve one process (`chunked_attention`) and context parallelism
(hpctrain.parallel.context), where the key chunks live on other ranks. A pair is computed by one of two
kernels, chosen by the tensors' device unless a caller names one (`pairs`): on CPU `FlashPairs`,
`_scaled_dot_product_flash_attention_for_cpu` (it takes grouped-query K/V as they are and an additive mask
in the query's dtype), elsewhere `MathPairs`. This module is the one that calls that private aten op and
its backward (hpctrain.parallel.context_torch registers the same two for torch's ring through the names
here); tests/test_dispatch.py pins the contract used, so that a torch upgrade that changes it fails there.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

# (out, lse) = CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=, scale=), lse (batch, heads, seq) fp32;
# (dq, dk, dv) = CPU_FLASH_BACKWARD(dout, q, k, v, out, lse, dropout_p, is_causal, attn_mask=, scale=)
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# The block a document-masked sequence is cut into on one process: bounds the mask's memory (block^2 per
# pair) and lets pairs of blocks with no shared document be skipped.
LOCAL_BLOCK = 512


class Pair(NamedTuple):
    """One query chunk against one key chunk: `causal` on the diagonal, `mask` (additive, or None) from
    the documents, `rows` the query rows with at least one key (None: all)."""
    causal: bool
    mask: Optional[torch.Tensor]
    rows: Optional[torch.Tensor]


def pair(q_chunk: int, k_chunk: int, q_docs: Optional[torch.Tensor], k_docs: Optional[torch.Tensor],
         dtype: torch.dtype) -> Optional[Pair]:
    """How query chunk `q_chunk` attends to key chunk `k_chunk` (global chunk indices), or None if it
    does not at all. q_docs, k_docs: (batch, chunk) document ids of the two chunks, or None."""
    if k_chunk > q_chunk:
        return None
    causal = k_chunk == q_chunk
    if q_docs is None:
        return Pair(causal, None, None)
    allowed = q_docs[:, :, None] == k_docs[:, None, :]
    if causal:
        allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=allowed.device).tril()
    if not allowed.any():
        return None
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    rows = allowed.any(-1)
    # the kernel masks by addition, the causal part included: no is_causal with a mask
    return Pair(False, mask[:, None], None if bool(rows.all()) else rows[:, None])


class FlashPairs:
    """A pair by the CPU's fused flash kernel (CPU only)."""

    @staticmethod
    def forward(q, k, v, p: Pair, scale: Optional[float]):
        return CPU_FLASH(q, k, v, 0.0, p.causal, attn_mask=p.mask, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, p: Pair, scale: Optional[float]):
        return CPU_FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, p.causal, attn_mask=p.mask, scale=scale)


class MathPairs:
    """A pair by matmuls over the chunk's scores: exact, any device, a (chunk x chunk) score matrix per
    head at a time. What runs off the CPU: CUDA's flash kernels pad their log-sum-exp and take no additive
    mask with grouped K/V; a fused path is future work."""

    @staticmethod
    def forward(q, k, v, p: Pair, scale: Optional[float]):
        return _math_forward(q, k, v, p, scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, p: Pair, scale: Optional[float]):
        return _math_backward(dout, q, k, v, out, lse, p, scale)


def pairs_for(device: torch.device) -> type:
    return FlashPairs if device.type == "cpu" else MathPairs


def pair_forward(q, k, v, p: Pair, scale: Optional[float],
                 pairs: Optional[type] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over one key chunk; rows with no key get lse -inf (the kernel says 0)."""
    out, lse = (pairs or pairs_for(q.device)).forward(q, k, v, p, scale)
    if p.rows is not None:
        lse = lse.masked_fill(~p.rows, float("-inf"))
    return out, lse


def pair_backward(dout, q, k, v, out, lse, p: Pair, scale: Optional[float], pairs: Optional[type] = None):
    """(dq, dk, dv) of one pair, from the merged out and lse of q's rows."""
    return (pairs or pairs_for(q.device)).backward(dout, q, k, v, out, lse, p, scale)


def _scores(q, k, p: Pair, scale: Optional[float]) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1) if rep > 1 else k
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if p.causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if p.mask is not None:
        s = s + p.mask.float()
    return s


def _math_forward(q, k, v, p: Pair, scale):
    s = _scores(q, k, p, scale)
    lse = torch.logsumexp(s, -1)
    rep = q.shape[1] // v.shape[1]
    v = v.repeat_interleave(rep, 1) if rep > 1 else v
    probs = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return (probs @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, p: Pair, scale):
    rep = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = _scores(q, k, p, scale)
    probs = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    kf = (k.repeat_interleave(rep, 1) if rep > 1 else k).float()
    vf = (v.repeat_interleave(rep, 1) if rep > 1 else v).float()
    do = dout.float()
    dv = probs.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    ds = probs * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    if rep > 1:  # the grouped heads' gradients summed back onto their K/V head
        dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], rep)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], o: torch.Tensor, l: torch.Tensor):
    """Running merge of partial attention results; out is kept in fp32."""
    o = o.float()
    if out is None:
        return o, l
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key yet on both sides
    out = out * torch.exp(lse - safe)[..., None] + o * torch.exp(l - safe)[..., None]
    return out, new


def chunks(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return list(t.chunk(n, dim)) if n > 1 else [t]


def chunk_forward(q, k, v, q_ids, k_ids, q_docs, k_docs, scale=None, pairs=None):
    """(out, lse, plan) of q's chunks (global indices q_ids) over k/v's chunks (k_ids), both cut evenly
    along the sequence (dim 2); docs: each side's document ids (batch, seq), or None for no document
    mask; `pairs`: the pair kernel (None: the device's). `plan`: the pairs computed, for chunk_backward."""
    qs, ks, vs = chunks(q, len(q_ids), 2), chunks(k, len(k_ids), 2), chunks(v, len(k_ids), 2)
    qd = chunks(q_docs, len(q_ids), 1) if q_docs is not None else [None] * len(q_ids)
    kd = chunks(k_docs, len(k_ids), 1) if k_docs is not None else [None] * len(k_ids)
    outs, lses, plan = [], [], []
    for i, qi in enumerate(q_ids):
        out = lse = None
        row = []
        for j, kj in enumerate(k_ids):
            p = pair(qi, kj, qd[i], kd[j], q.dtype)
            if p is None:
                continue
            out, lse = merge(out, lse, *pair_forward(qs[i], ks[j], vs[j], p, scale, pairs))
            row.append((j, p))
        outs.append(out)
        lses.append(lse)
        plan.append(row)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2), plan


def chunk_backward(dout, q, k, v, out, lse, plan, scale=None, pairs=None):
    """(dq, dk, dv) of chunk_forward's result."""
    nq = len(plan)
    nk = k.shape[2] // (q.shape[2] // nq)
    qs, ks, vs = chunks(q, nq, 2), chunks(k, nk, 2), chunks(v, nk, 2)
    outs, lses, douts = chunks(out, nq, 2), chunks(lse, nq, 2), chunks(dout.contiguous(), nq, 2)
    dq = [torch.zeros_like(t) for t in qs]
    dk = [torch.zeros_like(t) for t in ks]
    dv = [torch.zeros_like(t) for t in vs]
    for i, row in enumerate(plan):
        for j, p in row:
            a, b, c = pair_backward(douts[i], qs[i], ks[j], vs[j], outs[i], lses[i], p, scale, pairs)
            dq[i] += a
            dk[j] += b
            dv[j] += c
    return torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2)


class ChunkAttention(torch.autograd.Function):
    """chunk_forward with autograd."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, k_ids, q_docs, k_docs, scale, pairs=None):
        out, lse, ctx.plan = chunk_forward(q, k, v, q_ids, k_ids, q_docs, k_docs, scale, pairs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.pairs = scale, pairs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = chunk_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.pairs)
        return (*grads, None, None, None, None, None, None)  # (autograd drops the Nones of args not given)


def document_mask_attention(q, k, v, documents: torch.Tensor, pairs: Optional[type] = None) -> torch.Tensor:
    """Causal attention of one process's whole sequence, each token seeing only its own document: the
    sequence in LOCAL_BLOCK blocks, pairs of blocks that share no document skipped."""
    s = q.shape[2]
    n = max(1, s // LOCAL_BLOCK) if s % LOCAL_BLOCK == 0 else 1
    ids = list(range(n))
    return ChunkAttention.apply(q, k, v, ids, ids, documents, documents, None, pairs)


def causal_attention(q, k, v, documents: Optional[torch.Tensor] = None, pairs: Optional[type] = None) -> torch.Tensor:
    """The model's attention kernel on one process: q (batch, heads, seq, head_dim), k/v with the same
    or fewer (grouped) heads; `documents` (batch, seq): a document id per token, or None; `pairs`: the
    document-masked path's pair kernel on CPU (None: FlashPairs; tests name MathPairs to check it here)."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.device.type != "cpu":  # the mask whole, for SDPA's CUDA kernels
        s = q.shape[2]
        allowed = (documents[:, :, None] == documents[:, None, :]) & torch.ones(s, s, dtype=torch.bool,
                                                                                device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=gqa)
    return document_mask_attention(q, k, v, documents, pairs)
