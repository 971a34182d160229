"""One typed Config, one derived EngineSpec, one rule book (issue 44).

A run's config is changed after composing only by `hpctrain.core.spec.updated` (parallel=auto's choice,
elastic shrinking, the planner's layouts), and the rules that keep a layout from running are read from
one book (`hpctrain.core.rules`) by the login node's checks, the planner's search and every rank."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpctrain.checks.config_checks import problems
from hpctrain.core import rules
from hpctrain.core.compose import compose, to_dict, to_yaml
from hpctrain.core.schema import AC, Config
from hpctrain.core.spec import KNOBS, engine_spec, overrides_of, updated
from hpctrain.plan.elastic import shrink
from hpctrain.plan.login import choose_layout
from hpctrain.plan.memory import job_of
from hpctrain.plan.search import Space, knobs, layout_problems, search

from helpers import REPO

TINY = ["+experiment=tiny", "launcher.nproc=4"]


def test_parallel_auto_returns_the_config_of_the_layout_it_chose():
    """parallel=auto asked with cp=2 on short sequences: the search (which tries cp only from 16K tokens)
    chooses a cp=1 layout, and the config it returns has every knob of that layout, cp=1 included; the
    overrides it prints make the same config. Before issue 44 the choice travelled as override strings
    that left cp out, and the run was refused (pp x dp_shard x cp x tp = 8 on 4 ranks). Mutants caught:
    a knob left out of search.choice (cp, micro_batch); bools or lists written wrongly by overrides_of."""
    asked = [*TINY, "parallel.cp=2", "parallel=auto", "parallel.ac=full", "train.micro_batch=1"]
    cfg = compose(asked)
    chosen, printed = choose_layout(cfg, for_launch=True)
    top = search(job_of(cfg), Space(offloads=("none",)), world=4).ranked[0].job
    assert knobs(job_of(chosen)) == knobs(top)
    assert chosen.parallel.cp == 1 and not chosen.parallel.auto and cfg.parallel.cp == 2  # cfg left as it was
    assert isinstance(chosen.parallel.ac, AC)  # the schema's types, as config.yaml writes them
    assert problems(chosen) == []
    assert to_dict(compose([*asked, *printed])) == to_dict(chosen)


def test_elastic_shrinking_returns_a_new_config():
    """Mutant caught: the shrunk config made by changing the running one in place (its nodes then 1)."""
    cfg = compose(["+experiment=tiny", "cluster=local", "launcher=sbatch", "dry_run=true", "parallel.dp_shard=4"])
    new, _ = shrink(cfg, 1)
    assert (new.cluster.nodes, new.parallel.dp_shard) == (1, -1)
    assert (cfg.cluster.nodes, cfg.parallel.dp_shard) == (2, 4)
    assert engine_spec(new).layout.world == 2


def test_a_jobs_other_knobs_keep_the_world_it_was_planned_on():
    """job_of on 16 ranks of a config whose dp_shard is the rest (-1): the search's changes keep the 16.
    Mutant caught: the resolved layout not written back (dp_shard worked out again from the launcher's
    own world, 64 GPUs for the 70B preset)."""
    job = job_of(compose(["+experiment=70b"]), 16)
    assert job.world == 16 and job.with_(zero=1).world == 16


def test_updated_takes_config_keys_only_and_makes_the_schemas_types():
    cfg = Config()
    new = updated(cfg, {"parallel.ac": "full", "parallel.pp_layers": (1, 2), "cluster.nodes": 3})
    assert (new.parallel.ac, new.parallel.pp_layers, new.cluster.nodes) == (AC("full"), [1, 2], 3)
    assert (cfg.parallel.ac, cfg.parallel.pp_layers, cfg.cluster.nodes) == (AC("none"), [], 1)
    assert new.train is cfg.train  # what did not change is shared, not copied
    for key in ("parallel.zer0", "paralel.tp", "parallel"):
        with pytest.raises(KeyError, match=f"{key} is not a config key"):
            updated(cfg, {key: 1})


def test_overrides_of_writes_what_composing_reads_back():
    """Mutant caught: lists written as a tuple's repr (Hydra reads a string)."""
    changes = {"train.compile": True, "parallel.pp_layers": [1, 2], "parallel.ac": AC("full")}
    cfg = compose([*TINY, *overrides_of(changes)])
    assert (cfg.train.compile, cfg.parallel.pp_layers, cfg.parallel.ac) == (True, [1, 2], "full")


def test_every_knob_is_a_config_key_the_spec_reads():
    """The knob table names real keys, and the spec reads each back as the config holds it (a knob the
    table maps to the wrong key fails here)."""
    cfg = compose(TINY)
    spec = engine_spec(cfg)
    # resolved by the spec (grad_sync, sp_regather, cp_kernel, reduce_precision: spec.dtypes.reduce) or
    # read through spec.layout
    raw = {"grad_sync", "sp_regather", "cp_kernel", "reduce_precision", "pp", "dp_replicate", "dp_shard", "tp",
           "ep", "cp"}
    for name, key in KNOBS.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if name not in raw:
            got = getattr(spec, name)
            assert got == (tuple(value) if isinstance(value, list) else value), name
        updated(cfg, {key: value})  # a config key


# Layouts each rule refuses, on the tiny model (4 heads, 2 KV heads, ffn 256, 4 ranks).
REFUSED = {
    "parallel.tp=3 parallel.dp_shard=1 launcher.nproc=3": "model.n_heads=4 is not divisible by parallel.tp=3",
    "model.moe.experts=4 parallel.ep=3 parallel.dp_shard=4": "parallel.ep=3 does not divide parallel.dp_shard=4",
    "parallel.cp=2 data.seq_len=66": "data.seq_len=66 is not divisible by 2 x parallel.cp=4",
    "train.global_batch=6": "train.global_batch=6 is not divisible by data-parallel ranks (4)",
    "parallel.pp=2 parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual_stages=2 train.global_batch=6 "
    "train.micro_batch=1": "3 micro-batches per step",
    "parallel.zero=1 parallel.pp=2 offload=cpu": "the optimizer sharded by parameter owner does not offload",
    "parallel.zero=1 train.reduce_precision=bf16": "train.reduce_precision=bf16 with parallel.zero=1: only FSDP2",
    "parallel.dp_shard=3": "= 3, but the launcher provides 4 ranks (launcher.nproc=4). Fix: set parallel.dp_shard=-1",
}


@pytest.mark.parametrize("overrides,words", REFUSED.items())
def test_one_rule_one_wording_on_the_login_node_and_in_the_planner(overrides, words):
    """The config check and the planner's search refuse with the same message, from the book. Before
    issue 44 the planner ranked ZeRO-1 with offload under pipelining as fitting (56 layouts of the 70B
    preset) while the checks refused it. Mutant caught: a rule the search skips (layout_problems
    without rules.problems)."""
    cfg = compose([*TINY, *overrides.split()])
    from_book = [p.message for p in rules.problems(engine_spec(cfg))]
    assert any(words in m for m in from_book), from_book
    assert [m for m in problems(cfg) if words in m] == [m for m in from_book if words in m]
    assert [m for _, m in layout_problems(job_of(cfg)) if words in m] == [m for m in from_book if words in m]


@pytest.mark.slow
def test_a_rank_started_without_the_login_node_refuses_by_the_book(tmp_path):
    """torchrun or mpiexec straight on a run directory: the rank reads the same book before torch or a
    mesh, and says what the login node would have (tp 3 over 4 heads used to reach DTensor's sharding).
    Mutant caught: run.py without the rules check (the rank then fails deep in torch)."""
    cfg = compose(["+experiment=tiny", "parallel.tp=3", "parallel.dp_shard=1", "launcher.nproc=3",
                   f"run.dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "hpctrain.run", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.n_heads=4 is not divisible by parallel.tp=3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_reduce_precision_bf16_is_priced_where_fsdp_reduces():
    """train.reduce_precision, the knob issue 44 added end to end: the planner prices the reduce-scatter
    of the 70B preset (ZeRO-3) in bf16, FSDP2's reduce buffer (the largest unit's gradient) in 2 bytes an
    element instead of 4, and nothing else in memory. Mutants caught: the planner's reduce bytes left at 4
    (no difference); the spec's dtypes ignoring the key."""
    from hpctrain.plan.memory import memory, stage_params
    from hpctrain.plan.throughput import throughput

    job = job_of(compose(["+experiment=70b"]))
    half = job.with_(reduce_precision="bf16")
    assert (job.spec.dtypes.reduce, half.spec.dtypes.reduce) == ("float32", "bfloat16")
    full, halved = memory(job).device, memory(half).device
    unit = stage_params(job, 0).largest_unit
    assert full["fsdp_buffers"] - halved["fsdp_buffers"] == pytest.approx(2 * unit)
    assert {k for k in full if full[k] != halved[k]} <= {"fsdp_buffers", "fragmentation"}

    def dp_bytes(j):
        return {c["op"]: c["bytes"] for c in throughput(j).collectives if c["dim"].startswith("dp")}
    assert dp_bytes(half)["reduce_scatter"] == pytest.approx(dp_bytes(job)["reduce_scatter"] / 2)
    assert dp_bytes(half)["all_gather"] == dp_bytes(job)["all_gather"]  # parameters: bf16 either way
