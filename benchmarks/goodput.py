"""Goodput under unplanned failures on the local Slurm: the same fixed-length run twice in one
invocation, once undisturbed and once with a crash, a hang and a lost node, each recovered without
any human action.

    python benchmarks/goodput.py [--steps 150] [--every 10] [--hang-timeout 10] [--out DIR]

(tiny model, launcher=sbatch on 2 emulated nodes x 2 ranks, each step slowed to ~0.1 s so that the
run lasts long enough to be hit.) The schedule: rank 2 SIGKILLs itself at step 0.2 x steps (first
start), rank 1 hangs at 0.45 x steps (second start), node n2 is killed with everything on it once
the third start passes 0.7 x steps. Per failure: time to detect, time to recover (failure -> first
step after the restart), steps trained again; and each run's goodput (hpctrain.report.goodput). Targets:
recovery from the crash <= 30 s; the hang detected within hang_timeout_s + 10 s; no failure redoes
more than the checkpoint interval. Writes results.json and goodput.png; needs `slurm/start.sh 2`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def submit(run_dir: Path, steps: int, every: int, hang_timeout: float, fault: str) -> str:
    subprocess.run([sys.executable, "-m", "hpctrain", "+experiment=tiny", "cluster=local", "launcher=sbatch",
                    f"run.dir={run_dir}", f"train.steps={steps}", f"checkpoint.every={every}",
                    f"launcher.hang_timeout_s={hang_timeout}", "train.micro_batch=4",
                    f"+cluster.env.HPCTRAIN_FAULT='{fault}'"], cwd=REPO, check=True, capture_output=True)
    out = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sbatch")], check=True, capture_output=True,
                         text=True)
    return out.stdout.strip().split(";")[0]


def state(job: str) -> str:
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    if q.stdout.strip():
        return q.stdout.strip()
    a = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return a.stdout.strip().split("\n")[-1] or "UNKNOWN"


def last_step(run_dir: Path) -> tuple[int, int]:
    """(last logged step, attempts started)."""
    from hpctrain.core.rundir import read_jsonl

    m = read_jsonl(run_dir / "metrics.jsonl")
    attempts = [p for p in (run_dir / "attempts").glob("*") if p.name.isdigit()] if (run_dir / "attempts").is_dir() else []
    return (m[-1]["step"] if m else 0), len(attempts)


def run(run_dir: Path, a, fault: str, kill_node_at: int | None) -> dict:
    job = submit(run_dir, a.steps, a.every, a.hang_timeout, fault)
    print(f"  job {job}: {run_dir}", flush=True)
    killed = False
    deadline = time.monotonic() + 1800
    while state(job) in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED") and time.monotonic() < deadline:
        step, started = last_step(run_dir)
        if kill_node_at and not killed and started >= 3 and step >= kill_node_at:
            subprocess.run(["bash", str(REPO / "slurm" / "kill_node.sh"), "n2"], check=True)
            killed = True
            print(f"  killed node n2 at step {step}", flush=True)
        time.sleep(0.5)
    if killed:
        subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), "2"], capture_output=True)
    from hpctrain.report.goodput import measure

    g = measure(run_dir)
    return {"job": job, "state": state(job), "goodput": g.goodput, "wall_s": g.wall_s,
            "productive_s": g.productive_s, "lost_s": g.lost_s, "redone_s": g.redone_s, "other_s": g.other_s,
            "interruptions": g.interruptions}


def plot(base_dir: Path, fail_dir: Path, res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpctrain.core.rundir import read_jsonl

    fig, ax = plt.subplots(figsize=(9, 4))
    for d, label in ((base_dir, "no failures"), (fail_dir, "crash, hang, lost node")):
        attempts = read_jsonl(d / "attempts.jsonl")
        t0 = attempts[0]["start"]
        m = read_jsonl(d / "metrics.jsonl")
        ax.plot([r["time"] - t0 for r in m], [r["step"] for r in m], ".", ms=3, label=label)
    t0 = read_jsonl(fail_dir / "attempts.jsonl")[0]["start"]
    for r in res["failures"]["interruptions"]:
        ax.axvline(r["failed_at"] - t0, color="r", lw=0.8)
        ax.text(r["failed_at"] - t0, 5, f" {r['cause']}", color="r", fontsize=8, rotation=90, va="bottom")
    ax.set_xlabel("seconds since the first start")
    ax.set_ylabel("step (as kept)")
    ax.set_title(f"goodput {res['baseline']['goodput']:.0%} undisturbed, {res['failures']['goodput']:.0%} "
                 "with three failures, all recovered in the job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every")
    ap.add_argument("--hang-timeout", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "goodput")
    a = ap.parse_args()
    subprocess.run(["rm", "-rf", str(a.out)])
    a.out.mkdir(parents=True)
    slow = "slow_step:ms=100"
    crash, hang, node = int(0.2 * a.steps), int(0.45 * a.steps), int(0.7 * a.steps)
    print("undisturbed run", flush=True)
    res = {"steps": a.steps, "every": a.every, "hang_timeout_s": a.hang_timeout,
           "baseline": run(a.out / "baseline", a, slow, None)}
    print("run with failures", flush=True)
    faults = f"{slow};crash:step={crash},rank=2,attempt=0;hang:step={hang},rank=1,attempt=1"
    res["failures"] = run(a.out / "failures", a, faults, kill_node_at=node)
    checks = []
    for r in res["failures"]["interruptions"]:
        ok = r["steps_redone"] <= a.every
        if r["cause"] == "crashed":
            ok = ok and r["recover_s"] is not None and r["recover_s"] <= 30
        if r["cause"] == "hung":
            ok = ok and r["detect_s"] is not None and r["detect_s"] <= a.hang_timeout + 10
        checks.append(ok)
    res["targets_met"] = bool(checks) and all(checks) and res["failures"]["state"] == "COMPLETED"
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    plot(a.out / "baseline", a.out / "failures", res, a.out / "goodput.png")

    print(f"\n{a.steps} steps, checkpoint every {a.every}, hang timeout {a.hang_timeout:.0f} s; "
          "tiny model on 2 emulated nodes x 2 ranks (local Slurm)")
    print("| failure | detected after | recovered after (failure -> next step) | steps redone |")
    print("|---|---|---|---|")
    for r in res["failures"]["interruptions"]:
        print(f"| {r['cause']} (rank {','.join(map(str, r['ranks'])) or '-'}, {','.join(r['nodes']) or '-'}) | "
              f"{r['detect_s']:.1f} s | {r['recover_s']:.1f} s | {r['steps_redone']} |")
    for key, label in (("baseline", "undisturbed"), ("failures", "with failures")):
        r = res[key]
        print(f"{label}: goodput {r['goodput']:.1%} ({r['productive_s']:.0f} s productive of {r['wall_s']:.0f} s; "
              f"job {r['state']})")
    print(f"targets (crash recovered <= 30 s, hang detected <= timeout + 10 s, <= {a.every} steps redone each): "
          f"{'met' if res['targets_met'] else 'NOT met'}")
    print(f"results: {a.out / 'results.json'}, plot: {a.out / 'goodput.png'}")
    return 0 if res["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
