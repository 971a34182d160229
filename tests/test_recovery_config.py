"""The login node's side of memory snapshots and hot spares (issue 47): the refusals of
checkpoint.memory_* and cluster.spare_nodes with their fixes (config_checks.recovery_problems), the
snapshots' budget with its numbers (a plan's problem: the checks never import the planner),
the allocation that holds the spares (and the world that does not count them), the plan's text and
plan.json. Pure functions on composed configs: no launch, no Slurm. Each test names the mutant it
catches."""
from __future__ import annotations

import dataclasses
import math

import pytest

from hpctrain.checks.config_checks import compose_checked, problems, recovery_advice, recovery_problems
from hpctrain.core.compose import ConfigError
from hpctrain.core.flops import param_counts
from hpctrain.core.schema import BaseQuant
from hpctrain.core.spec import updated, world_size
from hpctrain.launch.allocation import allocation
from hpctrain.launch.sbatch import directives, sbatch_script
from hpctrain.launch.slurm import executor_parameters
from hpctrain.plan.login import plan_and_check
from hpctrain.plan.memory import GiB, gib, job_of
from hpctrain.plan.verdict import plan, plan_dict, summary

# Two nodes of two CPU ranks each under launcher=sbatch, ZeRO-3 over the 4 ranks (the tiny preset's).
TINY = ["+experiment=tiny", "launcher=sbatch", "cluster=local", "train.micro_batch=4", "cluster.nodes=2",
        "cluster.tasks_per_node=2", "checkpoint.memory_every=1"]


def composed(*overrides: str):
    cfg, refused = compose_checked([*TINY, *overrides])
    assert not refused, refused
    return cfg


@pytest.fixture(scope="module")
def base():
    return composed()


def with_lora(cfg, **changes):
    """`cfg` with model.lora.<key>=value, typed as composing them would (a compose costs ~1.5 s here;
    hpctrain.core.spec.updated takes two-part keys only)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora,
                                                                                                  **changes)))


@pytest.fixture(scope="module")
def lora(base):
    return with_lora(base, rank=4)


@pytest.fixture(scope="module")
def qlora(lora):
    return with_lora(lora, quantize=BaseQuant("nf4"))


def only(found: list[str]) -> str:
    assert len(found) == 1, found
    return found[0]


def assert_mentions(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} not in message:\n{msg}"


def test_a_config_that_can_run_has_no_refusal(base):
    """Memory snapshots every step on two Slurm nodes with a spare; and the defaults (all off). Mutants: a
    refusal whose condition always holds (e.g. spare_nodes >= 0, memory_every >= 0)."""
    assert recovery_problems(updated(base, {"cluster.spare_nodes": 1})) == []
    assert recovery_problems(updated(base, {"checkpoint.memory_every": 0})) == []
    assert recovery_problems(updated(base, {"launcher.name": "slurm"})) == []
    assert recovery_problems(updated(base, {"launcher.name": "local"})) == []


# (changes to the base config, what the one refusal must say). Mutant of each row: its condition
# dropped (no refusal) or widened to the valid configs above.
REFUSALS = {
    "memory_every<0": ({"checkpoint.memory_every": -1},
                       ["checkpoint.memory_every=-1 must be 0", "Fix: checkpoint.memory_every=0"]),
    "k8s": ({"launcher.name": "k8s"},
            ["checkpoint.memory_every=1 needs hpctrain's node agents", "launcher=k8s",
             "Fix: launcher=sbatch (or slurm, local)", "or checkpoint.memory_every=0"]),
    "spare<0": ({"cluster.spare_nodes": -1}, ["cluster.spare_nodes=-1 must be 0 or more", "Fix: cluster.spare_nodes=0"]),
    "spare without snapshots": ({"cluster.spare_nodes": 2, "checkpoint.memory_every": 0},
                                ["cluster.spare_nodes=2", "checkpoint.memory_every=0 takes none",
                                 "Fix: checkpoint.memory_every=1"]),
    "spare on local": ({"cluster.spare_nodes": 1, "launcher.name": "local"},
                       ["cluster.spare_nodes=1", "launcher=local runs without a Slurm allocation",
                        "Fix: launcher=sbatch (or slurm)"]),
    "nvme": ({"offload.target": "nvme", "offload.path": "/nvme"},
             ["offload.target=nvme", "a memory snapshot does not hold", "Fix: offload.target=cpu (or none)"]),
    "relative dir": ({"checkpoint.memory_dir": "shm"},
                     ["checkpoint.memory_dir=shm must be an absolute path", "Fix: checkpoint.memory_dir=/dev/shm"]),
    # This machine's own root file system: a disk, not its memory (checked on the login node for launcher=local,
    # where it is the node; each agent checks its own node otherwise).
    "not a tmpfs": ({"checkpoint.memory_dir": "/", "launcher.name": "local"},
                    ["checkpoint.memory_dir=/ is on a", "not a tmpfs", "Fix: checkpoint.memory_dir=/dev/shm"]),
    "container": ({"cluster.container_image": "nvcr.io#nvidia/pytorch:24.05-py3"},
                  ["cluster.container_image", "are not started in the image", "or checkpoint.memory_every=0"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_names_its_keys_and_fix(base, case):
    changes, parts = REFUSALS[case]
    assert_mentions(only(recovery_problems(updated(base, changes))), *parts)


def test_refusals_reach_the_login_nodes_check(base):
    """recovery_problems is what _recovery yields: the CLI refuses with it. Mutant: _recovery without the
    `yield from recovery_problems(cfg)` (only the lead's not-built line)."""
    found = problems(updated(base, {"checkpoint.memory_every": -1}))
    assert any(p.startswith("checkpoint.memory_every=-1 must be 0") for p in found), found


def test_adapters_only_checkpoints_are_refused_as_auto_resolves_them(lora, qlora):
    """checkpoint.weights=adapters, and `auto` where it resolves to adapters (LoRA with model.init_from);
    QLoRA with its own message. Mutants: the raw checkpoint.weights read (auto never refused); the nf4 test
    dropped (QLoRA passes: auto resolves to adapters under nf4, but then the message says weights); LoRA
    without init_from refused (auto resolves to full there)."""
    assert recovery_problems(lora) == []  # auto -> full: no model.init_from to re-read a base from
    assert_mentions(only(recovery_problems(updated(lora, {"checkpoint.weights": "adapters"}))),
                    "checkpoint.weights=adapters:", "re-read the base from model.init_from",
                    "Fix: checkpoint.weights=full")
    assert_mentions(only(recovery_problems(updated(lora, {"model.init_from": "/models/base"}))),
                    "checkpoint.weights=auto (adapters here: LoRA with model.init_from)", "Fix: checkpoint.weights=full")
    assert recovery_problems(updated(lora, {"model.init_from": "/models/base", "checkpoint.weights": "full"})) == []
    assert_mentions(only(recovery_problems(qlora)), "model.lora.quantize=nf4 (QLoRA)", "Fix: model.lora.quantize=none")


def node_snapshot_bytes(cfg) -> float:
    """What a node's snapshots take, worked out here from the parameter count: 2 ranks a node, each
    holding a quarter (ZeRO-3 over 4 ranks) of the fp32 parameters (4 bytes) and Adam's moments (8),
    5 copies each (two own steps, two replica steps, one being written)."""
    params = param_counts(cfg.model)["total"]
    return 2 * (4 + 8) * params / 4 * 5


def budget_problems(cfg) -> list[str]:
    """The plan's problems about the snapshots (the login node refuses a plan with problems)."""
    return [p for p in plan(job_of(cfg)).problems if "memory snapshots" in p]


def test_the_budget_refuses_with_the_numbers(base):
    """Just over budget: the plan cannot run, with the node's figure, its arithmetic, the budget and the
    share that would fit; just under: it can. Mutants: COPIES 4 (or any other factor), ranks per node from
    the world, the bf16 copy counted (14 bytes), the comparison the wrong way, the budget's share or
    host_mem_gb left out, verdict.plan without snapshot_problems."""
    need = node_snapshot_bytes(base)
    host_gb = need / GiB / 0.25  # the host memory at which the default budget exactly holds them
    over = updated(base, {"cluster.host_mem_gb": host_gb * 0.97})
    msg = only(budget_problems(over))
    assert_mentions(msg, f"memory snapshots take {gib(need)} per node", "2 ranks x ", " x 5 copies",
                    f"> checkpoint.memory_budget=0.25 x cluster.host_mem_gb={host_gb * 0.97:g} = "
                    f"{gib(0.25 * host_gb * 0.97 * GiB)}",
                    f"Fix: checkpoint.memory_budget={math.ceil(0.25 / 0.97 * 100) / 100:g}",
                    "cluster.host_mem_gb=", "more ranks to shard the state over", "checkpoint.memory_every=0")
    assert not plan(job_of(over)).fits
    assert budget_problems(updated(base, {"cluster.host_mem_gb": host_gb * 1.03})) == []
    # a larger share of the same memory lets them in
    assert budget_problems(updated(over, {"checkpoint.memory_budget": 0.3})) == []
    assert recovery_problems(over) == []  # the config's checks leave the size to the plan: no second refusal


def test_the_login_node_refuses_a_plan_over_the_budget(base):
    """plan_and_check (what `python -m hpctrain` runs after the config's checks) raises with the budget's
    message. Mutant: the snapshots' problem kept out of Plan.problems (shown, not refused)."""
    over = updated(base, {"cluster.host_mem_gb": node_snapshot_bytes(base) / GiB / 0.25 * 0.9})
    with pytest.raises(ConfigError, match="memory snapshots take .* per node"):
        plan_and_check(over, for_launch=True)


def test_a_budget_above_the_whole_memory_names_no_share(base):
    """Where even all of host memory is too little, the fix names no memory_budget over 1. Mutant: the
    share offered whatever its size."""
    msg = only(budget_problems(updated(base, {"cluster.host_mem_gb": node_snapshot_bytes(base) / GiB / 2})))
    assert "checkpoint.memory_budget=" not in msg.split("Fix:")[1], msg


def test_the_budget_fix_names_zero_3_only_below_it(base):
    """ZeRO-3 shards all of the state already: the fix offers parallel.zero=3 only below it. Mutant: the
    fix's parallel.zero=3 whatever the stage."""
    tight = updated(base, {"cluster.host_mem_gb": 1e-6})
    assert "parallel.zero=3" not in only(budget_problems(tight))
    assert "(parallel.zero=3, more cluster.nodes)" in only(budget_problems(updated(tight, {"parallel.zero": 1})))


@pytest.mark.parametrize("budget", [0.0, -0.5, 1.5, float("nan")])
def test_memory_budget_outside_its_range_is_refused_once(base, budget):
    """(0, 1]: refused by its RANGES row with the default as fix, and the budget check says nothing more
    (it would divide by it, or compare with nan). Mutants: the row gone (a default range takes 0 and 1.5),
    the budget check run on a value out of range (a second, nonsensical refusal)."""
    cfg = updated(base, {"checkpoint.memory_budget": budget})
    found = [p for p in problems(cfg) + budget_problems(cfg) if "memory_budget" in p or "memory snapshots" in p]
    assert_mentions(only(found), f"checkpoint.memory_budget={budget}", "(0, 1]",
                    "Fix: checkpoint.memory_budget=0.25 (the default)")


@pytest.mark.parametrize("host", [0.0, float("nan"), float("inf")])
def test_a_host_memory_out_of_range_leaves_the_budget_to_its_range(base, host):
    """cluster.host_mem_gb=0, nan or inf: its RANGES row refuses it; the budget check neither raises (ceil
    of nan, a division by 0) nor adds a refusal. Mutant: the budget compared whatever host_mem_gb holds."""
    assert budget_problems(updated(base, {"cluster.host_mem_gb": host})) == []


def test_one_node_is_warned_not_refused(base):
    """A single Slurm node has no other node for the replica: warned. Mutants: the warning dropped, given
    on two nodes, or given under launcher=local (one machine: the replica is not the point there)."""
    one = updated(base, {"cluster.nodes": 1})
    assert recovery_problems(one) == []
    assert_mentions(only(recovery_advice(one)), "cluster.nodes=1 with checkpoint.memory_every",
                    "a lost node falls back to the newest disk checkpoint")
    assert recovery_advice(base) == []
    assert recovery_advice(updated(one, {"launcher.name": "local"})) == []
    assert recovery_advice(updated(one, {"checkpoint.memory_every": 0})) == []


def test_the_allocation_holds_the_spares_and_the_world_does_not(base):
    """--nodes = cluster.nodes + cluster.spare_nodes in the sbatch script and in submitit's parameters, with
    --no-kill; the world (what the supervisor starts and the layout is planned on) stays cluster.nodes x
    ranks per node. Mutants: allocation() without the spares; world_size counting them; a spare-less
    script that changes (the snapshots in tests/snapshots guard the rest of it)."""
    cfg = updated(base, {"cluster.spare_nodes": 1})
    assert directives(cfg, "/runs/x")["nodes"] == 3 and directives(cfg, "/runs/x")["no-kill"] is True
    script = sbatch_script(cfg, "/runs/x", "/usr/bin/python")
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --ntasks-per-node=2\n" in script
    assert "# --nodes holds 1 spare node(s) besides" in script
    assert world_size(cfg) == 4 and job_of(cfg).world == 4
    assert executor_parameters(updated(cfg, {"launcher.name": "slurm"}))["additional_parameters"]["nodes"] == 3
    assert allocation(base.cluster, "x")["nodes"] == 2  # no spares: as before
    assert "spare" not in sbatch_script(base, "/runs/x", "/usr/bin/python")
    assert allocation(cfg.cluster, "x", nodes=5)["nodes"] == 5  # a caller's own count (bench sweeps) stands


def test_the_plan_shows_the_spares_and_the_snapshots_cost(base):
    """The plan's text and plan.json: "2 nodes + 1 spare (idle until a node is lost...)", and the
    snapshots' bytes per node against the budget; neither line without them. Mutants: the lines left out,
    the spare counted into the nodes, plan.json's figure not the refusal's."""
    p = plan(job_of(updated(base, {"cluster.spare_nodes": 1})))
    text, d = summary(p), plan_dict(p)
    need = node_snapshot_bytes(base)
    assert "\n2 nodes + 1 spare (idle until a node is lost; the job asks Slurm for 3)\n" in text, text
    assert_mentions(text, f"memory snapshots every 1 step: {gib(need)} per node",
                    "of checkpoint.memory_budget=0.25 x cluster.host_mem_gb=")
    assert "over the budget" not in text
    assert d["nodes"] == 2 and d["spare_nodes"] == 1 and d["world"] == 4
    snap = d["memory_snapshots"]
    assert snap["bytes_per_node"] == pytest.approx(need) and snap["ranks_per_node"] == 2 and snap["copies"] == 5
    assert snap["budget_bytes"] == pytest.approx(0.25 * base.cluster.host_mem_gb * GiB)

    off = plan(job_of(updated(base, {"checkpoint.memory_every": 0})))
    assert "spare" not in summary(off) and "memory snapshots" not in summary(off)
    assert plan_dict(off)["memory_snapshots"] is None and plan_dict(off)["spare_nodes"] == 0


def test_a_lora_snapshot_holds_the_frozen_base_without_optimizer_state(lora):
    """Under LoRA (weights full) a rank's snapshot is the adapters' parameters and moments (12 bytes each)
    plus the frozen base in the compute dtype (tiny: fp32), all a quarter under ZeRO-3 over 4 ranks.
    Mutant: the frozen weights priced as trained ones (moments and all: 3x here)."""
    from hpctrain.core.flops import lora_params
    from hpctrain.plan.snapshots import snapshot_cost

    assert str(lora.train.precision) == "fp32" and lora.parallel.zero == 3
    base_params, adapters = param_counts(lora.model)["total"], lora_params(lora.model, 1)
    cost = snapshot_cost(job_of(lora))
    assert cost.rank_bytes == pytest.approx((12 * adapters + 4 * base_params) / 4)
