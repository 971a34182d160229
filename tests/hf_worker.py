"""Multi-rank helpers of tests/test_hf.py:

    python tests/hf_worker.py first_loss OUT.json HF_DIR 'layout' ...   # model.init_from, two steps each
    python tests/hf_worker.py save_init RUN_DIR 'layout'                 # a checkpoint of the initial weights
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hpctrain.core.compose import compose
from hpctrain.train.loop import Trainer

from rank_worker import compose_once, over_layouts, run_rank_of_layouts

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2"]


def first_loss() -> None:
    out, path, layouts = sys.argv[2], sys.argv[3], sys.argv[4:]

    def one(spec: str, d: str, de) -> list[float]:
        run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
        cfg = compose_once([*COMMON, "model=hf", f"model.init_from={path}", f"launcher.nproc={de.world}",
                            *spec.split()], run)
        t = Trainer.of(cfg, run, torch.device("cpu"))
        t.resume(print)  # no checkpoint here: the weights come from model.init_from
        return [t.train_step()[0].item() for _ in range(2)]

    over_layouts(out, layouts, one)


def save_init() -> None:
    from hpctrain.distributed.bootstrap import detect, init

    run, layout = sys.argv[2], sys.argv[3]
    de = detect()
    init(de, "gloo", 120, 1)
    cfg = compose([*COMMON, f"launcher.nproc={de.world}", f"run.dir={run}", *layout.split()])
    t = Trainer.of(cfg, run, torch.device("cpu"))
    t.save(blocking=True)  # step 0: the initial weights, sharded as this layout holds them
    t.ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank_of_layouts({"first_loss": first_loss, "save_init": save_init}[sys.argv[1]])
