"""The two seams of the rank's parallel code, in one process: the MoE token dispatcher (hpctrain.models.
dispatch, hpctrain.parallel.dispatch), chosen once from the token and expert ranks, which owns every
collective and DTensor of the MoE layer; and context parallel's kernels, with the private torch
behaviour they rely on pinned here (torch 2.13), so that an upgrade that changes it fails in this file
first. The multi-rank numerics of every MoE, EP and CP layout: tests/test_layouts.py."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from hpctrain.core.schema import ModelConfig, MoEConfig
from hpctrain.models import attention as A
from hpctrain.models.dispatch import LocalDispatcher
from hpctrain.models.moe import MoE


def _moe() -> MoE:
    torch.manual_seed(0)
    layer = MoE(ModelConfig(dim=32, moe=MoEConfig(experts=4, top_k=2, ffn_dim=16, capacity_factor=1.0,
                                                  aux_loss_coef=0.01, z_loss_coef=0.001)))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    layer.router.bias.zero_()
    return layer


# ------------------------------------------------------------------------- the token dispatcher

class TwoSharesOfOne(LocalDispatcher):
    """A token group of two ranks holding the same tokens, without the collectives: the whole
    micro-batch is this rank's share twice (each rank keeps its own capacity: 1.0 x its slots / experts,
    whose drops add up to those of the whole micro-batch at twice the capacity)."""

    def totals(self, counts, tokens):
        return counts * 2, tokens * 2

    def whole(self, parts):
        return parts * 2


def test_the_moe_layer_sums_its_statistics_through_its_dispatcher():
    """Routed slots, balancing losses and dropped slots of a rank's share, summed by the dispatcher over
    its token group, are those of the whole micro-batch on one process. Mutant caught: the layer's forward
    using its own counts (routing.routed) or parts instead of the dispatcher's totals."""
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    shared, whole = _moe(), _moe()
    shared.dispatcher = TwoSharesOfOne()
    with torch.no_grad():
        shared(x)
        whole(torch.cat([x, x]))
    a, b = shared.stats, whole.stats
    assert b.dropped > 0
    torch.testing.assert_close(a.load, b.load)
    for got, want in ((a.aux, b.aux), (a.z, b.z), (a.dropped, b.dropped)):
        torch.testing.assert_close(got, want)


def test_rows_arriving_by_source_rank_are_grouped_by_local_expert():
    """Rows arrive as (source rank, local expert) blocks; the permutation makes each local expert's rows
    contiguous, source ranks in order within it. Mutant caught: the blocks left in arrival order."""
    from hpctrain.parallel.dispatch import by_expert

    got = torch.tensor([[2, 1], [0, 3]])  # from rank 0: 2 rows for expert 0, 1 for expert 1; rank 1: 0, 3
    arrived = ["r0e0", "r0e0", "r0e1", "r1e1", "r1e1", "r1e1"]
    order = by_expert(got).tolist()
    assert [arrived[i] for i in order] == ["r0e0", "r0e0", "r0e1", "r1e1", "r1e1", "r1e1"]
    assert order == [0, 1, 2, 3, 4, 5]
    got = torch.tensor([[1, 2], [2, 1]])
    arrived = ["r0e0", "r0e1", "r0e1", "r1e0", "r1e0", "r1e1"]
    assert [arrived[i] for i in by_expert(got).tolist()] == ["r0e0", "r1e0", "r1e0", "r0e1", "r0e1", "r1e1"]


class Mesh:
    def __init__(self, name, group=None):
        self.name, self.group = name, group

    def get_group(self):
        return self.group if self.group is not None else self.name

    def _flatten(self, name):
        return Mesh(name)


class NamedMeshes:
    """The meshes of a layout by name (hpctrain.distributed.mesh.ParallelDims's plan), each a stand-in
    whose group is its name: which mesh the dispatcher takes, without building process groups."""

    def __init__(self, dims, ep_group):
        self.dims, self.ep_group = dims, ep_group

    def enabled(self, name):
        return self.dims.enabled(name)

    def __getitem__(self, name):
        assert name in self.dims.plan, name
        return Mesh(name, self.ep_group if name == "ep" else None)


@pytest.mark.parametrize("cp,tp,ep,tokens", [(1, 1, 1, None), (1, 2, 1, "cp_tp"), (2, 1, 1, "cp_tp"),
                                             (2, 2, 1, "cp_tp"), (1, 1, 2, None), (2, 2, 2, "cp_tp"),
                                             (1, 2, 2, "cp_tp")])
def test_one_dispatcher_from_the_token_and_expert_ranks_together(world_of_one, cp, tp, ep, tokens):
    """Every MoE layer's dispatcher is decided in one place from both meshes: statistics summed over the
    token mesh (cp x tp, or whichever of them is on: its ranks are tests/test_mesh.py's), all-to-all
    over ep, whatever the order the transforms ran in. Mutants caught: the token mesh taken only with
    cp on (tp's shares then summed nowhere); the all-to-all dispatcher built without the token group
    (the order bug of before: expert parallel's dispatcher forgot what tensor parallel had set)."""
    import torch.distributed as dist

    from hpctrain.core.spec import Layout
    from hpctrain.distributed.mesh import ParallelDims
    from hpctrain.parallel.apply import moe_dispatcher
    from hpctrain.parallel.dispatch import AllToAllDispatcher

    dims = ParallelDims(Layout(pp=1, dp_replicate=1, dp_shard=2 * ep, tp=tp, ep=ep, cp=cp))
    meshes = NamedMeshes(dims, dist.group.WORLD)
    d = moe_dispatcher(_moe(), meshes)
    assert type(d) is (AllToAllDispatcher if ep > 1 else LocalDispatcher)
    assert d.token_group == tokens
    assert moe_dispatcher(torch.nn.Linear(2, 2), meshes) is None


def test_the_all_to_all_exchange_moves_rows_and_never_changes_them(world_of_one):
    """The all-to-all dispatcher over a group of one against the local one: output and every gradient
    (test_gpu.py runs the same over NCCL). Mutant caught: local counts summed over the source ranks'
    axis instead of the experts'."""
    import torch.distributed as dist

    from hpctrain.parallel.dispatch import AllToAllDispatcher

    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    outs, grads = [], []
    for dispatcher in (LocalDispatcher(), AllToAllDispatcher(dist.group.WORLD, 4)):
        layer = _moe()
        layer.dispatcher = dispatcher
        y = layer(x)
        y.pow(2).mean().backward()
        outs.append(y.detach())
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_rerun_of_the_forward_is_not_counted(early_stop):
    """hpctrain's activation checkpointing marks the rerun of a block with MoE layers (a public context_fn,
    not autograd's private graph-task id), and the routing statistics skip it. With torch's default early
    stop the rerun ends at the last saved tensor, before the statistics; without it (torch.compile's AC,
    or set_checkpoint_early_stop(False)) it reaches them. Two micro-batches. Mutants caught: the wrapper
    without the mark (early_stop=False counts each micro-batch twice); the mark left on when early stop
    ends the rerun by an exception (early_stop=True: the second micro-batch not counted)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from hpctrain.parallel.activation import checkpointed

    layer = _moe()
    block = checkpointed(layer)
    with set_checkpoint_early_stop(early_stop):
        for _ in range(2):
            block(torch.randn(1, 16, 32, requires_grad=True)).sum().backward()
    assert layer.stats.passes == 2 and layer.stats.load.sum().item() == 2 * 16 * 2


# ------------------------------------------------------------------------- context parallel's kernels

def _pairs_cases():
    gen = torch.Generator().manual_seed(4)
    docs_q = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    docs_k = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    for causal_pair in ((1, 1), (2, 1), (1, 1, "docs"), (2, 1, "docs")):
        q = torch.randn(1, 4, 8, 8, generator=gen)
        k, v = (torch.randn(1, 2, 8, 8, generator=gen) for _ in range(2))
        docs = (docs_q, docs_k) if len(causal_pair) == 3 else (None, None)
        yield q, k, v, A.pair(causal_pair[0], causal_pair[1], *docs, q.dtype)


def test_the_cpu_flash_kernel_keeps_the_contract_the_chunked_attention_uses():
    """torch's private `_scaled_dot_product_flash_attention_for_cpu` and its backward, as FlashPairs calls
    them (dropout and is_causal positional, an additive mask in the query's dtype, grouped-query K/V as
    they are; (out, natural-log lse (batch, heads, seq) fp32) out, (dq, dk, dv) back), against the matmul
    kernel on the same pairs: on the diagonal (causal), below it, with documents (rows without a key
    included). Mutants caught: is_causal given in the dropout slot; the mask not passed."""
    assert A.pairs_for(torch.device("cpu")) is A.FlashPairs and A.pairs_for(torch.device("meta")) is A.MathPairs
    for q, k, v, p in _pairs_cases():
        got, want = A.pair_forward(q, k, v, p, None, A.FlashPairs), A.pair_forward(q, k, v, p, None, A.MathPairs)
        assert got[1].dtype == torch.float32 and got[1].shape == q.shape[:3]
        keep = torch.isfinite(want[1])  # rows with no key: the kernel's out there is never read
        torch.testing.assert_close(got[0][keep], want[0][keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1])
        # backward takes the merged lse, finite on every row (each token sees itself in some pair)
        out, lse = want[0], want[1].masked_fill(~keep, 0.0)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        for a, b in zip(A.FlashPairs.backward(dout, q, k, v, out, lse, p, None),
                        A.MathPairs.backward(dout, q, k, v, out, lse, p, None)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_pair_kernel_named_serves_forward_and_backward():
    """The pair kernel is an argument from the model's attention to every pair, both ways (what a test
    once switched by patching module state). Mutant caught: the backward falling back to the device's
    kernel."""
    calls = []

    class Spy(A.MathPairs):
        @staticmethod
        def forward(*args):
            calls.append("forward")
            return A.MathPairs.forward(*args)

        @staticmethod
        def backward(*args):
            calls.append("backward")
            return A.MathPairs.backward(*args)

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 16, 8, generator=gen, requires_grad=True)
    docs = torch.tensor([[0] * 5 + [1] * 11])
    A.causal_attention(q, q, q, docs, pairs=Spy).sum().backward()
    assert "forward" in calls and "backward" in calls


def test_torch_context_parallel_private_api_as_used_on_torch_2_13(world_of_one):
    """torch's context parallel through the private names hpctrain.parallel.context_torch uses, on a cp
    group of one: DTensor's op dispatcher takes our CPU handlers beside torch's, the ring gives SDPA's
    causal attention forward and backward (grouped-query K/V, fp32), and `disable` leaves DTensor's
    handlers as torch had them: no process-wide change outlives the kernel's process use. Mutants
    caught: `disable` leaving the handlers on; the CPU handlers not registered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    from hpctrain.parallel import context_torch as T

    before = DTensor._op_dispatcher._custom_op_handlers
    assert not set(T.CPU_HANDLERS) & set(before)  # nothing changed until the kernel is chosen
    try:
        kernel = T.TorchContextParallelAttention(init_device_mesh("cpu", (1,)), "ring")
        handlers = DTensor._op_dispatcher._custom_op_handlers
        assert all(handlers[op] is fn for op, fn in T.CPU_HANDLERS.items())
        assert torch_cp._cp_options.enable_load_balance is True
        assert torch_cp._cp_options.rotate_method == torch_cp._RotateMethod.ALL_TO_ALL
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True) for _ in range(2))
        got = kernel(q, k, v)
        assert type(got) is torch.Tensor
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        g = torch.randn(got.shape, generator=gen)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    finally:
        T.disable()
    assert not set(T.CPU_HANDLERS) & set(DTensor._op_dispatcher._custom_op_handlers)
    assert DTensor._op_dispatcher._custom_op_handlers == before
