"""The chunked loss (train.loss=chunked) against the whole logits (train.loss=full): peak memory and step
time of the same training step on a vocabulary-heavy small model, and the planner's prediction of the
memory saved.

    python benchmarks/chunked_loss.py [--steps 8] [--out outputs/bench/chunked_loss] [--png F]

One one-rank process builds both trainers from the same weights and data and alternates their steps
(after a warm-up step each), the order swapped each round. Memory: the peak resident size during a step
(VmHWM, reset through /proc/self/clear_refs before it) above the resident size before it; the saving is
full's minus chunked's, compared with the planner's (hpctrain.plan.memory: the same config priced both
ways). Time: the ratio chunked / full of each pair of steps (they share the machine's load of their
moment) and its median. Results: <out>/results.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ranks  # noqa: E402

# dim 128, vocabulary 32768, 4,096 tokens a micro-batch: the whole logits (4096 x 32768 fp32, 512 MiB a
# copy) outweigh the rest of the step's activations many times; the automatic chunk is 1024 tokens.
MODEL = ["+experiment=tiny", "model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384",
         "model.vocab_size=32768", "data.seq_len=1024", "train.micro_batch=4", "train.global_batch=4",
         "launcher.nproc=1", "checkpoint.every=0"]


LOSSES = ("full", "chunked")


def worker(out: str, steps: int) -> None:
    """Both trainers in this one process, their steps alternated (the order swapped each round): each pair of
    steps shares the machine's load of its moment."""
    import gc

    de = _ranks.start_rank(threads=2)
    _ranks.preimport()
    trainers = {loss: _ranks.trainer(_ranks.compose_cfg([*MODEL, f"train.loss={loss}"]), de.rank)
                for loss in LOSSES}
    for t in trainers.values():
        t.train_step()  # warm-up: the optimizer's state, allocator pools
    runs = {loss: [] for loss in LOSSES}
    for i in range(steps):
        for loss in (LOSSES if i % 2 == 0 else LOSSES[::-1]):
            gc.collect()
            base = _ranks.rss_bytes()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            t0 = time.perf_counter()
            loss_v, _ = trainers[loss].train_step()
            loss_v = loss_v.item()
            runs[loss].append({"step_s": time.perf_counter() - t0, "peak_above_start": _hwm() - base, "loss": loss_v})
            print(f"step {i + 1}/{steps} {loss}: {runs[loss][-1]['step_s']:.3f} s, peak above start "
                  f"{runs[loss][-1]['peak_above_start'] / 2**20:.0f} MiB", flush=True)
    _ranks.write_json(out, runs)
    _ranks.finish()


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def planned_saving() -> dict:
    """The planner's device memory per rank of the same config, full and chunked."""
    from hpctrain.core.compose import compose
    from hpctrain.plan.memory import job_of, memory

    got = {}
    for loss in ("full", "chunked"):
        mem = memory(job_of(compose([*MODEL, f"train.loss={loss}"]), 1))
        got[loss] = {"total": mem.device_total, "by_kind": mem.device}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each, alternated")
    ap.add_argument("--out", default="outputs/bench/chunked_loss")
    ap.add_argument("--png", default=None, help="also draw the measured and planned memory, and the step times")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _ranks.launch_ranks(out / "run", 1, [__file__, "--worker", str(out / "steps.json"), "--steps", str(a.steps)], threads=2)
    runs = json.loads((out / "steps.json").read_text())
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("peak_above_start", "step_s")} for k, v in runs.items()}
    ratios = [c["step_s"] / f["step_s"] for f, c in zip(runs["full"], runs["chunked"])]
    measured = med["full"]["peak_above_start"] - med["chunked"]["peak_above_start"]
    plan = planned_saving()
    planned = plan["full"]["total"] - plan["chunked"]["total"]
    res = {"model": MODEL, "runs": runs, "median": med, "time_ratio_chunked_over_full": statistics.median(ratios),
           "time_ratios": ratios, "saving_measured": measured, "saving_planned": planned,
           "saving_measured_over_planned": measured / planned if planned else None, "plan": plan,
           "same_loss": runs["full"][0]["loss"] - runs["chunked"][0]["loss"]}
    _ranks.write_json(out / "results.json", res)
    mib = 2 ** 20
    print("\n| | full logits | chunked | chunked / full |\n|---|---|---|---|")
    print(f"| step time (median), s | {med['full']['step_s']:.3f} | {med['chunked']['step_s']:.3f} | "
          f"{res['time_ratio_chunked_over_full']:.3f} (median of {len(ratios)} pairs) |")
    print(f"| peak above the step's start, MiB | {med['full']['peak_above_start'] / mib:.0f} | "
          f"{med['chunked']['peak_above_start'] / mib:.0f} | |")
    print(f"\nsaved: measured {measured / mib:.0f} MiB, planned {planned / mib:.0f} MiB "
          f"(measured / planned {res['saving_measured_over_planned']:.3f}); the first step's loss, full - chunked: {res['same_loss']:.2e}")
    if a.png:
        draw(res, a.png)


def draw(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2 ** 20
    fig, (m, t) = plt.subplots(1, 2, figsize=(9, 3.5))
    kinds = ("full", "chunked")
    m.bar([0, 1], [res["median"][k]["peak_above_start"] / mib for k in kinds], color=["#c44", "#48c"])
    m.set_xticks([0, 1], ["full logits", "chunked"])
    m.set_ylabel("peak above the step's start, MiB")
    m.set_title(f"saved {res['saving_measured'] / mib:.0f} MiB; planner {res['saving_planned'] / mib:.0f} MiB")
    for k, c in zip(kinds, ["#c44", "#48c"]):
        t.plot([r["step_s"] for r in res["runs"][k]], "o-", color=c, label=k)
    t.set_xlabel("step (alternated)")
    t.set_ylabel("step time, s")
    t.set_title(f"chunked / full: {res['time_ratio_chunked_over_full']:.3f}")
    t.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
