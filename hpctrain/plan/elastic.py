"""The same run on fewer nodes, after some were lost or left out as unhealthy.

Tensor and pipeline parallel stay as they are (they decide what one rank holds); data parallel
shrinks to what the remaining ranks allow. The global batch stays the same, so the loss curve does:
each data-parallel rank runs more micro-batches (gradient accumulation), and the checkpoint, data
position included, reshards on load. The planner must still find the layout within memory; the
node count goes down until one fits or `launcher.min_nodes` is reached.
"""
from __future__ import annotations

from typing import Optional

from hpctrain.checks.config_checks import problems
from hpctrain.core.compose import ConfigError
from hpctrain.core.schema import Config
from hpctrain.core.spec import ranks_per_node, updated
from hpctrain.plan.login import plan_and_check


def micro_batch_for(global_batch: int, dp: int, wanted: int, pp: int) -> Optional[int]:
    """The largest micro-batch <= `wanted` that splits one data-parallel rank's share of the global
    batch into whole micro-batches (at least `pp` of them with pipelining); None if the global batch
    does not split over `dp` ranks."""
    if global_batch % dp:
        return None
    share = global_batch // dp
    for m in range(min(wanted, share), 0, -1):
        if share % m == 0 and share // m >= pp:
            return m
    return None


def shrink(cfg: Config, nodes: int) -> tuple[Config, str]:
    """(config for `nodes` nodes, what changed); raises ConfigError when no layout fits on that many."""
    p, t = cfg.parallel, cfg.train
    world = nodes * ranks_per_node(cfg.cluster)
    fixed = p.tp * p.pp
    if world % fixed:
        raise ConfigError(f"{world} ranks on {nodes} node(s) do not split into tp={p.tp} x pp={p.pp}")
    dp = world // fixed
    replicate = p.dp_replicate if dp % p.dp_replicate == 0 else 1
    micro = micro_batch_for(t.global_batch, dp, t.micro_batch, p.pp)
    if micro is None:
        raise ConfigError(f"train.global_batch={t.global_batch} does not split over {dp} data-parallel ranks "
                          f"in micro-batches of at most {t.micro_batch}")
    new = updated(cfg, {"cluster.nodes": nodes, "parallel.dp_replicate": replicate, "parallel.dp_shard": -1,
                        "train.micro_batch": micro})
    found = problems(new)
    if found:
        raise ConfigError("; ".join(found))
    plan_and_check(new, for_launch=True)  # memory: raises ConfigError when it does not fit
    old_dp = cfg.cluster.nodes * ranks_per_node(cfg.cluster) // fixed
    change = (f"{cfg.cluster.nodes} -> {nodes} node(s): data parallel {old_dp} -> {dp}"
              + (f", train.micro_batch {t.micro_batch} -> {micro}" if micro != t.micro_batch else "")
              + f", global batch {t.global_batch} kept")
    return new, change


def shrink_to_fit(cfg: Config, nodes: int, min_nodes: int) -> tuple[Config, int, str]:
    """The most nodes (<= `nodes`, >= `min_nodes`) on which the run still has a layout."""
    why = []
    for n in range(nodes, max(1, min_nodes) - 1, -1):
        try:
            new, change = shrink(cfg, n)
            return new, n, change
        except ConfigError as e:
            why.append(f"{n} node(s): {e}")
    raise ConfigError("no layout of this run fits on the nodes left:\n  " + "\n  ".join(why))
