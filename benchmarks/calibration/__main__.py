"""`python benchmarks/calibration [--fit [--write]] [--png PATH]`

The planner against every row of published.csv and published_moe.csv: predicted against published
throughput, fit rows and held-out rows apart, with their worst and median errors; then parallel=auto on
a few of those configurations. No torch: seconds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/calibration`: sys.path[0] is this directory, whose
    # modules would shadow top-level ones of their names (fit, published); the package is imported from
    # benchmarks/ instead, and hpctrain from this checkout
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent.parent))

from calibration import fit, published as pub, published_moe  # noqa: E402
from hpctrain.plan.__main__ import refuse_outputs  # noqa: E402

PROG = "python benchmarks/calibration"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=(
        "The planner against the published training runs of published.csv and published_moe.csv (fit and "
        "held-out rows apart, worst and median errors), then parallel=auto on a few of them."))
    ap.add_argument("--fit", action="store_true",
                    help="refit each GPU kind's two efficiencies on the fit rows first and judge those")
    ap.add_argument("--write", action="store_true",
                    help="with --fit: also write the fitted efficiencies into conf/cluster/<kind>.yaml")
    ap.add_argument("--png", metavar="PATH",
                    help="also draw predicted over published for every priced row and the held-out errors' "
                         "histogram (a new file, or one the planner wrote: it says so inside)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.write and not a.fit:
        ap.error("--write writes what --fit fits: give both")
    try:
        refuse_outputs(a.png)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    rows = pub.load()
    use = pub.usable(rows)
    presets = None
    if a.fit:
        fitted = fit.fit(use)
        presets = fit.presets_of(fitted)
        for k, v in fitted.items():
            print(f"{k}: matmul_efficiency {v['matmul_efficiency']}, attention_efficiency "
                  f"{v['attention_efficiency']} (fitted on {v['rows']} rows of {', '.join(v['sources'])})")
        f8 = fit.fit_fp8(use)
        print(f"FP8: FP8_EFFICIENCY {f8['FP8_EFFICIENCY']}, ROWWISE_RATE {f8['ROWWISE_RATE']} (fitted on {f8['rows']} "
              f"speedups of {', '.join(f8['sources'])}; hpctrain/plan/throughput.py holds them: --write leaves them)")
        if a.write:
            print("wrote " + ", ".join(fit.write(fitted)))
        print()
    preds = fit.evaluate(use, presets)
    print(fit.table(preds))
    skipped: dict = {}
    for p in rows:
        if p.skip:
            skipped[p.skip] = skipped.get(p.skip, 0) + 1
    print("rows not priced: " + "; ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda x: -x[1])))
    print()
    moe_rows = published_moe.load()
    print(published_moe.table(moe_rows))
    print()
    print(fit.auto_report(use, presets))
    if a.png:
        # optional and heavy (matplotlib): only when a picture is asked for
        from calibration.published_plot import save_published_png

        print(f"wrote {save_published_png(preds, moe_rows, a.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
