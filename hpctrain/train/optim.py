"""AdamW with linear warmup and cosine decay to `min_lr_ratio * lr`."""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpctrain.offload import HostAdamW


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - 1 - warmup)  # the last step (total - 1) runs at the floor
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over parameters that may be DTensors (tensor parallel, FSDP2's replicate): each parameter
    is owned by one rank of the data-parallel `group` (whole parameters, dealt largest first to the
    least loaded rank, the same on every rank), whose local optimizer alone keeps its state and steps
    it; the owner then broadcasts the updated parameter (its local tensor: the same tensor-parallel
    slice on every rank of the group) to the others. Gradients stay whole on every rank (ZeRO-1).

    `optim` is the local optimizer, so hpctrain.parallel.stateful checkpoints the owned state by name;
    the learning rate schedule drives this object's param_groups, copied to `optim` at each step."""

    def __init__(self, groups, optimizer_class, group, **kwargs):
        self.group = group
        self.rank = dist.get_rank(group)
        self._local = lambda p: p.to_local() if isinstance(p, DTensor) else p
        params = [p for g in groups for p in g["params"]]
        load = [0] * dist.get_world_size(group)
        self.owner = {}
        for i in sorted(range(len(params)), key=lambda i: -self._local(params[i]).numel()):
            r = min(range(len(load)), key=lambda k: (load[k], k))
            self.owner[params[i]] = r
            load[r] += self._local(params[i]).numel()
        mine = [{**g, "params": [p for p in g["params"] if self.owner[p] == self.rank]} for g in groups]
        self.optim = optimizer_class(mine, **kwargs)
        super().__init__(groups, defaults=dict(self.optim.defaults))

    @torch.no_grad()
    def step(self, closure=None):
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        loss = self.optim.step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                dist.broadcast(self._local(p), group=self.group, group_src=self.owner[p])
        return loss


def build_optimizer(params, o, total_steps: int, zero_group=None, offload=None, shard_group=None):
    """AdamW and its schedule. With `zero_group` (ZeRO-1) each rank of that group keeps the optimizer
    state of its share of the parameters only and broadcasts its updated parameters. With `offload`
    (an OffloadConfig whose target is cpu or nvme) the state lives in host memory or in files
    (hpctrain.offload.HostAdamW), this rank's share of it only. With `shard_group` (ZeRO-1 composed
    with tensor or pipeline parallel) a ShardedOptimizer does what ZeroRedundancyOptimizer does, for
    DTensor parameters too."""
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
        optimizer_class = partial(HostAdamW, offload=offload)
        kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if shard_group is not None:
        opt = ShardedOptimizer(groups, optimizer_class, shard_group, **kwargs)
    elif zero_group is not None:
        # ~0.5 s at import: only ZeRO-1 ranks pay for it
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
