"""A watchdog per rank: when the loop makes no progress for too long, write what this rank was
doing and fail, so that the supervisor restarts the run (hpctrain.launch.supervise).

The loop marks progress with `beat(step, phase)`. The allowed silence depends on the phase: steps
get `launcher.hang_timeout_s`, or, when that is 0, max(60 s, 10 x the median step time) once a few
steps were timed (until then, and during start-up, checkpoint saves and loads and compilation, the
collective timeout `launcher.timeout_s`, which is generous). On expiry the rank writes into
`<run.dir>/attempts/<n>/`:

- `stacks-rank-<r>.txt`: every thread's Python stack (faulthandler);
- `hang-rank-<r>.json`: rank, host, step, phase, seconds without progress, and how many collectives
  it entered on each of its process groups (their sequence numbers): a rank behind its peers on a
  group had not reached the collective they wait in;
- with NCCL, `nccl-trace-rank-<r>.pkl`: the flight recorder's dump (TORCH_NCCL_TRACE_BUFFER_SIZE),

then, after `linger_s` (so that every rank still able to report has done so before the first exit
makes the launcher tear the others down), exits with EXIT_HUNG. A rank that is stopped (SIGSTOP) or
dead writes nothing in that time: the supervisor names it from its silence. Why our own: torch's collective timeout ends a hung job only after
`timeout_s` and says nothing about who was stuck; torchrun's elastic agent restarts on failures but
does not detect hangs; NVIDIA's resiliency extension does both but is built around CUDA.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger("hpctrain")

EXIT_HUNG = 75
GENEROUS = ("start", "save", "load", "compile", "health")


def auto_timeout(step_times: list[float], floor: float = 60.0, factor: float = 10.0) -> Optional[float]:
    """The silence a step may take: max(floor, factor x median step time); None before 3 steps
    were timed (the first steps include compilation and warm-up)."""
    if len(step_times) < 3:
        return None
    return max(floor, factor * statistics.median(step_times[-50:]))


class Watchdog:
    def __init__(self, attempt_dir: Path, rank: int, hang_timeout_s: float, generous_s: float,
                 groups: Callable[[], dict] = dict, exit_fn: Callable[[int], None] = os._exit,
                 poll_s: float = 1.0, linger_s: float = 5.0, scale: float = 1.0):
        """`scale`: the hang timeout multiplied (under the node agents the collectives' own timeout,
        hpctrain.distributed.generation, frees the survivors first; this is the backstop)."""
        self.dir, self.rank, self.scale = Path(attempt_dir), rank, scale
        self.fixed, self.generous = hang_timeout_s, generous_s
        self.groups, self.exit_fn, self.poll_s, self.linger_s = groups, exit_fn, poll_s, linger_s
        self.step, self.phase, self.last = 0, "start", time.monotonic()
        self.step_times: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.fired = False

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int, phase: str = "step", step_time: Optional[float] = None) -> None:
        self.step, self.phase, self.last = step, phase, time.monotonic()
        if step_time is not None:
            self.step_times.append(step_time)

    def timeout(self) -> float:
        if self.phase in GENEROUS:
            return self.generous
        if self.fixed > 0:
            return self.scale * self.fixed
        auto = auto_timeout(self.step_times)
        return self.scale * auto if auto else self.generous

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            silent = time.monotonic() - self.last
            if silent > self.timeout():
                self.fire(silent)
                return

    def fire(self, silent: float) -> None:
        self.fired = True
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"stacks-rank-{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} on {socket.gethostname()}: no progress for {silent:.0f} s "
                    f"(step {self.step}, phase {self.phase})\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        report = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": self.step,
                  "phase": self.phase, "silent_s": round(silent, 1), "timeout_s": round(self.timeout(), 1),
                  "time": time.time(), "collectives": self._sequence_numbers()}
        _dump_nccl_trace(self.dir / f"nccl-trace-rank-{self.rank}.pkl")
        tmp = self.dir / f".hang-rank-{self.rank}.json"
        tmp.write_text(json.dumps(report))
        tmp.replace(self.dir / f"hang-rank-{self.rank}.json")
        log.error("no progress for %.0f s at step %d (%s): stacks in %s; stopping this rank so the run restarts",
                  silent, self.step, self.phase, self.dir)
        time.sleep(self.linger_s)
        logging.shutdown()
        self.exit_fn(EXIT_HUNG)

    def _sequence_numbers(self) -> dict:
        out = {}
        try:
            for name, group in self.groups().items():
                out[name] = int(group._get_sequence_number_for_group())
        except Exception as e:  # a backend without sequence numbers: the stacks still tell
            out["error"] = f"{type(e).__name__}: {e}"
        return out


def _dump_nccl_trace(path: Path) -> None:
    """NCCL's flight recorder, where the process runs NCCL with TORCH_NCCL_TRACE_BUFFER_SIZE set."""
    if not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return
    try:
        dump = torch._C._distributed_c10d._dump_nccl_trace()
        path.write_bytes(dump)
    except Exception as e:  # no NCCL in this build, or nothing recorded
        log.warning("no NCCL flight recorder dump: %s", e)
