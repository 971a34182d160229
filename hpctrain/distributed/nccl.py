"""NCCL and InfiniBand settings for a job, chosen from what the node has.

`nccl_env(sysfs, net_dir, env, overrides)` is pure over a sysfs tree, so it is tested on fake
trees. It only fills in what neither the user's environment nor `cluster.env` already set:

- NCCL_IB_HCA: the InfiniBand/RoCE devices under /sys/class/infiniband whose ports are ACTIVE
  (`=mlx5_0:1,mlx5_1:1`, exact match so mlx5_1 does not also select mlx5_10); none found: NCCL_IB_DISABLE=1
  so NCCL goes straight to sockets instead of probing.
- NCCL_SOCKET_IFNAME: the bootstrap/socket interface: the first up, non-virtual interface (ib*, then
  the usual Ethernet names), never lo or docker/veth bridges unless nothing else exists.
- TORCH_NCCL_ASYNC_ERROR_HANDLING=1 so a hung or failed collective aborts the job instead of
  hanging it until the time limit; the collective timeout itself is launcher.timeout_s.
- NCCL's flight recorder: TORCH_NCCL_TRACE_BUFFER_SIZE=2000 (the last collectives of every process
  group, with their state on this rank), and with a dump location, TORCH_NCCL_DUMP_ON_TIMEOUT=1 and
  TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<run.dir>/attempts/N/nccl-trace-rank- (torch appends the rank): a
  collective timeout writes it there; hpctrain's watchdog dumps it too when it sees a hang
  (hpctrain.train.watchdog). torch's docs: "Flight Recorder for debugging stuck jobs".
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

log = logging.getLogger("hpctrain")

VIRTUAL = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "vxlan", "tun", "tap")


def active_hcas(sysfs: Path) -> list[str]:
    """`device:port` of every InfiniBand/RoCE port whose state is ACTIVE."""
    root = sysfs / "class" / "infiniband"
    out = []
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            try:
                state = (port / "state").read_text()
            except OSError:
                continue
            if "ACTIVE" in state:
                out.append(f"{dev.name}:{port.name}")
    return out


def socket_ifname(sysfs: Path) -> str | None:
    root = sysfs / "class" / "net"
    if not root.is_dir():
        return None
    up = []
    for iface in sorted(root.iterdir()):
        try:
            state = (iface / "operstate").read_text().strip()
        except OSError:
            continue
        if state in ("up", "unknown") and not iface.name.startswith(VIRTUAL):
            up.append(iface.name)
    ib = [n for n in up if n.startswith("ib")]
    return (ib or up or [None])[0]


def nccl_env(sysfs: Path = Path("/sys"), env: Mapping[str, str] = os.environ,
             overrides: Mapping[str, str] | None = None, dump_prefix: str | None = None) -> dict[str, str]:
    """Variables to set: detection fills only what neither `env` nor `overrides` (cluster.env) has."""
    chosen: dict[str, str] = {}
    given = {**env, **(overrides or {})}
    hcas = active_hcas(sysfs)
    if "NCCL_IB_HCA" not in given and "NCCL_IB_DISABLE" not in given:
        if hcas:
            chosen["NCCL_IB_HCA"] = "=" + ",".join(hcas)
        else:
            chosen["NCCL_IB_DISABLE"] = "1"
    if "NCCL_SOCKET_IFNAME" not in given:
        ifname = socket_ifname(sysfs)
        if ifname:
            chosen["NCCL_SOCKET_IFNAME"] = ifname
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in given:
        chosen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in given:
        chosen["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"
    if dump_prefix and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in given:
        chosen["TORCH_NCCL_DUMP_ON_TIMEOUT"] = given.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        chosen["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = dump_prefix
    chosen.update({k: str(v) for k, v in (overrides or {}).items() if k.startswith(("NCCL_", "TORCH_NCCL_"))})
    return chosen


def apply(backend: str, overrides: Mapping[str, str] | None, rank: int,
          dump_prefix: str | None = None) -> dict[str, str]:
    """Set the job's NCCL environment before the process group starts; rank 0 logs it once."""
    if backend != "nccl":
        return {}
    chosen = nccl_env(overrides=overrides, dump_prefix=dump_prefix)
    os.environ.update(chosen)
    if rank == 0:
        shown = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("NCCL_", "TORCH_NCCL_"))}
        log.info("NCCL environment: %s", " ".join(f"{k}={v}" for k, v in shown.items()))
    return chosen
