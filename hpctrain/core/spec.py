"""The engine spec: every decision about how a config trains, made once, as plain numbers and names.

A run's configuration has three shapes: the override strings, one typed `Config` (what config.yaml
holds), and the `EngineSpec` that `engine_spec(cfg)` derives from it, holding the config: the layout,
which data-parallel engine wraps the model, the dtypes of parameters, matmuls and gradient reduction,
where parameters, gradients and optimizer state live and over how many ranks each is sharded, the
pipeline stages and the blocks of each, micro-batches, ranks per node and the collective backend; the
knobs asked for are read through it by name. The login node's checks and planner, the engine on every
rank, the launchers and the benchmarks read these fields instead of re-deriving them from the config,
so a rule lives here once (what refuses a layout: hpctrain.core.rules). `updated` is the one way a
config changes after composing. No torch: the login node builds it.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property, lru_cache
from typing import Optional

from hpctrain.core.flops import param_counts, train_flops_per_token
from hpctrain.core.shape import HF_LINEAR
from hpctrain.core.schema import ClusterConfig, Config, ModelConfig

ZERO_STAGES = (0, 1, 2, 3)
# Schedules with one stage per rank; V-shaped ones put stage s and 2p-1-s on one rank.
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
FLOAT32, BFLOAT16, FLOAT16 = "float32", "bfloat16", "float16"  # torch dtype names: getattr(torch, name)
# What train.precision computes the matmuls in (fp8: its float8 linears aside, hpctrain.parallel.float8).
COMPUTE = {"fp32": FLOAT32, "bf16": BFLOAT16, "fp16": FLOAT16, "fp8": BFLOAT16}


@dataclass(frozen=True)
class Layout:
    """The device mesh, outermost dimension first (TP innermost, so it stays inside a node)."""
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1  # expert parallel: a split of dp_shard (its ranks see different data too)
    cp: int = 1  # context parallel: ranks splitting each sequence (they see the same samples)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}{ep}{cp} "
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

    @property
    def layers(self) -> tuple:
        """Blocks of each stage, in stage (model) order: what parallel.pp_layers sets."""
        return tuple(end - start for start, end in self.blocks)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages one pipeline rank runs, in order."""
        return stage_ids(self.schedule, self.ranks, self.per_rank, pp_rank)

    def describe(self) -> str:
        """e.g. '16 stages (1f1b), blocks per stage 7, 8 x 14, 7'."""
        runs: list = []
        for k in self.layers:
            if runs and runs[-1][0] == k:
                runs[-1][1] += 1
            else:
                runs.append([k, 1])
        split = ", ".join(f"{k} x {c}" if c > 1 else f"{k}" for k, c in runs)
        per = f", {self.per_rank} per rank" if self.per_rank > 1 else ""
        return f"{self.stages} stages ({self.schedule}{per}), blocks per stage {split}"

    @cached_property
    def rank_shapes(self) -> tuple:
        """(blocks, holds the embedding, holds the output layer) of each pipeline rank, over its stages
        (cached: the planner asks for every rank of thousands of layouts)."""
        out = []
        for r in range(self.ranks):
            ids = self.stage_ids(r)
            out.append((sum(self.blocks[s][1] - self.blocks[s][0] for s in ids), 0 in ids, self.stages - 1 in ids))
        return tuple(out)

    def rank_blocks(self, pp_rank: int) -> int:
        """How many blocks one pipeline rank holds over its stages."""
        return self.rank_shapes[pp_rank][0]

    def holds_embedding(self, pp_rank: int) -> bool:
        return self.rank_shapes[pp_rank][1]

    def holds_output(self, pp_rank: int) -> bool:
        return self.rank_shapes[pp_rank][2]


@dataclass(frozen=True)
class LoRA:
    """Adapters on the frozen model (model.lora with rank > 0), targets by hpctrain's layer names."""
    rank: int
    alpha: float
    dropout: float
    targets: tuple
    quantize: str = "none"  # none | nf4: how the frozen base of the adapted layers is stored (QLoRA)


def lora_of(model) -> Optional[LoRA]:
    lo = getattr(model, "lora", None)
    if lo is None or lo.rank <= 0:
        return None
    return LoRA(int(lo.rank), float(lo.alpha), float(lo.dropout), tuple(HF_LINEAR.get(t, t) for t in lo.targets),
                str(getattr(lo, "quantize", "none")))


@dataclass(frozen=True)
class EngineSpec:
    """A run as the engine runs it: the typed config it was derived from, and every decision that follows
    from it. What the run asked for is read through the properties below (the knobs, by the names the
    engine and the planner use); what the rules decide are the fields."""
    config: Config = field(repr=False, hash=False)  # the run's one typed config (config.yaml): the only input
    world: int  # ranks the launcher provides (the layout must fill them: hpctrain.core.rules)
    layout: Layout  # the mesh, dp_shard=-1 resolved against `world`
    # ddp | zero1 (DDP + ZeroRedundancyOptimizer) | replicate (FSDP2's replicate: ZeRO-0 with TP/PP) |
    # replicate_zero1 (replicate + an optimizer sharded by parameter owner) | fsdp (FSDP2: ZeRO-2/3, HSDP)
    data_parallel: str
    dtypes: Dtypes
    sharding: Sharding
    placement: Placement
    pipeline: Optional[Pipeline]
    microbatches: int  # forward/backward passes per optimizer step on one data-parallel rank
    nodes: int
    ranks_per_node: int
    device: str
    backend: str  # gloo | nccl, where the cluster's device is present (see backend_for)
    # step | microbatch: gradients reduced once per optimizer step or after every micro-batch
    grad_sync: str = "step"
    # sequence-parallel inputs re-gathered in backward (parallel.sp_regather, with TP and not compiled)
    sp_regather: bool = False
    lora: Optional[LoRA] = None  # adapters on the frozen model (model.lora)

    @property
    def params(self) -> int:
        """Model parameters."""
        return param_counts(self.config.model)["total"]

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (MFU's numerator)."""
        return train_flops_per_token(self.config.model, self.config.data.seq_len)

    # The knobs the engine takes as they are, read from the config (enums as their strings).
    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def global_batch(self) -> int:
        return self.config.train.global_batch

    @property
    def seq_len(self) -> int:
        return self.config.data.seq_len

    @property
    def micro_batch(self) -> int:
        """Sequences per forward/backward on one rank."""
        return self.config.train.micro_batch

    @property
    def precision(self) -> str:
        return str(self.config.train.precision)

    @property
    def zero(self) -> int:
        return int(self.config.parallel.zero)

    @property
    def ac(self) -> str:
        return str(self.config.parallel.ac)

    @property
    def ac_every(self) -> int:
        return self.config.parallel.ac_every

    @property
    def schedule(self) -> str:
        return str(self.config.parallel.pp_schedule)

    @property
    def virtual_stages(self) -> int:
        return self.config.parallel.pp_virtual_stages

    @property
    def pp_layers(self) -> tuple:
        """Blocks per pipeline stage as asked for (parallel.pp_layers); () = the automatic split."""
        return tuple(self.config.parallel.pp_layers)

    @property
    def offload(self) -> str:
        return str(self.config.offload.target)

    @property
    def master_on_nvme(self) -> bool:
        return bool(self.config.offload.master_on_nvme)

    @property
    def compile(self) -> bool:
        return bool(self.config.train.compile)

    @property
    def fp8_recipe(self) -> Optional[str]:
        """torchao's float8 recipe of train.precision=fp8, else None."""
        return str(self.config.train.fp8.recipe) if self.precision == "fp8" else None

    @property
    def fp8_all_gather(self) -> bool:
        return self.precision == "fp8" and bool(self.config.train.fp8.all_gather)

    @property
    def loss_scaling(self) -> bool:
        """fp16's dynamic loss scaling (torch.amp.GradScaler): its 5 exponent bits underflow small gradients."""
        return self.precision == "fp16"

    @property
    def checkpoint_weights(self) -> str:
        """full | adapters: what a checkpoint holds of the model (checkpoint.weights, auto resolved: the LoRA
        adapters alone where the frozen base can be re-read, from model.init_from, and always under QLoRA)."""
        asked = str(self.config.checkpoint.weights)
        if asked == "auto":
            # (nf4: the only kind QLoRA can write; a real run has model.init_from, rules.qlora)
            return "adapters" if self.lora and (self.config.model.init_from or self.lora.quantize == "nf4") else "full"
        return asked

    @property
    def loss(self) -> str:
        """chunked | full (train.loss)."""
        return str(self.config.train.loss)

    @property
    def loss_kernel(self) -> str:
        """torch | liger: who computes the chunked loss (train.loss_kernel, auto resolved: Liger-Kernel on
        CUDA where installed and tp is 1). Asked on the ranks, where the CUDA packages are."""
        k = str(self.config.train.loss_kernel)
        if k != "auto":
            return k
        if self.loss != "chunked" or self.device != "cuda" or self.layout.tp > 1 or self.dpo:
            return "torch"  # (dpo: sums per sequence, which Liger's kernel does not give)
        return "liger" if installed("liger_kernel") else "torch"

    @property
    def dpo(self) -> bool:
        """train.objective=dpo: preference pairs, each step a reference pass beside the policy's."""
        return str(self.config.train.objective) == "dpo"

    @property
    def dpo_reference(self) -> Optional[str]:
        """base | copy: where DPO's reference log-probabilities come from (train.dpo.reference, auto resolved:
        the adapter-disabled base under LoRA, else a frozen copy); None without dpo."""
        if not self.dpo:
            return None
        r = str(self.config.train.dpo.reference)
        return ("base" if self.lora else "copy") if r == "auto" else r

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the chunked loss as asked (train.loss_chunk); 0 = automatic (loss_chunk_tokens)."""
        return int(self.config.train.loss_chunk)

    @property
    def ac_modules(self) -> tuple:
        """parallel.ac_modules, in the schema's order, each once."""
        asked = {str(m) for m in self.config.parallel.ac_modules}
        return tuple(m for m in ("attention", "mlp", "moe_act", "norm", "moe") if m in asked)

    @property
    def cp_attention(self) -> str:
        return str(self.config.parallel.cp_attention)

    @property
    def document_mask(self) -> bool:
        return bool(self.config.data.document_mask)

    @property
    def cp_kernel(self) -> str:
        """torch's context_parallel where it covers the case, else hpctrain's: CUDA, no document mask, and
        16-bit compute (with grouped-query K/V only CUDA's flash kernel, a 16-bit one, serves torch's ring)."""
        k = str(self.config.parallel.cp_kernel)
        if k == "auto":
            cc = float(self.config.cluster.compute_capability)
            # (flash attention, the one kernel of torch's ring that takes grouped-query K/V, needs SM80+)
            covered = (self.device == "cuda" and not self.document_mask and self.dtypes.compute != FLOAT32
                       and (cc == 0 or cc >= 8.0 or self.model.n_kv_heads in (0, self.model.n_heads)))
            return "torch" if covered else "hpctrain"
        return k


# ------------------------------------------------------------------------------------- the rules

@lru_cache(maxsize=None)
def installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (the login node imports no torch);
    cached: the planner asks for thousands of layouts."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def ranks_per_node(cluster: ClusterConfig) -> int:
    """One rank per GPU where nodes have GPUs, else cluster.tasks_per_node."""
    return cluster.gpus_per_node or cluster.tasks_per_node or 1


def world_size(cfg: Config) -> int:
    """Ranks the run needs: what the local launcher or the cluster's nodes provide."""
    if cfg.launcher.name == "local":
        return cfg.launcher.nproc
    return cfg.cluster.nodes * ranks_per_node(cfg.cluster)


def layout_of(cfg: Config, world: Optional[int] = None) -> Layout:
    """The mesh, with dp_shard=-1 ("the rest") filled in from the world size (0 where it does not
    divide: check.py says why)."""
    p = cfg.parallel
    world = world_size(cfg) if world is None else world
    dp_shard = p.dp_shard
    if dp_shard == -1:
        rest = p.pp * p.dp_replicate * p.cp * p.tp
        dp_shard = world // rest if rest > 0 and world % rest == 0 else 0
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, ep=p.ep, cp=p.cp)


def data_parallel(zero: int, dp: int, tp: int = 1, pp: int = 1) -> str:
    """ZeRO-1 over a single data-parallel rank shards nothing: it is plain DDP (whose wrapper a
    single rank skips), which also composes with tensor-parallel DTensors. Replicated parameters over
    data parallel > 1 together with tensor or pipeline parallel (Megatron's layout) run on FSDP2's
    `replicate` (gradients all-reduced per block): DDP cannot wrap DTensor parameters nor reduce
    pipeline stages' micro-batches, and ZeroRedundancyOptimizer cannot step DTensors, so ZeRO-1
    there shards the optimizer by parameter owner (hpctrain.train.optim.ShardedOptimizer)."""
    if zero >= 2:
        return "fsdp"
    if dp > 1 and (tp > 1 or pp > 1):
        return "replicate_zero1" if zero == 1 else "replicate"
    return "zero1" if zero == 1 and dp > 1 else "ddp"


def dtypes(precision: str, zero: int, reduce: str = "fp32") -> Dtypes:
    """FSDP2 (ZeRO 2/3) casts the parameters it gathers to the 16-bit compute dtype (bf16; fp16; bf16 under
    fp8, whose float8 linears cast their own inputs) and reduces in fp32, or in bf16 where
    train.reduce_precision says so; DDP and ZeRO-1 keep fp32 parameters, which autocast feeds to the
    matmuls in 16 bits (their gradients, and so the reduction, stay fp32: rules.engine refuses bf16 there).
    The master weights are fp32 either way."""
    fsdp = zero >= 2
    reduce_dtype = BFLOAT16 if reduce == "bf16" and fsdp else FLOAT32
    compute = COMPUTE[precision]
    if compute == FLOAT32:
        return Dtypes(param=FLOAT32, compute=FLOAT32, autocast=False, reduce=reduce_dtype, master=FLOAT32)
    return Dtypes(param=compute if fsdp else FLOAT32, compute=compute, autocast=not fsdp,
                  reduce=reduce_dtype, master=FLOAT32)


def sharding(zero: int, layout: Layout) -> Sharding:
    """ZeRO shards within dp_shard and replicates across dp_replicate (HSDP). With pipelining each
    block runs once per micro-batch, so ZeRO-3 keeps a stage's parameters gathered for the step."""
    return Sharding(group=layout.dp_shard * layout.cp if zero >= 1 else 1, optimizer=zero >= 1, grads=zero >= 2,
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


def stage_ids(schedule: str, ranks: int, per_rank: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` of `ranks` runs, in order. Stage s holds the blocks after
    stage s-1's; V-shaped schedules fold the stages in two (rank r runs r and 2*ranks-1-r, so rank 0
    holds both the first and the last), the others deal them round robin (r, r+ranks, r+2*ranks, ...)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * ranks - 1 - pp_rank]
    return [pp_rank + i * ranks for i in range(per_rank)]


# The automatic split (parallel.pp_layers=[]).
#
# A stage's cost, in blocks: its blocks, plus the embedding on the first stage and the final norm,
# output projection and loss on the last. One cost serves both things a split must balance, compute
# and memory, because both scale with parameters: a block's matmuls are 2 x its parameters FLOPs per
# token forward (attention scores add 4-8% on Llama 3 405B at 8k tokens: ignored, so the split does
# not depend on the sequence length), and so are the output projection's (2 x vocab x dim; the
# cross-entropy over the logits is O(vocab) more). The embedding is a lookup, no FLOPs, but its
# weights, gradients and optimizer state take as much memory as the output layer's: it counts half
# its parameters. Llama 3 405B (vocab 128256 x dim 16384 against 3.19 B parameters a block): the
# embedding costs 0.33 blocks, the output layer 0.66, so 126 blocks over 16 stages split
# 7, 8 x 14, 7 -- as Llama 3 405B was trained (Llama 3 paper, section 3.3.2: one layer fewer on the
# first and the last stage, for the embedding and for the output projection and loss).
#
# What bounds a step and a rank's memory is the busiest pipeline *rank*, which runs all its stages:
# the split first minimizes the largest rank cost, then, within that, the largest stage cost (equal
# stages keep the schedule's ticks even), then fills stages in order, each as full as both bounds
# allow (the last ones take the shortfall). With one stage per rank (gpipe, 1f1b) that is the classic
# min-max contiguous split. Interleaved schedules give rank 0 the first stage and rank pp-1 the last;
# V-shaped ones give rank 0 both, so rank 0's two stages are both light: 126 blocks under zbv with
# pp=16 split 3, 4 x 30, 3 (rank 0 holds 6 blocks + embedding + output, the others 8). Layers that
# divide evenly get no special case: where the embedding and output layer are small against a block
# (tiny vocabularies) the split is the even one; where they are not, the ends get fewer blocks.
#
# Every stage but the first and the last holds at least one block; those two may hold none (only the
# embedding, or only the output layer), so a model runs with up to n_layers + 2 stages.
_EPS = 1e-9


def split_layers(n: int, extra: tuple, owner: tuple) -> tuple:
    """Blocks per stage (stage order) of `n` equal blocks over len(extra) stages: stage s costs its
    blocks + extra[s] (in blocks) and runs on pipeline rank owner[s]. See the comment above."""
    stages = len(extra)
    if stages < 1:
        raise ValueError("no stages to split the blocks over")
    least = [0 if s in (0, stages - 1) else 1 for s in range(stages)]
    if sum(least) > n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages (every stage between the first and the "
                         f"last needs a block)")
    ranks = sorted(set(owner))
    of = {r: [s for s in range(stages) if owner[s] == r] for r in ranks}
    rank_extra = {r: sum(extra[s] for s in of[r]) for r in ranks}
    rank_least = {r: sum(least[s] for s in of[r]) for r in ranks}

    def fit(limit: float, cost: float) -> int:  # blocks that fit under `limit` beside `cost`
        return math.floor(limit - cost + _EPS)

    def rank_caps(limit: float, stage_caps=None) -> Optional[dict]:
        caps = {}
        for r in ranks:
            cap = fit(limit, rank_extra[r])
            if stage_caps is not None:
                cap = min(cap, sum(stage_caps[s] for s in of[r]))
            if cap < rank_least[r]:
                return None
            caps[r] = cap
        return caps if sum(caps.values()) >= n else None

    def stage_caps(limit: float) -> Optional[list]:
        caps = [fit(limit, e) for e in extra]
        return None if any(c < m for c, m in zip(caps, least)) else caps

    def lowest(candidates: set, feasible) -> float:
        values = sorted(candidates)
        lo, hi = 0, len(values) - 1  # the largest candidate always fits
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(values[mid]):
                hi = mid
            else:
                lo = mid + 1
        return values[lo]

    rank_limit = lowest({k + e for e in rank_extra.values() for k in range(n + 1)},
                        lambda x: rank_caps(x) is not None)

    def both(x: float) -> Optional[tuple]:
        caps = stage_caps(x)
        budget = None if caps is None else rank_caps(rank_limit, caps)
        return None if budget is None else (caps, budget)

    stage_limit = lowest({k + e for e in set(extra) for k in range(n + 1)}, lambda x: both(x) is not None)
    caps, budget = both(stage_limit)
    blocks, left = [], n
    after = [sum(least[s + 1:]) for s in range(stages)]
    for s in range(stages):
        r = owner[s]
        later = sum(least[t] for t in of[r] if t > s)
        k = min(caps[s], budget[r] - later, left - after[s])
        blocks.append(k)
        budget[r] -= k
        left -= k
    assert left == 0 and all(b >= m for b, m in zip(blocks, least)), (n, extra, owner, blocks)
    return tuple(blocks)


def stage_owners(schedule: str, ranks: int, per_rank: int) -> tuple:
    """The pipeline rank of each stage."""
    owner = [0] * (ranks * per_rank)
    for r in range(ranks):
        for s in stage_ids(schedule, ranks, per_rank, r):
            owner[s] = r
    return tuple(owner)


def auto_layers(model: ModelConfig, pp: int, schedule: str, virtual: int) -> tuple:
    """Blocks per stage (stage order) of the automatic split (the comment above)."""
    c = param_counts(model)
    return _auto_layers(c["embedding"], c["per_block"], c["final_norm"] + c["output"], model.n_layers, pp,
                        stages_per_rank(schedule, virtual), schedule in V_SHAPED)


@lru_cache(maxsize=4096)
def _auto_layers(embedding: int, per_block: int, output: int, n: int, pp: int, per_rank: int, v_shaped: bool) -> tuple:
    # Cached: the planner's layout search asks for the same split thousands of times.
    stages = pp * per_rank
    extra = [0.0] * stages
    extra[0] += 0.5 * embedding / per_block
    extra[-1] += output / per_block
    # Which rank runs each stage: the V fold, or the round-robin deal (any non-V name deals per_rank).
    return split_layers(n, tuple(extra), stage_owners(V_SHAPED[0] if v_shaped else "interleaved_1f1b", pp, per_rank))


def pp_layers_problems(model: ModelConfig, pp: int, schedule: str, virtual: int, layers) -> list[str]:
    """Why parallel.pp_layers (blocks per stage, stage order) cannot split this model, with the fix;
    [] when it can (or is [], the automatic split)."""
    layers = [int(x) for x in layers or ()]
    if not layers:
        return []
    shown = "[" + ",".join(map(str, layers)) + "]"
    if pp <= 1:
        return [f"parallel.pp_layers={shown} splits pipeline stages, and parallel.pp={pp} has none. "
                "Fix: parallel.pp_layers=[]"]
    per_rank = stages_per_rank(schedule, virtual)
    stages, n = pp * per_rank, model.n_layers
    if stages > n + 2:
        return []  # check.py's stage count refusal says it
    auto = "[" + ",".join(map(str, auto_layers(model, pp, schedule, virtual))) + "]"
    why = []
    if len(layers) != stages:
        made = (f"parallel.pp={pp} x {per_rank} stages per rank ({schedule}"
                + (f", parallel.pp_virtual_stages={virtual}" if schedule not in SINGLE_STAGE + V_SHAPED else "")
                + ")") if per_rank > 1 else f"parallel.pp={pp}"
        why.append(f"it has {len(layers)} entr{'y' if len(layers) == 1 else 'ies'}, but {made} makes {stages} "
                   f"stages (one entry per stage, in model order)")
    if sum(layers) != n:
        why.append(f"it sums to {sum(layers)} blocks, but model.n_layers={n}")
    empty = [s for s, k in enumerate(layers) if k < 0 or (k == 0 and 0 < s < len(layers) - 1)]
    if empty:
        why.append(f"stage{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} would hold "
                   f"{'no' if all(layers[s] == 0 for s in empty) else 'a negative number of'} blocks (every stage "
                   f"needs one, except the first and the last, which hold the embedding and the output layer)")
    if not why:
        return []
    return [f"parallel.pp_layers={shown} cannot split the model: {'; '.join(why)}. Fix: parallel.pp_layers={auto} "
            f"(the automatic split), or parallel.pp_layers=[] to use it"]


def pipeline(model: ModelConfig, pp: int, schedule: str, virtual: int, layers=()) -> Optional[Pipeline]:
    """The stages and the blocks of each: `layers` blocks per stage (parallel.pp_layers), or the
    automatic split. Raises ValueError with pp_layers_problems' message for a split that cannot run.
    More stages than blocks + 2 get no blocks (hpctrain.core.rules refuses them)."""
    layers = tuple(int(x) for x in layers or ())
    bad = pp_layers_problems(model, pp, schedule, virtual, layers)
    if bad:
        raise ValueError(" ".join(bad))
    if pp <= 1:
        return None
    c = param_counts(model)
    return _pipeline(c["embedding"], c["per_block"], c["final_norm"] + c["output"], model.n_layers, pp,
                     str(schedule), int(virtual), layers)


@lru_cache(maxsize=4096)
def _pipeline(embedding: int, per_block: int, output: int, n: int, pp: int, schedule: str, virtual: int,
              layers: tuple) -> Pipeline:
    # Cached: one Pipeline (and its rank_shapes) serves every planner layout with these stages.
    per_rank = stages_per_rank(schedule, virtual)
    stages = pp * per_rank
    blocks: tuple = ()
    if stages <= n + 2:
        counts = layers or _auto_layers(embedding, per_block, output, n, pp, per_rank, schedule in V_SHAPED)
        bounds = [0]
        for k in counts:
            bounds.append(bounds[-1] + k)
        blocks = tuple(zip(bounds[:-1], bounds[1:]))
    return Pipeline(schedule=schedule, stages=stages, per_rank=per_rank, blocks=blocks)


def backend_for(requested: str, device: str, cuda_available: bool) -> str:
    """The collective backend: as configured, else NCCL where the cluster's GPUs are present."""
    if requested != "auto":
        return str(requested)
    return "nccl" if device == "cuda" and cuda_available else "gloo"


def microbatches(global_batch: int, dp: int, micro_batch: int) -> int:
    return max(1, global_batch // max(1, dp * micro_batch))


# ------------------------------------------------------------------------------------- the spec

# The knobs: what a run chooses about how it trains, by the names the engine and the planner use, and the
# config key each is. One table: the planner's search varies them, parallel=auto and elastic shrinking
# apply them (`updated`), and the command line that reproduces a choice is written from it.
KNOBS = {
    "pp": "parallel.pp", "dp_replicate": "parallel.dp_replicate", "dp_shard": "parallel.dp_shard",
    "tp": "parallel.tp", "ep": "parallel.ep", "cp": "parallel.cp", "zero": "parallel.zero", "ac": "parallel.ac",
    "ac_every": "parallel.ac_every", "schedule": "parallel.pp_schedule", "virtual_stages": "parallel.pp_virtual_stages",
    "pp_layers": "parallel.pp_layers", "grad_sync": "parallel.grad_sync", "sp_regather": "parallel.sp_regather",
    "cp_attention": "parallel.cp_attention", "cp_kernel": "parallel.cp_kernel",
    "micro_batch": "train.micro_batch", "global_batch": "train.global_batch", "precision": "train.precision",
    "reduce_precision": "train.reduce_precision", "loss": "train.loss", "ac_modules": "parallel.ac_modules",
    "compile": "train.compile", "seq_len": "data.seq_len", "document_mask": "data.document_mask",
    "offload": "offload.target", "master_on_nvme": "offload.master_on_nvme",
}
LAYOUT_KNOBS = ("tp", "pp", "dp_replicate", "dp_shard", "ep", "cp")  # Layout's fields, as printed


def knob_changes(**knobs) -> dict:
    """{config key: value} of knobs by name; `layout=Layout(...)` stands for its six degrees."""
    lay = knobs.pop("layout", None)
    if lay is not None:
        knobs = {**{k: getattr(lay, k) for k in LAYOUT_KNOBS}, **knobs}
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise KeyError(f"not knobs: {unknown} (hpctrain.core.spec.KNOBS names them)")
    return {KNOBS[k]: v for k, v in knobs.items()}


def updated(cfg: Config, changes: dict) -> Config:
    """A new Config: `cfg` with `changes` ({"parallel.tp": 2, ...}, two-part keys) applied, each value
    made the schema's type (a choice's enum). The one way a run's config is changed after composing
    (parallel=auto's choice, elastic shrinking, the planner's layouts); `cfg` is left as it was. Configs
    are values, never changed in place once composed: the sections not changed are shared."""
    sections: dict = {}
    for key, value in changes.items():
        section, name, kind = _key(type(cfg), key)
        sections.setdefault(section, {})[name] = _as_kind(kind, value)
    new = _shallow(cfg)
    for section, values in sections.items():
        node = _shallow(getattr(cfg, section))
        node.__dict__.update(values)
        new.__dict__[section] = node
    return new


def _shallow(node):
    # dataclasses.replace without its cost (the planner changes ~10^4 configs a search); the schema's
    # dataclasses have no __post_init__ to run again
    out = object.__new__(type(node))
    out.__dict__.update(node.__dict__)
    return out


@lru_cache(maxsize=None)
def _key(cls, key: str) -> tuple:
    """(section, name, the schema's type of the value: a Choice enum, list, or None for as given)."""
    section, _, name = key.partition(".")
    hints = typing.get_type_hints(cls)
    inner = typing.get_type_hints(hints[section]) if section in hints and dataclasses.is_dataclass(hints[section]) else {}
    if name not in inner:
        raise KeyError(f"{key} is not a config key")
    hint = inner[name]
    if isinstance(hint, type) and issubclass(hint, Enum):
        return section, name, hint
    if hint is list or getattr(hint, "__origin__", None) is list:
        return section, name, list
    return section, name, None


def _as_kind(kind, value):
    if kind is list:
        return list(value)
    if kind is None or isinstance(value, kind):
        return value
    return _member(kind, str(value))


@lru_cache(maxsize=None)
def _member(kind, value: str):
    return kind(value)


def overrides_of(changes: dict) -> list[str]:
    """The command-line overrides that make the same change (`key=value`, lists as [a,b])."""
    def shown(v) -> str:
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(map(str, v)) + "]"
        return str(v).lower() if isinstance(v, bool) else str(v)
    return [f"{k}={shown(v)}" for k, v in changes.items()]


def placement_of(cfg: Config, world: int) -> tuple[int, int]:
    """(nodes, ranks per node): the local launcher puts every rank on this machine."""
    if cfg.launcher.name == "local":
        return 1, world
    return cfg.cluster.nodes, ranks_per_node(cfg.cluster)


def engine_spec(cfg: Config, world: Optional[int] = None) -> EngineSpec:
    """The spec of a composed config on `world` ranks (default: what the launcher provides). Raises
    ValueError where parallel.pp_layers cannot split the model (pp_layers_problems says why)."""
    world = world_size(cfg) if world is None else world
    lay, p, model = layout_of(cfg, world), cfg.parallel, cfg.model
    zero = int(p.zero)
    nodes, rpn = placement_of(cfg, lay.world)
    pipe = pipeline(model, lay.pp, str(p.pp_schedule), p.pp_virtual_stages, p.pp_layers)
    device = str(cfg.cluster.device)
    return EngineSpec(
        config=cfg, world=world, layout=lay, data_parallel=data_parallel(zero, lay.dp * lay.cp, lay.tp, lay.pp),
        dtypes=dtypes(str(cfg.train.precision), zero, str(cfg.train.reduce_precision)), sharding=sharding(zero, lay),
        placement=placement(str(cfg.offload.target), zero, lay.tp, bool(cfg.offload.master_on_nvme)),
        pipeline=pipe, microbatches=microbatches(cfg.train.global_batch, lay.dp, cfg.train.micro_batch),
        nodes=nodes, ranks_per_node=rpn, device=device, backend=backend_for(str(cfg.launcher.backend), device, True),
        grad_sync=grad_sync(str(p.grad_sync), zero, lay),
        sp_regather=bool(p.sp_regather) and lay.tp > 1 and not cfg.train.compile, lora=lora_of(model))
