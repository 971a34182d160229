"""hpctrain.distributed.mesh: the meshes by name give every rank the same ranks in the same order as the
builder they replaced (a frozen copy below), built in one process on torch's fake process group, one
rank at a time; the degrees' checks name the keys and the fix (torch-free)."""
from __future__ import annotations

import pytest

from hpctrain.core.spec import Layout
from hpctrain.distributed.mesh import NAMES, ParallelDims, build_mesh

# (pp, dp_replicate, dp_shard, cp, tp, ep): every mesh tests/test_layouts.py runs, ep 4 (tests/test_moe.py),
# and HSDP beside cp, ep and both.
LAYOUTS = [(1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 2, 1), (1, 1, 1, 2, 1, 1), (1, 1, 1, 2, 2, 1), (1, 1, 1, 4, 1, 1),
           (1, 1, 1, 4, 2, 1), (1, 1, 2, 1, 1, 1), (1, 1, 2, 1, 1, 2), (1, 1, 2, 1, 2, 1), (1, 1, 2, 1, 2, 2),
           (1, 1, 2, 2, 1, 1), (1, 1, 2, 2, 1, 2), (1, 1, 2, 2, 2, 2), (1, 1, 2, 4, 1, 1), (1, 1, 4, 1, 1, 2),
           (1, 2, 2, 1, 1, 1), (2, 1, 1, 1, 1, 1), (2, 1, 1, 1, 2, 1), (2, 1, 1, 2, 1, 1), (2, 1, 1, 4, 1, 1),
           (2, 1, 2, 1, 1, 1), (2, 1, 2, 1, 1, 2), (2, 1, 2, 1, 2, 1), (1, 1, 4, 1, 1, 4),
           (1, 2, 2, 2, 1, 1), (1, 2, 4, 1, 1, 2), (1, 2, 2, 2, 1, 2), (1, 2, 2, 2, 2, 2)]


def layout(pp, dp_replicate, dp_shard, cp, tp, ep) -> Layout:
    return Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, cp=cp)


# ------------------------------------------------------------- the builder before the names (frozen)

def old_build_mesh(layout: Layout, device_type: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if layout.ep > 1:
        return old_expert_mesh(layout, device_type)
    dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    mesh = init_device_mesh(device_type, tuple(getattr(layout, d) for d in dims), mesh_dim_names=dims)
    if layout.cp == 1:
        dp = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        fsdp = mesh[("dp_replicate", "dp_shard")] if layout.dp_replicate > 1 else mesh["dp_shard"]
        return dict(world=mesh, dp=dp, fsdp=fsdp, ep=None, efsdp=None, data=dp, cp=None)
    data = mesh[("dp_replicate", "dp_shard")]._flatten("data")
    dp = mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp")
    shard = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    fsdp = mesh[("dp_replicate", "dp_shard_cp")] if layout.dp_replicate > 1 else shard
    return dict(world=mesh, dp=dp, fsdp=fsdp, ep=None, efsdp=None, data=data, cp=mesh["cp"])


def old_expert_mesh(layout: Layout, device_type: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.cp, layout.ep, layout.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "efsdp", "cp", "ep", "tp"))
    hsdp = layout.dp_replicate > 1
    dp = mesh[("dp_replicate", "efsdp", "cp", "ep")]._flatten("dp")
    if layout.cp == 1:
        dp_shard = mesh[("efsdp", "ep")]._flatten("dp_shard")
        fsdp = mesh[("dp_replicate", "dp_shard")] if hsdp else dp_shard
        efsdp = mesh[("dp_replicate", "efsdp")] if hsdp else mesh["efsdp"]
        return dict(world=mesh, dp=dp, fsdp=fsdp, ep=mesh["ep"], efsdp=efsdp, data=dp, cp=None)
    data = mesh[("dp_replicate", "efsdp", "ep")]._flatten("data")
    shard = mesh[("efsdp", "cp", "ep")]._flatten("dp_shard_cp")
    expert_shard = mesh[("efsdp", "cp")]._flatten("efsdp_cp")
    fsdp = mesh[("dp_replicate", "dp_shard_cp")] if hsdp else shard
    efsdp = mesh[("dp_replicate", "efsdp_cp")] if hsdp else expert_shard
    return dict(world=mesh, dp=dp, fsdp=fsdp, ep=mesh["ep"], efsdp=efsdp, data=data, cp=mesh["cp"])


def old_callers(layout: Layout, m: dict) -> dict:
    """What the callers sliced from the old root themselves (parallel/apply.py, train/loop.py,
    parallel/tensor.py's token group), where they did."""
    w, out = m["world"], {"pp": m["world"]["pp"], "tp": m["world"]["tp"]}
    if layout.cp > 1:
        out["cp_tp"] = w[("cp", "tp")]._flatten("cp_tp") if layout.tp > 1 else m["cp"]
    elif layout.tp > 1:
        out["cp_tp"] = w["tp"]
    if layout.ep > 1:
        out["ep_tp"] = w[("ep", "tp")] if layout.tp > 1 else m["ep"]
    return out


# --------------------------------------------------------------------------------------- the tests

def ranks(mesh):
    """A mesh as one rank sees it: its ranks (this rank's group of each dimension) and dimension names."""
    return None if mesh is None else (mesh.mesh.tolist(), mesh.mesh_dim_names)


@pytest.fixture
def fake_world():
    """Join torch's fake process group as rank `rank` of `world` ranks (no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


COMPAT = ("world", "dp", "fsdp", "ep", "efsdp", "data", "cp")  # the old builder's attributes


def by_name(meshes, attr: str):
    """The named mesh that took the old attribute's place (None where the old one was off)."""
    if attr == "world":
        return meshes.world
    on = meshes.enabled("ep" if attr == "efsdp" else attr) or attr in ("dp", "fsdp", "data")
    return meshes[attr] if on else None


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim")
@pytest.mark.parametrize("degrees", LAYOUTS, ids=lambda d: "x".join(map(str, d)))
def test_named_meshes_place_ranks_as_the_old_builder(fake_world, degrees):
    """Every rank's view of every mesh, the attributes of before and the names alike.
    Mutants (each tried): ep before cp in the fold's root; dp_replicate optional in dp (dp then the root's
    dp_shard, not flattened); a mesh of the same ranks as a name before it built again (data a second
    group beside dp); fsdp flattened instead of a grid; cp_tp's parts required (flattened at cp 1); a
    "?" part kept at degree 1; a flat group not sorted in the root's order."""
    lay = layout(*degrees)
    for rank in range(lay.world):
        fake_world(rank, lay.world)
        old = old_build_mesh(lay, "cpu")
        new = build_mesh(lay, "cpu")
        for attr in COMPAT:
            assert ranks(by_name(new, attr)) == ranks(old[attr]), (rank, attr)
        for name, mesh in old_callers(lay, old).items():
            assert ranks(new[name]) == ranks(mesh), (rank, name)
        assert (new["data"] is new["dp"]) == (old["data"] is old["dp"]), rank  # one group, not two alike
        # by name, efsdp is there without expert parallel too: the experts sharded as the dense weights are
        assert ranks(new["efsdp"]) == ranks(old["fsdp"] if old["efsdp"] is None else old["efsdp"]), rank


@pytest.mark.parametrize("degrees", [(1, 2, 2, 2, 1, 2), (1, 1, 1, 1, 2, 1), (1, 1, 1, 1, 1, 1)])
def test_every_name_is_planned_with_its_degree(degrees):
    """Torch-free: a layout has every name of the table (ep_tp only with expert parallel); a name's degree
    is its ranks; dims.enabled(name) is degree > 1. Mutants (tried): a "?" part kept at degree 1 (cp_tp
    over cp x tp of size 1 flattened); no size-1 mesh where every part is optional and of degree 1."""
    dims = ParallelDims(layout(*degrees))
    lay = dims.layout
    assert set(NAMES) - {"ep_tp"} <= set(dims.plan)
    assert ("ep_tp" in dims.plan) == (lay.ep > 1)
    want = {"dp": lay.dp * lay.cp, "data": lay.dp, "fsdp": lay.dp * lay.cp, "efsdp": lay.dp * lay.cp // lay.ep,
            "cp_tp": lay.cp * lay.tp, "ep": lay.ep, "tp": lay.tp}
    assert {k: dims.degree(k) for k in want} == want
    assert dims.enabled("cp") == (lay.cp > 1) and not dims.enabled("pp")
    if lay.cp == lay.tp == 1:
        assert dims.plan["cp_tp"] == (("cp",),)  # a mesh of size 1 still


def test_hsdp_with_expert_and_context_parallel_plans():
    """The dimensions each name flattens or keeps, where every optional part is in play.
    Mutant (tried): fsdp flattened instead of a grid (one dimension under HSDP)."""
    plan = ParallelDims(layout(1, 2, 2, 2, 1, 2)).plan
    assert plan["fsdp"] == (("dp_replicate",), ("efsdp", "cp", "ep"))
    assert plan["efsdp"] == (("dp_replicate",), ("efsdp", "cp"))
    assert plan["dp"] == (("dp_replicate", "efsdp", "cp", "ep"),)
    assert plan["data"] == (("dp_replicate", "efsdp", "ep"),)
    assert plan["dp_shard"] == (("efsdp", "ep"),)


@pytest.mark.parametrize("degrees,world,words", [
    ((1, 1, 2, 1, 1, 1), 4, ["dp_shard=2 x tp=1 = 2, but the process group has 4 ranks",
                             "Fix: set parallel.dp_shard=-1 to use all ranks, or make the product equal 4"]),
    ((1, 1, 0, 1, 2, 1), None, ["parallel.dp_shard=0", "at least 1", "Fix:"]),
    ((1, 1, 4, 1, 1, 3), None, ["parallel.ep=3 does not divide parallel.dp_shard=4", "Fix: choose parallel.ep "
                                "among 1, 2, 4"]),
])
def test_degree_problems_name_the_keys_and_the_fix(degrees, world, words):
    """The login node's wording (hpctrain.core.rules), where the rule is the rule book's. Mutants (tried): the
    world size not compared; a degree of 0 let through; ep's divisibility unchecked."""
    with pytest.raises(ValueError) as e:
        ParallelDims(layout(*degrees), world)
    for w in words:
        assert w in str(e.value)


def test_megatron_folding_is_expressible_but_refused():
    """ep over dp_shard x tp: its divisibility is checked over the product (ep 4 divides 2 x 2, not 2
    alone), and it is refused as not built yet; with ep 1 nothing is folded. Mutants: the fold's product
    taken over dp_shard alone; the unbuilt fold accepted (both tried)."""
    lay = layout(1, 1, 2, 1, 2, 4)
    with pytest.raises(ValueError) as e:
        ParallelDims(lay, ep_over=("dp_shard", "tp"))
    assert "does not divide" not in str(e.value)
    assert "expert parallel over dp_shard x tp (Megatron's folding" in str(e.value)
    assert "is not built yet. Fix: parallel.ep dividing parallel.dp_shard (ep ranks taken" in str(e.value)
    with pytest.raises(ValueError, match="parallel.ep=4 does not divide parallel.dp_shard=2"):
        ParallelDims(lay)
    with pytest.raises(ValueError, match="cannot fold over tp"):
        ParallelDims(lay, ep_over=("tp",))
    assert ParallelDims(layout(1, 1, 2, 1, 2, 1), ep_over=("dp_shard", "tp")).root[2] == "dp_shard"
