"""`python -m hpctrain.launch.agent <run_dir> --node NAME --supervisor HOST:PORT`: the node agent of a run
with memory snapshots (checkpoint.memory_every > 0). One per node, spares included, for the supervisor's
whole life: on Slurm one srun step of its own per node (so that a lost node ends only its own step), on
this machine one subprocess (launcher=local).

What it does, torch-free:
- keeps a fork server (hpctrain.launch.forkserver) with torch imported, and forks ranks from it when the
  supervisor says `start`: a rank lost to a crash comes back in well under a second, with no interpreter
  start and no torch import (the survivors never stopped: hpctrain.distributed.generation);
- tells the supervisor, every BEAT_S, how its ranks are (running, stopped by SIGSTOP, ended with a code):
  a node whose beats stop is lost, faster and surer than asking Slurm (slurmctld learns it only after
  SlurmdTimeout);
- owns the node's snapshot directory (<checkpoint.memory_dir>/hpctrain-<job>-<run id>-<node>/), on a tmpfs: the
  ranks write their snapshots into own/, the pusher (hpctrain.core.replica) copies each to the partner
  node's agent, which keeps them in peer/, and serves both to ranks restoring on other nodes. The
  directory goes when the agent ends, as the node's RAM would.

Protocol with the supervisor: JSON lines over one TCP connection. Agent -> supervisor: {"hello": node,
"replica": "host:port", "pid"}, {"beat": {rank: "running"|"stopped"}}, {"pid": p, "rank": r},
{"ended": r, "rc": rc}. Supervisor -> agent: {"start": r, "env": {...}, "log": path | null},
{"signal": r, "signum": n}, {"partner": "host:port" | null}, {"exit": true}. A closed connection (the
supervisor is gone) ends the agent and its ranks.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

BEAT_S = 0.5
SUBDIRS = ("own", "peer", "fetched")


def run_id(run_dir: str | os.PathLike) -> str:
    """Eight hex digits naming a run on a node (two runs of one job, or two jobs, never share files)."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]


def memory_dir(root: str, run_dir: str | os.PathLike, job: Optional[str], node: str) -> Path:
    """The node's directory for the run: the job, the run and the node in its name, so that two runs, two
    jobs of one run, or two nodes (a memory_dir wrongly on a shared file system) never share one."""
    return Path(root) / f"hpctrain-{job or 'local'}-{run_id(run_dir)}-{node}"


def rank_state(pid: int) -> str:
    """running | stopped (SIGSTOP, or a debugger), from /proc/<pid>/stat's state letter."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return "running"  # ended: the fork server's `ended` says so
    state = text[text.rfind(")") + 2:][:1]
    return "stopped" if state in ("T", "t") else "running"


class Agent:
    def __init__(self, run_dir: Path, node: str, supervisor: str, host: str, memory_root: str, job: Optional[str]):
        self.run_dir, self.node, self.host = run_dir, node, host
        self.root = memory_root
        self.dir = memory_dir(memory_root, run_dir, job, node)
        addr, _, port = supervisor.rpartition(":")
        self.sock = socket.create_connection((addr, int(port)), timeout=30)
        self.sock.settimeout(None)
        self.inbuf = b""
        self.partner: Optional[str] = None
        self.server = self.replicas = self.pusher = None
        self.tee = None

    # ------------------------------------------------------------------ setup

    def prepare(self) -> None:
        from hpctrain.core import replica  # torch-free

        problem = replica.memory_root_problem(self.root)
        if problem:
            raise SystemExit(f"hpctrain agent: error: {problem}")
        for sub in SUBDIRS:
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        from hpctrain.core import replica  # torch-free

        # Listening on this node's address only (the loopback for a run on one machine).
        try:
            bind = socket.gethostbyname(self.host)
        except OSError:
            bind = "0.0.0.0"
        self.replicas = replica.ReplicaServer(self.dir, bind=bind)
        port = self.replicas.start()
        self.pusher = replica.Pusher(self.dir, lambda: self.partner)
        self.pusher.start()
        from hpctrain.launch.forkserver import ForkServer

        cmd = [sys.executable, "-m", "hpctrain.run", str(self.run_dir)]
        env = {**os.environ, "HPCTRAIN_MEMORY_DIR": str(self.dir), "HPCTRAIN_NODE": self.node}
        out = err = None
        if os.environ.get("HPCTRAIN_AGENT_TEE"):  # launcher=local: rank 0 on the terminal and in its log
            from hpctrain.launch.local import Tee

            (self.run_dir / "logs").mkdir(exist_ok=True)
            self.tee = Tee(self.run_dir / "logs" / "rank-0.log")
            out, err = self.tee.pipe(1), self.tee.pipe(2)
        self.fork = ForkServer(env, cmd, stdout=out, stderr=err)
        if out is not None:
            os.close(out)
            os.close(err)
        self.cmd = cmd
        self.say({"hello": self.node, "replica": f"{self.host}:{port}", "pid": os.getpid()})

    # ------------------------------------------------------------------ the loop

    def say(self, msg: dict) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def run(self) -> int:
        last_beat = 0.0
        reported: dict[int, int] = {}  # rank -> pid told to the supervisor
        while True:
            fds = [self.sock] + ([self.fork.fd] if self.fork.fd >= 0 else [])
            ready, _, _ = select.select(fds, [], [], 0.1)
            if self.sock in ready:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return 0  # the supervisor is gone (or done): nothing left to train for
                self.inbuf += chunk
                while b"\n" in self.inbuf:
                    line, self.inbuf = self.inbuf.split(b"\n", 1)
                    if self.command(json.loads(line)):
                        return 0
            self.fork.pump()
            for rank, pid in list(self.fork.pids.items()):
                if reported.get(rank) != pid and rank not in self.fork.rcs:
                    reported[rank] = pid
                    self.say({"pid": pid, "rank": rank})
            for rank, rc in list(self.fork.rcs.items()):
                self.say({"ended": rank, "rc": rc})
                del self.fork.rcs[rank]
                self.fork.pids.pop(rank, None)
                reported.pop(rank, None)
            if time.monotonic() - last_beat >= BEAT_S:
                last_beat = time.monotonic()
                self.say({"beat": {str(r): rank_state(p) for r, p in self.fork.pids.items()}})

    def command(self, msg: dict) -> bool:
        """Carry out one supervisor message; True: exit."""
        if "start" in msg:
            rank = int(msg["start"])
            self.fork.rcs.pop(rank, None)
            self.fork.start(rank, self.cmd, {**os.environ, "HPCTRAIN_MEMORY_DIR": str(self.dir),
                                             "HPCTRAIN_NODE": self.node, **msg["env"]},
                            None if msg.get("log") is None else Path(msg["log"]))
        elif "signal" in msg:
            self.fork.send({"signal": int(msg["signal"]), "signum": int(msg["signum"])})
        elif "partner" in msg:
            self.partner = msg["partner"]
        elif msg.get("exit"):
            return True
        return False

    def close(self) -> None:
        """Every rank of this node killed, the fork server and the replica threads stopped, the
        snapshot directory removed (only ours: the name holds the job and the run)."""
        fork = getattr(self, "fork", None)
        if fork is not None:
            for rank in list(fork.pids):
                fork.send({"signal": rank, "signum": signal.SIGKILL})
            deadline = time.monotonic() + 10
            while fork.pids and time.monotonic() < deadline and fork.fd >= 0:
                fork.pump(0.1)
                for rank in list(fork.rcs):
                    fork.pids.pop(rank, None)
                    fork.rcs.pop(rank, None)
            fork.close()
        # The snapshots go first, before threads that may take long to stop (a push to a dead partner):
        # a job killed meanwhile must not leave the node's memory full.
        if self.dir.is_dir() and self.dir.name.startswith("hpctrain-"):
            shutil.rmtree(self.dir, ignore_errors=True)
        for part in (self.pusher, self.replicas):
            if part is not None:
                part.stop()
        if self.tee is not None:
            self.tee.close()
        try:
            self.sock.close()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpctrain.launch.agent",
                                description="hpctrain's node agent (started by the supervisor; not by hand)")
    p.add_argument("run_dir")
    p.add_argument("--node", required=True)
    p.add_argument("--supervisor", required=True, help="host:port of the supervisor")
    p.add_argument("--host", default=None, help="the address peers reach this node's replica server at")
    p.add_argument("--memory-root", default="/dev/shm")
    a = p.parse_args(argv)
    # The supervisor ends us with `exit` or by closing the connection; a signal (scancel) likewise.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    agent = Agent(Path(a.run_dir).resolve(), a.node, a.supervisor, a.host or a.node, a.memory_root,
                  os.environ.get("SLURM_JOB_ID"))
    try:
        agent.prepare()
        return agent.run()
    finally:
        agent.close()


if __name__ == "__main__":
    sys.exit(main())
