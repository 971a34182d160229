"""What Mixture-of-Experts layers add to a rank's memory and step time. Pure arithmetic, no torch.

A rank of pipeline stage s holds the stage's MoE layers; of each, the router and shared experts whole
(sharded by ZeRO like every dense weight), and E / ep routed experts, sharded by ZeRO over the ranks
expert parallel leaves (hpctrain.distributed.mesh's efsdp). Per micro-batch of T tokens and top_k
experts per token, each rank sends T x top_k rows of `dim` to the ranks of its ep group and computes
the rows its experts receive: T x top_k on average, `model.moe.imbalance` times that on the busiest
rank (dropless routing waits for it). Dispatch and combine are one all-to-all each, forward and
backward (and again for a recomputed layer), on the critical path: the engine runs them in line.

Published runs of Megatron-Core fold expert parallel into tensor parallel (its "MoE parallel folding":
ep may exceed the data-parallel ranks, and ep x etp x edp = tp x dp); `ep` > dp_shard is priced so,
with `expert_tp` (Megatron's ETP) splitting each expert's width.
"""
from __future__ import annotations

from hpctrain.core.flops import param_counts
from hpctrain.core.shape import expert_ffn, moe_layer


def stage_moe_layers(job, stage: int) -> int:
    """MoE blocks pipeline rank `stage` holds, over all its (virtual) stages."""
    m = job.model
    if not m.moe.experts:
        return 0
    p = job.spec.pipeline
    if p is None:
        return sum(1 for i in range(m.n_layers) if moe_layer(m, i))
    return sum(1 for s in p.stage_ids(stage) for i in range(*p.blocks[s]) if moe_layer(m, i))


def folded(job) -> bool:
    """Expert parallel laid out innermost, over the tensor-parallel ranks first (Megatron-Core's folding:
    its runs, and any ep more than the data-parallel ranks give)."""
    lay = job.spec.layout
    return lay.ep > 1 and (job.engine == "megatron" or lay.dp_shard % lay.ep != 0)


def expert_zero_group(job) -> int:
    """Ranks each expert's weights are sharded over by ZeRO: what ep leaves of dp_shard (efsdp) times the
    cp ranks (hpctrain.distributed.mesh), or what it leaves of tp x dp x cp under folding (Megatron-Core:
    ep x etp x edp = tp x cp x dp)."""
    lay = job.spec.layout
    if lay.ep <= 1:
        return job.zero_group
    if folded(job):
        return max(1, lay.tp * lay.dp_shard * lay.cp // (lay.ep * job.expert_tp))
    return max(1, lay.dp_shard // lay.ep * lay.cp)


def expert_params(job, stage: int) -> float:
    """Routed-expert parameters one rank of `stage` holds before ZeRO (after EP and expert TP)."""
    layers = stage_moe_layers(job, stage)
    if not layers:
        return 0.0
    c = param_counts(job.model)
    return layers * job.model.moe.experts * c["expert"] / max(1, job.spec.layout.ep) / job.expert_tp


def expert_activation_bytes(job, tokens: int, elem: int, modules: tuple = ()) -> float:
    """What one MoE layer saves for backward beyond a dense block's attention half, per micro-batch of
    `tokens` on its busiest rank: the permuted rows each expert reads (dispatched and, received, k
    per token), w1 and w3's outputs (the SwiGLU keeps both) and their product w2 reads (3 x expert
    width per routed row), the experts' output before the weighted sum, the shared experts' SwiGLU,
    and the router's fp32 logits and probabilities. parallel.ac_modules (hpctrain.parallel.activation):
    moe keeps nothing of it (only the layer's input, the norm's output the dense half counts), moe_act
    drops the routed experts' product (f per routed row)."""
    if "moe" in modules:
        return 0.0
    m = job.model
    e, f = m.moe, expert_ffn(m) / job.expert_tp
    rows = routed_rows(job, tokens)
    shared = 3 * e.shared_experts * expert_ffn(m) / job.spec.layout.tp
    per_row = 3 * m.dim + (2 if "moe_act" in modules else 3) * f
    return (rows * per_row + tokens * (shared + m.dim)) * elem + tokens * e.experts * 4 * 2


def dense_ffn_activation(job, elem: int) -> float:
    """The dense SwiGLU's share of layer_activation_bytes per token (3 x ffn / tp), which an MoE layer
    replaces by expert_activation_bytes."""
    return 3 * job.model.ffn_dim / job.spec.layout.tp * elem


def routed_rows(job, tokens: int) -> float:
    """Rows the busiest rank's experts compute per micro-batch: its tokens x top_k x imbalance, where
    its tokens are 1/tp of the micro-batch's under tensor parallel (sequence parallel hands each TP rank
    its share of the sequence, which it dispatches on its own)."""
    e = job.model.moe
    return tokens / job.spec.layout.tp * e.top_k * e.imbalance


def expert_time(job, hw, tokens: int, swiglu_bytes: float = 6.0) -> dict:
    """One MoE layer's feed-forward on the busiest rank, one micro-batch, forward: the router's GEMM, the
    routed experts' grouped GEMMs (rows per local expert: routed_rows over the local experts) at the
    cluster's grouped-GEMM efficiency, the shared experts (tensor-parallel as a dense MLP), and the
    memory traffic of permuting the rows and of the SwiGLU (`swiglu_bytes` per element)."""
    m = job.model
    e, lay = m.moe, job.spec.layout
    f = expert_ffn(m) / job.expert_tp
    local = max(1, e.experts // max(1, lay.ep))
    rows = routed_rows(job, tokens)
    r = rows / local
    experts = local * (2 * hw.gemm(r, m.dim, f) + hw.gemm(r, f, m.dim)) / max(1e-6, job.cluster.grouped_gemm_efficiency)
    shared_f = e.shared_experts * expert_ffn(m) / lay.tp
    shared = 2 * hw.gemm(tokens, m.dim, shared_f) + hw.gemm(tokens, shared_f, m.dim) if shared_f else 0.0
    router = hw.gemm(tokens / lay.tp, m.dim, e.experts)
    # gather rows into expert order and scatter-add them back weighted: ~3 reads and writes of a row
    elem = (6 * rows * m.dim * hw.elem + swiglu_bytes * rows * f * hw.elem / 2) / hw.hbm
    return {"gemm": experts + shared + router, "elem": elem}


def dispatch_bytes(job, tokens: int, elem: int) -> float:
    """One all-to-all's buffer on one rank: its T x top_k routed rows (x imbalance on the busiest)."""
    return routed_rows(job, tokens) * job.model.dim * elem


def ep_link(job) -> tuple[int, int]:
    """(size, stride) of an expert-parallel group in the mesh: the innermost ep of dp_shard (stride tp),
    or under folding the tp ranks and beyond (stride 1)."""
    lay = job.spec.layout
    return (lay.ep, 1) if folded(job) else (lay.ep, lay.tp)
