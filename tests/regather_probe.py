"""What one forward leaves alive for backward (one multi-rank launch, as engine_probe.py):

    python tests/regather_probe.py OUT.json 'override ...' ...

For each layout every rank trains two steps; a TorchDispatchMode keeps a weak reference to every tensor
an op makes (for a DTensor, its local tensor), and when the output layer's backward is about to start in
the second step (every block's saved tensors alive) the bytes of the distinct storages still alive are
summed, less what the first step left (the optimizer state): what autograd keeps, whoever keeps it.
What is alive after each step is recorded too (the optimizer state, and anything left behind). (The resident set says the same
per block, but the runtime's own buffers blur it by a few MiB.) Rank 0 writes {layout: [per-rank dicts]}
to OUT.json.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hpctrain.train.loop import Trainer

from rank_worker import probe_trainers, run_rank_of_layouts

COMMON = ["+experiment=tiny", "data.seq_len=1024", "train.global_batch=8", "train.micro_batch=8",
          "optim.warmup_steps=2", "checkpoint.every=0", "train.steps=3"]


class Made(TorchDispatchMode):
    """Weak references to the tensors every op returns (those `keep(func, tensor)` accepts, if given)."""

    def __init__(self, keep=None):
        super().__init__()
        self.refs = []
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_flatten(out)[0]
                         if isinstance(t, torch.Tensor) and (self.keep is None or self.keep(func, t)))
        return out

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def alive_bytes(self) -> int:
        from torch.distributed.tensor import DTensor

        storages = {}
        for ref in self.refs:
            t = ref()
            if t is None:
                continue
            local = t._local_tensor if isinstance(t, DTensor) else t
            try:
                s = local.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            except RuntimeError:  # tensors without storage (wrappers of the collectives in flight)
                pass
        return sum(storages.values())


def probe(t: Trainer) -> dict:
    part = t.parts[-1]
    model = getattr(part, "module", part)
    made, seen = Made(), {}

    def mark(*_):
        seen["forward"] = made.alive_bytes() - seen["base"]  # returns None: the gradients stay as they are

    with made:
        t.train_step()  # the first also builds the optimizer state (and a pipeline's shapes)
        seen["base"] = made.alive_bytes()
        hooks = [model.output.register_full_backward_pre_hook(mark)] if model.output is not None else []
        if model.tok_embeddings is not None:
            hooks += embedding_accumulation(model.tok_embeddings.weight, seen)
        try:
            loss, _ = t.train_step()
        finally:
            for hook in hooks:
                hook.remove()
    # What each step left behind (no garbage collection first: a reference cycle would show here).
    return {"rank": dist.get_rank(), "forward": seen.get("forward"), "after_first": seen["base"],
            "after": made.alive_bytes(), "beyond_state": beyond_state(t), "loss": loss.item(),
            "embedding_accumulation": seen.get("embedding")}


def embedding_accumulation(weight, seen: dict) -> list:
    """Hooks that measure, for each micro-batch after the first, what adding the embedding's fresh
    gradient to its .grad holds at most: the fresh gradient's bytes plus the most that the accumulation
    (and the layout hooks after it) allocate beside it, inside DTensor's ops too (torch.profiler's
    allocation events, where a dispatch mode sees only the outer op). seen["embedding"]: the largest over
    the micro-batches."""
    from torch._C._profiler import _EventType
    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile

    def before(grad):
        if weight.grad is not None:  # the first micro-batch's is taken as .grad, nothing added
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            seen["_fresh"] = local.untyped_storage().nbytes()
            seen["_prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            seen["_prof"].start()
        return None

    def after(_):
        prof = seen.pop("_prof", None)
        if prof is None:
            return
        prof.stop()
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
            stack.extend(e.children)
        held = most = 0
        for _, size in sorted(events, key=lambda x: x[0]):
            held += size
            most = max(most, held)
        seen["embedding"] = max(seen.get("embedding", 0), seen.pop("_fresh") + most)

    return [weight.register_hook(before), weight.register_post_accumulate_grad_hook(after)]


def beyond_state(t: Trainer) -> int:
    """Bytes of the tensors alive between steps (every tensor object Python can reach) other than the
    parameters, their gradients, the model's buffers (RoPE tables) and the optimizer state: the runtime's
    own persistent buffers."""
    import gc

    from torch.distributed.tensor import DTensor

    def key(x):
        return (x._local_tensor if isinstance(x, DTensor) else x).untyped_storage().data_ptr()

    state = {key(p) for p in t.params} | {key(p.grad) for p in t.params if p.grad is not None}
    state |= {key(b) for part in t.parts for b in part.buffers()}
    opt = getattr(t.optimizer, "optim", t.optimizer)
    state |= {key(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    gc.collect()
    other = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            local = o._local_tensor if isinstance(o, DTensor) else o
            s = local.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in state:
                other[s.data_ptr()] = s.nbytes()
    return sum(other.values())


def main() -> None:
    probe_trainers(COMMON, probe)


if __name__ == "__main__":
    run_rank_of_layouts(main)
