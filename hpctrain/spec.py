"""The engine spec: every decision about how a config trains, made once, as plain numbers and names.

`engine_spec(cfg)` turns a composed config into an `EngineSpec`: the layout, which data-parallel engine
wraps the model, the dtypes of parameters, matmuls and gradient reduction, where parameters, gradients
and optimizer state live and over how many ranks each is sharded, the pipeline stages and the blocks
of each, micro-batches, ranks per node and the collective backend. The login node's checks and
planner, the engine on every rank, the launchers and the benchmarks read these fields instead of
re-deriving them from the config, so a rule lives here once. No torch: the login node builds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from hpctrain.flops import param_counts, train_flops_per_token

ZERO_STAGES = (0, 1, 2, 3)
# Schedules with one stage per rank; V-shaped ones put stage s and 2p-1-s on one rank.
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
FLOAT32, BFLOAT16 = "float32", "bfloat16"  # torch dtype names: getattr(torch, name)


@dataclass(frozen=True)
class Layout:
    """The device mesh, outermost dimension first (TP innermost, so it stays inside a node)."""
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x tp {self.tp} = {self.world} ranks")


@dataclass(frozen=True)
class Dtypes:
    param: str  # what forward and backward read parameters as
    compute: str  # what matmuls run in
    autocast: bool  # compute reached by torch.autocast over fp32 parameters (not by casting them)
    reduce: str  # what gradients are reduced (and kept for the optimizer) in
    master: str  # the optimizer's copy of the parameters


@dataclass(frozen=True)
class Sharding:
    """Which state is split over the `group` data-parallel ranks of a ZeRO group (1: replicated)."""
    group: int
    optimizer: bool  # ZeRO >= 1: master weights and moments
    grads: bool  # ZeRO >= 2
    params: bool  # ZeRO 3: also between forward and backward (ZeRO-2 keeps them gathered then)
    reshard_after_forward: bool


@dataclass(frozen=True)
class Placement:
    """Where state lives: device | host | nvme (optimizer offload)."""
    params: str
    grads: str
    master: str
    moments: str


@dataclass(frozen=True)
class Pipeline:
    schedule: str
    stages: int  # over all pipeline ranks
    per_rank: int
    blocks: tuple  # (start, end) block range of each stage

    @property
    def ranks(self) -> int:
        return self.stages // self.per_rank

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages one pipeline rank runs, in order."""
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * self.ranks - 1 - pp_rank]
        return [pp_rank + i * self.ranks for i in range(self.per_rank)]

    def rank_blocks(self, pp_rank: int) -> int:
        """How many blocks one pipeline rank holds over its stages."""
        return sum(self.blocks[s][1] - self.blocks[s][0] for s in self.stage_ids(pp_rank))

    def holds_embedding(self, pp_rank: int) -> bool:
        return 0 in self.stage_ids(pp_rank)

    def holds_output(self, pp_rank: int) -> bool:
        return self.stages - 1 in self.stage_ids(pp_rank)


@dataclass(frozen=True)
class EngineSpec:
    layout: Layout
    zero: int
    data_parallel: str  # none | ddp | zero1 (DDP + sharded optimizer) | fsdp (FSDP2: ZeRO-2/3, HSDP)
    dtypes: Dtypes
    sharding: Sharding
    placement: Placement
    pipeline: Optional[Pipeline]
    micro_batch: int  # sequences per forward/backward on one rank
    microbatches: int  # forward/backward passes per optimizer step on one data-parallel rank
    ac: str
    ac_every: int
    compile: bool
    nodes: int
    ranks_per_node: int
    device: str
    backend: str  # gloo | nccl, where the cluster's device is present (see backend_for)
    params: int  # model parameters
    flops_per_token: float  # model FLOPs per trained token (MFU's numerator)
    # step | microbatch: gradients reduced once per optimizer step or after every micro-batch
    grad_sync: str = "step"


# ------------------------------------------------------------------------------------- the rules

def ranks_per_node(cluster: Any) -> int:
    """One rank per GPU where nodes have GPUs, else cluster.tasks_per_node."""
    return cluster.gpus_per_node or cluster.tasks_per_node or 1


def world_size(cfg: Any) -> int:
    """Ranks the run needs: what the local launcher or the cluster's nodes provide."""
    if cfg.launcher.name == "local":
        return cfg.launcher.nproc
    return cfg.cluster.nodes * ranks_per_node(cfg.cluster)


def layout_of(cfg: Any, world: Optional[int] = None) -> Layout:
    """The mesh, with dp_shard=-1 ("the rest") filled in from the world size (0 where it does not
    divide: check.py says why)."""
    p = cfg.parallel
    world = world_size(cfg) if world is None else world
    dp_shard = p.dp_shard
    if dp_shard == -1:
        rest = p.pp * p.dp_replicate * p.tp
        dp_shard = world // rest if rest > 0 and world % rest == 0 else 0
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp)


def data_parallel(zero: int, dp: int) -> str:
    """ZeRO-1 over a single data-parallel rank shards nothing: it is plain DDP (whose wrapper a
    single rank skips), which also composes with tensor-parallel DTensors."""
    if zero >= 2:
        return "fsdp"
    return "zero1" if zero == 1 and dp > 1 else "ddp"


def dtypes(precision: str, zero: int) -> Dtypes:
    """FSDP2 (ZeRO 2/3) casts the parameters it gathers to bf16 and reduces in fp32; DDP and ZeRO-1
    keep fp32 parameters, which autocast feeds to the matmuls in bf16 (their gradients, and so the
    reduction, stay fp32). The master weights are fp32 either way."""
    if precision != "bf16":
        return Dtypes(param=FLOAT32, compute=FLOAT32, autocast=False, reduce=FLOAT32, master=FLOAT32)
    fsdp = zero >= 2
    return Dtypes(param=BFLOAT16 if fsdp else FLOAT32, compute=BFLOAT16, autocast=not fsdp,
                  reduce=FLOAT32, master=FLOAT32)


def sharding(zero: int, layout: Layout) -> Sharding:
    """ZeRO shards within dp_shard and replicates across dp_replicate (HSDP). With pipelining each
    block runs once per micro-batch, so ZeRO-3 keeps a stage's parameters gathered for the step."""
    return Sharding(group=layout.dp_shard if zero >= 1 else 1, optimizer=zero >= 1, grads=zero >= 2,
                    params=zero >= 3, reshard_after_forward=zero == 3 and layout.pp == 1)


def grad_sync(choice: str, zero: int, layout: Layout) -> str:
    """When gradients are reduced. ZeRO-2/3 keep their memory promise (sharded gradients) by reducing
    every micro-batch; DDP and ZeRO-1 hold full gradients anyway and reduce once. torch's pipeline stages
    decide for themselves: they sync on a step's last backward only."""
    if layout.pp > 1:
        return "step"
    if choice in ("step", "microbatch"):
        return choice
    return "microbatch" if zero >= 2 else "step"


def params_on_host(offload: str, zero: int, tp: int) -> bool:
    """Optimizer offload under FSDP2 (ZeRO 2/3) without tensor parallel also keeps the sharded fp32
    parameters and their gradients in host memory (FSDP2's CPU offload policy); otherwise parameters
    stay on the device and the host optimizer stages their shards itself."""
    return offload != "none" and zero >= 2 and tp == 1


def placement(offload: str, zero: int, tp: int, master_on_nvme: bool = False) -> Placement:
    host = params_on_host(offload, zero, tp)
    where = "device" if offload == "none" else "host"
    return Placement(params="host" if host else "device", grads="host" if host else "device",
                     master="nvme" if offload == "nvme" and master_on_nvme else where,
                     moments="nvme" if offload == "nvme" else where)


def stages_per_rank(schedule: str, virtual: int) -> int:
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return max(2, virtual)


def balanced_split(costs: list, parts: int) -> list[int]:
    """Boundaries (len parts+1) of `parts` contiguous chunks of `costs` minimizing the largest chunk
    (binary search on the bottleneck, greedy fill). Every chunk gets at least one item."""
    if parts > len(costs):
        raise ValueError(f"cannot split {len(costs)} items into {parts} stages")

    def fits(limit: float) -> Optional[list[int]]:
        bounds, acc = [0], 0.0
        for i, c in enumerate(costs):
            if (acc + c > limit and acc > 0) or len(costs) - i < parts - (len(bounds) - 1):
                bounds.append(i)
                acc = 0.0
                if len(bounds) - 1 >= parts:
                    return None
            acc += c
        bounds.append(len(costs))
        return bounds if len(bounds) == parts + 1 else None

    lo, hi = max(costs), sum(costs)
    best = fits(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        b = fits(mid)
        if b is not None:
            best, hi = b, mid
        else:
            lo = mid
    return best


def stage_blocks(model: Any, num_stages: int) -> tuple:
    """Block range [start, end) of each stage, balancing parameters: the embedding counts half its
    size (a lookup, not a matmul), the final norm and output projection count whole; they sit on the
    first and last stage whatever the split."""
    c = param_counts(model)
    return _stage_blocks(c["embedding"], c["per_block"], c["final_norm"] + c["output"], model.n_layers, num_stages)


@lru_cache(maxsize=4096)
def _stage_blocks(embedding: int, per_block: int, output: int, n: int, num_stages: int) -> tuple:
    # Cached: the planner's layout search asks for the same split thousands of times.
    bounds = balanced_split([embedding * 0.5, *[per_block] * n, output], num_stages)
    ranges = []
    for s in range(num_stages):
        # Units 1..n are blocks 0..n-1; unit 0 (embedding) and n+1 (output) own no block.
        start, end = max(bounds[s], 1) - 1, min(bounds[s + 1], n + 1) - 1
        ranges.append((start, max(start, end)))
    return tuple(ranges)


def pipeline(model: Any, pp: int, schedule: str, virtual: int) -> Optional[Pipeline]:
    if pp <= 1:
        return None
    per_rank = stages_per_rank(schedule, virtual)
    stages = pp * per_rank
    blocks = stage_blocks(model, stages) if stages <= model.n_layers + 2 else ()
    return Pipeline(schedule=str(schedule), stages=stages, per_rank=per_rank, blocks=blocks)


def backend_for(requested: str, device: str, cuda_available: bool) -> str:
    """The collective backend: as configured, else NCCL where the cluster's GPUs are present."""
    if requested != "auto":
        return str(requested)
    return "nccl" if device == "cuda" and cuda_available else "gloo"


def microbatches(global_batch: int, dp: int, micro_batch: int) -> int:
    return max(1, global_batch // max(1, dp * micro_batch))


# ------------------------------------------------------------------------------------- the spec

def engine_spec(cfg: Any, world: Optional[int] = None) -> EngineSpec:
    """The spec of a composed config, for `world` ranks (default: what the launcher provides)."""
    p, t = cfg.parallel, cfg.train
    lay = layout_of(cfg, world)
    nodes, rpn = (1, lay.world) if cfg.launcher.name == "local" else (cfg.cluster.nodes, ranks_per_node(cfg.cluster))
    return build(cfg.model, lay, zero=p.zero, precision=t.precision, offload=cfg.offload.target,
                 master_on_nvme=bool(cfg.offload.master_on_nvme), schedule=p.pp_schedule,
                 virtual_stages=p.pp_virtual_stages, global_batch=t.global_batch, micro_batch=t.micro_batch,
                 seq_len=cfg.data.seq_len, ac=p.ac, ac_every=p.ac_every, compile=bool(t.compile), nodes=nodes,
                 ranks_per_node=rpn, device=cfg.cluster.device, backend=cfg.launcher.backend, sync=p.grad_sync)


def build(model: Any, layout: Layout, *, zero: int, precision: str, offload: str, schedule: str,
          virtual_stages: int, global_batch: int, micro_batch: int, seq_len: int, ac: str = "none",
          ac_every: int = 2, compile: bool = False, master_on_nvme: bool = False, nodes: int = 1,
          ranks_per_node: int = 1, device: str = "cpu", backend: str = "auto", sync: str = "auto") -> EngineSpec:
    """The spec from the knobs themselves (the planner prices thousands of layouts this way)."""
    return EngineSpec(
        layout=layout, zero=int(zero), data_parallel=data_parallel(zero, layout.dp), dtypes=dtypes(precision, zero),
        sharding=sharding(zero, layout), placement=placement(offload, zero, layout.tp, master_on_nvme),
        pipeline=pipeline(model, layout.pp, schedule, virtual_stages), micro_batch=micro_batch,
        microbatches=microbatches(global_batch, layout.dp, micro_batch), ac=str(ac), ac_every=ac_every,
        compile=compile, nodes=nodes, ranks_per_node=ranks_per_node, device=str(device),
        backend=backend_for(backend, device, True), params=param_counts(model)["total"],
        flops_per_token=train_flops_per_token(model, seq_len), grad_sync=grad_sync(str(sync), int(zero), layout))
