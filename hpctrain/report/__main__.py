"""`python -m hpctrain.report DIR [--out OUT]`: the report of a run directory, or of a sweep's directory
(it holds sweep.json) comparing its elements. OUT (default DIR/report) is new, empty or an earlier
report, which the new one replaces whole (hpctrain.core.outdir)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from hpctrain.core import outdir
from hpctrain.report import run_report, sweep_report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.report", description="A run's report for people: report.html with its plots (loss, throughput, memory against the plan, checkpoints, restarts), or a sweep's, comparing its runs.")
    ap.add_argument("run_dir", type=Path, help="a run directory, or a sweep's (it holds sweep.json)")
    ap.add_argument("--out", type=Path, help="where report.html and the PNGs go (default: RUN_DIR/report)")
    a = ap.parse_args(argv)
    try:
        if (a.run_dir / "sweep.json").is_file():  # a `python -m hpctrain -m` sweep: compare its elements
            out = a.out or a.run_dir / "report"
            with outdir.replacing(out, run_report.TOOL) as tmp:  # as run reports: only into its own output
                sweep_report.write(a.run_dir, tmp)
            page = out / "report.html"
        else:
            page = run_report.write(a.run_dir, a.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
