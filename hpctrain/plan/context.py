"""What context parallelism and document masking change in the planner's terms (no torch).

A cp rank computes on 1/cp of each sequence (Job.tokens) and attends its queries over the whole sequence;
the balanced chunk layout (hpctrain.parallel.context) gives every rank the same share of the causal
triangle. K and V reach the other ranks by an all-gather per layer (forward, again in backward, and a
reduce-scatter of their gradients) or round a ring in cp - 1 steps each way (the gradients one step more),
each step's transfer under the attention on the chunks at hand.

With a document mask attention computes only the pairs inside documents: for documents whose boundaries
fall at random with mean length L (exponential lengths), the kept share of the causal triangle of a
sequence of s tokens is (2L/s)(1 - (L/s)(1 - e^(-s/L))) (the integral of P(no boundary between two
tokens) = e^(-d/L) over the triangle), 2L/s for L much shorter than s, 1 for L much longer.
"""
from __future__ import annotations

import math

from hpctrain.core.shape import head_dim


def attention_kept(job) -> float:
    """Share of the causal attention the document mask keeps (1: no mask, or no document length known)."""
    L, s = job.doc_len, job.spec.seq_len
    if not job.spec.document_mask or L <= 0 or s <= 0:
        return 1.0
    r = L / s
    return min(1.0, 2 * r * (1 - r * (1 - math.exp(-1 / r))))


def kv_bytes(job, elem: float) -> float:
    """K and V of one micro-batch's local chunks on one rank (this rank's heads under TP)."""
    m, lay = job.model, job.spec.layout
    return job.tokens * 2 * m.n_kv_heads * head_dim(m) / lay.tp * elem


def gathered_kv_bytes(job, elem: float) -> float:
    """What attention holds at once beyond a layer's own K/V: all-gather the whole sequence's K and V
    (and in backward their gradients as well), ring the chunks in flight (received, and in backward
    their gradients too)."""
    cp = job.spec.layout.cp
    if cp <= 1:
        return 0.0
    local = kv_bytes(job, elem)
    if job.spec.cp_attention == "ring":
        return 2 * 2 * local  # K/V being received, and the gradients travelling with them
    return 2 * cp * local  # the gathered K/V and, in backward, their gradients


def cp_collectives(job, coll, elem: float, attn_fwd: float, attn_bwd: float, layers: int,
                   recomputed: int, cp_overlap: float) -> tuple[list, float]:
    """The cp collectives of a stage per step and their exposed seconds per micro-batch. attn_fwd and
    attn_bwd: one layer's attention seconds per micro-batch (what a ring step hides behind). `coll`:
    throughput._coll."""
    cp, mb = job.spec.layout.cp, job.microbatches
    if cp <= 1:
        return [], 0.0
    local = kv_bytes(job, elem)
    fwd_layers = layers + recomputed
    if job.spec.cp_attention == "ring":
        step_kv = coll(job, "cp", "send_recv", local, (cp - 1) * (fwd_layers + layers) * mb)
        step_grad = coll(job, "cp", "send_recv", local, cp * layers * mb)
        t = step_kv.seconds
        # each forward step's K/V under the attention of one chunk pair set, each backward step's too;
        # the gradients' transfer follows the computation that made them
        exposed = ((cp - 1) * (fwd_layers * max(0.0, t - cp_overlap * attn_fwd / cp)
                               + layers * max(0.0, t - cp_overlap * attn_bwd / cp))
                   + cp * layers * step_grad.seconds)
        colls = [step_kv, step_grad]
    else:
        gather = coll(job, "cp", "all_gather", cp * local, (fwd_layers + layers) * mb)
        scatter = coll(job, "cp", "reduce_scatter", cp * local, layers * mb)
        exposed = (fwd_layers + layers) * gather.seconds + layers * scatter.seconds
        colls = [gather, scatter]
    total = sum(c.total for c in colls) or 1.0
    for c in colls:
        c.exposed = c.total / total * exposed * mb
    return colls, exposed
