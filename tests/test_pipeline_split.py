"""Uneven pipeline splits: the automatic split by weight (hpctrain.core.spec.split_layers), parallel.pp_layers
and its refusals, the planner and parallel=auto on layers that do not divide, and Llama 3 405B's
published layout (126 layers, TP8 PP16 DP64) planned on 8,192 H100s. Pure arithmetic, no torch; the
engine running these splits against the reference is tests/test_layouts.py (UNEVEN_BLOCKS)."""
from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache

import pytest

from hpctrain.core.compose import compose
from hpctrain.core.schema import ModelConfig
from hpctrain.checks.config_checks import problems
from hpctrain.plan.memory import GiB, job_of, memory
from hpctrain.plan.verdict import plan
from hpctrain.plan.search import Space, layout_problems, search
from hpctrain.core.spec import auto_layers, engine_spec, split_layers, stage_owners

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


@lru_cache(maxsize=None)
def _model(name: str) -> ModelConfig:
    return compose([f"model={name}"]).model


def model(name: str, **kw) -> ModelConfig:
    return replace(_model(name), **kw)


def rank_costs(blocks, extra, owner) -> list:
    out = [0.0] * (max(owner) + 1)
    for s, k in enumerate(blocks):
        out[owner[s]] += k + extra[s]
    return out


# --- the automatic split ----------------------------------------------------------------------


@pytest.mark.slow
def test_every_split_sums_to_the_layers_with_a_block_on_every_middle_stage():
    for name, pp, sched, v in itertools.product(("tiny", "small", "8b", "70b", "405b"), (2, 3, 4, 8, 16),
                                                SCHEDULES, (2, 4)):
        m = model(name)
        per = 1 if sched in ("gpipe", "1f1b") else 2 if sched in ("zbv", "dualpipev") else v
        if pp * per > m.n_layers + 2:
            continue
        got = auto_layers(m, pp, sched, v)
        assert len(got) == pp * per and sum(got) == m.n_layers, (name, pp, sched, v, got)
        assert min(got[1:-1], default=1) >= 1 and min(got) >= 0, (name, pp, sched, v, got)


def test_small_embedding_and_output_keep_the_even_split():
    # vocab 256 x dim 128 against a 197k-parameter block: the ends cost 0.08 and 0.17 of a block.
    tiny = model("tiny", n_layers=8)
    for sched in SCHEDULES:
        per = 1 if sched in ("gpipe", "1f1b") else 2
        assert auto_layers(tiny, 2, sched, 2) == (8 // (2 * per),) * (2 * per), sched
    assert auto_layers(model("tiny", n_layers=16), 4, "1f1b", 1) == (4, 4, 4, 4)


def test_a_large_vocabulary_lightens_the_first_and_last_stage():
    # Llama 3 405B: the embedding costs 0.33 blocks (half its parameters: a lookup), the output layer 0.66.
    m = model("405b")
    assert auto_layers(m, 16, "1f1b", 1) == (7,) + (8,) * 14 + (7,)  # the published layout
    # Two stages per rank: rank 0 of a V-shaped schedule runs both ends, so both are light.
    for sched in ("interleaved_1f1b", "zbv", "dualpipev"):
        got = auto_layers(m, 16, sched, 2)
        assert got == (3,) + (4,) * 30 + (3,), sched
    owner = stage_owners("zbv", 16, 2)
    assert [sum(k for k, r in zip(auto_layers(m, 16, "zbv", 1), owner) if r == 0)] == [6]
    # One block per chunk, the first chunk the embedding alone and the last the output layer alone.
    assert auto_layers(m, 16, "interleaved_1f1b", 8) == (0,) + (1,) * 126 + (0,)
    # The output layer outweighs the embedding: an odd block goes to the first stage.
    assert auto_layers(model("tiny", n_layers=3), 2, "1f1b", 1) == (2, 1)
    # Layers that divide: today's split for one stage per rank (stages filled in order, the last
    # takes the shortfall), balanced by rank for two (old per-stage split: 10, 11 x 6, 4 -> ranks 22).
    m70 = model("70b")
    assert auto_layers(m70, 4, "1f1b", 1) == (20, 21, 21, 18)
    zbv = auto_layers(m70, 4, "zbv", 1)
    assert zbv == (10, 11, 11, 11, 10, 10, 10, 7)
    assert max(rank_costs(zbv, [0.61] + [0] * 6 + [1.23], stage_owners("zbv", 4, 2))) == pytest.approx(21)


def _compositions(n: int, least: list):
    if len(least) == 1:
        if n >= least[0]:
            yield (n,)
        return
    for k in range(least[0], n + 1):
        for rest in _compositions(n - k, least[1:]):
            yield (k,) + rest


def test_split_minimizes_the_busiest_rank_then_the_busiest_stage():
    # Against every split of a few blocks: the largest rank cost first, then the largest stage cost.
    cases = 0
    for sched, pp, per in (("1f1b", 3, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 2, 3),
                           ("interleaved_1f1b", 3, 2), ("zbv", 2, 2), ("zbv", 3, 2)):
        stages = pp * per
        owner = stage_owners(sched, pp, per)
        least = [0] + [1] * (stages - 2) + [1 if stages == 1 else 0]
        for n in range(max(1, stages - 2), 10):
            for e, o in ((0.08, 0.17), (0.33, 0.66), (1.3, 2.6), (0.5, 0.5)):
                extra = [e] + [0.0] * (stages - 2) + [o]

                def cost(blocks):
                    return (round(max(rank_costs(blocks, extra, owner)), 9),
                            round(max(k + x for k, x in zip(blocks, extra)), 9))

                best = min(cost(b) for b in _compositions(n, least))
                got = split_layers(n, tuple(extra), owner)
                assert sum(got) == n and cost(got) == best, (sched, pp, per, n, e, o, got, cost(got), best)
                cases += 1
    assert cases > 100


# --- parallel.pp_layers -----------------------------------------------------------------------

BASE = ["+experiment=tiny", "model.n_layers=3", "launcher.nproc=2", "parallel.pp=2", "parallel.dp_shard=1"]


@pytest.mark.slow
def test_pp_layers_sets_the_blocks_of_each_stage():
    spec = engine_spec(compose([*BASE, "parallel.pp_layers=[1,2]"]))
    assert spec.pipeline.blocks == ((0, 1), (1, 3)) and spec.pipeline.layers == (1, 2)
    assert engine_spec(compose(BASE)).pipeline.layers == (2, 1)  # automatic
    # Interleaved: stage order, rank 0 runs stages 0 and 2; the first stage may hold the embedding alone.
    inter = engine_spec(compose([*BASE, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layers=[0,2,1,0]"]))
    assert inter.pipeline.rank_blocks(0) == 1 and inter.pipeline.rank_blocks(1) == 2
    assert not problems(compose([*BASE, "parallel.pp_layers=[1,2]"]))
    # The planner prices the split asked for.
    job = job_of(compose([*BASE, "parallel.pp_layers=[1,2]"]))
    assert (job.stage_layers(0), job.stage_layers(1)) == (1, 2)


@pytest.mark.parametrize("split,why", [
    ("[3]", "it has 1 entry, but parallel.pp=2 makes 2 stages"),
    ("[1,1,1]", "it has 3 entries, but parallel.pp=2 makes 2 stages"),
    ("[1,1]", "it sums to 2 blocks, but model.n_layers=3"),
    ("[4,-1]", "stage 1 would hold a negative number of blocks"),
])
def test_pp_layers_that_cannot_split_are_refused_with_the_automatic_split(split, why):
    found = problems(compose([*BASE, f"parallel.pp_layers={split}"]))
    assert len(found) == 1, found
    assert found[0].startswith(f"parallel.pp_layers={split} cannot split the model") and why in found[0], found[0]
    assert "Fix: parallel.pp_layers=[2,1] (the automatic split), or parallel.pp_layers=[] to use it" in found[0]
    with pytest.raises(ValueError, match="parallel.pp_layers"):  # the engine refuses it too
        engine_spec(compose([*BASE, f"parallel.pp_layers={split}"]))


@pytest.mark.slow
def test_pp_layers_refusals_name_stages_per_rank_and_empty_middle_stages():
    zbv = problems(compose([*BASE, "parallel.pp_schedule=zbv", "parallel.pp_layers=[2,1]"]))
    assert len(zbv) == 1 and "parallel.pp=2 x 2 stages per rank (zbv) makes 4 stages" in zbv[0], zbv
    assert "Fix: parallel.pp_layers=[1,1,1,0]" in zbv[0]
    empty = problems(compose([*BASE, "parallel.pp_schedule=zbv", "parallel.pp_layers=[2,0,1,0]"]))
    assert len(empty) == 1 and "stage 1 would hold no blocks" in empty[0] and "except the first and the last" in empty[0]
    one = problems(compose(["+experiment=tiny", "parallel.pp_layers=[2]"]))
    assert one == ["parallel.pp_layers=[2] splits pipeline stages, and parallel.pp=1 has none. Fix: parallel.pp_layers=[]"]


# --- the planner ------------------------------------------------------------------------------


def test_memory_prices_the_heaviest_middle_rank_of_an_uneven_split():
    base = ["+experiment=tiny", "model=small", "launcher.nproc=4", "parallel.pp=4", "parallel.dp_shard=1",
            "train.global_batch=8", "train.micro_batch=1"]
    even, heavy = (job_of(compose([*base, f"parallel.pp_layers={s}"])) for s in ("[2,2,2,2]", "[1,1,5,1]"))
    assert memory(heavy).stage == 2 and memory(heavy).device_total > memory(even).device_total


def test_layers_need_not_divide_into_stages_for_parallel_auto():
    job = job_of(compose(["model=405b", "cluster=h100", "launcher=sbatch", "cluster.nodes=32",
                          "cluster.gpus_per_node=8", "parallel.tp=8", "parallel.pp=16", "parallel.dp_shard=2",
                          "data.seq_len=8192", "train.global_batch=32", "train.micro_batch=1", "parallel.ac=full"]))
    assert not layout_problems(job)
    for v in (2, 4):
        assert not layout_problems(job.with_(schedule="interleaved_1f1b", virtual_stages=v))
    res = search(job, Space(zeros=(3,), offloads=("none",), acs=("full",), micro_batches=(1,)))
    assert {c.job.spec.layout.pp for c in res.ranked} >= {16, 32}, sorted({c.job.spec.layout.pp for c in res.ranked})


@pytest.mark.slow
def test_llama3_405b_published_layout_fits_8192_h100():
    """Llama 3 405B as published (Llama 3 paper, table 4): TP8 PP16 DP64 on 8,192 H100 80GB, 8k sequences,
    16M tokens (2,048 sequences) a step. FSDP (ZeRO-3) over the 64 data-parallel ranks, full activation
    checkpointing, or every other block (selective), also interleaved. Without checkpointing it does not fit
    hpctrain's engine: 1F1B's first ranks hold up to 16 micro-batches of 7-8 blocks at 612 MiB each
    (6h + 2kv + 3ffn per token at TP 8, re-gathered), ~60 GiB of activations beside the gathered stage and
    the gradients; Meta's stack, which ran it so, keeps less per block."""
    overrides = ["model=405b", "cluster=h100", "launcher=sbatch", "cluster.nodes=1024", "cluster.gpus_per_node=8",
                 "parallel.tp=8", "parallel.pp=16", "parallel.dp_shard=64", "parallel.zero=3", "parallel.ac=full",
                 "data.seq_len=8192", "train.global_batch=2048", "train.micro_batch=1", "train.precision=bf16"]
    p = plan(job_of(compose(overrides)))
    assert p.fits and p.memory.device_total <= 80 * GiB, p.problems
    assert p.job.spec.pipeline.layers == (7,) + (8,) * 14 + (7,)
    # The interleaved form (a rank runs 8 one-block chunks; the embedding and the output layer are chunks of their own).
    inter = plan(job_of(compose([*overrides, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=8"])))
    assert inter.fits and inter.job.spec.pipeline.layers == (0,) + (1,) * 126 + (0,)
    assert inter.time.bubble_fraction < p.time.bubble_fraction
    every_other = [*overrides, "parallel.ac=selective", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=4"]
    assert plan(job_of(compose(every_other))).fits
    none = plan(job_of(compose([*overrides, "parallel.ac=none"])))
    assert not none.fits and 55 * GiB < none.memory.device["activations"] < 80 * GiB, none.memory.device


@pytest.mark.slow
def test_llama3_405b_dry_run_plans_the_published_layout(tmp_path):
    # Seconds on a 2-core VM (arithmetic, no torch); the timeout only keeps a regression from hanging.
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "model=405b", "cluster=h100", "launcher=sbatch",
                           "cluster.nodes=1024", "cluster.gpus_per_node=8", "parallel.tp=8", "parallel.pp=16",
                           "parallel.dp_shard=64", "parallel.zero=3", "parallel.ac=full", "data.seq_len=8192",
                           "train.global_batch=2048", "train.micro_batch=1", "train.precision=bf16", "dry_run=true",
                           f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipeline: 16 stages (1f1b), blocks per stage 7, 8 x 14, 7" in proc.stdout, proc.stdout
    assert "= 8192 ranks" in proc.stdout and "does not fit" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
