"""Checkpoint save and load against the disk, and async saves against sync ones, at several sizes,
every figure paired with a baseline measured in the same run.

    python benchmarks/checkpoint.py [--dims 512,1024,1280] [--reps 3] [--threads 4] [--dir DIR]

For each model size (2 ranks, FSDP2; the checkpoint holds fp32 parameters and both Adam moments) the
ranks first do one of everything untimed (a sync save, an async save, which allocates its staging
buffers, a load, both disk baselines, a staging copy), then per repetition:

- a sync save, then the disk-write baseline: every rank writes as many bytes as its checkpoint
  file holds, with the save's own writer (hpctrain.checkpoint.raw: `checkpoint.threads` threads per
  rank, aligned O_DIRECT requests through 16 MiB bounce buffers, one fsync), at the same time;
- an async save: the time the loop is blocked, and the staging floor: every rank copying its state's
  bytes into a host buffer at the same time (memory bandwidth bounds what an async save can hide);
- after the saves, loads with the page cache dropped (where the kernel lets us), each paired with the
  disk-read baseline (the same files read back with O_DIRECT by the same number of threads).

The fixed cost of a save (opening it, planning, metadata, commit) is measured apart, as sync saves of
the tiny model (5.5 MB); the slope of the sync save times against bytes over every size is the save's
streaming speed, compared with the same slope for the disk baseline. Writes results.json and
checkpoint.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------- baselines (inside the ranks)

def raw_write(path: Path, nbytes: int, src, pool, threads: int) -> None:
    """What the checkpoint writer does with its bytes, without DCP: `threads` aligned regions of one
    file, written through the writer's bounce buffers from `src` (uint8, reused), one fsync."""
    from hpctrain.checkpoint.directio import ALIGN, open_direct, round_up
    from hpctrain.checkpoint.raw import _Region

    per = round_up(nbytes // threads, ALIGN)
    fd, direct = open_direct(str(path), True, mode=0o644)
    try:
        def share(n: int) -> None:
            region, left = _Region(fd, direct, n * per), per
            while left:
                k = min(left, src.numel())
                region.append(src[:k])
                left -= k
            region.close()

        for f in [pool.submit(share, n) for n in range(threads)]:
            f.result()
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, pool, threads: int) -> None:
    """The file read back with O_DIRECT in `threads` contiguous shares (8 MiB requests)."""
    import mmap

    size = os.path.getsize(path)
    per = (size // threads) // 4096 * 4096
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        def share(n: int) -> None:
            buf = mmap.mmap(-1, 8 << 20)
            off, end = n * per, size if n == threads - 1 else (n + 1) * per
            while off < end:
                got = os.preadv(fd, [buf], off)
                if got <= 0:
                    break
                off += got

        for f in [pool.submit(share, n) for n in range(threads)]:
            f.result()
    finally:
        os.close(fd)


def timed_together(fn) -> float:
    """Seconds from a barrier until every rank has finished `fn`."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def measure_size(dim: int, a, out_dir: Path) -> dict:
    import torch
    import torch.distributed as dist

    from hpctrain.checkpoint import directories as store
    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    rank = dist.get_rank()
    run_dir = out_dir / f"dim{dim}"
    cfg = compose(["+experiment=tiny", "launcher.nproc=2", f"model.dim={dim}", f"model.n_layers={a.layers}",
                   "model.n_heads=8", "model.n_kv_heads=4", f"model.ffn_dim={4 * dim}", f"model.vocab_size={a.vocab}",
                   "data.seq_len=32", "train.global_batch=2", "train.micro_batch=1", "checkpoint.keep=1000",
                   f"checkpoint.threads={a.threads}", f"run.dir={run_dir}"])
    t = Trainer.of(cfg, str(run_dir), torch.device("cpu"))
    t.train_step()  # the optimizer state exists from the first step on
    pool = t.ckpt._io_pool()
    mine = run_dir / f"baseline-{rank}.bin"

    def latest() -> Path:
        return store.list_complete(t.ckpt.root)[-1][1]

    def prune() -> None:  # keep only the newest checkpoint: disk space, outside any timing
        dist.barrier()
        if rank == 0:
            for _, p in store.list_complete(t.ckpt.root)[:-1]:
                shutil.rmtree(p)
        dist.barrier()

    def save(mode: str) -> tuple[float, float]:
        blocked = []

        def go():
            t.step += 1
            t0 = time.perf_counter()
            t.save(blocking=(mode == "sync"))
            blocked.append(time.perf_counter() - t0)
            t.ckpt.wait()
        total = timed_together(go)
        return blocked[0], total

    def my_bytes() -> int:
        return os.path.getsize(latest() / f"__{rank}_0.raw")

    source = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)  # made once, outside any timing

    def disk_write() -> float:
        mine.unlink(missing_ok=True)  # deleting the last one is not part of the write
        n = my_bytes()
        return timed_together(lambda: raw_write(mine, n, source, pool, a.threads))

    def staging() -> float:
        """Copying this rank's bytes host to host, in 256 MiB pieces (the stager copies tensor by
        tensor into buffers it reuses: touched pages, as here)."""
        n = my_bytes()
        src = torch.ones(min(n, 256 << 20), dtype=torch.uint8)
        dst = torch.zeros_like(src)

        def copy():
            left = n
            while left:
                k = min(left, src.numel())
                dst[:k].copy_(src[:k])
                left -= k
        return timed_together(copy)

    def load() -> float:
        dist.barrier()
        if rank == 0:
            drop_caches()
        return timed_together(lambda: t.ckpt.resume(lambda m: None))

    def disk_read() -> float:
        dist.barrier()
        if rank == 0:
            drop_caches()
        return timed_together(lambda: raw_read(mine, pool, a.threads))

    # Warm-up, untimed: every path once (the first async save allocates its staging buffers).
    save("sync")
    save("async")
    disk_write()
    disk_read()
    staging()
    load()
    prune()
    res = {"dim": dim, "sync_s": [], "async_blocked_s": [], "async_total_s": [], "disk_write_s": [],
           "staging_s": [], "load_s": [], "disk_read_s": []}
    for i in range(a.reps):
        # Which of the pair runs first alternates: neither always meets a disk still busy with the other.
        if i % 2:
            res["disk_write_s"].append(disk_write())
            res["sync_s"].append(save("sync")[1])
        else:
            res["sync_s"].append(save("sync")[1])
            res["disk_write_s"].append(disk_write())
        blocked, total = save("async")
        res["async_blocked_s"].append(blocked)
        res["async_total_s"].append(total)
        res["staging_s"].append(staging())
        prune()
    for _ in range(a.reps):
        res["load_s"].append(load())
        res["disk_read_s"].append(disk_read())
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, my_bytes())
    res["bytes"] = sum(sizes)
    res["bytes_per_rank"] = sizes
    res["dropped_cache"] = drop_caches() if rank == 0 else None
    t.ckpt.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.barrier()
    return res


def fixed_cost(a, out_dir: Path, saves: int = 12) -> dict:
    """Sync saves of the tiny model (5.5 MB: its write takes a few ms): what every save costs
    besides streaming its bytes (opening the save, planning, metadata, commit)."""
    import torch

    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    run_dir = out_dir / "tiny"
    cfg = compose(["+experiment=tiny", "launcher.nproc=2", f"checkpoint.threads={a.threads}", "checkpoint.keep=2",
                   f"run.dir={run_dir}"])
    t = Trainer.of(cfg, str(run_dir), torch.device("cpu"))
    t.train_step()
    times = []
    for i in range(saves + 2):
        t.step += 1
        dt = timed_together(lambda: t.save(blocking=True))
        if i >= 2:  # the first saves build the state dict, plan and writer threads
            times.append(dt)
    t.ckpt.close()
    return {"fixed_s": statistics.median(times), "fixed_range_s": [min(times), max(times)]}


def worker(a) -> None:
    import torch.distributed as dist

    from hpctrain.distributed.bootstrap import detect, init

    init(detect(), "gloo", 1800, 1)
    results = [measure_size(d, a, a.dir) for d in a.dims]
    fixed = fixed_cost(a, a.dir)
    if dist.get_rank() == 0:
        (a.dir / "ranks.json").write_text(json.dumps({"sizes": results, **fixed}))
    dist.destroy_process_group()


# ----------------------------------------------------------------- the driver

def fit(xs: list, ys: list) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarize(results: list[dict]) -> dict:
    med = statistics.median
    rows = []
    for r in results:
        gb = r["bytes"] / 1e9
        pair = lambda num, den: [d / n for n, d in zip(r[num], r[den])]  # noqa: E731  (baseline time / our time)
        rows.append({"dim": r["dim"], "gb": gb, "gb_per_rank": max(r["bytes_per_rank"]) / 1e9,
                     "save_gbps": med([gb / s for s in r["sync_s"]]),
                     "disk_write_gbps": med([gb / s for s in r["disk_write_s"]]),
                     "save_over_disk": med(pair("sync_s", "disk_write_s")),
                     "save_over_disk_range": [min(pair("sync_s", "disk_write_s")), max(pair("sync_s", "disk_write_s"))],
                     "load_over_disk": med(pair("load_s", "disk_read_s")),
                     "async_blocked_s": med(r["async_blocked_s"]), "sync_s": med(r["sync_s"]),
                     "async_over_sync": med([b / s for b, s in zip(r["async_blocked_s"], r["sync_s"])]),
                     "staging_floor_over_sync": med([c / s for c, s in zip(r["staging_s"], r["sync_s"])]),
                     "async_over_staging_floor": med([b / c for b, c in zip(r["async_blocked_s"], r["staging_s"])])})
    xs = [r["bytes"] for r in results for _ in r["sync_s"]]
    fixed, per_byte = fit(xs, [s for r in results for s in r["sync_s"]])
    dfixed, dper_byte = fit(xs, [s for r in results for s in r["disk_write_s"]])
    return {"rows": rows, "save_fixed_s": fixed, "save_stream_gbps": 1e-9 / per_byte,
            "disk_fixed_s": dfixed, "disk_stream_gbps": 1e-9 / dper_byte,
            "stream_over_disk": dper_byte / per_byte}


def plot(results: list[dict], s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, marker in (("sync_s", "sync save", "o"), ("disk_write_s", "disk write baseline", "s"),
                               ("load_s", "load", "^"), ("disk_read_s", "disk read baseline", "v")):
        xs = [r["bytes"] / 1e9 for r in results for _ in r[key]]
        ax.scatter(xs, [v for r in results for v in r[key]], label=label, marker=marker, s=18)
    gb = [r["bytes"] / 1e9 for r in results]
    ax.plot(gb, [s["save_fixed_s"] + g / s["save_stream_gbps"] for g in gb], "k--", lw=1,
            label=f"save fit: {s['save_fixed_s'] * 1e3:.0f} ms + bytes / {s['save_stream_gbps']:.2f} GB/s")
    ax.set_xlabel("checkpoint GB (2 ranks)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    ax.set_title("save and load vs the same writers on the bare disk")
    rows = s["rows"]
    bx.plot([r["gb"] for r in rows], [r["save_over_disk"] for r in rows], "o-", label="save / disk write")
    bx.plot([r["gb"] for r in rows], [r["async_over_sync"] for r in rows], "s-", label="async blocked / sync save")
    bx.plot([r["gb"] for r in rows], [r["staging_floor_over_sync"] for r in rows], "x:",
            label="staging copy / sync save (floor)")
    bx.axhline(0.8, color="C0", lw=0.5)
    bx.axhline(0.1, color="C1", lw=0.5)
    bx.set_xlabel("checkpoint GB (2 ranks)")
    bx.set_ylim(0, 1.3)
    bx.legend(fontsize=7)
    bx.set_title("ratios (medians of pairs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="512,1024,1280", help="model widths (12 layers, vocab 16384): "
                    "0.77, 2.7 and 4.1 GB checkpoints")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="checkpoint.threads (writer threads per rank)")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench" / "checkpoint")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.dims = [int(x) for x in str(a.dims).split(",")]
    if a.worker:
        worker(a)
        return 0
    from hpctrain.launch.local import launch

    subprocess.run(["rm", "-rf", str(a.dir)])
    a.dir.mkdir(parents=True)
    same = ["--dims", ",".join(map(str, a.dims)), "--layers", str(a.layers), "--vocab", str(a.vocab),
            "--reps", str(a.reps), "--threads", str(a.threads), "--dir", str(a.dir)]
    rc = launch(a.dir / "ranks", 2, cmd=[sys.executable, __file__, *same, "--worker"])
    if rc != 0:
        raise SystemExit(f"benchmark ranks failed: see {a.dir}/ranks/logs")
    raw = json.loads((a.dir / "ranks.json").read_text())
    results = raw["sizes"]
    s = summarize(results)
    s["fixed_s"], s["fixed_range_s"] = raw["fixed_s"], raw["fixed_range_s"]
    (a.dir / "results.json").write_text(json.dumps({"summary": s, "raw": results, "threads": a.threads}, indent=1))
    plot(results, s, a.dir / "checkpoint.png")
    print(f"2 ranks, {a.threads} writer threads each, {a.reps} reps; medians of paired ratios; load after "
          f"{'dropping' if results[0]['dropped_cache'] else 'NOT dropping'} the page cache")
    print("| checkpoint | per rank | save GB/s | disk GB/s | save / disk | load / disk | async blocked | "
          "/ sync save | staging floor / sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        lo, hi = r["save_over_disk_range"]
        print(f"| {r['gb']:.2f} GB | {r['gb_per_rank']:.2f} GB | {r['save_gbps']:.2f} | {r['disk_write_gbps']:.2f} | "
              f"**{r['save_over_disk']:.2f}** ({lo:.2f}-{hi:.2f}) | {r['load_over_disk']:.2f} | "
              f"{r['async_blocked_s'] * 1e3:.0f} ms | **{r['async_over_sync']:.2f}** | {r['staging_floor_over_sync']:.2f} |")
    lo, hi = s["fixed_range_s"]
    print(f"fixed cost per save: {s['fixed_s'] * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f} ms; sync saves of the "
          f"5.5 MB tiny model). Streaming (slope over sizes): {s['save_stream_gbps']:.2f} GB/s = "
          f"{s['stream_over_disk']:.2f} of the same writers on the bare disk ({s['disk_stream_gbps']:.2f} GB/s)")
    print(f"results: {a.dir / 'results.json'}, plot: {a.dir / 'checkpoint.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
