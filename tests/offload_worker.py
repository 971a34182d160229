"""Offloaded optimizer runs against the same runs without offload, in one multi-rank launch.

    python tests/offload_worker.py OUT.json STEPS OFFLOAD_DIR 'override ...' ...

Each layout argument is run as given (`train` mode: STEPS steps of train_step) or, when it starts with
`resume:`, as a run that checkpoints every 2 steps and then a second trainer that resumes from step 2
and trains to STEPS (losses of both). Rank 0 writes {layout: {...}} to OUT.json.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from hpctrain.core.compose import compose
from hpctrain.train.loop import Trainer

from rank_worker import over_layouts, run_rank_of_layouts, train_steps

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "optim.warmup_steps=2",
          "checkpoint.every=0", "offload.chunk_mb=1"]


def _plain(opt):
    return getattr(opt, "optim", opt)


def _model_holds_no_state(t: Trainer) -> bool:
    """No optimizer tensor shares memory with the model, and offloaded state lives off the device."""
    from hpctrain.offload.cpu import local_tensor

    model_ptrs = {local_tensor(p).untyped_storage().data_ptr() for p in t.params}
    for st in _plain(t.optimizer).state.values():
        for k, v in st.items():
            if k == "step":
                continue
            loc = local_tensor(v)
            if loc.device.type != "cpu" or loc.untyped_storage().data_ptr() in model_ptrs:
                return False
    return True


def _fsdp_host_params(t: Trainer):
    """Whether FSDP2 keeps the sharded parameters and gradients in host memory (its CPU offload
    policy), for every FSDP module; None without FSDP. Read from FSDP2's own parameter records."""
    flags = []
    for part in t.parts:
        for m in part.modules():
            state = getattr(m, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state else None
            if group is not None:
                flags += [fp.offload_to_cpu for fp in group.fsdp_params]
    return all(flags) if flags else None


def _param_sum(t: Trainer) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in t.params:
        total += p.detach().full_tensor().double().sum() if hasattr(p, "full_tensor") else p.detach().double().sum()
    return float(total)


def train(cfg, run: str, steps: int) -> dict:
    t = Trainer.of(cfg, run, torch.device("cpu"))
    info = {**train_steps(t, steps), "param_sum": _param_sum(t)}
    opt = _plain(t.optimizer)
    if hasattr(opt, "host_bytes"):
        info.update(host_bytes=opt.host_bytes(), state_bytes=opt.state_bytes(),
                    model_clean=_model_holds_no_state(t), host_params=_fsdp_host_params(t))
        opt.close()
    return info


def resume(cfg_args: list[str], run: str, steps: int) -> dict:
    """One run that checkpoints every 2 steps, then one that resumes from step 2 in the same directory."""
    first = Trainer.of(compose([*cfg_args, "checkpoint.every=2"]), run, torch.device("cpu"))
    whole = first.fit()
    second = Trainer.of(compose([*cfg_args, "checkpoint.every=2", "checkpoint.load_step=2"]), run,
                     torch.device("cpu"))
    out = second.fit()
    res = {"uninterrupted": whole.losses, "resumed": out.losses, "resumed_from": second.resumed_from,
           "param_sum_uninterrupted": _param_sum(first), "param_sum_resumed": _param_sum(second)}
    for t in (first, second):
        getattr(_plain(t.optimizer), "close", lambda: None)()
    return res


def main() -> None:
    out, steps, offload_dir, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]

    def one(spec: str, d: str, de) -> dict:
        mode, _, overrides = spec.rpartition(":")
        base = d if de.rank == 0 else os.path.join(d, "other")
        obj = [base]
        dist.broadcast_object_list(obj, src=0)  # resuming needs one run directory for all ranks
        run = os.path.join(obj[0], "run") if mode == "resume" else os.path.join(base, "run")
        args = [*COMMON, f"launcher.nproc={de.world}", f"train.steps={steps}", f"run.dir={run}",
                f"offload.path={offload_dir}", *overrides.split()]
        return resume(args, run, steps) if mode == "resume" else train(compose(args), run, steps)

    over_layouts(out, layouts, one, extra=lambda: {"_leftover_files": sorted(os.listdir(offload_dir))})


if __name__ == "__main__":
    run_rank_of_layouts(main)
