"""How the supervisor starts every rank of one attempt and learns how they ended: on this machine
(launcher=local), or as one srun step inside the job's allocation (launcher=slurm and sbatch), in
cluster.container_image through pyxis where one is set (hpctrain.launch.container)."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hpctrain.launch import container
from hpctrain.launch.failures import srun_failures
from hpctrain.launch.local import Ended, run_ranks, tail
from hpctrain.launch.sbatch import slurm_filename, source_root
from hpctrain.core.rundir import attempt_dir
from hpctrain.core.spec import ranks_per_node, world_size
from hpctrain.core.schema import Config

Poll = Callable[[], None]


class LocalRunner:
    """All ranks on this machine: one node, nothing to leave out."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.run_dir, self.nproc, self.fork = Path(run_dir), cfg.launcher.nproc, cfg.launcher.fork_ranks

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, attempt: int, nodes: list[str], env: dict, poll: Poll) -> Ended:
        return run_ranks(self.run_dir, self.nproc, env=env, poll=poll, fork=self.fork)

    def probe(self, nodes: list[str]) -> list[str]:
        return []

    def log_tail(self, rank: int, lines: int = 20) -> tuple[str, str]:
        path = self.run_dir / "logs" / f"rank-{rank}.log"
        if rank == 0:  # on the terminal already
            return f"above, and {path}", ""
        return str(path), tail(path, lines)


class SrunRunner:
    """One srun step per attempt on the chosen nodes of the allocation, one task per rank, each
    task's output in <run.dir>/logs/rank-N.log. With cluster.container_image the step runs the
    ranks in the image (pyxis's --container-* options; the checkout hpctrain runs from is mounted)."""

    def __init__(self, cfg: Config, run_dir: Path, env=os.environ):
        self.run_dir = Path(run_dir)
        self.job = env["SLURM_JOB_ID"]
        self.allocation = hostnames(env["SLURM_JOB_NODELIST"])
        self.tpn, self.cpus = ranks_per_node(cfg.cluster), cfg.cluster.cpus_per_task
        # The job's PYTHONPATH names the checkout this supervisor runs from (hpctrain.launch.sbatch.exports).
        self.container = container.srun_args(cfg.cluster, str(self.run_dir), source_root())
        self.python = container.python(cfg.cluster)
        # After the first rank's own report (an error, a hang): how long srun may take to end the step
        # before it is told to. Longer means srun waits for a node that is gone.
        self.grace_s = 10.0
        self._proc: Optional[subprocess.Popen] = None

    def nodes(self) -> list[str]:
        return list(self.allocation)

    def command(self, nodes: list[str], attempt: int = 0) -> list[str]:
        # After a failure the last step may still hold the nodes in Slurm's books (a step with a lost
        # node ends only when slurmctld declares the node down, SlurmdTimeout later): --overlap lets
        # the new step start on them meanwhile; the old step's processes there are gone.
        overlap = ["--overlap"] if attempt > 0 else []
        return ["srun", *overlap, f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * self.tpn}",
                f"--ntasks-per-node={self.tpn}", f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1",
                # srun of Slurm 22.05+ does not inherit --cpus-per-task from the allocation.
                f"--cpus-per-task={self.cpus}",
                # a filename pattern (%t: the task's rank), where a % of the run directory's own is doubled
                f"--output={slurm_filename(self.run_dir)}/logs/rank-%t.log", "--open-mode=append",
                *self.container, self.python, "-u", "-m", "hpctrain.run", str(self.run_dir)]

    def step_env(self, env: dict, attempt: int, base: Optional[dict] = None) -> dict:
        """The srun step's environment. In a container, MASTER_PORT as the ranks would work it out
        (hpctrain.distributed.bootstrap), kept by --container-env over the one enroot's PyTorch hook sets."""
        out = {**(os.environ if base is None else base), **env}
        if self.container:
            out.setdefault("MASTER_PORT", str(container.master_port(self.job, attempt)))
        return out

    def start(self, attempt: int, nodes: list[str], env: dict, poll: Poll) -> Ended:
        adir = attempt_dir(self.run_dir, attempt)
        adir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        err_path = adir / "srun.log"
        with open(err_path, "wb") as err:
            self._proc = subprocess.Popen(self.command(nodes, attempt), env=self.step_env(env, attempt),
                                          stdout=err, stderr=subprocess.STDOUT)
            first_report = None
            while self._proc.poll() is None:
                poll()
                if first_report is None and (any(adir.glob("hang-rank-*.json")) or any(adir.glob("error-rank-*.json"))):
                    first_report = time.monotonic()
                if first_report is not None and time.monotonic() - first_report > self.grace_s:
                    # A rank failed, yet the step lives on: srun waits for a node that will not answer.
                    self._cancel_step()
                time.sleep(0.5)
        rc = self._proc.returncode
        self._proc = None
        text = err_path.read_text(errors="replace")
        failed = srun_failures(text)
        first = next(iter(failed), None)
        return Ended(0 if rc == 0 else (rc if rc > 0 else 128 - rc), failed, first)

    def _cancel_step(self) -> None:
        p = self._proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGINT)  # srun: twice within a second cancels the step
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:  # it waits for a node that is gone: its ranks have ended
            p.kill()

    def forward(self, signum: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)

    def probe(self, nodes: list[str], timeout_s: float = 10.0) -> list[str]:
        """Nodes that do not run a trivial step within `timeout_s` (their slurmd or the node is gone)."""
        procs = {n: subprocess.Popen(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={n}", "--overlap",
                                      "--cpus-per-task=1", "true"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for n in nodes}
        deadline = time.monotonic() + timeout_s
        lost = []
        for n, p in procs.items():
            try:
                if p.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                    lost.append(n)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                lost.append(n)
        return lost

    def log_tail(self, rank: int, lines: int = 20) -> tuple[str, str]:
        path = self.run_dir / "logs" / f"rank-{rank}.log"
        return str(path), tail(path, lines)


def hostnames(nodelist: str) -> list[str]:
    """Slurm's own expansion of a hostlist (`n[1-3]` -> n1, n2, n3)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()


class AgentConn:
    """The supervisor's end of one node agent (hpctrain.launch.agent)."""

    def __init__(self, node: str, sock: socket.socket, replica: str, proc):
        self.node, self.sock, self.replica, self.proc = node, sock, replica, proc
        self.buf = b""
        self.beat = time.monotonic()
        self.states: dict[int, str] = {}
        self.lost = False

    def send(self, msg: dict) -> None:
        if self.lost:
            return
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self.lost = True


class AgentRunner:
    """checkpoint.memory_every > 0: one node agent per node of the allocation (spares too) for the
    supervisor's whole life, which forks ranks from its preloaded fork server; an attempt is a
    generation (hpctrain.distributed.generation). A start keeps the ranks that survived the last
    failure (alive, waiting for the next generation, on the node they were on, same world, not blamed)
    and has the agents fork only the others; every rank of the new generation restores the newest
    memory snapshot."""

    BEAT_TIMEOUT_S = 1.5  # three missed beats (hpctrain.launch.agent.BEAT_S): the node is lost
    HELLO_TIMEOUT_S = 120.0  # srun steps start, interpreters start (not torch: the fork server loads it behind)
    QUIET_S = 0.5  # after a failure: how long no new report or end means every rank able to say so has

    def __init__(self, cfg: Config, run_dir: Path, slurm: bool, env=os.environ):
        self.cfg, self.run_dir, self.slurm, self.env = cfg, Path(run_dir), slurm, env
        self.job = env.get("SLURM_JOB_ID") if slurm else None
        self.allocation = hostnames(env["SLURM_JOB_NODELIST"]) if slurm else [socket.gethostname()]
        self.agents: dict[str, AgentConn] = {}
        self.lost: set[str] = set()
        self.alive: dict[int, tuple[str, int]] = {}  # rank -> (node, pid)
        self.ended: dict[int, int] = {}  # rank -> return code, in the current generation
        self.plan: Optional[dict] = None
        self.blamed: set[int] = set()  # ranks the supervisor found at fault: never kept
        self._port: Optional[socket.socket] = None
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("0.0.0.0" if slurm else "127.0.0.1", 0))
        self.listener.listen(64)
        self.host = socket.gethostname() if slurm else "127.0.0.1"

    # ------------------------------------------------------------------ agents

    def _start_agents(self) -> None:
        from hpctrain.launch.sbatch import slurm_filename

        port = self.listener.getsockname()[1]
        procs = {}
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        cpus = ranks_per_node(self.cfg.cluster) * self.cfg.cluster.cpus_per_task
        for node in self.allocation:
            args = [sys.executable, "-u", "-m", "hpctrain.launch.agent", str(self.run_dir), "--node", node,
                    "--supervisor", f"{self.host}:{port}", "--memory-root", self.cfg.checkpoint.memory_dir]
            if self.slurm:
                cmd = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=0",
                       f"--cpus-per-task={cpus}", f"--output={slurm_filename(self.run_dir)}/logs/agent-{node}.log",
                       "--open-mode=append", *args, "--host", node]
                procs[node] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            else:
                env = {**os.environ, "HPCTRAIN_AGENT_TEE": "1",
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or
                       str(max(1, (os.cpu_count() or 1) // max(1, self.cfg.launcher.nproc))),
                       "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
                procs[node] = subprocess.Popen(args + ["--host", "127.0.0.1"], env=env, start_new_session=True)
        deadline = time.monotonic() + self.HELLO_TIMEOUT_S
        self.listener.settimeout(1.0)
        while len(self.agents) < len(procs) and time.monotonic() < deadline:
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                if all(p.poll() is not None for n, p in procs.items() if n not in self.agents):
                    break
                continue
            hello, rest = self._hello(sock)
            if hello is None or hello["hello"] not in procs or hello["hello"] in self.agents:
                sock.close()  # not one of our agents (a port scan, a stray client): ignored
                continue
            sock.setblocking(False)
            conn = AgentConn(hello["hello"], sock, hello["replica"], procs.get(hello["hello"]))
            conn.buf = rest
            self.agents[conn.node] = conn
        for node in procs:
            if node not in self.agents:
                self.lost.add(node)
                print(f"hpctrain: the agent on {node} did not start (see {logs}/agent-{node}.log): node left out",
                      file=sys.stderr, flush=True)

    @staticmethod
    def _hello(sock: socket.socket) -> tuple[Optional[dict], bytes]:
        """An agent's first line, {"hello": node, "replica": "host:port", ...}, read within 10 s and 64 KiB;
        (None, b"") for anything else."""
        sock.settimeout(10)
        buf = b""
        try:
            while b"\n" not in buf and len(buf) < 65536:
                chunk = sock.recv(65536)
                if not chunk:
                    return None, b""
                buf += chunk
            line, rest = buf.split(b"\n", 1)
            hello = json.loads(line)
        except (OSError, ValueError):
            return None, b""
        ok = isinstance(hello, dict) and isinstance(hello.get("hello"), str) and isinstance(hello.get("replica"), str)
        return (hello, rest) if ok else (None, b"")

    def nodes(self) -> list[str]:
        if not self.agents:
            self._start_agents()
        return [n for n in self.allocation if n not in self.lost]

    def _pump(self, timeout: float) -> bool:
        """Read what the agents said; True if anything happened."""
        conns = [c for c in self.agents.values() if not c.lost]
        ready, _, _ = select.select([c.sock for c in conns], [], [], timeout) if conns else ([], [], [])
        changed = False
        for c in conns:
            if c.sock in ready:
                try:
                    chunk = c.sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    chunk = None
                except OSError:
                    chunk = b""
                if chunk == b"":
                    self._lose(c)
                    changed = True
                    continue
                if chunk:
                    c.buf += chunk
                while b"\n" in c.buf:
                    line, c.buf = c.buf.split(b"\n", 1)
                    changed |= self._message(c, json.loads(line))
            if not c.lost and time.monotonic() - c.beat > self.BEAT_TIMEOUT_S and not self._answers(c):
                self._lose(c)
                changed = True
        return changed

    def _message(self, c: AgentConn, msg: dict) -> bool:
        if "beat" in msg:
            c.beat = time.monotonic()
            c.states = {int(r): s for r, s in msg["beat"].items()}
            return False
        if "pid" in msg:
            self.alive[int(msg["rank"])] = (c.node, int(msg["pid"]))
            return False
        if "ended" in msg:
            rank = int(msg["ended"])
            self.alive.pop(rank, None)
            self.ended[rank] = int(msg["rc"])
            return True
        return False

    CONFIRM_S = 10.0  # beats missing this long: lost even if its node still accepts connections

    def _answers(self, c: AgentConn) -> bool:
        """An agent whose beats are late but whose node still accepts a connection (its replica server's
        port) is busy, not lost: starved of CPU by its ranks, say. Up to CONFIRM_S."""
        if time.monotonic() - c.beat > self.CONFIRM_S:
            return False
        try:
            host, _, port = c.replica.rpartition(":")
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return True
        except (OSError, ValueError):
            return False

    def _lose(self, c: AgentConn) -> None:
        c.lost = True
        self.lost.add(c.node)
        try:
            c.sock.close()
        except OSError:
            pass
        for rank, (node, _) in list(self.alive.items()):
            if node == c.node:
                del self.alive[rank]
                self.ended[rank] = -signal.SIGKILL
        # Ranks this generation placed there that had not started yet (the node died during the start):
        # lost too, or the others would wait for them at the rendezvous until launcher.timeout_s.
        for r, node in ((self.plan or {}).get("rank_nodes") or {}).items():
            if node == c.node and int(r) not in self.ended:
                self.ended[int(r)] = -signal.SIGKILL

    # ------------------------------------------------------------------ a generation

    def _reported(self, generation: int) -> set[int]:
        adir = attempt_dir(self.run_dir, generation)
        out = set()
        for pattern in ("error-rank-*.json", "hang-rank-*.json"):
            for p in adir.glob(pattern):
                try:
                    out.add(int(p.stem.rsplit("-", 1)[1]))
                except ValueError:
                    pass
        return out

    def _waiting(self, generation: int) -> set[int]:
        """Ranks that dropped generation `generation` and wait in their process for the next one
        (hpctrain.distributed.generation.say_waiting)."""
        out = set()
        for p in attempt_dir(self.run_dir, generation).glob("waiting-rank-*"):
            try:
                out.add(int(p.name.rsplit("-", 1)[1]))
            except ValueError:
                pass
        return out

    def _master_port(self, generation: int) -> int:
        if self.slurm:
            return container.master_port(self.job or "0", generation)
        if self._port is not None:
            self._port.close()
        # Held bound (not listening) until the next generation: see hpctrain.launch.local.reserved_port.
        self._port = socket.socket()
        self._port.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._port.bind(("127.0.0.1", 0))
        return self._port.getsockname()[1]

    def start(self, attempt: int, nodes: list[str], env: dict, poll: Poll) -> Ended:
        from hpctrain.core.compose import load
        from hpctrain.core.generations import PLAN, rank_env

        cfg = self.cfg = load(self.run_dir / "config.yaml")
        tpn = cfg.launcher.nproc if not self.slurm else ranks_per_node(cfg.cluster)
        world = world_size(cfg)
        rank_nodes = {r: nodes[r // tpn] for r in range(world)}
        prev = self.plan
        self._pump(0.05)  # a rank that ended a moment ago is not kept
        waiting = self._waiting(prev["generation"]) if prev else set()
        keep = cfg.launcher.in_process and prev is not None and prev["world"] == world
        survivors = sorted(r for r, (node, _) in self.alive.items()
                           if keep and r in waiting and r not in self.blamed and node == rank_nodes.get(r)
                           and self.agents[node].states.get(r) != "stopped")
        self._kill([r for r in self.alive if r not in survivors])
        ring = [n for n in nodes if n in {rank_nodes[r] for r in rank_nodes}]
        for i, node in enumerate(ring):
            partner = ring[(i + 1) % len(ring)] if len(ring) > 1 else None
            self.agents[node].send({"partner": self.agents[partner].replica if partner else None})
        plan = {"generation": attempt, "world": world,
                "master_addr": rank_nodes[0] if self.slurm else "127.0.0.1",
                "master_port": self._master_port(attempt),
                "rank_nodes": {str(r): n for r, n in rank_nodes.items()},
                "agents": {n: self.agents[n].replica for n in ring}, "ring": ring,
                "lost": sorted(set((prev or {}).get("ring", [])) - set(ring)),
                "previous_rank_nodes": (prev or {}).get("rank_nodes"), "previous_ring": (prev or {}).get("ring"),
                "survivors": survivors}
        adir = attempt_dir(self.run_dir, attempt)
        adir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        tmp = adir / f".{PLAN}.tmp"
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, adir / PLAN)  # survivors poll for it: whole or absent
        self.plan, self.ended, self.blamed = plan, {}, set()
        for node in ring:  # lost between the supervisor's choice of nodes and now
            if self.agents[node].lost:
                self._lose(self.agents[node])
        if survivors:
            print(f"hpctrain: generation {attempt}: rank(s) {', '.join(map(str, survivors))} go on in their "
                  f"process; starting {world - len(survivors)} rank(s) from the node agents", file=sys.stderr,
                  flush=True)
        for r in range(world):
            if r in survivors:
                continue
            log = None if (not self.slurm and r == 0) else str(self.run_dir / "logs" / f"rank-{r}.log")
            self.agents[rank_nodes[r]].send({"start": r, "env": {**env, **rank_env(plan, r)}, "log": log})
        return self._watch(attempt, world, poll)

    def _watch(self, generation: int, world: int, poll: Poll) -> Ended:
        failed_at = None
        last_change = time.monotonic()
        hang_s = (self.cfg.launcher.hang_timeout_s or 60.0) + 3.0
        while True:
            if self._pump(0.1):
                last_change = time.monotonic()
            poll()
            bad = {r: rc for r, rc in self.ended.items() if rc != 0}
            reported = self._reported(generation)
            if failed_at is None and (bad or reported):
                failed_at, last_change = time.monotonic(), time.monotonic()
            if failed_at is None:
                if len(self.ended) == world:
                    return Ended(0, {}, None)
                continue
            # A failure: wait until every rank has ended, is waiting for the next generation, or is stopped.
            # Every rank able to say something has said it within QUIET_S of the last word; one that
            # stays silent longer is the stopped or stuck one (the supervisor blames it).
            waiting = self._waiting(generation)
            accounted = all(r in self.ended or r in waiting or self._stopped(r) for r in range(world))
            # A rank that reported and lives is tearing down to wait in its process: given until hang_s to
            # say so (slow under load), or it would be killed and forked afresh for nothing.
            tearing = any(r in reported and r in self.alive and r not in waiting for r in range(world))
            quiet = time.monotonic() - last_change
            if (accounted and quiet > self.QUIET_S) or (not tearing and quiet > 2 * self.QUIET_S) \
                    or time.monotonic() - failed_at > hang_s:
                if len(self.ended) == world and not bad:
                    return Ended(0, {}, None)
                return self._ended(bad)
            if (reported, waiting) != getattr(self, "_seen", None):
                self._seen = (reported, waiting)
                last_change = time.monotonic()

    def _stopped(self, rank: int) -> bool:
        node = (self.plan or {}).get("rank_nodes", {}).get(str(rank))
        return node in self.agents and self.agents[node].states.get(rank) == "stopped"

    def _ended(self, bad: dict) -> Ended:
        from hpctrain.launch.local import describe_exit

        how = dict(sorted(((r, describe_exit(rc)) for r, rc in bad.items()), key=lambda kv: ("killed" not in kv[1], kv[0])))
        first = next(iter(how), None)
        rc = bad[first] if first is not None else 1
        return Ended(rc if rc > 0 else 128 - rc, how, first)

    def _kill(self, ranks: list[int]) -> None:
        """SIGKILL, then wait (a little) for the agents to see them end."""
        for r in ranks:
            node, _ = self.alive[r]
            self.agents[node].send({"signal": r, "signum": int(signal.SIGKILL)})
        deadline = time.monotonic() + 10
        while any(r in self.alive for r in ranks) and time.monotonic() < deadline:
            self._pump(0.1)

    def blame(self, ranks: list[int]) -> None:
        self.blamed = set(ranks)

    def forward(self, signum: int) -> None:
        for r, (node, _) in list(self.alive.items()):
            self.agents[node].send({"signal": r, "signum": int(signum)})

    def probe(self, nodes: list[str]) -> list[str]:
        return [n for n in nodes if n in self.lost]

    def log_tail(self, rank: int, lines: int = 20) -> tuple[str, str]:
        path = self.run_dir / "logs" / f"rank-{rank}.log"
        return str(path), tail(path, lines)

    def close(self) -> None:
        """Every agent told to exit (its ranks killed, its snapshot directory removed), then waited for."""
        for c in self.agents.values():
            c.send({"exit": True})
        deadline = time.monotonic() + 15
        for c in self.agents.values():
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
        self.listener.close()
        if self._port is not None:
            self._port.close()
