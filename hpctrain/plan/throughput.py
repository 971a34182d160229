"""Time of one training step, from FLOPs and bytes: compute, communication per collective and mesh
dimension, pipeline bubble, optimizer step; then tokens/s, TFLOP/s per GPU and MFU. Pure arithmetic.

Hardware figures come from the cluster config (conf/cluster/*.yaml): datasheet numbers, plus two
efficiencies per GPU kind fitted on published runs (`python benchmarks/calibration --fit`,
docs/published_runs.md): the share of peak a large GEMM sustains and the share flash attention
sustains. Everything else is structure: a GEMM's time follows its shape (a roofline over its operands,
so thin GEMMs of small micro-batches or high TP run slower per FLOP), attention follows head dimension
and causal block waste, elementwise kernels follow the bytes they move (fused or eager), and the
`Software` profile says what the engine overlaps. Validation: tests/test_published.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from hpctrain.core.flops import (attention_flops_per_token, lora_linears, param_counts, recompute_flops_per_token,
                                 train_flops_per_token)
from hpctrain.core.shape import expert_ffn, head_dim, moe_layer_count
from hpctrain.core.spec import ranks_per_node
from hpctrain.plan.context import attention_kept, cp_collectives
from hpctrain.plan.moe import (dispatch_bytes, ep_link, expert_time, expert_zero_group, folded, routed_rows,
                               stage_moe_layers)
from hpctrain.plan.memory import (BYTES, GRAD_BYTES, Job, checkpointed_layers, loss_chunk, pipeline_ranks,
                                  reduce_bytes, stage_params, stream_bytes)
from hpctrain.core.schema import ClusterConfig

# Flash attention's backward does 2.5x the matmul work of its forward (it recomputes the scores).
ATTN_BWD = 2.5
# Flash attention works in blocks of 128 keys; under a causal mask the diagonal blocks are computed
# whole, so it does 1/2 (1 + 128/s) of the s x s score matrix, not 1/2.
ATTN_BLOCK = 128
# Its inner GEMMs have the head dimension as their depth: FA2 on A100 runs head_dim 64 at ~0.88 of
# head_dim 128's rate (Dao 2023, fig. 4-5), which hd / (hd + 20) reproduces (attention_efficiency is
# the limit of large heads).
ATTN_HEAD_KNEE = 20
# Unfused attention (Megatron-LM 2021: no flash kernel) writes the s x s scores to HBM: bytes per score
# element, forward (fused scale-mask-softmax 2 + 2, dropout 2 + 2 + a 1-byte mask) and backward
# (dropout 2 + 1 + 2, softmax 2 + 2 + 2); the QK^T and AV batched GEMMs are priced as GEMMs.
UNFUSED_SCORE_BYTES = (9, 11)
# Elementwise kernels, bytes per element of their input in 16-bit activations, forward. Fused
# (Megatron/TE kernels, torch.compile, native LayerNorm): an RMSNorm reads and writes once (4), a
# residual add reads two and writes one (6), RoPE 4 per q/k element, SwiGLU reads two ffn-wide
# tensors and writes one (6 per ffn element). Eager hpctrain/torchtitan Llama code (models/llama.py):
# RMSNorm upcasts, squares, reduces, scales, downcasts and multiplies, ~36 with its fp32
# intermediates; RoPE upcasts, chunks, 4 muls, 2 adds, cat, downcast, ~48; SwiGLU silu then mul, 10;
# the attention output's transpose is a copy (4). Backward moves about twice the forward's bytes.
FUSED_BYTES = {"norm": 4, "add": 6, "rope": 4, "swiglu": 6, "copy": 0}
EAGER_BYTES = {"norm": 36, "add": 6, "rope": 48, "swiglu": 10, "copy": 4}
# Bytes moved per logit by an fp32 cross-entropy over bf16 logits, forward and backward
# (unfused: upcast, log-softmax, its backward, downcast: ~10 passes of 4 bytes).
CE_BYTES = 40
# Optimizer step: Adam reads master, grad, m, v and writes master, m, v (4 bytes each) plus the
# low-precision copy of the parameter.
ADAM_BYTES = {"bf16": 30, "fp32": 28, "fp16": 30, "fp8": 30}
# The bubble of each schedule relative to 1F1B's (p-1) micro-batch times. ZB-H1 leaves about a
# third (Qi et al. 2023: (p-1)(F+B-W) with F = B = W); ZBV and DualPipeV about a sixth. Interleaving
# divides by the stages each rank runs (Narayanan et al. 2021), for zero_bubble too (torch's
# ScheduleInterleavedZeroBubble interleaves its stages).
BUBBLE_DIVISOR = {"gpipe": 1.0, "1f1b": 1.0, "zero_bubble": 3.0, "zbv": 6.0, "dualpipev": 6.0}
# FP8 (train.precision=fp8, torchao's Float8Linear on the blocks' linears wq wk wv wo w1 w2 w3; the output
# layer, routers, experts and attention stay bf16). Its GEMMs run at cluster.fp8_tflops x FP8_EFFICIENCY
# (the share of the FP8 peak a large FP8 GEMM sustains, one figure for every GPU kind: only H100 rows are
# published to fit it on), fitted with ROWWISE_RATE on torchao's Llama 3 8B table (benchmarks/calibration, docs/
# published_runs.md). ROWWISE_RATE: a rowwise-scaled GEMM's speed relative to a tensorwise one (CUTLASS
# kernels with a scale per row and column against cuBLAS's per-tensor scale).
FP8_EFFICIENCY = 0.364
ROWWISE_RATE = 0.81
# Bytes per element of one dynamic cast to float8 (memory-bound): the amax pass reads the 16-bit tensor
# (2), the cast reads it again and writes one byte (3); under torch.compile or Transformer Engine the amax
# is fused into the kernel that produced the tensor, leaving the cast's 3. A float8 tensor's transposed
# copy for the weight-gradient GEMM (tensorwise: _scaled_mm wants it column-major) reads and writes one
# byte each (2).
FP8_CAST_BYTES = {"eager": 5, "fused": 3}
FP8_TRANSPOSE_BYTES = 2
# train.precision=fp16's GradScaler, once per step: unscale reads and writes each fp32 gradient of the
# rank (8) and the inf check reads it (4); then one all-reduce of the found-inf flag over every rank.
SCALER_BYTES = 12


@dataclass(frozen=True)
class Software:
    """What the training engine does with the hardware: which communication it hides behind compute and
    which kernels it runs. Not hardware: the same cluster runs Megatron-LM and hpctrain differently."""
    name: str
    tp_overlap: float  # fraction of tensor-parallel collective time hidden behind GEMMs
    dp_overlap: float  # fraction of a micro-batch's backward (forward) that gradient reduction
    #                    (parameter gathering) may hide behind; the last bucket never hides
    pp_overlap: float  # fraction of steady-state send/recv hidden; the fill and drain hops never are
    fused: bool = False  # fused elementwise kernels; False: eager PyTorch unless the job compiles
    flash: bool = True  # flash attention; False: scores materialized in HBM
    attn_rate: float = 1.0  # its flash kernel's speed relative to FlashAttention-2 (or cuDNN's, alike)
    # ZeRO-1's traffic: "reduce_scatter" (Megatron's distributed optimizer: reduce-scatter the gradients,
    # all-gather the updated 16-bit parameters behind the next forward) or "all_reduce" (hpctrain: DDP's
    # or FSDP2 replicate's all-reduce of fp32 gradients, then each owner broadcasts its updated fp32
    # parameters after the step: ZeroRedundancyOptimizer, hpctrain.train.optim.ShardedOptimizer).
    zero1: str = "reduce_scatter"
    # Sequence parallelism with TP (Korthikanti et al. 2022): norms, dropout and residual adds run on
    # 1/tp of the sequence between an all-gather and a reduce-scatter. Without it (Megatron-LM of
    # 2021) every TP rank runs them on the whole sequence and the block's two collectives are
    # all-reduces (the same bytes).
    sequence_parallel: bool = True
    # The same fraction for the backward's TP collectives where it differs (None: tp_overlap).
    tp_overlap_bwd: Optional[float] = None
    # Whose buffers the memory model prices (hpctrain.plan.memory.Job.engine): "hpctrain" for the
    # PyTorch-native stacks, "megatron" for Megatron-style ones (main-grad buffers, per-transfer receives).
    engine: str = "hpctrain"
    # What a checkpointed block's recompute reruns. torch.utils.checkpoint's non-reentrant form (torch
    # >= 2.1, the default; hpctrain, torchtitan, Composer/llm-foundry) stops as soon as the last tensor
    # backward needs is recomputed: the block's last linear (w2, with its reduce-scatter under TP) and
    # the residual add after it are not rerun. Megatron's and DeepSpeed's checkpointing rerun the
    # whole forward.
    recompute_last_linear: bool = False
    # Fraction of expert parallel's all-to-all hidden behind compute: 0 in line (hpctrain, Megatron's
    # default dispatcher); Megatron-Core's "1F1B overlap" runs one micro-batch's dispatch under another's
    # compute (its MoE README).
    ep_overlap: float = 0.0
    # Context parallel's ring: the share of each step's K/V transfer that runs under the attention on the
    # chunks at hand (hpctrain starts the transfer first: all of it, up to that attention's time)
    cp_overlap: float = 1.0


# Megatron-LM with --tp-comm-overlap (userbuffers split GEMMs and collectives into chunks),
# --overlap-grad-reduce and --overlap-param-gather, Transformer Engine's fused kernels: the setting of
# its published H100 table (and of NeMo).
MEGATRON = Software("megatron", tp_overlap=0.9, dp_overlap=1.0, pp_overlap=1.0, fused=True, engine="megatron",
                    recompute_last_linear=True)
# hpctrain: FSDP2 prefetches all-gathers and issues reduce-scatters during backward, as Megatron's
# buckets do; DTensor TP runs its collectives in line (torch's async TP needs torch.compile); the
# Llama's norms, RoPE and SwiGLU run as eager PyTorch ops unless train.compile fuses them.
# torchtitan is the same PyTorch-native stack.
HPCTRAIN = Software("hpctrain", tp_overlap=0.0, dp_overlap=1.0, pp_overlap=1.0, zero1="all_reduce")
# torchtitan with async TP (torch.compile + symmetric memory): the forward's TP collectives overlap
# the GEMMs they feed, as Megatron's userbuffers do; the backward's run in line (its authors measured
# ~29% faster forwards and ~8% faster steps on Llama 3 7B; docs/measurements.md).
TORCH_ASYNC_TP = Software("torch-async-tp", tp_overlap=0.9, dp_overlap=1.0, pp_overlap=1.0, zero1="all_reduce",
                          tp_overlap_bwd=0.0)
# llm-foundry's MPT on PyTorch FSDP (2023, its benchmark yamls: attn_impl triton): hpctrain's overlap;
# native single-kernel LayerNorm and GELU; a Triton flash-attention kernel of FlashAttention v1's
# generation, which FlashAttention-2 outruns ~1.8x forward + backward at head_dim 128 (Dao 2023, fig. 4).
LLM_FOUNDRY = Software("llm-foundry", tp_overlap=0.0, dp_overlap=1.0, pp_overlap=1.0, fused=True,
                       attn_rate=0.55)
# The same on torch 1.13/2.0, whose non-reentrant checkpoint reruns a block's whole forward.
LLM_FOUNDRY_TORCH1 = replace(LLM_FOUNDRY, name="llm-foundry-torch1", recompute_last_linear=True)
# Megatron-LM of 2021 (Narayanan et al.): fused bias/softmax kernels but no flash attention, and
# nothing overlapped: TP all-reduces in line, gradients all-reduced after the backward, blocking
# pipeline send/recv.
MEGATRON_2021 = Software("megatron-2021", tp_overlap=0.0, dp_overlap=0.0, pp_overlap=0.0, fused=True,
                         flash=False, sequence_parallel=False, engine="megatron", recompute_last_linear=True)
# DeepSpeed ZeRO-3 of 2021 on Megatron's GPT (Narayanan et al. Table 2): prefetched parameter gathers.
DEEPSPEED_2021 = Software("deepspeed-2021", tp_overlap=0.0, dp_overlap=1.0, pp_overlap=1.0, fused=True,
                          flash=False, recompute_last_linear=True)


@dataclass(frozen=True)
class Hardware:
    flops: float  # sustained FLOP/s of a large GEMM at the job's precision
    attn_flops: float  # flash attention FLOP/s on the FLOPs it performs, large heads
    hbm: float  # bytes/s
    elem: int  # bytes per activation element
    fp8_flops: float = 0.0  # sustained FP8 FLOP/s of a large GEMM (train.precision=fp8 on a GPU with FP8)

    @classmethod
    def of(cls, job: Job) -> "Hardware":
        c = job.cluster
        # peak_tflops is the bf16 tensor-core peak (fp16's too: the same tensor cores, or on V100 and T4,
        # whose presets give the fp16 peak, the only one); fp32 matmuls on GPUs run as TF32 at half of it.
        scale = 0.5 if (job.spec.precision == "fp32" and c.device == "cuda") else 1.0
        peak = c.peak_tflops * 1e12 * scale
        fp8 = 0.0
        if job.spec.precision == "fp8":
            # without FP8 tensor cores (a CPU's emulation, or rules refusing the GPU) the float8 linears
            # are priced as the bf16 GEMMs they emulate
            fp8 = c.fp8_tflops * 1e12 * fp8_efficiency(c) or peak * c.matmul_efficiency
        return cls(flops=peak * c.matmul_efficiency, attn_flops=peak * c.attention_efficiency,
                   hbm=c.hbm_gbps * 1e9, elem=BYTES[job.spec.precision], fp8_flops=fp8)

    def gemm(self, m: float, k: float, n: float) -> float:
        """An (m x k) @ (k x n) GEMM as a smooth roofline: its FLOPs at the sustained rate plus the
        traffic of its operands and output. Per FLOP that is 1/rate + elem/(2 hbm) (1/m + 1/k + 1/n):
        a GEMM thinner than ~rate x elem / (2 hbm) (~160 on H100, ~115 on A100) in any dimension runs
        markedly slower, whether it is thin in tokens (micro-batch x sequence) or in hidden / TP."""
        return 2 * m * k * n / self.flops + self.elem * (m * k + k * n + m * n) / self.hbm

    def gemm8(self, m: float, k: float, n: float, rate: float = 1.0) -> float:
        """The same GEMM in float8 (torch._scaled_mm): one byte per operand element, the output in bf16,
        at the FP8 rate (x `rate`: ROWWISE_RATE for rowwise scales)."""
        return 2 * m * k * n / (self.fp8_flops * rate) + (m * k + k * n + 2 * m * n) / self.hbm


def fp8_efficiency(c: ClusterConfig) -> float:
    """Share of cluster.fp8_tflops a large FP8 GEMM sustains: FP8_EFFICIENCY (read when called, so that the
    calibration's fit can set it)."""
    return FP8_EFFICIENCY


def fp8_linear(job: Job, hw: Hardware, t: float, k: float, n: float, fused: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one torchao Float8Linear, `t` tokens of `k` in, `n` out, one
    micro-batch: its three GEMMs and the casts they need. torchao 0.18 saves the bf16 input and weight
    for backward (float8_linear.matmul_with_hp_or_float8_args) and casts them again there.

    tensorwise: forward casts the input X and the weight W; backward casts the output gradient G, X
    and W again, and transposes G and X for the weight-gradient GEMM. rowwise (and mxfp8): a scale per
    row, so each GEMM wants its operands scaled along its own axis: forward X, W; backward G twice, X,
    W; no transposes. rowwise_with_gw_hp: the weight-gradient GEMM in bf16 (X and G as they are), so
    backward casts G and W only. With train.fp8.all_gather (tensorwise, ZeRO-3) FSDP2 casts each
    weight shard before gathering it (1/dp_shard of W) and backward reuses the gathered float8 weight:
    its transpose only."""
    recipe = job.spec.fp8_recipe or "tensorwise"
    cast = FP8_CAST_BYTES["fused" if fused else "eager"]
    X, W, G = t * k, k * n, t * n
    rate = 1.0 if recipe == "tensorwise" else ROWWISE_RATE
    shard = max(1, job.zero_group) if job.spec.fp8_all_gather else 1
    fwd_bytes = cast * (X + W / shard)
    if recipe == "tensorwise":
        w_bwd = FP8_TRANSPOSE_BYTES * W if job.spec.fp8_all_gather else cast * W
        bwd_bytes = cast * (G + X) + w_bwd + FP8_TRANSPOSE_BYTES * (G + X)
    elif recipe == "rowwise_with_gw_hp":
        bwd_bytes = cast * (G + W)
    else:
        bwd_bytes = cast * (2 * G + X + W)
    wgrad = hw.gemm(k, t, n) if recipe == "rowwise_with_gw_hp" else hw.gemm8(k, t, n, rate)
    fwd = hw.gemm8(t, k, n, rate) + fwd_bytes / hw.hbm
    bwd = hw.gemm8(t, n, k, rate) + wgrad + bwd_bytes / hw.hbm
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# Communication


@dataclass
class Collective:
    dim: str  # mesh dimension: tp | dp | dp_shard | dp_replicate | pp
    op: str  # all_gather | reduce_scatter | all_reduce | broadcast | send_recv
    group: int
    nbytes: float  # the full buffer: all_gather output, reduce_scatter input, all_reduce buffer, message
    count: float  # calls per step on one rank
    busbw: float  # bytes/s
    latency: float  # s per algorithm step across nodes (within one node if the group is inside one)
    exposed: float = 0.0  # s per step on the critical path
    nodes: int = 1  # nodes the group spans
    intra_latency: float = 0.0  # s per algorithm step inside a node

    @property
    def seconds(self) -> float:
        """One call: nccl-tests' bus bandwidth convention plus NCCL's latency model (its tuning.cc):
        a ring all-gather or reduce-scatter takes n-1 steps, of which nodes-1 cross a node; a ring
        all-reduce twice that inside one node; across nodes a tree all-reduce, 2 (n/nodes - 1) steps
        inside nodes and 2 log2(nodes) across."""
        n, k = self.group, self.nodes
        if self.op == "send_recv":
            return self.latency + self.nbytes / self.busbw
        factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(self.op, (n - 1) / n)
        intra = self.intra_latency or self.latency
        # all_to_all (expert dispatch): n-1 pairwise exchanges, (n-1)/n of the buffer leaves the rank
        if self.op in ("all_gather", "reduce_scatter", "all_to_all"):
            lat = (n - k) * intra + (k - 1) * self.latency
        elif self.op == "all_reduce" and k > 1:
            lat = 2 * ((n // k - 1) * intra + math.ceil(math.log2(k)) * self.latency)
        elif self.op == "all_reduce":
            lat = 2 * (n - 1) * intra
        else:
            lat = math.ceil(math.log2(n)) * self.latency
        return lat + factor * self.nbytes / self.busbw

    @property
    def total(self) -> float:
        return self.count * self.seconds

    def as_dict(self) -> dict:
        return {"dim": self.dim, "op": self.op, "group": self.group, "bytes": self.nbytes, "count": self.count,
                "bytes_per_step": self.nbytes * self.count, "busbw_gbps": self.busbw / 1e9,
                "time_s": self.total, "exposed_s": self.exposed}


def link(cluster: ClusterConfig, size: int, stride: int) -> tuple[float, float, int]:
    """(bus bandwidth, latency, nodes spanned) of a group of `size` ranks `stride` apart in the mesh.

    Inside a node: NVLink-class bandwidth. Across nodes the node's NICs are shared by every rank on
    it (all groups of one mesh dimension communicate at once), so a group with g members per node
    gets g / ranks_per_node of the node's NIC bandwidth; a ring crossing nodes runs at that rate.
    """
    rpn = ranks_per_node(cluster)
    intra = cluster.intra_node_gbps * 1e9
    if size * stride <= rpn:
        return intra, cluster.intra_node_latency_us * 1e-6, 1
    per_node = max(1, min(size, rpn // stride))
    inter = cluster.nics_per_node * cluster.inter_node_gbps * 1e9 * per_node / rpn
    return min(intra, inter), cluster.inter_node_latency_us * 1e-6, -(-size // per_node)


def _coll(job: Job, dim: str, op: str, nbytes: float, count: float) -> Collective:
    lay = job.spec.layout
    if dim == "ep":
        size, stride = ep_link(job)
    elif dim == "edp":  # what ZeRO shards the experts over: the ranks outside the ep group
        size, stride = expert_zero_group(job), lay.tp * lay.ep if not folded(job) else lay.ep * job.expert_tp
    else:
        # mesh (pp, dp_replicate, dp_shard, cp, tp): the cp ranks share the parameter sharding and the
        # gradient reduction with dp_shard (hpctrain.distributed.mesh); with expert parallel dp_shard is
        # (efsdp, ep) and the cp ranks sit between them, ep x tp apart
        cp = lay.cp
        cp_stride = lay.tp * lay.ep if lay.ep > 1 and not folded(job) else lay.tp
        size, stride = {"tp": (lay.tp, 1), "cp": (cp, cp_stride), "dp_shard": (lay.dp_shard * cp, lay.tp),
                        "dp": (lay.dp * cp, lay.tp), "dp_replicate": (lay.dp_replicate, lay.tp * lay.dp_shard * cp),
                        "pp": (2, lay.tp * lay.dp * cp)}[dim]
    bw, lat, nodes = link(job.cluster, size, stride)
    return Collective(dim, op, size, nbytes, count, bw, lat, nodes=nodes,
                      intra_latency=job.cluster.intra_node_latency_us * 1e-6)


# ---------------------------------------------------------------------------------------------
# Compute per micro-batch


@dataclass
class StageTime:
    """Seconds one rank of a stage spends per micro-batch, and what it communicates per step."""
    stage: int
    fwd: float
    bwd: float
    recompute: float
    tp_exposed: float
    zero_exposed: float  # ZeRO-2/3 traffic that runs every micro-batch and does not hide
    dp_exposed: float  # once-per-step data-parallel traffic that does not hide
    params: float
    units: int
    collectives: list = field(default_factory=list)
    ep_exposed: float = 0.0  # expert parallel's dispatch and combine all-to-alls (in line)
    cp_exposed: float = 0.0  # context parallel's K/V traffic that attention does not hide
    experts: float = 0.0  # of params, routed experts (sharded by ZeRO over the expert group)
    trained_share: float = 1.0  # of params, those with gradients (LoRA: the adapters)
    fp8_share: float = 0.0  # of params (outside the experts), those FSDP2 gathers in float8 (train.fp8.all_gather)

    @property
    def total(self) -> float:
        return (self.fwd + self.bwd + self.recompute + self.tp_exposed + self.zero_exposed + self.ep_exposed
                + self.cp_exposed)


def layer_fwd(job: Job, hw: Hardware, tokens: int, sw: Software = None) -> dict:
    """One block on one rank for one micro-batch of `tokens`: GEMMs (forward), attention (forward and
    backward) and memory-bound elementwise kernels (forward)."""
    sw = sw or HPCTRAIN
    m, tp, s = job.model, job.spec.layout.tp, job.spec.seq_len
    hd = head_dim(m)
    h, q, kv, f = m.dim, m.n_heads * hd / tp, m.n_kv_heads * hd / tp, m.ffn_dim / tp
    # The four linears each sequence-parallel collective pairs with: wq|wk|wv after an all-gather, wo
    # before a reduce-scatter, w1 and w3 after an all-gather, w2 before a reduce-scatter.
    shapes = ((h, q + 2 * kv, 1), (q, h, 1), (h, f, 2), (f, h, 1))  # (in, out, how many)
    if job.spec.precision == "fp8" and hw.fp8_flops:
        fused = sw.fused or job.spec.compile
        pairs = [tuple(x * c for x in fp8_linear(job, hw, tokens, i, o, fused)) for i, o, c in shapes]
        linears = tuple(p[0] for p in pairs)
        linears_bwd = tuple(p[1] for p in pairs)  # input and weight gradients, with their casts
    else:
        linears = tuple(c * hw.gemm(tokens, i, o) for i, o, c in shapes)
        linears_bwd = tuple(2 * g for g in linears)
    gemm = sum(linears)
    if sw.flash:
        # the fraction of the s x s scores computed: the causal half (whole tiles on the diagonal), of
        # which a document mask keeps the part inside documents (tokens here: this rank's, 1/cp of s)
        causal = 0.5 * min(2.0, 1 + ATTN_BLOCK / s) * attention_kept(job)
        attn = 4 * tokens * s * q * causal / (hw.attn_flops * sw.attn_rate * hd / (hd + ATTN_HEAD_KNEE))
        attn_bwd = ATTN_BWD * attn
    else:  # QK^T and AV per head and sequence over the full s x s scores, which live in HBM
        heads = q / hd * tokens / s
        scores = heads * s * s * hw.elem / 2
        bmm = heads * (hw.gemm(s, hd, s) + hw.gemm(s, s, hd))
        attn = bmm + scores * UNFUSED_SCORE_BYTES[0] / hw.hbm
        attn_bwd = 2 * bmm + scores * UNFUSED_SCORE_BYTES[1] / hw.hbm
    b = FUSED_BYTES if (sw.fused or job.spec.compile) else EAGER_BYTES
    # RMSNorms and residual adds on the residual stream (1/tp of it with sequence parallelism); RoPE on
    # q and k; SwiGLU.
    stream = h / tp if job.sequence_parallel else h
    per_token = (2 * b["norm"] + 2 * b["add"]) * stream + b["rope"] * (q + kv) + b["swiglu"] * f + b["copy"] * q
    elem = tokens * per_token * hw.elem / 2 / hw.hbm
    return {"gemm": gemm, "linears": linears, "linears_bwd": linears_bwd, "attn": attn, "attn_bwd": attn_bwd,
            "elem": elem}


def loss_chunks(job: Job) -> int:
    """Chunks the output layer and the loss run in per micro-batch (1 under train.loss=full)."""
    return -(-int(job.tokens) // loss_chunk(job))


def output_layer(job: Job, hw: Hardware, tokens: float, wgrad: float = 1.0) -> dict:
    """The output projection and the fp32 cross-entropy over its vocab-parallel logits, one micro-batch:
    {"gemm": the logits' GEMMs, "fwd", "bwd"}. train.loss=full: the whole logits, then their gradient in
    backward (input and weight gradients). train.loss=chunked (hpctrain.models.loss, Liger's algorithm):
    each chunk's logits, softmax gradient, input gradient and weight gradient all in the forward, the
    same FLOPs, as GEMMs of `loss_chunk` tokens that read the whole output weight again per chunk
    (the roofline's weight term); the backward only scales what the forward kept."""
    m, tp = job.model, job.spec.layout.tp
    v = m.vocab_size / tp
    ce = tokens * v * CE_BYTES / hw.hbm
    if job.spec.loss != "chunked":
        out = hw.gemm(tokens, m.dim, v)
        return {"gemm": out, "fwd": out + ce / 3, "bwd": (1 + wgrad) * out + ce * 2 / 3}
    n = loss_chunks(job)
    out = n * hw.gemm(loss_chunk(job), m.dim, v)
    scale = 2 * (tokens * m.dim * hw.elem + wgrad * v * m.dim * 4) / hw.hbm  # grads x the loss's gradient
    return {"gemm": out, "fwd": (2 + wgrad) * out + ce, "bwd": scale}


def module_recompute(job: Job, hw: "Hardware", sw: Software, tokens: float, lf: dict, moe_share: float) -> float:
    """Seconds one block not checkpointed whole spends rerunning its parallel.ac_modules in backward
    (hpctrain.parallel.activation), one micro-batch; `moe_share`: the fraction of blocks that route.
    attention: the kernel's forward; mlp: the SwiGLU (elementwise); norm: the two RMSNorms (elementwise,
    the residual stream); moe_act: the experts' SwiGLU; moe: the MoE layer's forward (router, experts,
    shared experts, permutation; its all-to-alls are counted with expert parallel's, stage_time)."""
    mods = job.spec.ac_modules
    if not mods:
        return 0.0
    m, lay = job.model, job.spec.layout
    sw_bytes = FUSED_BYTES if (sw.fused or job.spec.compile) else EAGER_BYTES
    per_byte = tokens * hw.elem / 2 / hw.hbm  # seconds per 16-bit element-byte per token
    t = lf["attn"] if "attention" in mods else 0.0
    if "norm" in mods:
        t += 2 * sw_bytes["norm"] * (m.dim / lay.tp if job.sequence_parallel else m.dim) * per_byte
    if "mlp" in mods:
        t += (1 - moe_share) * sw_bytes["swiglu"] * m.ffn_dim / lay.tp * per_byte
    if moe_share and "moe" in mods:
        moe = expert_time(job, hw, tokens, sw_bytes["swiglu"])
        t += moe_share * (moe["gemm"] + moe["elem"])
    elif moe_share and "moe_act" in mods:
        rows = routed_rows(job, tokens)
        t += moe_share * sw_bytes["swiglu"] * rows * expert_ffn(m) / job.expert_tp * hw.elem / 2 / hw.hbm
    return t


def module_recompute_flops(job: Job, blocks: int, kept: float) -> float:
    """FLOPs per token the GEMMs and attention of parallel.ac_modules rerun in `blocks` blocks (the
    elementwise reruns add none): the attention's forward (attention), the MoE layers' routed and shared
    experts and router (moe)."""
    m, mods = job.model, job.spec.ac_modules
    if not blocks or not mods:
        return 0.0
    c = param_counts(m)
    out = attention_flops_per_token(m, job.spec.seq_len, kept) / m.n_layers / 3 if "attention" in mods else 0.0
    if "moe" in mods and c["moe_layers"]:
        e = m.moe
        active = e.top_k * c["expert"] + 3 * m.dim * e.shared_experts * expert_ffn(m) + m.dim * e.experts
        out += 2 * active * c["moe_layers"] / m.n_layers
    return blocks * out


def nf4_dequantise_bytes(elem: float) -> float:
    """Memory traffic per weight of one dequantisation of torchao's NF4Tensor (get_original_weight, torchao
    0.18, eager: unfused): the 4-bit codes read and split into two uint8 tensors (0.5 + 1), widened to int64
    (8 written, 8 read by the table lookup), then four passes over the weight in its dtype (the looked-up
    values written, scaled: read and written, stacked: read and written, less one read fused away)."""
    return 0.5 + 1 + 16 + 5 * elem


def stage_time(job: Job, stage: int, hw: Hardware, sw: Software) -> StageTime:
    m, lay = job.model, job.spec.layout
    tokens = job.tokens
    layers = job.stage_layers(stage)
    first, last = job.first(stage), job.last(stage)
    lf = layer_fwd(job, hw, tokens, sw)
    # Backward computes input and weight gradients: 2 GEMMs per forward one; LoRA's frozen weights need
    # only the input's (torch skips a weight gradient no parameter wants), its adapters both.
    wgrad = 0.0 if job.spec.lora else 1.0
    gemm_bwd = sum(lf["linears_bwd"]) if wgrad else lf["gemm"]  # (LoRA: the input gradient's GEMM only)
    fwd = layers * (lf["gemm"] + lf["attn"] + lf["elem"])
    bwd = layers * (gemm_bwd + lf["attn_bwd"] + 2 * lf["elem"])
    if job.spec.lora:
        r = job.spec.lora.rank
        adapter = sum(n * (hw.gemm(tokens, i, r) + hw.gemm(tokens, r, o)) for i, o, n in lora_linears(m, lay.tp))
        adapter *= layers / m.n_layers
        fwd, bwd = fwd + adapter, bwd + 2 * adapter
        if job.spec.lora.quantize == "nf4":  # each adapted weight dequantised in the forward and the backward
            deq = sum(i * o * n for i, o, n in lora_linears(m, lay.tp)) * layers / m.n_layers
            t_deq = deq * nf4_dequantise_bytes(hw.elem) / hw.hbm
            fwd, bwd = fwd + t_deq, bwd + t_deq
    if first:  # embedding lookup and its scatter-add gradient
        fwd += tokens * m.dim / lay.tp * hw.elem / hw.hbm
        bwd += 2 * tokens * m.dim / lay.tp * hw.elem / hw.hbm
    if last:  # output projection and the fp32 loss over vocab-parallel logits (bf16 under fp8 too)
        head = output_layer(job, hw, tokens, wgrad)
        out = head["gemm"]
        fwd += head["fwd"]
        bwd += head["bwd"]
    recomputed = checkpointed_layers(job.spec.ac, layers, job.spec.ac_every)
    w2 = 0.0 if sw.recompute_last_linear else lf["linears"][3]
    recompute = recomputed * (lf["gemm"] - w2 + lf["attn"] + lf["elem"])
    n_moe = stage_moe_layers(job, stage)
    mods = job.spec.ac_modules
    rest = layers - recomputed  # the blocks parallel.ac_modules recomputes modules of
    recompute += rest * module_recompute(job, hw, sw, tokens, lf, n_moe / layers if layers else 0.0)
    ep_exposed, ep_colls = 0.0, []
    if n_moe:
        # An MoE block's feed-forward in place of the SwiGLU (the two last linears and its elementwise)
        b = FUSED_BYTES if (sw.fused or job.spec.compile) else EAGER_BYTES
        moe = expert_time(job, hw, tokens, b["swiglu"])
        swiglu = tokens * b["swiglu"] * m.ffn_dim / lay.tp * hw.elem / 2 / hw.hbm
        # (the experts stay bf16 under fp8: the dense FFN's float8 linears leave with their own backward)
        delta = moe["gemm"] + moe["elem"] - (lf["linears"][2] + lf["linears"][3] + swiglu)
        delta_bwd = 2 * (moe["gemm"] + moe["elem"]) - (lf["linears_bwd"][2] + lf["linears_bwd"][3] + 2 * swiglu)
        fwd += n_moe * delta
        bwd += n_moe * delta_bwd
        recompute += recomputed * n_moe / layers * delta
        rerun_moe = recomputed * n_moe / layers + (rest * n_moe / layers if "moe" in mods else 0.0)
        if lay.ep > 1:  # dispatch + combine, forward and backward, and the recomputed forward's
            count = (4 * n_moe + 2 * rerun_moe) * job.microbatches
            a2a = _coll(job, "ep", "all_to_all", dispatch_bytes(job, tokens, hw.elem), count)
            # what overlaps hides behind the other micro-batch's compute, never more than that compute
            a2a.exposed = a2a.total - sw.ep_overlap * min(a2a.total, job.microbatches * (fwd + bwd))
            ep_exposed, ep_colls = a2a.exposed / job.microbatches, [a2a]

    mb = job.microbatches
    colls = []
    tp_exposed = 0.0
    if lay.tp > 1:
        # Sequence parallel: per block 2 all-gathers + 2 reduce-scatters of the residual stream forward,
        # the same backward, and again for a recomputed block; the output layer gathers once each way.
        # Without it each all-gather + reduce-scatter pair is one all-reduce, of the same cost.
        act = tokens * m.dim * hw.elem
        per_mb = 4 * layers + 2 * recomputed + last
        rerun_rs = 0 if sw.recompute_last_linear else recomputed  # w2's reduce-scatter, not rerun
        # parallel.sp_regather: backward gathers again the inputs of the blocks it did not recompute
        again = (2 * (layers - recomputed) + last) if job.spec.sp_regather else 0
        if job.sequence_parallel:
            colls.append(_coll(job, "tp", "all_gather", act, (per_mb + again) * mb))
            colls.append(_coll(job, "tp", "reduce_scatter", act, (per_mb - rerun_rs) * mb))
        else:
            colls.append(_coll(job, "tp", "all_reduce", act, (per_mb - rerun_rs) * mb))
        # What one linear's collective costs: an all-gather or a reduce-scatter of one activation (the
        # same), half an all-reduce.
        c = colls[0].seconds / (1 if job.sequence_parallel else 2)
        # vocab-parallel cross-entropy: torch's loss_parallel all-reduces the max, the sum-exp and the target
        # logit (3 x tokens x 4 bytes); the chunked loss, per chunk, the max, then the sum-exp with the target
        # logit in one (2 all-reduces, 3 x chunk x 4 bytes)
        if job.spec.loss == "chunked":
            ce = _coll(job, "tp", "all_reduce", loss_chunk(job) * 6, 2 * mb * loss_chunks(job)) if last else None
        else:
            ce = _coll(job, "tp", "all_reduce", loss_chunk(job) * 4, 3 * mb) if last else None
        if ce:
            colls.append(ce)
        out = hw.gemm(tokens, m.dim, m.vocab_size / lay.tp) if last else 0.0
        fwd_blocks = layers + recomputed
        regathered = 0.0
        if job.spec.sp_regather:  # each re-gather feeds the weight gradient of wq|wk|wv, w1|w3 or the output
            qkv, w13 = lf["linears"][0], lf["linears"][2]
            regathered = (layers - recomputed) * (_tp_exposed(c, qkv, sw, bwd=True)
                                                  + _tp_exposed(c, w13, sw, bwd=True))
            regathered += _tp_exposed(c, out, sw, bwd=True) if last else 0.0
        tp_exposed = (fwd_blocks * sum(_tp_exposed(c, g, sw) for g in lf["linears"])
                      - rerun_rs * _tp_exposed(c, lf["linears"][3], sw) * (1 if job.sequence_parallel else 2)
                      + layers * sum(_tp_exposed(c, 2 * g, sw, bwd=True) for g in lf["linears"]) + regathered
                      + (_tp_exposed(c, out, sw) + _tp_exposed(c, 2 * out, sw, bwd=True) if last else 0.0)
                      + (ce.total / mb if ce else 0.0))
        share = tp_exposed * mb / (sum(x.total for x in colls) or 1.0)
        for x in colls:
            x.exposed = x.total * share

    # (parallel.ac_modules=[attention] reruns the kernel, its exchanges of K and V with it)
    cp_colls, cp_exposed = cp_collectives(job, _coll, hw.elem, lf["attn"], lf["attn_bwd"], layers,
                                          recomputed + (rest if "attention" in mods else 0), sw.cp_overlap)
    sp = stage_params(job, stage)
    units = layers + first + last
    if job.spec.precision == "fp8" and lay.tp > 1 and (job.spec.fp8_recipe or "tensorwise") == "tensorwise":
        # tensorwise scales of weights sharded by TP: each cast of a weight (forward and backward) needs the
        # global amax, one scalar all-reduce over the TP group per linear (7 per block)
        amax = _coll(job, "tp", "all_reduce", 4, 2 * 7 * (layers + recomputed / 2) * mb)
        amax.exposed = amax.total
        colls.append(amax)
        tp_exposed += amax.total / mb
    st = StageTime(stage, fwd, bwd, recompute, tp_exposed, 0.0, 0.0, sp.total, units, colls + ep_colls + cp_colls,
                   ep_exposed=ep_exposed, experts=sp.experts, cp_exposed=cp_exposed,
                   trained_share=sp.trained(job) / sp.total if sp.total else 1.0)
    if job.spec.fp8_all_gather:  # the blocks' linears (not norms, embedding, output layer, experts)
        dense = param_counts(m)["dense_block"] - 2 * m.dim
        attention = dense - 3 * m.dim * m.ffn_dim  # an MoE block's float8 linears: its attention's
        linear = ((layers - n_moe) * dense + n_moe * attention) / lay.tp
        st.fp8_share = linear / max(1.0, sp.total - sp.experts)
    _zero_traffic(job, st, hw, sw)
    return st


def _tp_exposed(comm: float, gemm: float, sw: Software, bwd: bool = False) -> float:
    """What stays exposed of a tensor-parallel collective that an engine overlaps with the GEMM it
    feeds or drains (Megatron's userbuffers, torch's async TP: the GEMM is split into chunks and each
    chunk's transfer runs under the previous chunk's matmul; Wang et al., ASPLOS 2023). It can hide
    behind that GEMM's time and no more: a collective longer than its GEMM (thin shards at high TP)
    stays partly exposed. `gemm` is the forward GEMM, or dgrad plus wgrad in backward."""
    overlap = sw.tp_overlap if not bwd or sw.tp_overlap_bwd is None else sw.tp_overlap_bwd
    return comm - overlap * min(comm, gemm)


def _hide(t: float, window: float, units: int, overlap: float) -> float:
    """Exposed part of `t` seconds of traffic issued bucket by bucket under `window` seconds of compute."""
    return max(t / max(1, units), t - overlap * window)


def _zero_traffic(job: Job, st: StageTime, hw: Hardware, sw: Software) -> None:
    """Data-parallel collectives of this stage by ZeRO stage; fills st.zero_exposed (per micro-batch)
    and st.dp_exposed (once per step), and each collective's share of the exposed time.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers the
    updated parameters, or all-reduces them and broadcasts the updated parameters (Software.zero1);
    ZeRO-2 and 3 reduce-scatter every micro-batch (parallel.grad_sync=microbatch,
    sharded gradients only) or once per step (grad_sync=step, and under pipelining: an unsharded fp32
    gradient accumulates, hpctrain.plan.memory.accumulated_grads); ZeRO-3 (FSDP) also gathers parameters
    for forward and again for backward every micro-batch (once under pipelining, which keeps them
    gathered from a micro-batch's forward to its backward). With dp_replicate > 1 (HSDP) the shards are also all-reduced across replicas.
    Gradients travel in the reduce dtype (memory.reduce_bytes: fp32 unless train.reduce_precision=bf16),
    parameters in the compute precision.
    """
    lay = job.spec.layout
    if lay.ep <= 1:  # every parameter over the data-parallel ranks
        parts = [(st.params, "dp_shard", job.zero_group)] if lay.dp * lay.cp > 1 else []
    else:  # routed experts over the ranks expert parallel leaves (none: each rank owns its experts)
        parts = [(st.params - st.experts, "dp_shard", job.zero_group)] if lay.dp * lay.cp > 1 else []
        if expert_zero_group(job) > 1:
            parts.append((st.experts, "edp", expert_zero_group(job)))
    zero_exposed, dp_exposed = 0.0, 0.0
    for P, dim, N in parts:
        _zero_part(job, st, hw, sw, P, dim, N)
        zero_exposed, dp_exposed = zero_exposed + st.zero_exposed, dp_exposed + st.dp_exposed
    st.zero_exposed, st.dp_exposed = zero_exposed, dp_exposed


def _zero_part(job: Job, st: StageTime, hw: Hardware, sw: Software, P: float, shard_dim: str, N: int) -> None:
    """_zero_traffic for `P` parameters sharded over the `N` ranks of mesh dimension `shard_dim`; sets
    st.zero_exposed and st.dp_exposed to this part's."""
    lay, mb = job.spec.layout, job.microbatches
    st.zero_exposed = st.dp_exposed = 0.0
    fwd, bwd = st.fwd, st.bwd + st.recompute
    # Gradients exist for the trained parameters only (LoRA: the adapters); ZeRO-1/2 gather the updated
    # ones after the step, ZeRO-3 every parameter for each forward and backward.
    grad = P * st.trained_share * reduce_bytes(job)
    par = P * hw.elem * (1.0 if job.spec.zero >= 3 else st.trained_share)
    if job.spec.zero >= 3 and shard_dim != "edp" and st.fp8_share:  # float8 all-gather: 1 byte a weight
        par = P * (st.fp8_share + (1 - st.fp8_share) * hw.elem)

    def hide(t: float, window: float) -> float:
        return _hide(t, window, st.units, sw.dp_overlap)

    if job.spec.zero == 0 or N == 1:
        colls = [_coll(job, "dp" if shard_dim == "dp_shard" else shard_dim, "all_reduce", grad, 1)]
        st.dp_exposed = hide(colls[0].total, bwd)
    elif job.spec.zero == 1 and sw.zero1 == "all_reduce":
        # The parameters are fp32 (hpctrain.core.spec.dtypes); the broadcasts follow the optimizer step.
        colls = [_coll(job, "dp" if shard_dim == "dp_shard" else shard_dim, "all_reduce", grad, 1),
                 _coll(job, shard_dim, "broadcast", P * st.trained_share * 4, 1)]
        st.dp_exposed = hide(colls[0].total, bwd) + colls[1].total
    else:
        per_mb = job.spec.zero >= 2 and job.spec.grad_sync == "microbatch"
        rs_count = mb if per_mb else 1
        # ZeRO-3 gathers for each micro-batch's forward, and again for its backward unless it keeps the
        # parameters gathered in between (under pipelining, hpctrain.core.spec.sharding).
        gathers = (2 if job.spec.sharding.reshard_after_forward else 1) * mb if job.spec.zero >= 3 else 1
        # one call per unit (FSDP's per-block groups, Megatron's buckets): each pays the latency
        u = st.units
        colls = [_coll(job, shard_dim, "reduce_scatter", grad / u, rs_count * u),
                 _coll(job, shard_dim, "all_gather", par / u, gathers * u)]
        if lay.dp_replicate > 1:
            colls.append(_coll(job, "dp_replicate", "all_reduce", grad / N / u, rs_count * u))
        reduce = u * (colls[0].seconds + (colls[2].seconds if len(colls) > 2 else 0.0))
        gather = u * colls[1].seconds
        bwd_gather = gather if job.spec.sharding.reshard_after_forward else 0.0
        if job.spec.zero >= 3 and per_mb:
            st.zero_exposed = hide(gather, fwd) + hide(bwd_gather + reduce, bwd)
        elif job.spec.zero >= 3:  # gathers every micro-batch, reduces once, after the last backward
            st.zero_exposed = hide(gather, fwd) + hide(bwd_gather, bwd)
            st.dp_exposed = hide(reduce, bwd)
        else:
            if per_mb:  # ZeRO-2: all but the last micro-batch hide their reduce-scatter under their backward
                st.zero_exposed = hide(reduce, bwd) * (mb - 1) / mb
            st.dp_exposed = hide(reduce, bwd) + hide(gather, fwd)
    exposed = st.zero_exposed * mb + st.dp_exposed
    traffic = sum(c.total for c in colls) or 1.0
    for c in colls:
        c.exposed = exposed * c.total / traffic
    st.collectives.extend(colls)


# ---------------------------------------------------------------------------------------------
# One step


@dataclass
class Throughput:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (train_flops_per_token: the FLOPs computed) per second per GPU
    mfu: float
    hw_tflops_per_gpu: float  # model FLOPs plus the recomputed forward passes (activation checkpointing)
    bubble_fraction: float
    breakdown: dict  # seconds per step on the critical path, summing to step_time_s
    collectives: list  # Collective.as_dict() of the busiest stage


def stages_per_rank(job: Job) -> int:
    """Pipeline stages each rank runs (the spec's: interleaved and zero_bubble at least 2, V shapes 2)."""
    p = job.spec.pipeline
    return p.per_rank if p else 1


def bubble_divisor(job: Job) -> float:
    if job.spec.schedule == "interleaved_1f1b":
        return float(stages_per_rank(job))
    if job.spec.schedule == "zero_bubble":
        return BUBBLE_DIVISOR["zero_bubble"] * stages_per_rank(job)
    return BUBBLE_DIVISOR.get(job.spec.schedule, 1.0)


def optimizer_time(job: Job, params: float, experts: float = 0.0) -> dict:
    """The Adam step on this rank's shard: on device (HBM-bound), or on the host with PCIe copies
    (cpu), plus NVMe reads and writes of master weights and moments pipelined with it (nvme).
    `experts`: of `params`, routed experts, sharded over the expert group."""
    c = job.cluster
    shard = ((params - experts) / job.zero_group + experts / expert_zero_group(job)) if job.spec.zero >= 1 else params
    if job.spec.offload == "none":
        return {"optimizer": shard * ADAM_BYTES[job.spec.precision] / (c.hbm_gbps * 1e9)}
    rpn = ranks_per_node(c)
    pcie = shard * (GRAD_BYTES + BYTES[job.spec.precision]) / (c.pcie_gbps * 1e9)
    cpu = shard * rpn / (c.host_adam_gparams * 1e9)
    if job.spec.offload == "nvme":
        cpu = max(cpu, 2 * 12 * shard * rpn / (c.nvme_gbps * 1e9))
    return {"optimizer": cpu, "offload_copies": pcie}


def scaler_time(job: Job, params: float, experts: float = 0.0) -> float:
    """train.precision=fp16's GradScaler, once per step: unscale and inf-check this rank's fp32 gradients
    (sharded as the optimizer state is: optimizer_time), then agree on the found-inf flag with every
    rank (one scalar all-reduce: latency)."""
    shard = ((params - experts) / job.zero_group + experts / expert_zero_group(job)) if job.spec.zero >= 2 else params
    c = job.cluster
    flag = Collective("world", "all_reduce", job.world, 4, 1, c.intra_node_gbps * 1e9,
                      c.inter_node_latency_us * 1e-6, nodes=job.spec.nodes,
                      intra_latency=c.intra_node_latency_us * 1e-6)
    return shard * SCALER_BYTES / (c.hbm_gbps * 1e9) + (flag.seconds if job.world > 1 else 0.0)


def throughput(job: Job, sw: Software = HPCTRAIN) -> Throughput:
    """Step time of the slowest pipeline stage's ranks, and what it means in tokens/s and MFU."""
    hw = Hardware.of(job)
    lay, mb = job.spec.layout, job.microbatches
    # One rank of each distinct (blocks, embedding, output layer) shape: an uneven split
    # (parallel.pp_layers) can make any of them the slowest, which sets the steady-state pace.
    times = {r: stage_time(job, r, hw, sw) for r in pipeline_ranks(job)}
    worst = max(times.values(), key=lambda t: t.total)
    # The bubble idles each rank for (pp-1)/divisor micro-batch times of the average rank.
    p = job.spec.pipeline
    if p is not None:
        by_shape = {p.rank_shapes[r]: t.total for r, t in times.items()}
        mean = sum(by_shape[shape] for shape in p.rank_shapes) / p.ranks
    else:
        mean = 0.0
    bubble = (lay.pp - 1) / bubble_divisor(job) * mean

    br = {"compute": mb * (worst.fwd + worst.bwd), "recompute": mb * worst.recompute,
          "tp_exposed": mb * worst.tp_exposed, "zero_exposed": mb * worst.zero_exposed, "bubble": bubble}
    if job.spec.dpo:  # the reference's forward of every micro-batch (no backward, nothing kept for one)
        br["reference"] = mb * worst.fwd
    if worst.ep_exposed:
        br["ep_exposed"] = mb * worst.ep_exposed
    if worst.cp_exposed:
        br["cp_exposed"] = mb * worst.cp_exposed
    colls = list(worst.collectives)
    if lay.pp > 1:
        v = stages_per_rank(job)
        # the residual stream, sequence-parallel (Megatron-LM 2021 scattered it over TP for the hop too);
        # fp32 under autocast
        msg = job.tokens * job.model.dim / lay.tp * stream_bytes(job)
        p2p = _coll(job, "pp", "send_recv", msg, 2 * mb * v)
        p2p.exposed = (1 - sw.pp_overlap) * p2p.total + 2 * (lay.pp - 1) * p2p.seconds
        colls.append(p2p)
        br["p2p_exposed"] = p2p.exposed
    br["dp_exposed"] = worst.dp_exposed
    heaviest = max(times.values(), key=lambda t: t.params)
    br.update(optimizer_time(job, heaviest.params, heaviest.experts))
    if job.spec.loss_scaling:
        br["loss_scaling"] = scaler_time(job, heaviest.params * heaviest.trained_share, heaviest.experts)
    if job.spec.fp8_all_gather:  # precomputed scales: one all-reduce of every float8 weight's amax a step
        amax = _coll(job, "dp_shard", "all_reduce", 4 * 7 * job.model.n_layers, 1)
        amax.exposed = amax.total
        colls.append(amax)
        br["fp8_amax"] = amax.total
    step = sum(br.values())

    tokens = job.spec.global_batch * job.spec.seq_len * (2 if job.spec.dpo else 1)  # dpo: two sequences a pair
    # the FLOPs computed: the attention pairs the causal mask and the document mask keep, no more
    kept = attention_kept(job)
    flops = train_flops_per_token(job.model, job.spec.seq_len, kept) * tokens
    tflops = flops / step / job.world / 1e12
    recomputed = checkpointed_layers(job.spec.ac, job.model.n_layers, job.spec.ac_every)
    hw_flops = flops + recompute_flops_per_token(job.model, job.spec.seq_len, recomputed,
                                                 last_linear=sw.recompute_last_linear, kept=kept) * tokens
    hw_flops += module_recompute_flops(job, job.model.n_layers - recomputed, kept) * tokens
    if job.spec.dpo:  # (not the model's MFU) the reference's forward, blocks and output layer; and the policy's
        # per-sequence head, whose backward makes each chunk's logits again (hpctrain.models.loss): a head GEMM more
        head = 2.0 * job.model.vocab_size * job.model.dim
        hw_flops += (recompute_flops_per_token(job.model, job.spec.seq_len, job.model.n_layers, kept=kept)
                     + 2 * head) * tokens
    return Throughput(step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=tflops,
                      mfu=tflops / job.cluster.peak_tflops, hw_tflops_per_gpu=hw_flops / step / job.world / 1e12,
                      bubble_fraction=bubble / step, breakdown=br,
                      collectives=[c.as_dict() for c in colls])


def megatron_flops_per_token(m, seq_len: int, recompute: bool = True) -> float:
    """Megatron-LM's FLOPs per token: Narayanan et al. 2021, eq. (3), F = 96 B s l h^2 (1 + s/(6h) +
    V/(16 l h)) per iteration, generalized to grouped-query attention, SwiGLU and routed experts as
    Megatron-LM's num_floating_point_operations does it: 12 l h^2 [(1 + kv/heads + s/h) q/h + 1.5 f/h]
    per token for the blocks (f: the FFN width, top_k routed plus shared experts on MoE blocks), times
    4/3 with `recompute` (eq. (3) counts the forward full recomputation repeats; Megatron-LM r0.8's logged
    TFLOP/s, those of its README's H100 table, do not), plus 6 V h for the logits. The attention term is
    the whole s x s square, as eq. (3) and r0.8 count it: neither the causal half (later releases halve
    it) nor a document mask."""
    h, hd = m.dim, head_dim(m)
    q = m.n_heads * hd / h
    attention = (1 + m.n_kv_heads / m.n_heads + seq_len / h) * q
    n_moe = moe_layer_count(m)
    e, f_e = m.moe, expert_ffn(m)
    mlp = (1.5 * m.ffn_dim / h * (m.n_layers - n_moe)
           + 1.5 * (e.top_k + e.shared_experts) * f_e / h * n_moe) / m.n_layers
    blocks = 12 * m.n_layers * h * h * (attention + mlp) * (4 / 3 if recompute else 1)
    return blocks + 6 * m.vocab_size * h
