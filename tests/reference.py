"""A single-process reference: the same model, data and optimizer written as plainly as possible,
without torch.distributed, micro-batches or any of hpctrain's wrappers. Layouts are compared to it."""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from hpctrain.data import build_dataset
from hpctrain.train.sampler import StepSampler
from hpctrain.models.llama import Llama, LlamaArgs, init_param_
from hpctrain.train.optim import build_optimizer


def reference_losses(cfg, steps: int | None = None) -> tuple[list[float], list[float]]:
    """Per-step (loss, grad_norm) of one process seeing the whole global batch at once."""
    torch.manual_seed(0)
    args = LlamaArgs.from_config(cfg.model, max_seq_len=cfg.data.seq_len)
    model = Llama(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + zlib.crc32(name.encode()))
            init_param_(name, p, args, gen)
    opt, sched = build_optimizer(model.parameters(), cfg.optim, cfg.train.steps)
    B = cfg.train.global_batch
    sampler = StepSampler(build_dataset(cfg), B, B, 0, 1, cfg.data.seed)
    losses, norms = [], []
    for _ in range(steps or cfg.train.steps):
        (x, y), = sampler.next_step()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms
