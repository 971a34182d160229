"""Helpers the multi-rank benchmarks (pipeline.py, layouts.py) share: launch a worker script as N
local ranks, bring a rank up, compose a config, read this process's memory, gather results.

The driver side (launch_ranks) imports nothing heavy; the rank side imports torch only when called.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------ driver side


def launch_ranks(run_dir: Path, nproc: int, argv: Sequence[str], threads: int = 1, env: dict | None = None) -> None:
    """Run `python argv...` as `nproc` local ranks (hpctrain's local launcher), `threads` torch
    threads each, with `env` added to their environment; raises SystemExit naming the logs when a
    rank fails."""
    from hpctrain.launch.local import launch

    extra = {"OMP_NUM_THREADS": str(threads), **(env or {})}  # the launcher passes os.environ on
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        rc = launch(run_dir, nproc, cmd=[sys.executable, *argv])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if rc != 0:
        raise SystemExit(f"{argv[0]}: {nproc}-rank worker failed (exit {rc}); rank logs in {run_dir}/logs")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------ rank side


def start_rank(threads: int = 1, timeout_s: int = 300):
    """detect() + init() as hpctrain's own ranks do, with `threads` intra-op threads; the DistEnv."""
    from hpctrain.distributed.bootstrap import detect, init

    de = detect()
    init(de, "gloo", timeout_s, threads)
    return de


def preimport() -> None:
    """Import every module any layout pulls in lazily, so that a memory baseline taken afterwards
    holds the same code and libraries for every layout."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.pipelining.schedules  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401


def compose_cfg(overrides: Sequence[str]):
    from hpctrain.core.compose import compose

    return compose(list(overrides))


_SCRATCH: list = []  # this process's throw-away directory, removed by finish()


def trainer(cfg, rank: int):
    """A Trainer in a throw-away run directory (the benchmarks save nothing)."""
    import torch

    from hpctrain.train.loop import Trainer

    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="hpctrain-bench-"))
    run = tempfile.mkdtemp(prefix="run" if rank == 0 else f"rank{rank}-", dir=_SCRATCH[0])
    cfg.run.dir = run
    return Trainer.of(cfg, run, torch.device("cpu"))


def rss_bytes() -> int:
    """Resident set size now (/proc/self/statm; pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_json(path: str | os.PathLike, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def finish() -> None:
    """Leave without waiting on gloo's teardown (as tests/layout_worker.py does)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    for d in _SCRATCH:
        shutil.rmtree(d, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
