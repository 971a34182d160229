"""Fault injection for testing recovery paths end to end (off unless HPCTRAIN_FAULT is set).

    HPCTRAIN_FAULT="kill_in_save:step=4,rank=1"   rank 1 SIGKILLs itself in the middle of the step-4
                                                   save: its shard files are written, the save's
                                                   closing collective and the commit never happen

    HPCTRAIN_FAULT="slow_step:ms=250"             every step takes 250 ms longer (a sleep): lets a
                                                   tiny run outlast a Slurm signal's arrival

Users can use it too, to see how their cluster setup recovers from a torn save or a time limit.
"""
from __future__ import annotations

import os
import signal
import time


def _parse(spec: str) -> tuple[str, dict]:
    name, _, args = spec.partition(":")
    kv = dict(part.split("=", 1) for part in args.split(",") if part)
    return name, {k: int(v) for k, v in kv.items()}


def armed(point: str, **where: int) -> bool:
    spec = os.environ.get("HPCTRAIN_FAULT")
    if not spec:
        return False
    name, cond = _parse(spec)
    return name == point and all(where.get(k) == v for k, v in cond.items())


def wrap_writer(writer, step: int, rank: int):
    """A DCP storage writer that dies right after writing this rank's data, if so armed."""
    if not armed("kill_in_save", step=step, rank=rank):
        return writer
    write_data = writer.write_data

    def write_then_die(plan, planner):
        write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    writer.write_data = write_then_die
    return writer


def slow_step() -> None:
    spec = os.environ.get("HPCTRAIN_FAULT")
    if spec and spec.startswith("slow_step"):
        time.sleep(_parse(spec)[1].get("ms", 0) / 1000)
