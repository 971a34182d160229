"""Enumerate layouts of a model on a cluster, keep those that can run and fit, rank them by predicted
tokens/s, and say why the rest cannot run. Pure arithmetic: a 64-GPU search takes about a second.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from hpctrain.checks.config_checks import cp_fallback_problem
from hpctrain.plan.memory import Job, Memory, memory
from hpctrain.core.spec import ZERO_STAGES, Layout, ranks_per_node
from hpctrain.plan.throughput import HPCTRAIN, Software, Throughput, throughput
from hpctrain.core.schema import ClusterConfig

# The knobs a layout is made of; `nearest` counts how many of them differ.
KNOBS = ("tp", "pp", "dp_replicate", "zero", "offload", "ac", "micro_batch", "schedule", "virtual_stages")


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
    lay = job.knobs.layout
    return {"tp": lay.tp, "pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "ep": lay.ep,
            "cp": lay.cp,
            "zero": job.knobs.zero, "offload": job.knobs.offload, "ac": job.knobs.ac, "micro_batch": job.knobs.micro_batch,
            "schedule": job.knobs.schedule if lay.pp > 1 else "-",
            "virtual_stages": job.knobs.virtual_stages if job.knobs.schedule == "interleaved_1f1b" and lay.pp > 1 else 1,
            "grad_sync": job.spec.grad_sync,
            # Blocks per stage, automatic or parallel.pp_layers: equal splits compare equal either way.
            "pp_layers": list(job.spec.pipeline.layers) if job.spec.pipeline else []}


def overrides(job: Job) -> list[str]:
    """The command-line overrides that select this layout."""
    k = knobs(job)
    out = [f"parallel.tp={k['tp']}", f"parallel.pp={k['pp']}", f"parallel.dp_replicate={k['dp_replicate']}",
           f"parallel.dp_shard={k['dp_shard']}", *([f"parallel.ep={k['ep']}"] if job.model.moe.experts else []),
           *([f"parallel.cp={k['cp']}", f"parallel.cp_attention={job.knobs.cp_attention}"] if k["cp"] > 1 else []),
           f"parallel.zero={k['zero']}", f"parallel.ac={k['ac']}",
           f"train.micro_batch={k['micro_batch']}", f"offload.target={k['offload']}"]
    if job.knobs.ac == "selective":
        out.append(f"parallel.ac_every={job.knobs.ac_every}")
    if job.knobs.zero >= 2 and job.knobs.layout.pp == 1:
        out.append(f"parallel.grad_sync={job.spec.grad_sync}")
    if job.knobs.layout.pp > 1:
        out.append(f"parallel.pp_schedule={job.knobs.schedule}")
        if job.knobs.schedule == "interleaved_1f1b":
            out.append(f"parallel.pp_virtual_stages={job.knobs.virtual_stages}")
        if job.knobs.pp_layers:
            out.append(f"parallel.pp_layers=[{','.join(map(str, job.knobs.pp_layers))}]")
    return out


def layout_problems(job: Job) -> list[tuple[str, str]]:
    """(short reason, message) for what keeps a layout from running at all, before memory."""
    m, lay = job.model, job.knobs.layout
    out = []
    for key in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(m, key) % lay.tp:
            out.append((f"model.{key} % tp", f"model.{key}={getattr(m, key)} is not divisible by parallel.tp={lay.tp}"))
    if lay.cp > 1 and job.knobs.seq_len % (2 * lay.cp):
        out.append(("cp", f"parallel.cp={lay.cp} needs data.seq_len={job.knobs.seq_len} divisible by {2 * lay.cp}"))
    fallback = cp_fallback_problem(job.spec, m.n_heads)
    if fallback:
        out.append(("cp on CUDA with hpctrain's kernel (unpriced)", fallback))
    if lay.ep > 1 and (job.knobs.zero < 2 or lay.dp_shard % lay.ep or m.moe.experts % lay.ep):
        out.append(("ep", f"parallel.ep={lay.ep} needs parallel.zero >= 2 and to divide dp_shard={lay.dp_shard} "
                          f"and model.moe.experts={m.moe.experts}"))
    # Layers need not divide into stages (hpctrain.core.spec.split_layers splits them unevenly); every stage
    # but the first and the last needs a block.
    stages = job.spec.pipeline.stages if job.spec.pipeline else 1
    if stages > m.n_layers + 2:
        out.append(("stages > n_layers + 2",
                    f"parallel.pp={lay.pp} with schedule {job.knobs.schedule} makes {stages} stages, more than "
                    f"model.n_layers={m.n_layers} blocks + the embedding and the output layer"))
    if lay.dp < 1 or job.knobs.global_batch % (lay.dp * job.knobs.micro_batch):
        out.append(("global_batch % (dp x micro_batch)",
                    f"train.global_batch={job.knobs.global_batch} is not divisible by data-parallel ranks "
                    f"({lay.dp}) x train.micro_batch={job.knobs.micro_batch}"))
    if lay.pp > 1 and lay.dp >= 1 and job.microbatches < lay.pp:
        out.append(("micro-batches < pp", f"{job.microbatches} micro-batches per step for parallel.pp={lay.pp}: "
                                          "a pipeline needs at least pp micro-batches"))
    if lay.pp > 1 and job.knobs.schedule == "interleaved_1f1b":
        if job.microbatches % lay.pp:
            out.append(("interleaved: micro-batches % pp",
                        f"interleaved 1F1B needs micro-batches ({job.microbatches}) to be a multiple of pp={lay.pp}"))
    if job.knobs.offload != "none" and job.knobs.zero < 1:
        out.append(("offload needs zero >= 1", f"offload.target={job.knobs.offload} needs parallel.zero >= 1"))
    return out


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
        space = replace(space, seq_len=base.knobs.seq_len)
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


def search(base: Job, space: Space = Space(), sw: Software = HPCTRAIN, world: Optional[int] = None) -> SearchResult:
    """Every layout of `base`'s model, batch and cluster over `world` ranks (default: base's);
    `base`'s own layout does not matter."""
    ranked, failures, examples, misses, n = [], Counter(), {}, [], 0
    for job in jobs(base, space, world):
        n += 1
        cand = evaluate(job, sw)
        if cand.fits:
            ranked.append(cand)
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
        return sum(want[x] != have[x] for x in KNOBS)

    return sorted(ranked, key=lambda c: (distance(c), -c.time.tokens_per_s))[:k]
