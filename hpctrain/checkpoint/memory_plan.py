"""Which memory snapshot a restart loads, or why it loads the disk checkpoint instead. Pure and torch-free:
every rank computes it from the same gathered inventories and so reaches the same answer.

    choose(inventories, world, disk_newest, plan) ->
        {"kind": "memory", "step": S, "source": {"0": "own", "1": "n1"}}   or
        {"kind": "disk", "step": disk_newest, "why": "<one line a person reads>"}

`inventories`: {node: [[rank, step, "own"|"peer"], ...]} of the live nodes (the gather reaches only live
ranks, and a node's files died with it). S is the newest step of which every rank 0..world-1 has a copy
on some live node; a rank's own node (plan["rank_nodes"]) is preferred, else the first node by name.
Disk is chosen when it is newer than S (at the same step memory wins: the same state, read from RAM),
when no S exists, and when the snapshots were made by another world (they hold raw local shards, which
no other layout can load; a change of layout at the same world is found by the load, from the header).
"""
from __future__ import annotations

from typing import Optional


def _copies(inventories: dict) -> dict[int, dict[int, list[str]]]:
    """{rank: {step: [nodes holding a copy, sorted]}}."""
    out: dict[int, dict[int, set]] = {}
    for node, files in inventories.items():
        for rank, step, _where in files:
            out.setdefault(int(rank), {}).setdefault(int(step), set()).add(str(node))
    return {r: {s: sorted(nodes) for s, nodes in steps.items()} for r, steps in out.items()}


def _held_by(plan: Optional[dict], rank: int) -> Optional[tuple[str, Optional[str]]]:
    """(node the rank ran on before, the node its replicas went to) by the previous generation's plan."""
    prev = (plan or {}).get("previous_rank_nodes") or {}
    node = prev.get(str(rank))
    if node is None:
        return None
    ring = (plan or {}).get("previous_ring") or []
    partner = ring[(ring.index(node) + 1) % len(ring)] if node in ring and len(ring) > 1 else None
    return node, partner


def _gone(rank: int, plan: Optional[dict], copies: dict) -> str:
    """Why no live node holds a usable snapshot of `rank`: where they were, by the plans."""
    lost = set((plan or {}).get("lost") or [])
    held = _held_by(plan, rank)
    if held is not None:
        own, replica = held
        if replica is None:
            where = f"on {own} (own; no replica: a single node)"
            both = "lost" if own in lost else "not found"
        else:
            where = f"on {own} (own) and {replica} (replica)"
            both = ("both lost" if own in lost and replica in lost else
                    "lost" if own in lost or replica in lost else "not found on the live nodes")
            if own in lost and replica not in lost:
                both = f"{own} lost, and {replica} holds no copy of it"
            elif replica in lost and own not in lost:
                both = f"{replica} lost, and {own} holds no copy of it"
        return f"rank {rank}'s snapshots were {where}, {both}"
    have = copies.get(rank)
    if not have:
        return f"no live node holds a snapshot of rank {rank}" + (f" (lost: {', '.join(sorted(lost))})" if lost else "")
    return f"rank {rank}'s snapshots (steps {', '.join(map(str, sorted(have)))}) are of no step every rank has"


def _disk(disk_newest: Optional[int], why: str) -> dict:
    then = (f"resuming from the disk checkpoint of step {disk_newest}" if disk_newest is not None
            else "no disk checkpoint: starting from the beginning")
    return {"kind": "disk", "step": disk_newest, "why": f"{why}: {then}"}


def choose(inventories: dict, world: int, disk_newest: Optional[int], plan: Optional[dict]) -> dict:
    copies = _copies(inventories)
    prev = (plan or {}).get("previous_rank_nodes")
    if isinstance(prev, dict) and prev and len(prev) != world:
        why = f"memory snapshots hold the shards of {len(prev)} ranks; the run continues on {world}"
        # Said too where the lost nodes took every copy of some rank's snapshot: a spare would not have helped.
        gone = next((r for r in range(len(prev)) if not copies.get(r)), None)
        return _disk(disk_newest, why + (f" ({_gone(gone, plan, copies)})" if gone is not None else ""))
    if not copies:
        return _disk(disk_newest, "no memory snapshots on the live nodes")
    complete = [s for s in set().union(*(set(v) for v in copies.values()))
                if all(s in copies.get(r, {}) for r in range(world))]
    if not complete:
        missing = next((r for r in range(world) if not copies.get(r)), None)
        if missing is None:  # every rank has some, of different steps: name the one lacking the newest
            newest = max(s for v in copies.values() for s in v)
            missing = next(r for r in range(world) if newest not in copies[r])
        return _disk(disk_newest, _gone(missing, plan, copies))
    step = max(complete)
    bigger = sorted(r for r in copies if r >= world and step in copies[r])
    if bigger:  # a snapshot of that step by a rank the world no longer has: it was another layout
        return _disk(disk_newest, f"memory snapshots of step {step} hold the shards of {bigger[-1] + 1} ranks; "
                                  f"the run continues on {world}")
    if disk_newest is not None and disk_newest > step:
        return _disk(disk_newest, f"the disk checkpoint of step {disk_newest} is newer than the newest memory "
                                  f"snapshot every rank has (step {step})")
    rank_nodes = (plan or {}).get("rank_nodes") or {}
    source = {}
    for r in range(world):
        nodes = copies[r][step]
        mine = rank_nodes.get(str(r))
        source[str(r)] = "own" if mine in nodes else nodes[0]
    return {"kind": "memory", "step": step, "source": source}


def describe(choice: dict) -> str:
    """The line a person reads: "restored step 120 from memory: rank 1 from the replica on n1"."""
    if choice["kind"] != "memory":
        return f"restored from disk (step {choice.get('step')}): {choice.get('why')}"
    far = [f"rank {r} from the replica on {n}" for r, n in sorted(choice["source"].items(), key=lambda kv: int(kv[0]))
           if n != "own"]
    return f"restored step {choice['step']} from memory: " + ("; ".join(far) if far else "every rank from its own node")
