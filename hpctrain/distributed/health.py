"""The pre-flight health check every rank runs before the first step (and after each restart): a
compute kernel and a collective, in well under a second. A node whose kernel is far slower than the
others', or whose collective returns a wrong sum, is named in `<run.dir>/attempts/<n>/health.json`
and every rank exits with EXIT_UNHEALTHY; the supervisor then leaves the node out and starts again
(hpctrain.launch.supervise). A node that cannot even start its ranks fails the start-up instead,
which the supervisor sees the same way.
"""
from __future__ import annotations

import json
import logging
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.core import faults

log = logging.getLogger("hpctrain")

EXIT_UNHEALTHY = 76


@dataclass
class Verdict:
    unhealthy: dict  # host -> why
    kernel_s: dict  # host -> seconds of the kernel (its slowest rank)

    @property
    def ok(self) -> bool:
        return not self.unhealthy


def _kernel(device, repeats: int = 5, iters: int = 8) -> float:
    """Best of `repeats` timings of `iters` square matmuls, a few ms each (best-of: a rank sharing its
    core with another process for a moment is not a sick node). A CPU rank's kernel is timed in the
    process's CPU time, which a core shared with other processes does not stretch (on a busy machine
    one rank's wall time can be 5-35x another's for seconds on end); a GPU's after a synchronize."""
    size, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        for _ in range(iters):
            a = torch.tanh(a @ b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, clock() - t0)
    return best


def judge(per_rank: list[tuple[str, float, bool]], slowdown: float) -> Verdict:
    """(host, kernel seconds, collective ok) of every rank -> the nodes to leave out. A node is as
    slow as its slowest rank; it is unhealthy beyond `slowdown` x the lower median over nodes (with
    two nodes the median would be their mean, which one very slow node drags up to itself)."""
    by_host: dict[str, list] = {}
    bad: dict[str, str] = {}
    for host, seconds, ok in per_rank:
        by_host.setdefault(host, []).append(seconds)
        if not ok:
            bad[host] = "the all-reduce returned a wrong sum"
    node_s = {h: max(v) for h, v in by_host.items()}
    typical = statistics.median_low(sorted(node_s.values()))
    for h, s in node_s.items():
        if s > slowdown * typical and h not in bad:
            bad[h] = f"compute kernel {s * 1e3:.1f} ms, {s / typical:.1f}x the median node's {typical * 1e3:.1f} ms"
    return Verdict(unhealthy=bad, kernel_s=node_s)


def check(attempt_dir: Path, device, slowdown: float, rounds: int = 3) -> Verdict:
    """Every rank calls this together, after the process group is up. A node found slow is measured
    again (up to `rounds` times): it is left out only if it is slow every time, because ranks that
    share cores (or a node that was busy for a moment) look slow once, a sick one always does."""
    host = socket.gethostname()
    x = torch.ones(1024, device=device)
    dist.all_reduce(x)
    ok = bool((x == dist.get_world_size()).all())
    suspects = None
    for _ in range(rounds):
        seconds = _kernel(device)
        injected = faults.health_slowdown(host)
        if injected > 1:  # a slow node for tests and trials: really take that long
            time.sleep(seconds * (injected - 1))
            seconds *= injected
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (host, seconds, ok))
        verdict = judge(gathered, slowdown)
        suspects = set(verdict.unhealthy) if suspects is None else suspects & set(verdict.unhealthy)
        verdict.unhealthy = {h: w for h, w in verdict.unhealthy.items() if h in suspects}
        if verdict.ok:
            break
    if dist.get_rank() == 0:
        attempt_dir.mkdir(parents=True, exist_ok=True)
        (attempt_dir / "health.json").write_text(json.dumps(
            {"unhealthy": verdict.unhealthy, "kernel_s": verdict.kernel_s, "slowdown": slowdown,
             "time": time.time()}, indent=1))
        if verdict.ok:
            log.info("health check passed on %d node(s) (kernel %.1f-%.1f ms)", len(verdict.kernel_s),
                     1e3 * min(verdict.kernel_s.values()), 1e3 * max(verdict.kernel_s.values()))
        else:
            log.error("health check: unhealthy node(s): %s", "; ".join(f"{h}: {w}" for h, w in verdict.unhealthy.items()))
    return verdict
