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

    python benchmarks/goodput.py --minutes 15 [--out DIR]

The long mode (issue 47: recovery from peers' memory): one run of the tiny model lasting about M minutes
on 3 emulated nodes, 2 active x 2 ranks and 1 spare (cluster.spare_nodes=1), a memory snapshot every
step (checkpoint.memory_every=1), a disk checkpoint every 100 steps, hang_timeout_s=3, each step slowed by
100 ms. Every 3 minutes one failure, in turn: kill -9 of rank 1, SIGSTOP of the last rank (a hang), the
loss of node n2 (slurm/kill_node.sh: its processes and its private /dev/shm), then again; each injected
only once the previous one has recovered. Before it, 60 s of the same active layout without snapshots
(memory_every=0, no spare) give the step time without them. Per failure: detect_s, recover_s,
steps_redone, restored_from, replaced (interruptions.jsonl); goodput (hpctrain.report.goodput); both
step-time medians. Targets: crash recovered (failure -> next step) <= 5 s, lost node <= 15 s, <= 1 step
redone per failure, goodput >= 0.9, the job COMPLETED without a requeue. Writes results.json and
goodput.png; brings the local Slurm to 3 nodes (`slurm/start.sh 3`) and back to 2 at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def submit(run_dir: Path, steps: int, every: int, hang_timeout: float, fault: str) -> str:
    return submit_with(run_dir, [f"train.steps={steps}", f"checkpoint.every={every}",
                                 f"launcher.hang_timeout_s={hang_timeout}"], fault)


def submit_with(run_dir: Path, overrides: list[str], fault: str) -> str:
    """Write the tiny model's job script for the local Slurm with these overrides, sbatch it: the job id."""
    p = subprocess.run([sys.executable, "-m", "hpctrain", "+experiment=tiny", "cluster=local", "launcher=sbatch",
                        f"run.dir={run_dir}", "train.micro_batch=4", *overrides,
                        f"+cluster.env.HPCTRAIN_FAULT='{fault}'"], cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:  # the config checks' reason, not a bare CalledProcessError
        raise SystemExit(f"python -m hpctrain {' '.join(overrides)} failed:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
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


# ------------------------------------------------------------------------------- --minutes M (issue 47)

EVERY_S = 180.0  # one failure every 3 minutes
KINDS = ("crash", "hang", "node")  # in turn
CAUSE = {"crash": "crashed", "hang": "hung", "node": "node_lost"}  # the supervisor's name for each
TARGETS = {"crash_recover_s": 5.0, "node_recover_s": 15.0, "steps_redone": 1, "goodput": 0.9}
BASELINE_S = 60.0  # the run without snapshots, for its step time
MAIN = ["cluster.nodes=2", "cluster.spare_nodes=1", "checkpoint.memory_every=1", "checkpoint.every=100",
        "launcher.hang_timeout_s=3"]
NO_SNAPSHOTS = ["cluster.nodes=2", "cluster.spare_nodes=0", "checkpoint.memory_every=0", "checkpoint.every=100",
                "launcher.hang_timeout_s=3", "cluster.max_requeues=0"]
SLOW = "slow_step:ms=100"


def schedule(minutes: float, every_s: float = EVERY_S, margin_s: float = 30.0) -> list[tuple[float, str]]:
    """(seconds after the first start, kind) of each failure: every `every_s`, crash, hang, lost node in
    turn, none later than margin_s before the end (its recovery must fit in the run)."""
    out, t = [], every_s
    while t + margin_s <= minutes * 60:
        out.append((t, KINDS[len(out) % len(KINDS)]))
        t += every_s
    return out


def steps_for(minutes: float, step_s: float, failures: int, startup_s: float = 20.0, per_failure_s: float = 5.0,
              snapshot_cost: float = 1.08) -> int:
    """train.steps that make the run last about `minutes`: the time left after start-up and recoveries, at the
    step time without snapshots made slower by their expected cost."""
    if step_s <= 0:
        raise ValueError(f"step time {step_s} s: the run without snapshots logged no usable step")
    return max(10, int((minutes * 60 - startup_s - failures * per_failure_s) / (step_s * snapshot_cost)))


def cluster_time(minutes: float) -> str:
    """Slurm's time limit for the run: its length and 15 minutes of slack, as HH:MM:SS."""
    total = int(minutes) + 15
    return f"{total // 60:02d}:{total % 60:02d}:00"


def newest_ranks(run_dir: Path) -> tuple[int, dict] | None:
    """(generation, ranks.json) of the newest generation whose ranks have said where they run."""
    gens = sorted((int(p.name) for p in (run_dir / "attempts").glob("*") if p.name.isdigit()), reverse=True) \
        if (run_dir / "attempts").is_dir() else []
    for g in gens:
        try:
            r = json.loads((run_dir / "attempts" / str(g) / "ranks.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and isinstance(r.get("pids"), dict) and isinstance(r.get("hosts"), dict):
            return g, r
    return None


def target_of(kind: str, ranks: dict) -> dict:
    """Whom a failure hits: kill -9 of rank 1 (not rank 0, whose node hosts the rendezvous), SIGSTOP of the
    last rank, the loss of the last rank's node (n2 on the first layout, its spare after a replacement)."""
    world = len(ranks["pids"])
    if world < 2:
        raise ValueError(f"ranks.json names {world} rank(s): the failures need 2 or more")
    rank = 1 if kind == "crash" else world - 1
    if kind == "node":
        return {"kind": kind, "node": ranks["hosts"][str(rank)]}
    return {"kind": kind, "rank": rank, "pid": int(ranks["pids"][str(rank)]), "node": ranks["hosts"][str(rank)]}


def ready(interruptions: list[dict], injected: int) -> bool:
    """True when every failure injected so far has its interruption record and has recovered (a step since):
    the next failure then hits a running job, not one still recovering."""
    return len(interruptions) >= injected and all(r.get("recover_s") is not None for r in interruptions)


def inject(target: dict) -> None:
    if target["kind"] == "node":
        subprocess.run(["bash", str(REPO / "slurm" / "kill_node.sh"), target["node"]], check=True,
                       capture_output=True)
    else:
        os.kill(target["pid"], signal.SIGKILL if target["kind"] == "crash" else signal.SIGSTOP)


def match(injected: list[dict], records: list[dict], slack_s: float = 2.0) -> list[dict]:
    """One row per injected failure: what it was, and the first interruption record not yet taken whose
    failure time is no earlier than the injection (less slack_s: the clocks are one clock here, the slack
    covers the record's own rounding). A failure that left no record gets record None."""
    taken, rows = set(), []
    for inj in injected:
        found = None
        for i, r in enumerate(records):
            at = r.get("failed_at") or r.get("time")
            if i not in taken and isinstance(at, (int, float)) and at >= inj["at"] - slack_s:
                found = i
                break
        if found is not None:
            taken.add(found)
        rec = records[found] if found is not None else None
        rows.append({**inj, "record": rec, "cause": rec and rec.get("cause"),
                     **{k: rec and rec.get(k) for k in ("detect_s", "recover_s", "steps_redone", "restored_from",
                                                        "replaced")}})
    for i, r in enumerate(records):
        if i not in taken:  # a failure nobody injected (or a second record for one): shown, and a miss
            rows.append({"kind": None, "at": r.get("failed_at") or r.get("time"), "record": r, "cause": r.get("cause"),
                         **{k: r.get(k) for k in ("detect_s", "recover_s", "steps_redone", "restored_from",
                                                  "replaced")}})
    return rows


def verdict(rows: list[dict], goodput: float, state: str, requeued: bool,
            targets: dict = TARGETS) -> tuple[bool, list[str]]:
    """(all targets met, why not: one line per miss)."""
    why = []
    if state != "COMPLETED":
        why.append(f"the job ended {state}, not COMPLETED")
    if requeued:
        why.append("the job was requeued (a lost node must be replaced inside the job)")
    if not any(r["kind"] for r in rows):
        why.append("no failure was injected")
    for r in rows:
        what = (f"{r['kind']} at {r.get('since_start_s', 0):.0f} s" if r["kind"]
                else f"an interruption nobody injected ({r['cause']})")
        if r["kind"] is None:
            why.append(what)
            continue
        if r["record"] is None:
            why.append(f"{what}: no interruption recorded")
            continue
        if r["cause"] != CAUSE[r["kind"]]:
            why.append(f"{what}: recorded as {r['cause']}, not {CAUSE[r['kind']]}")
        bound = {"crash": targets["crash_recover_s"], "node": targets["node_recover_s"]}.get(r["kind"])
        if r["recover_s"] is None:
            why.append(f"{what}: never recovered (no step after it)")
        elif bound is not None and r["recover_s"] > bound:
            why.append(f"{what}: recovered in {r['recover_s']:.1f} s, over {bound:.0f} s")
        if (r["steps_redone"] or 0) > targets["steps_redone"]:
            why.append(f"{what}: {r['steps_redone']} steps redone, over {targets['steps_redone']}")
    if goodput < targets["goodput"]:
        why.append(f"goodput {goodput:.1%} under {targets['goodput']:.0%}")
    return not why, why


def step_stats(metrics: list[dict]) -> dict:
    """Median step time (step_time_s, the step alone), median step period (wall time per step between
    consecutive records of one stretch: the step plus what blocks the loop around it, the snapshot's copy
    included) and median snapshot_ms where logged."""
    times = [m["step_time_s"] for m in metrics if isinstance(m.get("step_time_s"), (int, float))]
    periods = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(metrics, metrics[1:])
               if isinstance(a.get("time"), (int, float)) and isinstance(b.get("time"), (int, float))
               and b["step"] > a["step"] and b["time"] > a["time"]]
    snap = [m["snapshot_ms"] for m in metrics if isinstance(m.get("snapshot_ms"), (int, float))]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"step_time_s": med(times), "step_period_s": med(periods), "snapshot_ms": med(snap),
            "snapshot_waited": max((m.get("snapshot_waited") or 0 for m in metrics), default=0)}


def requeued(job: str) -> bool:
    """Whether Slurm requeued the job (sacct -D lists each requeued run of it as a row of its own)."""
    a = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    # A row RESIZING is not a start: Slurm's record of the allocation shrinking when a node of a --no-kill
    # job goes down (after SlurmdTimeout), with the job running on.
    states = [s for s in a.stdout.split("\n") if s.strip() and s.strip() != "RESIZING"]
    return len(states) > 1 or any(s.startswith("REQUEUE") for s in states)


def metrics_of(run_dir: Path) -> list[dict]:
    from hpctrain.core.rundir import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []


def first_start(run_dir: Path) -> float | None:
    """When the first start began: attempts.jsonl's record is written only when that start ends (with the
    node agents, at the first failure), so until then the time its ranks said where they run."""
    from hpctrain.core.rundir import read_jsonl

    a = read_jsonl(run_dir / "attempts.jsonl") if (run_dir / "attempts.jsonl").exists() else []
    if a:
        return a[0]["start"]
    try:
        return (run_dir / "attempts" / "0" / "ranks.json").stat().st_mtime
    except OSError:
        return None


RUNNING = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED")


def run_without_snapshots(run_dir: Path, seconds: float = BASELINE_S) -> dict:
    """The active layout without snapshots, stopped (scancel) once it has logged `seconds` of steps."""
    job = submit_with(run_dir, [*NO_SNAPSHOTS, "train.steps=100000"], SLOW)
    print(f"  job {job}: {run_dir}", flush=True)
    deadline = time.monotonic() + seconds + 600
    while state(job) in RUNNING and time.monotonic() < deadline:
        m = metrics_of(run_dir)
        if len(m) > 2 and m[-1]["time"] - m[0]["time"] >= seconds:
            break
        time.sleep(1)
    # To hpctrain a scancel is a preemption: it saves and would requeue the job, but for max_requeues=0.
    # A second scancel in case it got requeued anyway.
    subprocess.run(["scancel", job], capture_output=True)
    end = time.monotonic() + 60
    while state(job) in ("RUNNING", "COMPLETING", "CONFIGURING") and time.monotonic() < end:
        time.sleep(0.5)
    subprocess.run(["scancel", job], capture_output=True)
    return {"job": job, **step_stats(metrics_of(run_dir))}


def run_with_failures(run_dir: Path, minutes: float, steps: int) -> dict:
    from hpctrain.core.rundir import INTERRUPTIONS, read_jsonl

    plan = schedule(minutes)
    # One restart per failure, and room: the default launcher.max_restarts=3 would end a 15-minute run at
    # its 4th failure.
    job = submit_with(run_dir, [*MAIN, f"train.steps={steps}", f"cluster.time='{cluster_time(minutes)}'",
                                f"launcher.max_restarts={len(plan) + 2}"], SLOW)
    print(f"  job {job}: {run_dir}, {steps} steps, failures at {[f'{t:.0f} s {k}' for t, k in plan]}", flush=True)
    injected: list[dict] = []
    deadline = time.monotonic() + minutes * 60 + 900
    while state(job) in RUNNING and time.monotonic() < deadline:
        t0 = first_start(run_dir)
        if t0 is not None and len(injected) < len(plan) and time.time() - t0 >= plan[len(injected)][0]:
            recs = read_jsonl(run_dir / INTERRUPTIONS) if (run_dir / INTERRUPTIONS).exists() else []
            ranks = newest_ranks(run_dir)
            if ready(recs, len(injected)) and ranks is not None:
                target = target_of(plan[len(injected)][1], ranks[1])
                at = time.time()
                inject(target)
                injected.append({**target, "at": at, "since_start_s": at - t0, "generation": ranks[0]})
                print(f"  {at - t0:.0f} s: {target}", flush=True)
        time.sleep(0.2)
    from hpctrain.report.goodput import measure

    g = measure(run_dir)
    st = state(job)
    rows = match(injected, g.interruptions)
    return {"job": job, "state": st, "requeued": requeued(job), "steps": steps, "goodput": g.goodput,
            "wall_s": g.wall_s, "productive_s": g.productive_s, "lost_s": g.lost_s, "redone_s": g.redone_s,
            "other_s": g.other_s, "failures": [{k: v for k, v in r.items() if k != "record"} for r in rows],
            "interruptions": g.interruptions, **step_stats(metrics_of(run_dir)), "_rows": rows}


def plot_long(run_dir: Path, res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpctrain.report.goodput import restored_text

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    m, t0 = metrics_of(run_dir), first_start(run_dir) or 0.0
    ax.plot([r["time"] - t0 for r in m], [r["step"] for r in m], ".", ms=2)
    for r in res["run"]["failures"]:
        if r.get("at") is None:
            continue
        ax.axvline(r["at"] - t0, color="r", lw=0.8)
        label = f" {r['kind'] or r['cause']}: {restored_text(r)}"
        ax.text(r["at"] - t0, 5, label, color="r", fontsize=7, rotation=90, va="bottom")
    ax.set_xlabel("seconds since the first start")
    ax.set_ylabel("step (as kept)")
    ax.set_title(f"goodput {res['run']['goodput']:.0%} over {res['run']['wall_s'] / 60:.1f} min; "
                 f"targets {'met' if res['ok'] else 'NOT met'}", fontsize=10)
    rows = [r for r in res["run"]["failures"] if r["kind"]]
    xs = range(len(rows))
    bx.bar(xs, [r["recover_s"] or 0 for r in rows], color=["C3" if r["kind"] == "node" else "C0" for r in rows])
    for x, r in zip(xs, rows):
        bound = {"crash": TARGETS["crash_recover_s"], "node": TARGETS["node_recover_s"]}.get(r["kind"])
        if bound:
            bx.plot([x - 0.4, x + 0.4], [bound, bound], "k--", lw=0.8)
    bx.set_xticks(list(xs), [f"{r['kind']}\n{r['steps_redone'] if r['steps_redone'] is not None else '?'} redone"
                             for r in rows], fontsize=8)
    bx.set_ylabel("failure -> next step (s); dashed: target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def clear_out(out: Path, runs: tuple[str, ...]) -> None:
    """--out is the user's directory: only what an earlier run of this benchmark wrote there goes (its run
    directories, each recognised by its config.yaml, results.json and goodput.png); anything else stays."""
    out.mkdir(parents=True, exist_ok=True)
    for name in runs:
        d = out / name
        if d.exists():
            if not (d / "config.yaml").is_file():
                sys.exit(f"goodput.py: {d} is not a run this benchmark wrote (no config.yaml): give another --out")
            subprocess.run(["rm", "-rf", str(d)], check=True)
    for name in ("results.json", "goodput.png"):
        (out / name).unlink(missing_ok=True)


def fmt(x, spec: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def main_minutes(a) -> int:
    from hpctrain.report.goodput import restored_text

    clear_out(a.out, ("no_snapshots", "failures"))
    subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), "3"], check=True, capture_output=True)
    try:
        print(f"{BASELINE_S:.0f} s without snapshots", flush=True)
        base = run_without_snapshots(a.out / "no_snapshots")
        plan = schedule(a.minutes)
        steps = steps_for(a.minutes, base["step_period_s"] or base["step_time_s"] or 0.0, len(plan))
        print(f"{a.minutes:g} minutes with failures", flush=True)
        run_res = run_with_failures(a.out / "failures", a.minutes, steps)
    finally:
        subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), "2"], capture_output=True)
    rows = run_res.pop("_rows")
    ok, why = verdict(rows, run_res["goodput"], run_res["state"], run_res["requeued"])
    res = {"minutes": a.minutes, "schedule": schedule(a.minutes), "targets": TARGETS, "no_snapshots": base,
           "run": run_res, "ok": ok, "why": why}
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    plot_long(a.out / "failures", res, a.out / "goodput.png")

    print(f"\n{a.minutes:g} min of the tiny model, 2 nodes x 2 ranks + 1 spare (local Slurm), a memory snapshot "
          "every step, disk every 100, hang timeout 3 s")
    print("| failure | detected after | recovered after (failure -> next step) | steps redone | restored from |")
    print("|---|---|---|---|---|")
    for r in res["run"]["failures"]:
        who = f"rank {r['rank']}" if r.get("rank") is not None else r.get("node") or "-"
        print(f"| {r['kind'] or 'not injected: ' + str(r['cause'])} ({who}) | {fmt(r['detect_s'], '.1f', ' s')} | "
              f"{fmt(r['recover_s'], '.1f', ' s')} | {fmt(r['steps_redone'], '')} | {restored_text(r)} |")
    print(f"step time, median: {fmt(base['step_time_s'], '.3f', ' s')} without snapshots, "
          f"{fmt(run_res['step_time_s'], '.3f', ' s')} with; per step incl. what blocks the loop: "
          f"{fmt(base['step_period_s'], '.3f', ' s')} / {fmt(run_res['step_period_s'], '.3f', ' s')}; "
          f"snapshot_ms median {fmt(run_res['snapshot_ms'], '.1f')}, waited for the writer {run_res['snapshot_waited']}")
    print(f"goodput {run_res['goodput']:.1%} ({run_res['productive_s']:.0f} s productive of {run_res['wall_s']:.0f} s; "
          f"job {run_res['state']}{', requeued' if run_res['requeued'] else ''})")
    print(f"targets (crash <= {TARGETS['crash_recover_s']:.0f} s, lost node <= {TARGETS['node_recover_s']:.0f} s, "
          f"<= {TARGETS['steps_redone']} step redone each, goodput >= {TARGETS['goodput']:.0%}): "
          f"{'met' if ok else 'NOT met'}")
    for w in why:
        print(f"  - {w}")
    print(f"results: {a.out / 'results.json'}, plot: {a.out / 'goodput.png'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every")
    ap.add_argument("--hang-timeout", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=None, help="default outputs/bench/goodput (goodput-long with --minutes)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="the long mode: a run of about M minutes with memory snapshots, a spare node and a failure "
                         "every 3 minutes (crash, hang, lost node in turn)")
    a = ap.parse_args()
    if a.minutes is not None:
        if a.minutes < 4:
            ap.error(f"--minutes {a.minutes:g}: at least 4 (one failure every 3 minutes, 30 s to recover)")
        a.out = a.out or REPO / "outputs" / "bench" / "goodput-long"
        return main_minutes(a)
    a.out = a.out or REPO / "outputs" / "bench" / "goodput"
    clear_out(a.out, ("baseline", "failures"))
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
