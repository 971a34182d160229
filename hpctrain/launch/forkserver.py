"""The local launcher's ranks as forks of one process that has imported torch once: the server (run as
`python -m hpctrain.launch.forkserver`) and the launcher's end of it (ForkServer, ForkedRank).

Importing torch, DTensor and distributed checkpointing costs every fresh interpreter about 5 CPU-seconds;
N ranks started by the local launcher pay it N times, on the machine they then train on. Here one
server process imports them (`PRELOAD`) and forks each rank, the way Python's multiprocessing
forkserver and torch.multiprocessing's "forkserver" start method do: a child starts with the modules in
memory. (Not multiprocessing's own forkserver: it lives as long as the launcher's process and keeps
the stdout it started with, and its children run a function, not `python -m module`.) Nothing has run a tensor operation, created a process group or touched a GPU before the fork
(CUDA is initialised lazily, by the rank), so a child is in the state a fresh interpreter would reach.

Each child gets its own session, the rank's whole environment, its log on stdout and stderr (or the
launcher's terminal for rank 0), and runs `python -m module args` or `python script args` as
`__main__`. The server is the ranks' parent: it reaps them and is the one that signals them, so a
signal never reaches a pid that has been reused.

Protocol, JSON lines: the launcher writes {"start": rank, "argv": [...], "env": {...}, "log": path or
null} and {"signal": rank, "signum": n} to the server's stdin; the server writes {"pid": p, "rank": r}
and {"ended": r, "rc": returncode as subprocess gives it} to the pipe whose fd it is given. Where a
command is not `python -m module` or `python script.py` (hpctrain.launch.local.forkable), the launcher
starts it as a process of its own instead.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

# What every rank of hpctrain imports anyway (hpctrain.run, the benchmarks and the tests' workers;
# torch._dynamo on its first step, through FSDP2 and torch._refs); HPCTRAIN_FORK_PRELOAD
# (comma-separated modules) replaces it.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor.parallel", "torch._dynamo", "hpctrain.train.loop", "hpctrain.checkpoint.manager")
# Keys that differ between ranks: the server itself runs without them.
PER_RANK = ("RANK", "LOCAL_RANK")


def _write(out: int, msg: dict) -> None:
    os.write(out, (json.dumps(msg) + "\n").encode())


def _run_child(argv: list[str], env: dict, log: str | None) -> None:
    """In the forked child: become the rank, as `python argv[1:]` would, down to how it ends (an
    exception or SystemExit leaves this frame and the server's, and the interpreter exits as usual)."""
    try:
        os.setsid()  # a session of its own, as the launcher gives a rank it starts itself
        for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
        runpy.run_path(argv[1], run_name="__main__")
    raise SystemExit(0)


def serve(out: int) -> None:
    # The launcher passes its signals to the ranks through us; a Ctrl-C meant for it is not ours.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    preload = os.environ.get("HPCTRAIN_FORK_PRELOAD")
    for name in PRELOAD if preload is None else [m for m in preload.split(",") if m]:
        try:
            importlib.import_module(name)
        except Exception as e:  # the rank that needs it will fail with the whole story
            print(f"hpctrain forkserver: could not preload {name}: {e}", file=sys.stderr, flush=True)
    # What is loaded stays out of the children's garbage collections, which would otherwise write to
    # (and so copy) every page of it.
    gc.freeze()
    pids: dict[int, int] = {}  # pid -> rank, until reaped
    pending = b""
    open_in = True
    while open_in or pids:
        if open_in:
            ready, _, _ = select.select([0], [], [], 0.05)
            if ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    open_in = False
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    msg = json.loads(line)
                    if "start" in msg:
                        pid = os.fork()
                        if pid == 0:
                            os.close(out)
                            _run_child(msg["argv"], msg["env"], msg.get("log"))
                        pids[pid] = msg["start"]
                        _write(out, {"pid": pid, "rank": msg["start"]})
                    elif "signal" in msg:
                        for pid, rank in pids.items():
                            if rank == msg["signal"]:
                                os.kill(pid, msg["signum"])  # not yet reaped: still ours
        else:
            select.select([], [], [], 0.05)
        while pids:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in pids:
                _write(out, {"ended": pids.pop(pid), "rc": os.waitstatus_to_exitcode(status)})


# --- the launcher's end (hpctrain.launch.local) ------------------------------------------------

def forkable(cmd: Sequence[str]) -> bool:
    """Whether hpctrain.launch.forkserver can start `cmd`: `python -m module ...` or `python script.py
    ...` with this interpreter, on Linux (a fork after importing torch is what its DataLoader does
    there; macOS's frameworks are not fork-safe)."""
    return sys.platform.startswith("linux") and len(cmd) >= 2 and cmd[0] == sys.executable and \
        ((cmd[1] == "-m" and len(cmd) >= 3) or cmd[1].endswith(".py"))


class ForkServer:
    """The launcher's end of hpctrain.launch.forkserver: one server per launch, parent of its ranks."""

    def __init__(self, env: dict, cmd: Sequence[str], stdout: Optional[int] = None, stderr: Optional[int] = None):
        """`stdout`, `stderr`: file descriptors for the server's output and that of the ranks started
        without a log (rank 0: the launcher copies it to the terminal and to logs/rank-0.log); None: the
        launcher's own."""
        r, w = os.pipe()
        # A session of its own: a terminal's Ctrl-C reaches the launcher, which passes it on. The rank
        # command is on its command line for `ps` to show (its forks carry the same; ranks.json
        # names their pids).
        self.proc = subprocess.Popen([sys.executable, "-m", "hpctrain.launch.forkserver", str(w), "--", *cmd],
                                     stdin=subprocess.PIPE, pass_fds=(w,), start_new_session=True,
                                     stdout=stdout, stderr=stderr,
                                     env={k: v for k, v in env.items() if k not in PER_RANK})
        os.close(w)
        self.fd, self.buf = r, b""
        self.pids: dict[int, int] = {}
        self.rcs: dict[int, int] = {}
        self.ranks: set[int] = set()

    def send(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        try:
            while data:  # one write for a signal (under PIPE_BUF: whole), a loop for a rank's start
                data = data[os.write(self.proc.stdin.fileno(), data):]
        except BrokenPipeError:
            pass  # the server is gone: pump() reports its ranks

    def start(self, rank: int, argv: Sequence[str], env: dict, log: Optional[Path]) -> "ForkedRank":
        self.ranks.add(rank)
        self.send({"start": rank, "argv": list(argv), "env": env, "log": None if log is None else str(log)})
        return ForkedRank(self, rank, list(argv))

    def pump(self, timeout: float = 0.0) -> None:
        """Read what the server has said, waiting at most `timeout` for the first word."""
        if self.fd < 0 or not select.select([self.fd], [], [], timeout)[0]:
            return
        chunk = os.read(self.fd, 65536)
        if not chunk:  # the server died (killed?): its ranks live on as orphans; stop them
            os.close(self.fd)
            self.fd = -1
            for rank in self.ranks - set(self.rcs):
                if rank in self.pids:
                    try:
                        os.kill(self.pids[rank], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.rcs[rank] = -signal.SIGKILL
            return
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "pid" in msg:
                self.pids[msg["rank"]] = msg["pid"]
            else:
                self.rcs[msg["ended"]] = msg["rc"]

    def close(self, timeout_s: float = 10.0) -> None:
        """After every rank ended: the server reaps the last and exits."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ForkedRank:
    """A rank the fork server started, with what the launcher uses of subprocess.Popen."""

    def __init__(self, server: ForkServer, rank: int, args: list[str]):
        self.server, self.rank, self.args = server, rank, args

    @property
    def pid(self) -> Optional[int]:
        return self.server.pids.get(self.rank)

    @property
    def returncode(self) -> Optional[int]:
        return self.server.rcs.get(self.rank)

    def poll(self) -> Optional[int]:
        self.server.pump()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # no pump(): this runs in the launcher's signal handler too
            self.server.send({"signal": self.rank, "signum": int(signum)})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.pump(min(0.1, left))
        return self.returncode



def main() -> None:
    serve(int(sys.argv[1]))


if __name__ == "__main__":
    main()
