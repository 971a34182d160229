"""Training state besides the tensors, as checkpointable (Stateful) objects: what the loop counts,
and the LR schedule (whose position sets the optimizer's learning rate on resume)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    step: int = 0  # optimizer steps completed, skipped ones included
    tokens_seen: int = 0
    skipped: int = 0  # steps whose update was skipped (train.on_nonfinite=skip), over the whole run

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.skipped = int(state.get("skipped", 0))  # checkpoints from before skipping have none


class Schedule:
    """The LR scheduler; on load the optimizer's groups get the scheduler's learning rate (they still
    hold the initial one). The position in the schedule comes from the checkpoint, the peak learning rate
    from this run's optim.lr: a run resumed with a lower one (after its loss went non-finite) trains with
    it, where the checkpoint's saved base rates would silently keep the old one."""

    # What a checkpoint keeps of torch's LambdaLR: its position. The rest of its __dict__ (base rates, the
    # lambdas' own dicts, `verbose`) is this run's to rebuild, and its keys differ between torch versions: a
    # checkpoint's other keys (earlier checkpoints hold the whole dict) are ignored, never loaded.
    reads = ("last_epoch", "_step_count")

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer

    def state_dict(self) -> dict:
        return {k: v for k, v in self.scheduler.state_dict().items() if k in self.reads}

    def state_problem(self, state: dict) -> str | None:
        """The position in the schedule is the one thing loading must find (the checkpoint's kinds and
        ranges are checked by hpctrain.checkpoint.validate): without it, the run would restart the warmup."""
        return None if "last_epoch" in state else "holds no 'last_epoch' (the position in the schedule)"

    def load_state_dict(self, state: dict) -> None:
        s = self.scheduler
        s.last_epoch = state["last_epoch"]
        s._step_count = state.get("_step_count", s.last_epoch + 1)
        s._last_lr = [b * f(s.last_epoch) for b, f in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, s.get_last_lr()):
            group["lr"] = lr
