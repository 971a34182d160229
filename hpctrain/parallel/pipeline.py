"""Pipeline parallel: split the plain Llama into stages and drive them with a torch schedule.

Stages keep the full model's parameter names (blocks in a ModuleDict, dropped modules set to None),
so checkpoints load into any split. The split balances parameters: the embedding and the output
projection count like blocks of their size.
"""
from __future__ import annotations

import copy

from torch import nn

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SHAPED = ("zbv", "dualpipev")  # stage s and 2p-1-s share a rank
SINGLE = ("gpipe", "1f1b")  # one stage per rank


def stages_per_rank(schedule: str, virtual: int) -> int:
    if schedule in SINGLE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return max(2, virtual)


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Boundaries (len parts+1) of `parts` contiguous chunks of `costs` minimizing the largest chunk
    (binary search on the bottleneck, greedy fill). Every chunk gets at least one item."""
    if parts > len(costs):
        raise ValueError(f"cannot split {len(costs)} items into {parts} stages")

    def fits(limit: float) -> list[int] | None:
        bounds, acc = [0], 0.0
        for i, c in enumerate(costs):
            remaining_items = len(costs) - i
            remaining_parts = parts - (len(bounds) - 1)
            if (acc + c > limit and acc > 0) or remaining_items < remaining_parts:
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


def split_costs(model: nn.Module) -> list[float]:
    """Cost of each unit in order: [embedding, block 0 .. block n-1, norm + output]."""
    def size(m):
        return sum(p.numel() for p in m.parameters()) if m is not None else 0

    blocks = [size(b) for b in model.layers.values()]
    return [size(model.tok_embeddings) * 0.5, *blocks, size(model.norm) + size(model.output)]


def layer_ranges(model: nn.Module, num_stages: int) -> list[tuple[int, int]]:
    """Block index range [start, end) of each stage. The embedding sits on stage 0 and the output on
    the last stage whatever the split, so their cost lands on those stages' budgets."""
    costs = split_costs(model)
    bounds = balanced_split(costs, num_stages)
    n = len(model.layers)
    ranges = []
    for s in range(num_stages):
        # Units 1..n are blocks 0..n-1; unit 0 (embedding) and n+1 (output) own no block.
        start, end = max(bounds[s], 1) - 1, min(bounds[s + 1], n + 1) - 1
        ranges.append((start, max(start, end)))
    return ranges


def stage_module(model: nn.Module, stage: int, num_stages: int, blocks: tuple[int, int]) -> nn.Module:
    """A copy of the (meta-device) model holding only this stage's parts."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in range(*blocks)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != num_stages - 1:
        part.norm = None
        part.output = None
    return part


def build_schedule(stages: list, schedule: str, n_microbatches: int, loss_fn):
    import torch.distributed.pipelining.schedules as S

    cls = getattr(S, SCHEDULES[schedule])
    if schedule in SINGLE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
