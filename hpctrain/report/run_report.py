"""A run's report for people: `python -m hpctrain.report RUN_DIR [--out DIR]` writes report.html and
its PNG plots (default: RUN_DIR/report/) from the files the run leaves: metrics.jsonl, plan.json,
checkpoints.jsonl, interruptions.jsonl, attempts.jsonl, outcome.json. It reads nothing else, so it
works on a run still in progress and on a run directory copied elsewhere; every link is relative.
The report directory is new, empty, or an earlier report (hpctrain.core.outdir): the report is built
beside it and swapped in whole, and files the report did not write are never touched.

Plots: loss (training and validation) against steps and tokens; tokens/s and MFU over wall time
(interruptions shaded); step time with the spread over ranks and the plan's prediction; memory with
the plan's; checkpoint save times. Tables: the plan beside what was measured, validation, the
interruptions and goodput.
"""
from __future__ import annotations

import html
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hpctrain.core import outdir
from hpctrain.core.rundir import CHECKPOINT_LOG, INTERRUPTIONS, OUTCOME, STOPPED, read_jsonl
from hpctrain.report import goodput

GiB = 2**30
# One colour per interruption cause on every plot (matplotlib's default cycle).
CAUSE_COLOURS = {"crashed": "C3", "hung": "C4", "node_lost": "C5", "unhealthy": "C6", "preempted": "C2",
                 STOPPED: "C8"}
TOOL = "hpctrain.report"  # the name in the marker of its output directories (run and sweep reports)


@dataclass
class Run:
    dir: Path
    metrics: list[dict]
    plan: dict = field(default_factory=dict)
    checkpoints: list[dict] = field(default_factory=list)
    interruptions: list[dict] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    outcome: Optional[dict] = None

    @property
    def val(self) -> list[dict]:
        return [m for m in self.metrics if "val_loss" in m]

    def measured_step_s(self) -> Optional[float]:
        """Median step time over the second half of the logged steps (warm-up left out)."""
        times = [m["step_time_s"] for m in self.metrics if "step_time_s" in m]
        return statistics.median(times[len(times) // 2:]) if times else None


def _json(path: Path) -> Optional[dict]:
    """A JSON object file (plan.json, outcome.json); None when absent, unreadable or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def load(run_dir: str | Path) -> Run:
    d = Path(run_dir)
    metrics = read_jsonl(d / "metrics.jsonl", warn=True)  # malformed lines: left out, named on stderr
    if not metrics and not (d / "plan.json").exists():
        raise ValueError(f"{d} holds neither metrics.jsonl nor plan.json: not an hpctrain run directory "
                         f"(run.dir of a run). Fix: pass the run.dir printed when the run started")
    checkpoints = {c["step"]: c for c in read_jsonl(d / CHECKPOINT_LOG, warn=True)}  # a step saved twice: the last
    return Run(d, metrics, _json(d / "plan.json") or {}, [checkpoints[s] for s in sorted(checkpoints)],
               read_jsonl(d / INTERRUPTIONS, warn=True), read_jsonl(d / "attempts.jsonl", warn=True),
               _json(d / OUTCOME))


# ------------------------------------------------------------------------------------------ plots

def _axes(n: int = 1, width: float = 6.5, rows: int = 1):
    """A figure of `rows` x `n` plots, its axes row after row."""
    # optional and heavy (matplotlib, ~1 s): only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, n, figsize=(width * n, 3.6 * rows), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def plot_loss(run: Run, out: Path) -> Optional[str]:
    train = [m for m in run.metrics if "loss" in m]
    if not train:
        return None
    fig, (by_step, by_tokens) = _axes(2)
    losses = [m["loss"] for m in train] + [m["val_loss"] for m in run.val]
    # A loss falling over decades needs a log axis (a linear one shows only its first steps); one that
    # stays within a factor of 10 reads better on a linear one.
    log = min(losses) > 0 and max(losses) / min(losses) > 10
    for ax, x in ((by_step, "step"), (by_tokens, "tokens")):
        ax.plot([m.get(x, m["step"]) for m in train], [m["loss"] for m in train], lw=1, label="training")
        if run.val:
            ax.plot([m.get(x, m["step"]) for m in run.val], [m["val_loss"] for m in run.val], "o-", color="C3",
                    label="validation")
        if x == "step":
            _mark_interruptions(ax, run)
        ax.set_xlabel(x)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel("loss (log scale)" if log else "loss")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    return _save(fig, out / "loss.png")


def _mark_interruptions(ax, run: Run) -> None:
    """A vertical line at the last step before each interruption, named by its cause."""
    seen = set()
    for r in run.interruptions:
        step, cause = r.get("last_step"), r.get("cause", "?")
        if isinstance(step, (int, float)) and step > 0:
            ax.axvline(step, color=CAUSE_COLOURS.get(cause, "C7"), ls=":", lw=1.5,
                       label=None if cause in seen else f"{cause} after this step")
            seen.add(cause)


def _breaks(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """A gap in the line where the time between records is far above the usual (a restart)."""
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    if not gaps:
        return xs, ys
    limit = 5 * statistics.median(gaps)
    ox, oy = [xs[0]], [ys[0]]
    for (a, b), y in zip(zip(xs, xs[1:]), ys[1:]):
        if b - a > limit:
            ox.append(float("nan"))
            oy.append(float("nan"))
        ox.append(b)
        oy.append(y)
    return ox, oy


def plot_throughput(run: Run, out: Path) -> Optional[str]:
    rows = [m for m in run.metrics if m.get("tokens_per_s") and "time" in m]
    if not rows:
        return None
    t0 = rows[0]["time"]
    fig, (ax,) = _axes(1, 9)
    ax.plot(*_breaks([(m["time"] - t0) / 60 for m in rows], [m["tokens_per_s"] for m in rows]), lw=1,
            label="tokens/s")
    ax.set_xlabel("minutes since the first logged step")
    ax.set_ylabel("tokens/s")
    for r in run.interruptions:  # from the failure to the first step after the restart
        if r.get("failed_at") and r.get("first_step_at"):
            ax.axvspan((r["failed_at"] - t0) / 60, (r["first_step_at"] - t0) / 60,
                       color=CAUSE_COLOURS.get(r.get("cause"), "C7"), alpha=0.2,
                       label=f"{r.get('cause', '?')}: until the next step")
    per = rows[0].get("mfu", 0) / rows[0]["tokens_per_s"]  # MFU is tokens/s times a constant of the run
    if per > 0:
        mfu = ax.secondary_yaxis("right", functions=(lambda t: 100 * per * t, lambda m: m / (100 * per)))
        mfu.set_ylabel("MFU % (the same line, on its own scale)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return _save(fig, out / "throughput.png")


def plot_step_time(run: Run, out: Path) -> Optional[str]:
    rows = [m for m in run.metrics if "step_time_s" in m]
    if not rows:
        return None
    fig, (ax,) = _axes(1, 9)
    steps = [m["step"] for m in rows]
    ax.plot(steps, [m["step_time_s"] for m in rows], lw=1, label="rank 0")
    spread = [m for m in rows if "step_time_max" in m]
    if spread:
        ax.fill_between([m["step"] for m in spread], [m["step_time_min"] for m in spread],
                        [m["step_time_max"] for m in spread], alpha=0.3, color="C1", label="fastest to slowest rank")
    if run.plan.get("step_time_s"):
        ax.axhline(run.plan["step_time_s"], ls="--", color="k", label="the plan's prediction")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "step_time.png")


def plot_memory(run: Run, out: Path) -> Optional[str]:
    rows = [m for m in run.metrics if "mem_bytes" in m]
    if not rows:
        return None
    gpu = run.plan.get("device") == "gpu"
    fig, (ax,) = _axes(1, 9)
    ax.plot([m["step"] for m in rows], [m["mem_bytes"] / GiB for m in rows],
            label="measured on rank 0: peak allocated on the GPU" if gpu else "measured on rank 0: peak RSS of the process")
    for i, phase in enumerate(("forward", "backward", "forward_backward", "optimizer", "checkpoint")):
        key = f"mem_{phase}_bytes"  # profile.memory=true: the peak of each phase of the step
        pts = [m for m in rows if key in m]
        if pts:
            ax.plot([m["step"] for m in pts], [m[key] / GiB for m in pts], ".", ms=4, color=f"C{i + 1}",
                    label=f"peak in {phase.replace('_', '+')}")
    if run.plan.get("memory_per_gpu_bytes"):
        ax.axhline(run.plan["memory_per_gpu_bytes"] / GiB, ls="--", color="k",
                   label="the plan: tensors on one rank's device")
    if not gpu:
        # The two lines measure different things: say so where the eye compares them.
        ax.text(0.01, 0.97, "CPU run: the process's RSS (Python, torch, libraries) against the plan's tensors;\n"
                "they are not comparable. On GPUs the measure is torch's peak allocated memory.",
                transform=ax.transAxes, va="top", fontsize=8, color="0.3")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * (1.35 if not gpu else 1.0))
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    return _save(fig, out / "memory.png")


def plot_checkpoints(run: Run, out: Path) -> Optional[str]:
    if not run.checkpoints:
        return None
    fig, (ax,) = _axes(1, 9)
    labels = [str(c["step"]) for c in run.checkpoints]
    blocked = [min(c["blocked_s"], c["seconds"]) for c in run.checkpoints]
    behind = [c["seconds"] - b for c, b in zip(run.checkpoints, blocked)]
    # Stacked, not overlaid: the bar is the whole save, its lower part the time training waited.
    ax.bar(labels, blocked, color="C1", label="training blocked")
    if any(b > 0.05 * c["seconds"] for b, c in zip(behind, run.checkpoints)):
        ax.bar(labels, behind, bottom=blocked, color="C0", label="written while training went on (async)")
    stops = {r.get("last_step"): r.get("cause") for r in run.interruptions if r.get("cause") in (STOPPED, "preempted")}
    for i, c in enumerate(run.checkpoints):
        if c["step"] in stops:  # the save a Ctrl-C or a preemption asked for
            why = "Ctrl-C" if stops[c["step"]] == STOPPED else "preemption"
            ax.annotate(f"on {why}", (i, c["seconds"]), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("seconds (whole save)")
    ax.set_ylim(0, max(c["seconds"] for c in run.checkpoints) * 1.4 or 1)
    ax.legend(loc="upper right", ncols=2)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "checkpoints.png")


def plot_router(run: Run, out: Path) -> Optional[str]:
    """Mixture-of-Experts runs: each expert's share of the routed tokens over the steps (relative to an
    even split, the mean over MoE layers), the spread over experts and layers with the balancing loss,
    where a capacity factor dropped any, the routed slots dropped per step, and, per MoE layer, the
    most and the least loaded expert's share over the steps (a layer whose routing collapses shows
    there, while the mean over layers hides it)."""
    rows = [m for m in run.metrics if m.get("expert_share")]
    if not rows:
        return None
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    dropping = any(m.get("moe_dropped") for m in rows)  # a capacity factor that bit: the slots it cut
    layered = [m for m in rows if m.get("expert_share_max_by_layer") and m.get("moe_layers")]
    ids = layered[-1]["moe_layers"] if layered else []
    layered = [m for m in layered if m["moe_layers"] == ids]  # one set of layers (a resized model: the last)
    n = 3 if dropping else 2
    fig, axes = _axes(n, rows=2 if layered else 1)
    axes, per_layer = axes[:n], axes[n:]  # the second row: per MoE layer
    heat, spread = axes[:2]
    for ax in per_layer[2:]:
        ax.set_axis_off()
    fig.set_figheight(8.4 if layered else 4.2)
    steps = [m["step"] for m in rows]
    share = np.array([m["expert_share"] for m in rows]).T  # experts x steps
    hi = max(1.5, float(share.max()))
    im = heat.imshow(share, aspect="auto", origin="lower", cmap="RdBu_r", interpolation="nearest",
                     norm=TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, float(share.min())), vmax=hi),
                     extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, share.shape[0] - 0.5))
    fig.colorbar(im, ax=heat, label="share of tokens / even share")
    heat.set_xlabel("step")
    heat.set_ylabel("expert (mean over MoE layers)")
    spread.fill_between(steps, [m["expert_share_min"] for m in rows], [m["expert_share_max"] for m in rows],
                        alpha=0.3, color="C1", label="least to most loaded expert, any layer")
    spread.axhline(1.0, ls="--", color="k", lw=1, label="even")
    spread.set_xlabel("step")
    spread.set_ylabel("share of tokens / even share")
    spread.grid(alpha=0.3)
    handles, labels = spread.get_legend_handles_labels()
    if any("moe_aux_loss" in m for m in rows):
        aux = spread.twinx()
        aux.plot(steps, [m.get("moe_aux_loss") for m in rows], color="C0", lw=1, label="balancing loss (sum over layers)")
        aux.set_ylabel("balancing loss")
        more = aux.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    # one legend under the axes: over them it would hide the spread it explains
    spread.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize="small")
    if dropping:
        axes[2].plot(steps, [m.get("moe_dropped", 0) for m in rows], color="C3")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("routed slots dropped (over capacity)")
        axes[2].set_title(f"{sum(m.get('moe_dropped', 0) for m in rows):,} dropped over the logged steps", fontsize=9)
        axes[2].grid(alpha=0.3)
    if layered:
        lsteps = [m["step"] for m in layered]
        for ax, key, what in ((per_layer[0], "expert_share_max_by_layer", "most"),
                              (per_layer[1], "expert_share_min_by_layer", "least")):
            values = np.array([m[key] for m in layered]).T  # MoE layers x steps
            im = ax.imshow(values, aspect="auto", origin="lower", cmap="RdBu_r", interpolation="nearest",
                           norm=TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, float(values.min())),
                                             vmax=max(1.5, float(values.max()))),
                           extent=(lsteps[0] - 0.5, lsteps[-1] + 0.5, -0.5, len(ids) - 0.5))
            fig.colorbar(im, ax=ax, label="share of tokens / even share")
            ax.set_title(f"the {what} loaded expert of each MoE layer", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("MoE layer (block)")
            ticks = range(0, len(ids), max(1, len(ids) // 12))
            ax.set_yticks(list(ticks), [str(ids[i]) for i in ticks])
    return _save(fig, out / "router.png")


def plot_preference(run: Run, out: Path) -> Optional[str]:
    """Preference tuning (train.objective=dpo): the rewards of the chosen and the rejected completions and
    their margin (beta x log(policy / reference), means over each step's pairs: TRL's rewards/*), and the
    share of pairs whose chosen reward is the higher (rewards/accuracies). A policy that learns the
    preference shows the margin rising from 0 and the accuracy from about 0.5; the chosen reward falling
    with the rejected one (both log-probabilities pushed down) is the known DPO failure the left plot shows."""
    rows = [m for m in run.metrics if "rewards/margins" in m]
    if not rows:
        return None
    fig, (rewards, accuracy) = _axes(2)
    steps = [m["step"] for m in rows]
    for key, what, colour in (("rewards/chosen", "chosen", "C2"), ("rewards/rejected", "rejected", "C3"),
                              ("rewards/margins", "margin (chosen - rejected)", "C0")):
        rewards.plot(steps, [m[key] for m in rows], lw=1.5 if key == "rewards/margins" else 1, color=colour,
                     label=what)
    rewards.axhline(0.0, ls="--", color="k", lw=0.8)
    rewards.set_xlabel("step")
    rewards.set_ylabel("reward: beta x log(policy / reference)")
    rewards.grid(alpha=0.3)
    rewards.legend(fontsize="small")
    accuracy.plot(steps, [m["rewards/accuracies"] for m in rows], color="C1", lw=1)
    accuracy.axhline(0.5, ls="--", color="k", lw=0.8, label="chance")
    accuracy.set_ylim(-0.02, 1.02)
    accuracy.set_xlabel("step")
    accuracy.set_ylabel("pairs with chosen reward > rejected")
    accuracy.grid(alpha=0.3)
    accuracy.legend(fontsize="small")
    return _save(fig, out / "preference.png")


PLOTS = {
    "loss.png": ("Loss", plot_loss),
    "throughput.png": ("Throughput and MFU", plot_throughput),
    "step_time.png": ("Step time", plot_step_time),
    "memory.png": ("Memory", plot_memory),
    "checkpoints.png": ("Checkpoint saves", plot_checkpoints),
    "router.png": ("Expert load (Mixture-of-Experts)", plot_router),
    "preference.png": ("Preference tuning: rewards and accuracy", plot_preference),
}


# ------------------------------------------------------------------------------------------ tables

def status(run: Run) -> str:
    if run.outcome:
        return f"{run.outcome.get('status', '?')} at step {run.outcome.get('step', '?')}"
    last = run.metrics[-1]["step"] if run.metrics else 0
    return f"in progress, or stopped without an outcome: last logged step {last}"


def plan_rows(run: Run) -> list[tuple[str, str, str]]:
    """(quantity, the plan's prediction, measured)."""
    p, rows = run.plan, []
    measured = run.measured_step_s()
    if p.get("step_time_s") or measured:
        rows.append(("step time (s)", _num(p.get("step_time_s")), _num(measured)))
    tps = [m["tokens_per_s"] for m in run.metrics[len(run.metrics) // 2:] if "tokens_per_s" in m]
    if p.get("tokens_per_s") or tps:
        rows.append(("tokens/s", _num(p.get("tokens_per_s")), _num(statistics.median(tps) if tps else None)))
    mfu = [m["mfu"] for m in run.metrics[len(run.metrics) // 2:] if "mfu" in m]
    if p.get("mfu") or mfu:
        rows.append(("MFU", _pct(p.get("mfu")), _pct(statistics.median(mfu) if mfu else None)))
    mem = [m["mem_bytes"] for m in run.metrics if "mem_bytes" in m]
    if p.get("memory_per_gpu_bytes") or mem:
        what = "memory per rank (GiB)" if run.plan.get("device") == "gpu" else \
            "memory per rank (GiB; measured: the process's RSS on CPU, not comparable)"
        rows.append((what, _num(p["memory_per_gpu_bytes"] / GiB if p.get("memory_per_gpu_bytes") else None),
                     _num(max(mem) / GiB if mem else None)))
    return rows


def _num(x) -> str:
    """One style for every number of the page: 16,610 and 3,792 (not 1.661e+04), 0.0398, 12.5."""
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _cell(x) -> str:
    """A table cell: lists joined ("-" when empty), numbers as _num says, None as "-"."""
    if isinstance(x, (list, tuple)):
        return ", ".join(map(str, x)) or "-"
    if isinstance(x, bool) or x is None or x == "":
        return "-" if x is None or x == "" else str(x)
    if isinstance(x, (int, float)):
        return _num(x)
    return str(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _table(header: list[str], rows: list) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _ppl(m: dict) -> float:
    """Perplexity, exp(loss), where a record (an older or hand-made one) leaves it out."""
    return m["val_ppl"] if "val_ppl" in m else math.exp(min(m["val_loss"], 700.0))


def render(run: Run, images: dict[str, str], goodput_text: Optional[str]) -> str:
    """The HTML page (pure): `images` maps file name -> title of the plots that were drawn."""
    parts = [f"<h1>hpctrain run: {html.escape(run.dir.name)}</h1>",
             f"<p>Status: {html.escape(status(run))}. Plan: {html.escape(_plan_line(run.plan))}</p>"]
    preference = [m for m in run.metrics if "rewards/margins" in m]  # train.objective=dpo
    if run.val:
        best = min(run.val, key=lambda m: m["val_loss"])
        last = run.val[-1]
        if preference:  # a preference loss: exp of it is no perplexity
            parts.append("<h2>Validation</h2>" + _table(
                ["", "step", "validation loss (preference)"],
                [("last", last["step"], f"{last['val_loss']:.4f}"), ("best", best["step"], f"{best['val_loss']:.4f}")]))
        else:
            parts.append("<h2>Validation</h2>" + _table(
                ["", "step", "validation loss", "perplexity"],
                [("last", last["step"], f"{last['val_loss']:.4f}", f"{_ppl(last):,.2f}"),
                 ("best", best["step"], f"{best['val_loss']:.4f}", f"{_ppl(best):,.2f}")]))
    if preference:
        first, last = preference[0], preference[-1]
        keys = (("rewards/chosen", "reward of the chosen"), ("rewards/rejected", "reward of the rejected"),
                ("rewards/margins", "margin"), ("rewards/accuracies", "accuracy"),
                ("logps/chosen", "log-probability of the chosen"), ("logps/rejected", "log-probability of the rejected"))
        parts.append("<h2>Preference tuning</h2>" + _table(
            ["", f"step {first['step']}", f"step {last['step']}"],
            [(what, f"{first[k]:.4f}", f"{last[k]:.4f}") for k, what in keys]))
    rows = plan_rows(run)
    if rows:
        parts.append("<h2>The plan beside the run</h2>" + _table(["", "plan", "measured"], rows))
    for name, title in images.items():
        parts.append(f"<h2>{html.escape(title)}</h2><img src=\"{html.escape(name)}\" alt=\"{html.escape(title)}\">")
    if run.interruptions:
        cols = {"attempt": "attempt", "cause": "cause", "ranks": "ranks", "nodes": "nodes",
                "checkpoint_step": "resumed from step", "steps_redone": "steps redone",
                "detect_s": "noticed after (s)", "recover_s": "to the next step (s)", "detail": "detail"}
        parts.append("<h2>Interruptions</h2>" + _table(list(cols.values()),
                                                        [[_cell(r.get(k)) for k in cols] for r in run.interruptions]))
    if goodput_text:
        parts.append(f"<h2>Goodput</h2><pre>{html.escape(goodput_text)}</pre>")
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(run.dir.name)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def _plan_line(p: dict) -> str:
    if not p:
        return "no plan.json"
    lay = p.get("layout", {})
    return (f"model {p.get('model', '?')}, {p.get('world', '?')} ranks (pp {lay.get('pp')} x dp "
            f"{lay.get('dp_replicate')}x{lay.get('dp_shard')} x tp {lay.get('tp')}, zero {lay.get('zero')}), "
            f"{p.get('global_batch', '?')} x {p.get('seq_len', '?')} tokens per step, {p.get('precision', '?')}")


def _goodput(run: Run) -> Optional[str]:
    if not run.attempts:
        return None
    try:
        return goodput.report(goodput.measure(run.dir))
    except (ValueError, KeyError, ZeroDivisionError):
        return None  # a run too young to say


def write(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    run = load(run_dir)
    try:
        # optional dependency (matplotlib): say so before any work
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the report draws with matplotlib, which is not installed. "
                         "Fix: pip install matplotlib (or hpctrain[report])") from None
    out = Path(out) if out else run.dir / "report"
    with outdir.replacing(out, TOOL) as tmp:  # refuses a directory holding files it did not write
        images = {name: title for name, (title, plot) in PLOTS.items() if plot(run, tmp)}
        (tmp / "report.html").write_text(render(run, images, _goodput(run)))
    return out / "report.html"
