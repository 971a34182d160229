"""Fit the planner's per-GPU constants on the published rows of the fit sources and judge it on the
held-out ones (`python benchmarks/calibration [--fit [--write]]`). Pure arithmetic.

Fitted per GPU kind (conf/cluster/<kind>.yaml): matmul_efficiency and attention_efficiency, the two
shares of peak the structure of hpctrain.plan.throughput leaves open. The fit minimizes the squared log
error of tokens/s per GPU over the kind's fit rows, each source weighted equally (a source with many
rows does not outvote one with few), on a coarse grid refined twice. Held-out rows never enter it.
"""
from __future__ import annotations

import math
import re
import statistics
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterable, Optional

from hpctrain.core.compose import conf_dir
from hpctrain.plan import throughput as plan_throughput
from hpctrain.plan.search import search
from hpctrain.plan.throughput import throughput
from hpctrain.plan.verdict import describe, explain

from .published import GPUS, Prediction, Published, predict, preset, usable

FITTED = ("matmul_efficiency", "attention_efficiency")
# Presets with no published 16-bit run to fit on, which take a fitted kind's constants (same tensor cores).
SHARES = {"h100": ("h200",)}
BOUND = 0.15  # the target: every held-out row within 15% of its published tokens/s


def kind(p: Published) -> str:
    return GPUS[p.gpu][0]


def evaluate(rows: Optional[list] = None, presets: Optional[dict] = None, price: Callable = throughput) -> list:
    """A Prediction for every usable row."""
    return [predict(p, presets, price=price) for p in (rows if rows is not None else usable())]


def loss(preds: Iterable[Prediction]) -> float:
    by: dict = {}
    for x in preds:
        by.setdefault(x.row.row["source"], []).append(math.log(x.tokens / x.row.tokens) ** 2)
    return sum(sum(v) / len(v) for v in by.values())


def fit(rows: Optional[list] = None, price: Callable = throughput) -> dict:
    """{kind: {constant: value}} fitted on the fit rows of each GPU kind."""
    rows = rows if rows is not None else usable()
    out = {}
    for k in sorted({kind(p) for p in rows if p.fit and not p.fp8}):
        mine = [p for p in rows if p.fit and not p.fp8 and kind(p) == k]
        base = preset(k)
        best = (math.inf, base.matmul_efficiency, base.attention_efficiency)
        lo, hi, step = (0.3, 0.1), (0.95, 0.95), 0.05
        for _ in range(3):
            mm = _grid(lo[0], hi[0], step)
            at = _grid(lo[1], hi[1], step)
            for a in mm:
                for b in at:
                    c = replace(base, matmul_efficiency=a, attention_efficiency=b)
                    err = loss(predict(p, {k: c}, price=price) for p in mine)
                    if err < best[0]:
                        best = (err, a, b)
            lo = (best[1] - step, best[2] - step)
            hi = (best[1] + step, best[2] + step)
            step /= 5
        out[k] = {"matmul_efficiency": round(best[1], 3), "attention_efficiency": round(best[2], 3),
                  "rows": len(mine), "sources": sorted({p.row["source"] for p in mine})}
    return out


FP8_FITTED = ("FP8_EFFICIENCY", "ROWWISE_RATE")


@contextmanager
def fp8_constants(efficiency: float, rowwise: float):
    """The planner priced with these FP8 constants (hpctrain.plan.throughput's module constants, which
    every cluster takes), restored afterwards."""
    old = (plan_throughput.FP8_EFFICIENCY, plan_throughput.ROWWISE_RATE)
    plan_throughput.FP8_EFFICIENCY, plan_throughput.ROWWISE_RATE = efficiency, rowwise
    try:
        yield
    finally:
        plan_throughput.FP8_EFFICIENCY, plan_throughput.ROWWISE_RATE = old


def speedup_pairs(rows: list) -> list:
    """(fp8 row, the bf16 row of the same table, model, GPUs and layout) pairs of the FP8 fit rows."""
    out = []
    for p in rows:
        if not (p.fit and p.fp8):
            continue
        same = [q for q in rows if not q.fp8 and q.row["source"] == p.row["source"]
                and q.id == p.id and q.row["micro_batch"] == p.row["micro_batch"]]
        if same:
            out.append((p, same[0]))
    return out


def fit_fp8(rows: Optional[list] = None) -> dict:
    """FP8_EFFICIENCY and ROWWISE_RATE fitted on the FP8 fit rows' published speedups over bf16 (each
    FP8 row over its table's bf16 row: the 16-bit prediction's own error stays out of the FP8 constants),
    squared log error, on a grid refined twice. Every FP8 row of another table is held out (published.FP8_FIT)."""
    rows = rows if rows is not None else usable()
    pairs = speedup_pairs(rows)
    base = {id(q): predict(q).tokens for _, q in pairs}
    best = (math.inf, plan_throughput.FP8_EFFICIENCY, plan_throughput.ROWWISE_RATE)
    lo, hi, step = (0.2, 0.4), (0.9, 1.0), 0.05
    for _ in range(3):
        for a in _grid(lo[0], hi[0], step):
            for b in _grid(lo[1], hi[1], step):
                with fp8_constants(a, b):
                    err = sum(math.log(predict(p).tokens / base[id(q)] / (p.tokens / q.tokens)) ** 2
                              for p, q in pairs)
                if err < best[0]:
                    best = (err, a, b)
        lo, hi = (best[1] - step, best[2] - step), (best[1] + step, best[2] + step)
        step /= 5
    return {"FP8_EFFICIENCY": round(best[1], 3), "ROWWISE_RATE": round(min(1.0, best[2]), 3), "rows": len(pairs),
            "sources": sorted({p.row["source"] for p, _ in pairs})}


def _grid(lo: float, hi: float, step: float) -> list:
    n = int(round((hi - lo) / step))
    return [round(min(0.99, max(0.02, lo + i * step)), 4) for i in range(n + 1)]


def presets_of(fitted: dict) -> dict:
    return {k: replace(preset(k), **{c: v[c] for c in FITTED}) for k, v in fitted.items()}


def summary(preds: list, fitted: bool, fp8: bool = False) -> dict:
    """Rows, median |error|, worst error and rows outside BOUND, of the fit or the held-out rows, 16-bit
    or FP8 (rows of engines the planner does not model are left out)."""
    errs = [x.error for x in preds if x.row.fit == fitted and x.row.fp8 == fp8 and not x.row.source.unmodelled]
    if not errs:
        return {"rows": 0, "median": 0.0, "worst": 0.0, "outside": 0}
    return {"rows": len(errs), "median": statistics.median(abs(e) for e in errs),
            "worst": max(errs, key=abs), "outside": sum(abs(e) > BOUND for e in errs)}


def table(preds: list) -> str:
    """Predicted against published, fit rows first, then held-out, with worst and median errors.

    tok/s/GPU is what is compared (converted from TFLOP/s where a source prints only those). TFLOP/s:
    per GPU by the source's own FLOP rule (model FLOPs; Narayanan et al.'s eq. (3) counts the
    recompute), published and predicted; hw pred: the planner's hardware TFLOP/s (its FLOP rule plus
    the recomputed forward). Memory: published peak (torchtitan: GiB) and the planner's."""
    head = (f"{'source':<30} {'model':<14} {'GPUs':>13} {'layout':<22} {'software':<16} {'tok/s/GPU':>9} {'pred':>9} "
            f"{'error':>7} {'TFLOP/s':>7} {'pred':>6} {'hw pred':>7} {'mem GiB':>7} {'pred':>5}  unpublished knobs")
    out = []
    for fp8, fitted in ((False, True), (False, False), (True, True), (True, False)):
        group = [x for x in preds if x.row.fit == fitted and x.row.fp8 == fp8]
        if fp8:
            out.append("FP8 FIT rows (FP8_EFFICIENCY and ROWWISE_RATE fitted on their speedups over bf16)"
                       if fitted else "FP8 HELD-OUT rows (not used by the fit)")
        else:
            out.append("FIT rows (constants fitted on these)" if fitted else "HELD-OUT rows (not used by the fit)")
        out.append(head)
        for x in group:
            out.append(_line(x) + (" [not modelled]" if x.row.source.unmodelled else ""))
        s = summary(preds, fitted, fp8)
        out.append(f"{'FP8 ' if fp8 else ''}{'fit' if fitted else 'held-out'}: {s['rows']} rows, median |error| "
                   f"{s['median']:.1%}, worst {s['worst']:+.1%}, {s['outside']} outside {BOUND:.0%}")
        for why in sorted({x.row.source.unmodelled for x in group if x.row.source.unmodelled}):
            out.append(f"  [not modelled]: {why}")
        out.append("")
    return "\n".join(out)


def _line(x: Prediction) -> str:
    p, r, j = x.row, x.row.row, x.job
    cp = f" cp{j.spec.layout.cp}" if j.spec.layout.cp > 1 else ""
    lay = f"tp{j.spec.layout.tp} pp{j.spec.layout.pp} dp{j.spec.layout.dp}{cp} z{j.spec.zero}"
    flops = p.source.flops(j.model, j.spec.seq_len, p.params)  # per token, by the source's rule
    pub_m, pred_m = p.tokens * flops / 1e12, x.tokens * flops / 1e12
    hw = x.time.hw_tflops_per_gpu
    mem = r["memory_gb"] or "-"
    chosen = ",".join(f"{k}={_knob(j, k)}" for k in p.tuned)
    sw = p.software.name + ("+compile" if j.spec.compile and not p.software.fused else "")
    return (f"{r['source'][:30]:<30} {r['model'][:14]:<14} {r['num_gpus'] + 'x' + r['gpu']:>13} "
            f"{lay + ' mb' + str(j.spec.micro_batch):<22} {sw:<16} {p.tokens:>9,.0f} "
            f"{x.tokens:>9,.0f} {x.error:>+7.1%} {pub_m:>7.0f} {pred_m:>6.0f} {hw:>7.0f} {mem:>7} "
            f"{x.memory_gib:>5.0f}  {chosen}")


def _knob(job, k: str):
    return {"micro_batch": job.spec.micro_batch, "recompute": job.spec.ac,
            "vp": job.spec.virtual_stages if job.spec.schedule == "interleaved_1f1b" else 1}[k]


# ---------------------------------------------------------------------------------------------
# parallel=auto on published configurations

# Rows whose model, GPUs and global batch the CLI and tests hand to the layout search.
AUTO = ("llm_foundry_mpt | MPT 70b | 64xh100_80gb", "torchtitan_h100_202412 | Llama 3.1 8B | 8xh100_96gb",
        "torchtitan_asynctp_h100_202506 | Llama 3 70B | 256xh100_96gb")


_AUTO: dict = {}  # row id -> auto(row) with the presets as shipped: a search takes seconds, asked by several callers


def auto(p: Published, presets: Optional[dict] = None):
    """(prediction of the published layout, search result) for the row's model, GPUs, global batch and
    sequence, both priced with the row's software profile."""
    if presets is None and p.id in _AUTO:
        return _AUTO[p.id]
    x = predict(p, presets)
    out = x, search(x.job, sw=p.software)
    if presets is None:
        _AUTO[p.id] = out
    return out


def auto_rows(rows: Optional[list] = None) -> list:
    rows = rows if rows is not None else usable()
    out = []
    for prefix in AUTO:
        hit = [p for p in rows if p.id.startswith(prefix)]
        if hit:
            out.append(hit[0])
    return out


def auto_report(rows: Optional[list] = None, presets: Optional[dict] = None) -> str:
    out = []
    for p in auto_rows(rows):
        x, res = auto(p, presets)
        best = res.ranked[0] if res.ranked else None
        out.append(f"parallel=auto on {p.id} (global batch {x.job.spec.global_batch}, software {p.software.name}):")
        out.append(f"  published layout: {describe(x.job)}: {x.tokens:,.0f} tokens/s per GPU predicted "
                   f"({p.tokens:,.0f} published)")
        if best:
            out.append(f"  auto picks:       {describe(best.job)}: {best.time.tokens_per_s / best.job.world:,.0f} "
                       f"tokens/s per GPU predicted ({best.time.tokens_per_s / best.job.world / x.tokens - 1:+.0%})")
        out.append("\n".join("  " + line for line in explain(res, top=5, why=2, request=x.job).splitlines()))
        out.append("")
    return "\n".join(out)


def write(fitted: dict) -> list:
    """Rewrite the fitted constants in conf/cluster/<kind>.yaml; returns the paths written."""


    paths = []
    for k, v in [(c, fitted[k]) for k in fitted for c in (k, *SHARES.get(k, ()))]:
        path = conf_dir() / "cluster" / f"{k}.yaml"
        text = path.read_text()
        for c in FITTED:
            text = re.sub(rf"^{c}: [0-9.]+", f"{c}: {v[c]}", text, flags=re.M)
        path.write_text(text)
        paths.append(str(path))
    return paths
