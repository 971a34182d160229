"""What the multi-rank test workers share (layout_worker.py, engine_probe.py, regather_probe.py,
offload_worker.py): one launch runs many layouts, since importing torch costs seconds per rank."""
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

    from hpctrain.distributed.bootstrap import detect, init

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


def compose_once(overrides: list[str], run: str):
    """The config of `overrides` with run.dir=`run`: composed by rank 0 and sent to the others (Hydra
    takes ~0.5 s of CPU a call, and every layout of every rank would pay it)."""
    import dataclasses

    import torch.distributed as dist

    from hpctrain.core.compose import compose

    box = [compose([*overrides, f"run.dir={run}"]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cfg = box[0]
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=os.path.abspath(run)))


def probe_trainers(common: list[str], probe: Callable[[Any], Any]) -> None:
    """A probe worker's main (OUT.json and layouts on the command line): for every layout each rank builds
    a Trainer of `common` + the layout, calls `probe(trainer)`, and rank 0 writes {layout: [the result
    of every rank]}."""
    import torch
    import torch.distributed as dist

    from hpctrain.train.loop import Trainer

    def one(spec: str, d: str, de) -> list:
        run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
        cfg = compose_once([*common, f"launcher.nproc={de.world}", *spec.split()], run)
        mine = probe(Trainer.of(cfg, run, torch.device("cpu")))
        gathered = [None] * de.world
        dist.all_gather_object(gathered, mine)
        return gathered

    over_layouts(sys.argv[1], sys.argv[2:], one)


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
