"""The parallel dimensions by name (torchtitan's ParallelDims the model): one root DeviceMesh, TP
innermost so it stays inside a node, and every mesh the engine asks for derived from it by one table.

`ParallelDims` validates a `Layout`'s degrees and plans each name's mesh (no process group); its `build`
makes the root mesh and the named meshes on every rank, all at once (a flattened mesh is a new
process group, which every rank must create in the same order). `Meshes` hands them out by name:
`meshes["fsdp"]`, `meshes.group("dp")`, `meshes.enabled("cp")`.

With expert parallel, dp_shard is itself two dimensions, (efsdp, ep): the ep ranks of a group split
each MoE layer's experts and the efsdp groups shard each expert's weights, as FSDP2 wants (the
experts' DTensor mesh and the mesh FSDP shards them over must come from one root mesh). dp_shard is
then the flattened pair, so the dense parameters, data order and everything else see the same
ranks in the same order as without expert parallel. With context parallel the cp ranks join the
experts' sharding as they join the dense parameters' (efsdp x cp): they hold the same experts and
read the same samples, and sit ep x tp ranks apart (tp without expert parallel).

A new dimension is its degree in `Layout` and its place in `ROOT`, then the rows of `NAMES` that
include it. A new derived mesh is one row of `NAMES`; a new way of folding expert parallel is one
`Fold` in `EP_FOLDS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hpctrain.core import rules
from hpctrain.core.spec import Layout

# The Layout's degrees as the root mesh's dimensions, outermost first: TP innermost, inside a node.
ROOT = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Derived:
    """A named mesh: its parts (root dimensions, or names defined before it) either flattened into one
    dimension or kept as dimensions of their own (a 2-D mesh, e.g. HSDP's (replicate, shard)). A part
    ending in "?" is left out where its degree is 1, unless every part is (a mesh of size 1 remains)."""
    parts: tuple
    flat: bool


def flat(*parts: str) -> Derived:
    return Derived(parts, True)


def grid(*parts: str) -> Derived:
    return Derived(parts, False)


@dataclass(frozen=True)
class Fold:
    """Where expert parallel takes its ranks from: `over`, the Layout dimensions ep divides; `place`, the
    root dimensions at a `ROOT` dimension's place (None: expressible, not built yet); the names the fold
    defines before `NAMES`; and the degrees of root dimensions that are not a Layout field."""
    over: tuple
    what: str = ""
    place: Optional[dict] = None
    names: dict = field(default_factory=dict)
    degrees: Callable[[Layout], dict] = lambda layout: {}


# Without expert parallel the experts are sharded as the dense weights are: efsdp is dp_shard.
NO_FOLD = Fold(over=(), place={}, names={"efsdp": flat("dp_shard")})
# ep over dp_shard: cp before ep, since FSDP2 lays the experts' weights out on (efsdp x cp, ep) and DTensor
# slices a mesh only in the root's dimension order.
EP_FOLDS = {f.over: f for f in (
    Fold(over=("dp_shard",), what="ep ranks taken from dp_shard",
         place={"dp_shard": ("efsdp",), "cp": ("cp", "ep")}, names={"dp_shard": flat("efsdp", "ep")},
         degrees=lambda layout: {"efsdp": layout.dp_shard // layout.ep}),
    # Megatron-Core's MoE parallel folding (ep x etp x edp = tp x dp): ep may exceed dp_shard.
    Fold(over=("dp_shard", "tp"), what="Megatron's folding"),
)}
DEFAULT_EP_OVER = ("dp_shard",)

# Every mesh handed out by name besides the root's dimensions, built in this order (after the fold's).
# A name may be defined again: efsdp is the root's dimension (or dp_shard) in efsdp_cp, then the mesh FSDP
# shards the experts' weights over.
NAMES = {
    # FSDP's shard group: the cp ranks hold the same parameters and read the same samples, so they join it
    "dp_shard_cp": flat("dp_shard", "cp?"),
    "efsdp_cp": flat("efsdp", "cp?"),
    "fsdp": grid("dp_replicate?", "dp_shard_cp"),  # what FSDP shards dense weights over (HSDP: 2-D)
    "efsdp": grid("dp_replicate?", "efsdp_cp"),  # ... each expert's weights over
    # every rank of a different data or cp rank: the loss, the gradients, DDP
    "dp": flat("dp_replicate", "dp_shard", "cp?"),
    # the ranks that read different samples: dp without the cp ranks, who split each sample's sequence
    # (torchtitan's way: cp ranks are data-parallel ranks for the gradients and the parameter sharding)
    "data": flat("dp_replicate", "dp_shard"),
    # the ranks that split each micro-batch's tokens, over which MoE layers count the routed slots
    "cp_tp": flat("cp?", "tp?"),
    "ep_tp": grid("ep", "tp?"),  # the experts' mesh under tensor parallel: split over ep, replicated over tp
}


def problems(layout: Layout, world_size: Optional[int] = None, ep_over: tuple = DEFAULT_EP_OVER) -> list:
    """Why these degrees make no mesh, in words naming the parallel.* keys and the fix (empty: they do).
    The product and the fold's divisibility are the rule book's (hpctrain.core.rules), as the login node
    words them; what is the mesh's own is a degree below 1 and a fold not built."""
    low = [f"parallel.{d}={getattr(layout, d)}" for d in (*ROOT, "ep") if getattr(layout, d) < 1]
    if low:  # the products below mean nothing then
        return [f"{', '.join(low)}: every degree is a number of ranks, at least 1 (dp_shard=-1, the rest, "
                "comes out 0 where the other degrees do not divide the world size). Fix: degrees whose product "
                "is the world size"]
    out = []
    if world_size is not None:
        out += [p.message for p in rules.world_problems(layout, world_size, "the process group has")]
    if layout.ep == 1:
        return out
    fold = EP_FOLDS.get(tuple(ep_over))
    if fold is None:
        return out + [f"expert parallel cannot fold over {' x '.join(ep_over)}: the folds are "
                      f"{', '.join(' x '.join(f) for f in EP_FOLDS)}"]
    out += [p.message for p in rules.ep_fold_problems(layout, fold.over)]
    if fold.place is None:
        built = EP_FOLDS[DEFAULT_EP_OVER]
        out.append(f"expert parallel over {' x '.join(fold.over)} ({fold.what}) is not built yet. Fix: "
                   f"parallel.ep dividing {' x '.join(f'parallel.{d}' for d in built.over)} ({built.what})")
    return out


@dataclass(frozen=True)
class ParallelDims:
    """A Layout's degrees, validated (ValueError naming the keys and the fix), and each name's mesh
    planned as groups of root dimensions: one group per mesh dimension, flattened where it holds
    several. No process group until `build`."""
    layout: Layout
    world_size: Optional[int] = None  # the ranks of the run, where known: the degrees' product must be it
    ep_over: tuple = DEFAULT_EP_OVER  # which Layout dimensions expert parallel takes its ranks from

    def __post_init__(self):
        found = problems(self.layout, self.world_size, self.ep_over)
        if found:
            raise ValueError("\n".join(found))

    @property
    def fold(self) -> Fold:
        return EP_FOLDS[tuple(self.ep_over)] if self.layout.ep > 1 else NO_FOLD

    @cached_property
    def root(self) -> tuple:
        """The root mesh's dimensions, outermost first."""
        return tuple(d for r in ROOT for d in self.fold.place.get(r, (r,)))

    @cached_property
    def root_degrees(self) -> dict:
        own = self.fold.degrees(self.layout)
        return {d: own[d] if d in own else getattr(self.layout, d) for d in self.root}

    @cached_property
    def plan(self) -> dict:
        """Each name this layout has -> its mesh's dimensions, each a tuple of root dimensions in the root's
        order. A name missing a required part (ep without expert parallel) is absent."""
        out = {d: ((d,),) for d in self.root}
        for name, derived in [*self.fold.names.items(), *NAMES.items()]:
            groups = self._groups(derived, out)
            out.pop(name, None)  # defined again: built after its parts, so listed after them
            if groups is not None:
                out[name] = groups
        return out

    def _groups(self, derived: Derived, known: dict) -> Optional[tuple]:
        """A row's mesh dimensions, given the names planned before it (None: a required part is missing)."""
        parts = [p.rstrip("?") for p in derived.parts]
        optional = {p.rstrip("?") for p in derived.parts if p.endswith("?")}
        if any(p not in known for p in parts if p not in optional):
            return None
        present = [p for p in parts if p in known]
        # every part optional and of degree 1: the first remains, a mesh of size 1
        kept = [p for p in present if p not in optional or self._size(known[p]) > 1] or present[:1]
        order = {d: i for i, d in enumerate(self.root)}
        if derived.flat:
            dims = {d for p in kept for g in known[p] for d in g}
            return (tuple(sorted(dims, key=order.get)),)
        assert all(len(known[p]) == 1 for p in kept), f"{derived}: a grid's parts are one dimension each"
        return tuple(sorted((known[p][0] for p in kept), key=lambda g: order[g[0]]))

    def _size(self, groups: tuple) -> int:
        return prod(self.root_degrees[d] for g in groups for d in g)

    def degree(self, name: str) -> int:
        """The ranks of a name's mesh: 1 for a name this layout lacks (ep without expert parallel)."""
        return self._size(self.plan[name]) if name in self.plan else 1

    def enabled(self, name: str) -> bool:
        return self.degree(name) > 1

    def build(self, device_type: str) -> "Meshes":
        """The root mesh and every named one but those built on request (each rank must call this, and in
        the same order)."""
        root = init_device_mesh(device_type, tuple(self.root_degrees.values()), mesh_dim_names=self.root)
        meshes = Meshes(self, root)
        for name in self.plan:
            if name not in ON_REQUEST or meshes.built(self.plan[name]):
                meshes[name]
        return meshes


# Names built when first asked for (the MoE dispatcher asks for the token group on every rank alike), not
# with the others: DTensor reduces a tensor over a (dp_shard x cp, tp) mesh in one all-reduce over a
# flattened (cp, tp) group where one exists, two otherwise, and a dense model's gradient norm would move
# by an ulp with the group's mere existence.
ON_REQUEST = frozenset({"cp_tp"})


class Meshes:
    """The meshes by name (`meshes["fsdp"]`; every name of `ParallelDims.plan`, a mesh of size 1 where the
    degree is 1; `world` is the root)."""

    def __init__(self, dims: ParallelDims, root):
        self.dims, self.world = dims, root
        self._named: dict = {}
        self._by_groups: dict = {}  # groups of root dimensions -> their mesh: one mesh for the same ranks
        self._dim_name = {(d,): d for d in dims.root}  # a group of root dimensions -> its mesh dimension's name

    def built(self, groups: tuple) -> bool:
        return groups in self._by_groups

    def __getitem__(self, name: str):
        if name not in self.dims.plan:
            raise KeyError(f"no {name!r} mesh in this layout ({self.dims.layout.describe()}): "
                           f"it has {', '.join(self.dims.plan)}")
        if name not in self._named:
            groups = self.dims.plan[name]
            if groups not in self._by_groups:
                if len(groups) == 1 and groups[0] not in self._dim_name:
                    self._by_groups[groups] = self.world[groups[0]]._flatten(name)
                    self._dim_name[groups[0]] = name
                else:
                    # HSDP's 2-D meshes are sliced from the root by the flattened names (torch warns that
                    # this will change)
                    names = tuple(self._dim_name[g] for g in groups)
                    self._by_groups[groups] = self.world[names[0] if len(names) == 1 else names]
            self._named[name] = self._by_groups[groups]
        return self._named[name]

    def __contains__(self, name: str) -> bool:
        return name in self.dims.plan

    def group(self, name: str):
        """The process group of a one-dimensional mesh."""
        return self[name].get_group()

    def enabled(self, name: str) -> bool:
        return self.dims.enabled(name)


def build_mesh(layout: Layout, device_type: str) -> Meshes:
    """Every named mesh of `layout` on this rank's process group (whose size the degrees must multiply to)."""
    world = dist.get_world_size() if dist.is_initialized() else None
    return ParallelDims(layout, world).build(device_type)
