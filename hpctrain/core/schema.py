"""Typed configuration: the schema Hydra composes `conf/` against.

Every field here is a knob a user can set on the command line (`train.steps=10`). The dataclasses are
registered in Hydra's ConfigStore as the schema of each group (hpctrain.core.compose.register), so an
unknown key or a wrong type is refused while composing, before any process starts. Checks that span
several fields live in `hpctrain.checks.config_checks`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class Choice(str, Enum):
    """A knob with a fixed set of values. OmegaConf refuses any other value while composing, with the
    allowed list; members compare equal to their strings and print as them (`f"{x}"` is "bf16")."""

    # the member's own characters, which are its value (str's, not Enum's: the planner calls it ~10^5 times)
    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


def _choice(name: str, values: str) -> type:
    # Members named after their values: a value such as "1f1b" is not an identifier.
    return Choice(name, [(v, v) for v in values.split()])


AC = _choice("AC", "none full selective")
GradSync = _choice("GradSync", "auto step microbatch")
PipelineSchedule = _choice("PipelineSchedule", "gpipe 1f1b interleaved_1f1b zero_bubble zbv dualpipev")
OptimImpl = _choice("OptimImpl", "auto fused foreach for_loop")
OptimName = _choice("OptimName", "adamw")
DataSource = _choice("DataSource", "synthetic shards")
Precision = _choice("Precision", "fp32 bf16 fp16 fp8")
ReducePrecision = _choice("ReducePrecision", "fp32 bf16")
Fp8Recipe = _choice("Fp8Recipe", "tensorwise rowwise rowwise_with_gw_hp mxfp8")
LossImpl = _choice("LossImpl", "chunked full")
LossKernel = _choice("LossKernel", "auto torch liger")
ACModule = _choice("ACModule", "attention mlp moe_act norm moe")
OffloadTarget = _choice("OffloadTarget", "none cpu nvme")
OffloadKernel = _choice("OffloadKernel", "auto cpp compile fused")
LauncherName = _choice("LauncherName", "local slurm sbatch k8s")
WandbMode = _choice("WandbMode", "offline online disabled")
Backend = _choice("Backend", "auto gloo nccl")
Device = _choice("Device", "cpu cuda")
Router = _choice("Router", "softmax sigmoid")
CPAttention = _choice("CPAttention", "allgather ring")
CPKernel = _choice("CPKernel", "auto torch hpctrain")
NonFinite = _choice("NonFinite", "stop skip")
Objective = _choice("Objective", "lm dpo")
PreferenceLoss = _choice("PreferenceLoss", "sigmoid ipo")
Reference = _choice("Reference", "auto base copy")
BaseQuant = _choice("BaseQuant", "none nf4")
CheckpointWeights = _choice("CheckpointWeights", "auto full adapters")


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (model.moe; docs/moe.md). experts=0: a dense model."""

    experts: int = 0
    """Routed experts in each MoE layer; 0 = no MoE layers (every block has the dense SwiGLU)."""
    top_k: int = 2
    """Routed experts each token goes to (1 <= top_k <= experts)."""
    ffn_dim: int = 0
    """Hidden width of each routed expert's SwiGLU; 0 = model.ffn_dim."""
    shared_experts: int = 0
    """Experts every token goes to (DeepSeek-V3: 1): one SwiGLU of width shared_experts x moe.ffn_dim
    beside the routed ones."""
    every: int = 1
    """Block i (0-based) is an MoE layer when (i + 1) is a multiple of this (Qwen3's
    decoder_sparse_step) and i >= first_dense; other blocks keep the dense SwiGLU of model.ffn_dim."""
    first_dense: int = 0
    """The first this-many blocks stay dense (DeepSeek-V3: 3)."""
    router: Router = Router("softmax")
    """softmax: probabilities over all experts, the top_k kept (Mixtral, Qwen3); sigmoid: an independent
    score per expert (DeepSeek-V3)."""
    norm_topk: bool = True
    """Rescale the top_k weights of each token to sum to 1 (Mixtral; Qwen3's norm_topk_prob; DeepSeek-V3)."""
    route_scale: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    aux_loss_coef: float = 0.0
    """Load-balancing loss (Switch Transformer): coef x experts x sum_e f_e P_e per MoE layer, f_e the
    share of routed slots expert e got (summing to top_k), P_e its mean router probability; summed over
    MoE layers (Megatron-Core's convention), added to the training loss's gradient. transformers pools
    the layers into one loss instead: its router_aux_loss_coef is this x the MoE layers (model=hf and
    the hf export convert; docs/moe.md)."""
    z_loss_coef: float = 0.0
    """Router z-loss (ST-MoE): coef x mean over tokens of logsumexp(router logits)^2, per MoE layer."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores only to pick
    the top_k, moved after each optimizer step by this much towards balance (+rate for experts below the
    mean load of the step, -rate above); 0 = off."""
    capacity_factor: float = 0.0
    """0 = dropless (every routed slot computed). Else each expert takes at most ceil(capacity_factor x
    tokens x top_k / experts) tokens of a micro-batch on a rank, in token order; the rest are dropped
    (their routed output is zero, the residual carries them) and counted in the metrics."""
    grouped_mm: bool = True
    """Compute the experts as one grouped GEMM (torch._grouped_mm); false = a loop over experts (the
    reference). Falls back to the loop where the shapes are not 16-byte aligned."""
    imbalance: float = 1.0
    """Planner: the busiest expert-parallel rank's routed tokens over the mean, from 1.0 (even) to
    experts / top_k (one expert takes every token). A run's metrics give it: expert_share_max is the
    busiest expert's share relative to an even split."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the frozen model (model.lora; docs/finetune.md). rank=0: off, every weight trained."""

    rank: int = 0
    """The adapters' rank r; 0 = no adapters (full training)."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout)."""
    targets: List[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    """The linear layers that get adapters, by hpctrain's names or Hugging Face's (q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj); the experts of MoE layers have none."""
    init_from: Optional[str] = None
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to continue from."""
    quantize: BaseQuant = BaseQuant("none")
    """How the frozen base is stored. none: in the compute precision (bf16 under train.precision=bf16);
    nf4: QLoRA (Dettmers et al. 2023, arXiv:2305.14314): torchao's 4-bit NormalFloat, about 0.5 byte per
    weight plus its scales, dequantised block by block in the forward; the adapters train in
    train.precision."""


@dataclass
class ModelConfig:
    """The Llama model: its shape, RoPE and initialization, or a Hugging Face model to start from
    (the `model` group)."""

    name: str = "tiny"
    """The model's name in summaries and plans. `hf` (model=hf) reads every shape key below from
    model.init_from's config.json while composing."""
    dim: int = 128
    """Hidden (embedding) dimension; divisible by n_heads (unless model.head_dim is set), with an even
    head dimension."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); n_heads must be a multiple of it."""
    ffn_dim: int = 384
    """Hidden dimension of each block's SwiGLU feed-forward layer."""
    vocab_size: int = 256
    """Vocabulary size: rows of the token embedding and of the output layer."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorm layers."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    tie_embeddings: bool = False
    """One matrix for the token embedding and the output layer (Llama 3.2 1B); not with pipeline
    parallel (parallel.pp=1)."""
    init_std: float = 0.02
    """Standard deviation of the truncated-normal initialization of the linear weights (wo and w2, the
    residual-branch outputs: init_std / sqrt(2 n_layers)), and of the embedding when tied (else 1.0)."""
    rope_scaling: float = 0.0
    """Llama 3.1 RoPE scaling: the factor; 0 = off."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 RoPE scaling: the low frequency factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 RoPE scaling: the high frequency factor."""
    rope_original_max_seq_len: int = 8192
    """Llama 3.1 RoPE scaling: the original context length."""
    head_dim: int = 0
    """Width of each attention head; 0 = dim / n_heads (Qwen3 sets it apart from dim)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts layers (experts=0: none)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (rank=0: none): the base weights frozen, only the adapters trained."""
    init_from: Optional[str] = None
    """A Hugging Face Llama directory (config.json + *.safetensors) to start from; its config.json
    must agree with the model keys above (`python -m hpctrain.core.hf_format config DIR` prints them)."""


@dataclass
class ParallelConfig:
    """The layout: data, tensor and pipeline parallel degrees, ZeRO stage, activation checkpointing
    (the `parallel` group: fsdp, ddp, auto)."""

    auto: bool = False
    """parallel=auto: the planner picks every knob below (layout, ZeRO stage, checkpointing, micro-batch)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; >1 needs parallel.zero=2 or 3).
    pp x dp_replicate x dp_shard x cp x tp must equal the world size."""
    dp_shard: int = -1
    """Data-parallel ranks the model state is sharded over (ZeRO); -1 means "the rest": the world
    size over pp x dp_replicate x cp x tp. pp x dp_replicate x dp_shard x cp x tp must equal the world
    size."""
    tp: int = 1
    """Tensor-parallel degree. pp x dp_replicate x dp_shard x cp x tp must equal the world size."""
    pp: int = 1
    """Pipeline-parallel degree. pp x dp_replicate x dp_shard x cp x tp must equal the world size."""
    ep: int = 1
    """Expert-parallel degree (Mixture-of-Experts models): each MoE layer's experts are split over ep of
    the dp_shard ranks, tokens travel to their experts' rank and back by all-to-all; the rest of
    dp_shard (dp_shard / ep ranks, x cp with context parallel) shards each expert's weights as FSDP
    does. Divides dp_shard and model.moe.experts; needs parallel.zero=2 or 3."""
    zero: int = 3
    """ZeRO stage: 0 = DDP (replicated), 1 = optimizer state sharded, 2 = gradients and optimizer
    state sharded, 3 = FSDP2 (parameters, gradients and optimizer state sharded)."""
    ac: AC = AC("none")
    """Activation checkpointing: none | full | selective (every `ac_every`-th block)."""
    ac_every: int = 2
    """With ac=selective: checkpoint every ac_every-th block of each stage, starting with its first."""
    pp_schedule: PipelineSchedule = PipelineSchedule("1f1b")
    """Pipeline schedule. Micro-batches per step come from train.global_batch / data-parallel ranks /
    train.micro_batch."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank for interleaved_1f1b and zero_bubble (at least 2); gpipe and 1f1b
    run one, zbv and dualpipev two."""
    pp_layers: List[int] = field(default_factory=list)
    """Blocks of each pipeline stage in model order, one entry per stage (pp x stages per rank: 2 for
    interleaved_1f1b/zero_bubble with pp_virtual_stages<=2, else pp_virtual_stages; 2 for zbv and
    dualpipev, whose rank r runs stages r and 2pp-1-r), summing to model.n_layers; e.g. [7,8,...,8,7].
    [] = automatic: balances parameters, the embedding and output layer counted on the first and
    last stage (hpctrain.core.spec.split_layers)."""
    grad_sync: GradSync = GradSync("auto")
    """When gradients are reduced under gradient accumulation: every micro-batch (ZeRO-2/3 keep only
    sharded gradients: their memory promise) or once per step (DDP/ZeRO-1; ZeRO-2/3 then accumulate an
    unsharded fp32 gradient, less traffic, more memory). auto: microbatch for ZeRO-2/3, step otherwise
    and with pipelining (torch's pipeline stages sync on the last backward)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, attention computed across them. Each
    rank holds two of the sequence's 2 x cp chunks, an early and a late one (causal attention then costs
    every rank the same), and the RoPE positions of its chunks; the cp ranks see the same samples and
    share the parameter sharding with dp_shard. data.seq_len must be divisible by 2 x cp.
    pp x dp_replicate x dp_shard x cp x tp must equal the world size."""
    cp_attention: CPAttention = CPAttention("allgather")
    """How K and V reach the other cp ranks. allgather: each layer all-gathers them, then attends
    (Llama 3's choice: with grouped-query attention K/V are a small part of the activations, and one
    collective is simple to overlap); ring: they travel round the cp ranks in cp - 1 steps, each step's
    transfer overlapping the attention on the previous chunk, and no rank holds all of them (the memory
    floor for the longest sequences). The planner prices both."""
    cp_kernel: CPKernel = CPKernel("auto")
    """Whose attention runs across the cp ranks. torch: torch's context_parallel ring (its CUDA flash,
    memory-efficient and cuDNN kernels; on CPU the CPU flash kernel through the same ring), causal only,
    no document mask; hpctrain: hpctrain's chunk pairs (any device, with or without data.document_mask);
    auto: torch on CUDA in bf16 without a document mask, hpctrain otherwise."""
    ac_modules: List[ACModule] = field(default_factory=list)
    """Recomputation by module (Megatron's --recompute-modules), in blocks parallel.ac does not checkpoint
    whole: attention (the core attention kernel: its output and log-sum-exp are recomputed, q/k/v kept),
    mlp (the SwiGLU's product inside every dense feed-forward: only the w1 and w3 outputs are kept),
    moe_act (the same inside the experts), norm (the RMSNorms' outputs: recomputed from their inputs, which
    the residual stream keeps anyway), moe (the whole MoE layer, its token dispatch included: only its
    input is kept). [] = none. Not with parallel.ac=full, which already recomputes every block whole."""
    sp_regather: bool = True
    """With tensor parallel: keep 1/tp of each sequence-parallel input the column-parallel linears
    gathered, and all-gather it again in backward (Megatron's way; hpctrain.parallel.regather), instead
    of keeping the gathered tensor for backward: 2 x tokens x dim x (tp-1)/tp fewer elements per block
    and micro-batch, 2 more all-gathers per block in backward. Not under train.compile."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to min_lr_ratio x lr (the `optim` group)."""

    name: OptimName = OptimName("adamw")
    """The optimizer."""
    lr: float = 1e-3
    """Peak learning rate, reached at the end of the warmup."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at min_lr_ratio x lr on the last step; in [0, 1]."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup from lr / warmup_steps to lr."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, on parameters of two or more dimensions (norms get none)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    impl: OptimImpl = OptimImpl("auto")
    """torch's AdamW implementation. auto: fused on CPU and CUDA when every parameter is a plain
    tensor or DTensor of one kind."""


@dataclass
class SourceConfig:
    """One source of a data mixture (data.sources)."""

    path: str = "???"
    """A directory made by `python -m hpctrain.data.prepare`."""
    weight: float = 1.0
    """Relative share of the training stream."""


@dataclass
class DataConfig:
    """Training data: generated, or token shards from `python -m hpctrain.data.prepare` (the `data`
    group: synthetic, shards)."""

    source: DataSource = DataSource("synthetic")
    """synthetic: sequences generated on the fly, no files; shards: data.path or data.sources."""
    path: Optional[str] = None
    """Directory made by `python -m hpctrain.data.prepare` (data.source=shards)."""
    sources: List[SourceConfig] = field(default_factory=list)
    """A mixture instead of one path: data.sources='[{path: A, weight: 3}, {path: B, weight: 1}]'.
    Every source must come from the same tokenizer; validation mixes their val splits alike."""
    seq_len: int = 64
    """Tokens per training sequence."""
    document_mask: bool = False
    """Packed sequences hold several documents, each ending with the end-of-document token: no token
    attends to another document's (Llama 3's mask). The end-of-document id comes from the shards'
    meta.json, or data.eos_id."""
    document_positions: bool = False
    """With document_mask: RoPE positions restart at 0 with each document, as if it were trained alone."""
    eos_id: int = -1
    """The end-of-document token id: -1 takes the shards' (meta.json's eos_id). Synthetic data with
    eos_id set packs documents of synthetic_doc_len tokens on average, each ending with it."""
    synthetic_doc_len: int = 0
    """Synthetic data: the mean document length (lengths drawn from an exponential distribution), 0 =
    one document per sequence and no end-of-document token."""
    seed: int = 1234
    """Seed of the sample order (shuffled anew each epoch), the mixture's draws and the synthetic data."""


@dataclass
class EvalConfig:
    """Validation loss on the data's validation split."""

    every: int = 0
    """Validation loss every N steps and after the last one; 0 = never."""
    batches: int = 4
    """Global batches (train.global_batch sequences each) of the validation split per evaluation."""


@dataclass
class Fp8Config:
    """train.precision=fp8: the blocks' linear layers compute in float8 through torchao (docs/precision.md)."""

    recipe: Fp8Recipe = Fp8Recipe("tensorwise")
    """torchao's scaling recipe: tensorwise (one scale per tensor: the fastest, torchtitan's default),
    rowwise (a scale per row: more accurate, slower), rowwise_with_gw_hp (rowwise, the weight gradient's
    GEMM kept in bf16), mxfp8 (a scale per 32 elements; needs SM100, B200 and later)."""
    all_gather: bool = False
    """FSDP2 all-gathers the float8 weights with scales precomputed after each optimizer step (half the
    bytes of bf16): tensorwise only, parallel.zero=3, NCCL only (gloo has no float8 type)."""


@dataclass
class Fp16Config:
    """train.precision=fp16: dynamic loss scaling (torch.amp.GradScaler), fp32 master weights."""

    init_scale: float = 65536.0
    """The loss scale of the first step (2^16, torch's default)."""
    growth_interval: int = 2000
    """The scale doubles after this many steps in a row without an overflow; an overflow halves it and
    skips the step on every rank."""


@dataclass
class DpoConfig:
    """train.objective=dpo: preference tuning on prompt / chosen / rejected pairs (docs/finetune.md)."""

    loss: PreferenceLoss = PreferenceLoss("sigmoid")
    """sigmoid: DPO (Rafailov et al. 2023, arXiv:2305.18290), -log sigmoid(beta x margin); ipo: IPO
    (Azar et al. 2023, arXiv:2310.12036), (margin - 1 / (2 beta))^2 on log-probabilities averaged per
    completion token (TRL's form)."""
    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta x log(policy / reference)."""
    label_smoothing: float = 0.0
    """sigmoid only: the share of pairs assumed mislabelled (conservative DPO), in [0, 0.5)."""
    reference: Reference = Reference("auto")
    """Where the reference log-probabilities come from. base: the same model with the adapters switched
    off (LoRA only: no second model); copy: a frozen copy of the starting weights, sharded like the
    policy; auto: base under LoRA, else copy."""


@dataclass
class TrainConfig:
    """The training loop: steps, batch sizes, precision."""

    steps: int = 100
    """Optimizer steps to train."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 4
    """Sequences per forward/backward on one rank."""
    seed: int = 0
    """Seed of the initial weights (the same model whatever the layout)."""
    precision: Precision = Precision("fp32")
    """fp32 | bf16 | fp16 | fp8. bf16 keeps fp32 master weights and reduces gradients in fp32
    (train.reduce_precision); fp16 (GPUs without bf16: V100, T4) adds dynamic loss scaling (train.fp16);
    fp8 runs the blocks' linear layers in float8 through torchao (train.fp8) and the rest in bf16. On CPU
    every one runs (fp8 in torchao's emulation)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """train.precision=fp8: the scaling recipe and the float8 all-gather."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """train.precision=fp16: the loss scaler."""
    objective: Objective = Objective("lm")
    """lm: next-token cross-entropy (pretraining, SFT); dpo: preference tuning on pairs from
    `prepare --format preference` (train.dpo), train.global_batch and train.micro_batch counting pairs."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """train.objective=dpo: the loss, beta and the reference."""
    loss: LossImpl = LossImpl("chunked")
    """chunked: the output layer and the cross-entropy computed train.loss_chunk tokens at a time, each
    chunk's gradient made at once and its logits dropped, so the whole logits never exist (as Liger's
    fused linear cross-entropy); full: the whole logits, then the loss (the reference)."""
    loss_kernel: LossKernel = LossKernel("auto")
    """Whose kernel computes train.loss=chunked. torch: hpctrain's (any device; vocabulary-parallel under
    tensor parallel); liger: Liger-Kernel's fused linear cross-entropy (CUDA, Triton; `pip install
    liger-kernel`; not with parallel.tp > 1, whose vocabulary-parallel split it does not know); auto: liger
    on CUDA where it is installed and tp is 1, else torch."""
    loss_chunk: int = 0
    """Tokens per chunk of train.loss=chunked; 0 = enough chunks that one chunk's logits hold about as
    many elements as the micro-batch's hidden states (tokens / ceil(vocab / dim))."""
    z_loss_coef: float = 0.0
    """PaLM's z-loss on the output layer: coef x logsumexp(logits)^2 per trained token, added to the
    loss (keeps the softmax normaliser near 1; PaLM used 1e-4); 0 = off."""
    reduce_precision: ReducePrecision = ReducePrecision("fp32")
    """fp32 | bf16: what FSDP2 (parallel.zero=2 or 3) reduces gradients across data-parallel ranks in.
    fp32 sums exactly; bf16 halves the bytes of every reduce-scatter and all-reduce and of the buffers
    they use (torchtitan's mixed_precision_reduce), each sum rounded to bf16 before the fp32 shard takes
    it. DDP and ZeRO-1 reduce the fp32 gradients autocast leaves: bf16 is refused there."""
    log_every: int = 1
    """Log the step's metrics (metrics.jsonl, the console, trackers) every N steps; the last step and
    steps with a validation loss are always logged."""
    compile: bool = False
    """torch.compile each transformer block."""
    threads: int = 0
    """Torch intra-op threads per rank; 0 = OMP_NUM_THREADS where set, else Slurm's cpus per task, else
    cores / local ranks."""
    on_nonfinite: NonFinite = NonFinite("stop")
    """A step whose loss or gradient norm is not finite (nan, inf; on any rank) never updates the weights
    or the optimizer state. stop: the run ends there, not completed (outcome.json status nonfinite, with
    that step), without a final save, so the newest checkpoint is the last one before it; skip: the step
    is skipped (the data and the learning-rate schedule move on), counted in the progress line, the
    metrics (skipped_steps) and the summary, and training goes on, up to train.max_skipped_steps."""
    max_skipped_steps: int = 10
    """With train.on_nonfinite=skip: the most steps the whole run may skip; the next non-finite step stops
    it as train.on_nonfinite=stop does."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints: when to save, how many to keep, where to resume."""
    every: int = 0
    """Steps between saves (and the last step's); 0 = none but the last step's (checkpoint.final) and a
    preemption's."""
    final: bool = True
    """Save the last step of a completed run, so that there is a model to export; false (with every=0):
    no save but a preemption's, and the run's summary says that nothing was written."""
    keep: int = 3
    """Complete checkpoints kept, newest first."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones to evaluate or branch
    from later), beyond the newest `keep`; 0 = none."""
    # Was `checkpoint.async`, a Python keyword that kept the schema from being a plain dataclass.
    async_save: bool = False
    """Stage to host memory, write in the background (was `checkpoint.async`)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in run.dir."""
    load_step: Optional[int] = None
    """Resume from this step instead of the newest."""
    threads: int = 8
    """Writer threads per rank: one is far from the disk's bandwidth."""
    weights: CheckpointWeights = CheckpointWeights("auto")
    """Which weights a checkpoint holds. full: every weight; adapters (LoRA with model.init_from): the
    adapters only, the frozen base re-read from model.init_from on resume and export, checked against the
    fingerprint of it the checkpoint records (a changed base is refused; a copy elsewhere is accepted);
    auto: adapters under LoRA with model.init_from (and under QLoRA, which needs it), else full. Optimizer
    state, data position and RNG are in both, and a run resumes either kind whatever it saves
    (docs/checkpoints.md)."""
    memory_every: int = 0
    """Steps between in-memory snapshots of every rank's state (0 = off). Each is copied at the step's
    end into a file on the node's tmpfs (checkpoint.memory_dir), checksummed in the background and
    replicated by the node's agent to the next node (the same local rank there); a restart loads the
    newest step every rank has a copy of, its own node's or the replica, and so redoes at most this many
    steps; disk checkpoints go on at checkpoint.every. Turns on the node agents and the in-process
    restart of surviving ranks (launcher local, slurm, sbatch; docs/recovery.md)."""
    memory_dir: str = "/dev/shm"
    """A tmpfs on every node where snapshots live (<memory_dir>/hpctrain-<job>-<run id>-<node>/); a directory on
    another file system is refused (the login node checks it for launcher=local, each node agent on its node)."""
    memory_budget: float = 0.25
    """Fraction of cluster.host_mem_gb the snapshots may take on a node (ranks per node x state x 5:
    two steps of its own, two of the partner's replica, one being written); above it the login node
    refuses, with the numbers."""


@dataclass
class OffloadConfig:
    """Optimizer state in host memory or on NVMe, the AdamW step on the CPU (the `offload` group:
    none, cpu, nvme)."""

    target: OffloadTarget = OffloadTarget("none")
    """Where the optimizer state lives: none (with the parameters), cpu (host memory) or nvme (files
    under offload.path)."""
    path: Optional[str] = None
    """nvme: an existing, writable directory on a fast local disk; each rank keeps its optimizer state
    there in files that are reserved at start and vanish when the run ends (hpctrain.offload.nvme)."""
    kernel: OffloadKernel = OffloadKernel("auto")
    """Host AdamW step: auto = cpp, else compile, else fused."""
    pin_memory: bool = True
    """Page-locked host buffers, where an accelerator exists."""
    chunk_mb: int = 64
    """nvme streaming: each state tensor goes through host memory in chunks of chunk_mb MiB."""
    buffer_count: int = 4
    """nvme streaming: buffer sets (>= 2: reads run ahead and writes behind the update)."""
    queue_depth: int = 8
    """nvme streaming: requests (of block_mb MiB each) in flight."""
    block_mb: int = 8
    """nvme streaming: MiB per request (queue_depth of them in flight)."""
    direct_io: bool = True
    """O_DIRECT (bypass the page cache) where the file system allows it."""
    master_on_nvme: bool = False
    """nvme: stream the fp32 master weights through the files too, where they are kept apart from the
    parameters (an accelerator, or bf16/fp16 parameters); otherwise they stay in host memory."""


@dataclass
class TensorBoardLogger:
    """logger=tensorboard."""

    enabled: bool = False
    """Events in <run.dir>/tensorboard."""


@dataclass
class WandbLogger:
    """logger=wandb: Weights & Biases."""

    enabled: bool = False
    """Log to Weights & Biases."""
    project: str = "hpctrain"
    """The W&B project."""
    entity: Optional[str] = None
    """The W&B entity (user or team); None = the account's default."""
    mode: WandbMode = WandbMode("offline")
    """offline: <run.dir>/wandb, synced later with `wandb sync`."""
    tags: List[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass
class MLflowLogger:
    """logger=mlflow."""

    enabled: bool = False
    """Log to MLflow."""
    tracking_uri: Optional[str] = None
    """None: a local file store in <run.dir>/mlruns."""
    experiment: str = "hpctrain"
    """The MLflow experiment the run is logged under (created if missing)."""


@dataclass
class LoggerConfig:
    """Experiment trackers beside metrics.jsonl, picked with the `logger` group: `logger=wandb`,
    several at once with `logger=[tensorboard,wandb,mlflow]`. Rank 0 feeds them; a tracker that
    fails logs a warning and is dropped, training goes on."""
    tensorboard: TensorBoardLogger = field(default_factory=TensorBoardLogger)
    """TensorBoard (logger=tensorboard)."""
    wandb: WandbLogger = field(default_factory=WandbLogger)
    """Weights & Biases (logger=wandb)."""
    mlflow: MLflowLogger = field(default_factory=MLflowLogger)
    """MLflow (logger=mlflow)."""


@dataclass
class ProfileConfig:
    """Off by default, and then free."""
    steps: List[int] = field(default_factory=list)
    """[first, last]: a torch.profiler Chrome trace per rank of these optimizer steps (1-based,
    inclusive) in <run.dir>/profile/; [] = none."""
    memory: bool = False
    """Peak memory per phase (forward, backward, optimizer, checkpoint) in metrics."""


@dataclass
class KubernetesConfig:
    """launcher=k8s: <run.dir>/k8s.yaml for `kubectl apply -f` (hpctrain.launch.k8s)."""
    namespace: str = "default"
    """The Kubernetes namespace of the Job and its Service."""
    volume_claim: Optional[str] = None
    """PersistentVolumeClaim mounted at run.dir's parent in every pod (the run directory must be
    shared by all nodes, as on Slurm); None = an emptyDir, for a single node only."""
    shm_gb: float = 64.0
    """/dev/shm for the data loaders and NCCL."""
    service_account: Optional[str] = None
    """The pods' service account (serviceAccountName); None = the namespace's default."""
    node_selector: dict = field(default_factory=dict)
    """The pods' nodeSelector: node label -> value (`+launcher.k8s.node_selector.KEY=VALUE`)."""
    port: int = 29500
    """Rendezvous port on the first pod."""


@dataclass
class HealthConfig:
    """The pre-flight check every start runs on every node (hpctrain.distributed.health)."""
    enabled: bool = True
    """Run the check."""
    slowdown: float = 2.0
    """A node whose compute kernel is this many times slower than the median is left out."""


@dataclass
class LauncherConfig:
    """How ranks start: here, through Slurm, as a batch script, or on Kubernetes; what happens when
    they fail (the `launcher` group: local, slurm, sbatch, k8s)."""

    name: LauncherName = LauncherName("local")
    """local: launcher.nproc ranks on this machine; slurm: submit through submitit; sbatch: write a
    batch script to submit; k8s: write a Kubernetes manifest."""
    nproc: int = 2
    """Ranks the local launcher starts."""
    fork_ranks: bool = True
    """Linux: the local launcher starts its ranks as forks of one process that has imported torch
    (hpctrain.launch.forkserver), about 5 CPU-seconds less per rank; false: each rank a fresh
    interpreter."""
    backend: Backend = Backend("auto")
    """Collective backend; auto: nccl where the cluster's device is cuda and CUDA is present, else gloo."""
    timeout_s: int = 300
    """Collective timeout."""
    max_restarts: int = 3
    """Unplanned failures (hpctrain.launch.supervise): when a rank crashes, hangs or a node is lost,
    every rank stops and the run starts again from the newest complete checkpoint, at most this
    many times (a failure that repeats itself exactly stops at once)."""
    hang_timeout_s: float = 0.0
    """No progress for this long is a hang; 0 = max(60 s, 10x the median step)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """The pre-flight node health check."""
    min_nodes: int = 1
    """After losing nodes, go on with at least this many; with fewer, requeue without them."""
    straggler_ratio: float = 1.5
    """A rank this many times slower than the median rank, for launcher.straggler_steps logged steps
    in a row, is named in a warning."""
    straggler_steps: int = 5
    """A rank launcher.straggler_ratio times slower than the median rank for this many logged steps in
    a row is named in a warning."""
    chain: int = 1
    """launcher=slurm|sbatch: submit N jobs, each starting after the previous ends (afterany), for
    clusters whose time limit is shorter than the run; each resumes from the newest checkpoint."""
    array_parallelism: int = 0
    """`-m` sweeps as a Slurm job array: at most this many at once; 0 = no bound."""
    k8s: KubernetesConfig = field(default_factory=KubernetesConfig)
    """launcher=k8s settings."""
    in_process: bool = True
    """With checkpoint.memory_every: after a failure the surviving ranks stay alive and train on in the
    same process with a new process group; only the lost ranks start fresh (forked from the node
    agent's preloaded interpreter). false: every rank starts again."""


@dataclass
class ClusterConfig:
    """The machines: the device, the figures the planner (hpctrain.plan) prices a step with, the Slurm
    allocation and the container (the `cluster` group). Planner defaults describe a 2-core cloud VM
    (docs/measurements.md); conf/cluster/{a100,h100,h200}.yaml give datacenter figures. GB = 1e9 bytes
    except the *_mem_gb capacities, which are GiB as nvidia-smi and free report them."""

    name: str = "cpu"
    """The cluster's name, shown in plans."""
    device: Device = Device("cpu")
    """The device every rank trains on."""
    peak_tflops: float = 0.1
    """Peak dense matmul throughput of one device (rank) in TFLOP/s, the denominator of MFU: bf16 (fp16
    on GPUs without bf16)."""
    compute_capability: float = 0.0
    """The GPUs' CUDA compute capability: 7.0 V100, 7.5 T4, 8.0 A100, 9.0 H100 and H200, 10.0 B200. Says
    which precisions they have: bf16 from 8.0, fp8 from 8.9, mxfp8 from 10.0. 0 = not known (CPU: every
    precision runs, fp8 emulated)."""
    fp8_tflops: float = 0.0
    """Planner: peak dense FP8 matmul throughput of one device, TFLOP/s; 0 = the device has no FP8."""
    device_mem_gb: float = 16.0
    """Memory of one device, GiB (the planner's limit per rank)."""
    host_mem_gb: float = 16.0
    """Host memory per node, GiB (the planner's limit for offloaded state)."""
    hbm_gbps: float = 30.0
    """Planner: device memory bandwidth (elementwise kernels, optimizer step)."""
    matmul_efficiency: float = 0.5
    """Planner: fraction of peak_tflops a large GEMM sustains."""
    attention_efficiency: float = 0.3
    """Planner: fused attention: fraction of peak on the FLOPs it performs."""
    grouped_gemm_efficiency: float = 0.85
    """Planner: a Mixture-of-Experts layer's grouped GEMM over its experts, as a fraction of the rate of
    dense GEMMs of the same shapes (benchmarks/moe.py measures it against the per-expert loop)."""
    intra_node_gbps: float = 5.0
    """Planner: collective bus bandwidth (nccl-tests busbw) inside a node."""
    intra_node_latency_us: float = 50.0
    """Planner: per collective step inside a node."""
    inter_node_gbps: float = 1.2
    """Planner: bus bandwidth one NIC sustains between nodes."""
    inter_node_latency_us: float = 100.0
    """Planner: per collective step across nodes."""
    nics_per_node: int = 1
    """Planner: NICs per node for traffic between nodes (each at inter_node_gbps)."""
    pcie_gbps: float = 30.0
    """Planner: host <-> device copies per rank (offload)."""
    nvme_gbps: float = 0.6
    """Planner: NVMe read or write per node (offload.target=nvme)."""
    nvme_gb: float = 0.0
    """Planner: NVMe capacity per node for offloaded state; 0 = none."""
    checkpoint_gbps: float = 2.0
    """Planner: write bandwidth per node to run.dir's file system, GB/s: prices the checkpoint saves in the
    whole run's time (a parallel file system client sustains a few GB/s per node)."""
    host_adam_gparams: float = 0.3
    """Planner: host optimizer updates per node, billions of parameters/s."""
    runtime_reserve_gb: float = 0.0
    """Planner, per rank: CUDA context, NCCL and cuBLAS buffers, fragmentation."""
    # Slurm
    partition: Optional[str] = None
    """Slurm partition (sbatch --partition); None = the cluster's default."""
    nodes: int = 1
    """Slurm: nodes to allocate."""
    spare_nodes: int = 0
    """Slurm: extra nodes allocated idle (an agent with torch loaded on each) that replace a lost node
    inside the same job, without a requeue, its ranks restored from the replicas on their peers; needs
    checkpoint.memory_every."""
    gpus_per_node: int = 0
    """Slurm: GPUs per node (sbatch --gpus-per-node); when set, one rank per GPU."""
    tasks_per_node: int = 1
    """Slurm: ranks per node on nodes without GPUs."""
    cpus_per_task: int = 1
    """Slurm: CPUs per rank (sbatch --cpus-per-task)."""
    mem: Optional[str] = None
    """Slurm: memory per node (sbatch --mem, e.g. 200G); None = the cluster's default."""
    time: str = "01:00:00"
    """Slurm: the job's time limit (sbatch --time)."""
    account: Optional[str] = None
    """Slurm: account to charge (sbatch --account)."""
    qos: Optional[str] = None
    """Slurm: quality of service (sbatch --qos)."""
    constraint: Optional[str] = None
    """Slurm: node features to require (sbatch --constraint)."""
    exclude: Optional[str] = None
    """Slurm: nodes to leave out (sbatch --exclude)."""
    signal_lead_s: int = 120
    """Slurm: seconds before the time limit that Slurm sends USR2 so that all ranks can save
    (1..65535, shorter than cluster.time)."""
    max_requeues: int = 10
    """Slurm: at most this many requeues of a job (after a preemption save, or with too few nodes
    left), so that a job that keeps getting preempted stops instead of cycling forever."""
    setup: list = field(default_factory=list)
    """Shell lines run as written before the ranks start (e.g. `module load ...`, activating an
    environment): the batch script's body, submitit's setup under launcher=slurm."""
    sbatch_extra: dict = field(default_factory=dict)
    """More sbatch options, which override the others: `mail_type` -> --mail-type; true = a bare flag,
    false/null = left out."""
    env: dict = field(default_factory=dict)
    """Environment variables exported to every rank (e.g. NCCL settings)."""
    container_image: Optional[str] = None
    """Containers (pyxis/enroot): every rank runs inside this image via `srun --container-image`; the
    supervisor stays on the batch host. Also the pods' image under launcher=k8s."""
    container_mounts: List[str] = field(default_factory=list)
    """Container mounts "SRC:DST[:FLAGS]"; the run dir is added."""
    container_workdir: Optional[str] = None
    """Working directory inside the container (srun --container-workdir)."""
    container_python: str = "python"
    """The interpreter inside the image."""


@dataclass
class RunConfig:
    """Where the run lives."""

    name: str = "tiny"
    """The run's name: the Slurm job name, the Kubernetes objects' name, trackers' run name."""
    dir: str = "outputs/${run.name}"
    """The run directory: plan.json, metrics.jsonl, logs and checkpoints. Resuming reads it."""


@dataclass
class Config:
    """The whole config `python -m hpctrain` composes from conf/ and the command line."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment trackers."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Profiling."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Optimizer state offload."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """How ranks start and restart."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines and their Slurm allocation."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run's name and directory."""
    dry_run: bool = False
    """Compose, check and plan (printed), then stop: nothing starts, nothing is submitted, nothing is
    written (run.dir may hold another run's files; `python -m hpctrain.plan --json PATH` writes the plan)."""
