"""Host memory that memory snapshots (checkpoint.memory_every) take on a node: pure arithmetic, no torch.

A rank's snapshot holds what its checkpoint saves: its shard of the fp32 parameters and of Adam's
moments, 12 bytes a trained parameter before sharding (the planner's async staging, which also counts
the bf16 copy FSDP2 gathers, prices 14). A node
keeps, for each of its ranks, COPIES snapshots at once; a plan whose snapshots would take more than
checkpoint.memory_budget x cluster.host_mem_gb on a node cannot run (snapshot_problems, one of the plan's
problems: the login node refuses it as it refuses one over the device memory), and the plan's text and
plan.json show the figure either way. The config's own refusals of the keys are
hpctrain.checks.config_checks.recovery_problems.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.core import words
from hpctrain.core.spec import ranks_per_node
from hpctrain.plan.memory import BYTES, GiB, Job, gib, pipeline_ranks, stage_params
from hpctrain.plan.moe import expert_zero_group

# Per rank on a node: the two newest steps of its own (the older kept until the newer is complete),
# the two newest of the partner node's rank it holds the replica of, and the one being written (its
# reused buffer, then the `.tmp-` file renamed into place).
COPIES = 5


def trained_state_bytes(params: float, zero: int, group: int) -> float:
    """A rank's saved state of `params` trained parameters (after tensor parallel): the fp32 parameters
    (FSDP2, ZeRO 2/3, stores each as its shard and casts what it gathers; DDP and ZeRO-1 keep them whole)
    and Adam's two fp32 moments (sharded from ZeRO-1), as hpctrain.core.spec's sharding places them."""
    n = max(1, group)
    return 4 * params / (n if zero >= 2 else 1) + 8 * params / (n if zero >= 1 else 1)


def rank_state_bytes(job: Job, stage: int) -> float:
    """Bytes of one snapshot of a rank of pipeline stage `stage`: what its checkpoint saves, the trained
    parameters and their optimizer state (routed experts sharded over their own group), and under LoRA
    the frozen weights in the compute dtype, sharded by ZeRO-3 (hpctrain.plan.memory.lora_state): a
    snapshot holds every weight (adapters-only checkpoints are refused with memory snapshots)."""
    spec, sp = job.spec, stage_params(job, stage)
    zero = spec.zero
    if spec.lora:
        shard = job.zero_group if zero >= 3 else 1
        eshard = expert_zero_group(job) if zero >= 3 else 1
        frozen = (sp.total - sp.adapters - sp.experts) / max(1, shard) + sp.experts / max(1, eshard)
        return trained_state_bytes(sp.adapters, zero, job.zero_group) + BYTES[spec.precision] * frozen
    return (trained_state_bytes(sp.total - sp.experts, zero, job.zero_group)
            + trained_state_bytes(sp.experts, zero, expert_zero_group(job)))


@dataclass(frozen=True)
class SnapshotCost:
    every: int  # checkpoint.memory_every
    rank_bytes: float  # one snapshot of the heaviest pipeline stage's rank
    ranks_per_node: int
    budget: float  # checkpoint.memory_budget
    host_mem_gb: float  # cluster.host_mem_gb (GiB)

    @property
    def node_bytes(self) -> float:
        return self.ranks_per_node * self.rank_bytes * COPIES

    @property
    def budget_bytes(self) -> float:
        return self.budget * self.host_mem_gb * GiB

    @property
    def fits(self) -> bool:
        return self.node_bytes <= self.budget_bytes

    def arithmetic(self) -> str:
        """How the node's figure is made, in words."""
        return (f"{words.plural(self.ranks_per_node, 'rank')} x {gib(self.rank_bytes)} of state x {COPIES} copies: "
                "a rank's two newest steps, the two it holds of a rank on another node, one being written")

    def against_budget(self) -> str:
        return (f"checkpoint.memory_budget={self.budget:g} x cluster.host_mem_gb={self.host_mem_gb:g} = "
                f"{gib(self.budget_bytes)}")

    def describe(self) -> str:
        """The plan's line: "memory snapshots every 1 step: 1.2 GiB per node (...) of 4.0 GiB (...)"."""
        return (f"memory snapshots every {words.plural(self.every, 'step')}: {gib(self.node_bytes)} per node "
                f"({self.arithmetic()}) of {self.against_budget()}")


def snapshot_cost(job: Job) -> SnapshotCost | None:
    """What memory snapshots take on a node of `job`; None where checkpoint.memory_every is off."""
    ck = job.spec.config.checkpoint
    if ck.memory_every <= 0:
        return None
    rank = max(rank_state_bytes(job, s) for s in pipeline_ranks(job))
    return SnapshotCost(every=ck.memory_every, rank_bytes=rank, ranks_per_node=ranks_per_node(job.cluster),
                        budget=ck.memory_budget, host_mem_gb=job.cluster.host_mem_gb)


def snapshot_problems(job: Job) -> list[str]:
    """The plan's refusal of snapshots over the budget, with the numbers and the fixes; [] where they
    fit or are off."""
    cost = snapshot_cost(job)
    # a budget or a host memory out of range (0, nan) is the config checks' to refuse (RANGES): there
    # is no figure to compare with
    if cost is None or not (0 < cost.budget <= 1 and 0 < cost.host_mem_gb < math.inf) or cost.fits:
        return []
    share = math.ceil(cost.node_bytes / (cost.host_mem_gb * GiB) * 100) / 100
    # below ZeRO-3 some of the state is whole on every rank (trained_state_bytes)
    zero = "parallel.zero=3, " if job.spec.zero < 3 else ""
    raise_budget = f"checkpoint.memory_budget={share:g} where the nodes can spare that much, " if share <= 1 else ""
    return [f"memory snapshots take {gib(cost.node_bytes)} per node ({cost.arithmetic()}) > "
            f"{cost.against_budget()}. Fix: {raise_budget}cluster.host_mem_gb=<the nodes' memory, GiB> where "
            f"they have more, more ranks to shard the state over ({zero}more cluster.nodes), or "
            "checkpoint.memory_every=0 (disk checkpoints alone)"]
