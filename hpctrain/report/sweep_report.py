"""A sweep's report: `python -m hpctrain.report SWEEP_DIR` on the directory of a `python -m hpctrain -m`
sweep (it holds sweep.json) compares its elements in one table and one figure: status, final and
best validation loss, final training loss, tokens/s; the loss curves side by side. Like the run
report it reads only the files the runs leave, so it works while the sweep is still running.
"""
from __future__ import annotations

import html
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpctrain.launch.multirun import read_sweep
from hpctrain.core.rundir import OUTCOME, read_jsonl


@dataclass
class Row:
    name: str
    overrides: list[str]
    status: str
    steps: int
    final_loss: Optional[float]
    final_val: Optional[float]
    best_val: Optional[float]
    best_val_step: Optional[int]
    tokens_per_s: Optional[float]
    metrics: list[dict]


def row(run_dir: Path, name: str, overrides: list[str]) -> Row:
    metrics = read_jsonl(run_dir / "metrics.jsonl", warn=True)  # malformed lines: left out, named on stderr
    train = [m for m in metrics if "loss" in m]
    val = [m for m in metrics if "val_loss" in m]
    try:
        outcome = json.loads((run_dir / OUTCOME).read_text())
        status = str(outcome.get("status", "?")) if isinstance(outcome, dict) else "?"
    except (OSError, ValueError):
        status = "running" if metrics else "not started"
    best = min(val, key=lambda m: m["val_loss"]) if val else None
    tps = [m["tokens_per_s"] for m in train[len(train) // 2:] if "tokens_per_s" in m]  # warm-up left out
    return Row(name, overrides, status, train[-1]["step"] if train else 0,
               train[-1]["loss"] if train else None, val[-1]["val_loss"] if val else None,
               best["val_loss"] if best else None, best["step"] if best else None,
               statistics.median(tps) if tps else None, metrics)


def rows(sweep_dir: str | Path) -> list[Row]:
    d = Path(sweep_dir)
    sweep = read_sweep(d)
    if sweep is None:
        raise ValueError(f"{d} holds no sweep.json: not the directory of a `python -m hpctrain -m` sweep")
    elements = sweep.get("elements") if isinstance(sweep, dict) else None
    if not isinstance(elements, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and e["name"] not in ("", ".", "..")
            and "/" not in e["name"] and isinstance(e.get("overrides", []), list) for e in elements):
        raise ValueError(f"{d / 'sweep.json'} is damaged: it needs \"elements\", a list of objects each with a "
                         "\"name\" (its directory) and \"overrides\" (a list). Fix: restore it, or run the sweep "
                         "again with `python -m hpctrain -m`")
    return [row(d / e["name"], e["name"], [str(o) for o in e.get("overrides", [])]) for e in elements]


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def table(rs: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Header and rows, best validation loss first (elements without one last)."""
    order = sorted(rs, key=lambda r: (r.best_val is None, r.best_val if r.best_val is not None else 0.0))
    header = ["element", "status", "steps", "final loss", "final val loss", "best val loss (step)", "tokens/s"]
    body = [[r.name, r.status, str(r.steps), _fmt(r.final_loss), _fmt(r.final_val),
             f"{_fmt(r.best_val)} ({r.best_val_step})" if r.best_val is not None else "-",
             _fmt(r.tokens_per_s, ",.0f")] for r in order]
    return header, body


def plot(rs: list[Row], out: Path) -> Optional[str]:
    # optional and heavy (matplotlib, ~1 s): only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(r.metrics for r in rs):
        return None
    fig, (ax_loss, ax_bar) = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, r in enumerate(rs):
        train = [m for m in r.metrics if "loss" in m]
        val = [m for m in r.metrics if "val_loss" in m]
        ax_loss.plot([m["step"] for m in train], [m["loss"] for m in train], lw=1, color=f"C{i % 10}", alpha=0.6)
        if val:
            ax_loss.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o-", color=f"C{i % 10}", label=r.name)
        else:
            ax_loss.plot([], [], color=f"C{i % 10}", label=r.name)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (lines: training, dots: validation)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    names = [r.name for r in rs]
    ys = [r.best_val if r.best_val is not None else (r.final_loss or 0.0) for r in rs]
    ax_bar.barh(range(len(rs)), ys, color=[f"C{i % 10}" for i in range(len(rs))])
    ax_bar.set_yticks(range(len(rs)), names, fontsize=7)
    ax_bar.set_xlabel("best validation loss (final training loss where no validation)")
    lo = min(ys) if ys else 0.0
    ax_bar.set_xlim(left=max(0.0, lo - 0.1 * abs(lo)))
    for i, r in enumerate(rs):
        if r.tokens_per_s:
            ax_bar.text(ys[i], i, f" {r.tokens_per_s:,.0f} tok/s", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=100)
    plt.close(fig)
    return "sweep.png"


def write(sweep_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    rs = rows(sweep_dir)
    out = Path(out) if out else Path(sweep_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    image = plot(rs, out)
    header, body = table(rs)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    title = f"hpctrain sweep: {Path(sweep_dir).resolve().name} ({len(rs)} elements)"
    style = ("body{font-family:sans-serif;max-width:1300px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}")
    page = (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<table><tr>{head}</tr>{trs}</table>"
            + (f"<h2>Loss</h2><img src=\"{image}\" alt=\"loss of every element\">" if image else "")
            + "</body></html>\n")
    path = out / "report.html"
    path.write_text(page)
    (out / "sweep.tsv").write_text("\n".join("\t".join(r) for r in [header, *body]) + "\n")
    return path
