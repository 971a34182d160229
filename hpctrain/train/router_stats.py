"""What the routers of a Mixture-of-Experts model did in a step, and DeepSeek-V3's balancing bias.

After each optimizer step the routed slots per expert of every MoE layer this rank holds are summed
over the data-parallel ranks (every rank then holds the step's whole load, so the biases stay equal
everywhere). Auxiliary-loss-free balancing (model.moe.bias_update_rate = gamma) then moves each
layer's bias by gamma towards balance: +gamma for an expert that got fewer slots than the mean,
-gamma for one that got more (DeepSeek-V3 report, section 2.1.2). The metrics (balancing losses, each
expert's share of the slots relative to an even split, dropped slots) are reduced over the pipeline
stages too, on the steps that are logged; the least and most loaded expert's share is also kept per
MoE layer (by block number), for the run report's per-layer view.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.models.moe import MoE


def _block(name: str) -> int | None:
    """The block number in a module's name (`layers.12.moe` -> 12), or None."""
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


class RouterStats:
    def __init__(self, parts: list, experts: int, bias_update_rate: float, dp_group, pp_group=None,
                 device: torch.device | str = "cpu", blocks: int | None = None):
        """`blocks`: the model's block count (model.n_layers): every pipeline stage's per-layer metrics
        are laid out over it."""
        named = [(name, m) for part in parts for name, m in part.named_modules() if isinstance(m, MoE)]
        self.modules = [m for _, m in named]
        ids = [_block(name) for name, _ in named]
        self.block_ids = ids if None not in ids else list(range(len(named)))
        self.blocks = max([blocks or 0, *(i + 1 for i in self.block_ids)])
        self.experts, self.device = experts, torch.device(device)
        self.rate, self.dp_group, self.pp_group = bias_update_rate, dp_group, pp_group
        self.loads = None  # (layers here, experts): the last step's routed slots, over data parallel
        self.sums = None  # aux, z, dropped, passes summed over this rank's layers, over data parallel

    def set_aux_scale(self, scale: float) -> None:
        for m in self.modules:
            m.aux_scale = scale

    @torch.no_grad()
    def after_step(self, move_biases: bool = True) -> None:
        """Every rank, after each optimizer step: sum the step's loads, move the biases (not after a
        step whose update was skipped: it changes nothing), start afresh."""
        if not self.modules:
            return
        device = self.device
        loads = torch.stack([m.stats.load.to(device) if m.stats.load is not None
                             else torch.zeros(m.num_experts, device=device) for m in self.modules])
        sums = torch.tensor([[float(m.stats.aux) / max(1, m.stats.passes), float(m.stats.z) / max(1, m.stats.passes),
                              float(m.stats.dropped)] for m in self.modules], device=device, dtype=torch.float64)
        dist.all_reduce(loads, group=self.dp_group)
        dist.all_reduce(sums, group=self.dp_group)
        if self.rate > 0 and move_biases:
            for m, load in zip(self.modules, loads):
                m.router.bias += self.rate * torch.sign(load.mean() - load)
        for m in self.modules:
            m.stats.reset()
        self.loads, self.sums = loads, sums

    def metrics(self) -> dict:
        """The last step's router metrics, over every MoE layer of the model (a collective over the
        pipeline stages: every rank calls it on the same steps)."""
        if not self.experts or (self.loads is None and self.pp_group is None):
            return {}
        dp = dist.get_world_size(self.dp_group)
        # Per block: [-least, most] loaded expert's share; -inf where this rank holds no MoE layer.
        by_block = torch.full((2, self.blocks), float("-inf"), device=self.device)
        if self.loads is not None:
            share = self.loads / self.loads.sum(-1, keepdim=True).clamp(min=1) * self.loads.shape[-1]
            lo, hi = share.min().item(), share.max().item()
            total = torch.cat([self.sums.sum(0)[:3].float(), torch.tensor([len(self.modules)], dtype=torch.float32,
                                                                         device=share.device)])
            per_expert = share.sum(0)
            ids = torch.tensor(self.block_ids, device=by_block.device)
            by_block[0, ids] = -share.min(-1).values.to(by_block)
            by_block[1, ids] = share.max(-1).values.to(by_block)
        else:  # a pipeline stage without MoE layers still joins the collectives
            lo, hi, total, per_expert = float("inf"), float("-inf"), torch.zeros(4, device=self.device), None
        if self.pp_group is not None:
            device = total.device
            ends = torch.tensor([-lo, hi], device=device)
            dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=self.pp_group)
            dist.all_reduce(total, group=self.pp_group)
            lo, hi = -ends[0].item(), ends[1].item()
            experts = torch.zeros(self.experts, device=device) if per_expert is None else per_expert
            dist.all_reduce(experts, group=self.pp_group)
            per_expert = experts
            dist.all_reduce(by_block, op=dist.ReduceOp.MAX, group=self.pp_group)
        aux, z, dropped, layers = total.tolist()
        if not layers:
            return {}
        held = torch.isfinite(by_block[1])
        return {"moe_aux_loss": aux / dp, "moe_z_loss": z / dp, "expert_share_min": lo, "expert_share_max": hi,
                "moe_dropped": int(dropped),
                "expert_share": [round(v, 4) for v in (per_expert / layers).tolist()],
                "moe_layers": held.nonzero().flatten().tolist(),
                "expert_share_min_by_layer": [round(v, 4) for v in (-by_block[0][held]).tolist()],
                "expert_share_max_by_layer": [round(v, 4) for v in by_block[1][held].tolist()]}
