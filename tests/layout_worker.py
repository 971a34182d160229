"""Runs several parallel layouts in one multi-rank launch (importing torch costs seconds per rank).

    python tests/layout_worker.py OUT.json STEPS 'override ...' 'override ...' ...

Each argument after STEPS is one layout (space-separated overrides on top of tests' common ones);
rank 0 writes {layout: {"loss": [...], "grad_norm": [...], "val": validation loss after the last
step, "blocks": the block indices each rank's model parts hold, by rank, "kernel": the attention kernel's
class on rank 0}} to OUT.json.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hpctrain.train.loop import Trainer

from rank_worker import compose_once, over_layouts, run_rank_of_layouts, train_steps

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "optim.warmup_steps=2",
          "checkpoint.every=0"]


def main() -> None:
    out, steps, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

    def one(spec: str, d: str, de) -> dict:
        run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
        cfg = compose_once([*COMMON, f"launcher.nproc={de.world}", f"train.steps={steps}", *spec.split()], run)
        t = Trainer.of(cfg, run, torch.device("cpu"))
        t.resume(lambda *a: None)  # as fit() starts: model.init_from, model.lora.init_from (a fresh run dir)
        held = sorted(int(i) for part in t.parts for i in getattr(part, "module", part).layers.keys())
        blocks = [None] * de.world
        dist.all_gather_object(blocks, held)
        part = getattr(t.parts[0], "module", t.parts[0])
        kernel = type(next(iter(part.layers.values())).attention.kernel).__name__ if len(part.layers) else None
        return {**train_steps(t, steps), "val": t.evaluate(), "blocks": blocks, "kernel": kernel}

    over_layouts(out, layouts, one)


if __name__ == "__main__":
    run_rank_of_layouts(main)
