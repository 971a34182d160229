"""How the supervisor starts every rank of one attempt and learns how they ended: on this machine
(launcher=local), or as one srun step inside the job's allocation (launcher=slurm and sbatch), in
cluster.container_image through pyxis where one is set (hpctrain.launch.container)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from hpctrain.launch import container
from hpctrain.launch.failures import srun_failures
from hpctrain.launch.local import Ended, run_ranks, tail
from hpctrain.launch.sbatch import slurm_filename, source_root
from hpctrain.core.rundir import attempt_dir
from hpctrain.core.spec import ranks_per_node
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
