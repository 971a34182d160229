"""The parallel layout a config asks for, as plain numbers (no torch): shared by the login-node
checks, the planner and the mesh built on every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.config import world_size


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x tp {self.tp} = {self.world} ranks")


def layout_of(cfg: Any, world: int | None = None) -> Layout:
    """Fill in dp_shard=-1 ("the rest") from the world size. Does not validate: see check.py."""
    p = cfg.parallel
    world = world_size(cfg) if world is None else world
    dp_shard = p.dp_shard
    if dp_shard == -1:
        rest = p.pp * p.dp_replicate * p.tp
        dp_shard = world // rest if rest > 0 and world % rest == 0 else 0
    return Layout(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp)


def params_on_host(offload: str, zero: int, tp: int) -> bool:
    """Whether optimizer offload also moves the sharded parameters and gradients to host memory:
    under FSDP2 (ZeRO 2/3) without tensor parallel, FSDP2's CPU offload streams them (see
    hpctrain.parallel.data.apply_fsdp). Otherwise the parameters stay on the device and the host
    optimizer stages their shards itself. The engine and the planner both ask this."""
    return offload != "none" and zero >= 2 and tp == 1
