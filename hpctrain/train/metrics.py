"""Metrics of rank 0: one JSON object per logged step in metrics.jsonl, the same records to the
experiment trackers (hpctrain.train.trackers: TensorBoard, W&B, MLflow), and progress for people (an
updating line on a terminal, plain lines in a log)."""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from hpctrain.core.rundir import end_torn_line, read_jsonl
from hpctrain.train.trackers import scalars

log = logging.getLogger("hpctrain")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, total_steps: int, trackers: Sequence = (),
                 stream: IO[str] | None = None, live: bool | None = None):
        """`trackers`: hpctrain.train.trackers.Tracker objects, not yet started (trackers.from_config)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        end_torn_line(self.path)  # a rank killed mid-write: the restarted run's first record stays whole
        self.file = open(self.path, "a", buffering=1)
        self.total = total_steps
        self.stream = stream or sys.stdout
        # An updating line only where a person watches a terminal; plain lines elsewhere (logs, CI). The
        # local launcher copies rank 0's output to the terminal and to logs/rank-0.log through a pipe,
        # and says when the terminal is one (hpctrain.launch.local.LIVE_ENV).
        if live is None:
            live = self.stream.isatty() or (stream is None and os.environ.get("HPCTRAIN_LIVE_PROGRESS") == "1")
        self.live = live
        self._start = time.monotonic()
        self._first_step: int | None = None
        self._last_step: int | None = None
        self.trackers: list = []
        for t in trackers:
            where = self._guard(t, "start", t.start)
            if where is not None:
                self.trackers.append(t)
                self.event(f"{t.name}: {where}")

    def _guard(self, tracker, what: str, fn, *args):
        """Run one tracker call; on an error warn once and drop the tracker: training goes on."""
        try:
            out = fn(*args)
            return "" if out is None else out
        except Exception as e:  # noqa: BLE001 - whatever a tracker raises, the run goes on
            msg = (f"tracker {tracker.name} failed in {what}: {type(e).__name__}: {e}; "
                   "it logs nothing more in this run, training goes on")
            log.warning("%s", msg)
            self.event(f"warning: {msg}")
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            return None

    def log(self, step: int, **values) -> None:
        """`step` counts completed optimizer steps (1-based)."""
        if self._first_step is None:
            self._first_step = step - 1
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}, "time": time.time()}
        self.file.write(json.dumps(record) + "\n")
        self._last_step = step
        if self.trackers:
            numbers = scalars({k: record[k] for k in values})  # loss -> train/loss, val_loss -> val/loss
            for t in list(self.trackers):
                self._guard(t, f"log (step {step})", t.log, step, numbers, record["time"])
        self._show(step, record)

    def event(self, text: str) -> None:
        """A one-off message (resumed, saved, preempted) between progress lines."""
        if self.live:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def _show(self, step: int, r: dict) -> None:
        done = step - self._first_step
        elapsed = time.monotonic() - self._start
        eta = elapsed / max(1, done) * (self.total - step)
        width = 20
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"[{bar}] step {step}/{self.total}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                f"{r['tokens_per_s']:,.0f} tok/s  mfu {100 * r['mfu']:.1f}%  "
                f"mem {r['mem_bytes'] / 2**30:.2f} GiB  eta {fmt_duration(eta)}")
        if "expert_share_min" in r:  # Mixture-of-Experts: the least and most loaded expert of any layer
            line += f"  expert share {r['expert_share_min']:.2f}-{r['expert_share_max']:.2f}"
        if "val_loss" in r:
            line += f"  val loss {r['val_loss']:.4f}"
            if "val_ppl" in r:  # (a preference loss has no perplexity)
                line += f" ppl {r['val_ppl']:,.2f}"
        if r.get("nonfinite"):
            line += "  not finite: no update"
        if "rewards/margins" in r:  # train.objective=dpo: how far the policy prefers the chosen completions
            line += f"  margin {r['rewards/margins']:.3f}  acc {r['rewards/accuracies']:.2f}"
        if r.get("skipped_steps"):  # the run's count (train.on_nonfinite=skip)
            line += f"  skipped {r['skipped_steps']}"
        if "loss_scale" in r:  # train.precision=fp16: the loss scale, and the steps its overflows skipped
            line += f"  scale {r['loss_scale']:g}"
            if r.get("overflow"):
                line += " overflow: no update"
            if r.get("overflow_steps"):
                line += f"  overflows {r['overflow_steps']}"
        if self.live:
            self.stream.write("\r\033[K" + line + ("\n" if step >= self.total or "val_loss" in r else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.file.close()
        # Finished: train.steps reached (or nothing to do) and no error on its way out of the loop;
        # else (preempted, failed) the trackers mark their runs so until a restart reopens them.
        finished = sys.exc_info()[0] is None and (self._last_step is None or self._last_step >= self.total)
        for t in list(self.trackers):
            self._guard(t, "close", t.close, finished)
        self.trackers = []


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")
