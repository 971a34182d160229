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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

from hpctrain.launch.forkserver import ForkedRank, ForkServer, forkable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


@contextmanager
def reserved_port() -> Iterator[int]:
    """A rendezvous port that stays this job's until the block ends.

    A port found free and then let go can be handed to anyone before rank 0 binds it: Linux gives it to
    a later bind to port 0 (here a few times in 40,000 binds). If another launch's probe gets it, both
    jobs get one port: one job's rank 0 cannot listen, and its other ranks join the other job's
    rendezvous, whose collectives then cross (gloo aborts on a size mismatch, ranks hang). If a gloo
    listener of another job gets it, this job cannot start. So the launcher keeps the port bound,
    without listening, while its ranks run: Linux never hands a bound port to a bind to port 0, nor to an
    outgoing connection, and rank 0's TCPStore, which binds with SO_REUSEADDR as this socket does, may
    still listen on it
    (socket(7), SO_REUSEADDR; docs/failures.md, "Two jobs on one rendezvous port")."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HPCTRAIN_LAUNCHER="local",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")  # a stack in the log of a rank killed by a fatal signal
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


Rank = Union[subprocess.Popen, ForkedRank]


def running(p: Rank) -> bool:
    """For a signal handler: a forked rank's state as last read (reading the server's pipe here could
    interleave with the main loop's read)."""
    return (p.returncode if isinstance(p, ForkedRank) else p.poll()) is None


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


@dataclass
class Ended:
    """How a set of local ranks ended."""
    rc: int  # 0, or the first failed rank's exit code (128 + signal for a signal)
    failed: dict = field(default_factory=dict)  # rank -> "exit code N" | "killed by SIGNAME"
    first: Optional[int] = None  # the rank to blame
    interrupted: int = 0  # the first SIGINT/SIGTERM the launcher itself got (a person, scancel), or 0


def run_ranks(run_dir: str | os.PathLike, nproc: int, cmd: Sequence[str] | None = None,
              env: Optional[dict] = None, grace_s: float = 10.0, settle_s: float = 5.0,
              poll: Optional[Callable[[], None]] = None, fork: bool = True) -> Ended:
    """Run `cmd` (default: the hpctrain rank entry) as nproc ranks with `env` added to theirs; when one
    fails, give the others `settle_s` to fail by themselves (and write what they know), then stop them.
    `poll` is called about every 0.1 s while they run. `fork`: start them through a fork server
    (hpctrain.launch.forkserver) where `cmd` allows."""
    with reserved_port() as port:
        return _run_ranks(Path(run_dir), nproc, cmd, env, grace_s, settle_s, poll, fork, port)


def _run_ranks(run_dir: Path, nproc: int, cmd: Sequence[str] | None, env: Optional[dict], grace_s: float,
               settle_s: float, poll: Optional[Callable[[], None]], fork: bool, port: int) -> Ended:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = list(cmd or [sys.executable, "-m", "hpctrain.run", str(run_dir)])
    envs = [{**rank_env(r, nproc, port), **(env or {})} for r in range(nproc)]
    # One rank has nothing to share the server's imports with.
    server = ForkServer(envs[0], cmd) if fork and nproc > 1 and forkable(cmd) else None
    procs: list[Rank] = []
    files = []
    for r in range(nproc):
        log = logs / f"rank-{r}.log" if r > 0 else None
        if server is not None:
            procs.append(server.start(r, cmd, envs[r], log))
            continue
        out = None
        if log is not None:
            out = open(log, "ab")
            files.append(out)
        # A session of their own: a terminal's Ctrl-C reaches the launcher once, which passes it on.
        procs.append(subprocess.Popen(cmd, env=envs[r], stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=True))
    interrupted = []

    def forward(signum, _frame):
        if signum in (signal.SIGINT, signal.SIGTERM):
            interrupted.append(signum)
        alive = [r for r, p in enumerate(procs) if running(p)]
        # Whoever sends a signal says so: a rank's log shows only that it died of it.
        print(f"hpctrain: passing {signal.Signals(signum).name} (sent to the launcher, pid {os.getpid()}) on to "
              f"rank(s) {', '.join(map(str, alive))}", file=sys.stderr, flush=True)
        for r in alive:
            procs[r].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    failed: tuple[int, int] | None = None
    how: dict = {}  # ranks that ended by themselves with an error (not those stopped here)
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # One rank's death makes its peers fail too (a broken collective): give them a
                # moment, so that the report can name the rank that failed first, not an echo.
                _settle(procs, settle_s)
                failed = first_failure(procs)
                how = _ended_badly(procs)
                _stop(procs, grace_s)
                break
            if poll is not None:
                poll()
            time.sleep(0.1)
        failed = failed or first_failure(procs)
        how = how or _ended_badly(procs)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for f in files:
            f.close()
        if server is not None:
            server.close()
    if failed is None:
        return Ended(0, how, None, interrupted[0] if interrupted else 0)
    r, rc = failed
    return Ended(rc if rc > 0 else 128 - rc, how, r, interrupted[0] if interrupted else 0)


def _ended_badly(procs: list[Rank]) -> dict:
    bad = sorted(((r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)),
                 key=lambda rb: (rb[1] > 0, rb[0]))  # signals first: the cause before its echoes
    return {r: describe_exit(rc) for r, rc in bad}


def describe_exit(rc: int) -> str:
    return f"exit code {rc}" if rc > 0 else f"was killed by {signal_name(rc)}"


def launch(run_dir: str | os.PathLike, nproc: int, cmd: Sequence[str] | None = None,
           grace_s: float = 10.0, settle_s: float = 2.0, fork: bool = True) -> int:
    """Run `cmd` (default: the hpctrain rank entry) as nproc ranks once; returns the job's exit code
    and says which rank failed first, with the tail of its log."""
    ended = run_ranks(run_dir, nproc, cmd, grace_s=grace_s, settle_s=settle_s, fork=fork)
    if ended.rc == 0:
        return 0
    r = ended.first
    logs = Path(run_dir) / "logs"
    where = "above" if r == 0 else str(logs / f"rank-{r}.log")
    msg = f"hpctrain: rank {r} failed ({ended.failed[r]}); the other ranks were stopped. Its log: {where}"
    if r > 0:
        msg += "\n--- last lines of rank %d ---\n%s" % (r, tail(logs / f"rank-{r}.log"))
    print(msg, file=sys.stderr)
    return ended.rc


def first_failure(procs: list[Rank]) -> tuple[int, int] | None:
    """The rank to blame: one killed by a signal (the cause) before one that exited with an error
    (often only the echo of a peer's death), lowest rank first."""
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
    if not bad:
        return None
    return sorted(bad, key=lambda rb: (rb[1] > 0, rb[0]))[0]


def _settle(procs: list[Rank], settle_s: float) -> None:
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop(procs: list[Rank], grace_s: float) -> None:
    # SIGKILL, not SIGTERM: SIGTERM asks ranks for a collective save, which a dead peer would hang.
    alive = [(r, p) for r, p in enumerate(procs) if p.poll() is None]
    if alive:
        print("hpctrain: a rank failed: stopping the others with SIGKILL: "
              + ", ".join(f"rank {r} (pid {p.pid})" for r, p in alive), file=sys.stderr, flush=True)
    for _, p in alive:
        p.kill()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
