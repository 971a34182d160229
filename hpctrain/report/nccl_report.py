"""Turn a sweep directory into a verdict: a table, plots, and a conf/cluster snippet.

    python -m hpctrain.report.nccl_report <sweep dir> [--large-from 16M] [--small-below 64K] [--min-gain 0.03]

Reads `<sweep dir>/<setting>/results.jsonl` (written by hpctrain.bench.collectives) and
`<sweep dir>/sweep.json` (written at submission: baseline, settings, elements), and writes into
`<sweep dir>/report/` (only if that directory is absent, empty or an earlier report of this tool's;
it is replaced whole once the new report is complete, hpctrain.core.outdir):

- `report.md`: per node count, the best setting for each operation and size range (small, medium,
  large) with its gain over the baseline, every setting's large-message gains, failed settings, and
  the verdict (also printed);
- `plots/busbw_<op>.png`: bus bandwidth against message size (log x), one line per setting, one
  panel per node count;
- `cluster_snippet.yaml`: `env:` with the winning setting's variables, to merge into
  conf/cluster/<name>.yaml (training jobs export cluster.env);
- `report.json`: the same, for programs.

Gains are geometric means over sizes of busbw(setting) / busbw(baseline), so that every size counts
the same. The winner is chosen on LARGE messages of the operations training's gradient reductions
use (all_reduce for DDP, reduce_scatter + all_gather for FSDP/ZeRO), at the largest node count
swept (closest to a training job), and must beat the baseline by --min-gain (default 3%, above the
run-to-run noise of a quiet cluster); otherwise the verdict is to keep the baseline.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import yaml

from hpctrain.core import outdir
from hpctrain.core.nccl_words import OPS, format_size, parse_size

TOOL = "hpctrain.report.nccl_report"  # the name in the marker of its output directory
REPORT = "report"  # <sweep dir>/report/

TRAINING_OPS = ("all_reduce", "reduce_scatter", "all_gather")
RANGES = ("small", "medium", "large")
# Variables a backend never reads: a setting that differs from the baseline only in these is the
# baseline run again (an A/A replica), whatever its name; its "gain" measures the noise.
INERT = {"gloo": ("NCCL_", "TORCH_NCCL_"), "nccl": ("GLOO_", "TORCH_GLOO_")}


def effective_env(env: Mapping[str, object], backend: str) -> dict:
    inert = INERT.get(backend, ())
    return {k: v for k, v in (env or {}).items() if not k.startswith(inert)}


def spread(series: Mapping[int, dict], sizes: Sequence[int]) -> float | None:
    """Median over sizes of (slowest - fastest batch) / median batch: the run's own noise."""
    xs = []
    for s in sizes:
        b = sorted(series.get(s, {}).get("batches_us") or [])
        if len(b) >= 2 and b[len(b) // 2] > 0:
            xs.append((b[-1] - b[0]) / b[len(b) // 2])
    return sorted(xs)[len(xs) // 2] if xs else None


@dataclass
class SweepData:
    root: Path
    manifest: dict
    baseline: str
    settings: dict  # name -> env (as the manifest has it; from results when there is no manifest)
    # (nodes, setting, op) -> {bytes: record}
    series: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)  # (setting, nodes, why)
    shape: dict = field(default_factory=dict)  # nodes -> "2 nodes x 8 tasks (16 ranks), nccl"


def load(root: str | Path) -> SweepData:
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    mf = {}
    if (root / "sweep.json").is_file():
        mf = json.loads((root / "sweep.json").read_text())
    settings = dict(mf.get("settings") or {})
    data = SweepData(root, mf, mf.get("baseline") or "default", settings)
    # Not settings: Slurm's logs, our report (and a report being built, .report.partial-*), the plots
    # directory of reports written before they had a directory of their own.
    dirs = sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name not in ("slurm", "plots", REPORT) and not p.name.startswith("."))
    expected = {e["dir"]: (e["setting"], e["nodes"]) for e in mf.get("elements", [])}
    seen = set()
    for d in dirs:
        res = d / "results.jsonl"
        setting_meta = {}
        if (d / "setting.json").is_file():
            try:
                setting_meta = json.loads((d / "setting.json").read_text())
            except json.JSONDecodeError:
                pass
        name, nodes = expected.get(d.name, (setting_meta.get("setting", d.name), setting_meta.get("nodes")))
        rows = []
        if res.is_file():
            for line in res.read_text().splitlines():
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a killed job
        if not rows:
            if d.name in expected or setting_meta:
                why = f"no results (exit {setting_meta['rc']})" if "rc" in setting_meta else "no results"
                data.failed.append((name, nodes, f"{why}: see {d / 'bench.log'}"))
                seen.add(d.name)
            continue
        seen.add(d.name)
        if setting_meta.get("rc") not in (None, 0):
            data.failed.append((name, nodes, f"exit {setting_meta['rc']} after {len(rows)} results: "
                                             f"see {d / 'bench.log'}"))
        for r in rows:
            n = nodes or r.get("nodes", 1)
            data.series.setdefault((n, name, r["op"]), {})[int(r["bytes"])] = r
            data.shape.setdefault(n, f"{r.get('nodes', n)} node(s) x {r.get('tasks_per_node') or '?'} task(s) "
                                     f"({r.get('world')} ranks), {r.get('backend')}, {r.get('dtype')}")
            if name not in data.settings:
                data.settings[name] = {}
    for dname, (name, nodes) in expected.items():
        if dname not in seen:
            data.failed.append((name, nodes, "never started or no directory (see slurm/ logs)"))
    if data.baseline not in data.settings and data.settings:
        data.baseline = next(iter(data.settings))
    return data


# ----------------------------------------------------------------------------------------------
# Arithmetic.

def geomean(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def split_ranges(sizes: Sequence[int], small_below: int, large_from: int) -> dict[str, tuple[list[int], str]]:
    """Range name -> (sizes in it, label). With no size >= large_from, the largest third of the sizes
    measured stand in for 'large' (and the label says so)."""
    sizes = sorted(sizes)
    out = {
        "small": ([s for s in sizes if s < small_below], f"< {format_size(small_below)}"),
        "medium": ([s for s in sizes if small_below <= s < large_from],
                   f"{format_size(small_below)} - <{format_size(large_from)}"),
        "large": ([s for s in sizes if s >= large_from], f">= {format_size(large_from)}"),
    }
    if not out["large"][0] and sizes:
        k = max(1, len(sizes) // 3)
        top = sizes[-k:]
        out["large"] = (top, f"largest measured, {format_size(top[0])} - {format_size(top[-1])} "
                             f"(none >= {format_size(large_from)})")
        out["medium"] = ([s for s in out["medium"][0] if s not in top], out["medium"][1])
        out["small"] = ([s for s in out["small"][0] if s not in top], out["small"][1])
    return out


def gain(series: Mapping[int, dict], base: Mapping[int, dict],
         sizes: Sequence[int]) -> tuple[float | None, float | None]:
    """(geometric mean of busbw ratios to the baseline - 1, mean busbw) over the sizes both have."""
    common = [s for s in sizes if s in series and s in base]
    ratios = [series[s]["busbw_gbps"] / base[s]["busbw_gbps"] for s in common if base[s]["busbw_gbps"] > 0]
    mean_bw = [series[s]["busbw_gbps"] for s in sizes if s in series]
    g = geomean(ratios)
    return (g - 1 if g is not None else None), (sum(mean_bw) / len(mean_bw) if mean_bw else None)


def analyse(data: SweepData, small_below: int = 64 << 10, large_from: int = 16 << 20,
            min_gain: float = 0.03) -> dict:
    """Everything the report shows, as plain data."""
    node_counts = sorted({k[0] for k in data.series})
    out: dict = {"baseline": data.baseline, "node_counts": {}, "failed": data.failed, "min_gain": min_gain,
                 "small_below": small_below, "large_from": large_from}
    for n in node_counts:
        ops = [op for op in OPS if any(k[0] == n and k[2] == op for k in data.series)]
        settings = [s for s in data.settings if any(k[0] == n and k[1] == s for k in data.series)]
        best_rows, large = [], {}
        for op in ops:
            base = data.series.get((n, data.baseline, op), {})
            all_sizes = sorted({b for (nn, _, o), ser in data.series.items() if nn == n and o == op for b in ser})
            ranges = split_ranges(all_sizes, small_below, large_from)
            for rname in RANGES:
                rs, label = ranges[rname]
                if not rs:
                    continue
                scored = []
                for s in settings:
                    ser = data.series.get((n, s, op))
                    if not ser:
                        continue
                    g, bw = gain(ser, base, rs)
                    if bw is None:
                        continue
                    scored.append((g if g is not None else -math.inf, bw, s))
                    if rname == "large":
                        large.setdefault(s, {})[op] = {"gain": g, "busbw": bw}
                if not scored:
                    continue
                # Rank by gain over the baseline; without a baseline, by mean busbw.
                scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
                g, bw, s = scored[0]
                base_g, base_bw = gain(base, base, rs) if base else (None, None)
                best_rows.append({"op": op, "range": rname, "sizes": label, "n_sizes": len(rs), "best": s,
                                  "busbw": bw, "baseline_busbw": base_bw,
                                  "gain": None if g == -math.inf else g,
                                  "runner_up": scored[1][2] if len(scored) > 1 else None})
        # The verdict: large messages of the training collectives.
        train_ops = [op for op in TRAINING_OPS if op in ops] or ops
        backend = next((r.get("backend") for (nn, _, _), ser in data.series.items() if nn == n
                        for r in ser.values()), "")
        base_eff = effective_env(data.settings.get(data.baseline, {}), backend)
        replicas = [s for s in settings if s != data.baseline
                    and effective_env(data.settings.get(s, {}), backend) == base_eff]
        ranking, spreads = [], {}
        for s in settings:
            gains = [large.get(s, {}).get(op, {}).get("gain") for op in train_ops]
            sp = [spread(data.series.get((n, s, op), {}),
                         split_ranges(sorted(data.series.get((n, s, op), {})), small_below, large_from)["large"][0])
                  for op in train_ops]
            sp = [x for x in sp if x is not None]
            spreads[s] = max(sp) if sp else None
            if any(g is None for g in gains):
                continue  # missing an operation (failed part-way) or no baseline to compare with
            ranking.append((geomean(1 + g for g in gains) - 1, s))
        ranking.sort(reverse=True)
        noise = max((abs(g) for g, s in ranking if s in replicas), default=None)
        candidates = [(g, s) for g, s in ranking if s not in replicas and s != data.baseline]

        def needed(s: str) -> float:
            """The gain a setting must show: the floor, the A/A noise, and both runs' batch spread."""
            return max([min_gain, noise or 0.0] + [x for x in (spreads.get(data.baseline), spreads.get(s)) if x])

        winner, why = data.baseline, ""
        ops_txt = ", ".join(train_ops)
        clear = [(g, s) for g, s in candidates if g >= needed(s)]
        threshold = needed(clear[0][1]) if clear else (needed(candidates[0][1]) if candidates else min_gain)
        if clear:
            top_gain, winner = clear[0]
            why = (f"{winner} beats the baseline {data.baseline!r} by {top_gain:+.1%} bus bandwidth on large messages "
                   f"of {ops_txt} (needed: {threshold:.1%})")
        elif candidates:
            top_gain, top = candidates[0]
            if top_gain > 0:
                why = (f"the best setting, {top}, is {top_gain:+.1%} over the baseline {data.baseline!r}, below the "
                       f"{threshold:.1%} a winner needs here (floor {min_gain:.0%}, noise between identical runs "
                       f"{_pm(noise)}, batch spread of the two runs): keep the baseline")
            else:
                why = f"no setting beats the baseline {data.baseline!r} on large messages of {ops_txt}"
        elif ranking:
            why = (f"no setting other than the baseline {data.baseline!r} has large-message results for every "
                   f"training collective ({ops_txt}) to compare with (failed or missing): keep the baseline")
        else:
            why = "no setting has large-message results for every training collective: no verdict"
        if replicas:
            one = len(replicas) == 1
            why += (f"; {', '.join(replicas)} {'differs' if one else 'differ'} from the baseline only in variables "
                    f"{backend or 'this backend'} does not read, so {'it measures' if one else 'they measure'} the "
                    f"noise ({_pm(noise)}) and cannot win")
        out["node_counts"][n] = {"shape": data.shape.get(n, ""), "ops": ops, "settings": settings,
                                 "best": best_rows, "large": large, "train_ops": train_ops,
                                 "ranking": ranking, "winner": winner, "why": why, "backend": backend,
                                 "replicas": replicas, "noise": noise, "threshold": threshold,
                                 "spread": spreads}
    if node_counts:
        top_n = node_counts[-1]
        v = out["node_counts"][top_n]
        out["winner"], out["winner_nodes"], out["why"] = v["winner"], top_n, v["why"]
        ranking = dict((s, g) for g, s in v["ranking"])
        out["winner_gain"] = ranking.get(v["winner"]) if v["winner"] != data.baseline else 0.0
    else:
        out["winner"], out["winner_nodes"], out["why"], out["winner_gain"] = None, None, "no results", None
    return out


# ----------------------------------------------------------------------------------------------
# Output.

def _pct(g: float | None) -> str:
    return "n/a" if g is None else f"{g:+.1%}"


def _pm(x: float | None) -> str:
    return "n/a" if x is None else f"±{x:.1%}"


def _bw(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def markdown(data: SweepData, res: dict, out: Path | None = None, plots: Sequence[str] = ()) -> str:
    """The report's text; `out`: the directory it will be in (for the snippet's path), `plots`: the
    names of the PNGs beside it in plots/."""
    out = data.root / REPORT if out is None else out
    mf = data.manifest
    lines = [f"# Collective sweep {mf.get('name', data.root.name)!r}", ""]
    if mf.get("description"):
        lines += [mf["description"], ""]
    lines += [f"Directory: `{data.root}`; baseline: `{data.baseline}`; array job: {mf.get('array_job', 'n/a')}; "
              f"busbw in GB/s (1e9 B/s, nccl-tests convention); gain = geometric mean over sizes of "
              f"busbw / baseline busbw.", ""]
    for n, v in res["node_counts"].items():
        lines += [f"## {v['shape'] or f'{n} node(s)'}", "",
                  "### Best setting per operation and size range", "",
                  "| op | range | sizes | best setting | busbw | baseline busbw | gain | runner-up |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in v["best"]:
            tag = " (= baseline)" if r["best"] in v["replicas"] else ""
            lines.append(f"| {r['op']} | {r['range']} | {r['sizes']} ({r['n_sizes']}) | {r['best']}{tag} | "
                         f"{_bw(r['busbw'])} | {_bw(r['baseline_busbw'])} | {_pct(r['gain'])} | "
                         f"{r['runner_up'] or '-'} |")
        ops = v["ops"]
        lines += ["", "### Large messages, every setting (mean busbw, gain over the baseline)", "",
                  "| setting | " + " | ".join(ops) + " | training collectives | batch spread |",
                  "|---|" + "---|" * len(ops) + "---|---|"]
        rank = {s: g for g, s in v["ranking"]}
        for s in v["settings"]:
            cells = []
            for op in ops:
                c = v["large"].get(s, {}).get(op)
                cells.append("-" if not c else f"{_bw(c['busbw'])} ({_pct(c['gain'])})")
            mark = (" (baseline)" if s == data.baseline else "") + (" **winner**" if s == v["winner"] else "")
            if s in v["replicas"]:
                mark += " (= baseline)"
            sp = v["spread"].get(s)
            lines.append(f"| {s}{mark} | " + " | ".join(cells) + f" | {_pct(rank.get(s))} | "
                         + ("-" if sp is None else f"{sp:.0%}") + " |")
        lines += ["", "Batch spread: (slowest - fastest) / median of the timed batches, worst training "
                      "collective, median over the large sizes. Gains smaller than it are not findings.", "",
                  f"Verdict at this node count: **{v['winner']}** — {v['why']}.", ""]
    if data.failed:
        lines += ["## Failed settings", ""]
        lines += [f"- {s} on {n} node(s): {why}" for s, n, why in data.failed]
        lines.append("")
    lines += ["## Verdict", ""]
    if res["winner"] is None:
        lines.append("No results: nothing to choose from.")
    else:
        env = {k: v for k, v in (data.settings.get(res["winner"]) or {}).items()}
        lines.append(f"Chosen for large messages (what training's gradient reductions move: all_reduce for DDP, "
                     f"reduce_scatter + all_gather for FSDP/ZeRO), at {res['winner_nodes']} node(s), the largest "
                     f"count swept: **{res['winner']}** ({res['why']}).")
        lines.append("")
        lines.append("Variables: " + (", ".join(f"`{k}={v}`" for k, v in env.items()) or "none (the defaults)")
                     + f". Snippet: `{out / 'cluster_snippet.yaml'}`.")
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`plots/{name}`" for name in sorted(plots))]
    return "\n".join(lines) + "\n"


def snippet(data: SweepData, res: dict) -> str:
    """YAML for conf/cluster/<name>.yaml: the winning setting's variables under `env:`."""
    mf = data.manifest
    winner = res.get("winner")
    env = dict(data.settings.get(winner) or {}) if winner else {}
    unset = [k for k, v in env.items() if v is None]
    env = {k: str(v) for k, v in env.items() if v is not None}
    head = [f"# From collective sweep {mf.get('name', data.root.name)!r} ({data.root}), "
            f"report of {_dt.datetime.now():%Y-%m-%d %H:%M}.",
            f"# Winner for large messages of {', '.join(res['node_counts'][res['winner_nodes']]['train_ops'])} "
            f"at {res['winner_nodes']} node(s): {winner} ({res['why']})." if winner else "# No results.",
            "# Merge the env: entries into conf/cluster/<name>.yaml (training jobs export cluster.env)."]
    base_env = (mf.get("base_env") or {})
    if base_env:
        head.append("# Measured on top of: " + " ".join(f"{k}={v}" for k, v in base_env.items()))
    for k in unset:
        head.append(f"# The winner also unsets {k}: remove it from cluster.env.")
    if not env:
        head.append("# The winner sets no variables: keep the defaults.")
    body = yaml.safe_dump({"env": env}, default_flow_style=False, sort_keys=False) if env else "env: {}\n"
    return "\n".join(head) + "\n" + body


def plot(data: SweepData, res: dict, out_dir: Path) -> list[Path]:
    # optional and heavy (matplotlib, ~1 s): only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    node_counts = list(res["node_counts"])
    ops = [op for op in OPS if any(op in v["ops"] for v in res["node_counts"].values())]
    for op in ops:
        fig, axes = plt.subplots(1, len(node_counts), figsize=(6.5 * len(node_counts), 4.5), squeeze=False)
        for ax, n in zip(axes[0], node_counts):
            v = res["node_counts"][n]
            for s in v["settings"]:
                ser = data.series.get((n, s, op))
                if not ser:
                    continue
                xs = sorted(ser)
                style = {"color": "black", "linewidth": 2.2, "linestyle": "--"} if s == data.baseline else {}
                if s == v["winner"] and s != data.baseline:
                    style = {"linewidth": 2.2}
                label = s + (" (baseline)" if s == data.baseline else "") + (" *" if s == v["winner"] else "")
                line, = ax.plot(xs, [ser[x]["busbw_gbps"] for x in xs], marker="o", markersize=3, label=label, **style)
                # The fastest and slowest timed batch as a band: how far apart identical runs land.
                band = [(x, ser[x]["busbw_gbps"] * ser[x]["time_us"] / max(ser[x]["batches_us"]),
                         ser[x]["busbw_gbps"] * ser[x]["time_us"] / min(ser[x]["batches_us"]))
                        for x in xs if len(ser[x].get("batches_us") or []) > 1 and min(ser[x]["batches_us"]) > 0]
                if band:
                    ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                                    color=line.get_color(), alpha=0.12, linewidth=0)
            ax.set_xscale("log", base=2)
            ticks = sorted({x for s in v["settings"] for x in data.series.get((n, s, op), {})})
            if ticks:
                step = max(1, len(ticks) // 8)
                ax.set_xticks(ticks[::step])
                ax.set_xticklabels([format_size(t) for t in ticks[::step]], rotation=45, ha="right")
            ax.set_xlabel("message size")
            ax.set_ylabel("busbw (GB/s)")
            ax.set_title(f"{op}: {v['shape'] or f'{n} node(s)'}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"busbw_{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.report.nccl_report",
                                 description="Table, plots and conf/cluster snippet from a collective sweep.")
    ap.add_argument("sweep_dir", help="the directory python -m hpctrain.bench.sweep wrote (--out)")
    ap.add_argument("--small-below", default="64K", help="end of the 'small' range (default 64K)")
    ap.add_argument("--large-from", default="16M",
                    help="start of the 'large' range the verdict uses (default 16M: gradient buckets and "
                         "FSDP layer shards)")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="gain over the baseline a winner needs (default 0.03 = 3%%)")
    ap.add_argument("--no-plots", action="store_true", help="the table and snippet only, no PNGs")
    a = ap.parse_args(argv)
    root = Path(a.sweep_dir)
    try:
        data = load(root)
    except FileNotFoundError as e:
        print(f"hpctrain.report.nccl_report: {e}", file=sys.stderr)
        return 2
    if not data.series:
        print(f"hpctrain.report.nccl_report: no results under {root} (expected <setting>/results.jsonl)"
              + ("".join(f"\n  {s} on {n} node(s): {why}" for s, n, why in data.failed)), file=sys.stderr)
        return 1
    res = analyse(data, parse_size(a.small_below), parse_size(a.large_from), a.min_gain)
    out = root / REPORT
    try:
        with outdir.replacing(out, TOOL) as tmp:
            plots = []
            if not a.no_plots:
                try:
                    plots = plot(data, res, tmp / "plots")
                except ImportError:
                    print("hpctrain.report.nccl_report: matplotlib is not installed: no plots (pip install "
                          "matplotlib, or pip install 'hpctrain[dev]')", file=sys.stderr)
            md = markdown(data, res, out, [p.name for p in plots])
            (tmp / "report.md").write_text(md)
            (tmp / "cluster_snippet.yaml").write_text(snippet(data, res))
            summary = {**{k: v for k, v in res.items() if k != "node_counts"},
                       "node_counts": {str(n): nv for n, nv in res["node_counts"].items()},
                       "plots": [str(out / "plots" / p.name) for p in plots],
                       "snippet": str(out / "cluster_snippet.yaml")}
            (tmp / "report.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    except outdir.OutputDirError as e:
        print(f"hpctrain.report.nccl_report: {e}", file=sys.stderr)
        return 2
    print(md)
    print(f"snippet ({out / 'cluster_snippet.yaml'}):\n" + (out / "cluster_snippet.yaml").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
