"""A rank's generations under the node agents (checkpoint.memory_every > 0): after a failure the
surviving ranks stay in their process, drop their Trainer and process group, and train on in the next
generation with the ranks the agents forked afresh for the lost ones: no new interpreter, no torch
import, no CUDA context, only a new process group over a new port and the state restored from the
newest memory snapshot (hpctrain.checkpoint.memory).

The supervisor writes <run_dir>/attempts/<g>/plan.json for each generation g (who runs where, the
rendezvous, the survivors); a survivor waits for the next plan that names it. What it does not trust
is its own live tensors: a failure can land in the middle of an update, so every rank of the new
generation restores the same snapshot.

Why not NVRx's in-process restart (nvidia-resiliency-ext's inprocess.Wrapper): it aborts NCCL process
groups only (gloo runs here), and its store is hosted by rank 0, which may be the rank that died; why
not torchft: it re-forms a quorum of replica groups each step and trains on with fewer, not the same
layout with bit-identical losses (docs/recovery.md).
"""
from __future__ import annotations

import gc
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional


ARM_AFTER_STEPS = 3  # a generation's first steps (warm-up, a restore's first save) run under the generous timeout


def set_collective_timeout(seconds: float, keep=()) -> int:
    """Every process group's collectives give up after `seconds` (a peer stopped by SIGSTOP, or stuck,
    otherwise holds a gloo collective until launcher.timeout_s): the survivors then leave the step with
    an error and wait for the next generation. `keep`: groups left alone (the checkpoint's, whose saves
    may take longer). Uses torch's private _set_pg_timeout; where it is missing, returns 0 and the
    watchdog remains the only way out of a hang."""
    import torch.distributed.distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:
        return 0
    done = 0
    for pg in list(getattr(c10d._world, "pg_map", {})):
        if any(pg is k for k in keep):
            continue
        try:
            setter(timedelta(seconds=seconds), pg)
            done += 1
        except (ValueError, AssertionError, RuntimeError):
            pass  # a group this rank is not in
    return done


class ArmingWatchdog:
    """The rank's watchdog, as the training loop sees it, that also shortens the collectives' timeout
    once the generation has made ARM_AFTER_STEPS steps (hpctrain.train.loop beats once per step)."""

    def __init__(self, watchdog, seconds: float, keep):
        """`seconds`: launcher.hang_timeout_s, or 0: the watchdog's own rule, max(60 s, 10 x the median
        step), from this generation's timed steps."""
        self.watchdog, self.seconds, self.keep = watchdog, seconds, keep
        self.first: Optional[int] = None
        self.times: list[float] = []
        self.armed: Optional[float] = None

    def beat(self, step: int, phase: str = "step", step_time: Optional[float] = None) -> None:
        self.watchdog.beat(step, phase, step_time)
        if phase != "step" or self.armed is not None:
            return
        if step_time is not None:
            self.times.append(step_time)
        self.first = step if self.first is None else self.first
        if step - self.first >= ARM_AFTER_STEPS:
            from hpctrain.train.watchdog import auto_timeout

            self.armed = self.seconds or auto_timeout(self.times) or 60.0
            set_collective_timeout(self.armed, keep=[k for k in self.keep() if k is not None])

    def __getattr__(self, name):
        return getattr(self.watchdog, name)


def hang_report(adir: Path, rank: int, error: BaseException, step: Optional[int]) -> None:
    """A collective that timed out because a peer made no progress: reported as the watchdog reports a
    hang (hpctrain.launch.failures blames the ranks that wrote nothing)."""
    rep = {"rank": rank, "time": time.time(), "step": step, "phase": "collective", "silent_s": 0.0,
           "timeout_s": None, "collectives": {}, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    try:
        (adir / f"hang-rank-{rank}.json").write_text(json.dumps(rep))
    except OSError:
        pass


def is_timeout(error: BaseException) -> bool:
    text = str(error)
    return "Timed out waiting" in text or "timed out" in text.lower()


def waiting_file(adir: Path, rank: int) -> Path:
    return adir / f"waiting-rank-{rank}"


def say_waiting(adir: Path, rank: int) -> None:
    """This rank has dropped its generation and waits for the next plan: the supervisor keeps only such
    ranks (one that reported an error and is about to exit is not one)."""
    waiting_file(adir, rank).touch()


def teardown(trainer) -> None:
    """What held the old generation's process group goes, so that the next can be made in this process."""
    import torch.distributed as dist

    if trainer is not None:
        try:  # the checkpoint and snapshot threads, without waiting for what a broken group holds up
            trainer.close(wait=False)
        except Exception:  # noqa: BLE001 - a snapshot not finished is never used (complete or absent)
            pass
    forget_save_plans()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to close; a new one is made anyway
            pass
    gc.collect()


def forget_save_plans() -> None:
    """Distributed checkpoint's save plans cached by the planner's class, process-wide: the coordinator
    (rank 0) of a generation that kept them tells the others to reuse a plan that a rank new to the
    generation never made (KeyError 'ReusingSavePlanner' in finish_plan). Every survivor forgets them."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in [a for a in vars(SavePlanner) if a.startswith("_cached")]:
        cache = getattr(SavePlanner, name)
        if isinstance(cache, dict):
            cache.clear()
