"""The single-GPU check: a ~1B Llama with bf16, FSDP2 and torch.compile on one GPU (an H200 when lent),
tokens/s and MFU against the bf16 matmul peak measured on the same GPU in the same run.

    python benchmarks/gpu_1b.py [--steps 30] [--seq 4096] [--micro 4] [--out outputs/bench/gpu_1b]

Prints the measured matmul peak, the training tokens/s, model TFLOP/s and MFU (target >= 0.5 of the
measured peak), and the planner's predicted step time for the same shape on a cluster with that peak
(plan.json of the run) against the measured one (target: within 15%); writes results.json. Needs
CUDA; refuses to run without it (exit code 2).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "gpu_1b")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_1b: no CUDA device here", file=sys.stderr)
        return 2
    peak = matmul_peak_tflops()
    print(f"measured bf16 matmul peak: {peak:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    run = a.out / "run"
    cmd = [sys.executable, "-m", "hpctrain", "+experiment=tiny", "model=1b", "cluster=h200", "launcher=local",
           "launcher.nproc=1", "parallel=fsdp", "train.precision=bf16", "train.compile=true",
           f"train.steps={a.steps}", f"data.seq_len={a.seq}", f"train.micro_batch={a.micro}",
           f"train.global_batch={a.micro}", f"cluster.peak_tflops={peak}", f"run.dir={run}",
           "checkpoint.resume=false", "optim.warmup_steps=5"]
    subprocess.run(["rm", "-rf", str(run)])
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 3:]  # compile and warm-up steps left out
    tps = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2]
    mfu = sorted(r["mfu"] for r in steady)[len(steady) // 2]
    step_s = sorted(r["step_time_s"] for r in steady)[len(steady) // 2]
    plan = json.loads((run / "plan.json").read_text())
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_peak_tflops": peak,
           "tokens_per_s": tps, "model_tflops": mfu * peak, "mfu_vs_measured_peak": mfu, "seq_len": a.seq,
           "micro_batch": a.micro, "step_time_s": step_s, "predicted_step_time_s": plan["step_time_s"],
           "predicted_over_measured": plan["step_time_s"] / step_s, "predicted_memory_gib": plan["memory_per_gpu_bytes"] / 2**30,
           "peak_mem_gib": max(r["mem_bytes"] for r in rows) / 2**30, "wall_s": time.time() - t0}
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"MFU {mfu:.1%} of the measured peak (target >= 50%); planned step time {plan['step_time_s']:.3f} s "
          f"vs measured {step_s:.3f} s = {res['predicted_over_measured']:.2f} (target 0.85-1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
