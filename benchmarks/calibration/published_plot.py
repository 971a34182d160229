"""The planner against published runs as one picture (`python benchmarks/calibration --png PATH`):
predicted over published tokens/s per GPU for every priced row, dense and MoE, fit and held-out, with the
15% band the held-out rows are judged by; and the held-out errors as a histogram."""
from __future__ import annotations

from hpctrain.plan.verdict import TOOL

from . import published_moe
from .fit import BOUND


def points(dense: list, moe: list) -> dict:
    """{series: [(published, predicted), ...]} in tokens/s per GPU. `dense`: fit.evaluate's Predictions;
    `moe`: published_moe.load's rows (the unpriced ones left out). Rows of engines the dense planner does
    not model are a series of their own, outside the judged ones."""
    out: dict = {"dense fit": [], "dense held-out": [], "dense, engine not modelled": [], "FP8 fit": [],
                 "FP8 held-out": [], "MoE fit": [], "MoE held-out": []}
    for x in dense:
        kind = "FP8" if getattr(x.row, "fp8", False) else "dense"
        key = "dense, engine not modelled" if x.row.source.unmodelled else \
            f"{kind} fit" if x.row.fit else f"{kind} held-out"
        out[key].append((x.row.tokens, x.tokens))
    for r in moe:
        if not r.skip:
            out["MoE fit" if r.fit else "MoE held-out"].append((r.tokens, published_moe.predict(r)))
    return out


STYLE = {"dense fit": dict(marker="o", color="0.65", s=14), "dense held-out": dict(marker="o", color="C0", s=16),
         "dense, engine not modelled": dict(marker="x", color="0.5", s=16),
         "FP8 fit": dict(marker="s", color="C8", s=20), "FP8 held-out": dict(marker="s", color="C2", s=22),
         "MoE fit": dict(marker="^", color="C1", s=30), "MoE held-out": dict(marker="^", color="C3", s=36)}


def save_published_png(dense: list, moe: list, path: str) -> str:
    # optional and heavy (~1 s): only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(dense, moe)
    fig, (scatter, hist) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.25, 1]})
    every = [v for series in pts.values() for pair in series for v in pair]
    lo, hi = min(every) / 1.3, max(every) * 1.3
    scatter.plot([lo, hi], [lo, hi], color="k", lw=1, label="predicted = published")
    for f, ls in ((1 + BOUND, "--"), (1 - BOUND, "--")):
        scatter.plot([lo, hi], [lo * f, hi * f], color="k", lw=0.8, ls=ls)
    scatter.plot([], [], color="k", lw=0.8, ls="--", label=f"±{BOUND:.0%}")
    titles = []
    for name, series in pts.items():
        if not series:
            continue
        errs = [p / q - 1 for q, p in series]
        outside = sum(abs(e) > BOUND for e in errs)
        scatter.scatter([q for q, _ in series], [p for _, p in series], label=f"{name} ({len(series)}, {outside} outside)",
                        **STYLE[name])
        if name in ("dense held-out", "FP8 held-out", "MoE held-out"):
            titles.append(f"{name}: {len(series) - outside} of {len(series)} within {BOUND:.0%}")
            # shares, not counts: 7 MoE rows stay visible beside 120 dense ones
            hist.hist([min(max(100 * e, -49.99), 49.99) for e in errs], bins=[5 * i for i in range(-10, 11)],
                      weights=[1 / len(errs)] * len(errs), alpha=0.6, color=STYLE[name]["color"],
                      label=f"{name} ({len(errs)} rows)")
    scatter.set_xscale("log")
    scatter.set_yscale("log")
    scatter.set_xlim(lo, hi)
    scatter.set_ylim(lo, hi)
    scatter.set_xlabel("published tokens/s per GPU")
    scatter.set_ylabel("planner's tokens/s per GPU")
    scatter.set_title("; ".join(titles), fontsize=9)
    scatter.legend(fontsize=7, loc="upper left")
    scatter.grid(alpha=0.3, which="both")
    for x in (-100 * BOUND, 100 * BOUND):
        hist.axvline(x, color="k", ls="--", lw=0.8)
    hist.set_xlabel("planner over published - 1, % (beyond ±50%: in the end bins)")
    hist.set_ylabel("share of the series' rows")
    hist.set_title("held-out rows: error of the predicted tokens/s", fontsize=9)
    hist.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": TOOL})  # the mark outdir.file_problem reads
    plt.close(fig)
    return path
