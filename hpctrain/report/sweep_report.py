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


def score(r: Row) -> Optional[float]:
    """What elements are ranked by: the best validation loss, else the final training loss."""
    return r.best_val if r.best_val is not None else r.final_loss


def ranked(rs: list[Row]) -> list[Row]:
    """Best first: by validation loss where every element has one, else by final training loss (never
    mixing the two); elements with neither last."""
    if not all(r.best_val is not None for r in rs):
        key = (lambda r: r.final_loss)
    else:
        key = (lambda r: r.best_val)
    return sorted(rs, key=lambda r: (key(r) is None, key(r) if key(r) is not None else 0.0))


def table(rs: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Header and rows, best first (ranked)."""
    order = ranked(rs)
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
    any_val = any(r.best_val is not None for r in rs)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (lines: training, dots: validation)" if any_val else "training loss")
    if all(m["loss"] > 0 for r in rs for m in r.metrics if "loss" in m):
        ax_loss.set_yscale("log")
        ax_loss.set_ylabel(ax_loss.get_ylabel() + ", log scale")
    ax_loss.grid(alpha=0.3, which="both")
    ax_loss.legend(fontsize=7)
    # Which element is best: one dot each, best at the top, on the measure the table ranks by. Dots, not
    # bars: a bar's length would need an axis from zero, where a loss of 0.0045 has no visible bar.
    order = [r for r in ranked(rs) if score(r) is not None]
    by_val = all(r.best_val is not None for r in rs)
    xs = [r.best_val if by_val else r.final_loss for r in order]
    colour = {r.name: f"C{i % 10}" for i, r in enumerate(rs)}
    ys = list(range(len(order)))[::-1]
    ax_bar.scatter(xs, ys, color=[colour[r.name] for r in order], zorder=3)
    ax_bar.set_yticks(ys, [r.name for r in order], fontsize=7)
    log = bool(xs) and min(xs) > 0 and max(xs) / min(xs) > 10
    if log:
        ax_bar.set_xscale("log")
    what = "best validation loss" if by_val else "final training loss (not every element has validation)"
    ax_bar.set_xlabel(what + (", log scale" if log else "") + "; best at the top")
    ax_bar.grid(alpha=0.3, which="both")
    ax_bar.margins(x=0.2, y=0.15)  # room for the tokens/s beside the last dot
    for x, y, r in zip(xs, ys, order):
        if r.tokens_per_s:
            ax_bar.annotate(f"{r.tokens_per_s:,.0f} tok/s", (x, y), xytext=(6, 0), textcoords="offset points",
                            va="center", fontsize=7)
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
