"""The plan of a generation (hpctrain.distributed.generation): the file the supervisor writes before
generation g starts, <run_dir>/attempts/<g>/plan.json, and what a rank reads from it. Torch-free: the
supervisor writes it, the ranks read it.

    {"generation": g, "world": W, "master_addr": "n1", "master_port": p,
     "rank_nodes": {"0": "n1", ...}, "agents": {"n1": "n1:port", ...}, "ring": ["n1", "n2"],
     "lost": [...], "previous_rank_nodes": {...} | null, "previous_ring": [...] | null, "survivors": [0]}
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from hpctrain.core.rundir import attempt_dir

PLAN = "plan.json"


def read_plan(run_dir: Path, generation: int) -> Optional[dict]:
    path = attempt_dir(run_dir, generation) / PLAN
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return plan if isinstance(plan, dict) and plan.get("generation") == generation else None


def rank_env(plan: dict, rank: int) -> dict:
    """The variables hpctrain.distributed.bootstrap.detect reads, for `rank` in this generation."""
    nodes = plan["rank_nodes"]
    mine = nodes[str(rank)]
    here = sorted(int(r) for r, n in nodes.items() if n == mine)
    return {"RANK": str(rank), "WORLD_SIZE": str(plan["world"]), "LOCAL_RANK": str(here.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(here)), "MASTER_ADDR": str(plan["master_addr"]),
            "MASTER_PORT": str(plan["master_port"]), "HPCTRAIN_ATTEMPT": str(plan["generation"]),
            "HPCTRAIN_LAUNCHER": "agent"}


def wait_next(run_dir: Path, generation: int, rank: int, timeout_s: float, poll_s: float = 0.05) -> Optional[int]:
    """The next generation whose plan keeps this rank alive, or None: a plan without it (the
    supervisor replaces every rank, or this one), or none within timeout_s."""
    deadline = time.monotonic() + timeout_s
    root = Path(run_dir) / "attempts"
    while time.monotonic() < deadline:
        later = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and int(p.name) > generation) \
            if root.is_dir() else []
        for g in later:
            plan = read_plan(run_dir, g)
            if plan is None:
                continue  # being written
            return g if rank in plan.get("survivors", []) else None
        time.sleep(poll_s)
    return None
