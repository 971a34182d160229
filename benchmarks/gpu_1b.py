"""The single-GPU check: a ~1B Llama with bf16, FSDP2 and torch.compile on one GPU (an H200 when lent),
tokens/s and MFU against the bf16 matmul peak measured on the same GPU in the same run.

    python benchmarks/gpu_1b.py [--steps 30] [--seq 4096] [--micro 4] [--out outputs/bench/gpu_1b]

Prints the measured matmul peak, the training tokens/s, model TFLOP/s and MFU (target >= 0.5 of the
measured peak), and the planner's predicted step time for the same shape on a cluster with that peak
(plan.json of the run) against the measured one (target: within 15%); then, each for --variant-steps, the
same run with the whole logits (train.loss=full), in fp16 and, on compute capability 8.9+ with torchao, in
fp8 (tensorwise and rowwise): tokens/s over bf16's, measured and planned, and peak memory. Writes
results.json. Needs CUDA; refuses to run without it (exit code 2).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def matmul_peak_tflops(n: int = 8192, iters: int = 50) -> float:
    """Best sustained bf16 GEMM throughput of this GPU: the honest denominator for MFU."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12)
    return best


def train(overrides: list, run: Path) -> tuple:
    """metrics.jsonl's rows and plan.json of one run of `python -m hpctrain` with `overrides` in `run`."""
    subprocess.run(["rm", "-rf", str(run)])
    subprocess.run([sys.executable, "-m", "hpctrain", *overrides, f"run.dir={run}"], cwd=REPO, check=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "tokens_per_s" in r], json.loads((run / "plan.json").read_text()), run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--variant-steps", type=int, default=12, help="steps of each variant beside bf16")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "gpu_1b")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_1b: no CUDA device here", file=sys.stderr)
        return 2
    peak = matmul_peak_tflops()
    print(f"measured bf16 matmul peak: {peak:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    base = ["+experiment=tiny", "model=1b", "cluster=h200", "launcher=local", "launcher.nproc=1", "parallel=fsdp",
            "train.compile=true", f"data.seq_len={a.seq}", f"train.micro_batch={a.micro}", f"train.global_batch={a.micro}",
            f"cluster.peak_tflops={peak}", "checkpoint.resume=false", "optim.warmup_steps=5"]
    t0 = time.time()
    rows, plan, run = train(base + ["train.precision=bf16", f"train.steps={a.steps}"], a.out / "run")
    steady = rows[len(rows) // 3:]  # compile and warm-up steps left out
    tps = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2]
    mfu = sorted(r["mfu"] for r in steady)[len(steady) // 2]
    step_s = sorted(r["step_time_s"] for r in steady)[len(steady) // 2]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_peak_tflops": peak,
           "tokens_per_s": tps, "model_tflops": mfu * peak, "mfu_vs_measured_peak": mfu, "seq_len": a.seq,
           "micro_batch": a.micro, "step_time_s": step_s, "predicted_step_time_s": plan["step_time_s"],
           "predicted_over_measured": plan["step_time_s"] / step_s, "predicted_memory_gib": plan["memory_per_gpu_bytes"] / 2**30,
           "peak_mem_gib": max(r["mem_bytes"] for r in rows) / 2**30}
    # Issue 45's levers beside bf16 (each a shorter run; the ratio is of median steady steps): the whole
    # logits instead of the chunked loss (peak memory and time), fp16 with loss scaling, fp8 where the GPU
    # has it (compute capability 8.9+) and torchao is installed.
    variants = {"loss=full": ["train.precision=bf16", "train.loss=full"], "fp16": ["train.precision=fp16"]}
    if torch.cuda.get_device_capability() >= (8, 9) and importlib.util.find_spec("torchao") is not None:
        variants["fp8 tensorwise"] = ["train.precision=fp8"]
        variants["fp8 rowwise"] = ["train.precision=fp8", "train.fp8.recipe=rowwise"]
    res["variants"] = {}
    for name, over in variants.items():
        try:
            vrows, vplan, _ = train(base + over + [f"train.steps={a.variant_steps}"], a.out / f"run-{name.replace(' ', '-')}")
        except subprocess.CalledProcessError as e:
            res["variants"][name] = {"error": f"exit {e.returncode}"}
            continue
        vs = vrows[len(vrows) // 3:]
        v_tps = sorted(r["tokens_per_s"] for r in vs)[len(vs) // 2]
        res["variants"][name] = {"tokens_per_s": v_tps, "over_bf16": v_tps / tps,
                                 "peak_mem_gib": max(r["mem_bytes"] for r in vrows) / 2**30,
                                 "predicted_over_bf16": plan["step_time_s"] / vplan["step_time_s"],
                                 "final_loss": vrows[-1]["loss"]}
        print(f"{name}: {v_tps:,.0f} tokens/s = {v_tps / tps:.2f} x bf16 (planner {res['variants'][name]['predicted_over_bf16']:.2f}), "
              f"peak {res['variants'][name]['peak_mem_gib']:.1f} GiB vs {res['peak_mem_gib']:.1f}", flush=True)
    res["wall_s"] = time.time() - t0
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"MFU {mfu:.1%} of the measured peak (target >= 50%); planned step time {plan['step_time_s']:.3f} s "
          f"vs measured {step_s:.3f} s = {res['predicted_over_measured']:.2f} (target 0.85-1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
