"""The planner on the login node: price the requested layout, pick one for `parallel=auto`, refuse a
layout that cannot fit with the numbers and the nearest layouts that would, write plan.json."""
from __future__ import annotations

import json
from pathlib import Path

from hpctrain.checks.config_checks import check, compose_checked
from hpctrain.core.compose import ConfigError, compose
from hpctrain.core.schema import Config
from hpctrain.core.spec import world_size
from hpctrain.plan.memory import job_of
from hpctrain.plan.search import Space, nearest, overrides, search
from hpctrain.plan.verdict import describe, explain, plan, plan_dict, summary


def _space(for_launch: bool):
    # A launch searches layouts without offload; a dry run may suggest it.
    return Space(offloads=("none",)) if for_launch else Space()


def choose_layout(cfg: Config, for_launch: bool) -> list[str]:
    """Overrides of the fastest layout that fits (parallel=auto)."""
    res = search(job_of(cfg), _space(for_launch), world=world_size(cfg))
    if not res.ranked:
        raise ConfigError("parallel=auto: no layout of this model fits this cluster:\n" + explain(res, top=0))
    return overrides(res.ranked[0].job)


def plan_and_check(cfg: Config, for_launch: bool):
    """The requested layout's plan; raises ConfigError when it cannot fit."""
    job = job_of(cfg)
    p = plan(job)
    if p.fits:
        return p
    res = search(job, _space(for_launch), world=world_size(cfg))
    near = nearest(job, res.ranked) if res.ranked else []
    alt = ("\nlayouts that would fit, nearest first (or use parallel=auto):\n"
           + "\n".join(f"  {describe(c.job)}: {c.memory.device_total / 2**30:.1f} GiB, "
                       f"{c.time.tokens_per_s:,.0f} tokens/s" for c in near)) if near else \
        "\nno layout of this model fits this cluster: add nodes (cluster.nodes) or GPUs with more memory"
    raise ConfigError("the plan does not fit:\n" + summary(p) + alt)


def write_plan(p, run_dir: str | Path) -> Path:
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan_dict(p), indent=1, default=float))
    return path


def plan_one(overrides: list[str], show=None):
    """(config, plan) of one run: composed, checked, its layout chosen under parallel=auto, priced;
    ConfigError names every problem."""
    cfg, refused = compose_checked(overrides)
    if cfg.parallel.auto and not refused:
        chosen = choose_layout(cfg, for_launch=not cfg.dry_run)
        cfg = compose([*overrides, *chosen, "parallel.auto=false"])
        print("parallel=auto chose: " + " ".join(chosen))
    check(cfg, refused)
    if show is not None:  # what is about to be priced, shown even when the plan then refuses it
        show(cfg)
    return cfg, plan_and_check(cfg, for_launch=not cfg.dry_run)
