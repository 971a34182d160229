"""A Mixture-of-Experts layer's experts as one grouped GEMM against the per-expert loop (the reference),
forward and backward, in one process, interleaved repetitions.

    python benchmarks/moe.py [--tokens 2048] [--dim 512] [--ffn 512] [--experts 8 32] [--top-k 2]
                             [--dtype fp32] [--reps 5] [--threads 0] [--out outputs/bench/moe]

Two measurements per shape:
  layer    the whole MoE layer (router, permutation, experts, weighted sum), tokens/s forward+backward,
           model.moe.grouped_mm=true against false;
  experts  the expert SwiGLUs alone on the same routed rows: grouped (torch._grouped_mm), loop, and one
           dense SwiGLU over all the rows (the same FLOPs as a single large GEMM): grouped / dense is the
           grouped-GEMM efficiency the planner takes (cluster.grouped_gemm_efficiency).
Every ratio comes from the same run, the variants alternating within each repetition; the median of
--reps is reported. Writes results.json and moe.png under --out; prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn, reps: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def shape_run(tokens: int, dim: int, ffn: int, experts: int, top_k: int, dtype: str, reps: int) -> dict:
    import torch

    from hpctrain.core.schema import ModelConfig, MoEConfig
    from hpctrain.models.moe import MoE, Routed, grouped_swiglu, looped_swiglu

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    layers = {}
    for grouped in (True, False):
        m = ModelConfig(dim=dim, moe=MoEConfig(experts=experts, top_k=top_k, ffn_dim=ffn, grouped_mm=grouped))
        layer = MoE(m).to(dt)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
            layer.router.bias.zero_()
        layers[grouped] = layer
    x = torch.randn(1, tokens, dim, dtype=dt)
    g = torch.randn(1, tokens, dim, dtype=dt)

    def layer_step(grouped: bool):
        xi = x.clone().requires_grad_()
        layers[grouped](xi).backward(g)

    # the expert GEMMs alone, on the routed rows of this batch
    layer = layers[True]
    idx, weight, _, _ = layer.router(x.reshape(-1, dim))
    routing = Routed(idx, weight, experts)
    rows = routing.permute(x.reshape(-1, dim)).detach()
    counts = routing.counts
    w1, w2, w3 = (getattr(layer.experts, n).detach().requires_grad_() for n in ("w1", "w2", "w3"))
    dense = [w[0].detach().clone().requires_grad_() for w in (w1, w2, w3)]
    gy = torch.randn(rows.shape[0], dim, dtype=dt)

    def experts_step(kind: str):
        r = rows.clone().requires_grad_()
        if kind == "grouped":
            y = grouped_swiglu(r, counts, w1, w2, w3)
        elif kind == "loop":
            y = looped_swiglu(r, counts, w1, w2, w3)
        else:  # one expert's weights over every row: the same FLOPs in one GEMM per matrix
            a, b, c = dense
            y = looped_swiglu(r, torch.tensor([r.shape[0]]), a[None], b[None], c[None])
        y.backward(gy)

    for fn in (lambda: layer_step(True), lambda: layer_step(False), lambda: experts_step("grouped"),
               lambda: experts_step("loop"), lambda: experts_step("dense")):
        fn()  # warm-up: allocator, kernels
    times: dict = {k: [] for k in ("layer_grouped", "layer_loop", "experts_grouped", "experts_loop", "experts_dense")}
    for _ in range(reps):  # interleaved: every variant once per repetition
        times["layer_grouped"].append(timed(lambda: layer_step(True)))
        times["layer_loop"].append(timed(lambda: layer_step(False)))
        times["experts_grouped"].append(timed(lambda: experts_step("grouped")))
        times["experts_loop"].append(timed(lambda: experts_step("loop")))
        times["experts_dense"].append(timed(lambda: experts_step("dense")))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": tokens, "dim": dim, "ffn": ffn, "experts": experts, "top_k": top_k, "dtype": dtype,
            "rows": int(rows.shape[0]), "counts_min": int(counts.min()), "counts_max": int(counts.max()),
            "median_s": med, "samples_s": times,
            "layer_tokens_per_s_grouped": tokens / med["layer_grouped"],
            "layer_tokens_per_s_loop": tokens / med["layer_loop"],
            "layer_speedup": med["layer_loop"] / med["layer_grouped"],
            "experts_speedup": med["experts_loop"] / med["experts_grouped"],
            "grouped_gemm_efficiency": med["experts_dense"] / med["experts_grouped"]}


def plot(results: list, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['experts']} experts\n{r['dtype']}" for r in results]
    xs = range(len(results))
    w = 0.27
    ax.bar([x - w for x in xs], [r["layer_speedup"] for r in results], w, label="whole layer: loop time / grouped time")
    ax.bar(list(xs), [r["experts_speedup"] for r in results], w, label="expert GEMMs: loop / grouped")
    ax.bar([x + w for x in xs], [r["grouped_gemm_efficiency"] for r in results], w,
           label="expert GEMMs: one dense GEMM / grouped (efficiency)")
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ratio (same run)")
    ax.set_title(f"MoE experts, forward + backward, {results[0]['tokens']} tokens x top-{results[0]['top_k']}")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "moe.png", dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                    help="bf16 matmuls are slow on CPUs without AMX: fp32 by default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "moe")
    a = ap.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for dtype in a.dtype:
        for experts in a.experts:
            r = shape_run(a.tokens, a.dim, a.ffn, experts, a.top_k, dtype, a.reps)
            results.append(r)
            print(f"{experts:4d} experts {dtype:5s} rows/expert {r['counts_min']}-{r['counts_max']}: layer "
                  f"{r['layer_tokens_per_s_grouped']:,.0f} tok/s grouped, {r['layer_tokens_per_s_loop']:,.0f} loop "
                  f"(x{r['layer_speedup']:.2f}); expert GEMMs grouped x{r['experts_speedup']:.2f} the loop, "
                  f"{r['grouped_gemm_efficiency']:.2f} of one dense GEMM", flush=True)
    (a.out / "results.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                    "results": results}, indent=1))
    plot(results, a.out)
    print(f"wrote {a.out / 'results.json'} and {a.out / 'moe.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
