"""Pipeline parallel: split the plain Llama into stages and drive them with a torch schedule.

Stages keep the full model's parameter names (blocks in a ModuleDict, dropped modules set to None),
so checkpoints load into any split. Which blocks each stage holds, and which stages each rank runs,
is the engine spec's (hpctrain.core.spec.Pipeline).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.core.spec import SINGLE_STAGE

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
    # heavy (~2 s: it pulls in torch._dynamo): only ranks of a pipelined layout pay for it
    import torch.distributed.pipelining.schedules as S

    cls = getattr(S, SCHEDULES[schedule])
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def forward_only(stages: dict, owner: list[int], me: int, group, micro, loss_fn, device) -> "torch.Tensor":
    """Mean loss of `micro` [(inputs, targets, model keyword arguments)] through every stage in order,
    forward only. loss_fn(loss, targets) scales the last stage's summed loss.

    `stages` maps this rank's stage indices to their modules; `owner[s]` is the pipeline rank of stage
    s. torch's schedules run forward-only passes (`eval`) for some kinds only (not the V-shaped ones),
    and validation is a few batches: a plain stage-by-stage relay serves every kind alike. Activations
    travel in fp32 (exact for bf16 ones) after their shape (under tensor parallel a stage hands on its
    sequence shard). Only the rank of the last stage gets a non-zero loss.
    """
    total = torch.zeros((), device=device)
    last = len(owner) - 1
    for x, y, kw in micro:
        kw = {k: v.to(device) for k, v in kw.items()}
        h = None
        for s, rank in enumerate(owner):
            if rank == me:
                if s > 0 and owner[s - 1] != me:
                    shape = torch.empty(3, dtype=torch.int64, device=device)
                    dist.recv(shape, group_src=owner[s - 1], group=group)
                    h = torch.empty(*shape.tolist(), dtype=torch.float32, device=device)
                    dist.recv(h, group_src=owner[s - 1], group=group)
                # the last stage's output layer computes the loss (hpctrain.models.loss)
                extra = {"targets": y.to(device)} if s == last else {}
                h = stages[s](x.to(device) if s == 0 else h, **kw, **extra)
                if s < last and owner[s + 1] != me:
                    dist.send(torch.tensor(h.shape, dtype=torch.int64, device=device), group_dst=owner[s + 1], group=group)
                    dist.send(h.float().contiguous(), group_dst=owner[s + 1], group=group)
        if owner[last] == me:
            total += loss_fn(h, y.to(device)).detach().float() / len(micro)
    return total
