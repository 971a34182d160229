"""A collective sweep end to end on the local Slurm (slurm/start.sh: 2 emulated nodes n1, n2).

conf/sweep/local_gloo.yaml with small sizes: 4 settings, submitted as ONE job array through submitit's
map_array; every element runs the benchmark with srun on both nodes (gloo), its variables exported;
then the report writes the table, one plot per operation and the conf/cluster snippet.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import yaml

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

REPO = Path(__file__).resolve().parent.parent


def _sacct_states(array_id: str, n: int, timeout_s: float = 30) -> list[str]:
    """The array's element states (sacct lags the job by a second or two)."""
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        p = subprocess.run(["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True,
                           text=True, timeout=30)
        states = [line.split("|")[1] for line in p.stdout.splitlines() if "|" in line]
        if len(states) == n and all(s == "COMPLETED" for s in states):
            break
        time.sleep(1)
    return states


def test_local_gloo_sweep_as_one_array(slurm, tmp_path):
    out = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "hpctrain.bench.sweep", "local_gloo", "--out", str(out), "--wait",
                        "--report", "bench.max_bytes=256K", "bench.iters=3", "bench.repeats=2", "time_min=5"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}"

    # One array job, four elements, all completed.
    mf = json.loads((out / "sweep.json").read_text())
    settings = ["default", "threads2", "two_devices", "nccl_recorded"]
    assert list(mf["settings"]) == settings
    array_id = mf["array_job"]
    assert mf["job_ids"] == [f"{array_id}_{i}" for i in range(4)]
    assert _sacct_states(array_id, 4) == ["COMPLETED"] * 4

    # Each element ran across both emulated nodes with its own variables exported.
    for s in settings:
        rows = [json.loads(x) for x in (out / s / "results.jsonl").read_text().splitlines()]
        assert len(rows) == 4 * 5  # 4 ops x (1K 4K 16K 64K 256K)
        for r in rows:
            assert r["setting"] == s and r["hosts"] == ["n1", "n2"] and r["nodes"] == 2 and r["world"] == 2
            assert r["backend"] == "gloo" and r["check"] == "ok" and r["launcher"] == "slurm"
            assert r["job_id"] == array_id and r["env"]["GLOO_SOCKET_IFNAME"] == mf["settings"][s].get(
                "GLOO_SOCKET_IFNAME", "lo")
        setting = json.loads((out / s / "setting.json").read_text())
        assert setting["rc"] == 0 and setting["nodes"] == 2
    assert json.loads((out / "threads2" / "results.jsonl").read_text().splitlines()[0])["threads"] == 2
    nccl = json.loads((out / "nccl_recorded" / "results.jsonl").read_text().splitlines()[0])["env"]
    assert nccl["NCCL_ALGO"] == "Ring" and nccl["NCCL_PROTO"] == "Simple"

    # The report: table, plots, snippet.
    md = (out / "report" / "report.md").read_text()
    assert "### Best setting per operation and size range" in md and "## Verdict" in md
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        assert f"| {op} | large |" in md
        assert (out / "report" / "plots" / f"busbw_{op}.png").read_bytes()[:4] == b"\x89PNG"
    assert "nccl_recorded (= baseline)" in md  # NCCL_* on gloo: the baseline again, never the winner
    res = json.loads((out / "report" / "report.json").read_text())
    assert res["winner"] in ("default", "threads2", "two_devices")
    snippet = yaml.safe_load((out / "report" / "cluster_snippet.yaml").read_text())
    assert snippet["env"] == {k: str(v) for k, v in mf["settings"][res["winner"]].items()}
    # Each element recorded the setting it ran with (speed is the benchmark's business, not a test's).
    for s in settings:
        rec = json.loads((out / s / "setting.json").read_text())
        assert (rec["setting"], rec["rc"], rec["rows"]) == (s, 0, 4 * 5)
