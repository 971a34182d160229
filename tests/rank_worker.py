"""What the multi-rank test workers share (layout_worker.py, engine_probe.py, offload_worker.py): one
launch runs many layouts, since importing torch costs seconds per rank."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable


def over_layouts(out: str, layouts: list[str], one: Callable[[str, str, Any], Any],
                 extra: Callable[[], dict] = dict) -> None:
    """Bring up gloo, call `one(layout, scratch_dir, dist_env)` for every layout (each in a fresh
    temporary directory, all ranks together), and have rank 0 write {layout: result, **extra()} to
    `out` as JSON."""
    import torch.distributed as dist

    from hpctrain.dist.bootstrap import detect, init

    de = detect()
    init(de, "gloo", 120, 1)
    results = {}
    for layout in layouts:
        with tempfile.TemporaryDirectory() as d:
            results[layout] = one(layout, d, de)
            dist.barrier()
    results.update(extra())
    if de.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def train_steps(trainer, steps: int) -> dict:
    """{"loss": [...], "grad_norm": [...]} of `steps` optimizer steps of a Trainer."""
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = trainer.train_step()
        losses.append(loss.item())
        norms.append(float(norm))
    return {"loss": losses, "grad_norm": norms}


def run_rank_of_layouts(main: Callable[[], None]) -> None:
    """Run `main`, then leave without interpreter finalization (gloo's threads may still be up)."""
    main()
    sys.stdout.flush()
    os._exit(0)
