"""Enumerate layouts of a model on a cluster, keep those that can run and fit, rank them by predicted
tokens/s, and say why the rest cannot run. Pure arithmetic: a 64-GPU search takes about a second.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from hpctrain.core import rules
from hpctrain.plan.memory import Job, Memory, memory
from hpctrain.core.spec import ZERO_STAGES, Layout, knob_changes, ranks_per_node
from hpctrain.plan.throughput import HPCTRAIN, Software, Throughput, throughput
from hpctrain.core.schema import ClusterConfig

# The knobs `nearest` compares (the layout's, by hpctrain.core.spec.KNOBS's names): it counts how many differ.
NEAREST = ("tp", "pp", "dp_replicate", "zero", "offload", "ac", "micro_batch", "schedule", "virtual_stages")


@dataclass(frozen=True)
class Space:
    """What the search may choose from. TP stays inside a node (its per-layer collectives would
    crawl over the NICs); HSDP shard groups cover whole nodes."""
    zeros: tuple = ZERO_STAGES
    offloads: tuple = ("none", "cpu", "nvme")
    acs: tuple = ("none", "selective", "full")
    micro_batches: tuple = (1, 2, 4, 8)
    schedules: tuple = ("1f1b", "interleaved_1f1b", "gpipe")
    virtual_stages: tuple = (2, 4)  # tried with interleaved_1f1b
    grad_syncs: tuple = ("microbatch", "step")  # tried with ZeRO-2/3 without pipelining
    ac_every: int = 2
    experts: int = 0  # a MoE model's routed experts: expert-parallel degrees dividing them are tried
    # context parallel: tried for sequences of cp_from tokens or more, at powers of two up to cp_max
    seq_len: int = 0
    cp_from: int = 16384
    cp_max: int = 32
    # Tried on each layout that fits (refinements: they change the time, and the memory only downwards):
    # precisions beside the requested one (None: fp8 where the request is bf16 and the cluster's GPUs have
    # FP8, cluster.fp8_tflops > 0; never a change of fp32 or fp16, whose users chose their numerics) and
    # the other train.loss (chunked needs less memory; full runs the output layer as one GEMM).
    precisions: Optional[tuple] = None
    losses: tuple = ("chunked", "full")
    # parallel.ac_modules sets tried where a layout without checkpointing (ac=none) runs out of device
    # memory only, cheapest recompute first: Megatron's --recompute-modules, by hpctrain.parallel.activation's
    # names. Dense models take the ones without moe*, MoE models all; the sets without norm serve tensor
    # parallel, under which the rule book refuses norm.
    ac_module_sets: tuple = (("norm",), ("mlp",), ("norm", "mlp"), ("attention", "mlp"), ("attention", "norm", "mlp"),
                             ("moe_act",), ("norm", "moe_act"), ("attention", "moe_act"), ("attention", "norm", "moe_act"),
                             ("norm", "moe"))


@dataclass
class Candidate:
    job: Job
    problems: list  # messages that name the keys and a fix
    reasons: list = field(default_factory=list)  # short forms, for counting
    memory: Optional[Memory] = None
    time: Optional[Throughput] = None

    @property
    def fits(self) -> bool:
        return not self.problems


@dataclass
class SearchResult:
    ranked: list  # Candidates that fit, fastest first
    failures: Counter  # short reason -> layouts refused for it
    examples: dict  # short reason -> one refused Candidate
    considered: int
    near_misses: list = field(default_factory=list)  # refused only for device memory, least over first


def knobs(job: Job) -> dict:
    """The layout's knobs as the search sets them (hpctrain.core.spec.KNOBS names), the resolved values
    where a choice has an automatic one: what `nearest` compares and what parallel=auto applies."""
    sp, lay = job.spec, job.spec.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "ep": lay.ep,
            "cp": lay.cp, "zero": sp.zero, "offload": sp.offload, "ac": sp.ac, "micro_batch": sp.micro_batch,
            "schedule": sp.schedule if lay.pp > 1 else "-",
            "virtual_stages": sp.virtual_stages if sp.schedule == "interleaved_1f1b" and lay.pp > 1 else 1,
            "grad_sync": sp.grad_sync, "precision": sp.precision, "loss": sp.loss, "ac_modules": list(sp.ac_modules),
            # Blocks per stage, automatic or parallel.pp_layers: equal splits compare equal either way.
            "pp_layers": list(sp.pipeline.layers) if sp.pipeline else []}


def choice(job: Job) -> dict:
    """{config key: value} that selects this layout on top of the config it was searched from: the
    knobs the search varies (hpctrain.core.spec.updated applies it; overrides_of writes it out)."""
    sp, lay = job.spec, job.spec.layout
    chosen = dict(layout=lay, zero=sp.zero, offload=sp.offload, ac=sp.ac, micro_batch=sp.micro_batch,
                  precision=sp.precision, loss=sp.loss, ac_modules=list(sp.ac_modules))
    if sp.ac == "selective":
        chosen["ac_every"] = sp.ac_every
    if lay.cp > 1:
        chosen["cp_attention"] = sp.cp_attention
    # the resolved grad_sync and the split asked for, always: a user's grad_sync=microbatch or pp_layers
    # would not fit another pipeline degree
    chosen.update(grad_sync=sp.grad_sync, pp_layers=list(sp.pp_layers))
    if lay.pp > 1:
        chosen["schedule"] = sp.schedule
        if sp.schedule == "interleaved_1f1b":
            chosen["virtual_stages"] = sp.virtual_stages
    return knob_changes(**chosen)


def layout_problems(job: Job) -> list[tuple[str, str]]:
    """(short reason, message) for what keeps a layout from running at all, before memory: the rule book."""
    return [(p.reason, p.message) for p in rules.problems(job.spec)]


def evaluate(job: Job, sw: Software = HPCTRAIN) -> Candidate:
    """Price one layout: structural problems first, then memory, then (if it fits) time."""
    found = layout_problems(job)
    cand = Candidate(job=job, problems=[msg for _, msg in found], reasons=[r for r, _ in found])
    if found:
        return cand
    cand.memory = memory(job)
    if cand.memory.problems:
        cand.problems = list(cand.memory.problems)
        cand.reasons = [p.split(":")[0] for p in cand.memory.problems]
        return cand
    cand.time = throughput(job, sw)
    return cand


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cluster: ClusterConfig, world: int, space: Space) -> Iterator[tuple[Layout, int]]:
    """(mesh, ZeRO stage) pairs. ZeRO-0 replicates over all data-parallel ranks; ZeRO >= 1 shards
    over dp_shard and may replicate across dp_replicate groups (HSDP) whose shard group fills nodes."""
    rpn = ranks_per_node(cluster)
    for tp in divisors(world):
        if tp > rpn:
            break
        for pp in divisors(world // tp):
            for cp in cps(world // (tp * pp), space):
                dp = world // (tp * pp * cp)
                for zero in space.zeros:
                    if zero == 0:
                        yield Layout(pp=pp, dp_replicate=1, dp_shard=dp, tp=tp, cp=cp), zero
                        continue
                    for rep in divisors(dp):
                        shard = dp // rep
                        if rep == 1 or (zero == 3 and (shard * cp * tp) % rpn == 0):
                            # expert parallel: a split of dp_shard into whole experts (FSDP2 only)
                            eps = [e for e in divisors(shard) if space.experts % e == 0] \
                                if space.experts and zero >= 2 else [1]
                            for ep in eps:
                                yield Layout(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, cp=cp), zero


def cps(ranks: int, space: Space) -> list[int]:
    """Context-parallel degrees to try over `ranks`: 1, and for long sequences the powers of two that
    divide the ranks and split the sequence into whole chunk pairs."""
    out = [1]
    c = 2
    while space.seq_len >= space.cp_from and c <= min(ranks, space.cp_max):
        if ranks % c == 0 and space.seq_len % (2 * c) == 0:
            out.append(c)
        c *= 2
    return out


def jobs(base: Job, space: Space = Space(), world: Optional[int] = None) -> Iterator[Job]:
    if base.model.moe.experts and not space.experts:
        space = replace(space, experts=base.model.moe.experts)
    if not space.seq_len:
        space = replace(space, seq_len=base.spec.seq_len)
    for lay, zero in layouts(base.cluster, world or base.world, space):
        scheds = [(s, v) for s in space.schedules for v in (space.virtual_stages if s == "interleaved_1f1b" else (1,))]
        for offload in (space.offloads if zero >= 1 else ("none",)):
            for ac in space.acs:
                for mb in space.micro_batches:
                    syncs = space.grad_syncs if zero >= 2 and lay.pp == 1 else ("auto",)
                    for sched, v in (scheds if lay.pp > 1 else [("1f1b", 1)]):
                        for sync in syncs:
                            yield base.with_(layout=lay, zero=zero, offload=offload, ac=ac, ac_every=space.ac_every,
                                             micro_batch=mb, schedule=sched, virtual_stages=v, grad_sync=sync,
                                             pp_layers=())


def precisions(base: Job, space: Space) -> tuple:
    """The precisions the search tries: Space.precisions, or the request's and, for a bf16 request on
    GPUs with FP8 (cluster.fp8_tflops > 0), fp8 (the rule book refuses it where the GPU cannot)."""
    if space.precisions is not None:
        return space.precisions
    pr = base.spec.precision
    return (pr, "fp8") if pr == "bf16" and base.cluster.fp8_tflops > 0 else (pr,)


def refinements(job: Job, base: Job, space: Space) -> Iterator[Job]:
    """The same layout in the other precisions and losses the search tries (the layout's own first)."""
    for pr in precisions(base, space):
        for loss in space.losses:
            if (pr, loss) != (job.spec.precision, job.spec.loss):
                yield job.with_(precision=pr, loss=loss)


def module_sets(job: Job, space: Space) -> Iterator[Job]:
    """ac=none layouts with parallel.ac_modules: the sets that name modules this model has."""
    moe = bool(job.model.moe.experts)
    for mods in space.ac_module_sets:
        if moe or not any(m.startswith("moe") for m in mods):
            yield job.with_(ac_modules=list(mods))


def search(base: Job, space: Space = Space(), sw: Software = HPCTRAIN, world: Optional[int] = None) -> SearchResult:
    """Every layout of `base`'s model, batch and cluster over `world` ranks (default: base's);
    `base`'s own layout does not matter. Each layout that fits is also priced in the other precisions
    and losses (refinements); each layout without checkpointing that runs out of device memory only is
    priced with parallel.ac_modules (module_sets), the first set that fits kept."""
    ranked, failures, examples, misses, n = [], Counter(), {}, [], 0
    base = base.with_(ac_modules=[]) if base.spec.ac_modules else base
    for job in jobs(base, space, world):
        n += 1
        cand = evaluate(job, sw)
        if not cand.fits and cand.reasons == ["device memory"] and job.spec.ac == "none":
            # the layout, refused without checkpointing, counts once: as the first module set that fits
            cand = next((alt for alt in map(lambda j: evaluate(j, sw), module_sets(job, space)) if alt.fits), cand)
        if cand.fits:
            ranked.append(cand)
            for variant in refinements(cand.job, base, space):
                alt = evaluate(variant, sw)
                if alt.fits:  # (a refinement that does not fit is not another layout refused)
                    n += 1
                    ranked.append(alt)
            continue
        for r in cand.reasons:
            failures[r] += 1
            examples.setdefault(r, cand)
        if cand.reasons == ["device memory"]:
            misses.append(cand)
    ranked.sort(key=lambda c: (-c.time.tokens_per_s, c.memory.device_total))
    misses.sort(key=lambda c: c.memory.device_total / c.memory.device_limit)
    return SearchResult(ranked=ranked, failures=failures, examples=examples, considered=n, near_misses=misses[:3])


def nearest(job: Job, ranked: list, k: int = 3) -> list:
    """The fitting layouts that change the fewest knobs of `job`, fastest first among equals."""
    want = knobs(job)

    def distance(c: Candidate) -> int:
        have = knobs(c.job)
        return sum(want[x] != have[x] for x in NEAREST)

    return sorted(ranked, key=lambda c: (distance(c), -c.time.tokens_per_s))[:k]
