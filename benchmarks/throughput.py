"""Tokens/s of hpctrain's training loop against a plain hand-written torch DDP loop (plain_ddp.py)
on the same model and data, measured in the same run.

    python benchmarks/throughput.py [--steps 20] [--skip 4] [--out outputs/bench/throughput]

Both loops live in the same 2 ranks and take turns step by step (hpctrain DDP, plain DDP,
hpctrain FSDP2, in an order that rotates every step), so a shared, noisy machine slows them alike
and the ratio holds. hpctrain's
step is the whole per-step work of Trainer.fit: the training step, the loss read-back, the
collective preemption check and a metrics.jsonl record. Prints a table and the median ratio of
adjacent steps; writes results.json and a PNG.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPE = dict(dim=512, layers=8, heads=8, kv_heads=4, ffn=1536, vocab=8192, seq=128, batch=8, micro=4)


def overrides(parallel: str) -> list[str]:
    s = SHAPE
    return ["+experiment=tiny", f"parallel={parallel}", "launcher.nproc=2", "model=small", f"model.dim={s['dim']}",
            f"model.n_layers={s['layers']}", f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv_heads']}",
            f"model.ffn_dim={s['ffn']}", f"model.vocab_size={s['vocab']}", f"data.seq_len={s['seq']}",
            f"train.global_batch={s['batch']}", f"train.micro_batch={s['micro']}", "train.steps=100000"]


def worker(out: Path, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from hpctrain.core.compose import compose
    from hpctrain.distributed.bootstrap import detect, init
    from hpctrain.train.metrics import MetricsLogger
    from hpctrain.train.preempt import Preemption
    from hpctrain.train.loop import Trainer

    sys.path.insert(0, str(Path(__file__).parent))
    from plain_ddp import PlainDDP

    de = detect()
    init(de, "gloo", 300, 0)
    tmp = Path(tempfile.mkdtemp())
    contenders = {}
    for parallel in ("ddp", "fsdp"):
        run = tmp / parallel
        run.mkdir()
        t = Trainer.of(compose([*overrides(parallel), f"run.dir={run}"]), str(run), torch.device("cpu"))
        logger = MetricsLogger(run, steps, stream=open("/dev/null", "w")) if de.rank == 0 else None
        pre = Preemption()

        def hp_step(i, t=t, logger=logger, pre=pre):
            loss, norm = t.train_step()
            v = loss.item()
            if logger:
                logger.log(i + 1, loss=v, grad_norm=float(norm), lr=0.0, tokens_per_s=0.0, mfu=0.0, mem_bytes=0)
            pre.agreed()
            return v

        contenders[f"hpctrain {parallel}"] = hp_step
    plain = PlainDDP(**SHAPE)
    contenders["plain ddp"] = plain.step
    names = ["hpctrain ddp", "plain ddp", "hpctrain fsdp"]
    times = {k: [] for k in names}
    for i in range(steps):
        # The order rotates every step: none always runs first (after the barrier) or last.
        for k in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            contenders[k](i)
            times[k].append(time.perf_counter() - t0)
    if de.rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=4, help="warm-up steps left out")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "throughput")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps)
        return 0
    from hpctrain.launch.local import launch

    a.out.mkdir(parents=True, exist_ok=True)
    raw = a.out / "times.json"
    rc = launch(a.out / "ranks", 2, cmd=[sys.executable, __file__, "--worker", str(raw), "--steps", str(a.steps)])
    if rc != 0:
        raise SystemExit(f"benchmark ranks failed: see {a.out}/ranks/logs")
    times = json.loads(raw.read_text())
    tokens = SHAPE["batch"] * SHAPE["seq"]
    s = a.skip
    tps = {k: [tokens / t for t in v] for k, v in times.items()}
    ratio = [h / p for h, p in zip(tps["hpctrain ddp"][s:], tps["plain ddp"][s:])]
    ratio_fsdp = [h / p for h, p in zip(tps["hpctrain fsdp"][s:], tps["plain ddp"][s:])]
    summary = {"shape": SHAPE, "steps": a.steps, "skip": s, "when": time.strftime("%F %T"),
               "median_tokens_per_s": {k: statistics.median(v[s:]) for k, v in tps.items()},
               "ratio_hpctrain_ddp_over_plain": {"median": statistics.median(ratio), "min": min(ratio),
                                                 "max": max(ratio)},
               "ratio_hpctrain_fsdp_over_plain": {"median": statistics.median(ratio_fsdp), "min": min(ratio_fsdp),
                                                  "max": max(ratio_fsdp)},
               "step_times_s": times}
    (a.out / "results.json").write_text(json.dumps(summary, indent=1))
    print("| loop | median tokens/s (2 ranks) |\n|---|---|")
    for k, v in summary["median_tokens_per_s"].items():
        print(f"| {k} | {v:,.0f} |")
    for name, key in (("hpctrain ddp / plain ddp", "ratio_hpctrain_ddp_over_plain"),
                      ("hpctrain fsdp / plain ddp", "ratio_hpctrain_fsdp_over_plain")):
        r = summary[key]
        print(f"{name}: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}) over {len(ratio)} step pairs")
    plot(tps, s, a.out / "throughput.png")
    print(f"results: {a.out / 'results.json'}, plot: {a.out / 'throughput.png'}")
    return 0


def plot(tps: dict, skip: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in tps.items():
        ax.plot(range(1, len(v) + 1), v, marker="o", ms=3, label=k)
    ax.axvspan(0.5, skip + 0.5, color="0.9", label="warm-up (left out)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s (2 ranks)")
    ax.set_title("hpctrain's loop vs a plain torch DDP loop, taking turns step by step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
