"""Runs several parallel layouts in one multi-rank launch (importing torch costs seconds per rank).

    python tests/layout_worker.py OUT.json STEPS 'override ...' 'override ...' ...

Each argument after STEPS is one layout (space-separated overrides on top of tests' common ones);
rank 0 writes {layout: {"loss": [...], "grad_norm": [...], "mem": [...]}} to OUT.json.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from hpctrain.compose import compose
from hpctrain.dist.bootstrap import detect, init
from hpctrain.train.loop import Trainer

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "optim.warmup_steps=2",
          "checkpoint.every=0"]


def main() -> None:
    out, steps, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    de = detect()
    init(de, "gloo", 120, 1)
    results = {}
    for spec in layouts:
        with tempfile.TemporaryDirectory() as d:
            run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
            cfg = compose([*COMMON, f"launcher.nproc={de.world}", f"train.steps={steps}", f"run.dir={run}",
                           *spec.split()])
            t = Trainer(cfg, run, torch.device("cpu"))
            losses, norms = [], []
            for _ in range(steps):
                loss, norm = t.train_step()
                losses.append(loss.item())
                norms.append(float(norm))
            results[spec] = {"loss": losses, "grad_norm": norms}
            dist.barrier()
    if de.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
