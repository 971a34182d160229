"""The whole run's time, said before it starts: start-up + steps x step time + checkpoint saves, against
the Slurm time limit of the job (or of its chain). Pure arithmetic over a config and its plan."""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.checks.cluster_checks import MIN_WORK_S, SLURM_LAUNCHERS, fmt, parse_time
from hpctrain.core.flops import lora_params, param_counts
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
    checkpoint_bytes: float = 0.0  # one checkpoint on disk, all ranks together (checkpoint_bytes)
    weights: str = "full"  # what it holds of the model: full | adapters (checkpoint.weights)

    @property
    def total_s(self) -> float:
        return self.start_s + self.steps * self.step_s + self.saves * self.save_s


def saves_of(steps: int, every: int, final: bool = True) -> int:
    """Saves in a run: every `every` steps, and the last step's (hpctrain.checkpoint.manager.finish when
    saving is on; checkpoint.final, the default, whatever `every` says: hpctrain.train.loop._save_end)."""
    if every <= 0:
        return int(final and steps > 0)
    return steps // every + (steps % every != 0)


# Bytes a checkpoint keeps of a weight: trained, its fp32 copy (the parameter, or the master where the
# parameters are kept in the compute dtype) and Adam's two fp32 moments; frozen (LoRA's base), its copy in the
# dtype it is kept in (hpctrain.models.lora.store_frozen_as).
TRAINED_BYTES = 12
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_bytes(spec, weights: str | None = None) -> float:
    """One checkpoint's bytes, all ranks together, holding `weights` (full | adapters; default: what the run
    saves, checkpoint.weights resolved): every weight, or under checkpoint.weights=adapters the LoRA adapters
    alone, the frozen base left to model.init_from. DCP's metadata, hpctrain.json and the RNG's state add
    tens of kilobytes."""
    weights = weights or spec.checkpoint_weights
    total = param_counts(spec.model)["total"]
    if not spec.lora:
        return TRAINED_BYTES * total
    frozen = 0.0 if weights == "adapters" else DTYPE_BYTES.get(spec.dtypes.compute, 4) * total
    return TRAINED_BYTES * lora_params(spec.model) + frozen


def duration(cfg: Config, plan) -> Duration:
    m, c, spec = plan.memory, cfg.cluster, plan.job.spec
    per_rank = sum(m.device.get(k, 0) + m.host_per_rank.get(k, 0) for k in SAVED)
    if spec.checkpoint_weights == "adapters":  # the frozen base is not written: the rank's share of the rest
        per_rank *= checkpoint_bytes(spec) / checkpoint_bytes(spec, "full")
    if cfg.checkpoint.async_save:  # training waits only for the copy into host memory
        save_s = per_rank / (c.pcie_gbps * GB)
    else:
        save_s = per_rank * m.ranks_per_node / (c.checkpoint_gbps * GB)
    return Duration(MIN_WORK_S, cfg.train.steps, plan.time.step_time_s,
                    saves_of(cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.final), save_s,
                    checkpoint_bytes(spec), spec.checkpoint_weights)


def hms(seconds: float) -> str:
    return fmt(round(seconds))


def describe(d: Duration) -> str:
    saves = f" + {d.saves} save{'' if d.saves == 1 else 's'} x {d.save_s:.3g} s" if d.saves else ""
    held = ("the LoRA adapters and their optimizer state, the base left to model.init_from"
            if d.weights == "adapters" else "every weight and its optimizer state")
    each = f"\ncheckpoint: {_size(d.checkpoint_bytes)} a save ({held})" if d.saves and d.checkpoint_bytes else ""
    return (f"whole run: {hms(d.total_s)} = start-up {d.start_s:.0f} s + {d.steps} steps x {d.step_s:.3g} s"
            f"{saves}{each}")


def _size(n: float) -> str:
    return f"{n / GB:.3g} GB" if n >= GB else f"{n / 1e6:.3g} MB"


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
