"""What a run that ends leaves you: its summary, said by the supervisor and kept in outcome.json.

The numbers come from the run directory's own records, never from a second count: the losses and tokens
from metrics.jsonl (the last record of each step, as the run finally happened), the wall time and goodput
from hpctrain.report.goodput, the newest complete checkpoint from checkpoints/, with the command that
exports it for transformers. A run that wrote no checkpoint says why, and the keys that would save one. A
run whose loss went non-finite says at which step (outcome.json's status nonfinite, as the ranks wrote it),
that its newest checkpoint is the last one before that step, and what to change; steps skipped under
train.on_nonfinite=skip are counted from metrics.jsonl, and so are train.precision=fp16's overflow steps (with
the last loss scale).
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


def nonfinite_fix(cfg: Config, checkpoint_step: int | None) -> str:
    """What to change after the loss went non-finite, and what running again then does."""
    o, t = cfg.optim, cfg.train
    fix = f"Fix: lower optim.lr (now {o.lr:g}), or raise optim.warmup_steps (now {o.warmup_steps})"
    if o.grad_clip <= 0:
        fix += ", or clip the gradients (optim.grad_clip=1.0; now off)"
    if t.precision != "fp32":
        fix += f", or train.precision=fp32 (now {t.precision})"
    fix += ("; train.on_nonfinite=skip steps over a rare bad batch instead. " if t.on_nonfinite == "stop" else
            f"; or allow more skips (train.max_skipped_steps now {t.max_skipped_steps}). ")
    if checkpoint_step is None:
        return fix + "Nothing was saved before it: the same command with the change starts again from step 1"
    # The weights of the last finite step may have diverged already (finite, but far too large).
    return (fix + f"The same command with the change resumes from step {checkpoint_step}; if that stops again "
            "at once, those weights diverged already: start afresh with a new run.dir, or resume an earlier "
            f"checkpoint with checkpoint.load_step (python -m hpctrain.checkpoint list {cfg.run.dir})")


def summarize(run_dir: str | Path, cfg: Config) -> dict:
    """The summary of the run in `run_dir` as its files stand now (JSON-ready)."""
    run_dir = Path(run_dir)
    ended = read_outcome(run_dir) or {}
    stop = ended.get("nonfinite") if ended.get("status") == "nonfinite" else None
    stop = stop if isinstance(stop, dict) and isinstance(stop.get("step"), int) else None
    by_step = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if isinstance(m.get("step"), int)}
    trained = [by_step[s] for s in sorted(by_step)]
    # The step that stopped the run was never trained: its row says so, the figures stop before it.
    rows = [m for m in trained if stop is None or m["step"] < stop["step"]]
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
    skipped = [m["step"] for m in rows if m.get("nonfinite") is True]
    if skipped or last.get("skipped_steps"):
        out.update(skipped_steps=max(len(skipped), int(last.get("skipped_steps") or 0)), skipped=skipped)
    if isinstance(last.get("loss_scale"), (int, float)):  # train.precision=fp16
        overflowed = sum(m.get("overflow") is True for m in rows)
        out.update(loss_scale=last["loss_scale"], overflow_steps=max(overflowed, int(last.get("overflow_steps") or 0)))
    if stop is not None:
        out["nonfinite"] = {k: stop.get(k) for k in ("step", "loss", "grad_norm")}
        out["nonfinite_fix"] = nonfinite_fix(cfg, out.get("checkpoint_step"))
    return out


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else "?"


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
    stop = s.get("nonfinite")
    if stop:
        lines.append(f"  the loss or gradient norm went non-finite at step {stop['step']} (loss {_num(stop['loss'])}, "
                     f"gradient norm {_num(stop['grad_norm'])}): its update was not applied, and the run stopped "
                     "there without saving")
    if s.get("skipped_steps"):
        shown = ", ".join(map(str, s["skipped"][:10])) + (", ..." if len(s["skipped"]) > 10 else "")
        lines.append(f"  {s['skipped_steps']} step{'' if s['skipped_steps'] == 1 else 's'} skipped, the loss or "
                     f"gradient norm not finite (train.on_nonfinite=skip)" + (f": step {shown}" if shown else ""))
    if s.get("loss_scale") is not None:
        n = s.get("overflow_steps") or 0
        lines.append(f"  loss scale {s['loss_scale']:g} at step {s['step']} (train.precision=fp16)"
                     + (f"; {n} step{'' if n == 1 else 's'} skipped on an fp16 gradient overflow, each halving the "
                        "scale (expected now and then; not counted by train.on_nonfinite)" if n else ""))
    if s.get("checkpoint"):
        before = stop and s["checkpoint_step"] < stop["step"]  # (a checkpoint.load_step run may hold later ones)
        last_finite = f", the last finite one (step {s['checkpoint_step']}, before step {stop['step']})" if before else ""
        lines.append(f"  newest checkpoint: {s['checkpoint']}{last_finite}")
        lines.append(f"  export it for transformers: {s['export']}")
        if s.get("export_adapter"):
            lines.append(f"  or the adapters alone (PEFT): {s['export_adapter']}")
    else:
        lines.append(f"  {s['no_checkpoint']}")
    if stop:
        lines.append(f"  {s['nonfinite_fix']}")
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
