"""QLoRA layouts in one multi-rank launch (as layout_worker.py):

    python tests/qlora_worker.py OUT.json STEPS 'override ...' 'override ...' ...

Rank 0 writes {layout: {"loss": [...], "grad_norm": [...], "nf4_bytes": [the bytes of every rank's NF4
storages, measured], "nf4": [whether each rank's adapted weights are NF4Tensors]}}.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hpctrain.models.lora import LoRALinear
from hpctrain.parallel.quantize import nf4_bytes
from hpctrain.train.loop import Trainer

from rank_worker import compose_once, over_layouts, run_rank_of_layouts, train_steps


def main() -> None:
    out, steps, common, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]

    def one(spec: str, d: str, de) -> dict:
        run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
        cfg = compose_once([*common, f"launcher.nproc={de.world}", f"train.steps={steps}", *spec.split()], run)
        t = Trainer.of(cfg, run, torch.device("cpu"))
        t.resume(lambda *a: None)
        layers = [m for part in t.parts for m in part.modules() if isinstance(m, LoRALinear)]
        nf4 = all(type(getattr(m.weight, "_local_tensor", m.weight)).__name__ == "NF4Tensor" for m in layers)
        mine = [sum(nf4_bytes(m.weight) for m in layers), nf4]
        got = train_steps(t, steps)
        every = [None] * de.world
        dist.all_gather_object(every, mine)
        return {**got, "nf4_bytes": [e[0] for e in every], "nf4": [e[1] for e in every]}

    over_layouts(out, layouts, one)


if __name__ == "__main__":
    run_rank_of_layouts(main)
