"""`python -m hpctrain.report.goodput <run.dir>`: how much of a run's wall time went into steps it kept.

goodput = time in productive steps / wall time, where productive steps are the steps of the run as
it finally happened (metrics.jsonl keeps one record per step; steps trained again after a restart
replace the lost ones) and the wall time runs from the first start of the ranks to the end of the
last (attempts.jsonl), less the time a person kept the run stopped (an interruption of cause
"stopped", a Ctrl-C: from the stop to the next start). The breakdown charges each interruption (interruptions.jsonl) with the time
from the failure to the first step after the restart, and with the steps it made train again; the
table says where each restart took its state from (memory snapshots, and whose replica, or disk).
Works on a run in progress too (its wall time ends now). Malformed lines of those files are left out
and named (file:line) under the figures; a wall time that ends before it starts is reported as a
problem, not as a figure.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.core.rundir import INTERRUPTIONS, STOPPED, read_jsonl_checked


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    steps: int
    interruptions: list = field(default_factory=list)  # the records, as written
    lost_s: float = 0.0  # failure -> first step after the restart, summed
    paused_s: float = 0.0  # a person's stop -> the next start: not in wall_s
    redone_s: float = 0.0  # steps trained twice, at the median step time
    skipped: list = field(default_factory=list)  # 'file:line: why' of each malformed line left out
    problems: list = field(default_factory=list)  # why a figure cannot be trusted (a negative wall time)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        """Start-up, checkpoint saves, logging: wall time neither productive nor charged to a failure."""
        return max(0.0, self.wall_s - self.productive_s - self.lost_s - self.redone_s)


def measure(run_dir: str | Path) -> Goodput:
    run_dir = Path(run_dir)
    attempts, skipped_a = read_jsonl_checked(run_dir / "attempts.jsonl")
    metrics, skipped_m = read_jsonl_checked(run_dir / "metrics.jsonl")
    interruptions, skipped_i = read_jsonl_checked(run_dir / INTERRUPTIONS)
    skipped = skipped_a + skipped_m + skipped_i
    for name, records, bad in (("attempts.jsonl", attempts, skipped_a), ("metrics.jsonl", metrics, skipped_m)):
        if not records and bad:
            raise ValueError(f"{run_dir / name} holds no usable record: {len(bad)} malformed line(s) left out "
                             f"({'; '.join(bad[:3])}). Fix: repair those lines (one JSON object per line, as "
                             "hpctrain writes them) or remove them")
    if not attempts or not metrics:
        raise ValueError(f"{run_dir} has no attempts.jsonl or metrics.jsonl: is it a run directory "
                         "of hpctrain that has started?")
    start = attempts[0]["start"]
    end = max(a.get("end", time.time()) for a in attempts)
    by_step = {m["step"]: m for m in metrics}  # the last record of a step is the one kept
    every = _log_every(sorted(by_step))
    times = [m["step_time_s"] for m in by_step.values() if "step_time_s" in m]
    paused = sum(_paused(r) for r in interruptions)
    g = Goodput(wall_s=end - start - paused, paused_s=paused, productive_s=sum(times) * every, steps=len(by_step) * every,
                interruptions=interruptions, skipped=skipped)
    if g.wall_s < 0:
        g.problems.append(f"{run_dir / 'attempts.jsonl'}: the run ends (end={end}) {start - end:.1f} s before it "
                          f"starts (start={start} of its first record): the clocks of the machines that wrote it "
                          "disagree, or the file was edited. Fix: correct its start and end times")
    median = statistics.median(times) if times else 0.0
    for rec in g.interruptions:
        if rec.get("cause") == "preempted":
            continue
        if rec.get("recover_s") is not None and rec.get("cause") != STOPPED:
            g.lost_s += rec["recover_s"]
        g.redone_s += (rec.get("steps_redone") or 0) * median
    return g


def _paused(rec: dict) -> float:
    """How long a person kept the run stopped: from their stop to the next start (0 for other causes)."""
    stopped, restarted = rec.get("failed_at") or rec.get("time"), rec.get("restarted_at")
    if rec.get("cause") != STOPPED or not all(isinstance(t, (int, float)) for t in (stopped, restarted)):
        return 0.0
    return max(0.0, restarted - stopped)


def _log_every(steps: list) -> int:
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return max(1, round(statistics.median(gaps))) if gaps else 1


def restored_text(rec: dict) -> str:
    """Where the restart after an interruption took its state from (the record's `restored_from`, which the
    supervisor adds with checkpoint.memory_every): 'memory 120' (every rank its own node's snapshot),
    'memory 120 (r1 n1)' (rank 1 from the replica on n1), 'disk 100', 'disk -' (no checkpoint: from the
    start), and a lost node's replacement, 'n2->n3'. '-' for records without it (older runs, no memory)."""
    rf, parts = rec.get("restored_from"), []
    if isinstance(rf, dict) and rf.get("kind") in ("memory", "disk"):
        step = rf.get("step")
        parts.append(f"{rf['kind']} {step if isinstance(step, int) else '-'}")
        source = rf.get("source")
        if rf["kind"] == "memory" and isinstance(source, dict):
            peers = [f"r{r} {n}" for r, n in sorted(source.items(), key=lambda kv: str(kv[0]).zfill(8))
                     if n != "own"]
            if peers:
                parts.append(f"({', '.join(peers)})")
    replaced = rec.get("replaced")
    if isinstance(replaced, dict) and replaced:
        parts.append(" ".join(f"{lost}->{spare}" for lost, spare in replaced.items()))
    return " ".join(parts) or "-"


def report(g: Goodput) -> str:
    if g.problems:  # no figure to give: the wall time is not a time
        lines = [f"goodput cannot be measured: {p}" for p in g.problems]
    else:
        lines = [f"goodput {g.goodput:.1%}: {g.productive_s:.1f} s in {g.steps} productive steps of {g.wall_s:.1f} s wall time",
                 f"  charged to interruptions: {g.lost_s:.1f} s from failure to the next step, "
                 f"{g.redone_s:.1f} s of steps trained again; start-up, saves and the rest: {g.other_s:.1f} s"]
        if g.paused_s:
            lines.append(f"  not counted: {g.paused_s:.1f} s stopped by a person (Ctrl-C) until the next start")
    if g.interruptions:
        lines.append(f"{'cause':<10} {'ranks':<8} {'nodes':<10} {'detect s':>9} {'recover s':>10} {'redone':>7}  "
                     f"{'restored from':<22} detail")
        for r in g.interruptions:
            detect = f"{r['detect_s']:.1f}" if r.get("detect_s") is not None else "-"
            recover = f"{r['recover_s']:.1f}" if r.get("recover_s") is not None else "-"
            lines.append(f"{r['cause']:<10} {','.join(map(str, r.get('ranks') or [])) or '-':<8} "
                         f"{','.join(r.get('nodes') or []) or '-':<10} {detect:>9} {recover:>10} "
                         f"{r.get('steps_redone') or 0:>7}  {restored_text(r):<22} {(r.get('detail') or '')[:80]}")
    lines += [f"warning: {s}; line left out" for s in g.skipped[:10]]
    if len(g.skipped) > 10:
        lines.append(f"warning: {len(g.skipped) - 10} more malformed lines left out")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.report.goodput", description=(
        "How much of a run's wall time went into steps it kept (goodput), and what each interruption cost: "
        "the time from the failure to the next step, and the steps trained again. Exit 1 when the figures "
        "cannot be trusted (the files disagree), 2 when they cannot be read."))
    ap.add_argument("run_dir", help="the run directory (run.dir): attempts.jsonl, metrics.jsonl, interruptions.jsonl")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        g = measure(args.run_dir)
        print(report(g))
    except ValueError as e:
        print(f"hpctrain.report.goodput: error: {e}", file=sys.stderr)
        return 2
    return 1 if g.problems else 0


if __name__ == "__main__":
    sys.exit(main())
