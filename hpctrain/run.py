"""What every rank runs: `python -m hpctrain.run <run_dir>`.

The run directory's config.yaml is the single source of truth; the launcher (local, srun,
torchrun, mpiexec) only decides how many of us there are and where rank 0 listens.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from pathlib import Path

from hpctrain.compose import load
from hpctrain.dist import nccl
from hpctrain.dist.bootstrap import BootstrapError, detect, init
from hpctrain.train.requeue import requeue
from hpctrain.spec import backend_for, engine_spec
from hpctrain.train.preempt import Preemption

log = logging.getLogger("hpctrain")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hpctrain.run <run_dir>", file=sys.stderr)
        return 2
    # First thing: a preemption signal may come while torch is still importing (seconds).
    preemption = Preemption().install()
    run_dir = Path(argv[0]).resolve()
    cfg = load(run_dir / "config.yaml")
    de = detect()
    logging.basicConfig(level=logging.INFO, format=f"[rank {de.rank}] %(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if de.note:
        log.warning(de.note)
    spec = engine_spec(cfg, de.world)
    if spec.layout.world != de.world:
        log.error("the config's layout (%s) does not match the %d ranks %s started", spec.layout.describe(),
                  de.world, de.launcher)
        return 2

    import torch
    import torch.distributed as dist

    from hpctrain.checkpoint.manager import NoUsableCheckpoint, SaveFailed
    from hpctrain.train.loop import Trainer

    try:
        backend = backend_for(cfg.launcher.backend, spec.device, torch.cuda.is_available())
        nccl.apply(backend, {k: str(v) for k, v in cfg.cluster.env.items()}, de.rank)
        device = init(de, backend, cfg.launcher.timeout_s, cfg.train.threads)
        log.info("rank %d of %d on %s (launcher %s, backend %s, device %s)", de.rank, de.world,
                 socket.gethostname(), de.launcher, backend, device)
        outcome = Trainer(cfg, str(run_dir), device, spec).fit(preemption)
        if de.rank == 0:
            log.info("%s at step %d", outcome.status, outcome.step)
            if outcome.status == "preempted" and de.launcher == "slurm":
                # Every rank's shards are committed (the save ends in a barrier): safe to requeue.
                requeue(os.environ, cfg.cluster.max_requeues)
    except (BootstrapError, NoUsableCheckpoint, SaveFailed) as e:
        log.error("%s", e)
        return 2
    except BaseException:  # DCP raises BaseException subclasses; log them all, then fail the rank
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Leave without running interpreter finalization: C++ threads of the process group (gloo,
    TCPStore) can still be alive then, and tearing down their objects aborts the process
    ("terminate called without an active exception") after the work is done."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
