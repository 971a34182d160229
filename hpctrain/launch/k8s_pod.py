"""What each pod of launcher=k8s runs (`python -m hpctrain.launch.k8s_pod --run-dir DIR -- TORCHRUN...`,
written into the Job by hpctrain.launch.k8s): torchrun around the ranks, pod 0 hosting the rendezvous,
a store of its own for every start, signals forwarded, and the run's outcome as the pod's exit status
(EXIT_REQUEUE after a collective save, so that the Job replaces the pods without counting a failure).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hpctrain.core.compose import ConfigError
from hpctrain.core.rundir import RunLock, clear_outcome, read_outcome, write_atomic


# pod_main's exit status when every rank saved after a signal and stopped (the pod, or a peer, was
# asked to stop): the Job replaces the pods without counting a failure (podFailurePolicy Ignore).
# 75 and 76 are the watchdog's and the health check's.
EXIT_REQUEUE = 77
# Once the run's outcome is written, torchrun gets this long to end before pod_main stops it.
EXIT_GRACE_S = 30.0
# A replaced pod 0 may start while the one it replaces is still terminating (30 s of grace by default),
# or, its node lost, while the claim's server still counts that pod's lock (an NFSv4 lease: 90 s).
REPLACED_WAIT_S = 180.0



def with_host(command: list[str], is_host: bool) -> list[str]:
    """The torchrun command with `is_host` added to its --rdzv-conf: pod 0 hosts the rendezvous."""
    out, done = [], False
    for arg in command:
        if not done and arg.startswith("--rdzv-conf="):
            arg = f"{arg},is_host={'true' if is_host else 'false'}"
            done = True
        out.append(arg)
    if not done:
        raise ValueError("the torchrun command has no --rdzv-conf= to add is_host to")
    return out


def torchrun_env(env: Any) -> dict[str, str]:
    """torchrun's environment. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: otherwise the ranks' process
    group lives in the rendezvous's own store, kept from one start to the next, where a rank that
    starts again reads the addresses its peers had at the last start (torch 2.13: the restarted run
    fails to connect, or waits forever); with it, every start has a store of its own on rank 0."""
    out = dict(env)
    out.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return out


def pod_exit(rc: int, outcome: Optional[dict], signalled: bool) -> int:
    """The pod's exit status from torchrun's and the run's outcome (<run_dir>/outcome.json, written
    by rank 0 once every rank is done). After a signal (to this pod, or pod_main's own once the
    outcome was final), the outcome decides: EXIT_REQUEUE when the ranks saved and stopped, so that
    the Job starts the pods again without counting a failure; 0 when the run completed."""
    status = (outcome or {}).get("status")
    if status == "preempted" and (rc == 0 or signalled):
        return EXIT_REQUEUE
    if status == "completed" and (rc == 0 or signalled):
        return 0
    if rc < 0:  # killed by a signal
        return 128 - rc
    return rc


class OutcomeWatch:
    """The run's outcome.json as this pod has seen it change: one left from an earlier start (another
    Job, before pod 0 clears it) is not this run's."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "outcome.json"
        self.initial = self._stamp()

    def _stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def final(self) -> Optional[dict]:
        """This run's outcome, once written; None before."""
        stamp = self._stamp()
        if stamp is None or stamp == self.initial:
            return None
        return read_outcome(self.path.parent)


def pod_main(argv: list[str], grace_s: float = EXIT_GRACE_S, poll_s: float = 1.0) -> int:
    """`python -m hpctrain.launch.k8s_pod --run-dir DIR [--seed-config FILE] -- TORCHRUN...`, in each pod:
    seed config.yaml (no volume claim), take the run's lock and clear the last outcome (pod 0, which
    holds the lock until torchrun ends; hpctrain.core.rundir.RunLock), run torchrun with pod 0 as the
    rendezvous host, forward SIGTERM to it, and exit with pod_exit()'s status. Once the outcome is
    final, torchrun gets grace_s to end: its agents wait for each other before they exit, for one
    that was stopped by a signal up to 5 minutes, while its replacement could not join."""
    usage = ("usage: python -m hpctrain.launch.k8s_pod --run-dir DIR [--seed-config FILE] -- COMMAND...\n"
             "What each pod of launcher=k8s runs around torchrun; to train: python -m hpctrain launcher=k8s ...")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if "--" not in argv:
        print(usage, file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1:]
    run_dir = Path(opts[opts.index("--run-dir") + 1]) if "--run-dir" in opts else None
    seed = Path(opts[opts.index("--seed-config") + 1]) if "--seed-config" in opts else None
    if run_dir is None or not command:
        print("hpctrain.launch.k8s_pod: --run-dir and a command are needed", file=sys.stderr)
        return 2
    index = int(os.environ.get("JOB_COMPLETION_INDEX", "0") or 0)
    if seed is not None and not (run_dir / "config.yaml").is_file():
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", seed.read_text())
    say = lambda msg: print(f"hpctrain: pod {index}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    lock = None
    if index == 0:  # pod 0 drives the run (it hosts the rendezvous): it holds the run's lock
        try:
            lock = RunLock.take(run_dir, wait_s=REPLACED_WAIT_S)
        except ConfigError as e:
            say(f"error: {e}")
            return 2
        clear_outcome(run_dir)  # the last start's
    try:
        return _run_torchrun(command, run_dir, index, say, grace_s, poll_s)
    finally:
        if lock is not None:
            lock.release()


def _run_torchrun(command: list[str], run_dir: Path, index: int, say, grace_s: float, poll_s: float) -> int:
    """torchrun to its end, signals forwarded; the pod's exit status (pod_exit)."""
    watch = OutcomeWatch(run_dir)
    command = with_host(command, index == 0)
    say(shlex.join(command))
    signalled: list[int] = []
    proc = subprocess.Popen(command, env=torchrun_env(os.environ))

    def forward(signum, _frame):
        signalled.append(signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        final_at = stopped_at = None
        while True:
            try:
                rc = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if final_at is None and watch.final() is not None:
                final_at = now
            if final_at is not None and stopped_at is None and now - final_at > grace_s:
                # Its ranks are gone; the agent waits in a barrier, where it does not see SIGTERM.
                say(f"the run's outcome is final but torchrun is still running after {grace_s:.0f} s: stopping it")
                signalled.append(signal.SIGTERM)
                stopped_at = now
                proc.terminate()
            elif stopped_at is not None and now - stopped_at > grace_s:
                proc.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    outcome = watch.final()
    status = pod_exit(rc, outcome, bool(signalled))
    say(f"torchrun exited {rc}, outcome {(outcome or {}).get('status')}; exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(pod_main(sys.argv[1:]))
