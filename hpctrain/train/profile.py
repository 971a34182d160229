"""Profiling on request (the `profile` config group); nothing here exists in a run that asks for none.

profile.steps=[a,b]: a torch.profiler Chrome trace of optimizer steps a..b (1-based, inclusive) per
rank, in <run.dir>/profile/steps-a-b/rank-R.json, each step annotated `ProfilerStep#N` with N the
optimizer step (what Perfetto or chrome://tracing shows as the step's span). On a GPU also a CUDA
memory snapshot of the same steps, rank-R-memory.pickle (drag it into https://pytorch.org/memory_viz).
The directory names the steps it holds: a run resumed inside the window traces the rest of it, one
preempted inside the window writes what it recorded; a run resumed after b traces nothing.

profile.memory=true: the peak memory of each phase of a step (forward, backward, optimizer, and the
checkpoint save after it when there is one) for metrics.jsonl, mem_<phase>_bytes; forward and backward
are the largest over the step's micro-batches, and a pipeline-parallel run, whose schedule interleaves
them, has one forward_backward phase instead. On CUDA the allocator's peak
(max_memory_allocated after reset_peak_memory_stats); on CPU the process's peak RSS (VmHWM, reset
through /proc/self/clear_refs; where that is not allowed, the larger of the resident sizes at the
phase's start and end).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from hpctrain.core.schema import ProfileConfig
from hpctrain.train.metrics import peak_rss_bytes

log = logging.getLogger("hpctrain")

STEP_NAME = "ProfilerStep#"  # torch.profiler's own name for a step's span


def trace_dir(run_dir: str | os.PathLike, first: int, last: int) -> Path:
    return Path(run_dir) / "profile" / f"steps-{first}-{last}"


class Profiler:
    """Call begin(n) before optimizer step n (1-based) and end(n) after it (its checkpoint save
    included); close() after the loop, close(export=False) when it failed."""

    def __init__(self, cfg: ProfileConfig, run_dir: str | os.PathLike, rank: int, device: torch.device,
                 event: Optional[Callable[[str], None]] = None):
        self.first, self.last = int(cfg.steps[0]), int(cfg.steps[1])
        self.run_dir, self.rank, self.device, self.event = run_dir, rank, device, event
        self.prof = None
        self.started: Optional[int] = None  # the first step recorded
        self.step: Optional[int] = None  # the last step begun
        self._span = None

    def begin(self, n: int) -> None:
        if self.prof is None:
            if not self.first <= n <= self.last:
                return
            self._start(n)
        self.step = n
        self._span = torch.profiler.record_function(f"{STEP_NAME}{n}")
        self._span.__enter__()

    def end(self, n: int) -> None:
        if self.prof is None:
            return
        self._close_span()
        if n >= self.last:
            self._stop(export=True)

    def close(self, export: bool = True) -> None:
        """The loop is over: a window still open (a preempted run) is written as far as it got."""
        if self.prof is not None:
            self._close_span()
            self._stop(export)

    def _start(self, n: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000, device=self.device)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.start()
        self.started = n

    def _close_span(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None

    def _stop(self, export: bool) -> None:
        prof, self.prof = self.prof, None
        prof.stop()
        cuda = self.device.type == "cuda"
        try:
            if not export or self.step is None:
                return
            out = trace_dir(self.run_dir, self.started, self.step)
            try:
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"rank-{self.rank}.json"
                tmp = path.with_name(path.name + ".tmp")
                prof.export_chrome_trace(str(tmp))
                os.replace(tmp, path)  # a reader never sees half a trace
                if cuda:
                    torch.cuda.memory._dump_snapshot(str(out / f"rank-{self.rank}-memory.pickle"))
            except OSError as e:  # a trace is not worth the run
                log.warning("profile: could not write the trace of steps %d-%d into %s: %s",
                            self.started, self.step, out, e)
                return
            if self.event is not None:
                extra = " and a CUDA memory snapshot (rank-R-memory.pickle)" if cuda else ""
                self.event(f"profile: steps {self.started}-{self.step} traced into {out}: "
                           f"a Chrome trace per rank (rank-R.json){extra}")
        finally:
            if cuda:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)


# ---------------------------------------------------------------------------- memory per phase

def _proc_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PhaseMemory:
    """Peak memory of each named phase within the current step, in bytes. Phases may repeat within a
    step (forward and backward of every micro-batch): a phase's value is its largest peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.values: dict[str, int] = {}
        # The peak since the start, read before any reset: resetting the counter for a phase must
        # not lose it (the loop's mem_bytes reports it).
        self.overall = self._peak()
        self._can_reset = not self.cuda  # CPU: until /proc/self/clear_refs refuses

    def begin_step(self) -> None:
        self.values = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        before = self._peak()  # whatever happened since the last phase (evaluation, logging)
        self.overall = max(self.overall, before)
        start = self._reset()
        try:
            yield
        finally:
            peak = max(self._peak(), start) if self._can_reset or self.cuda else max(start, self._rss())
            self.overall = max(self.overall, peak)
            self.values[name] = max(self.values.get(name, 0), peak)

    def take(self) -> dict[str, int]:
        """This step's values as metrics (mem_<phase>_bytes)."""
        return {f"mem_{k}_bytes": v for k, v in self.values.items()}

    def peak_since_start(self) -> int:
        self.overall = max(self.overall, self._peak())
        return self.overall

    # -- the counters

    def _reset(self) -> int:
        """Reset the peak counter; returns the memory in use now (a floor for the phase's peak)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self._can_reset:
            self._can_reset = self._reset_rss()
        return self._rss()

    def _peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        kib = _proc_status_kib("VmHWM")
        if kib is None:
            return peak_rss_bytes()
        return kib * 1024

    @staticmethod
    def _rss() -> int:
        kib = _proc_status_kib("VmRSS")
        return 0 if kib is None else kib * 1024

    @staticmethod
    def _reset_rss() -> bool:
        """Linux: writing 5 to clear_refs sets the peak RSS (VmHWM) to the current RSS."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False
