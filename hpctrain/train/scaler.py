"""train.precision=fp16: dynamic loss scaling with torch.amp.GradScaler, its overflow check agreed by every rank.

fp16 has 5 exponent bits: gradients below 2^-24 flush to zero. The loss is multiplied by the scale
(2^16 to start, train.fp16.init_scale) before backward, and the gradients divided by it before the
global norm, clipping and the update (the fp32 master weights never see a scaled gradient). A scale
too large makes some gradient overflow to infinity: that step is skipped and the scale halves; after
train.fp16.growth_interval steps in a row without one, it doubles (GradScaler's rules, and its code:
`unscale_` and `update`).

GradScaler decides per process: its `found_inf` is what this rank's gradients hold (DTensor's dispatcher
reduces it over the mesh of the first gradient of each unscale call, FSDP's and TP's, which is why FSDP2
needs no ShardedGradScaler; pipeline stages and DDP's plain tensors share no mesh). An infinity on one
rank need not reach another, which would then step and keep its scale while the first skips and halves:
the replicas diverge. Here every rank's verdict is all-reduced (MAX over the whole world, one scalar) and
handed back to GradScaler as the gradient of one more tensor it checks (`_Grads` of a one-element flag),
through its public `unscale_`; its `update` then backs off or grows alike on every rank, and the trainer
skips the step on every rank. No private state of torch's is read or written.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

GROWTH, BACKOFF = 2.0, 0.5  # GradScaler's defaults: what the issue and torch document
# An overflow with a scale already below this is not an overflow: halving has not helped in ~16 steps
# from 2^16, so an infinity or NaN comes from the model (or the data), and the trainer treats it as
# train.on_nonfinite's non-finite gradient instead of halving towards zero for ever.
MIN_SCALE = 1.0


class _Grads:
    """The `optimizer` GradScaler.unscale_ reads: only `param_groups` (and its identity)."""

    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]


class LossScaler:
    """One per rank; the trainer calls `scale` on the loss before backward, `unscale_` before the norm,
    `agree` with the norm, and `update` once per step, every rank alike. Checkpointed as plain JSON
    ("scaler" in hpctrain.json): the scale, GradScaler's count of clean steps, and the run's overflows."""

    # A checkpoint without a "scaler" entry was written by a run without fp16 (bf16 moved to V100s, say): the
    # scale starts afresh from train.fp16.init_scale, as a new run's does (hpctrain.checkpoint.validate). The
    # entry is one key of hpctrain.json, which is written whole or not at all: its absence is not damage.
    optional = True

    def __init__(self, device: torch.device, init_scale: float, growth_interval: int):
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, init_scale=float(init_scale), growth_factor=GROWTH,
                                           backoff_factor=BACKOFF, growth_interval=int(growth_interval))
        # GradScaler makes its scale tensor at its first scale(); the first stages of a pipeline never
        # scale a loss (the last stage's backward sends them scaled gradients), and unscale_ needs it.
        self.scaler.scale(torch.ones((), device=device))
        self.overflows = 0  # steps skipped on an overflow over the whole run, resumes included (the trainer counts)
        self.value = float(self.scaler.get_scale())  # the scale the next backward runs with (read once a step)
        self._flag = torch.zeros(1, device=device)
        self._flag_grads = _Grads([self._flag])
        self._grads = None  # this step's unscaled gradients

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs on: loss x the scale, as a Python number (a tensor-parallel loss is a
        DTensor, which does not mix with GradScaler's plain scale tensor). Exact where the scale is a power
        of two, as it stays from the default 2^16."""
        return loss * self.value

    def unscale_(self, params) -> None:
        """Divide this rank's gradients by the scale, in place (GradScaler notes the infinities it meets). The
        group is kept until update: GradScaler knows it by its id, which a freed one could hand to the next."""
        self._grads = _Grads(params)
        self.scaler.unscale_(self._grads)

    def agree(self, norm: torch.Tensor) -> bool:
        """Whether any rank's gradients overflowed, the same answer on every rank. `norm`: this rank's global
        gradient norm after unscale_ (not finite if any of this rank's gradients is not: a DTensor's
        replicated gradient counts only on the rank that holds it, hence the all-reduce)."""
        bad = (~torch.isfinite(norm)).to(torch.float32).reshape(1).to(self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item() > 0)

    def update(self, overflow: bool) -> None:
        """The step's agreed verdict to GradScaler, then its update: halve on an overflow, double after
        growth_interval clean steps. Once per step on every rank."""
        self._flag.grad = torch.full_like(self._flag, float("inf") if overflow else 0.0)
        self.scaler.unscale_(self._flag_grads)
        self.scaler.update()
        self._flag.grad = None
        self._grads = None
        self.value = float(self.scaler.get_scale())

    # ------------------------------------------------------------ checkpoints (plain JSON)

    def state_dict(self) -> dict:
        s = self.scaler.state_dict()
        return {"scale": float(s["scale"]), "growth_tracker": int(s["_growth_tracker"]), "overflows": self.overflows}

    def state_problem(self, state: dict) -> str | None:
        """The kinds and ranges are checked by hpctrain.checkpoint.validate (numbers, finite, not negative);
        a scale must also be above zero and a resumed run must know it."""
        missing = [k for k in ("scale", "growth_tracker") if k not in state]
        if missing:
            return f"holds no {' or '.join(repr(k) for k in missing)} (the loss scale of train.precision=fp16)"
        if not state["scale"] > 0:
            return f"says scale {state['scale']!r}: a loss scale must be above 0"
        return None

    def load_state_dict(self, state: dict) -> None:
        """The position (scale, clean steps) from the checkpoint; growth_interval and the factors from this
        run's config, as hpctrain.train.progress.Schedule takes the peak learning rate."""
        self.scaler.load_state_dict({"scale": float(state["scale"]), "growth_factor": GROWTH,
                                     "backoff_factor": BACKOFF,
                                     "growth_interval": self.scaler.get_growth_interval(),
                                     "_growth_tracker": int(state["growth_tracker"])})
        self.overflows = int(state.get("overflows", 0))
        self.value = float(self.scaler.get_scale())
