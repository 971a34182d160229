"""Measured pipeline bubble of every schedule hpctrain offers, against theory, on local CPU ranks.

    python benchmarks/pipeline.py [--pp 2] [--micro 2 4 8] [--reps 2] [--steps 3] [--out outputs/bench/pipeline]

For each pipeline size p (one multi-rank launch of p ranks, 1 torch thread each) every schedule
(gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev) runs hpctrain's Trainer-built stages
with m micro-batches per step for each m asked for. Repetitions are interleaved: rep 0 runs every
(schedule, m), then rep 1 runs them all again, each time on a freshly built Trainer.

How the idle fraction is measured (the same way for every schedule)
-------------------------------------------------------------------
Every stage computation is timed where torch runs it: PipelineStage.forward_one_chunk (F),
backward_one_chunk (B when full_backward, I -- gradients of the inputs only -- when the schedule
splits backward), backward_weight_one_chunk (W -- the weight gradients a zero-bubble schedule
defers), and the loss on the last stage (L, _maybe_compute_loss). Those calls do only compute: the
schedules wait for their receives and post their sends outside them. A rank's busy time in a
step is the sum of its timed calls; the step's time is the pipeline's makespan, from a barrier
that starts every rank together to the last rank leaving schedule.step() (perf_counter is
CLOCK_MONOTONIC, shared by the processes of one machine). So

    idle(rank) = 1 - busy(rank) / makespan

is the share of the step the rank spent not computing: waiting for a peer (the bubble), and the
sends, receives and schedule bookkeeping on the critical path. It is honest for zero-bubble
schedules: splitting backward into I and W changes what is busy, not how it is counted, and any
extra cost of the split (I + W > B) shows as busy time per micro-batch (column busy/mb), not as
a smaller bubble. Medians over the measured steps of all repetitions are reported.

The column peer-wait splits that idle time: the part spent waiting for another rank (an input
from a stage on another rank not yet there when this rank was free, and the wait after its last
call for the last rank to finish) -- the bubble proper -- against this rank's own overhead (the
rest: splitting the batch into micro-batches, posting sends, the schedule's bookkeeping).

Two references are printed next to it:

- theory: the closed-form bubble with equal stages and free communication,
    gpipe, 1f1b:        (p-1) / (m+p-1)
    interleaved_1f1b:   (p-1) / (v*m+p-1), v = stages per rank (2 here)
    zero_bubble:        (p-1) / (3*v*m+p-1): ZB-H1's bubble (p-1)*(T_F+T_B-T_W) with T_F = T_B = T_W,
                        on chunks of 1/v of a rank's layers (torch's interleaved ZB1P, v = 2)
    zbv, dualpipev:     0: their design target (T_F = T_B = T_W, enough micro-batches); no closed
                        form for small m is claimed here, the replay column is their reference
- replay, step's ops: the step re-played from what each rank actually ran -- the order of its
  calls and their measured durations -- with only the data dependencies between stages (F of
  stage s after F of s-1; B/I of s after F of s and B/I of s+1; W after I) and zero-cost
  communication. measured - replay is what communication, waking a blocked receiver and the
  schedule's own bookkeeping add to that very step.
- replay, median ops: the same calls in the same order, each lasting the median duration of its
  (stage, kind) over every measured step: the structural bubble of this exact schedule with this
  model's real, unequal stage costs (the last stage also computes the output layer and the loss,
  the first one an embedding lookup), free of step-to-step noise -- though not of contention that
  slows one rank's calls throughout a configuration (see CPU share). replay(median) - theory is
  what unequal stages and F:B:W ratios other than the formulas' assumptions cost.

The CPU share column (thread CPU time / wall time inside the timed calls, lowest rank) says how
much of the compute time the rank actually had a core: below ~0.9 another process (or another
rank, when ranks outnumber cores) competed for it, which inflates busy and hides bubble.

Writes results.json and bubble.png under --out; prints a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import REPO, launch_ranks, median  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"]  # config.PipelineSchedule
SHAPE = dict(dim=256, layers=8, heads=4, kv_heads=2, ffn=768, vocab=1024, seq=128, micro_batch=2)


def stages_per_rank(schedule: str) -> int:
    from hpctrain.core.spec import stages_per_rank as spr

    return spr(schedule, 1)


def theory(schedule: str, p: int, m: int) -> float:
    v = stages_per_rank(schedule)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m + p - 1)
    return 0.0  # zbv, dualpipev


def overrides(shape: dict, schedule: str, p: int, m: int) -> list[str]:
    s = shape
    return ["+experiment=tiny", "model=small", f"model.dim={s['dim']}", f"model.n_layers={s['layers']}",
            f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv_heads']}", f"model.ffn_dim={s['ffn']}",
            f"model.vocab_size={s['vocab']}", f"data.seq_len={s['seq']}", "parallel=ddp", f"parallel.pp={p}",
            "parallel.dp_shard=1", f"parallel.pp_schedule={schedule}", f"train.micro_batch={s['micro_batch']}",
            f"train.global_batch={m * s['micro_batch']}", f"launcher.nproc={p}", "train.steps=1000",
            "checkpoint.every=0", "checkpoint.resume=false"]


# ---------------------------------------------------------------------------------------------
# rank side

REC = {"on": False, "ops": []}


def install_timers() -> None:
    """Time every stage computation where torch runs it (see the module docstring)."""
    from torch.distributed.pipelining import schedules, stage

    def timed(fn, what):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if not REC["on"]:
                return fn(*a, **k)
            op = what(*a, **k)
            if op is None:
                return fn(*a, **k)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                REC["ops"].append((*op, time.perf_counter() - w0, time.thread_time() - c0, w0))
        return wrapper

    def fwd(self, fwd_chunk_id, *a, **k):
        return ("F", self.stage_index, fwd_chunk_id)

    def bwd(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return ("B" if full_backward else "I", self.stage_index, bwd_chunk_id)

    def wgt(self, bwd_chunk_id, *a, **k):
        return ("W", self.stage_index, bwd_chunk_id)

    def loss(self, stage_, output, target_mbs, mb_index, *a, **k):
        return ("L", stage_.stage_index, mb_index) if stage_.is_last and self._loss_fn is not None else None

    base = stage._PipelineStageBase
    base.forward_one_chunk = timed(base.forward_one_chunk, fwd)
    base.backward_one_chunk = timed(base.backward_one_chunk, bwd)
    base.backward_weight_one_chunk = timed(base.backward_weight_one_chunk, wgt)
    sched = schedules._PipelineSchedule
    sched._maybe_compute_loss = timed(sched._maybe_compute_loss, loss)


def run_config(shape: dict, schedule: str, p: int, m: int, steps: int, warmup: int, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from _ranks import compose_cfg, gather, trainer

    cfg = compose_cfg(overrides(shape, schedule, p, m))
    try:
        t = trainer(cfg, rank)
    except (ValueError, RuntimeError) as e:  # a schedule refusing this m: the same on every rank
        dist.barrier()
        return {"error": f"{type(e).__name__}: {e}"}
    mine = []
    for i in range(warmup + steps):
        micro = t.sampler.next_step()
        x, y = torch.cat([a for a, _ in micro]), torch.cat([b for _, b in micro])
        losses: list = []
        dist.barrier()
        REC["ops"], REC["on"] = [], i >= warmup
        t0 = time.perf_counter()
        t.schedule.step(*((x,) if t.par.first else ()), target=y if t.par.last else None, losses=losses)
        t1 = time.perf_counter()
        REC["on"] = False
        t.optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            mine.append({"start": t0, "end": t1, "ops": [(k, s, mb, w, c, st - t0) for k, s, mb, w, c, st in REC["ops"]],
                         "loss": float(torch.stack([l.detach() for l in losses]).mean()) if losses else None})
    stages = list(t.par.stage_indices)
    del t
    per_rank = gather({"stages": stages, "steps": mine})
    dist.barrier()
    return {"ranks": per_rank}


def worker(out: str, spec: str) -> None:
    from _ranks import finish, start_rank, write_json

    a = json.loads(spec)
    de = start_rank(threads=1, timeout_s=300)
    install_timers()
    results = []
    for rep in range(a["reps"]):
        for schedule in a["schedules"]:
            for m in a["micro"]:
                t0 = time.perf_counter()
                r = run_config(a["shape"], schedule, de.world, m, a["steps"], a["warmup"], de.rank)
                r.update(schedule=schedule, p=de.world, m=m, rep=rep)
                results.append(r)
                if de.rank == 0:
                    print(f"  rep {rep} p={de.world} {schedule:16s} m={m}: "
                          f"{r.get('error') or 'ok'} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if de.rank == 0:
        write_json(out, results)
    finish()


# ---------------------------------------------------------------------------------------------
# analysis (driver side, plain Python)


def replay(ranks: list[list[tuple]]) -> tuple[float, list[float]]:
    """(makespan, busy per rank) of one step re-played from each rank's ordered (kind, stage, mb,
    seconds) calls with data dependencies only (see the module docstring). L joins the F before it."""
    seqs = []
    for ops in ranks:
        seq = []
        for kind, s, mb, dur in ops:
            if kind == "L":
                j = max(i for i, o in enumerate(seq) if o[0] == "F" and o[1] == s and o[2] == mb)
                seq[j] = (*seq[j][:3], seq[j][3] + dur)
            else:
                seq.append((kind, s, mb, dur))
        seqs.append(seq)
    last = max(o[1] for seq in seqs for o in seq)
    done: dict = {}

    def deps(kind, s, mb):
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind in ("B", "I"):
            return [("F", s, mb)] + ([("BI", s + 1, mb)] if s < last else [])
        return [("I", s, mb)]  # W

    pos, clock = [0] * len(seqs), [0.0] * len(seqs)
    busy = [sum(o[3] for o in seq) for seq in seqs]
    while any(pos[r] < len(seqs[r]) for r in range(len(seqs))):
        moved = False
        for r, seq in enumerate(seqs):
            while pos[r] < len(seq):
                kind, s, mb, dur = seq[pos[r]]
                need = deps(kind, s, mb)
                if not all(d in done for d in need):
                    break
                end = max([clock[r]] + [done[d] for d in need]) + dur
                clock[r] = end
                done[(kind, s, mb)] = end
                if kind in ("B", "I"):
                    done[("BI", s, mb)] = end
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("replay deadlocked: the recorded calls do not form a schedule")
    return max(clock), busy


def peer_wait(st: list[dict]) -> list[float]:
    """Seconds each rank spent, in one step, waiting for another rank: before a call whose input
    (an activation or a gradient from a stage on another rank) was not ready when the rank was
    free, and after its last call until the last rank finished. The rest of a rank's idle time is
    its own overhead (splitting the batch, posting sends, the schedule's bookkeeping)."""
    last = max(o[1] for s in st for o in s["ops"])
    end_of: dict = {}
    for r, s in enumerate(st):
        for k, sg, mb, w, _, t0 in s["ops"]:
            end_of[("BI" if k in "BI" else k, sg, mb)] = (r, s["start"] + t0 + w)
    finish = max(s["end"] for s in st)
    out = []
    for r, s in enumerate(st):
        prev, wait = min(x["start"] for x in st), 0.0
        for k, sg, mb, w, _, t0 in s["ops"]:
            dep = ("F", sg - 1, mb) if k == "F" and sg > 0 else ("BI", sg + 1, mb) if k in "BI" and sg < last else None
            if dep in end_of and end_of[dep][0] != r and end_of[dep][1] > prev:
                wait += end_of[dep][1] - prev
            prev = max(prev, s["start"] + t0 + w)
        out.append(wait + finish - prev)
    return out


def analyse(results: list[dict]) -> list[dict]:
    """One row per (schedule, p, m): medians over the measured steps of every repetition."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r["schedule"], r["p"], r["m"]), []).append(r)
    rows = []
    for (schedule, p, m), rs in groups.items():
        row = {"schedule": schedule, "p": p, "m": m, "v": stages_per_rank(schedule),
               "theory": theory(schedule, p, m)}
        errs = [r["error"] for r in rs if "error" in r]
        if errs:
            rows.append(row | {"error": errs[0]})
            continue
        steps, idle, idle_rp, busy_mb, share, losses, waits = [], [], [], [], [], [], []
        durations: dict = {}  # (kind, stage) -> seconds of every call, for the median replay
        for r in rs:
            for rk in r["ranks"]:
                for st in rk["steps"]:
                    for o in st["ops"]:
                        durations.setdefault((o[0], o[1]), []).append(o[3])
        typical = {k: median(v) for k, v in durations.items()}
        for r in rs:
            ranks = r["ranks"]
            for j in range(len(ranks[0]["steps"])):
                st = [rk["steps"][j] for rk in ranks]
                makespan = max(s["end"] for s in st) - min(s["start"] for s in st)
                busy = [sum(o[3] for o in s["ops"]) for s in st]
                cpu = [sum(o[4] for o in s["ops"]) for s in st]
                span_rp, busy_rp = replay([[(o[0], o[1], o[2], o[3]) for o in s["ops"]] for s in st])
                steps.append(makespan)
                idle.append([1 - b / makespan for b in busy])
                waits.append([w / makespan for w in peer_wait(st)])
                idle_rp.append([1 - b / span_rp for b in busy_rp])
                busy_mb.append([b / m for b in busy])
                share.append(min(c / b for c, b in zip(cpu, busy) if b > 0))
                losses += [s["loss"] for s in st if s["loss"] is not None]
        n = len(idle[0])
        # The same calls in the same order, each lasting the median of its (kind, stage) over every
        # measured step: the schedule's structural bubble with this model's stage costs, noise-free.
        first = [[(o[0], o[1], o[2], typical[(o[0], o[1])]) for o in rk["steps"][0]["ops"]] for rk in rs[0]["ranks"]]
        span_md, busy_md = replay(first)
        row.update(step_s=median(steps), samples=len(steps),
                   idle=[median([x[i] for x in idle]) for i in range(n)],
                   idle_replay=[median([x[i] for x in idle_rp]) for i in range(n)],
                   peer_wait=[median([x[i] for x in waits]) for i in range(n)],
                   idle_replay_median_ops=[1 - b / span_md for b in busy_md],
                   op_median_ms={f"{s}{k}": round(v * 1e3, 2) for (k, s), v in sorted(typical.items(),
                                                                                     key=lambda kv: kv[0][::-1])},
                   busy_per_mb_s=[median([x[i] for x in busy_mb]) for i in range(n)],
                   cpu_share=median(share), loss=median(losses),
                   stages=[rk["stages"] for rk in rs[0]["ranks"]])
        row["idle_mean"] = sum(row["idle"]) / n
        row["idle_replay_mean"] = sum(row["idle_replay"]) / n
        row["idle_replay_median_ops_mean"] = sum(row["idle_replay_median_ops"]) / n
        rows.append(row)
    order = {s: i for i, s in enumerate(SCHEDULES)}
    return sorted(rows, key=lambda r: (r["p"], order[r["schedule"]], r["m"]))


def table(rows: list[dict]) -> str:
    def pct(xs):
        return " ".join(f"{x:5.1%}" for x in xs)

    out = ["| schedule | p | m | step s | busy/mb ms (per rank) | idle measured (per rank) | mean | "
           "of which peer-wait | replay, step's ops | replay, median ops | theory | CPU share |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | refused: {r['error'][:90]} | | | | | | | "
                       f"{r['theory']:.1%} | |")
            continue
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['step_s']:.3f} | "
                   f"{' '.join(f'{b * 1e3:.0f}' for b in r['busy_per_mb_s'])} | {pct(r['idle'])} | "
                   f"{r['idle_mean']:.1%} | {pct(r['peer_wait'])} | {pct(r['idle_replay'])} | "
                   f"{pct(r['idle_replay_median_ops'])} | "
                   f"{r['theory']:.1%} | {r['cpu_share']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=True)
    colors = {2: "tab:blue", 4: "tab:orange", 8: "tab:green"}
    for ax, schedule in zip(axes.flat, SCHEDULES):
        for p in sorted({r["p"] for r in rows}):
            rs = [r for r in rows if r["schedule"] == schedule and r["p"] == p and "error" not in r]
            every = sorted({r["m"] for r in rows if r["p"] == p})
            c = colors.get(p, "k")
            ax.plot(every, [theory(schedule, p, m) for m in every], color=c, lw=1.5, label=f"theory p={p}")
            if not rs:
                continue
            ms = [r["m"] for r in rs]
            ax.plot(ms, [r["idle_replay_mean"] for r in rs], color=c, ls="--", lw=1,
                    label=f"replay, step's ops p={p}")
            ax.plot(ms, [r["idle_replay_median_ops_mean"] for r in rs], color=c, ls=":", lw=1.5,
                    label=f"replay, median ops p={p}")
            for i in range(p):
                ax.plot(ms, [r["idle"][i] for r in rs], color=c, ls="none", marker="os^vD<>p"[i % 8], ms=5,
                        alpha=0.8, label=f"measured p={p} rank {i}")
        ax.set_title(schedule)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("idle fraction of the step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.suptitle("pipeline bubble: measured idle per rank vs theory and a comm-free replay (CPU, gloo)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline sizes (one launch each)")
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8], help="micro-batches per step")
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions (fresh Trainer each)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per repetition")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out first (shape inference)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "pipeline")
    for k, v in SHAPE.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--reanalyse", action="store_true",
                    help="run nothing: rebuild the table, results.json and the plot from --out's raw-pp*.json")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "SPEC"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    shape = {k: getattr(a, k) for k in SHAPE}
    a.out.mkdir(parents=True, exist_ok=True)
    raw = []
    t_all = time.perf_counter()
    for p in a.pp:
        spec = json.dumps({"shape": shape, "schedules": a.schedules, "micro": a.micro, "reps": a.reps,
                           "steps": a.steps, "warmup": a.warmup})
        out = a.out / f"raw-pp{p}.json"
        if not a.reanalyse:
            print(f"p={p}: {p} ranks, 1 thread each", flush=True)
            launch_ranks(a.out / f"pp{p}", p, [str(Path(__file__).resolve()), "--worker", str(out), spec])
        raw += json.loads(out.read_text())
    rows = analyse(raw)
    summary = {"shape": shape, "when": time.strftime("%F %T"), "reps": a.reps, "steps": a.steps,
               "warmup": a.warmup, "wall_s": time.perf_counter() - t_all,
               "method": "idle = 1 - busy/makespan; busy = timed F/B/I/W/loss calls; see benchmarks/pipeline.py",
               "reanalysed_only": a.reanalyse,
               "rows": rows}
    (a.out / "results.json").write_text(json.dumps(summary, indent=1))
    print()
    print(table(rows))
    plot(rows, a.out / "bubble.png")
    print(f"\nresults: {a.out / 'results.json'}, plot: {a.out / 'bubble.png'} "
          f"({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
