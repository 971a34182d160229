"""How an MoE layer's routed rows reach its experts and its routing statistics reach the micro-batch.

The MoE layer (hpctrain.models.moe) routes, asks its dispatcher, combines; it holds no collective and
no DTensor. Its dispatcher owns everything that depends on where tokens and experts live:

    weight(w)                      this rank's compute view of a parameter (its local part of a DTensor)
    experts(module, rows, counts)  dispatch rows sorted by expert -> compute -> combine them back
    totals(counts, tokens)         routed slots and tokens of the whole micro-batch
    whole(parts)                   this rank's parts of the balancing losses, summed over the micro-batch

`LocalDispatcher` is the one-process case and the base: every expert here, the rows computed where they
are. With tensor or context parallel the micro-batch's tokens are split over a `token_group` (each rank
routes its share), and the statistics are summed over it. The all-to-all dispatcher (expert parallel:
hpctrain.parallel.dispatch) moves the rows to the ranks holding their experts. Which one a layer gets is
decided once, from the token mesh and the ep mesh together (hpctrain.parallel.dispatch.token_dispatcher).

The seam for faster exchanges: `dispatch` returns the rows and per-expert counts this rank's experts
compute, and a handle `combine` uses to send the results home. DeepEP-style kernels (fused permute and
exchange, low-latency dispatch) would be another subclass overriding these two (one taking the routing
itself, since those kernels permute as they send).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight held as a DTensor (experts sharded by expert parallel; weights
    replicated over tensor parallel), for compute on this rank's own tokens; a plain tensor as it is. A
    replicated weight then gets a partial gradient (its tokens' share of the sum over the sequence),
    which DTensor sums over the replicas."""
    if not hasattr(w, "to_local"):
        return w
    from torch.distributed.tensor import Partial, Replicate

    return w.to_local(grad_placements=[Partial() if isinstance(q, Replicate) else q for q in w.placements])


class LocalDispatcher:
    """Every expert on this rank: the rows sorted by expert are computed here. `token_group`: the ranks
    that split each micro-batch's tokens (tensor parallel's sequence shares, context parallel's chunks,
    or both), over which the routed slots and the balancing losses are summed; None: this rank holds the
    whole micro-batch."""

    def __init__(self, token_group=None):
        self.token_group = token_group

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return local_weight(w)

    def expert_weight(self, w: torch.Tensor) -> torch.Tensor:
        """An expert weight as this rank computes with it (called inside the experts' forward, after
        FSDP2 has gathered them)."""
        return self.weight(w)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple:
        """(rows for this rank's experts, their count per local expert, handle for `combine`)."""
        return rows, counts, None

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        """The experts' results back in the order `dispatch` was given the rows."""
        return y

    def experts(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x, local_counts, handle = self.dispatch(rows, counts)
        return self.combine(experts(x, local_counts, self.expert_weight), handle)

    def totals(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """(routed slots per expert, tokens) of the whole micro-batch, from this rank's share."""
        if self.token_group is None:
            return counts, tokens
        counts = counts.clone()  # the routing's own counts stay this rank's (its dropped slots)
        dist.all_reduce(counts, group=self.token_group)
        return counts, tokens * dist.get_world_size(self.token_group)

    def whole(self, parts: torch.Tensor) -> torch.Tensor:
        """This rank's parts of per-micro-batch sums (balancing losses, dropped slots), summed."""
        if self.token_group is not None:
            dist.all_reduce(parts, group=self.token_group)
        return parts
