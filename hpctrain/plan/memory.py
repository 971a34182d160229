"""Bytes one rank holds while training: model state by ZeRO stage and offload target, activations by
checkpointing and pipeline schedule, and the transient buffers on top. Pure arithmetic, no torch.

`Job` is the planner's input: one layout of one model on one cluster, as plain numbers, so the
search can price thousands of layouts at once. `job_of(cfg)` builds it from a composed config.
"""
from __future__ import annotations

import shutil
import dataclasses
from dataclasses import dataclass, field, fields, replace

from hpctrain.core.flops import lora_linears, lora_params, param_counts
from hpctrain.core.shape import head_dim, loss_chunk_tokens
from hpctrain.core.schema import ClusterConfig, Config, LauncherConfig, LauncherName, ModelConfig
from hpctrain.core.spec import KNOBS, EngineSpec, engine_spec, knob_changes, ranks_per_node, updated
from hpctrain.plan.context import gathered_kv_bytes
from hpctrain.plan.moe import (dense_ffn_activation, expert_activation_bytes, expert_params, expert_zero_group,
                               stage_moe_layers)

GiB = 2**30
BYTES = {"bf16": 2, "fp32": 4, "fp16": 2, "fp8": 2}  # per activation element (fp8: its linears aside, bf16)
# Gradients are kept (and, but with train.reduce_precision=bf16 under FSDP2, reduced) in fp32 whatever
# the compute precision (hpctrain.core.spec.dtypes).
GRAD_BYTES = 4
# The caching allocator rounds and fragments: a share of what comes and goes within a step
# (activations, transient buffers) stays reserved but unusable.
FRAGMENTATION = 0.05
# Per rank, outside the device, by device kind: the Python process with torch, and on GPUs the CUDA
# context's host side, pinned staging and NCCL's host state. A CPU rank (torch 2.13, gloo) peaks at
# 0.34 GiB of RSS on the tiny model (metrics.jsonl's mem_bytes); 0.5 GiB leaves room for the data
# loader and the interpreter's growth.
HOST_BASE_BYTES = {"cuda": 3 * GiB, "cpu": GiB // 2}
# The DTensor runtime (tensor parallel, FSDP2 = ZeRO-2/3) on top of the plain one, host memory: the
# Python heap of sharding propagation (its caches, fake tensors, the source lines linecache reads
# for their stack traces; 1.9-2.6 MiB by tracemalloc) and the library pages its ops touch
# (+0.9-1.9 MiB of RssFile). Measured on CPU by benchmarks/layouts.py, the same for a 0.5M and a
# 34M-parameter model. Device memory only where the device is the host (a CPU cluster).
DTENSOR_RUNTIME_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Job:
    """One run as the planner prices it: the engine spec (derived from the run's config, its cluster
    the one the planner prices) and what only the planner needs beside it."""
    spec: EngineSpec
    async_checkpoint: bool = False
    # Whose buffers: "hpctrain" (torch autograd's gradient accumulation, torch.distributed.pipelining's
    # receive buffers) or "megatron" (gradients accumulated by the wgrad GEMM into a main-grad buffer,
    # pipeline receives allocated per transfer): published runs of Megatron-style stacks.
    engine: str = "hpctrain"
    # TP with sequence parallelism (hpctrain always; Megatron-LM of 2021 had none: its norms and
    # residual stream were whole on every TP rank)
    sequence_parallel: bool = True
    # Megatron's expert tensor parallel (ETP): each expert's width split over this many ranks (1: none,
    # hpctrain's engine)
    expert_tp: int = 1
    # data.document_mask: the mean document length of the data (0: unknown, the whole causal triangle priced)
    doc_len: float = 0.0

    @classmethod
    def of(cls, model: ModelConfig, cluster: ClusterConfig, **knobs) -> "Job":
        """A job of `model` on `cluster` without a composed config (published runs, tests): the schema's
        defaults with these knobs (hpctrain.core.spec.KNOBS; `layout=Layout(...)`) and planner fields."""
        planner = {k: knobs.pop(k) for k in list(knobs) if k in PLANNER}
        missing = [k for k in ("layout", "global_batch", "seq_len") if k not in knobs]
        if missing:
            raise TypeError(f"Job.of needs {', '.join(missing)}: a job without them prices the schema's defaults")
        knobs = {"precision": "bf16", "micro_batch": 1, **knobs}  # GPU runs train in bf16; one sequence unless given
        cfg = Config(model=model, cluster=cluster, launcher=LauncherConfig(name=LauncherName("sbatch")))
        return cls(spec=spec_on(updated(cfg, knob_changes(**knobs))), **planner)

    @property
    def model(self) -> ModelConfig:
        return self.spec.config.model

    @property
    def cluster(self) -> ClusterConfig:
        return self.spec.config.cluster

    @property
    def world(self) -> int:
        return self.spec.layout.world

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch on one rank: 1/cp of its sequences under context parallelism (dpo: a
        micro-batch of pairs is twice as many sequences)."""
        return self.spec.micro_batch * self.spec.seq_len / self.spec.layout.cp * (2 if self.spec.dpo else 1)

    @property
    def autocast(self) -> bool:
        """hpctrain's bf16 over fp32 parameters (DDP, ZeRO-1: hpctrain.core.spec.dtypes), not Megatron's
        bf16 parameters with fp32 main gradients and master weights."""
        return self.spec.dtypes.autocast and self.engine == "hpctrain"

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel rank runs per step (pipeline micro-batches when pp > 1)."""
        return self.spec.microbatches

    @property
    def zero_group(self) -> int:
        """Ranks the model state is sharded over (1: replicated)."""
        return self.spec.sharding.group

    @property
    def params_on_host(self) -> bool:
        return self.spec.placement.params == "host"

    def stage_layers(self, stage: int) -> int:
        """Blocks pipeline rank `stage` holds, over all its (virtual) stages."""
        p = self.spec.pipeline
        return p.rank_blocks(stage) if p else self.model.n_layers

    def first(self, stage: int) -> bool:
        """Pipeline rank `stage` holds the embedding (the first stage)."""
        p = self.spec.pipeline
        return p.holds_embedding(stage) if p else True

    def last(self, stage: int) -> bool:
        """Pipeline rank `stage` holds the final norm, output projection and loss (the last stage)."""
        p = self.spec.pipeline
        return p.holds_output(stage) if p else True

    def with_(self, **kw) -> "Job":
        """This job with other knobs (zero=1, layout=...: hpctrain.core.spec.KNOBS), model, cluster or
        planner fields."""
        changes = knob_changes(**{k: kw.pop(k) for k in list(kw) if k in KNOBS or k == "layout"})
        cfg = self.spec.config
        if "model" in kw or "cluster" in kw:
            cfg = dataclasses.replace(cfg, model=kw.pop("model", cfg.model), cluster=kw.pop("cluster", cfg.cluster))
        return replace(self, spec=spec_on(updated(cfg, changes)), **kw)


PLANNER = frozenset(f.name for f in fields(Job)) - {"spec"}


def spec_on(cfg: Config) -> EngineSpec:
    """The engine spec of a planner's config: on the ranks its layout names (the search's layouts name
    every degree), on the cluster's nodes."""
    p = cfg.parallel
    return engine_spec(cfg, p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp if p.dp_shard > 0 else None)


def job_of(cfg: Config, world: int | None = None) -> Job:
    """The planner's view of a composed config. The local launcher puts every rank on one machine."""
    spec = engine_spec(cfg, world)
    cluster = cluster_of(cfg)
    if (cluster.nodes, ranks_per_node(cluster)) != (spec.nodes, spec.ranks_per_node):
        cluster = replace(cluster, nodes=spec.nodes, tasks_per_node=spec.ranks_per_node,
                          gpus_per_node=spec.ranks_per_node if cluster.gpus_per_node else 0)
    if spec.layout.dp_shard >= 1:  # the layout as resolved on `world` ranks: the search's changes keep it
        cfg = updated(cfg, knob_changes(layout=spec.layout))
    if cluster is not cfg.cluster or spec.config is not cfg:
        spec = engine_spec(dataclasses.replace(cfg, cluster=cluster), world)
    return Job(spec=spec, async_checkpoint=bool(cfg.checkpoint.async_save), doc_len=mean_document_length(cfg))


def mean_document_length(cfg: Config) -> float:
    """Tokens per document of the training data where known: synthetic documents' mean, or the shards'
    tokens over their documents (meta.json); 0 where unknown."""
    d = cfg.data
    if d.source == "synthetic":
        return float(d.synthetic_doc_len if d.eos_id >= 0 else 0)
    from hpctrain.data.shards import read_meta, split_tokens

    try:
        meta = read_meta(d.sources[0].path if d.sources else d.path) or {}
        docs = meta.get("documents") or 0
        return sum(split_tokens(meta, s) for s in meta.get("splits", {})) / docs if docs else 0.0
    except (OSError, ValueError, TypeError, KeyError):
        return 0.0


def cluster_of(cfg: Config) -> ClusterConfig:
    """The cluster the planner prices: the config's, where a local run's NVMe is this machine's."""
    cluster = cfg.cluster
    o = cfg.offload
    if cfg.launcher.name == "local" and o.target == "nvme" and o.path:
        # A local run's "cluster" is this machine: its NVMe capacity is the free space under offload.path
        # (the cluster preset's nvme_gb describes a datacenter node, or none).
        try:
            cluster = replace(cluster, nvme_gb=shutil.disk_usage(o.path).free / GiB)
        except OSError:
            pass  # check() names a path that is not there
    return cluster


# ---------------------------------------------------------------------------------------------
# Parameters per rank


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline stage `stage` holds after tensor parallel, before ZeRO."""
    stage: int
    layers: int
    total: float
    largest_unit: float  # the biggest FSDP unit (a block, the embedding or the output layer)
    experts: float = 0.0  # of `total`, routed experts (after expert parallel): sharded over expert_zero_group
    adapters: float = 0.0  # of `total`, LoRA adapters (model.lora): the only parameters trained then

    def trained(self, job: "Job") -> float:
        """The parameters with gradients and optimizer state: the adapters under LoRA, else all."""
        return self.adapters if job.spec.lora else self.total


def stage_params(job: "Job", stage: int) -> StageParams:
    m, tp = job.model, job.spec.layout.tp
    c = param_counts(m)
    layers = job.stage_layers(stage)
    n_moe = stage_moe_layers(job, stage)
    # TP splits every matrix (vocab-parallel embedding and output included); norms are replicated. An MoE
    # block's routed experts are split by expert parallel instead (plan.moe), a unit of their own.
    block = (c["dense_block"] - 2 * m.dim) / tp + 2 * m.dim
    moe_block = (c["moe_block"] - 2 * m.dim) / tp + 2 * m.dim
    experts = expert_params(job, stage)
    # Under expert parallel the experts are an FSDP unit of their own (hpctrain.parallel.data_parallel);
    # without it they belong to their block's.
    per_layer = experts / max(1, n_moe)
    moe_units = [moe_block, per_layer] if job.spec.layout.ep > 1 else [moe_block + per_layer]
    units = ([block] if layers > n_moe else []) + (moe_units if n_moe else [])
    total = (layers - n_moe) * block + n_moe * moe_block + experts
    if job.first(stage):
        units.append(c["embedding"] / tp)
        total += c["embedding"] / tp
    if job.last(stage):
        # Tied embeddings on one stage share a tensor; across stages each end holds a copy.
        out = c["embedding"] if (m.tie_embeddings and job.spec.layout.pp > 1) else c["output"]
        units.append(out / tp + m.dim)
        total += out / tp + m.dim
    # LoRA adapters beside the frozen weights (hpctrain.models.lora), in proportion to the stage's blocks
    adapters = lora_params(m, tp) * layers / m.n_layers if job.spec.lora else 0.0
    return StageParams(stage=stage, layers=layers, total=total + adapters, largest_unit=max(units, default=0.0),
                       experts=experts, adapters=adapters)


def model_state(params: float, precision: str, zero: int, shard: int, offload: str,
                host_params: bool = False, autocast: bool = False) -> tuple[dict, dict]:
    """(on device, off device) bytes of parameters, gradients, fp32 master weights and Adam moments.

    Mixed precision (bf16) keeps 2 + 2 + 4 + 8 = 16 bytes per parameter; fp32 keeps 4 + 4 + 8, the
    parameters being their own master copy. ZeRO-1 shards the optimizer state (master + moments) over
    `shard` ranks, ZeRO-2 the gradients too, ZeRO-3 the parameters too. Offloading moves master and
    moments to the host (cpu) or NVMe, where the host optimizer also needs the fp32 gradients.
    `host_params` (FSDP2's CPU offload, hpctrain.core.spec.placement): the sharded parameters, in fp32 and
    serving as master weights, and the sharded gradients live on the host as well; the device keeps
    only what it gathers (all of it from forward to backward with ZeRO-2, a unit at a time with ZeRO-3).
    `autocast` (bf16 over DDP or ZeRO-1, hpctrain.core.spec.dtypes): the parameters stay fp32 and are their
    own master copy, their gradients are fp32, and ZeRO-1 shards only the moments: 4 + 4 + 8 / shard,
    not 2 + 2 + 12 / shard (the bf16 copies autocast makes are transients, `weight_casts`).
    """
    pb = 4 if autocast else BYTES[precision]
    n = max(1, shard)
    master = 4 if precision != "fp32" and not autocast else 0
    state = {"params": pb * params / (n if zero >= 3 else 1),
             "grads": pb * params / (n if zero >= 2 else 1),
             "master": master * params / (n if zero >= 1 else 1),
             "moments": 8 * params / (n if zero >= 1 else 1)}
    if offload == "none":
        return state, {}
    off = {"master": state.pop("master"), "moments": state.pop("moments"),
           "grads_fp32": 4 * params / (n if zero >= 1 else 1)}
    if host_params:
        off["master"] = 0.0
        off["params_fp32"] = 4 * params / n
        state["grads"] = 0.0
        if zero >= 3:
            state["params"] = 0.0
    return state, off


# ---------------------------------------------------------------------------------------------
# Activations


def layer_activation_bytes(m: ModelConfig, tokens: int, tp: int, precision: str, regather: bool = False,
                           sp: bool = True, stream: int = 0, modules: tuple = ()) -> float:
    """What autograd saves for one Llama block's backward, one micro-batch of `tokens`, no checkpointing.

    Per token, in elements: the two RMSNorm inputs (h each, sequence-parallel so / tp; the norm keeps
    only its input and a per-token scale, hpctrain.models.llama), the q/k/v outputs after RoPE
    (h + 2 kv), the attention output (h; flash attention keeps no s x s matrix), the SwiGLU's w1 and
    w3 outputs and the product w2 reads (3 ffn: silu(w1) is recomputed), all / tp. The two norm
    outputs that feed column-parallel linears are all-gathered over TP: torch's ColwiseParallel saves
    that gathered input (2h not divided by tp); with `regather` (parallel.sp_regather, as Megatron)
    only the rank's 1/tp of it is kept and gathered again in backward. Without TP the sum is
    6h + 2kv + 3ffn elements per token (measured: tests/test_sp_regather.py). Without sequence
    parallelism (`sp`) the norm inputs are whole on every TP rank and their outputs feed the linears
    as they are (nothing to re-gather). `stream`: bytes per element of the residual stream, which the
    norms keep, where it differs from the compute precision (fp32 under autocast: the embedding and
    the residual adds stay fp32, only the matmuls' outputs are bf16; the norms cast their outputs to
    bf16 once, hpctrain.models.llama.RMSNorm, so the linears reading one share it).

    `modules` (parallel.ac_modules, hpctrain.parallel.activation) drop, per token: attention the
    attention output (h / tp; its log-sum-exp, heads x 4 bytes, was never counted), mlp the SwiGLU
    product (ffn / tp), norm the two norm outputs the linears read (the gathered term). (moe_act and moe
    act on an MoE layer's experts: plan.moe.expert_activation_bytes.)
    """
    kv = m.n_kv_heads * head_dim(m)
    pb = BYTES[precision]  # (an MoE layer's feed-forward: plan.moe.expert_activation_bytes)
    gathered = 0.0 if "norm" in modules else 2 * m.dim / (tp if (regather and sp) else 1)
    norm_inputs = 2 * m.dim / (tp if sp else 1)
    attention_out = 0.0 if "attention" in modules else m.dim
    ffn = (2 if "mlp" in modules else 3) * m.ffn_dim
    per_token = (gathered + ((m.dim + 2 * kv) + attention_out + ffn) / tp) * pb + norm_inputs * (stream or pb)
    return tokens * per_token


def layer_input_bytes(m: ModelConfig, tokens: int, tp: int, precision: str, sp: bool = True, stream: int = 0) -> float:
    """A checkpointed block keeps only its input: the residual stream, sequence-parallel with TP."""
    return tokens * m.dim / (tp if sp else 1) * (stream or BYTES[precision])


def stream_bytes(job: "Job") -> int:
    """Bytes per element of a parameter outside FSDP, and so of its gradient and of the residual stream
    the embedding starts (what crosses a pipeline boundary): fp32 under autocast, whose parameters are
    fp32; else the compute precision."""
    return 4 if job.autocast else BYTES[job.spec.precision]


def in_flight(schedule: str, pp: int, m: int, v: int, stage: int = 0) -> float:
    """The most micro-batches whose activations stage `stage` holds at once, in units of its layers.

    GPipe runs every forward first (m). 1F1B holds pp - stage on stage s, so the first stage is the
    worst. Interleaving raises that by (1 + (pp-1)/(pp v)) (Korthikanti et al. 2022, sec. 4.2.3).
    The zero-bubble family keeps 1F1B's peak (ZB-H1 by design; ZBV/DualPipeV hold ~pp chunk pairs).
    Whether they are all alive together with the gradients is in_flight_with_grads.
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    held = float(min(m, pp - stage))
    if schedule == "interleaved_1f1b" and v > 1:
        held *= 1 + (pp - 1) / (pp * max(1, v))
    elif schedule in ("zbv", "dualpipev"):
        held = float(min(m, pp))
    return held


def in_flight_with_grads(schedule: str, pp: int, m: int, v: int, stage: int = 0) -> float:
    """Micro-batches whose activations stage `stage` still holds once its gradients exist.

    The trainer sets gradients to None after every optimizer step (zero_grad(set_to_none=True)), so
    they come into existence during the stage's first backward, which frees the activations of the
    micro-batch it runs as it goes. The in_flight micro-batches and the gradients are therefore alive
    together only if a forward runs after that first backward:

    - no pipeline: the trainer runs forward and backward per micro-batch, so the second micro-batch's
      forward runs with the first one's gradients: 1 if m > 1, else 0 (the one backward frees the
      activations as it fills the gradients).
    - 1F1B (torch's Schedule1F1B): stage s warms up with w = min(m, pp - s) forwards, then alternates
      one backward, one forward. If m > w the forward after the first backward brings the count back
      to w, with gradients; if m == w (every forward of the step is in the warm-up, e.g. stage 0 at
      m == pp) only w - 1 are left when the first backward ends.
    - GPipe: every forward, then every backward: m - 1.
    - the interleaved, zero-bubble and V schedules: as many as in_flight (their steady state, with
      gradients, reaches the warm-up's count unless m is tiny; a conservative bound).
    """
    held = in_flight(schedule, pp, m, v, stage)
    if pp == 1:
        return 1.0 if m > 1 else 0.0
    if schedule == "gpipe":
        return float(m - 1)
    if schedule == "1f1b":
        return held if m > held else held - 1
    return held


def checkpointed_layers(ac: str, layers: int, every: int) -> int:
    if ac == "full":
        return layers
    if ac == "selective":
        return layers // max(1, every)
    return 0


def activations(job: Job, stage: int) -> dict:
    """Activation bytes of stage `stage` at their most (in_flight micro-batches): saved tensors of the
    in-flight micro-batches, the one block being recomputed, and the output layer's inputs on the last
    stage. Whether all of them are alive together with the gradients is decided in stage_memory."""
    m, lay, pr = job.model, job.spec.layout, job.spec.precision
    tokens = job.tokens
    layers = job.stage_layers(stage)
    regather, sp, stream = job.spec.sp_regather, job.sequence_parallel, stream_bytes(job)
    mods = job.spec.ac_modules  # (in the blocks not checkpointed whole)
    full = layer_activation_bytes(m, tokens, lay.tp, pr, regather, sp, stream)
    dense = layer_activation_bytes(m, tokens, lay.tp, pr, regather, sp, stream, mods)
    ckpt = checkpointed_layers(job.spec.ac, layers, job.spec.ac_every)
    n_moe = stage_moe_layers(job, stage)
    rerun = 0.0  # what a recomputed module holds again while its backward runs (output-discarding: a tensor)
    if n_moe:  # MoE blocks save their experts' rows instead of a SwiGLU's (mean over the stage's blocks)
        swap = expert_activation_bytes(job, tokens, BYTES[pr]) - tokens * dense_ffn_activation(job, BYTES[pr])
        moe_full = full + swap
        attention_half = layer_activation_bytes(m, tokens, lay.tp, pr, regather, sp, stream,
                                                tuple(x for x in mods if x != "mlp")) - tokens * dense_ffn_activation(job, BYTES[pr])
        moe_kept = attention_half + expert_activation_bytes(job, tokens, BYTES[pr], mods)
        layer = ((layers - n_moe) * dense + n_moe * moe_kept) / layers
        if "moe" in mods:  # the layer's experts' activations again, while its backward runs
            rerun = expert_activation_bytes(job, tokens, BYTES[pr])
        full = max(full, moe_full) if n_moe < layers else moe_full
    else:
        layer = dense
    per_mb = ckpt * layer_input_bytes(m, tokens, lay.tp, pr, sp, stream) + (layers - ckpt) * layer
    if job.last(stage):  # final norm input (sequence-parallel) and, under train.loss=full, the gathered
        # output-layer input (the chunked loss keeps none: its gradients are made in the forward, loss_buffers)
        head_input = 0.0 if job.spec.loss == "chunked" else (1 / lay.tp if regather and sp else 1) * BYTES[pr]
        per_mb += tokens * m.dim * ((1 / lay.tp if sp else 1) * stream + head_input)
    held = in_flight(job.spec.schedule, lay.pp, job.microbatches, job.spec.virtual_stages, stage)
    return {"activations": held * per_mb, "recompute": max(full if ckpt else 0.0, rerun)}


# ---------------------------------------------------------------------------------------------
# Per rank totals


@dataclass
class Memory:
    stage: int  # the pipeline stage whose ranks need the most device memory
    device: dict  # bytes by kind on one rank of that stage
    host_per_rank: dict
    nvme_per_rank: float
    ranks_per_node: int
    device_limit: float
    host_limit: float
    nvme_limit: float
    problems: list = field(default_factory=list)

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_per_node(self) -> float:
        return sum(self.host_per_rank.values()) * self.ranks_per_node

    @property
    def nvme_per_node(self) -> float:
        return self.nvme_per_rank * self.ranks_per_node

    @property
    def fits(self) -> bool:
        return not self.problems


def reduce_bytes(job: Job) -> int:
    """Bytes of a gradient element as it is reduced, and as FSDP2 accumulates it unsharded between
    reductions: train.reduce_precision's dtype (spec.dtypes.reduce)."""
    return 2 if job.spec.dtypes.reduce == "bfloat16" else GRAD_BYTES


def transients(job: Job, sp: StageParams) -> dict:
    """Buffers that live for part of a step on top of state and saved activations."""
    m, lay = job.model, job.spec.layout
    pb = BYTES[job.spec.precision]
    out = {}
    if job.spec.zero == 2 and job.zero_group > 1 and not job.params_on_host:
        # FSDP2 without resharding after forward: the gathered parameters (the model state's
        # "params") live from the forward to the end of the backward next to the rank's own shard.
        out["param_shards"] = pb * sp.total / job.zero_group
    if job.spec.zero >= 3 and job.zero_group > 1 and not job.spec.sharding.reshard_after_forward:
        # Under pipelining ZeRO-3 does not reshard after forward (hpctrain.core.spec.sharding): a block
        # gathered for a micro-batch's forward stays gathered until its backward, and a stage runs
        # every block's forward before its first backward, so the whole stage is gathered at the peak.
        out["gathered_params"] = pb * sp.total
        out["fsdp_buffers"] = sp.largest_unit * reduce_bytes(job)
    elif job.spec.zero >= 3 and job.zero_group > 1:
        # FSDP all-gathers the current unit and prefetches the next one, and reduce-scatters a
        # unit's gradient in fp32 (the largest unit, often the vocabulary-sized output layer).
        out["fsdp_buffers"] = sp.largest_unit * (2 * pb + reduce_bytes(job) * trained_share(job, sp))
    elif job.spec.zero == 2 and job.zero_group > 1:  # reduce-scatters a unit's gradient (fp32 by default)
        out["reduce_buffers"] = sp.largest_unit * reduce_bytes(job)
    if job.spec.data_parallel in ("replicate", "replicate_zero1"):
        # FSDP2's replicate (ZeRO-0/1 with TP or PP) all-reduces each block's gradient in one fp32
        # buffer as the backward passes it: no persistent buckets.
        out["reduce_buffers"] = sp.largest_unit * reduce_bytes(job)
    elif job.spec.zero <= 1 and lay.dp > 1:
        # DDP's reducer (ZeRO-0, and ZeRO-1's ZeroRedundancyOptimizer over DDP) allocates one flat
        # bucket per ~25 MiB of gradients for *every* gradient, kept for the model's lifetime
        # (gradient_as_bucket_view=False): a second copy of the gradients, in their dtype.
        out["ddp_buckets"] = stream_bytes(job) * sp.trained(job)  # in the gradients' dtype
    if job.spec.lora and job.spec.lora.quantize == "nf4":
        # QLoRA dequantises an NF4 weight into a full-precision temporary for its product, in the forward
        # and again in the backward (hpctrain.models.lora.NF4Base): the largest adapted linear's, one at a
        # time, beside torchao's int64 codes of half its weights while it is made (get_original_weight).
        largest = max((i * o for i, o, _ in lora_linears(m, lay.tp)), default=0.0)
        out["dequantised"] = largest * (pb + 8)
    if job.autocast and not job.spec.lora:  # (LoRA's frozen weights are kept in bf16: nothing to cast)
        # autocast casts each fp32 weight a matmul reads to bf16 once per autocast region (its weight
        # cache) and the matmul saves that copy for backward: every linear weight of the stage
        # (the embedding is a lookup, not cast), alive from the forward to the end of the backward.
        linear = sp.layers * (param_counts(m)["per_block"] - 2 * m.dim) / lay.tp
        if job.last(sp.stage):
            linear += m.vocab_size * m.dim / lay.tp
        out["weight_casts"] = pb * linear
    if job.last(sp.stage):
        out.update(loss_buffers(job))
    if lay.cp > 1:  # K/V of the other cp ranks while a layer attends (hpctrain.plan.context)
        out["cp_kv"] = gathered_kv_bytes(job, pb)
    return out


def loss_chunk(job: Job) -> int:
    """Tokens the output layer and the loss take at a time on the last stage: train.loss=chunked's chunk
    (hpctrain.core.shape.loss_chunk_tokens over the rank's tokens, which under TP the head all-gathers
    whole, and its 1/tp of the vocabulary), or the whole micro-batch under train.loss=full."""
    tokens = int(job.tokens)
    if job.spec.loss != "chunked":
        return tokens
    return loss_chunk_tokens(tokens, -(-job.model.vocab_size // job.spec.layout.tp), job.model.dim,
                             job.spec.loss_chunk)


def loss_buffers(job: Job) -> dict:
    """The output layer's and the loss's buffers on the last stage, from the head's forward to its
    backward. Logits: the matmul's output in the compute dtype, its fp32 copy for the loss and the fp32
    softmax gradient (vocab-parallel with TP), for the whole micro-batch under train.loss=full (at 128k
    vocabulary this rivals a block's weights) or one chunk at a time under train.loss=chunked
    (hpctrain.models.loss: each chunk's gradient is made in the forward, Liger's algorithm, and its logits
    dropped). The chunked loss then holds, until the head's backward, the gradient of the head's input
    (tokens x dim, compute dtype) and the fp32 accumulator of the output weight's gradient (V/tp x dim)."""
    m, tp = job.model, job.spec.layout.tp
    pb = BYTES[job.spec.precision]
    if job.spec.loss != "chunked":
        return {"logits": job.tokens * m.vocab_size / tp * (pb + 4 + 4)}
    # A chunk's logits are one fp32 buffer, turned into its softmax and its gradient in place; in 16 bits
    # also the matmul's output and the gradient cast back (2 pb), and the weight gradient's 16-bit GEMM with
    # its fp32 copy made a slice of the vocabulary at a time within half a chunk ((pb + 4) / 2).
    per = 4 if pb == 4 else 4 + 2 * pb + (pb + 4) / 2
    weight = 0.0 if job.spec.lora else m.vocab_size / tp * m.dim * GRAD_BYTES  # LoRA: the output is frozen
    return {"logits": loss_chunk(job) * m.vocab_size / tp * per, "loss_grads": job.tokens * m.dim * pb + weight}


def pipeline_buffers(job: Job, stage: int) -> float:
    """torch.distributed.pipelining's receive buffers on pipeline rank `stage`. A PipelineStage
    allocates, at its first step, one buffer per micro-batch for its input (every stage but the first)
    and one per micro-batch for its output's gradient (every stage but the last), and keeps them for
    the life of the schedule (PipelineStage._setup_forward_recv_info, _create_grad_recv_info): each
    is the sequence-parallel residual stream of one micro-batch. A received input of an in-flight
    micro-batch is also its first block's saved input (counted in activations); the rest are extra.
    At Llama 3 405B's published layout (32 micro-batches of 8K tokens, TP 8) that is 32 MiB per
    buffer, 2 GiB per stage. Megatron's receives are allocated per transfer and freed after use."""
    p = job.spec.pipeline
    if p is None or job.engine != "hpctrain":
        return 0.0
    inputs = sum(1 for s in p.stage_ids(stage) if s != 0)
    saved = min(in_flight(job.spec.schedule, job.spec.layout.pp, job.microbatches, job.spec.virtual_stages, stage) * inputs,
                inputs * job.microbatches)
    return boundary_bytes(job) * (pipeline_receives(job, stage) - saved)


def pipeline_receives(job: Job, stage: int) -> int:
    """How many receive buffers torch's pipeline stages of rank `stage` keep (pipeline_buffers)."""
    p = job.spec.pipeline
    if p is None:
        return 0
    ids = p.stage_ids(stage)
    return job.microbatches * (sum(1 for s in ids if s != 0) + sum(1 for s in ids if s != p.stages - 1))


def boundary_bytes(job: Job) -> float:
    """What crosses a pipeline boundary per micro-batch: the residual stream, sequence-parallel."""
    tp = job.spec.layout.tp if job.sequence_parallel else 1
    return job.tokens * job.model.dim / tp * stream_bytes(job)


def accumulation_transient(job: Job, sp: StageParams, per_microbatch: float) -> float:
    """A weight's second gradient during gradient accumulation outside FSDP (plain and DDP data
    parallel, ZeRO-1 by ZeroRedundancyOptimizer, TP and PP without FSDP): autograd's AccumulateGrad
    takes the first micro-batch's gradient as .grad, then for each later one the backward makes the
    gradient afresh and adds it in place, so for a moment the weight has two. The output layer's comes
    first in a backward, with the micro-batch's activations (`per_microbatch`) and logits alive, then
    the blocks'; the input embedding's comes last, once that micro-batch's activations are freed, and
    under TP it arrives replicated, the whole vocab x dim, and adding it to the vocabulary-parallel .grad
    first copies out this rank's shard (DTensor's Replicate -> Shard), beside it (hpctrain.parallel.tensor.
    keep_grads_like_params lays it out like the parameter afterwards; found with torch.profiler's allocation
    events at the first stage's peak of TP 2 x PP 2, fp32 and bf16 alike). FSDP2 (ZeRO-2/3, replicate)
    reduces or accumulates a unit's gradient in its own buffers (transients); Megatron accumulates in
    the wgrad GEMM itself."""
    if (job.engine != "hpctrain" or job.microbatches == 1 or job.spec.data_parallel not in ("ddp", "zero1")
            or job.spec.lora):  # frozen weights get no gradient; an adapter's second one is negligible
        return 0.0
    m, tp = job.model, job.spec.layout.tp
    largest = m.dim * max(m.ffn_dim, m.n_heads * head_dim(m)) / tp if sp.layers else 0.0
    if job.last(sp.stage):
        largest = max(largest, m.vocab_size * m.dim / tp)
    grad = stream_bytes(job)
    copies = 1 + 1 / tp if tp > 1 else 1  # the replicated one, and under TP its shard copied out beside it
    embedding = grad * m.vocab_size * m.dim * copies if job.first(sp.stage) else 0.0
    return max(grad * largest, embedding - per_microbatch)


def all_reduce_buffers(job: Job, sp: StageParams) -> float:
    """FSDP2 with a data-parallel all-reduce (HSDP's replicas, replicate's ZeRO-0/1 with TP or PP)
    keeps each unit's reduced fp32 gradient buffer from its all-reduce until the backward ends
    (FSDPParamGroup._all_reduce_state; held across layers so that the next unit's reduce-scatter cannot
    reuse it while the all-reduce runs: pytorch#140044). The first micro-batch's buffers become the
    gradients themselves; after that they come beside them: one more fp32 gradient of the stage, of
    the shard's size. Reducing once per step (parallel.grad_sync=step) the one reduction's buffers
    become the gradients."""
    fsdp_all_reduce = (job.spec.zero >= 2 and job.spec.layout.dp_replicate > 1
                       or job.spec.data_parallel in ("replicate", "replicate_zero1"))
    if (job.engine != "hpctrain" or not fsdp_all_reduce or job.microbatches == 1 or job.params_on_host
            or job.spec.grad_sync != "microbatch"):
        return 0.0
    return reduce_bytes(job) * sp.trained(job) / max(1, job.zero_group)


def cast_weight_grads(job: Job, extra: dict) -> float:
    """Under autocast with pipelining the weight casts are made once per step (the autocast region is
    the schedule's step) and shared by every micro-batch. Autograd runs a node when it is ready, latest
    made first: in a later micro-batch's backward the shared casts' ToCopyBackward nodes, made in the
    first micro-batch's forward, come after every other node, so each linear's bf16 weight gradient
    waits in its cast's input buffer until that backward ends: one more bf16 copy of the stage's
    linear weights. (Found by live-tensor accounting at the first stage's peak, made by aten.mm in
    backward; without pipelining each micro-batch makes its own casts in order.)"""
    if not (job.autocast and job.spec.pipeline is not None and job.microbatches > 1):
        return 0.0
    return extra.get("weight_casts", 0.0)


def accumulated_grads(job: Job, sp: StageParams) -> float:
    """ZeRO-2/3 reducing once per step (parallel.grad_sync=step, and always under pipelining): FSDP2
    accumulates each micro-batch's gradient unsharded, in the reduce dtype (fp32), until the step's last
    backward reduce-scatters it (torch's FSDPParam.unsharded_accumulated_grad): the whole stage's
    gradients, unsharded, from the first backward to the end of the last. FSDP2's replicate (ZeRO-0/1
    with TP or PP) accumulates the same way, and its all-reduce writes each gradient anew beside it."""
    replicate = job.spec.data_parallel in ("replicate", "replicate_zero1")
    if not (job.spec.zero >= 2 and job.zero_group > 1 or replicate) or job.microbatches == 1 or job.params_on_host:
        return 0.0
    return reduce_bytes(job) * sp.trained(job) if job.spec.grad_sync == "step" else 0.0


def trained_share(job: Job, sp: StageParams) -> float:
    return sp.trained(job) / sp.total if sp.total else 1.0


def lora_state(job: Job, sp: StageParams) -> tuple[dict, dict]:
    """Model state under LoRA: the adapters' as model_state prices any trained parameters, and the
    frozen weights alone (no gradient, master copy or moments), kept in the compute dtype
    (hpctrain.models.lora.store_frozen_as) and sharded by ZeRO-3 (routed experts over their own group)."""
    dev, off = model_state(sp.adapters, job.spec.precision, job.spec.zero, job.zero_group, job.spec.offload,
                           job.params_on_host, job.autocast)
    frozen_bytes = BYTES[job.spec.precision]
    shard = job.zero_group if job.spec.zero >= 3 else 1
    eshard = expert_zero_group(job) if job.spec.zero >= 3 else 1
    nf4 = nf4_weights(job, sp)  # QLoRA: the adapted layers' frozen weights at NF4's size instead
    frozen = (sp.total - sp.adapters - sp.experts - nf4) / max(1, shard) + sp.experts / max(1, eshard)
    if job.params_on_host:  # FSDP2's CPU offload: the shards on the host, gathered on the device
        off["params_frozen"] = frozen_bytes * frozen
        frozen = 0.0 if job.spec.zero >= 3 else sp.total - sp.adapters
    dev["params"] = dev.get("params", 0.0) + frozen_bytes * frozen
    if nf4:
        dev["nf4_base"] = nf4_bytes_per_weight(frozen_bytes) * nf4 / max(1, shard)
    return dev, off


def nf4_weights(job: Job, sp: StageParams) -> float:
    """Weights of the adapted linear layers one rank of the stage holds after TP, before ZeRO, when
    model.lora.quantize=nf4 stores them in NF4 (hpctrain.parallel.quantize); else 0."""
    if not (job.spec.lora and job.spec.lora.quantize == "nf4"):
        return 0.0
    return sum(i * o * n for i, o, n in lora_linears(job.model, job.spec.layout.tp)) * sp.layers / job.model.n_layers


def nf4_bytes_per_weight(scale_bytes: float) -> float:
    """Bytes of torchao's NF4Tensor per weight (torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py,
    torchao 0.18, to_nf4's defaults): quantized_data, two 4-bit codes a uint8 (0.5); quantized_scalers, one
    int8 absmax scale per block of 64 weights (1/64); quantization_factor, one factor in the weight's dtype
    (`scale_bytes`) per 256 scales (per 16,384 weights). Per tensor it also keeps the scales' mean and a
    16-entry table: a few bytes, left out. bf16: 0.51575 byte per weight."""
    return 0.5 + 1 / 64 + scale_bytes / (64 * 256)


def stage_memory(job: Job, stage: int) -> tuple[dict, dict, float]:
    """(device bytes by kind, host bytes by kind, NVMe bytes) for one rank of `stage`."""
    lay = job.spec.layout
    sp = stage_params(job, stage)
    if job.spec.lora:
        dev, off = lora_state(job, sp)
    else:
        dev, off = model_state(sp.total - sp.experts, job.spec.precision, job.spec.zero, job.zero_group,
                               job.spec.offload, job.params_on_host, job.autocast)
    if sp.experts and not job.spec.lora:  # routed experts: sharded over what expert parallel leaves of the data-parallel ranks
        e_dev, e_off = model_state(sp.experts, job.spec.precision, job.spec.zero, expert_zero_group(job),
                                   job.spec.offload, job.params_on_host, job.autocast)
        dev = {k: dev.get(k, 0.0) + e_dev.get(k, 0.0) for k in {**dev, **e_dev}}
        off = {k: off.get(k, 0.0) + e_off.get(k, 0.0) for k in {**off, **e_off}}
    if job.spec.dpo_reference == "copy":  # dpo: a second set of the starting weights, built and sharded as the
        # policy's parameters are (the same parallelize), frozen: no gradient, master copy or moments. Stored as
        # the policy stores its own: fp32 (its own master under mixed precision: FSDP2 casts only what it
        # gathers, autocast only what it multiplies), sharded by ZeRO-3, on the host under FSDP2's CPU offload;
        # under LoRA the frozen base in the compute dtype beside the adapters.
        if job.spec.lora:
            ref_dev, ref_off = dev.get("params", 0.0), off.get("params_frozen", 0.0)
        else:
            ref = 4.0 * (sp.total - sp.experts) / (max(1, job.zero_group) if job.spec.zero >= 3 else 1)
            ref_dev, ref_off = (0.0, ref) if job.params_on_host else (ref, 0.0)
        if ref_dev:
            dev["reference"] = ref_dev
        if ref_off:
            off["reference"] = ref_off
    acts = activations(job, stage)
    extra = transients(job, sp)
    # Two candidate peaks, whichever is higher: the end of the warm-up (every in-flight micro-batch,
    # the last one's logits, no gradients yet: they are None between steps) and the rest of the step
    # (the gradients with the micro-batches still or again in flight, logits if a forward runs then).
    held = in_flight(job.spec.schedule, lay.pp, job.microbatches, job.spec.virtual_stages, stage)
    held_g = in_flight_with_grads(job.spec.schedule, lay.pp, job.microbatches, job.spec.virtual_stages, stage)
    # the head's buffers (loss_buffers) live in one window: from its forward to its backward
    head = {k: extra.pop(k) for k in ("logits", "loss_grads") if k in extra}
    if "loss_grads" in head:  # each micro-batch's head forward keeps its own until its backward (GPipe: all m)
        head["loss_grads"] *= max(1.0, held)
    logits = sum(head.values())
    accum = accumulated_grads(job, sp)
    if accum and job.spec.zero >= 2:  # the sharded gradients appear as the unsharded ones are reduced and freed
        dev["grads"] = 0.0
    second = accumulation_transient(job, sp, acts["activations"] / held)
    # A third: the end of a backward that follows another, with every unit's all-reduce buffer beside
    # the gradients under FSDP2's data-parallel all-reduces (HSDP, replicate; all_reduce_buffers) and,
    # under autocast with pipelining, every linear's bf16 weight gradient (cast_weight_grads).
    held_ar = all_reduce_buffers(job, sp)
    cast_grads = cast_weight_grads(job, extra)
    before = acts["activations"] + logits
    after = (dev["grads"] + accum + second + acts["activations"] * held_g / held
             + (logits if held_g >= 1 else 0.0))
    # The first stage's backward ends in the embedding's, whose fresh gradient comes beside .grad there.
    end_second = accumulation_transient(job, sp, 0.0) if job.first(stage) and lay.pp > 1 else 0.0
    end = (dev["grads"] + accum + held_ar + cast_grads + end_second
           + acts["activations"] * max(0.0, held_g - 1) / held)
    if before > max(after, end):
        dev["grads"], accum, second, held_ar, cast_grads = 0.0, 0.0, 0.0, 0.0, 0.0
    elif end > after:
        acts["activations"] *= max(0.0, held_g - 1) / held
        logits, second = 0.0, end_second
    else:
        acts["activations"] *= held_g / held
        logits = logits if held_g >= 1 else 0.0
        held_ar, cast_grads = 0.0, 0.0
    dev = {k: v for k, v in dev.items() if v}
    dev.update({k: v for k, v in acts.items() if v})
    if logits:  # as loss_buffers named them
        dev.update({k: v for k, v in head.items() if v})
    if accum:
        dev["unsharded_grads"] = accum
    if second:
        dev["second_grad"] = second
    if held_ar:
        dev["all_reduce_buffers"] = held_ar
    if cast_grads:
        dev["cast_grads"] = cast_grads
    buffers = pipeline_buffers(job, stage)
    if buffers:
        dev["pipeline_buffers"] = buffers
    dev.update(extra)
    persistent = ("params", "grads", "master", "moments", "param_shards", "ddp_buckets", "unsharded_grads",
                  "pipeline_buffers")
    churn = sum(v for k, v in dev.items() if k not in persistent)
    dev["fragmentation"] = FRAGMENTATION * churn
    dev["runtime_reserve"] = job.cluster.runtime_reserve_gb * GiB
    if job.cluster.device == "cpu" and (lay.tp > 1 or job.spec.zero >= 2):
        dev["dtensor_runtime"] = float(DTENSOR_RUNTIME_BYTES)
    host = {"process": float(HOST_BASE_BYTES[str(job.cluster.device)])}
    nvme = 0.0
    off = {k: v for k, v in off.items() if v}
    if job.spec.offload == "cpu":
        host.update(off)
    elif job.spec.offload == "nvme":
        nvme = off.pop("master", 0.0) + off.pop("moments")
        host.update(off)
        # Swap-in and swap-out buffers for one unit's optimizer state (double buffering).
        host["swap_buffers"] = 2 * 12 * sp.largest_unit / max(1, job.zero_group)
    if job.async_checkpoint:  # async checkpoints stage this rank's whole state in host memory first
        # (the adapters' alone where the checkpoint leaves the frozen base out: checkpoint.weights=adapters)
        saved = sp.adapters if job.spec.checkpoint_weights == "adapters" else sp.total
        state = dict(model_state(saved, job.spec.precision, job.spec.zero, job.zero_group, "none",
                                 autocast=job.autocast)[0])
        host["checkpoint_staging"] = state["params"] + state["master"] + state["moments"]
    return dev, host, nvme


def pipeline_ranks(job: Job) -> list[int]:
    """The pipeline ranks that can need the most memory: the first of each distinct (blocks, holds the
    embedding, holds the output layer), since a later rank never holds more micro-batches (in_flight),
    and always the first, the second and the last. An uneven split (parallel.pp_layers) can make a
    middle rank the heaviest."""
    p = job.spec.pipeline
    if p is None:
        return [0]
    first: dict = {}
    for r, shape in enumerate(p.rank_shapes):
        first.setdefault(shape, r)
    return sorted(set(first.values()) | {0, 1, p.ranks - 1})


def memory(job: Job) -> Memory:
    """Memory of the worst pipeline stage, with the problems that keep it from fitting."""
    worst = max(((s,) + stage_memory(job, s) for s in pipeline_ranks(job)), key=lambda x: sum(x[1].values()))
    stage, dev, host, nvme = worst
    c = job.cluster
    mem = Memory(stage=stage, device=dev, host_per_rank=host, nvme_per_rank=nvme,
                 ranks_per_node=ranks_per_node(c), device_limit=c.device_mem_gb * GiB,
                 host_limit=c.host_mem_gb * GiB, nvme_limit=c.nvme_gb * GiB)
    mem.problems = memory_problems(job, mem)
    return mem


def memory_problems(job: Job, mem: Memory) -> list[str]:
    out = []
    if mem.device_total > mem.device_limit:
        big = max((k for k in mem.device if k != "runtime_reserve"), key=mem.device.get)
        out.append(f"device memory: {gib(mem.device_total)} per rank (stage {mem.stage}) > "
                   f"{gib(mem.device_limit)} (cluster.device_mem_gb); largest part {big} "
                   f"{gib(mem.device[big])}. {_memory_fix(job, big)}")
    if mem.host_per_node > mem.host_limit:
        out.append(f"host memory: {gib(mem.host_per_node)} per node > {gib(mem.host_limit)} "
                   f"(cluster.host_mem_gb). Fix: offload.target=nvme or more ranks to shard over")
    if job.spec.offload == "nvme" and not mem.nvme_limit:
        out.append("NVMe: this cluster has none for offloaded state (cluster.nvme_gb=0). Fix: offload.target=cpu")
    elif job.spec.offload == "nvme" and mem.nvme_per_node > mem.nvme_limit:
        out.append(f"NVMe: {gib(mem.nvme_per_node)} per node > {gib(mem.nvme_limit)} (cluster.nvme_gb). "
                   "Fix: offload.target=cpu or more nodes")
    return out


def _memory_fix(job: Job, big: str) -> str:
    if big == "pipeline_buffers":  # one per micro-batch, per direction, per stage a rank runs
        fixes = ["fewer micro-batches a step (a larger train.micro_batch or a smaller train.global_batch)"]
        if job.spec.virtual_stages > 1:
            fixes.append("fewer parallel.pp_virtual_stages")
        return "Fix: " + ", ".join(fixes + ["more parallel.tp"])
    if big in ("weight_casts", "cast_grads"):  # autocast's bf16 copies of fp32 weights; FSDP2 gathers bf16 unit by unit
        return "Fix: parallel.zero=3 (FSDP2 keeps no bf16 copy of the whole stage) or more parallel.tp/pp"
    if big in ("activations", "recompute", "logits", "loss_grads"):
        fixes = []
        if big == "logits" and job.spec.loss != "chunked":
            fixes.append("train.loss=chunked")
        if job.spec.ac != "full":
            fixes.append("parallel.ac=full")
        if job.spec.micro_batch > 1:
            fixes.append("a smaller train.micro_batch")
        fixes.append("more parallel.tp or parallel.pp")
        return "Fix: " + ", ".join(fixes)
    if job.spec.zero < 3:
        return f"Fix: parallel.zero={job.spec.zero + 1} or more data-parallel ranks"
    if job.spec.offload == "none":
        return "Fix: offload.target=cpu, more ranks, or more parallel.tp/pp"
    return "Fix: more ranks, or more parallel.tp/pp"


def gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB" if x >= GiB / 10 else f"{x / 2**20:.1f} MiB"

