"""Two gloo jobs given one rendezvous port, as hpctrain's local launcher could hand out before it held
its port (docs/failures.md, "Two jobs on one rendezvous port"): what each rank dies of.

    python benchmarks/port_clash.py --trials 20

Each trial starts job A (2 or 4 ranks) and, 0-4 s later, job B (2 or 4 ranks, other tensor sizes) on the
same MASTER_PORT, as two launches would. Every rank runs all-reduce, all-gather and broadcast for a few
seconds. The table counts how the ranks ended (exit code, signal, hang) and names the native errors found
in their output; `--keep DIR` keeps the logs of trials where a rank died of a signal. No GPU, no Slurm,
not hpctrain: torch.distributed and gloo only.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK = r"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
n0, t0, n = int(os.environ["N"]), time.time(), 0
while time.time() - t0 < 3:
    x = torch.ones(n0 + 13 * (n % 5)) * (r + 1)
    dist.all_reduce(x)
    assert x[0].item() == w * (w + 1) / 2, f"a wrong sum: {x[0].item()}"
    dist.all_gather([torch.empty_like(x) for _ in range(w)], x)
    dist.broadcast(x, src=n % w)
    n += 1
dist.barrier()
"""
NATIVE = ("Segmentation fault", "Fatal Python error: Aborted", "enforce fail at [^ ]+", "a wrong sum", "EADDRINUSE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(tag: str, world: int, port: int, size: int, d: Path) -> list:
    out = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   N=str(size), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", TORCH_CPP_LOG_LEVEL="ERROR")
        log = open(d / f"{tag}{r}.log", "w")
        out.append((f"{tag}{r}", subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True)))
    return out


def ended(p: subprocess.Popen, deadline: float) -> str:
    try:
        rc = p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return "hang"
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Two gloo jobs on one rendezvous port: how their ranks end.")
    ap.add_argument("--trials", type=int, default=10, help="pairs of jobs to start (default: %(default)s)")
    ap.add_argument("--hang-s", type=float, default=25.0, help="a rank still running this long hangs (default: %(default)s)")
    ap.add_argument("--keep", type=Path, help="copy the logs of trials where a rank died of a signal here")
    args = ap.parse_args(argv)
    ends, errors = collections.Counter(), collections.Counter()
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            d, port = Path(tmp), free_port()
            ranks = job("A", random.choice([2, 4]), port, 1000, d)
            time.sleep(random.uniform(0, 4))
            ranks += job("B", random.choice([2, 4]), port, 3007, d)
            deadline = time.monotonic() + args.hang_s
            how = {name: ended(p, deadline) for name, p in ranks}
            found = {m for name, _ in ranks for pat in NATIVE for m in re.findall(pat, (d / f"{name}.log").read_text(errors="replace"))}
            ends.update(how.values())
            errors.update(found)
            print(f"trial {trial}: " + ", ".join(f"{k} {v}" for k, v in how.items()) + (f" | {sorted(found)}" if found else ""),
                  flush=True)
            if args.keep and any(v.startswith("killed") for v in how.values()):
                shutil.copytree(d, args.keep / f"trial-{trial}")
    print("\nhow the ranks ended:", dict(ends.most_common()))
    print("errors in their logs:", dict(errors.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
