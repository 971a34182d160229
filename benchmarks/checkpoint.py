"""Checkpoint save/load throughput against the disk's own sequential bandwidth, measured in the
same run, and how long an async save blocks the loop compared with a synchronous one.

    python benchmarks/checkpoint.py [--reps 3] [--dim 512 --layers 12 --vocab 16384] [--threads 4] [--dir DIR]

The disk baseline writes and reads the same number of bytes with O_DIRECT (no page cache), 8 MiB
requests from 4 threads, like fio's sequential job at queue depth 4, once per repetition right after
that repetition's synchronous save; each ratio pairs a save (or load) with its own repetition's
baseline. Checkpoint loads are timed after dropping the page cache where the kernel lets us (root
outside a restricted container). The async figure leaves out a run's first async save, which
allocates the staging buffers every later save reuses (printed apart).
Every checkpoint of the run is kept (checkpoint.keep): deleting older ones is retention, which
hpctrain runs in a background thread beside training, and is not part of what a save costs here.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHUNK = 8 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def direct_io(path: Path, nbytes: int, write: bool, threads: int = 4) -> float:
    """Seconds to write (or read) nbytes sequentially with O_DIRECT, split over `threads` regions."""
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags, 0o644)
    per = (nbytes // threads // CHUNK) * CHUNK
    bufs = [mmap.mmap(-1, CHUNK) for _ in range(threads)]  # page-aligned, as O_DIRECT requires
    for b in bufs:
        b.write(os.urandom(1 << 20) * (CHUNK >> 20))

    def worker(i: int) -> None:
        off, end = i * per, (i + 1) * per
        while off < end:
            n = os.pwritev(fd, [bufs[i]], off) if write else os.preadv(fd, [bufs[i]], off)
            off += n

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def disk_baseline(d: Path, nbytes: int) -> dict:
    """GB/s of an O_DIRECT sequential write, then read, of nbytes (the checkpoint's size)."""
    f = d / "disk-baseline.bin"
    w = direct_io(f, nbytes, write=True)
    r = direct_io(f, nbytes, write=False)
    f.unlink()
    n = (nbytes // 4 // CHUNK) * CHUNK * 4
    return {"write_gbps": n / w / 1e9, "read_gbps": n / r / 1e9}


# ----------------------------------------------------------------- the ranks' side

def worker(run_dir: Path, out: Path, overrides: list[str], reps: int) -> None:
    """Each repetition: a synchronous save, the disk baseline on the same number of bytes (rank 0,
    the other rank waiting), an asynchronous save; then as many loads. Ratios pair a save or load
    with the baseline of its own repetition: the disk's speed drifts by tens of percent over a
    minute here."""
    import torch
    import torch.distributed as dist

    from hpctrain.checkpoint import store
    from hpctrain.compose import compose
    from hpctrain.dist.bootstrap import detect, init
    from hpctrain.train.loop import Trainer

    cfg = compose([*overrides, f"run.dir={run_dir}"])
    init(detect(), "gloo", 600, 1)
    t = Trainer(cfg, str(run_dir), torch.device("cpu"))
    t.train_step()  # the optimizer state exists from the first step on
    rank = dist.get_rank()
    res = {"sync_s": [], "async_blocked_s": [], "async_total_s": [], "load_s": [], "disk": [], "bytes": 0,
           "dropped_cache": False}
    step = 1
    for _ in range(reps):
        for mode in ("sync", "async"):
            step += 1
            t.step = step
            dist.barrier()
            t0 = time.perf_counter()
            t.save(blocking=(mode == "sync"))
            blocked = time.perf_counter() - t0
            t.ckpt.wait()
            dist.barrier()
            total = time.perf_counter() - t0
            if mode == "sync":
                res["sync_s"].append(total)
                if rank == 0:
                    res["bytes"] = store.disk_usage(store.list_complete(t.ckpt.root)[-1][1])
                    res["disk"].append(disk_baseline(run_dir, max(256 << 20, res["bytes"])))
                dist.barrier()
            else:
                res["async_blocked_s"].append(blocked)
                res["async_total_s"].append(total)
    for _ in range(reps):  # loads last: as in training, nothing between two saves replaces the state
        dist.barrier()
        if rank == 0:
            res["dropped_cache"] = drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        t.ckpt.resume(print)
        dist.barrier()
        res["load_s"].append(time.perf_counter() - t0)
    if rank == 0:
        out.write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=4, help="checkpoint.threads (writer threads per rank)")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench" / "checkpoint")
    ap.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    overrides = ["+experiment=tiny", "launcher.nproc=2", f"model.dim={a.dim}", f"model.n_layers={a.layers}",
                 "model.n_heads=8", "model.n_kv_heads=4", f"model.ffn_dim={4 * a.dim}",
                 f"model.vocab_size={a.vocab}", "data.seq_len=32", "train.global_batch=2", "train.micro_batch=1",
                 f"checkpoint.keep={2 * a.reps + 1}", f"checkpoint.threads={a.threads}"]
    if a.worker:
        worker(a.worker[0], a.worker[1], overrides, a.reps)
        return 0

    from hpctrain.launch.local import launch

    run_dir = a.dir / "run"
    subprocess.run(["rm", "-rf", str(run_dir)])
    run_dir.mkdir(parents=True)
    out = a.dir / "ranks.json"
    # The ranks parse the same options (they build the same overrides).
    same = ["--reps", str(a.reps), "--dim", str(a.dim), "--layers", str(a.layers), "--vocab", str(a.vocab),
            "--threads", str(a.threads)]
    rc = launch(run_dir, 2, cmd=[sys.executable, __file__, *same, "--worker", str(run_dir), str(out)])
    if rc != 0:
        raise SystemExit(f"benchmark ranks failed: see {run_dir}/logs")
    res = json.loads(out.read_text())
    med = statistics.median
    gb = res["bytes"] / 1e9
    disk_w = [d["write_gbps"] for d in res["disk"]]
    disk_r = [d["read_gbps"] for d in res["disk"]]
    save = [gb / s for s in res["sync_s"]]
    load = [gb / s for s in res["load_s"]]
    save_ratio = [s / d for s, d in zip(save, disk_w)]
    load_ratio = [x / d for x, d in zip(load, disk_r)]
    # The first async save of a run allocates its staging buffers; later ones reuse them.
    later = res["async_blocked_s"][1:] or res["async_blocked_s"]
    blocked = med(later) / med(res["sync_s"])
    summary = {"checkpoint_gb": gb, "disk_write_gbps": disk_w, "disk_read_gbps": disk_r,
               "save_gbps": save, "load_gbps": load, "save_over_disk": save_ratio, "load_over_disk": load_ratio,
               "save_over_disk_median": med(save_ratio), "load_over_disk_median": med(load_ratio),
               "async_blocked_over_sync": blocked, "first_async_blocked_s": res["async_blocked_s"][0],
               "load_after_cache_drop": res["dropped_cache"], "ranks": res, "threads": a.threads}
    (a.dir / "results.json").write_text(json.dumps(summary, indent=1))

    def span(xs):
        return f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    print(f"checkpoint: {gb:.3f} GB over 2 ranks, {a.reps} reps, {a.threads} writer threads per rank; "
          "median (min-max) over reps, ratios paired with the disk baseline of the same rep")
    print("| what | GB/s | vs disk (paired) |\n|---|---|---|")
    print(f"| disk write (O_DIRECT, 8 MiB x 4 threads) | {span(disk_w)} | 1 |")
    print(f"| checkpoint save (sync, fsync'd) | {span(save)} | {span(save_ratio)} |")
    print(f"| disk read (O_DIRECT) | {span(disk_r)} | 1 |")
    print(f"| checkpoint load{'' if res['dropped_cache'] else ' (page cache NOT dropped)'} | {span(load)} | "
          f"{span(load_ratio)} |")
    print(f"async save blocks the loop for {med(later):.3f} s = {blocked:.2f} of a synchronous save "
          f"({med(res['sync_s']):.3f} s); the run's first async save, which allocates the staging buffers: "
          f"{res['async_blocked_s'][0]:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
