"""AdamW with linear warmup and cosine decay to `min_lr_ratio * lr`."""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - 1 - warmup)  # the last step (total - 1) runs at the floor
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, o, total_steps: int, zero_group=None, offload=None):
    """AdamW and its schedule. With `zero_group` (ZeRO-1) each rank of that group keeps the optimizer
    state of its share of the parameters only and broadcasts its updated parameters. With `offload`
    (an OffloadConfig whose target is cpu or nvme) the state lives in host memory or in files
    (hpctrain.offload.HostAdamW), this rank's share of it only."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms: decaying them only hurts
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False},
            "auto": {"fused": True}}[o.impl]
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)
    optimizer_class = torch.optim.AdamW
    if offload is not None and offload.target != "none":
        from functools import partial

        from hpctrain.offload import HostAdamW

        optimizer_class = partial(HostAdamW, offload=offload)
        kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=optimizer_class,
                                      process_group=zero_group, weight_decay=o.weight_decay, **kwargs)
        opt.add_param_group(groups[1])
    else:
        opt = optimizer_class(groups, **kwargs)
    if offload is not None and offload.target != "none":
        # Place the state now (host buffers, or reserved files: a full disk stops the run here).
        getattr(opt, "optim", opt)._ensure_setup()
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, o.warmup_steps, total_steps, o.min_lr_ratio))
    return opt, sched
