"""The whole run's time, said before it starts: start-up + steps x step time + checkpoint saves, against
the Slurm time limit of the job (or of its chain). Pure arithmetic over a config and its plan."""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.checks.cluster_checks import MIN_WORK_S, SLURM_LAUNCHERS, fmt, parse_time
from hpctrain.core.schema import Config

SAVED = ("params", "master", "moments")  # what a checkpoint holds of a rank's memory (plan/memory.py kinds)
GB = 1e9


@dataclass(frozen=True)
class Duration:
    start_s: float  # imports, rendezvous, health check: once per job
    steps: int
    step_s: float
    saves: int
    save_s: float  # what one save blocks training for

    @property
    def total_s(self) -> float:
        return self.start_s + self.steps * self.step_s + self.saves * self.save_s


def saves_of(steps: int, every: int, final: bool = True) -> int:
    """Saves in a run: every `every` steps, and the last step's (hpctrain.checkpoint.manager.finish when
    saving is on; checkpoint.final, the default, whatever `every` says: hpctrain.train.loop._save_end)."""
    if every <= 0:
        return int(final and steps > 0)
    return steps // every + (steps % every != 0)


def duration(cfg: Config, plan) -> Duration:
    m, c = plan.memory, cfg.cluster
    per_rank = sum(m.device.get(k, 0) + m.host_per_rank.get(k, 0) for k in SAVED)
    if cfg.checkpoint.async_save:  # training waits only for the copy into host memory
        save_s = per_rank / (c.pcie_gbps * GB)
    else:
        save_s = per_rank * m.ranks_per_node / (c.checkpoint_gbps * GB)
    return Duration(MIN_WORK_S, cfg.train.steps, plan.time.step_time_s,
                    saves_of(cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.final), save_s)


def hms(seconds: float) -> str:
    return fmt(round(seconds))


def describe(d: Duration) -> str:
    saves = f" + {d.saves} save{'' if d.saves == 1 else 's'} x {d.save_s:.3g} s" if d.saves else ""
    return (f"whole run: {hms(d.total_s)} = start-up {d.start_s:.0f} s + {d.steps} steps x {d.step_s:.3g} s"
            f"{saves}")


def time_limit_problem(cfg: Config, d: Duration) -> str | None:
    """A warning with the fixes when the run will not finish within its Slurm time (x launcher.chain)."""
    if cfg.launcher.name not in SLURM_LAUNCHERS:
        return None
    try:
        limit = parse_time(cfg.cluster.time)
    except ValueError:
        return None  # cluster_checks refuses it with its own message
    if not limit:
        return None
    links = max(1, cfg.launcher.chain)
    # Each job loses its start-up and the signal lead (the save before the limit) to the run.
    usable = links * (limit - cfg.cluster.signal_lead_s) - (links - 1) * d.start_s
    if d.total_s <= usable:
        return None
    need = d.total_s + cfg.cluster.signal_lead_s
    per_job = limit - cfg.cluster.signal_lead_s - d.start_s
    every = cfg.checkpoint.every
    # The steps that fit, once the last step's save (checkpoint.final, or saving on) is kept room for.
    last_save = d.save_s if (every > 0 or cfg.checkpoint.final) else 0.0
    fits = max(0, int((links * per_job - last_save) / (d.step_s + (d.save_s / every if every > 0 else 0))))
    chains = -(-(d.total_s - d.start_s) // per_job) if per_job > 0 else None
    fixes = [f"cluster.time={hms(need * 1.1)} (the run and its last save, with 10% to spare)",
             f"train.steps={fits} (what fits)"]
    if chains:
        fixes.append(f"launcher.chain={int(chains)} (jobs one after another, each saving before its limit and "
                     "the next resuming from that save)")
    within = f"cluster.time={cfg.cluster.time}" + (f" x launcher.chain={links}" if links > 1 else "")
    return (f"the whole run needs about {hms(d.total_s)}, more than {within} allows: {hms(usable)}, "
            f"once each job keeps cluster.signal_lead_s={cfg.cluster.signal_lead_s} s for its save before the limit. It "
            f"would stop before train.steps={cfg.train.steps}. Fix: " + ", or ".join(fixes))
