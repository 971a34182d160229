"""Training state besides the tensors, as checkpointable (Stateful) objects: what the loop counts,
and the LR schedule (whose position sets the optimizer's learning rate on resume)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


class Schedule:
    """The LR scheduler; on load the optimizer's groups get the scheduler's learning rate (they still
    hold the initial one)."""

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
