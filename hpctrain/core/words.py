"""How numbers and devices are said to a person: one place, so the CLI, the planner and the reports
agree (a 0.5 M model is not "0.000 B", a CPU rank is not a GPU, 1 micro-batch is not "1 micro-batches")."""
from __future__ import annotations


def params(n: float) -> str:
    """A parameter count as model cards give it: 0.459 M, 8.03 B, 405 B."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def device(gpus_per_node: int) -> str:
    """What one rank runs on: "GPU", or "rank" on a cluster without GPUs (memory per rank, not per GPU)."""
    return "GPU" if gpus_per_node else "rank"
