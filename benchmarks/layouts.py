"""Tokens/s and peak memory per rank of each parallel layout, measured, next to the planner's
predicted bytes per rank for the same config.

    python benchmarks/layouts.py [--models small tiny] [--layouts ddp zero1 ... | moe_zero3 moe_ep2 ... | lora_zero3 ...] [--steps 5] [--skip 2]
                                 [--mem-steps 4] [--reps 1] [--set KEY=VALUE ...] [--out outputs/bench/layouts]

Both models by default, each with every layout (conf/model/small.yaml, ~34M parameters, and
conf/model/tiny.yaml, ~0.5M), each model's outputs under --out/<model>.

Every layout runs in launches of its own (fresh processes and process group, so peaks never mix),
1 torch thread per rank, twice: a memory run and a speed run (below). Repetitions are interleaved
(every layout once, then again).

Memory, measured: each rank imports everything any layout uses, initializes the process group and
composes its config, then takes a baseline -- its resident set size (RSS) at that moment -- before
building the Trainer. After the steps it reads its peak RSS (getrusage ru_maxrss, KiB on Linux).
The figure reported is peak - baseline: what building and training this layout added to the
process, i.e. the CPU analogue of device memory. It also records the RSS once the Trainer is built,
the steady RSS after each step (what stays between steps: parameters, optimizer state, DDP's
gradient buckets, the runtime's own buffers), the peak once forward/backward is done and once
gradient clipping is done (which phase sets the peak), the exact bytes of this rank's
parameters and optimizer state, and its resident pages by kind (anonymous, file-backed) at the
baseline, once built and after each step, so a gap to the planner can be traced to a part. The
file-backed growth ("of which file-backed" in the table, ~24-29 MiB on every layout of the small model) is
the pages of torch's libraries that building and training touch for the first time: part of the
per-process runtime (cluster.runtime_reserve_gb), which dominates the tiny model's peak.

The allocator matters (both are measured and printed): with glibc's default, malloc
raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which tensors
come from the heap, whose freed holes are kept, not returned: peak RSS then depends on the order
of allocations and grows over the first steps (by up to 2x for FSDP's gather/scatter buffers).
The memory run therefore fixes the threshold (MALLOC_MMAP_THRESHOLD_=65536: every tensor above
64 KiB is its own mapping, unmapped when freed), so RSS follows the bytes alive -- the quantity
the planner models, like CUDA's max_memory_allocated. That makes allocation slow (each large
tensor is fresh zeroed pages), so tokens/s comes from the speed run, under glibc's default, which
also reports the default allocator's peak RSS for comparison.

Memory, predicted: hpctrain.plan.memory for the same composed config (job_of(cfg, world)) --
the device bytes of the rank's pipeline stage (stage_memory), which on a CPU cluster the planner
takes for what the rank holds. Its host figures (the 3 GiB "process" base) are left out: the
baseline removes the process itself from the measurement. measured / predicted is printed per
rank, with the layouts whose every rank is within 10%.

ZeRO here: 0 = DDP; 1 = torch's ZeroRedundancyOptimizer over DDP; 2 = FSDP2 with
reshard_after_forward=False; 3 = FSDP2 resharding after forward. All four at dp = 2 with the same
micro-batch, one micro-batch per rank per step (train.global_batch=4, micro_batch=2), so their
per-rank activations match and only the model state differs.

Tokens/s: global tokens of a step / median step time after --skip warm-up steps of the speed run.
Layouts with more ranks than this machine has cores (4 ranks here) share cores: their tokens/s
measures contention as much as the layout, and is flagged.

Writes results.json and layouts.png under --out; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import REPO, launch_ranks, median  # noqa: E402

MiB = 2**20
MODES = {"memory": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "speed": {}}  # extra environment of each run
MODELS = ("small", "tiny")  # conf/model: ~33.6M and ~0.46M parameters
COMMON = ["+experiment=tiny", "data.seq_len=128", "train.micro_batch=2", "train.global_batch=4",
          "train.steps=1000", "optim.warmup_steps=2", "checkpoint.every=0", "checkpoint.resume=false"]
LAYOUTS = {  # name: (ranks, overrides on top of COMMON)
    "ddp": (2, ["parallel=ddp"]),
    "zero1": (2, ["parallel=ddp", "parallel.zero=1"]),
    "zero2": (2, ["parallel=fsdp", "parallel.zero=2"]),
    "zero3": (2, ["parallel=fsdp", "parallel.zero=3"]),
    # gradients reduced once per step (parallel.grad_sync=step): FSDP2 accumulates them unsharded
    "zero2_step": (2, ["parallel=fsdp", "parallel.zero=2", "parallel.grad_sync=step"]),
    "zero3_step": (2, ["parallel=fsdp", "parallel.zero=3", "parallel.grad_sync=step"]),
    "tp2": (2, ["parallel=ddp", "parallel.tp=2"]),
    "pp2": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "hsdp2x2": (4, ["parallel=fsdp", "parallel.dp_replicate=2", "train.global_batch=8"]),
    "tp2xpp2": (4, ["parallel=ddp", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    # Megatron's layout: parameters replicated over data parallel (FSDP2's replicate) with TP or PP
    "ddp_tp2_dp2": (4, ["parallel=ddp", "parallel.tp=2", "parallel.dp_shard=2"]),
    "zero1_pp2_dp2": (4, ["parallel=ddp", "parallel.zero=1", "parallel.pp=2", "parallel.dp_shard=2",
                          "parallel.pp_schedule=1f1b"]),
    # ZeRO-3 under pipelining keeps a stage's parameters gathered from forward to backward
    "zero3_pp2_dp2": (4, ["parallel=fsdp", "parallel.zero=3", "parallel.pp=2", "parallel.dp_shard=2",
                          "parallel.pp_schedule=1f1b"]),
    # an uneven pipeline split, given by hand
    "pp2_uneven": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_layers=[3,5]"]),
}
# Mixture-of-Experts layouts (the model made MoE: 8 experts of width 512, 2 a token, in every block),
# measured when named with --layouts: FSDP2 alone, expert parallel over 2 and 4 ranks, and ep 2 x cp 2.
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_dim=512", "parallel=fsdp", "parallel.zero=3"]
MOE_LAYOUTS = {
    "moe_zero3": (2, MOE),
    "moe_ep2": (2, [*MOE, "parallel.ep=2"]),
    "moe_ep2_dp2": (4, [*MOE, "parallel.ep=2", "train.global_batch=8"]),
    "moe_ep4": (4, [*MOE, "parallel.ep=4", "train.global_batch=8"]),
    "moe_ep2_cp2": (4, [*MOE, "parallel.ep=2", "parallel.cp=2"]),  # the experts sharded over the cp ranks
}
DENSE_LAYOUTS = list(LAYOUTS)
LAYOUTS.update(MOE_LAYOUTS)
# Long context (measured when named): one sequence per step, split over cp 1, 2 and 4 ranks (FSDP2 over
# them), 8K to 64K tokens, K/V all-gathered; "_ring" passes them round instead, "_torch" runs torch's
# context_parallel instead of hpctrain's kernel. With --models tiny.
LONG = ["parallel=fsdp", "parallel.zero=3", "train.global_batch=1", "train.micro_batch=1"]
LONG_LAYOUTS = {f"cp{c}_{k}k{'_ring' if ring else ''}": (c, [*LONG, f"data.seq_len={k * 1024}", f"parallel.cp={c}",
                                                           *(["parallel.cp_attention=ring"] if ring else [])])
                for k in (8, 16, 32, 64) for c in (1, 2, 4) for ring in (False, True) if not (ring and c == 1)}
LAYOUTS.update(LONG_LAYOUTS)
# ... and through torch's context_parallel ring (parallel.cp_kernel=torch, CPU kernel registered by hpctrain)
LONG_LAYOUTS.update({f"{name}_torch": (c, [*o, "parallel.cp_kernel=torch"]) for name, (c, o) in list(LONG_LAYOUTS.items())
                     if c > 1})
LAYOUTS.update(LONG_LAYOUTS)
# LoRA (measured when named): rank-16 adapters on every linear of a block, the base frozen, under each engine.
LORA = ["model.lora.rank=16", "model.lora.alpha=32"]
LORA_LAYOUTS = {"lora_ddp": (2, ["parallel=ddp", *LORA]), "lora_zero1": (2, ["parallel=ddp", "parallel.zero=1", *LORA]),
                "lora_zero2": (2, ["parallel=fsdp", "parallel.zero=2", *LORA]),
                "lora_zero3": (2, ["parallel=fsdp", "parallel.zero=3", *LORA]),
                "lora_tp2": (2, ["parallel=ddp", "parallel.tp=2", *LORA]),
                "lora_pp2": (2, ["parallel=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b", *LORA])}
LAYOUTS.update(LORA_LAYOUTS)
DESCRIBE = {"ddp": "DDP (zero 0), dp 2", "zero1": "ZeRO-1 (ZeroRedundancyOptimizer + DDP), dp 2",
            "zero2": "ZeRO-2 (FSDP2, no reshard after fwd), dp 2", "zero3": "ZeRO-3 (FSDP2), dp 2",
            "zero2_step": "ZeRO-2, gradients reduced once per step, dp 2",
            "zero3_step": "ZeRO-3, gradients reduced once per step, dp 2",
            "tp2": "TP 2 (dp 1)", "pp2": "PP 2, 1f1b, 2 micro-batches", "hsdp2x2": "HSDP 2x2 (zero 3), 4 ranks",
            "tp2xpp2": "TP 2 x PP 2, 1f1b, 4 ranks", "ddp_tp2_dp2": "DDP (replicate) x TP 2, dp 2, 4 ranks",
            "zero1_pp2_dp2": "ZeRO-1 (sharded by owner) x PP 2, dp 2, 4 ranks",
            "zero3_pp2_dp2": "ZeRO-3 (FSDP2) x PP 2, dp 2, 4 ranks", "pp2_uneven": "PP 2, 1f1b, blocks 3 + 5",
            "moe_zero3": "MoE 8 experts, ZeRO-3 (FSDP2), dp 2", "moe_ep2": "MoE, EP 2 (ZeRO-3), dp 2",
            "moe_ep2_dp2": "MoE, EP 2 x expert FSDP 2, dp 4", "moe_ep4": "MoE, EP 4, dp 4",
            "moe_ep2_cp2": "MoE, EP 2 x CP 2 (experts FSDP over cp), dp 2",
            "lora_ddp": "LoRA r16, DDP, dp 2", "lora_zero1": "LoRA r16, ZeRO-1, dp 2", "lora_zero2": "LoRA r16, ZeRO-2, dp 2",
            "lora_zero3": "LoRA r16, ZeRO-3 (FSDP2), dp 2", "lora_tp2": "LoRA r16, TP 2", "lora_pp2": "LoRA r16, PP 2, 1f1b"}


SET: list[str] = []  # --set: config overrides after every layout's own (the runs' and the planner's)


def overrides(name: str, model: str = "small") -> list[str]:
    n, extra = LAYOUTS[name]
    return [*COMMON, f"model={model}", f"launcher.nproc={n}", *extra, *SET]


# ---------------------------------------------------------------------------------------------
# rank side


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def rss_parts() -> dict:
    """This process's resident pages by kind (/proc/self/status, bytes): anonymous (heap, tensors,
    Python objects) and file-backed (pages of the shared libraries and files mapped in)."""
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem"):
                d[k] = int(v.split()[0]) * 1024
    d.update(malloc_parts())
    return d


def malloc_parts() -> dict:
    """glibc's own account (mallinfo2, every arena): bytes of the heap in use by small allocations,
    free holes it keeps, and bytes in mmapped blocks (the tensors above MALLOC_MMAP_THRESHOLD_)."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        f = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # not glibc >= 2.33
        return {}
    f.restype = Info
    i = f()
    return {"heap_used": i.uordblks, "heap_free": i.fordblks, "mmapped": i.hblkhd, "mmapped_blocks": i.hblks}


def worker(out: str, spec: str) -> None:
    import gc

    import torch

    from _ranks import (compose_cfg, finish, gather, peak_rss_bytes, preimport, rss_bytes, start_rank,
                        trainer, write_json)

    a = json.loads(spec)
    de = start_rank(threads=1, timeout_s=300)
    preimport()
    cfg = compose_cfg(a["overrides"])
    gc.collect()
    base, base_peak = rss_bytes(), peak_rss_bytes()
    parts = [rss_parts()]  # at the baseline, once built, after each step
    t = trainer(cfg, de.rank)
    built = rss_bytes()
    parts.append(rss_parts())
    # Per step, peak - base once forward/backward is done (gradient clipping starts) and once
    # clipping is done; with peak_after_step (after the optimizer) they say which phase sets the peak.
    phases: list = []
    import hpctrain.train.loop as train_mod

    clip = train_mod.grad_norm_and_clip

    def clip_watched(*args, **kw):
        phases.append([peak_rss_bytes() - base])
        out = clip(*args, **kw)
        phases[-1].append(peak_rss_bytes() - base)
        return out

    train_mod.grad_norm_and_clip = clip_watched
    times, losses, rss_steps, peak_steps = [], [], [], []
    for i in range(a["steps"]):
        t0 = time.perf_counter()
        loss, _ = t.train_step()
        losses.append(loss.item())  # waits for the step
        times.append(time.perf_counter() - t0)
        rss_steps.append(rss_bytes() - base)
        peak_steps.append(peak_rss_bytes() - base)
        phases[-1].append(peak_steps[-1])
        parts.append(rss_parts())
    after_first = rss_steps[0] + base
    peak = peak_rss_bytes()
    opt = getattr(t.optimizer, "optim", t.optimizer)  # ZeroRedundancyOptimizer wraps the local one
    state = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    mine = {"rank": de.rank, "base_rss": base, "base_peak": base_peak, "built_rss": built,
            "after_first_step_rss": after_first, "peak_rss": peak, "delta_peak": peak - base,
            "param_bytes": sum(_local_bytes(p) for p in t.params), "optim_state_bytes": state,
            "stages": list(t.par.stage_indices) if t.schedule is not None else None,
            "step_times": times, "losses": losses, "rss_after_step": rss_steps, "peak_after_step": peak_steps,
            "phase_peaks": phases, "rss_parts": parts}
    ranks = gather(mine)
    if de.rank == 0:
        write_json(out, ranks)
    finish()


# ---------------------------------------------------------------------------------------------
# driver side


def predicted(name: str, model: str) -> tuple[list[dict], dict]:
    """The planner's device bytes (by kind) for each rank's pipeline stage, and its job summary."""
    from hpctrain.core.compose import compose
    from hpctrain.plan.memory import job_of, stage_memory

    n = LAYOUTS[name][0]
    cfg = compose(overrides(name, model))
    job = job_of(cfg, n)
    lay = job.spec.layout
    per_stage = {s: stage_memory(job, s)[0] for s in range(lay.pp)}
    ranks = [per_stage[r // (n // lay.pp)] for r in range(n)]  # mesh order (pp, dp_rep, dp_shard, tp)
    return ranks, {"layout": lay.describe(), "zero": job.spec.zero, "microbatches": job.microbatches,
                   "tokens_per_step": job.spec.global_batch * job.spec.seq_len}


def summarize(name: str, model: str, runs: dict, skip: int, cores: int) -> dict:
    """`runs`: mode -> the raw per-rank lists of each repetition."""
    n = LAYOUTS[name][0]
    pred, job = predicted(name, model)
    mem, speed = runs["memory"], runs["speed"]
    ranks = []
    for r in range(n):
        mine = [run[r] for run in mem]
        delta = median([m["delta_peak"] for m in mine])
        p = sum(pred[r].values())
        ranks.append({"rank": r, "measured": delta, "predicted": p, "ratio": delta / p,
                      "glibc_default": median([run[r]["delta_peak"] for run in speed]),
                      "built": median([m["built_rss"] - m["base_rss"] for m in mine]),
                      "steady": median([m["rss_after_step"][-1] for m in mine]),
                      "phase_peaks": mine[0].get("phase_peaks"),
                      "after_first_step": median([m["after_first_step_rss"] - m["base_rss"] for m in mine]),
                      "param_bytes": mine[0]["param_bytes"], "optim_state_bytes": mine[0]["optim_state_bytes"],
                      "predicted_breakdown": pred[r], "stages": mine[0]["stages"],
                      "base_rss": median([m["base_rss"] for m in mine]),
                      "peak_after_step": mine[0]["peak_after_step"],
                      "glibc_peak_after_step": speed[0][r]["peak_after_step"],
                      # library pages touched since the baseline (RssFile grows, never shrinks here)
                      "file_backed": median([m["rss_parts"][-1]["RssFile"] - m["rss_parts"][0]["RssFile"]
                                             for m in mine if "rss_parts" in m])})
    step = median([median(run[0]["step_times"][skip:]) for run in speed])
    best = min(min(run[0]["step_times"][skip:]) for run in speed)
    worst = max(ranks, key=lambda x: x["measured"])
    return {"name": name, "model": model, "describe": DESCRIBE.get(name, name), "ranks_n": n, "oversubscribed": n > cores, **job,
            "step_s": step, "tokens_per_s": job["tokens_per_step"] / step, "best_step_s": best,
            "loss_last": median([run[0]["losses"][-1] for run in speed]), "per_rank": ranks,
            "worst_measured": worst["measured"], "worst_predicted": max(x["predicted"] for x in ranks),
            "worst_ratio": worst["measured"] / max(x["predicted"] for x in ranks),
            "worst_glibc_default": max(x["glibc_default"] for x in ranks)}


def table(rows: list[dict]) -> str:
    def mib(x):
        return f"{x / MiB:.0f}"

    def each(r, key):
        return " ".join(mib(x[key]) for x in r["per_rank"])

    out = ["| layout | ranks | tokens/s | step s median (best) | measured MiB (per rank) | predicted MiB | "
           "measured/predicted | steady MiB after a step | of which file-backed | params+optim state MiB | "
           "glibc default MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pr = r["per_rank"]
        flag = " (oversubscribed)" if r["oversubscribed"] else ""
        out.append(f"| {r['describe']} | {r['ranks_n']} | {r['tokens_per_s']:,.0f}{flag} | "
                   f"{r['step_s']:.2f} ({r['best_step_s']:.2f}) | {each(r, 'measured')} | {each(r, 'predicted')} | "
                   f"{' '.join(format(x['ratio'], '.2f') for x in pr)} | {each(r, 'steady')} | "
                   f"{' '.join(mib(x['file_backed']) if x.get('file_backed') is not None else '-' for x in pr)} | "
                   f"{' '.join(mib(x['param_bytes'] + x['optim_state_bytes']) for x in pr)} | "
                   f"{each(r, 'glibc_default')} |")
    return "\n".join(out)


def breakdown_table(rows: list[dict]) -> str:
    kinds = []
    for r in rows:
        for x in r["per_rank"]:
            kinds += [k for k in x["predicted_breakdown"] if k not in kinds]
    out = ["| layout (rank 0) | " + " | ".join(kinds) + " | total |", "|---" * (len(kinds) + 2) + "|"]
    for r in rows:
        b = r["per_rank"][0]["predicted_breakdown"]
        out.append(f"| {r['name']} | " + " | ".join(f"{b.get(k, 0) / MiB:.0f}" for k in kinds)
                   + f" | {sum(b.values()) / MiB:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    x0 = 0.0
    ticks, labels = [], []
    for r in rows:
        n = r["ranks_n"]
        xs = [x0 + i * 0.8 for i in range(n)]
        ax.bar(xs, [p["glibc_default"] / MiB for p in r["per_rank"]], width=0.7, color="tab:blue", alpha=0.3,
               label="same, glibc's default malloc" if x0 == 0 else None)
        ax.bar(xs, [p["measured"] / MiB for p in r["per_rank"]], width=0.7, color="tab:blue",
               label="measured peak RSS - baseline (fixed mmap threshold)" if x0 == 0 else None)
        ax.plot(xs, [p["predicted"] / MiB for p in r["per_rank"]], "D", color="tab:red", ms=7,
                label="planner's prediction" if x0 == 0 else None)
        ax.plot(xs, [(p["param_bytes"] + p["optim_state_bytes"]) / MiB for p in r["per_rank"]], "_",
                color="k", ms=18, mew=2, label="params + optimizer state (exact)" if x0 == 0 else None)
        ticks.append(sum(xs) / n)
        labels.append(r["name"])
        x0 = xs[-1] + 1.4
    ax.set_xticks(ticks, labels, rotation=20)
    top = max(max(p["glibc_default"], p["measured"], p["predicted"]) for r in rows for p in r["per_rank"])
    ax.set_ylim(0, top / MiB * 1.4)  # room for the legend
    ax.set_ylabel("MiB per rank (one bar per rank)")
    ax.set_title("memory per rank: measured vs planner")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    colors = ["tab:gray" if r["oversubscribed"] else "tab:green" for r in rows]
    bx.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    bx.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=20)
    bx.set_ylabel("tokens/s (all ranks)")
    bx.set_title("throughput (gray: more ranks than cores)")
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(model: str, rows: list[dict], a, cores: int, wall_s: float, out: Path) -> list[str]:
    """Write `out`/results.json and layouts.png for one model's rows, print its tables; the layouts
    whose every rank is within 10% of the planner."""
    zero = {r["name"]: r["worst_measured"] for r in rows if r["name"] in ("ddp", "zero1", "zero2", "zero3")}
    order = [zero[k] for k in ("ddp", "zero1", "zero2", "zero3") if k in zero]
    falls = all(x > y for x, y in zip(order, order[1:]))
    # The issue's criterion, per rank: every rank of the layout within 10% of its prediction.
    within = [r["name"] for r in rows if all(abs(x["ratio"] - 1) <= 0.10 for x in r["per_rank"])]
    glibc = [next(r["worst_glibc_default"] for r in rows if r["name"] == k)
             for k in ("ddp", "zero1", "zero2", "zero3") if k in zero]
    summary = {"when": time.strftime("%F %T"), "model": model, "common": [*COMMON, f"model={model}"], "set": SET,
               "steps": a.steps, "mem_steps": a.mem_steps, "skip": a.skip, "reps": a.reps, "cores": cores,
               "modes": MODES, "wall_s": wall_s, "zero_memory_falls": falls, "zero_memory_worst": order,
               "zero_memory_glibc_default": glibc, "within_10_percent": within, "reanalysed_only": a.reanalyse,
               "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"\n## model={model}\n")
    print(table(rows))
    print(f"\nplanner's predicted breakdown, MiB (rank 0), model={model}:")
    print(breakdown_table(rows))
    print(f"\nwith glibc's default malloc the same worst ranks hold {' > '.join(f'{x / MiB:.0f}' for x in glibc)} MiB")
    print(f"per-rank memory falls with the ZeRO stage (0 > 1 > 2 > 3, worst rank): {falls} "
          f"({' > '.join(f'{x / MiB:.0f}' for x in order)} MiB)")
    print(f"model={model}: every rank within 10% of the planner: {len(within)} of {len(rows)} layouts {within}")
    if rows:
        plot(rows, out / "layouts.png")
    print(f"results: {out / 'results.json'}, plot: {out / 'layouts.png'}")
    return within


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DENSE_LAYOUTS, choices=list(LAYOUTS),
                    help="default: every dense layout; the MoE ones (moe_*) when named")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="conf/model configs to measure, each with every layout (outputs under --out/<model>)")
    ap.add_argument("--steps", type=int, default=5, help="steps of the speed run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of tokens/s")
    ap.add_argument("--mem-steps", type=int, default=4,
                    help="steps of the memory run: the peak comes once the optimizer state exists (step 2) and, "
                         "for DDP and ZeRO-1 under gradient accumulation only from step 3 (measured: 686 -> 778 MiB)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions (one launch each)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "layouts")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides for every layout, e.g. cluster.runtime_reserve_gb=0.02 (with "
                         "--reanalyse: what the planner predicts under them for the runs on disk)")
    ap.add_argument("--reanalyse", action="store_true", help="run nothing: rebuild outputs from --out's raw files")
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "SPEC"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    SET[:] = a.set
    for model in a.models:
        (a.out / model).mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for rep in range(a.reps):
        for model in a.models:
            for name in a.layouts:
                for mode, env in MODES.items():
                    raw = a.out / model / f"raw-{name}-{mode}-{rep}.json"
                    if a.reanalyse:
                        continue
                    t0 = time.perf_counter()
                    steps = a.mem_steps if mode == "memory" else a.steps
                    spec = json.dumps({"overrides": overrides(name, model), "steps": steps})
                    launch_ranks(a.out / model / "runs" / f"{name}-{mode}-{rep}", LAYOUTS[name][0],
                                 [str(Path(__file__).resolve()), "--worker", str(raw), spec], env=env)
                    ranks = json.loads(raw.read_text())
                    print(f"rep {rep} {model:5s} {name:8s} {mode:6s} peak-baseline MiB per rank "
                          f"{[round(x['delta_peak'] / MiB) for x in ranks]}, step s "
                          f"{[round(x, 2) for x in ranks[0]['step_times']]} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
    cores = os.cpu_count() or 1
    wall = time.perf_counter() - t_all
    verdict = {}
    for model in a.models:
        rows = []
        for name in a.layouts:
            runs = {mode: [json.loads(p.read_text()) for p in sorted((a.out / model).glob(f"raw-{name}-{mode}-*.json"))]
                    for mode in MODES}
            if all(runs.values()):
                rows.append(summarize(name, model, runs, a.skip, cores))
        verdict[model] = (report(model, rows, a, cores, wall, a.out / model), len(rows))
    print()
    for model, (within, n) in verdict.items():
        print(f"model={model}: {len(within)} of {n} layouts with every rank within 10% {within}")
    print(f"({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
