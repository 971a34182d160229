"""The local launcher's ranks as forks of one process that has imported torch once.

Importing torch, DTensor and distributed checkpointing costs every fresh interpreter about 5 CPU-seconds;
N ranks started by the local launcher pay it N times, on the machine they then train on. Here one
server process imports them (`PRELOAD`) and forks each rank, the way Python's multiprocessing
forkserver and torch.multiprocessing's "forkserver" start method do: a child starts with the modules in
memory. Nothing has run a tensor operation, created a process group or touched a GPU before the fork
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
import sys

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


def main() -> None:
    serve(int(sys.argv[1]))


if __name__ == "__main__":
    main()
