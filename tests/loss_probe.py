"""Runs one step's forward and backward of each layout twice, with train.loss=full and train.loss=chunked
from the same initial weights and batch, and compares the losses and every gradient (one launch).

    python tests/loss_probe.py OUT.json 'override ...' ...

Rank 0 writes {layout: {"loss": [full, chunked], "worst": the largest |chunked - full| of any gradient
element over that gradient's largest |full| element, "params": gradients compared}}.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpctrain.train.loop import Trainer

from rank_worker import compose_once, over_layouts, run_rank_of_layouts

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "checkpoint.every=0", "train.steps=1"]


def gradients(spec: str, loss: str, d: str, de) -> tuple[float, list]:
    run = os.path.join(d, loss, "run" if de.rank == 0 else "other")
    cfg = compose_once([*COMMON, f"launcher.nproc={de.world}", f"train.loss={loss}", *spec.split()], run)
    t = Trainer.of(cfg, run, torch.device("cpu"))
    micro = t.sampler.next_step()
    loss_v = t._pipeline_forward_backward(micro) if t.schedule is not None else t._forward_backward(micro)
    dist.all_reduce(loss_v, op=dist.ReduceOp.AVG, group=t.dp_mesh.get_group())
    grads = []
    for p in t.params:  # the same parameters in the same order on both runs
        g = p.grad
        grads.append(g.full_tensor() if isinstance(g, DTensor) else g.clone())
    return loss_v.item(), grads


def main() -> None:
    out, layouts = sys.argv[1], sys.argv[2:]

    def one(spec: str, d: str, de) -> dict:
        lf, gf = gradients(spec, "full", d, de)
        lc, gc = gradients(spec, "chunked", d, de)
        worst = max((float((c - f).abs().max() / f.abs().max().clamp_min(1e-30)) for f, c in zip(gf, gc)), default=0.0)
        box = torch.tensor([worst])
        dist.all_reduce(box, op=dist.ReduceOp.MAX)  # every rank's gradients (pipeline stages hold different ones)
        n = torch.tensor([len(gf)])
        dist.all_reduce(n)
        return {"loss": [lf, lc], "worst": box.item(), "params": int(n.item())}

    over_layouts(out, layouts, one)


if __name__ == "__main__":
    run_rank_of_layouts(main)
