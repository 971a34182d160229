"""Collective benchmark with the nccl-tests conventions: time, algbw and busbw per operation and size.

    python -m hpctrain.bench.collectives --nproc 2 --max-bytes 64M          # 2 local ranks (gloo)
    srun -N2 --ntasks-per-node=8 python -m hpctrain.bench.collectives       # NCCL on GPUs
    python -m hpctrain.bench.collectives --ops all_reduce,all_gather --min-bytes 1M --max-bytes 1G

Any launcher `hpctrain.distributed.bootstrap.detect()` knows works (srun, torchrun, mpiexec, --nproc).
Backend and device are automatic: NCCL on CUDA where GPUs exist, gloo on CPU otherwise.

Per operation and size: every rank fills its buffers with rank-dependent integers, runs the
collective once and checks the result exactly (a wrong result stops the run with an error: it is
not a fast number); then `--warmup` untimed calls, a barrier, and `--iters` timed calls (CUDA events
on GPUs, a monotonic clock on CPU). The time is the mean over ranks of each rank's time per call
(nccl-tests' default `-a 1`); the slowest rank's time is recorded beside it.

    size  = bytes of the largest buffer of one rank (nccl-tests: the all_gather output, the
            reduce_scatter input, the all_to_all send buffer), rounded down to a multiple of
            world x element size where the operation splits it
    algbw = size / time
    busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, reduce_scatter, all_to_all),
            x 1 (broadcast, sendrecv)
    GB/s  = 1e9 bytes/s, as nccl-tests

sendrecv: every rank sends to rank+1 and receives from rank-1 at the same time (a ring of pairs, as
nccl-tests' sendrecv_perf), so with 2 ranks both directions of the one link are busy.

Output: rank 0 writes one JSON line per operation x size to `<out-dir>/results.jsonl` (with the
NCCL_*/GLOO_* environment in force, world size, nodes, backend) and prints a table (also written to
`<out-dir>/table.txt`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from hpctrain.core import faults
from hpctrain.core.nccl_words import OPS, format_size, parse_size
from hpctrain.core.spec import backend_for
from hpctrain.distributed import bootstrap
from hpctrain.launch import local

# Operations whose buffer is split in `world` equal chunks: size is rounded to a multiple of world.
SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")
DTYPES = {  # name -> (torch attribute, bytes, largest integer every value up to is exact)
    "float32": ("float32", 4, 2 ** 24), "float": ("float32", 4, 2 ** 24),
    "float16": ("float16", 2, 2 ** 11), "half": ("float16", 2, 2 ** 11),
    "bfloat16": ("bfloat16", 2, 2 ** 8), "bf16": ("bfloat16", 2, 2 ** 8),
    "float64": ("float64", 8, 2 ** 53), "double": ("float64", 8, 2 ** 53),
    "int32": ("int32", 4, 2 ** 31 - 1), "int64": ("int64", 8, 2 ** 63 - 1),
}
# Environment variables recorded with every result: what the communication library reads.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_GLOO_", "UCX_", "FI_", "CUDA_DEVICE_MAX_CONNECTIONS")
ENV_NAMES = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


class CheckError(RuntimeError):
    """A collective returned a wrong result."""


# ----------------------------------------------------------------------------------------------
# Pure arithmetic (unit-tested): the nccl-tests bandwidth conventions and the size list.

def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for `op` on `world` ranks (nccl-tests' convention)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if op == "all_reduce":
        return 2.0 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown operation {op!r}; known: {', '.join(OPS)}")


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): bytes / time."""
    if seconds <= 0:
        raise ValueError(f"time must be > 0, got {seconds}")
    return nbytes / seconds / 1e9


def busbw(op: str, nbytes: float, seconds: float, world: int) -> float:
    """Bus bandwidth in GB/s: algbw x bus_factor(op, world)."""
    return algbw(nbytes, seconds) * bus_factor(op, world)


def sizes(min_bytes: int, max_bytes: int, factor: float = 2) -> list[int]:
    """min, min*factor, ... up to max inclusive (nccl-tests -b -e -f)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        out.append(int(round(s)))
        s *= factor
    return sorted(set(out))


def element_count(op: str, nbytes: int, esize: int, world: int) -> int:
    """Elements of the largest per-rank buffer for a message of `nbytes` (0: too small to run)."""
    n = nbytes // esize
    if op in SPLIT_OPS:
        n -= n % world
    return n


def parse_ops(text: str | Sequence[str]) -> list[str]:
    ops = [o.strip() for o in (text.split(",") if isinstance(text, str) else text) if o.strip()]
    if ops == ["all"]:
        return list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"unknown operation(s) {bad or ops}: valid operations are {', '.join(OPS)} (or 'all')")
    return ops


def recorded_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    return {k: env[k] for k in sorted(env) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


# ----------------------------------------------------------------------------------------------
# Exact, rank-dependent data. A 1-D tensor is filled with a periodic integer pattern through a 2-D
# view (no temporary the size of the buffer), and checked the same way, in bounded chunks.

PERIOD = 251  # prime: chunks of different ranks never line up by accident


def _fill(t, base, offset: int = 0) -> None:
    # torch: bench.sweep imports this module on the login node
    import torch

    p = base.numel()
    base = torch.roll(base, -(offset % p))
    full = t.numel() // p * p
    if full:
        t[:full].view(-1, p).copy_(base)
    if t.numel() > full:
        t[full:].copy_(base[: t.numel() - full])


def _first_mismatch(t, base, offset: int = 0) -> int | None:
    import torch

    p = base.numel()
    base = torch.roll(base, -(offset % p))
    full = t.numel() // p * p
    rows = full // p
    step = max(1, (1 << 22) // p)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        bad = (t[r0 * p:r1 * p].view(-1, p) != base).flatten().nonzero()
        if bad.numel():
            return r0 * p + int(bad[0])
    if t.numel() > full:
        bad = (t[full:] != base[: t.numel() - full]).nonzero()
        if bad.numel():
            return full + int(bad[0])
    return None


def _gather_pattern(r: int) -> list[int]:
    """What rank r contributes to all_gather / broadcast / sendrecv: 1..251, shifted by rank."""
    return [(r * 31 + k) % PERIOD + 1 for k in range(PERIOD)]


def _a2a_pattern(src: int, dst: int) -> list[int]:
    return [(src * 17 + dst * 5 + k) % PERIOD + 1 for k in range(PERIOD)]


def _reduce_patterns(r: int, world: int, exact_limit: int) -> tuple[list[int], list[int]]:
    """(rank r's input period, the expected sum's period) for all_reduce / reduce_scatter.

    Rich pattern (r+1)*(k+1), k < 13, where every partial sum is an exact integer of the dtype;
    else an indicator (1 where (k+r) % world == 0): every element sums to exactly 1 in any order and
    any dtype, and a lost, doubled or misplaced contribution still shows."""
    if 13 * world * (world + 1) // 2 <= exact_limit:
        return [(r + 1) * (k + 1) for k in range(13)], [world * (world + 1) // 2 * (k + 1) for k in range(13)]
    return [1 if (k + r) % world == 0 else 0 for k in range(world)], [1] * world


# ----------------------------------------------------------------------------------------------
# The benchmark proper.

class Bench:
    def __init__(self, ops: Sequence[str], size_list: Sequence[int], dtype: str, warmup: int, iters: int,
                 device, backend: str, repeats: int = 1):
        # torch: bench.sweep imports this module on the login node
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.ops, self.size_list = list(ops), list(size_list)
        self.dtype_name = DTYPES[dtype][0]
        self.dtype = getattr(torch, self.dtype_name)
        self.esize, self.exact_limit = DTYPES[dtype][1], DTYPES[dtype][2]
        self.warmup, self.iters, self.repeats = warmup, iters, max(1, repeats)
        self.device, self.backend = device, backend
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = device.type == "cuda"
        self.barrier_kw = {"device_ids": [device.index]} if backend == "nccl" and device.index is not None else {}
        # all_gather_into_tensor / reduce_scatter_tensor, under the names torch 2.13 gave them
        # (the old names still work there but warn).
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    # small helpers ------------------------------------------------------------------------------
    def _t(self, values: Iterable[int]):
        return self.torch.tensor(list(values), dtype=self.dtype, device=self.device)

    def _empty(self, n: int):
        return self.torch.empty(n, dtype=self.dtype, device=self.device)

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _any_rank(self, flag: bool) -> bool:
        t = self.torch.tensor([1 if flag else 0], dtype=self.torch.int32, device=self.device)
        self.dist.all_reduce(t)
        return int(t.item()) > 0

    # per operation: buffers, the call, the check ---------------------------------------------------
    def _buffers(self, op: str, max_n: int) -> dict:
        n, w = max_n, self.world
        if op == "all_reduce" or op == "broadcast":
            return {"buf": self._empty(n)}
        if op == "all_gather":
            return {"inp": self._empty(n // w), "out": self._empty(n)}
        if op == "reduce_scatter":
            return {"inp": self._empty(n), "out": self._empty(n // w)}
        return {"inp": self._empty(n), "out": self._empty(n)}  # all_to_all, sendrecv

    def _call(self, op: str, b: dict, n: int) -> Callable[[], None]:
        dist, w, r = self.dist, self.world, self.rank
        if op == "all_reduce":
            buf = b["buf"][:n]
            return lambda: dist.all_reduce(buf)
        if op == "all_gather":
            inp, out = b["inp"][: n // w], b["out"][:n]
            return lambda: self.all_gather(out, inp)
        if op == "reduce_scatter":
            inp, out = b["inp"][:n], b["out"][: n // w]
            return lambda: self.reduce_scatter(out, inp)
        if op == "all_to_all":
            inp, out = b["inp"][:n], b["out"][:n]
            return lambda: dist.all_to_all_single(out, inp)
        if op == "broadcast":
            buf = b["buf"][:n]
            return lambda: dist.broadcast(buf, src=0)
        if op == "sendrecv":
            inp, out = b["inp"][:n], b["out"][:n]
            nxt, prv = (r + 1) % w, (r - 1) % w

            def sendrecv():
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt), dist.P2POp(dist.irecv, out, prv)])
                for q in reqs:
                    q.wait()
            return sendrecv
        raise ValueError(op)

    def _check(self, op: str, b: dict, n: int) -> str | None:
        """Fill, run once, verify exactly; the description of the first wrong element, or None."""
        w, r = self.world, self.rank
        call = self._call(op, b, n)
        m = n // w
        if op == "all_reduce":
            mine, want = _reduce_patterns(r, w, self.exact_limit)
            buf = b["buf"][:n]
            _fill(buf, self._t(mine))
            call()
            self._sync()
            self._fault(buf)
            return self._where(buf, want)
        if op == "reduce_scatter":
            mine, want = _reduce_patterns(r, w, self.exact_limit)
            _fill(b["inp"][:n], self._t(mine))
            out = b["out"][:m]
            out.fill_(-1)
            call()
            self._sync()
            self._fault(out)
            return self._where(out, want, offset=r * m)
        if op == "all_gather":
            _fill(b["inp"][:m], self._t(_gather_pattern(r)))
            out = b["out"][:n]
            out.fill_(-1)
            call()
            self._sync()
            self._fault(out)
            for s in range(w):
                bad = self._where(out[s * m:(s + 1) * m], _gather_pattern(s), where=f"chunk from rank {s}")
                if bad:
                    return bad
            return None
        if op == "all_to_all":
            inp, out = b["inp"][:n], b["out"][:n]
            for s in range(w):
                _fill(inp[s * m:(s + 1) * m], self._t(_a2a_pattern(r, s)))
            out.fill_(-1)
            call()
            self._sync()
            self._fault(out)
            for s in range(w):
                bad = self._where(out[s * m:(s + 1) * m], _a2a_pattern(s, r), where=f"chunk from rank {s}")
                if bad:
                    return bad
            return None
        if op == "broadcast":
            buf = b["buf"][:n]
            if r == 0:
                _fill(buf, self._t(_gather_pattern(0)))
            else:
                buf.fill_(-1)
            call()
            self._sync()
            self._fault(buf)
            return self._where(buf, _gather_pattern(0))
        if op == "sendrecv":
            _fill(b["inp"][:n], self._t(_gather_pattern(r)))
            out = b["out"][:n]
            out.fill_(-1)
            call()
            self._sync()
            self._fault(out)
            return self._where(out, _gather_pattern((r - 1) % w), where=f"message from rank {(r - 1) % w}")
        raise ValueError(op)

    def _fault(self, result) -> None:
        """HPCTRAIN_FAULT="bench_corrupt:rank=R": rank R damages one element of each checked result,
        to prove that the check catches it (tests/test_bench_collectives.py)."""
        if faults.armed("bench_corrupt", rank=self.rank) and result.numel():
            result[result.numel() // 2] += 1

    def _where(self, t, want: list[int], offset: int = 0, where: str = "") -> str | None:
        i = _first_mismatch(t, self._t(want), offset)
        if i is None:
            return None
        got = t[i].item()
        exp = want[(offset + i) % len(want)]
        return (f"rank {self.rank}: element {i}{' of the ' + where if where else ''} is {got}, expected {exp}")

    def _time(self, call: Callable[[], None]) -> tuple[float, float, list[float]]:
        """Seconds per call of the median batch: (mean over ranks, slowest rank, every batch's mean)."""
        torch, dist = self.torch, self.dist
        for _ in range(self.warmup):
            call()
        per_batch = []
        for _ in range(self.repeats):
            self._sync()
            dist.barrier(**self.barrier_kw)
            self._sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    call()
                end.record()
                end.synchronize()
                per_batch.append(start.elapsed_time(end) / 1e3 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    call()
                per_batch.append((time.perf_counter() - t0) / self.iters)
        mean = torch.tensor(per_batch, dtype=torch.float64, device=self.device)
        slow = mean.clone()
        dist.all_reduce(mean)
        dist.all_reduce(slow, op=dist.ReduceOp.MAX)
        means = [float(x) / self.world for x in mean.cpu()]
        slows = [float(x) for x in slow.cpu()]
        mid = sorted(range(len(means)), key=means.__getitem__)[len(means) // 2]
        return means[mid], slows[mid], means

    def run(self, emit: Callable[[dict], None]) -> None:
        for op in self.ops:
            if op == "sendrecv" and self.world < 2:
                if self.rank == 0:
                    print(f"# sendrecv needs 2 ranks or more: skipped on {self.world}", flush=True)
                continue
            counts = []
            for s in self.size_list:
                n = element_count(op, s, self.esize, self.world)
                if n > 0 and n not in counts:
                    counts.append(n)
            if not counts:
                continue
            bufs = self._buffers(op, max(counts))
            for n in counts:
                bad = self._check(op, bufs, n)
                if self._any_rank(bad is not None):
                    every: list = [None] * self.world
                    self.dist.all_gather_object(every, bad)
                    wrong = [x for x in every if x]
                    raise CheckError(f"{op} of {n * self.esize} bytes ({self.dtype_name}, {self.world} ranks, "
                                     f"backend {self.backend}) returned a wrong result on {len(wrong)} rank(s): "
                                     + "; ".join(wrong[:4]) + (" ..." if len(wrong) > 4 else ""))
                if op == "all_reduce":
                    bufs["buf"][:n].zero_()  # repeated in-place sums must not grow to inf
                mean, slow, batches = self._time(self._call(op, bufs, n))
                nbytes = n * self.esize
                emit({"op": op, "bytes": nbytes, "count": n, "dtype": self.dtype_name,
                      "time_us": mean * 1e6, "time_max_us": slow * 1e6,
                      "batches_us": [round(b * 1e6, 3) for b in batches],
                      "algbw_gbps": algbw(nbytes, mean), "busbw_gbps": busbw(op, nbytes, mean, self.world),
                      "bus_factor": bus_factor(op, self.world), "check": "ok"})
            del bufs
            if self.cuda:
                self.torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Command line.

HEADER = (f"{'op':>14} {'size':>10} {'count':>11} {'type':>8} {'time(us)':>11} {'max(us)':>11} "
          f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'check':>6}")


def table_row(rec: Mapping) -> str:
    return (f"{rec['op']:>14} {format_size(rec['bytes']):>10} {rec['count']:>11} {rec['dtype']:>8} "
            f"{rec['time_us']:>11.1f} {rec['time_max_us']:>11.1f} {rec['algbw_gbps']:>12.3f} "
            f"{rec['busbw_gbps']:>12.3f} {rec['check']:>6}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.bench.collectives",
                                 description="Collective benchmark (nccl-tests conventions) on NCCL or gloo.")
    ap.add_argument("--ops", default="all", help=f"comma list of {', '.join(OPS)}, or 'all' (default)")
    ap.add_argument("--min-bytes", "-b", default="8", help="smallest message (default 8)")
    ap.add_argument("--max-bytes", "-e", default=None,
                    help="largest message (default 1G with NCCL, 64M with gloo: CPU runs of 1 GiB take minutes)")
    ap.add_argument("--factor", "-f", type=float, default=2.0, help="size multiplier between steps (default 2)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--warmup", "-w", type=int, default=5)
    ap.add_argument("--iters", "-n", type=int, default=20, help="timed calls per batch (default 20)")
    ap.add_argument("--repeats", "-r", type=int, default=1,
                    help="timed batches per size; the median batch is reported, all are recorded (default 1)")
    ap.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    ap.add_argument("--out-dir", default=None,
                    help="where results.jsonl and table.txt go (default outputs/bench/collectives-<time>)")
    ap.add_argument("--setting", default=os.environ.get("HPCTRAIN_BENCH_SETTING", ""),
                    help="a label recorded with every result (sweeps set it)")
    ap.add_argument("--nproc", type=int, default=0,
                    help="start this many local ranks (when no launcher started this process)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (default: OMP_NUM_THREADS, else cores / ranks per node)")
    ap.add_argument("--timeout", type=int, default=300, help="process group timeout, seconds")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        if a.warmup < 0 or a.iters < 1 or a.repeats < 1:
            raise ValueError(f"need --warmup >= 0, --iters >= 1 and --repeats >= 1, got {a.warmup}, {a.iters}, "
                             f"{a.repeats}")
        ops = parse_ops(a.ops)
        min_b = parse_size(a.min_bytes)
        max_b = parse_size(a.max_bytes) if a.max_bytes else None
        sizes(min_b, max_b if max_b is not None else min_b, a.factor)
    except ValueError as e:
        ap.error(str(e))
    out_dir = Path(a.out_dir or f"outputs/bench/collectives-{_dt.datetime.now():%Y%m%d-%H%M%S}")

    de = bootstrap.detect()
    if a.nproc > 1 and de.launcher == "single" and de.world == 1:
        out_dir.mkdir(parents=True, exist_ok=True)
        rest = _drop_option(argv, "--nproc")
        if a.out_dir is None:
            rest += ["--out-dir", str(out_dir)]
        return local.launch(out_dir, a.nproc, cmd=[sys.executable, "-m", "hpctrain.bench.collectives", *rest])
    return _run(a, ops, min_b, max_b, out_dir, de)


def _drop_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x == name:
            skip = True
            continue
        if x.startswith(name + "="):
            continue
        out.append(x)
    return out


def _run(a, ops, min_b, max_b, out_dir: Path, de) -> int:
    # torch: bench.sweep imports this module on the login node
    import torch
    import torch.distributed as dist

    backend = backend_for(a.backend, "cuda", torch.cuda.is_available())
    if max_b is None:
        max_b = (1 << 30) if backend == "nccl" else (64 << 20)
    size_list = sizes(min_b, max(max_b, min_b), a.factor)
    threads = a.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    device = bootstrap.init(de, backend=backend, timeout_s=a.timeout, threads=threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = len(set(hosts))
    meta = {"setting": a.setting, "world": world, "nodes": nodes,
            "tasks_per_node": world // nodes if world % nodes == 0 else None,
            "backend": backend, "device": device.type, "launcher": de.launcher,
            "warmup": a.warmup, "iters": a.iters, "repeats": a.repeats, "env": recorded_env(),
            "job_id": os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"),
            "hosts": sorted(set(hosts)), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
            "threads": torch.get_num_threads()}
    jsonl = table = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = open(out_dir / "results.jsonl", "w")
        table = open(out_dir / "table.txt", "w")
        intro = (f"# hpctrain collectives: {world} ranks on {nodes} node(s) ({', '.join(meta['hosts'])}), "
                 f"backend {backend}, device {device.type}, {a.dtype}, warmup {a.warmup}, iters {a.iters} x {a.repeats}"
                 + (f", setting {a.setting!r}" if a.setting else "")
                 + "\n# env: " + (" ".join(f"{k}={v}" for k, v in meta["env"].items()) or "(none)")
                 + "\n# time: mean over ranks of the time per call (median of the batches); max: the slowest rank; "
                   "GB/s = 1e9 B/s; busbw per nccl-tests\n" + HEADER)
        print(intro, flush=True)
        table.write(intro + "\n")

    def emit(rec: dict) -> None:
        if rank != 0:
            return
        rec = {**rec, **meta, "time": _dt.datetime.now().isoformat(timespec="seconds")}
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()
        row = table_row(rec)
        print(row, flush=True)
        table.write(row + "\n")
        table.flush()

    rc = 0
    try:
        Bench(ops, size_list, a.dtype, a.warmup, a.iters, device, backend, a.repeats).run(emit)
    except CheckError as e:
        print(f"hpctrain.bench.collectives: {e}", file=sys.stderr, flush=True)
        rc = 3
    finally:
        if rank == 0:
            jsonl.close()
            table.close()
    if rank == 0 and rc == 0:
        print(f"# results: {out_dir / 'results.jsonl'}", flush=True)
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
