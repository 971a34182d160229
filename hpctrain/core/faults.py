"""Fault injection, for the tests and for users trying how their cluster recovers (off unless
HPCTRAIN_FAULT is set; several faults separated by `;`).

    crash:step=200,rank=1         rank 1 SIGKILLs itself after step 200 (an OOM kill); with
                                  `signal=SEGV` (or another name) it dies of that signal instead (a
                                  segfault, which leaves its stack in its log)
    raise:step=3,rank=1           rank 1 raises an error after step 3, at every attempt: a failure
                                  that a restart cannot cure (a bad file found late)
    hang:step=50,rank=1           rank 1 stops making progress after step 50 (a kernel, I/O or a
                                  collective of its own that never returns), holding every other
                                  rank in the step's closing collective
    slow_rank:rank=1,ms=200       rank 1 takes 200 ms longer per step (a straggler)
    unhealthy:node=n2             the pre-flight health check's kernel runs 10x slower on host n2
                                  (`slowdown=` sets the factor)
    kill_in_save:step=4,rank=1    rank 1 SIGKILLs itself in the middle of the step-4 save: its shard
                                  files are written, the save's closing collective and commit never
                                  happen
    nonfinite:step=4,rank=1       rank 1's loss of step 4 is NaN (its gradients stay finite): the
                                  step's update is not applied (train.on_nonfinite)
    infgrad:step=4,rank=1         an infinity in one of rank 1's gradients at step 4, after backward
                                  (and data parallel's reduction); `param=norm` picks the first
                                  parameter whose name holds `norm`: under train.precision=fp16 an
                                  overflow, which every rank must skip and halve the scale for;
                                  otherwise a non-finite gradient (train.on_nonfinite)
    slow_step:ms=250              every step takes 250 ms longer (a sleep): lets a tiny run outlast a
                                  Slurm signal's arrival

crash, hang and unhealthy fire in the run's first attempt only (`attempt=0`; the in-job restart is
attempt 1, 2, ...), so that the restarted run can get past them; `attempt=-1` fires in every attempt.
The attempt comes from HPCTRAIN_ATTEMPT, which the supervisor sets (hpctrain.launch.supervise).
No torch here: the login node reads the same settings.
"""
from __future__ import annotations

import os
import signal
import time

ONCE = ("crash", "hang", "unhealthy")  # fire in attempt 0 unless told otherwise


def _value(v: str):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def specs(env: dict | None = None) -> list[tuple[str, dict]]:
    """(name, arguments) of every fault in HPCTRAIN_FAULT."""
    text = (env if env is not None else os.environ).get("HPCTRAIN_FAULT", "")
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, args = part.partition(":")
        kv = dict(a.split("=", 1) for a in args.split(",") if a)
        out.append((name, {k: _value(v) for k, v in kv.items()}))
    return out


def attempt() -> int:
    return int(os.environ.get("HPCTRAIN_ATTEMPT", "0") or 0)


def armed(point: str, **where) -> dict | None:
    """The arguments of the fault `point` if it applies here (every condition it names matches
    `where`, and the attempt); None otherwise."""
    for name, args in specs():
        if name != point:
            continue
        want_attempt = args.get("attempt", 0 if name in ONCE else -1)
        if want_attempt != -1 and want_attempt != attempt():
            continue
        conditions = {k: v for k, v in args.items() if k in ("step", "rank", "node")}
        if all(where.get(k) == v for k, v in conditions.items()):
            return args
    return None


def after_step(step: int, rank: int) -> None:
    """Called by every rank once step `step` is done (its loss read back)."""
    crash = armed("crash", step=step, rank=rank)
    if crash is not None:
        name = f"SIG{crash.get('signal', 'KILL')}"
        if name not in signal.Signals.__members__:
            raise ValueError(f"HPCTRAIN_FAULT: crash:signal={crash['signal']} names no signal (e.g. SEGV, KILL, ABRT)")
        os.kill(os.getpid(), signal.Signals[name])
    if armed("raise", step=step, rank=rank) is not None:
        raise RuntimeError(f"injected failure at step {step} on rank {rank} (HPCTRAIN_FAULT)")
    if armed("hang", step=step, rank=rank) is not None:
        while True:
            time.sleep(3600)
    slow = armed("slow_rank", rank=rank)
    if slow is not None:
        time.sleep(slow.get("ms", 100) / 1000)
    step_delay = armed("slow_step")
    if step_delay is not None:
        time.sleep(step_delay.get("ms", 0) / 1000)


def health_slowdown(host: str) -> float:
    """How much slower the health check's kernel is made to run on `host` (1: not at all)."""
    args = armed("unhealthy", node=host)
    return float(args.get("slowdown", 10)) if args is not None else 1.0


def wrap_writer(writer, step: int, rank: int):
    """A DCP storage writer that dies right after writing this rank's data, if so armed."""
    if armed("kill_in_save", step=step, rank=rank) is None:
        return writer
    write_data = writer.write_data

    def write_then_die(plan, planner):
        write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    writer.write_data = write_then_die
    return writer


def slow_step() -> None:
    step_delay = armed("slow_step")
    if step_delay is not None:
        time.sleep(step_delay.get("ms", 0) / 1000)
