"""gloo all_reduce (torch.distributed) against a plain MPI allreduce (mpi4py, numpy), same run.

    python benchmarks/collectives_vs_mpi.py                    # 2 ranks, 64 MiB and 256 MiB
    python benchmarks/collectives_vs_mpi.py --sizes 64M,256M --iters 5 --rounds 3 --modes default,nolocal

The driver starts `mpiexec -n <np>` once per MPI mode. In each run every rank brings up
torch.distributed (gloo, through hpctrain.distributed.bootstrap: rank 0's TCPStore address travels over MPI)
and times both libraries on the SAME float32 buffer (the numpy array is a view of the torch tensor),
in place, alternating which goes first round by round, so both see the same machine at the same
moments (this VM is shared and noisy). Both results are checked once (sum of rank+1 everywhere).

Numbers use the nccl-tests conventions of hpctrain.bench.collectives: time = mean over ranks of
the time per call (the median of --rounds batches of --iters calls), algbw = bytes / time, busbw =
algbw x 2(n-1)/n. The ratio printed is busbw(gloo) / busbw(MPI).

Modes: `default` lets MPI use what it finds (MPICH: shared memory between ranks of one node);
`nolocal` sets MPIR_CVAR_NOLOCAL=1, so MPICH sends even on-node messages through its network
module (TCP over loopback here, as gloo does): the like-for-like transport comparison.

Needs an MPI runtime with mpiexec: `pip install mpich==5.0.2` (one MPI wheel per environment).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpctrain.bench.collectives import algbw, busbw, format_size, parse_size  # noqa: E402

MODES = {"default": {}, "nolocal": {"MPIR_CVAR_NOLOCAL": "1"}}


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from hpctrain.distributed import bootstrap

    de = bootstrap.detect()
    if de.launcher != "mpi":
        raise SystemExit("the worker runs under mpiexec (run the script without --worker)")
    from mpi4py import MPI  # MPI launched us: importing initializes it

    comm = MPI.COMM_WORLD
    bootstrap.init(de, backend="gloo", timeout_s=300, threads=a.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert comm.Get_size() == world, (comm.Get_size(), world)
    results = []
    for nbytes in [parse_size(s) for s in a.sizes.split(",")]:
        n = nbytes // 4
        t = torch.empty(n, dtype=torch.float32)
        arr = t.numpy()  # the same memory: both libraries move exactly the same bytes
        want = world * (world + 1) / 2

        t.fill_(rank + 1)
        dist.all_reduce(t)
        ok_gloo = bool((t == want).all())
        arr[:] = rank + 1
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        ok_mpi = bool((arr == want).all())
        if not comm.allreduce(ok_gloo and ok_mpi, op=MPI.LAND):
            raise SystemExit(f"wrong all_reduce result at {nbytes} bytes (gloo ok: {ok_gloo}, MPI ok: {ok_mpi})")
        t.zero_()  # repeated in-place sums of zeros stay finite

        def gloo_call():
            dist.all_reduce(t)

        def mpi_call():
            comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)

        for f in (gloo_call, mpi_call):
            for _ in range(a.warmup):
                f()
        per = {"gloo": [], "mpi": []}
        for rnd in range(a.rounds):
            order = [("gloo", gloo_call), ("mpi", mpi_call)]
            if rnd % 2:
                order.reverse()
            for name, f in order:
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    f()
                dt = (time.perf_counter() - t0) / a.iters
                per[name].append(comm.allreduce(dt, op=MPI.SUM) / world)  # mean over ranks
        row = {"bytes": nbytes, "world": world, "rounds": a.rounds, "iters": a.iters}
        for name in ("gloo", "mpi"):
            ts = sorted(per[name])
            med = ts[len(ts) // 2]
            row[name] = {"time_ms": med * 1e3, "algbw_gbps": algbw(nbytes, med),
                         "busbw_gbps": busbw("all_reduce", nbytes, med, world),
                         "rounds_ms": [round(x * 1e3, 2) for x in per[name]]}
        row["ratio_gloo_over_mpi"] = row["gloo"]["busbw_gbps"] / row["mpi"]["busbw_gbps"]
        results.append(row)
        del arr, t
    if rank == 0:
        Path(a.out).write_text(json.dumps({"mpi": MPI.Get_library_version().splitlines()[0].strip(),
                                           "torch": torch.__version__, "rows": results}, indent=2))
    dist.destroy_process_group()


def driver(a) -> int:
    mpiexec = shutil.which("mpiexec")
    if not mpiexec:
        print("no mpiexec on PATH: pip install mpich==5.0.2", file=sys.stderr)
        return 2
    report = {"modes": {}}
    for mode in a.modes.split(","):
        if mode not in MODES:
            print(f"unknown mode {mode!r}; valid: {', '.join(MODES)}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), GLOO_SOCKET_IFNAME="lo", **MODES[mode])
            env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            cmd = [mpiexec, "-n", str(a.np), sys.executable, __file__, "--worker", "--out", str(out),
                   "--sizes", a.sizes, "--iters", str(a.iters), "--rounds", str(a.rounds), "--warmup",
                   str(a.warmup), "--threads", str(a.threads)]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            if proc.returncode != 0 or not out.is_file():
                print(f"mode {mode}: mpiexec exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            res = json.loads(out.read_text())
            res["seconds"] = round(time.monotonic() - t0, 1)
            report["modes"][mode] = res
    print(f"{a.np} ranks on this machine, float32, in place, {a.rounds} rounds x {a.iters} calls (median round), "
          f"busbw = algbw x 2(n-1)/n, GB/s = 1e9 B/s")
    print(f"{'MPI mode':>9} {'size':>8} {'gloo ms':>9} {'MPI ms':>9} {'gloo busbw':>11} {'MPI busbw':>10} "
          f"{'gloo/MPI':>9}")
    for mode, res in report["modes"].items():
        for r in res["rows"]:
            print(f"{mode:>9} {format_size(r['bytes']):>8} {r['gloo']['time_ms']:>9.1f} {r['mpi']['time_ms']:>9.1f} "
                  f"{r['gloo']['busbw_gbps']:>11.3f} {r['mpi']['busbw_gbps']:>10.3f} {r['ratio_gloo_over_mpi']:>9.2f}")
    first = next(iter(report["modes"].values()))
    print(f"# {first['mpi']}; torch {first['torch']}; MPIR_CVAR_NOLOCAL=1 (nolocal) routes on-node MPI "
          "traffic through the network module, as gloo's TCP does")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64M,256M")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 ranks, 2 cores)")
    ap.add_argument("--modes", default="default,nolocal", help=f"MPI modes, comma list of {', '.join(MODES)}")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", default=None, help="also write every number here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
