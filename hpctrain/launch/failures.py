"""Why a start of the ranks failed, from what they left behind (pure: files in, a Failure out).

The ranks of start N write into `<run.dir>/attempts/N/`: `ranks.json` (the host of every rank),
`health.json` (the pre-flight check), `hang-rank-R.json` and `stacks-rank-R.txt` (a watchdog that saw
no progress), `error-rank-R.json` (an exception). The runner adds how each rank ended (exit codes,
signals, srun's own report) and which nodes no longer answer. The first rule that applies wins:

1. unhealthy: the health check named nodes;
2. node lost: a node of the start no longer answers;
3. hung: a watchdog fired. To blame: the ranks that wrote no report in time (stopped, or dead), else
   the ranks behind the others on the world group (fewer collectives entered: they had not reached
   the one the others wait in);
4. crashed: a rank killed by a signal it did not get from us, else the earliest error report, else
   the first rank that failed.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hpctrain.core.rundir import ECHOES

EXIT_HUNG = 75  # hpctrain.train.watchdog
EXIT_UNHEALTHY = 76  # hpctrain.distributed.health
REPORT_WINDOW_S = 3.0  # watchdogs linger 5 s (hpctrain.train.watchdog) and poll every second


@dataclass
class Failure:
    cause: str  # unhealthy | node_lost | hung | crashed; the supervisor's own: preempted | stopped
    ranks: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    detail: str = ""
    failed_at: Optional[float] = None  # best estimate (the last sign of progress where nothing better)

    def signature(self) -> tuple:
        """What 'failing the same way' means: same cause, same ranks and nodes, same message."""
        return self.cause, tuple(self.ranks), tuple(self.nodes), re.sub(r"\d+\.\d+", "#", self.detail)


def read_reports(attempt_dir: Path) -> dict:
    """Everything the ranks of one start wrote about themselves."""
    def load(p: Path):
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    d = Path(attempt_dir)
    out = {"hosts": {}, "health": load(d / "health.json"), "hangs": {}, "errors": {}}
    ranks = load(d / "ranks.json") or {}
    out["hosts"] = {int(r): h for r, h in ranks.get("hosts", {}).items()}
    for p in d.glob("hang-rank-*.json"):
        rep = load(p)
        if rep:
            out["hangs"][int(rep["rank"])] = rep
    for p in d.glob("error-rank-*.json"):
        rep = load(p)
        if rep:
            out["errors"][int(rep["rank"])] = rep
    return out


def classify(reports: dict, ended: dict, world: int, lost_nodes: list, last_progress: Optional[float]) -> Failure:
    """`ended`: rank -> how it ended ("exit code N", "was killed by SIGKILL", ...), in the order the
    runner saw them; `lost_nodes`: nodes that no longer answer; `last_progress`: time of the last
    logged step."""
    hosts = reports["hosts"]
    health = reports.get("health") or {}
    if health.get("unhealthy"):
        bad = sorted(health["unhealthy"])
        return Failure("unhealthy", [r for r, h in sorted(hosts.items()) if h in bad], bad,
                       "; ".join(f"{h}: {health['unhealthy'][h]}" for h in bad), health.get("time"))
    if lost_nodes:
        return Failure("node_lost", [r for r, h in sorted(hosts.items()) if h in lost_nodes], sorted(lost_nodes),
                       f"node(s) {', '.join(sorted(lost_nodes))} no longer answer", last_progress)
    hangs = reports["hangs"]
    if hangs or any(how == f"exit code {EXIT_HUNG}" for how in ended.values()):
        return _hang(hangs, hosts, world)
    return _crash(reports["errors"], ended, hosts, world, last_progress)


def _hang(hangs: dict, hosts: dict, world: int) -> Failure:
    # In time: within REPORT_WINDOW_S of the first report. Watchdogs that can fire do so within their
    # poll of each other and linger before exiting; a report later than that comes from a rank woken
    # or let go by the teardown of the others (Slurm sends SIGCONT before killing a step), which was
    # silent while it mattered.
    first = min((rep.get("time", 0.0) for rep in hangs.values()), default=0.0)
    late = [r for r, rep in hangs.items() if rep.get("time", 0.0) > first + REPORT_WINDOW_S]
    hangs = {r: rep for r, rep in hangs.items() if r not in late}
    silent = [r for r in range(world) if r not in hangs]
    seqs = {r: rep.get("collectives", {}).get("world") for r, rep in hangs.items()}
    seqs = {r: s for r, s in seqs.items() if isinstance(s, int)}
    behind = []
    if seqs and len(set(seqs.values())) > 1:
        ahead = max(seqs.values())
        behind = [r for r, s in seqs.items() if s < ahead]
    if silent:  # the clearer sign: the others' sequence numbers only say where each of them waits
        behind = []
    blamed = sorted(set(silent) | set(behind))
    parts = []
    if silent:
        parts.append(f"rank(s) {_ranks(silent)} wrote no report (stopped or dead)")
    if behind:
        parts.append(f"rank(s) {_ranks(behind)} had not reached collective #{max(seqs.values())} of the world "
                     "group that the others wait in")
    if not parts:
        parts.append("every rank waits in the same collective: none stands out (the network?)")
        blamed = sorted(hangs)
    steps = sorted({rep["step"] for rep in hangs.values()})
    since = min((rep["time"] - rep["silent_s"] for rep in hangs.values()), default=None)
    where = f" at step {steps[0]}" if len(steps) == 1 else (f" at steps {steps}" if steps else "")
    return Failure("hung", blamed, sorted({hosts[r] for r in blamed if r in hosts}),
                   f"no progress{where}: " + "; ".join(parts), since)


def _crash(errors: dict, ended: dict, hosts: dict, world: int, last_progress: Optional[float]) -> Failure:
    signalled = [r for r, how in ended.items() if "killed by" in how or "signal" in how.lower()]
    own = {r: e for r, e in errors.items() if not any(echo in e.get("error", "") for echo in ECHOES)}
    # Every report only echoes a peer's death: the peer is a rank that wrote none (killed before it
    # could; srun may report its death only after it began tearing the step down, too late to count).
    silent = [r for r in range(world) if r not in errors] if errors and not own else []
    if signalled:
        r = signalled[0]
        detail = f"rank {r} {ended[r]}"
        when = last_progress
    elif silent:
        r = silent[0]
        echo = errors[min(errors, key=lambda k: errors[k].get("time", 0))].get("error", "?")
        detail = (f"rank {r} ended without a word while rank(s) {_ranks(sorted(errors))} lost their connection "
                  f"to a peer ({echo[:200]})")
        when = last_progress
    elif own or errors:
        pick = own or errors
        r = min(pick, key=lambda k: pick[k].get("time", 0))
        detail = f"rank {r}: {pick[r].get('error', '?')}"
        when = pick[r].get("time")
    elif ended:
        r = next(iter(ended))
        detail = f"rank {r} {ended[r]}"
        when = last_progress
    else:
        return Failure("crashed", [], [], "the ranks ended with an error but none says which", last_progress)
    return Failure("crashed", [r], [hosts[r]] if r in hosts else [], detail, when)


def _ranks(rs: list) -> str:
    return ", ".join(map(str, rs))


def srun_failures(stderr: str) -> dict:
    """Rank -> how it ended, from srun's own lines, in the order srun printed them:
    `srun: error: n2: task 3: Killed`, `srun: error: n1: tasks 0-1: Exited with exit code 1`."""
    out: dict = {}
    # What srun reports after it began tearing the step down is its own doing, not a cause. Slurm
    # 22.05 writes the first sign as `srun: launch/slurm: _step_signal: Terminating StepId=12.0`
    # (older ones `srun: Terminating StepId=12.0`); tasks it then killed say `Terminated`.
    stderr = re.split(r"srun: (?:[\w/]+: )*(?:Terminating|Job step aborted|Force Terminated)|\*\*\* STEP .* CANCELLED",
                      stderr)[0]
    for m in re.finditer(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)", stderr):
        how = m.group(3).strip()
        code = re.match(r"Exited with exit code (\d+)", how)
        how = f"exit code {code.group(1)}" if code else ("was killed by SIGKILL" if how == "Killed" else f"signal: {how}")
        for part in m.group(2).split(","):
            lo, _, hi = part.partition("-")
            for r in range(int(lo), int(hi or lo) + 1):
                out.setdefault(r, how)
    return out


def now() -> float:
    return time.time()
