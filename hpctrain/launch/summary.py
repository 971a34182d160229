"""What a run that ends leaves you: its summary, said by the supervisor and kept in outcome.json.

The numbers come from the run directory's own records, never from a second count: the losses and tokens
from metrics.jsonl (the last record of each step, as the run finally happened), the wall time and goodput
from hpctrain.report.goodput, the newest complete checkpoint from checkpoints/, with the command that
exports it for transformers. A run that wrote no checkpoint says why, and the keys that would save one.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from hpctrain.core.rundir import list_complete, read_jsonl, read_outcome, write_outcome
from hpctrain.core.schema import Config
from hpctrain.report import goodput

SUMMARY = "summary"  # its key in outcome.json


def export_command(checkpoint: str | Path, out: str | Path, fmt: str = "hf") -> str:
    return (f"python -m hpctrain.checkpoint export {shlex.quote(str(checkpoint))} {shlex.quote(str(out))} "
            f"--format {fmt}")


def no_checkpoint_reason(cfg: Config) -> str:
    c = cfg.checkpoint
    if not c.final and c.every <= 0:
        return (f"no checkpoint was written: saving is off (checkpoint.final=false, checkpoint.every={c.every}), "
                "so there is nothing to export. Fix: checkpoint.final=true (the default) saves the last step, "
                "checkpoint.every=N every N steps")
    return "no checkpoint was written before the run ended, so there is nothing to export"


def summarize(run_dir: str | Path, cfg: Config) -> dict:
    """The summary of the run in `run_dir` as its files stand now (JSON-ready)."""
    run_dir = Path(run_dir)
    by_step = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if isinstance(m.get("step"), int)}
    rows = [by_step[s] for s in sorted(by_step)]
    last = rows[-1] if rows else {}
    val = [m for m in rows if isinstance(m.get("val_loss"), (int, float))]
    best = min(val, key=lambda m: m["val_loss"]) if val else None
    out: dict = {"step": last.get("step", 0), "tokens": last.get("tokens"), "loss": last.get("loss"),
                 "val_loss": val[-1]["val_loss"] if val else None, "val_step": val[-1]["step"] if val else None,
                 "best_val_loss": best["val_loss"] if best else None, "best_val_step": best["step"] if best else None,
                 "wall_s": None, "goodput": None}
    try:
        g = goodput.measure(run_dir)
        if not g.problems:
            out["wall_s"], out["goodput"] = g.wall_s, g.goodput
    except (ValueError, KeyError, TypeError):
        pass  # no step logged yet: no time to speak of
    saved = list_complete(run_dir / "checkpoints")
    if saved:
        step, path = saved[-1]
        out.update(checkpoint=str(path), checkpoint_step=step, export=export_command(path, run_dir / "hf"))
        if cfg.model.lora.rank > 0:  # the adapters alone, in PEFT's format, beside the merged model
            out["export_adapter"] = export_command(path, run_dir / "adapter", "peft")
    else:
        out.update(checkpoint=None, no_checkpoint=no_checkpoint_reason(cfg))
    return out


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def describe(s: dict) -> list[str]:
    """The summary as lines for the terminal."""
    tokens = f", {int(s['tokens']):,} tokens trained" if isinstance(s.get("tokens"), (int, float)) else ""
    lines = [f"summary: {s['step']} step{'' if s['step'] == 1 else 's'}{tokens}"
             + (f" in {_hms(s['wall_s'])} of wall time, goodput {s['goodput']:.1%}" if s.get("wall_s") is not None else "")]
    if s.get("loss") is not None:
        lines.append(f"  training loss {s['loss']:.4f} at step {s['step']}")
    if s.get("val_loss") is not None:
        lines.append(f"  validation loss {s['val_loss']:.4f} at step {s['val_step']}, "
                     f"best {s['best_val_loss']:.4f} at step {s['best_val_step']}")
    if s.get("checkpoint"):
        lines.append(f"  newest checkpoint: {s['checkpoint']}")
        lines.append(f"  export it for transformers: {s['export']}")
        if s.get("export_adapter"):
            lines.append(f"  or the adapters alone (PEFT): {s['export_adapter']}")
    else:
        lines.append(f"  {s['no_checkpoint']}")
    return lines


def record(run_dir: str | Path, cfg: Config, ended_as: str | None = None) -> list[str]:
    """Summarize the run, write the summary into its outcome.json, and return the lines to print. Where
    no rank wrote an outcome (ranks stopped at once, or a run given up) and `ended_as` says how it
    ended (stopped, failed), the outcome is that status at the last logged step."""
    s = summarize(run_dir, cfg)
    outcome = read_outcome(run_dir)
    if outcome is None and ended_as:
        outcome = {"status": ended_as, "step": s["step"], "checkpoint": s.get("checkpoint")}
    if outcome is not None:
        write_outcome(run_dir, {**outcome, SUMMARY: s})
    return describe(s)
