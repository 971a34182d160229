"""The embedded default: start N ranks on this machine, watch them, stop them all if one fails.

Every rank writes to <run_dir>/logs/rank-N.log; rank 0 also to this terminal (the launcher copies its
output to both). SIGINT, SIGTERM and SIGUSR2 sent to the launcher are passed on to every rank (each asks
for a collective save at the next step boundary); a second SIGINT (Ctrl-C) stops the ranks at once,
without saving.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

from hpctrain.launch.forkserver import ForkedRank, ForkServer, forkable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
# Set for rank 0 when the launcher's stdout is a terminal: its output reaches it through a pipe (Tee), and
# the progress line may still update in place (hpctrain.train.metrics).
LIVE_ENV = "HPCTRAIN_LIVE_PROGRESS"
CLEAR_LINE = b"\r\x1b[K"  # what the updating progress line writes before each update


class Tee:
    """Rank 0's stdout and stderr, each copied as it comes to the launcher's own (the terminal) and into
    one file, <run_dir>/logs/rank-0.log, where an update of the terminal's progress line is a line of
    its own. Threads copy, so a rank killed by a signal still leaves every byte it wrote (a fatal
    signal's stack too)."""

    def __init__(self, path: Path):
        self.file = open(path, "ab")
        self.lock = threading.Lock()
        self.at_line_start, self.last = True, None  # the file's last byte ends a line; who wrote it
        self.threads: list[threading.Thread] = []

    def pipe(self, terminal_fd: int) -> int:
        """A pipe whose reading end is copied to `terminal_fd` and the file; returns its writing end,
        for the rank (the caller closes its own copy once the rank has it)."""
        r, w = os.pipe()
        t = threading.Thread(target=self._copy, args=(r, terminal_fd), daemon=True,
                             name=f"hpctrain-rank-0-fd{terminal_fd}")
        t.start()
        self.threads.append(t)
        return w

    def _copy(self, r: int, fd: int) -> None:
        terminal = True
        try:
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    return
                if terminal:
                    terminal = _write_all(fd, chunk)  # a closed terminal: the file goes on
                with self.lock:
                    self._log(chunk, fd)
        finally:
            os.close(r)

    def _log(self, data: bytes, source: int) -> None:
        if self.file.closed:
            return
        out = bytearray()
        if source != self.last and not self.at_line_start:
            out += b"\n"  # the other stream's text starts a line of its own
        for i, part in enumerate(data.split(CLEAR_LINE)):
            if i and not (out.endswith(b"\n") if out else self.at_line_start):
                out += b"\n"
            out += part
        if out:
            self.file.write(out)
            self.file.flush()
            self.at_line_start = out.endswith(b"\n")
        self.last = source

    def close(self, timeout_s: float = 5.0) -> None:
        """Once the rank (and the fork server) ended: the pipes' last bytes, then the file."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:  # a process rank 0 started may hold a pipe open longer: not waited for
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            self.file.close()


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data):]
        return True
    except OSError:
        return False


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
    stopped_now: bool = False  # a second SIGINT (Ctrl-C) stopped the ranks at once, without their save


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
    if os.isatty(1):
        envs[0][LIVE_ENV] = "1"
    tee = Tee(logs / "rank-0.log")
    out0, err0 = tee.pipe(1), tee.pipe(2)  # rank 0's (and the fork server's) stdout and stderr
    procs: list[Rank] = []
    files = []
    server = None
    interrupted: list[int] = []
    stopped_now: list[bool] = []
    starting, missed = [True], []  # signals that came while the ranks were being started

    def stop_now() -> None:
        # A second Ctrl-C: the person does not want to wait for the save. Said once, however often it is
        # pressed; the supervisor records the stop.
        alive = [r for r, p in enumerate(procs) if running(p)]
        if stopped_now or not (alive or starting):
            return
        stopped_now.append(True)
        print(f"hpctrain: second Ctrl-C (SIGINT): stopping rank(s) {', '.join(map(str, alive)) or 'being started'} "
              "now, without saving", file=sys.stderr, flush=True)
        for r in alive:
            procs[r].kill()

    def pass_on(signum: int) -> None:
        alive = [r for r, p in enumerate(procs) if running(p)]
        if not alive:
            return
        # Whoever sends a signal says so: a rank's log shows only that it died of it.
        print(f"hpctrain: passing {signal.Signals(signum).name} (sent to the launcher, pid {os.getpid()}) on to "
              f"rank(s) {', '.join(map(str, alive))}", file=sys.stderr, flush=True)
        for r in alive:
            procs[r].send_signal(signum)

    def forward(signum, _frame):
        if signum == signal.SIGINT and signal.SIGINT in interrupted:
            return stop_now()
        if signum in (signal.SIGINT, signal.SIGTERM):
            interrupted.append(signum)
        if starting:
            missed.append(signum)
        else:
            pass_on(signum)

    # Until every rank, the server and rank 0's output have ended: a signal in between is still one
    # for the ranks (a KeyboardInterrupt there would leave them running, and nothing recorded).
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    failed: tuple[int, int] | None = None
    how: dict = {}  # ranks that ended by themselves with an error (not those stopped here)
    try:
        try:
            # One rank has nothing to share the server's imports with.
            server = ForkServer(envs[0], cmd, stdout=out0, stderr=err0) if fork and nproc > 1 and forkable(cmd) \
                else None
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
                procs.append(subprocess.Popen(cmd, env=envs[r], stdout=out or out0,
                                              stderr=subprocess.STDOUT if out else err0, start_new_session=True))
        finally:
            os.close(out0)  # the rank (or the server) has its own copy: EOF when it ends
            os.close(err0)
        starting.clear()
        if stopped_now:  # a second Ctrl-C while they were being started
            for p in procs:
                p.kill()
        for signum in dict.fromkeys(missed):
            pass_on(signum)
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) and not stopped_now:
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
        for f in files:
            f.close()
        if server is not None:
            server.close()
        tee.close()
        for s, h in previous.items():
            signal.signal(s, h)
    first_signal = interrupted[0] if interrupted else 0
    if failed is None:
        return Ended(0, how, None, first_signal, bool(stopped_now))
    r, rc = failed
    return Ended(rc if rc > 0 else 128 - rc, how, r, first_signal, bool(stopped_now))


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
    where = f"above, and {logs / 'rank-0.log'}" if r == 0 else str(logs / f"rank-{r}.log")
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
