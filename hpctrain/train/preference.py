"""Preference tuning (train.objective=dpo): the DPO / IPO loss of a micro-batch's pairs and the step's metrics.

A micro-batch of m pairs is 2m rows interleaved [chosen 1, rejected 1, chosen 2, ...] (hpctrain.train.sampler),
so every micro-batch holds whole pairs. The model's output layer gives each row's summed loss over its
completion tokens (hpctrain.models.loss, per_row): the row's log-probability negated. The formulas and the
metrics' names and definitions are TRL's DPOTrainer's (1.16), the reference it is tested against:

- sigmoid (DPO, Rafailov et al. 2023): -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h), h the margin of
  the log-ratios (chosen minus rejected, each policy minus reference), e train.dpo.label_smoothing
  (conservative DPO; e = 0 is TRL's "sigmoid");
- ipo (Azar et al. 2023): (h' - 1 / (2 beta))^2 with each log-ratio averaged over its completion's tokens.

The step's loss is the mean over the global batch's pairs; rewards are beta x the log-ratios.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# metrics.jsonl's keys (TRL's), each a mean over the global batch's pairs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def pair_losses(logps: torch.Tensor, ref_logps: torch.Tensor, tokens: torch.Tensor, loss: str, beta: float,
                label_smoothing: float = 0.0) -> torch.Tensor:
    """Each pair's loss. logps, ref_logps, tokens: per row (2m,), interleaved chosen/rejected; tokens: the
    row's completion tokens (IPO averages over them)."""
    ratios = logps - ref_logps
    chosen, rejected = ratios[0::2], ratios[1::2]
    if loss == "ipo":
        n = tokens.to(ratios.dtype).clamp(min=1.0)
        h = chosen / n[0::2] - rejected / n[1::2]
        return (h - 1 / (2 * beta)) ** 2
    h = chosen - rejected
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def pair_sums(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """The metrics' sums over a micro-batch's pairs, in METRICS's order (divided by the global batch's pairs
    once every micro-batch and rank has added its own)."""
    logps, ref_logps = logps.detach().float(), ref_logps.detach().float()
    rewards = beta * (logps - ref_logps)
    chosen, rejected = rewards[0::2], rewards[1::2]
    return torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).float().sum(),
                        logps[0::2].sum(), logps[1::2].sum()])
