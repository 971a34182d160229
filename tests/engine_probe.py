"""Looks inside one training step of several layouts (one multi-rank launch, as layout_worker.py):

    python tests/engine_probe.py OUT.json 'override ...' 'override ...' ...

For each layout every rank records, around one Trainer.train_step():
- the dtypes every matmul ran in (a TorchDispatchMode over aten's mm/addmm/bmm/linear ops);
- the dtypes gradients were reduced in (FSDP2's reduce-scatters and all-reduces, DDP's bucket
  all-reduces; the loss's and the gradient norm's all-reduces are fp32 as well) and
  parameters gathered in (FSDP2's all-gathers);
- bytes of the gathered (not data-parallel-sharded) parameters registered on the modules when the
  output projection has run (what forward keeps gathered), of the gradients the optimizer gets, of the optimizer's moments after
  the step, and of the parameters at rest after it;
- `full`: bytes of this rank's parameters if nothing were sharded over data parallel (global
  shapes, divided by tp where tensor parallel splits them), and the biggest single tensor.
Rank 0 writes {layout: [per-rank dicts]} to OUT.json.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.train.loop import Trainer

from rank_worker import probe_trainers, run_rank_of_layouts

COMMON = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "optim.warmup_steps=2",
          "checkpoint.every=0", "train.steps=2"]
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"}


class MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.update(str(a.dtype).replace("torch.", "") for a in args[:2] if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _gathered(p: torch.Tensor) -> bool:
    """Not sharded over data parallel (FSDP2 registers the gathered parameter while a unit is in use)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names or ()
    return not any(isinstance(pl, Shard) and n in ("dp_shard", "dp_replicate") for n, pl in zip(names, p.placements))


def _tp_share(p: torch.Tensor, tp_mesh) -> float:
    """Elements of p on one tensor-parallel rank, were it not sharded over data parallel."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor) or tp_mesh is None:
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    split = any(isinstance(pl, Shard) and n == "tp" for n, pl in zip(names, p.placements))
    return p.numel() / (tp_mesh.size() if split else 1)


def probe(t: Trainer) -> dict:
    record = {"reduce": set(), "scatter": set(), "gather": set(), "after_forward": 0, "n_reduce": 0, "n_gather": 0}
    tp_mesh = t.meshes["tp"] if t.meshes.enabled("tp") else None

    rs, ag, ar = dist.reduce_scatter_single, dist.all_gather_single, dist.all_reduce

    def all_reduce(tensor, *a, **kw):  # FSDP2's replicate (and HSDP) all-reduce gradients
        record["reduce"].add(str(tensor.dtype).replace("torch.", ""))
        return ar(tensor, *a, **kw)

    def reduce_scatter_single(output, input, *a, **kw):
        record["reduce"].add(str(input.dtype).replace("torch.", ""))
        record["scatter"].add(str(input.dtype).replace("torch.", ""))  # FSDP2's gradients alone
        record["n_reduce"] += 1
        return rs(output, input, *a, **kw)

    def all_gather_single(output, input, *a, **kw):
        record["gather"].add(str(input.dtype).replace("torch.", ""))
        record["n_gather"] += 1
        return ag(output, input, *a, **kw)

    dist.reduce_scatter_single, dist.all_gather_single = reduce_scatter_single, all_gather_single
    dist.all_reduce = all_reduce
    part = t.parts[-1]
    model = getattr(part, "module", part)  # DDP wraps
    if hasattr(part, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def recording_hook(state, bucket):
            record["reduce"].add(str(bucket.buffer().dtype).replace("torch.", ""))
            return allreduce_hook(state, bucket)

        part.register_comm_hook(t.dp_mesh.get_group(), recording_hook)
    hooks = []
    if model.output is not None:
        def after_output(_m, _i, _o):
            held = _bytes(p for q in t.parts for p in q.parameters() if _gathered(p))
            record["after_forward"] = max(record["after_forward"], held)
        hooks.append(model.output.register_forward_hook(after_output))

    opt = t.optimizer
    inner = getattr(opt, "optim", opt)
    real_step = opt.step

    def step(*a, **kw):
        grads = [p.grad for p in t.params if p.grad is not None]
        record["grads"] = _bytes(grads)
        record["grad_dtypes"] = sorted({str(g.dtype).replace("torch.", "") for g in grads})
        return real_step(*a, **kw)

    opt.step = step
    mode = MatmulDtypes()
    try:
        with mode:
            t.train_step()
    finally:
        dist.reduce_scatter_single, dist.all_gather_single, dist.all_reduce = rs, ag, ar
        for h in hooks:
            h.remove()
    params = [p for q in t.parts for p in q.parameters()]
    moments = [v for st in inner.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"rank": dist.get_rank(), "dp_rank": t.dp_mesh.get_local_rank(), "dp": t.dp_mesh.size(),
            "group": [t.meshes[d].get_local_rank() for d in ("pp", "tp")],
            "matmul": sorted(mode.seen), "reduce": sorted(record["reduce"]),
            "scatter": sorted(record["scatter"]), "gather": sorted(record["gather"]),
            "after_forward": record["after_forward"], "has_output": model.output is not None,
            "n_reduce": record["n_reduce"], "n_gather": record["n_gather"], "microbatches": t.spec.microbatches,
            "units": _fsdp_units(t.parts), "blocks": len(model.layers),
            "grads": record["grads"], "grad_dtypes": record["grad_dtypes"], "moments": _bytes(moments),
            "at_rest": _bytes(params), "param_dtypes": sorted({str(_local(p).dtype).replace("torch.", "") for p in params}),
            "full": sum(_tp_share(p, tp_mesh) for p in params), "largest": max(_tp_share(p, tp_mesh) for p in params)}


def _fsdp_units(parts) -> int:
    """FSDP2 units with parameters: one per fully_shard call that took some (a call over a list of
    modules, as the final norm with the output, is one unit; the root is none when all went below)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {id(g) for q in parts for m in q.modules() if isinstance(m, FSDPModule)
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}
    return len(groups)


def main() -> None:
    probe_trainers(COMMON, probe)


if __name__ == "__main__":
    run_rank_of_layouts(main)
