"""Pipeline parallel: split the plain Llama into stages and drive them with a torch schedule.

Stages keep the full model's parameter names (blocks in a ModuleDict, dropped modules set to None),
so checkpoints load into any split. Which blocks each stage holds, and which stages each rank runs,
is the engine spec's (hpctrain.spec.Pipeline).
"""
from __future__ import annotations

import copy

from torch import nn

from hpctrain.spec import SINGLE_STAGE

# config.PipelineSchedule's values -> torch.distributed.pipelining's classes.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


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
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
