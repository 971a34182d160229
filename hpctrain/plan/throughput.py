"""Time of one training step, from FLOPs and bytes: compute, communication per collective and mesh
dimension, pipeline bubble, optimizer step; then tokens/s, TFLOP/s per GPU and MFU. Pure arithmetic.

Hardware figures come from the cluster config (conf/cluster/*.yaml); the constants below describe
the software (kernels and overlap) and are shared by every cluster. The two efficiencies in
conf/cluster/h100.yaml were chosen once so that, with the MEGATRON overlap profile, every row of
Megatron-LM's published H100 table comes within 10% (report.calibration, tests/test_plan.py).
Plans for hpctrain itself use the HPCTRAIN profile, which differs only in tensor-parallel overlap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpctrain.flops import recompute_flops_per_token, train_flops_per_token
from hpctrain.spec import ranks_per_node
from hpctrain.plan.memory import (BYTES, REDUCE_BYTES, Job, checkpointed_layers,
                                  stage_params)

# Causal flash attention computes half of the s x s score matrix that the FLOP rule counts.
CAUSAL = 0.5
# Flash attention's backward does 2.5x the matmul work of its forward (it recomputes the scores).
ATTN_BWD = 2.5
# Bytes moved per logit by an fp32 cross-entropy over bf16 logits, forward and backward
# (unfused: upcast, log-softmax, its backward, downcast: ~10 passes of 4 bytes).
CE_BYTES = 40
# Optimizer step: Adam reads master, grad, m, v and writes master, m, v (4 bytes each) plus the
# low-precision copy of the parameter.
ADAM_BYTES = {"bf16": 30, "fp32": 28}
# The bubble of each schedule relative to 1F1B's (p-1) micro-batch times. ZB-H1 leaves about a
# third (Qi et al. 2023); ZBV and DualPipeV about a sixth. Interleaving divides by virtual stages.
BUBBLE_DIVISOR = {"gpipe": 1.0, "1f1b": 1.0, "zero_bubble": 3.0, "zbv": 6.0, "dualpipev": 6.0}


@dataclass(frozen=True)
class Software:
    """How much communication the training engine hides behind compute. This is not hardware: the
    same cluster runs Megatron-LM and hpctrain with different overlap."""
    tp_overlap: float  # fraction of tensor-parallel collective time hidden behind GEMMs
    dp_overlap: float  # fraction of a micro-batch's backward (forward) that gradient reduction
    #                    (parameter gathering) may hide behind; the last bucket never hides
    pp_overlap: float  # fraction of steady-state send/recv hidden; the fill and drain hops never are


# Megatron-LM with --tp-comm-overlap (userbuffers split GEMMs and collectives into chunks),
# --overlap-grad-reduce and --overlap-param-gather: the setting of its published H100 table.
MEGATRON = Software(tp_overlap=0.9, dp_overlap=1.0, pp_overlap=1.0)
# hpctrain: FSDP2 prefetches all-gathers and issues reduce-scatters during backward, as Megatron's
# buckets do; DTensor TP runs its collectives in line (torch's async TP needs torch.compile).
HPCTRAIN = Software(tp_overlap=0.0, dp_overlap=1.0, pp_overlap=1.0)


@dataclass(frozen=True)
class Hardware:
    flops: float  # sustained GEMM FLOP/s at the job's precision
    attn_flops: float  # fused attention FLOP/s on the FLOPs it performs
    hbm: float  # bytes/s
    elem: int  # bytes per activation element

    @classmethod
    def of(cls, job: Job) -> "Hardware":
        c = job.cluster
        # peak_tflops is the bf16 tensor-core peak; fp32 matmuls on GPUs run as TF32 at half of it.
        scale = 0.5 if (job.precision == "fp32" and c.device == "cuda") else 1.0
        peak = c.peak_tflops * 1e12 * scale
        return cls(flops=peak * c.matmul_efficiency, attn_flops=peak * c.attention_efficiency,
                   hbm=c.hbm_gbps * 1e9, elem=BYTES[job.precision])

    def gemm(self, m: float, k: float, n: float) -> float:
        """A GEMM as a smooth roofline: its FLOPs at the sustained rate plus its operands' traffic.
        Small or skinny GEMMs (small models, high TP) come out slower per FLOP, as measured."""
        return 2 * m * k * n / self.flops + self.elem * (m * k + k * n + m * n) / self.hbm


# ---------------------------------------------------------------------------------------------
# Communication


@dataclass
class Collective:
    dim: str  # mesh dimension: tp | dp | dp_shard | dp_replicate | pp
    op: str  # all_gather | reduce_scatter | all_reduce | send_recv
    group: int
    nbytes: float  # the full buffer: all_gather output, reduce_scatter input, all_reduce buffer, message
    count: float  # calls per step on one rank
    busbw: float  # bytes/s
    latency: float  # s per algorithm step
    exposed: float = 0.0  # s per step on the critical path

    @property
    def seconds(self) -> float:
        """One call: nccl-tests' bus bandwidth convention plus a log-depth latency term."""
        n = self.group
        if self.op == "send_recv":
            return self.latency + self.nbytes / self.busbw
        factor = {"all_reduce": 2 * (n - 1) / n}.get(self.op, (n - 1) / n)
        steps = math.ceil(math.log2(n)) * (2 if self.op == "all_reduce" else 1)
        return steps * self.latency + factor * self.nbytes / self.busbw

    @property
    def total(self) -> float:
        return self.count * self.seconds

    def as_dict(self) -> dict:
        return {"dim": self.dim, "op": self.op, "group": self.group, "bytes": self.nbytes, "count": self.count,
                "bytes_per_step": self.nbytes * self.count, "busbw_gbps": self.busbw / 1e9,
                "time_s": self.total, "exposed_s": self.exposed}


def link(cluster: Any, size: int, stride: int) -> tuple[float, float]:
    """(bus bandwidth, latency) of a group of `size` ranks `stride` apart in the mesh.

    Inside a node: NVLink-class bandwidth. Across nodes the node's NICs are shared by every rank on
    it (all groups of one mesh dimension communicate at once), so a group with g members per node
    gets g / ranks_per_node of the node's NIC bandwidth; a ring crossing nodes runs at that rate.
    """
    rpn = ranks_per_node(cluster)
    intra = cluster.intra_node_gbps * 1e9
    if size * stride <= rpn:
        return intra, cluster.intra_node_latency_us * 1e-6
    per_node = max(1, min(size, rpn // stride))
    inter = cluster.nics_per_node * cluster.inter_node_gbps * 1e9 * per_node / rpn
    return min(intra, inter), cluster.inter_node_latency_us * 1e-6


def _coll(job: Job, dim: str, op: str, nbytes: float, count: float) -> Collective:
    lay = job.layout
    size, stride = {"tp": (lay.tp, 1), "dp_shard": (lay.dp_shard, lay.tp), "dp": (lay.dp, lay.tp),
                    "dp_replicate": (lay.dp_replicate, lay.tp * lay.dp_shard),
                    "pp": (2, lay.tp * lay.dp)}[dim]
    bw, lat = link(job.cluster, size, stride)
    return Collective(dim, op, size, nbytes, count, bw, lat)


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

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp_exposed + self.zero_exposed


def layer_fwd(job: Job, hw: Hardware, tokens: int) -> dict:
    """Forward of one block on one rank: GEMMs, attention, memory-bound elementwise kernels."""
    m, tp = job.model, job.layout.tp
    hd = m.dim // m.n_heads
    h, q, kv, f = m.dim, m.n_heads * hd / tp, m.n_kv_heads * hd / tp, m.ffn_dim / tp
    gemm = (hw.gemm(tokens, h, q + 2 * kv) + hw.gemm(tokens, q, h)  # wq|wk|wv, wo
            + 2 * hw.gemm(tokens, h, f) + hw.gemm(tokens, f, h))  # w1, w3, w2
    attn = 4 * tokens * job.seq_len * q * CAUSAL / hw.attn_flops
    # RMSNorms and residual adds on the (sequence-parallel) stream: read+write 10 h; RoPE on q and k;
    # SwiGLU reads two ffn-wide tensors and writes one.
    elem = tokens * hw.elem * (10 * h / tp + 2 * (q + kv) + 3 * f) / hw.hbm
    return {"gemm": gemm, "attn": attn, "elem": elem}


def stage_time(job: Job, stage: int, hw: Hardware, sw: Software) -> StageTime:
    m, lay = job.model, job.layout
    tokens = job.micro_batch * job.seq_len
    layers = job.stage_layers(stage)
    first, last = job.first(stage), job.last(stage)
    lf = layer_fwd(job, hw, tokens)
    fwd = layers * (lf["gemm"] + lf["attn"] + lf["elem"])
    bwd = layers * (2 * lf["gemm"] + ATTN_BWD * lf["attn"] + 2 * lf["elem"])
    if first:  # embedding lookup and its scatter-add gradient
        fwd += tokens * m.dim / lay.tp * hw.elem / hw.hbm
        bwd += 2 * tokens * m.dim / lay.tp * hw.elem / hw.hbm
    if last:  # output projection and the fp32 loss over vocab-parallel logits
        out = hw.gemm(tokens, m.dim, m.vocab_size / lay.tp)
        fwd += out + tokens * m.vocab_size / lay.tp * CE_BYTES / 3 / hw.hbm
        bwd += 2 * out + tokens * m.vocab_size / lay.tp * CE_BYTES * 2 / 3 / hw.hbm
    recomputed = checkpointed_layers(job.ac, layers, job.ac_every)
    recompute = recomputed * (lf["gemm"] + lf["attn"] + lf["elem"])

    mb = job.microbatches
    colls = []
    if lay.tp > 1:
        # Sequence parallel: per block 2 all-gathers + 2 reduce-scatters of the residual stream forward,
        # the same backward, and again for a recomputed block; the output layer gathers once each way.
        act = tokens * m.dim * hw.elem
        per_mb = 4 * layers + 2 * recomputed + last
        colls.append(_coll(job, "tp", "all_gather", act, per_mb * mb))
        colls.append(_coll(job, "tp", "reduce_scatter", act, per_mb * mb))
        if last:  # vocab-parallel cross-entropy: max, sum-exp, target logit
            colls.append(_coll(job, "tp", "all_reduce", tokens * 4, 3 * mb))
    tp_time = sum(c.total for c in colls) / mb
    for c in colls:
        c.exposed = c.total * (1 - sw.tp_overlap)
    tp_exposed = tp_time * (1 - sw.tp_overlap)

    sp = stage_params(job, stage)
    units = layers + first + last
    st = StageTime(stage, fwd, bwd, recompute, tp_exposed, 0.0, 0.0, sp.total, units, colls)
    _zero_traffic(job, st, hw, sw)
    return st


def _hide(t: float, window: float, units: int, overlap: float) -> float:
    """Exposed part of `t` seconds of traffic issued bucket by bucket under `window` seconds of compute."""
    return max(t / max(1, units), t - overlap * window)


def _zero_traffic(job: Job, st: StageTime, hw: Hardware, sw: Software) -> None:
    """Data-parallel collectives of this stage by ZeRO stage; fills st.zero_exposed (per micro-batch)
    and st.dp_exposed (once per step), and each collective's share of the exposed time.

    ZeRO-0 all-reduces gradients once per step; ZeRO-1 reduce-scatters them once and all-gathers the
    updated parameters; ZeRO-2 and 3 reduce-scatter every micro-batch (parallel.grad_sync=microbatch,
    sharded gradients only) or once per step (grad_sync=step, and under pipelining: an unsharded fp32
    gradient accumulates, hpctrain.plan.memory.accumulated_grads); ZeRO-3 (FSDP) also gathers parameters
    for forward and again for backward every micro-batch. With dp_replicate > 1 (HSDP) the shards are also all-reduced across replicas.
    Gradients travel in fp32 (REDUCE_BYTES), parameters in the compute precision.
    """
    lay, mb, P = job.layout, job.microbatches, st.params
    if lay.dp == 1:
        return
    fwd, bwd = st.fwd, st.bwd + st.recompute
    grad, par = P * REDUCE_BYTES, P * hw.elem
    N = job.zero_group

    def hide(t: float, window: float) -> float:
        return _hide(t, window, st.units, sw.dp_overlap)

    if job.zero == 0 or N == 1:
        colls = [_coll(job, "dp", "all_reduce", grad, 1)]
        st.dp_exposed = hide(colls[0].total, bwd)
    else:
        per_mb = job.zero >= 2 and job.spec.grad_sync == "microbatch"
        rs_count = mb if per_mb else 1
        colls = [_coll(job, "dp_shard", "reduce_scatter", grad, rs_count),
                 _coll(job, "dp_shard", "all_gather", par, 2 * mb if job.zero >= 3 else 1)]
        if lay.dp_replicate > 1:
            colls.append(_coll(job, "dp_replicate", "all_reduce", grad / N, rs_count))
        reduce = colls[0].seconds + (colls[2].seconds if len(colls) > 2 else 0.0)
        gather = colls[1].seconds
        if job.zero >= 3 and per_mb:
            st.zero_exposed = hide(gather, fwd) + hide(gather + reduce, bwd)
        elif job.zero >= 3:  # gathers every micro-batch, reduces once, after the last backward
            st.zero_exposed = hide(gather, fwd) + hide(gather, bwd)
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
    tflops_per_gpu: float  # model FLOPs (train_flops_per_token) per second per GPU
    mfu: float
    hw_tflops_per_gpu: float  # model FLOPs plus the recomputed forward passes (activation checkpointing)
    bubble_fraction: float
    breakdown: dict  # seconds per step on the critical path, summing to step_time_s
    collectives: list  # Collective.as_dict() of the busiest stage


def bubble_divisor(job: Job) -> float:
    if job.schedule == "interleaved_1f1b":
        return float(max(1, job.virtual_stages))
    return BUBBLE_DIVISOR.get(job.schedule, 1.0)


def optimizer_time(job: Job, params: float) -> dict:
    """The Adam step on this rank's shard: on device (HBM-bound), or on the host with PCIe copies
    (cpu), plus NVMe reads and writes of master weights and moments pipelined with it (nvme)."""
    c = job.cluster
    shard = params / job.zero_group if job.zero >= 1 else params
    if job.offload == "none":
        return {"optimizer": shard * ADAM_BYTES[job.precision] / (c.hbm_gbps * 1e9)}
    rpn = ranks_per_node(c)
    pcie = shard * (REDUCE_BYTES + BYTES[job.precision]) / (c.pcie_gbps * 1e9)
    cpu = shard * rpn / (c.host_adam_gparams * 1e9)
    if job.offload == "nvme":
        cpu = max(cpu, 2 * 12 * shard * rpn / (c.nvme_gbps * 1e9))
    return {"optimizer": cpu, "offload_copies": pcie}


def throughput(job: Job, sw: Software = HPCTRAIN) -> Throughput:
    """Step time of the slowest pipeline stage's ranks, and what it means in tokens/s and MFU."""
    hw = Hardware.of(job)
    lay, mb = job.layout, job.microbatches
    stages = sorted({0, min(1, lay.pp - 1), lay.pp - 1})
    times = {s: stage_time(job, s, hw, sw) for s in stages}
    worst = max(times.values(), key=lambda t: t.total)
    # The bubble idles each stage for (pp-1)/divisor micro-batch times of the average stage; the
    # stages between first and last all look like stage 1.
    mid = times[min(1, lay.pp - 1)].total
    mean = (times[0].total + times[lay.pp - 1].total + (lay.pp - 2) * mid) / lay.pp if lay.pp > 1 else 0.0
    bubble = (lay.pp - 1) / bubble_divisor(job) * mean

    br = {"compute": mb * (worst.fwd + worst.bwd), "recompute": mb * worst.recompute,
          "tp_exposed": mb * worst.tp_exposed, "zero_exposed": mb * worst.zero_exposed, "bubble": bubble}
    colls = list(worst.collectives)
    if lay.pp > 1:
        v = max(1, job.virtual_stages) if job.schedule == "interleaved_1f1b" else 1
        msg = job.micro_batch * job.seq_len * job.model.dim / lay.tp * hw.elem
        p2p = _coll(job, "pp", "send_recv", msg, 2 * mb * v)
        p2p.exposed = (1 - sw.pp_overlap) * p2p.total + 2 * (lay.pp - 1) * p2p.seconds
        colls.append(p2p)
        br["p2p_exposed"] = p2p.exposed
    br["dp_exposed"] = worst.dp_exposed
    br.update(optimizer_time(job, max(t.params for t in times.values())))
    step = sum(br.values())

    tokens = job.global_batch * job.seq_len
    flops = train_flops_per_token(job.model, job.seq_len) * tokens
    tflops = flops / step / job.world / 1e12
    recomputed = checkpointed_layers(job.ac, job.model.n_layers, job.ac_every)
    hw_flops = flops + recompute_flops_per_token(job.model, job.seq_len, recomputed) * tokens
    return Throughput(step_time_s=step, tokens_per_s=tokens / step, tflops_per_gpu=tflops,
                      mfu=tflops / job.cluster.peak_tflops, hw_tflops_per_gpu=hw_flops / step / job.world / 1e12,
                      bubble_fraction=bubble / step, breakdown=br,
                      collectives=[c.as_dict() for c in colls])
