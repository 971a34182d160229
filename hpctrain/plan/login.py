"""The planner on the login node: price the requested layout, pick one for `parallel=auto`, refuse a
layout that cannot fit with the numbers and the nearest layouts that would, write plan.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from hpctrain.checks.config_checks import check, compose_checked
from hpctrain.core.compose import ConfigError
from hpctrain.core.schema import Config
from hpctrain.core.spec import overrides_of, updated, world_size
from hpctrain.plan.memory import job_of
from hpctrain.plan.search import Space, choice, nearest, search
from hpctrain.plan.verdict import describe, explain, plan, plan_dict, summary


def names_launcher(overrides: Sequence[str]) -> bool:
    """The command line picks the launcher or its size (launcher=..., launcher.nproc=...)."""
    keys = (o.lstrip("+~").split("=", 1)[0] for o in overrides)
    return any(k == "launcher" or k.startswith("launcher.") for k in keys)


def world_rule(cfg: Config, overrides: Sequence[str], planner: bool) -> tuple[list[str], str]:
    """Who sizes the world, for the planner and the dry run alike (one rule): (overrides to add, a line
    to print, "" when there is nothing to say).

    launcher=local starts launcher.nproc ranks on this machine (hpctrain.core.spec.world_size); Slurm's
    launchers start cluster.nodes x cluster.gpus_per_node. The planner, asked about a cluster with GPUs
    while the launcher is left at its local default, plans that cluster, as launcher=sbatch would run it.
    A run or a dry run keeps its launcher (it prices what it would start) and says so where the GPU
    cluster named would be a different world."""
    c = cfg.cluster
    if cfg.launcher.name != "local" or not c.gpus_per_node:
        return [], ""
    gpus, nproc = c.nodes * c.gpus_per_node, cfg.launcher.nproc
    cluster = f"cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node}"
    if planner and not names_launcher(overrides):
        return ["launcher=sbatch"], (f"world: {gpus} GPUs, {cluster}, as launcher=sbatch runs them (the launcher "
                                     "was left at local; launcher=local launcher.nproc=N plans N ranks on one machine)")
    if gpus == nproc:
        return [], ""
    return [], (f"world: {nproc} ranks, launcher.nproc={nproc} of launcher=local on this machine, not the "
                f"{gpus} GPUs of {cluster}. Fix: launcher=sbatch (or slurm) for the cluster, or launcher.nproc=N")


def _space(for_launch: bool):
    # A launch searches layouts without offload; a dry run may suggest it.
    return Space(offloads=("none",)) if for_launch else Space()


def choose_layout(cfg: Config, for_launch: bool) -> tuple[Config, list[str]]:
    """parallel=auto: (the config with the fastest layout that fits, the overrides that select it)."""
    res = search(job_of(cfg), _space(for_launch), world=world_size(cfg))
    if not res.ranked:
        raise ConfigError("parallel=auto: no layout of this model fits this cluster:\n" + explain(res, top=0))
    changes = {**choice(res.ranked[0].job), "parallel.auto": False}
    return updated(cfg, changes), overrides_of(changes)


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
    note = world_rule(cfg, overrides, planner=False)[1]
    if note:
        print(note, flush=True)
    if cfg.parallel.auto and not refused:
        cfg, chosen = choose_layout(cfg, for_launch=not cfg.dry_run)
        print("parallel=auto chose: " + " ".join(chosen))
    check(cfg, refused)
    if show is not None:  # what is about to be priced, shown even when the plan then refuses it
        show(cfg)
    return cfg, plan_and_check(cfg, for_launch=not cfg.dry_run)
