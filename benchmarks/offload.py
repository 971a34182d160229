"""Optimizer offload benchmark: the host AdamW step, the NVMe swap, and a step with NVMe offload.

    python benchmarks/offload.py [--params 100e6] [--reps 7] [--io-gib 1] [--dir outputs/bench/offload]

1. CPU step (params/s, ~100M fp32 parameters, all cores): every contender interleaved in the same run,
   the order rotated each repetition, best and median reported:
     ceiling       memory-only kernels with Adam's access pattern in one pass (read p, g, m, v; write
                   p, m, v; mixed precision also writes the bf16 copy), in C++ (AVX2) and compiled by
                   Inductor; per repetition the faster of the two is the ceiling
     hpctrain      the single-pass AdamW kernels (hpctrain.offload.adam_kernel) on one flat tensor:
                   C++ (what kernel=auto uses) and torch.compile
     HostAdamW     the optimizer itself (kernel=auto) over Llama-shaped tensors (per-tensor costs
                   included; mixed precision: bf16 parameters, bf16 gradients, fp32 master weights)
     torch fused   torch.optim.AdamW(fused=True)   (+ a copy to bf16 in mixed precision)
     torch foreach torch.optim.AdamW(foreach=True) (+ copy)
     DeepSpeed     deepspeed.ops.adam.DeepSpeedCPUAdam (+ copy: 0.19.8 has no fused copy-back on step())
   Ratios to the ceiling are given best/best and as the median of paired ratios: both ceilings are
   timed right before every run of every contender, so each pair shares the load other programs put
   on the machine at that moment. Ratios to DeepSpeed pair runs of the same repetition.
2. NVMe swap of --io-gib GiB: write and read GB/s of an O_DIRECT baseline writer (4 threads, 8 MiB,
   benchmarks/checkpoint.py's), of hpctrain.offload.aio.AsyncIO, and of DeepSpeed's AsyncIO with
   page-locked buffers when its async_io op builds here (libaio-dev; cached in TORCH_EXTENSIONS_DIR).
3. A step with offload=nvme over --io-gib GiB of moments, against max(I/O time, CPU step time): the
   I/O time is writing and reading that state with AsyncIO, the CPU time an offload=cpu step.

Results go to <dir>/results.json and a Markdown table on stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "outputs" / "cache" / "inductor"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "outputs" / "cache" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from hpctrain.offload import HostAdamW  # noqa: E402
from hpctrain.offload.adam_kernel import AdamKernel, _plain, memory_ceiling_kernel  # noqa: E402
from hpctrain.checkpoint.directio import aligned_empty, open_direct  # noqa: E402
from hpctrain.offload.aio import AsyncIO  # noqa: E402

HP = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def summarize(times: list[float], n: int) -> dict:
    return {"best_s": min(times), "median_s": statistics.median(times), "best_mps": n / min(times) / 1e6,
            "median_mps": n / statistics.median(times) / 1e6, "times_s": times}


# ---------------------------------------------------------------- 1. the CPU step

def _deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its op does not build here
        log(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}")
        return None


def llama_shapes(target: float) -> list[tuple]:
    """Parameter shapes of a Llama of about `target` parameters (dim 768, GQA 12/4 heads, SwiGLU)."""
    dim, ffn, kv = 768, 2048, 256
    layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    layers = 12
    vocab = max(1000, int((target - layers * per_layer) / (2 * dim)))
    return [(vocab, dim)] + layer * layers + [(dim,), (vocab, dim)]


def cpu_step(n: int, reps: int, mixed: bool, ds_cls) -> dict:
    torch.manual_seed(0)
    p = torch.randn(n) * 0.02
    g = torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    p16 = p.bfloat16()
    ceil_cpp = memory_ceiling_kernel(copy=mixed, impl="cpp")
    ceil_ind = memory_ceiling_kernel(copy=mixed, impl="compile")
    plain = [_plain(t) for t in (p, g, m, v, p16)]
    step = [0]

    def kernel_step(kernel):
        def run():
            step[0] += 1
            kernel.step(p, g, m, v, p16 if mixed else None, step=step[0], **HP)
        return run

    contenders = {
        "ceiling (C++)": lambda: ceil_cpp(*(plain if mixed else plain[:4])),
        "ceiling (Inductor)": lambda: ceil_ind(*(plain if mixed else plain[:4])),
        "hpctrain C++ kernel": kernel_step(AdamKernel("cpp")),
        "hpctrain compiled kernel": kernel_step(AdamKernel("compile")),
    }

    # the optimizer itself, over model-shaped tensors (its own parameters: same count)
    shapes = llama_shapes(n)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    if mixed:  # bf16 parameters, fp32 master weights with the optimizer
        params = [torch.nn.Parameter(q.detach().bfloat16()) for q in params]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    host = HostAdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                     weight_decay=HP["weight_decay"], offload=dict(target="cpu"))
    host_n = sum(q.numel() for q in params)
    contenders["HostAdamW"] = host.step

    def torch_opt(**kw):
        param = torch.nn.Parameter(p)  # shares p's memory
        param.grad = g
        opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                weight_decay=HP["weight_decay"], **kw)

        def run():
            opt.step()
            if mixed:
                p16.copy_(param.detach())  # the copy-back: a second pass
        return run

    contenders["torch fused"] = torch_opt(fused=True)
    contenders["torch foreach"] = torch_opt(foreach=True)
    if ds_cls is not None:
        param = torch.nn.Parameter(p)
        param.grad = g
        ds = ds_cls([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                    weight_decay=HP["weight_decay"], adamw_mode=True)

        def ds_run():
            ds.step()
            if mixed:
                p16.copy_(param.detach())
        contenders["DeepSpeedCPUAdam"] = ds_run

    for name, fn in contenders.items():  # warm up: compile, allocate state
        fn()
        fn()
    ceilings = ("ceiling (C++)", "ceiling (Inductor)")
    names = [k for k in contenders if k not in ceilings]
    times = {k: [] for k in contenders}
    adjacent = {k: [] for k in names}  # the ceiling timed right before each run of k
    sizes = {k: host_n if k == "HostAdamW" else n for k in contenders}

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            tc = [timed(contenders[c]) for c in ceilings]
            for c, t in zip(ceilings, tc):
                times[c].append(t)
            adjacent[name].append(min(tc))
            times[name].append(timed(contenders[name]))
        log(f"  {'mixed' if mixed else 'fp32'} rep {r + 1}/{reps}: " +
            ", ".join(f"{k} {sizes[k] / times[k][-1] / 1e6:.0f}" for k in contenders) + " Mparam/s")
    times["ceiling"] = [min(a, b) for a, b in zip(*(times[c] for c in ceilings))]
    sizes["ceiling"] = n
    out = {k: summarize(t, sizes[k]) for k, t in times.items()}
    best_ceiling = out["ceiling"]["best_mps"]
    for k in out:
        out[k]["over_ceiling_best"] = out[k]["best_mps"] / best_ceiling
        pairs = (zip(times[k], adjacent[k]) if k in adjacent else zip(times[k], times["ceiling"]))
        out[k]["over_ceiling_median"] = statistics.median((sizes[k] / t) / (n / c) for t, c in pairs)
    if "DeepSpeedCPUAdam" in times:
        ds_t, ds_best = times["DeepSpeedCPUAdam"], out["DeepSpeedCPUAdam"]["best_mps"]
        for k in names:
            out[k]["over_deepspeed_best"] = out[k]["best_mps"] / ds_best
            out[k]["over_deepspeed_median"] = statistics.median(
                (sizes[k] / t) / (n / d) for t, d in zip(times[k], ds_t))
    host.close()
    return {"params": n, "host_adamw_params": host_n, "bytes_per_param": 30 if mixed else 28,
            "threads": torch.get_num_threads(), "contenders": out}


# ---------------------------------------------------------------- 2. the NVMe swap

def direct_baseline(path: Path, nbytes: int, write: bool, threads: int = 4) -> float:
    """benchmarks/checkpoint.py's O_DIRECT writer: `threads` regions, 8 MiB requests, page-aligned."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoint import direct_io

    return direct_io(path, nbytes, write, threads)


def ours_io(path: Path, buf: torch.Tensor, write: bool, queue_depth: int, block: int) -> float:
    """hpctrain.offload.aio: one request per chunk of the buffer, split into `block` pieces."""
    if write and path.exists():
        path.unlink()
    if write:
        fd, _ = open_direct(str(path), True)
    else:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    io = AsyncIO(queue_depth, block)
    t0 = time.perf_counter()
    (io.write if write else io.read)(fd, buf, 0).wait()
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    io.close()
    os.close(fd)
    return dt


def _deepspeed_aio(block: int, queue_depth: int):
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None, "AsyncIOBuilder is not compatible here (libaio-dev missing?)"
        mod = AsyncIOBuilder().load(verbose=False)
        return mod.aio_handle(block, queue_depth, False, True, 4), None  # 4 threads: intra-op parallelism
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def swap(d: Path, nbytes: int, reps: int, queue_depth: int, block: int) -> dict:
    f = d / "swap.bin"
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    ds, why = _deepspeed_aio(1 << 20, 8)
    ds_buf = None
    if ds is not None:
        ds_buf = ds.new_cpu_locked_tensor(nbytes // 4, torch.empty(0, dtype=torch.float32))
        ds_buf.view(torch.uint8).copy_(buf)
    else:
        log(f"DeepSpeed AsyncIO unavailable: {why}")
    res = {"baseline": {"write_s": [], "read_s": []}, "hpctrain": {"write_s": [], "read_s": []}}
    if ds is not None:
        res["DeepSpeed AsyncIO (locked)"] = {"write_s": [], "read_s": []}
    for r in range(reps):
        for name in list(res):
            if f.exists():
                f.unlink()
            if name == "baseline":
                w = direct_baseline(f, nbytes, True)
                rd = direct_baseline(f, nbytes, False)
            elif name == "hpctrain":
                w = ours_io(f, buf, True, queue_depth, block)
                rd = ours_io(f, buf, False, queue_depth, block)
            else:
                t0 = time.perf_counter()
                ds.sync_pwrite(ds_buf, str(f))
                w = time.perf_counter() - t0
                t0 = time.perf_counter()
                ds.sync_pread(ds_buf, str(f))
                rd = time.perf_counter() - t0
            res[name]["write_s"].append(w)
            res[name]["read_s"].append(rd)
            log(f"  swap rep {r + 1}/{reps} {name}: write {nbytes / w / 1e9:.2f} GB/s, "
                f"read {nbytes / rd / 1e9:.2f} GB/s")
    if f.exists():
        f.unlink()
    for name, t in res.items():
        for k in ("write", "read"):
            ts = t[f"{k}_s"]
            t[f"{k}_gbps_best"] = nbytes / min(ts) / 1e9
            t[f"{k}_gbps_median"] = nbytes / statistics.median(ts) / 1e9
    if ds is None:
        res["DeepSpeed AsyncIO (locked)"] = {"unavailable": why}
    return {"bytes": nbytes, "queue_depth": queue_depth, "block_bytes": block, "contenders": res}


# ---------------------------------------------------------------- 3. a step with NVMe offload

def nvme_step(d: Path, state_bytes: int, reps: int, queue_depth: int, block: int) -> dict:
    n = state_bytes // 8  # two fp32 moments per parameter
    parts = 16
    params = [torch.nn.Parameter(torch.randn(n // parts) * 0.02) for _ in range(parts)]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    kw = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    cpu = HostAdamW(params, **kw, offload=dict(target="cpu"))
    nv = HostAdamW(params, **kw, offload=dict(target="nvme", path=str(d),
                                              queue_depth=queue_depth, block_bytes=block))
    io_buf = aligned_empty(state_bytes)
    f = d / "io.bin"
    times = {"cpu_step_s": [], "nvme_step_s": [], "io_write_s": [], "io_read_s": [], "swap_only_s": []}
    cpu.step()
    nv.step()
    for r in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        cpu.step()
        times["cpu_step_s"].append(time.perf_counter() - t0)
        times["io_write_s"].append(ours_io(f, io_buf, True, queue_depth, block))
        times["io_read_s"].append(ours_io(f, io_buf, False, queue_depth, block))
        t0 = time.perf_counter()
        for _ in nv._store.stream():  # the swap alone: read and write every chunk, no update
            pass
        times["swap_only_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        nv.step()
        times["nvme_step_s"].append(time.perf_counter() - t0)
        log(f"  nvme step rep {r + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()))
    f.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    io = med["io_write_s"] + med["io_read_s"]
    bound = max(io, med["cpu_step_s"])
    per_rep = [s / max(w + rd, c) for s, w, rd, c in
               zip(times["nvme_step_s"], times["io_write_s"], times["io_read_s"], times["cpu_step_s"])]
    out = {"params": n, "state_bytes": state_bytes, "chunk_mb": nv.offload.chunk_mb,
           "buffer_count": nv.offload.buffer_count, "direct_io": nv._store.direct, "times": times,
           "median": med, "io_s": io, "bound_s": bound, "step_over_bound": med["nvme_step_s"] / bound,
           "step_over_bound_per_rep_median": statistics.median(per_rep),
           "nvme_effective_gbps": 2 * state_bytes / med["nvme_step_s"] / 1e9}
    cpu.close()
    nv.close()
    return out


# ---------------------------------------------------------------- main

def table(res: dict) -> str:
    lines = []
    for mode in ("fp32", "mixed"):
        c = res.get(f"cpu_{mode}")
        if not c:
            continue
        lines.append(f"\n### CPU AdamW step, {mode}{' (bf16 params written back)' if mode == 'mixed' else ''}: "
                     f"{c['params'] / 1e6:.0f} M params, {c['threads']} threads, {c['bytes_per_param']} B/param moved")
        lines.append("| contender | best Mparam/s | median Mparam/s | best / best ceiling | median paired "
                     "ratio to ceiling | best / best DeepSpeed | median per-rep ratio to DeepSpeed |")
        lines.append("|---|---|---|---|---|---|---|")
        for k, v in c["contenders"].items():
            lines.append(f"| {k} | {v['best_mps']:.0f} | {v['median_mps']:.0f} | {v['over_ceiling_best']:.2f} | "
                         f"{v['over_ceiling_median']:.2f} | {v.get('over_deepspeed_best', float('nan')):.2f} | "
                         f"{v.get('over_deepspeed_median', float('nan')):.2f} |")
    s = res.get("swap")
    if s:
        lines.append(f"\n### NVMe swap of {s['bytes'] / 2**30:.2f} GiB (O_DIRECT; hpctrain queue depth "
                     f"{s['queue_depth']}, {s['block_bytes'] >> 20} MiB requests)")
        lines.append("| contender | write GB/s best | write median | read GB/s best | read median |")
        lines.append("|---|---|---|---|---|")
        for k, v in s["contenders"].items():
            if "unavailable" in v:
                lines.append(f"| {k} | unavailable: {v['unavailable'][:80]} | | | |")
                continue
            lines.append(f"| {k} | {v['write_gbps_best']:.2f} | {v['write_gbps_median']:.2f} | "
                         f"{v['read_gbps_best']:.2f} | {v['read_gbps_median']:.2f} |")
    st = res.get("nvme_step")
    if st:
        m = st["median"]
        lines.append(f"\n### Step with offload=nvme: {st['params'] / 1e6:.0f} M params, "
                     f"{st['state_bytes'] / 2**30:.2f} GiB of moments (medians)")
        lines.append("| cpu step s | I/O write+read s | swap only s | nvme step s | step / max(I/O, CPU) |")
        lines.append("|---|---|---|---|---|")
        lines.append(f"| {m['cpu_step_s']:.3f} | {st['io_s']:.3f} | {m['swap_only_s']:.3f} | "
                     f"{m['nvme_step_s']:.3f} | {st['step_over_bound']:.2f} (per rep {st['step_over_bound_per_rep_median']:.2f}) |")
    lines.append("\n### Targets (median paired ratios; best/best in brackets)")
    for mode, floor, ds_floor in (("fp32", 0.9, None), ("mixed", 0.85, 1.5)):
        c = res.get(f"cpu_{mode}")
        if not c:
            continue
        for k in ("hpctrain C++ kernel", "HostAdamW"):
            v = c["contenders"][k]
            line = (f"- {mode} {k}: {v['over_ceiling_median']:.2f} [{v['over_ceiling_best']:.2f}] of the ceiling "
                    f"(target >= {floor}: {'met' if v['over_ceiling_median'] >= floor else 'NOT met'})")
            if ds_floor and "over_deepspeed_median" in v:
                line += (f"; {v['over_deepspeed_median']:.2f}x [{v['over_deepspeed_best']:.2f}x] DeepSpeedCPUAdam "
                         f"(target >= {ds_floor}x: {'met' if v['over_deepspeed_median'] >= ds_floor else 'NOT met'}; "
                         f"DeepSpeed itself runs at {c['contenders']['DeepSpeedCPUAdam']['over_ceiling_median']:.2f} "
                         "of the ceiling, so no kernel under the ceiling can be more than "
                         f"{1 / c['contenders']['DeepSpeedCPUAdam']['over_ceiling_median']:.2f}x it)")
            lines.append(line)
    if st:
        ok = st["step_over_bound"] <= 1.2
        lines.append(f"- NVMe step: {st['step_over_bound']:.2f} of max(I/O, CPU step) (target <= 1.2: "
                     f"{'met' if ok else 'NOT met'})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--io-reps", type=int, default=3)
    ap.add_argument("--io-gib", type=float, default=1.0)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--block-mb", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: all cores)")
    ap.add_argument("--parts", default="cpu,swap,step")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench" / "offload")
    a = ap.parse_args()
    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    a.dir.mkdir(parents=True, exist_ok=True)
    parts = set(a.parts.split(","))
    res: dict = {"threads": threads, "torch": torch.__version__, "time": time.time()}
    ds = None if a.no_deepspeed else _deepspeed_adam()
    n = int(a.params)
    if "cpu" in parts:
        for mode in ("fp32", "mixed"):
            log(f"CPU step, {mode}:")
            res[f"cpu_{mode}"] = cpu_step(n, a.reps, mode == "mixed", ds)
            gc.collect()
    nbytes = int(a.io_gib * 2**30) // (1 << 20) * (1 << 20)
    block = a.block_mb << 20
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        if "swap" in parts:
            log("NVMe swap:")
            res["swap"] = swap(Path(d), nbytes, a.io_reps, a.queue_depth, block)
        if "step" in parts:
            log("Step with offload=nvme:")
            res["nvme_step"] = nvme_step(Path(d), nbytes, a.io_reps, a.queue_depth, block)
    (a.dir / "results.json").write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
