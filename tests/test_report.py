"""`python -m hpctrain.report`: the report of a finished run with an interruption, of a run in progress
copied elsewhere, and the refusal of a directory that is no run."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain.report import run_report as report
from hpctrain.core.rundir import read_jsonl

from helpers import run_cli

REPO = Path(__file__).resolve().parent.parent
PNGS = ["loss.png", "throughput.png", "step_time.png", "memory.png", "checkpoints.png"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reported") / "run"
    run_cli("+experiment=tiny", "train.steps=16", "checkpoint.every=4", "eval.every=4", f"run.dir={d}",
            env={"HPCTRAIN_FAULT": "crash:step=7,rank=1"})
    return d


def drawn(png: Path) -> bool:
    """A real plot: many colours (lines, text, anti-aliasing), not an empty canvas."""
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    return len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 50


def test_report_of_a_finished_run_with_an_interruption(crashed_run):
    proc = subprocess.run([sys.executable, "-m", "hpctrain.report", str(crashed_run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = crashed_run / "report"
    page = (out / "report.html").read_text()
    for name in PNGS:
        assert f'src="{name}"' in page and drawn(out / name), name
    assert "completed at step 16" in page
    assert "<h2>Interruptions</h2>" in page and "<td>crashed</td>" in page and "<h2>Goodput</h2>" in page
    val = [r for r in read_jsonl(crashed_run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8, 12, 16]
    best = min(val, key=lambda r: r["val_loss"])
    assert f"<td>best</td><td>{best['step']}</td><td>{best['val_loss']:.4f}</td>" in page


def test_the_plan_beside_the_run(crashed_run):
    run = report.load(crashed_run)
    plan = json.loads((crashed_run / "plan.json").read_text())
    times = [r["step_time_s"] for r in read_jsonl(crashed_run / "metrics.jsonl")]
    rows = {q: (p, m) for q, p, m in report.plan_rows(run)}
    assert rows["step time (s)"] == (f"{plan['step_time_s']:,.4g}", f"{statistics.median(times[len(times) // 2:]):,.4g}")
    assert rows["MFU"][0] == f"{100 * plan['mfu']:.1f}%"


def test_report_of_a_run_in_progress_copied_elsewhere(crashed_run, tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(crashed_run, copy, ignore=shutil.ignore_patterns("checkpoints", "report"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines[:6]) + '\n{"step": 7, "lo')  # torn mid-write
    (copy / "outcome.json").unlink()
    report.write(copy)  # an earlier report, drawn while checkpoints.jsonl was there
    assert (copy / "report" / "checkpoints.png").is_file()
    (copy / "checkpoints.jsonl").unlink()
    page = report.write(copy).read_text()
    assert "in progress" in page and "last logged step 6" in page
    assert drawn(copy / "report" / "loss.png")
    assert not (copy / "report" / "checkpoints.png").exists() and 'src="checkpoints.png"' not in page
    assert str(crashed_run) not in page  # nothing points back at where the run was


def test_a_directory_that_is_no_run_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain.report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(tmp_path) in proc.stderr and "not an hpctrain run directory" in proc.stderr
