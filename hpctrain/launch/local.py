"""The embedded default: start N ranks on this machine, watch them, stop them all if one fails.

Rank 0 writes to this terminal; every other rank to <run_dir>/logs/rank-N.log. SIGINT, SIGTERM
and SIGUSR2 sent to the launcher are passed on to every rank (USR2 asks for a collective save).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HPCTRAIN_LAUNCHER="local",
               PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def launch(run_dir: str | os.PathLike, nproc: int, cmd: Sequence[str] | None = None,
           grace_s: float = 10.0, settle_s: float = 2.0) -> int:
    """Run `cmd` (default: the hpctrain rank entry) as nproc ranks; returns the job's exit code."""
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = list(cmd or [sys.executable, "-m", "hpctrain.run", str(run_dir)])
    port = free_port()
    procs: list[subprocess.Popen] = []
    files = []
    for r in range(nproc):
        out = None
        if r > 0:
            out = open(logs / f"rank-{r}.log", "ab")
            files.append(out)
        # A session of their own: a terminal's Ctrl-C reaches the launcher once, which passes it on.
        procs.append(subprocess.Popen(cmd, env=rank_env(r, nproc, port), stdout=out,
                                      stderr=subprocess.STDOUT if out else None, start_new_session=True))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    failed: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # One rank's death makes its peers fail too (a broken collective): give them a
                # moment, so that the report can name the rank that failed first, not an echo.
                _settle(procs, settle_s)
                failed = first_failure(procs)
                _stop(procs, grace_s)
                break
            time.sleep(0.1)
        failed = failed or first_failure(procs)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for f in files:
            f.close()
    if failed is None:
        return 0
    r, rc = failed
    how = f"exit code {rc}" if rc > 0 else f"was killed by {signal_name(rc)}"
    where = "above" if r == 0 else str(logs / f"rank-{r}.log")
    msg = f"hpctrain: rank {r} failed ({how}); the other ranks were stopped. Its log: {where}"
    if r > 0:
        msg += "\n--- last lines of rank %d ---\n%s" % (r, tail(logs / f"rank-{r}.log"))
    print(msg, file=sys.stderr)
    return rc if rc > 0 else 128 - rc


def first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """The rank to blame: one killed by a signal (the cause) before one that exited with an error
    (often only the echo of a peer's death), lowest rank first."""
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
    if not bad:
        return None
    return sorted(bad, key=lambda rb: (rb[1] > 0, rb[0]))[0]


def _settle(procs: list[subprocess.Popen], settle_s: float) -> None:
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    # SIGKILL, not SIGTERM: SIGTERM asks ranks for a collective save, which a dead peer would hang.
    for p in procs:
        if p.poll() is None:
            p.kill()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
