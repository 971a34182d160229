"""Typed configuration: the schema Hydra composes `conf/` against.

Every field here is a knob a user can set on the command line (`train.steps=10`). The dataclasses are
registered in Hydra's ConfigStore as the schema of each group, so an unknown key or a wrong type is
refused while composing, before any process starts. Checks that span several fields live in
`hpctrain.checks.config_checks`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class Choice(str, Enum):
    """A knob with a fixed set of values. OmegaConf refuses any other value while composing, with the
    allowed list; members compare equal to their strings and print as them (`f"{x}"` is "bf16")."""

    def __str__(self) -> str:
        return self.value

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
Precision = _choice("Precision", "fp32 bf16")
OffloadTarget = _choice("OffloadTarget", "none cpu nvme")
OffloadKernel = _choice("OffloadKernel", "auto cpp compile fused")
LauncherName = _choice("LauncherName", "local slurm sbatch k8s")
WandbMode = _choice("WandbMode", "offline online disabled")
Backend = _choice("Backend", "auto gloo nccl")
Device = _choice("Device", "cpu cuda")


@dataclass
class ModelConfig:
    name: str = "tiny"
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Llama 3.1 RoPE scaling: factor (0 = off), low/high frequency factors, original context length.
    rope_scaling: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # A Hugging Face Llama directory (config.json + *.safetensors) to start from; its config.json
    # must agree with the model keys above (`python -m hpctrain.core.hf_format config DIR` prints them).
    init_from: Optional[str] = None


@dataclass
class ParallelConfig:
    # parallel=auto: the planner picks every knob below (layout, ZeRO stage, checkpointing, micro-batch).
    auto: bool = False
    # pp x dp_replicate x dp_shard x tp must equal the world size; -1 for dp_shard means "the rest".
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    # 0 = DDP (replicated), 3 = FSDP2 (parameters, gradients and optimizer state sharded).
    zero: int = 3
    # Activation checkpointing: none | full | selective (every `ac_every`-th block).
    ac: AC = AC("none")
    ac_every: int = 2
    # Micro-batches per step come from train.global_batch / data-parallel ranks / train.micro_batch.
    pp_schedule: PipelineSchedule = PipelineSchedule("1f1b")
    pp_virtual_stages: int = 1
    # Blocks of each pipeline stage in model order, one entry per stage (pp x stages per rank: 2 for
    # interleaved_1f1b/zero_bubble with pp_virtual_stages<=2, else pp_virtual_stages; 2 for zbv and
    # dualpipev, whose rank r runs stages r and 2pp-1-r), summing to model.n_layers; e.g. [7,8,...,8,7].
    # [] = automatic: balances parameters, the embedding and output layer counted on the first and
    # last stage (hpctrain.core.spec.split_layers).
    pp_layers: List[int] = field(default_factory=list)
    # When gradients are reduced under gradient accumulation: every micro-batch (ZeRO-2/3 keep only
    # sharded gradients: their memory promise) or once per step (DDP/ZeRO-1; ZeRO-2/3 then accumulate an
    # unsharded fp32 gradient, less traffic, more memory). auto: microbatch for ZeRO-2/3, step otherwise
    # and with pipelining (torch's pipeline stages sync on the last backward).
    grad_sync: GradSync = GradSync("auto")
    # With tensor parallel: keep 1/tp of each sequence-parallel input the column-parallel linears
    # gathered, and all-gather it again in backward (Megatron's way; hpctrain.parallel.regather), instead
    # of keeping the gathered tensor for backward: 2 x tokens x dim x (tp-1)/tp fewer elements per block
    # and micro-batch, 2 more all-gathers per block in backward. Not under train.compile.
    sp_regather: bool = True


@dataclass
class OptimConfig:
    name: OptimName = OptimName("adamw")
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # auto: fused on CPU and CUDA when every parameter is a plain tensor or DTensor of one kind.
    impl: OptimImpl = OptimImpl("auto")


@dataclass
class SourceConfig:
    path: str = "???"  # a directory made by `python -m hpctrain.data.prepare`
    weight: float = 1.0  # relative share of the training stream


@dataclass
class DataConfig:
    source: DataSource = DataSource("synthetic")
    path: Optional[str] = None  # directory made by `python -m hpctrain.data.prepare`
    # A mixture instead of one path: data.sources='[{path: A, weight: 3}, {path: B, weight: 1}]'.
    # Every source must come from the same tokenizer; validation mixes their val splits alike.
    sources: List[SourceConfig] = field(default_factory=list)
    seq_len: int = 64
    seed: int = 1234


@dataclass
class EvalConfig:
    every: int = 0  # validation loss every N steps and after the last one; 0 = never
    batches: int = 4  # global batches (train.global_batch sequences each) of the validation split per evaluation


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 4  # sequences per forward/backward on one rank
    seed: int = 0
    # fp32 | bf16: bf16 keeps fp32 master weights and reduces gradients in fp32.
    precision: Precision = Precision("fp32")
    log_every: int = 1
    compile: bool = False
    threads: int = 0  # torch intra-op threads per rank; 0 = cores / local ranks


@dataclass
class CheckpointConfig:
    """Sharded checkpoints: when to save, how many to keep, where to resume."""
    every: int = 0  # steps between saves; 0 = only when preempted
    keep: int = 3  # complete checkpoints kept, newest first
    # Stage to host memory, write in the background (was `checkpoint.async`, a Python keyword that kept
    # the schema from being a plain dataclass).
    async_save: bool = False
    resume: bool = True  # resume from the newest complete checkpoint in run.dir
    load_step: Optional[int] = None  # resume from this step instead of the newest
    threads: int = 8  # writer threads per rank: one is far from the disk's bandwidth


@dataclass
class OffloadConfig:
    target: OffloadTarget = OffloadTarget("none")
    # nvme: an existing, writable directory on a fast local disk; each rank keeps its optimizer state
    # there in files that are reserved at start and vanish when the run ends (hpctrain.offload.nvme).
    path: Optional[str] = None
    kernel: OffloadKernel = OffloadKernel("auto")  # host AdamW step: auto = cpp, else compile, else fused
    pin_memory: bool = True  # page-locked host buffers, where an accelerator exists
    # nvme streaming: each state tensor goes through host memory in chunks of chunk_mb MiB, using
    # buffer_count buffer sets (>= 2: reads run ahead and writes behind the update), with queue_depth
    # requests of block_mb MiB in flight.
    chunk_mb: int = 64
    buffer_count: int = 4
    queue_depth: int = 8
    block_mb: int = 8
    direct_io: bool = True  # O_DIRECT (bypass the page cache) where the file system allows it
    # nvme: stream the fp32 master weights through the files too, where they are kept apart from the
    # parameters (an accelerator, or bf16/fp16 parameters); otherwise they stay in host memory.
    master_on_nvme: bool = False


@dataclass
class TensorBoardLogger:
    enabled: bool = False  # events in <run.dir>/tensorboard


@dataclass
class WandbLogger:
    enabled: bool = False
    project: str = "hpctrain"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode("offline")  # offline: <run.dir>/wandb, synced later with `wandb sync`
    tags: List[str] = field(default_factory=list)


@dataclass
class MLflowLogger:
    enabled: bool = False
    tracking_uri: Optional[str] = None  # None: a local file store in <run.dir>/mlruns
    experiment: str = "hpctrain"


@dataclass
class LoggerConfig:
    """Experiment trackers beside metrics.jsonl, picked with the `logger` group: `logger=wandb`,
    several at once with `logger=[tensorboard,wandb,mlflow]`. Rank 0 feeds them; a tracker that
    fails logs a warning and is dropped, training goes on."""
    tensorboard: TensorBoardLogger = field(default_factory=TensorBoardLogger)
    wandb: WandbLogger = field(default_factory=WandbLogger)
    mlflow: MLflowLogger = field(default_factory=MLflowLogger)


@dataclass
class ProfileConfig:
    """Off by default, and then free."""
    # [first, last]: a torch.profiler Chrome trace per rank of these optimizer steps (1-based,
    # inclusive) in <run.dir>/profile/; [] = none.
    steps: List[int] = field(default_factory=list)
    memory: bool = False  # peak memory per phase (forward, backward, optimizer, checkpoint) in metrics


@dataclass
class KubernetesConfig:
    """launcher=k8s: <run.dir>/k8s.yaml for `kubectl apply -f` (hpctrain.launch.k8s)."""
    namespace: str = "default"
    # PersistentVolumeClaim mounted at run.dir's parent in every pod (the run directory must be
    # shared by all nodes, as on Slurm); None = an emptyDir, for a single node only.
    volume_claim: Optional[str] = None
    shm_gb: float = 64.0  # /dev/shm for the data loaders and NCCL
    service_account: Optional[str] = None
    node_selector: dict = field(default_factory=dict)
    port: int = 29500  # rendezvous port on the first pod


@dataclass
class HealthConfig:
    """The pre-flight check every start runs on every node (hpctrain.distributed.health)."""
    enabled: bool = True
    slowdown: float = 2.0  # a node whose compute kernel is this many times slower than the median is left out


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName("local")
    nproc: int = 2  # ranks the local launcher starts
    backend: Backend = Backend("auto")
    timeout_s: int = 300  # collective timeout
    # Unplanned failures (hpctrain.launch.supervise): when a rank crashes, hangs or a node is lost,
    # every rank stops and the run starts again from the newest complete checkpoint, at most this
    # many times (a failure that repeats itself exactly stops at once).
    max_restarts: int = 3
    hang_timeout_s: float = 0.0  # no progress for this long is a hang; 0 = max(60 s, 10x the median step)
    health: HealthConfig = field(default_factory=HealthConfig)
    min_nodes: int = 1  # after losing nodes, go on with at least this many; with fewer, requeue without them
    straggler_ratio: float = 1.5  # a rank this many times slower than the median rank, ...
    straggler_steps: int = 5  # ... for this many logged steps in a row, is named in a warning
    # launcher=slurm|sbatch: submit N jobs, each starting after the previous ends (afterany), for
    # clusters whose time limit is shorter than the run; each resumes from the newest checkpoint.
    chain: int = 1
    array_parallelism: int = 0  # `-m` sweeps as a Slurm job array: at most this many at once; 0 = no bound
    k8s: KubernetesConfig = field(default_factory=KubernetesConfig)


@dataclass
class ClusterConfig:
    name: str = "cpu"
    device: Device = Device("cpu")
    # Peak dense matmul throughput of one device (rank) in TFLOP/s, the denominator of MFU.
    peak_tflops: float = 0.1
    device_mem_gb: float = 16.0
    host_mem_gb: float = 16.0
    # What the planner (hpctrain.plan) prices a step with. Defaults describe a 2-core cloud VM
    # (docs/measurements.md); conf/cluster/{a100,h100,h200}.yaml give datacenter figures. GB = 1e9 bytes except
    # the *_mem_gb capacities, which are GiB as nvidia-smi and free report them.
    hbm_gbps: float = 30.0  # device memory bandwidth (elementwise kernels, optimizer step)
    matmul_efficiency: float = 0.5  # fraction of peak_tflops a large GEMM sustains
    attention_efficiency: float = 0.3  # fused attention: fraction of peak on the FLOPs it performs
    intra_node_gbps: float = 5.0  # collective bus bandwidth (nccl-tests busbw) inside a node
    intra_node_latency_us: float = 50.0  # per collective step inside a node
    inter_node_gbps: float = 1.2  # bus bandwidth one NIC sustains between nodes
    inter_node_latency_us: float = 100.0  # per collective step across nodes
    nics_per_node: int = 1
    pcie_gbps: float = 30.0  # host <-> device copies per rank (offload)
    nvme_gbps: float = 0.6  # NVMe read or write per node (offload.target=nvme)
    nvme_gb: float = 0.0  # NVMe capacity per node for offloaded state; 0 = none
    host_adam_gparams: float = 0.3  # host optimizer updates per node, billions of parameters/s
    runtime_reserve_gb: float = 0.0  # per rank: CUDA context, NCCL and cuBLAS buffers, fragmentation
    # Slurm
    partition: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    mem: Optional[str] = None
    time: str = "01:00:00"
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    signal_lead_s: int = 120
    max_requeues: int = 10
    setup: list = field(default_factory=list)
    sbatch_extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    # Containers (pyxis/enroot): every rank runs inside this image via `srun --container-image`; the
    # supervisor stays on the batch host. Also the pods' image under launcher=k8s.
    container_image: Optional[str] = None
    container_mounts: List[str] = field(default_factory=list)  # "SRC:DST[:FLAGS]"; the run dir is added
    container_workdir: Optional[str] = None
    container_python: str = "python"  # the interpreter inside the image


@dataclass
class RunConfig:
    name: str = "tiny"
    dir: str = "outputs/${run.name}"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dry_run: bool = False


def register() -> None:
    """Register the schema with Hydra's ConfigStore; conf/config.yaml names it first in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="hpctrain_schema", node=Config)
