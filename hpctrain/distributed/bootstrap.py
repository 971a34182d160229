"""Which launcher started this process, and torch.distributed brought up from what it tells us.

`detect(env)` is pure: it reads a mapping of environment variables and returns a `DistEnv`.
`init(dist_env, ...)` performs the side effects (process group, device, threads).
"""
from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

from hpctrain.distributed import hostlist


@dataclass(frozen=True)
class DistEnv:
    launcher: str  # local | torchrun | slurm | mpi | single
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: Optional[str]
    master_port: Optional[int]
    note: str = ""


class BootstrapError(RuntimeError):
    pass


MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def detect(env: Mapping[str, str] = os.environ) -> DistEnv:
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else env.get("HPCTRAIN_LAUNCHER", "local")
        world = int(env["WORLD_SIZE"])
        return DistEnv(launcher, int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])),
                       int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "127.0.0.1"),
                       int(env.get("MASTER_PORT", 29500)))
    # MPI before Slurm: mpirun inside an allocation starts its ranks from srun-launched daemons
    # whose SLURM_PROCID/SLURM_NTASKS count nodes, not ranks.
    for var in MPI_RANK_VARS:
        if var in env:
            return _mpi(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env)
    if "SLURM_JOB_ID" in env:
        # The batch script body: Slurm sets SLURM_PROCID=0 and SLURM_NTASKS=N here, but this is one
        # process outside any job step, not rank 0 of N.
        return DistEnv("single", 0, 1, 0, 1, None, None,
                       note="inside a Slurm batch script but outside srun: running as a single process")
    return DistEnv("single", 0, 1, 0, 1, None, None)


def _slurm(env: Mapping[str, str]) -> DistEnv:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise BootstrapError("srun started this process but SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is unset")
    world = int(env["SLURM_NTASKS"])
    local_world = _first_int(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "1")
    return DistEnv("slurm", int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world,
                   env.get("MASTER_ADDR") or hostlist.first(nodelist),
                   int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"),
                                                             int(env.get("HPCTRAIN_ATTEMPT", "0") or 0))))


def slurm_port(job_id: str, attempt: int = 0) -> int:
    """A port that differs between jobs sharing a node and between the starts of the ranks within a
    job (the last start's sockets may linger), the same for every rank of one start. Below Linux's
    ephemeral range (32768-60999 by default), where outgoing connections would take it first."""
    key = job_id if attempt == 0 else f"{job_id}.{attempt}"
    return 16000 + zlib.crc32(key.encode()) % 16000


def _first_int(tasks_per_node: str) -> int:
    # Forms: "4", "2(x3)", "4(x2),2".
    head = tasks_per_node.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else 1


def _mpi(env: Mapping[str, str]) -> DistEnv:
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local, local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    elif "PMIX_RANK" in env:
        rank, world = int(env["PMIX_RANK"]), int(env.get("PMIX_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
        local, local_world = int(env.get("PMIX_LOCAL_RANK", 0)), int(env.get("PMIX_LOCAL_SIZE", 1))
    else:
        rank, world = int(env["PMI_RANK"]), int(env.get("PMI_SIZE", 1))
        local, local_world = int(env.get("MPI_LOCALRANKID", 0)), int(env.get("MPI_LOCALNRANKS", 1))
    # The address and port come from rank 0 over MPI itself (see init).
    return DistEnv("mpi", rank, world, local, local_world, None, None)


def default_threads(env, local_world: int, cores: int | None = None) -> int:
    """Torch threads for a rank when train.threads is 0: OMP_NUM_THREADS where it is set (by the user,
    cluster.env or the local launcher), else the CPUs Slurm gave each task (SLURM_CPUS_PER_TASK), else
    the node's cores shared among its ranks (MPI launchers leave torch at one thread). More threads
    than the rank's cores spin in OpenMP's barriers while a sibling waits for a core."""
    for key in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        try:
            if int(env.get(key, "")) > 0:
                return int(env[key])
        except ValueError:
            pass
    return max(1, (cores or os.cpu_count() or 1) // max(1, local_world))


def init(de: DistEnv, backend: str = "gloo", timeout_s: int = 300, threads: int = 0):
    """Start the default process group; returns the torch device this rank computes on."""
    # torch: hpctrain.run imports this module before torch, once its preemption handler is in place
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads if threads > 0 else default_threads(os.environ, de.local_world))

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", de.local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        # Host tensors take part in collectives too: offloaded gradients (their norm) and checkpoint metadata.
        backend = "cpu:gloo,cuda:nccl"
    if de.launcher == "mpi":
        store = _mpi_store(de, timeout)
        dist.init_process_group(backend, store=store, rank=de.rank, world_size=de.world, timeout=timeout)
    elif de.world == 1 and de.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{de.master_addr}:{de.master_port}",
                                rank=de.rank, world_size=de.world, timeout=timeout)
    return device


def _mpi_store(de: DistEnv, timeout: timedelta):
    """Rank 0 opens a TCPStore on a free port and tells everyone where it is over MPI."""
    # torch: as in init()
    import torch.distributed as dist
    # mpi4py initializes MPI at import: only when MPI launched us
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != de.world:
        raise BootstrapError(
            f"MPI reports {comm.Get_size()} ranks but the launcher environment says {de.world}: the MPI "
            "library does not match the launcher (e.g. Open MPI under `srun --mpi=pmi2`). Use mpiexec of the "
            "same MPI, or MPICH with srun --mpi=pmi2")
    store = None
    if de.rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, de.world, True, timeout=timeout, wait_for_workers=False)
        addr = (socket.gethostname(), store.port)
    else:
        addr = None
    host, port = comm.bcast(addr, root=0)
    if de.rank != 0:
        store = dist.TCPStore(host, port, de.world, False, timeout=timeout)
    return store
