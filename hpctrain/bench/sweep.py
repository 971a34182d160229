"""Sweeps of NCCL (or any) environment settings and node counts, submitted as ONE Slurm job array.

    python -m hpctrain.bench.sweep nccl_algo_proto --out outputs/sweeps/algo      # conf/sweep/<name>.yaml
    python -m hpctrain.bench.sweep conf/sweep/channels.yaml --out DIR nodes=[2,4] bench.max_bytes=256M
    python -m hpctrain.bench.sweep local_gloo --out DIR --wait --report           # wait, then report
    python -m hpctrain.bench.sweep nccl_algo_proto --out DIR --dry-run            # check, print, submit nothing

A sweep file (conf/sweep/*.yaml) names the settings (`settings:` name -> env mapping, and/or a `grid:`
of variable -> values whose cartesian product is added), the node counts (`nodes: [2, 4]`), the
allocation (tasks/GPUs per node, partition, ...; `cluster: h100` takes them and cluster.env/setup from
conf/cluster/h100.yaml) and the benchmark (`bench:` ops, sizes, dtype, iterations). Every (setting x
node count) is one element of a single `sbatch --array` job, submitted with submitit's `map_array`.

Each element's batch script runs one Python function (submitit, `use_srun=False`) that starts the
benchmark on its nodes with `srun --nodes=K --ntasks-per-node=T python -m hpctrain.bench.collectives`,
the setting's variables exported into the srun environment (cluster.env first, then the setting; a
value of null unsets a variable), writing into `<out>/<setting>/` (`<setting>_<K>n/` when several node
counts are swept): results.jsonl, table.txt, bench.log, setting.json.

Node counts: a job array has one allocation shape, so every element asks for max(nodes) nodes and
runs its srun on the first K of them. Elements ask for `--exclusive` nodes (default) so that no other
job shares the links being measured.

Settings are checked before anything is submitted: an unknown NCCL_ALGO / NCCL_PROTO value, a
misspelled NCCL_* name, a non-integer channel count, an unknown operation all raise SweepConfigError
naming the key and the valid values (NCCL itself silently ignores what it does not understand).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf

from hpctrain.bench import collectives as C
from hpctrain.core.compose import ConfigError, compose, conf_dir
from hpctrain.core.nccl_words import parse_size
from hpctrain.core.spec import ranks_per_node
from hpctrain.launch.allocation import allocation, sbatch_lines, submitit_parameters
from hpctrain.report import nccl_report as report


class SweepConfigError(ConfigError):
    """A sweep that must not be submitted; the message names the key and the valid values."""


# ----------------------------------------------------------------------------------------------
# NCCL variables: what is checked, and how.

NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("Simple", "LL", "LL128")
NCCL_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")  # per-collective form
NET_GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")

# Documented NCCL variables (a name outside this list that is close to one in it is a typo).
KNOWN_NCCL = (
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
    "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT", "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_IB_DISABLE",
    "NCCL_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_PCI_RELAXED_ORDERING",
    "NCCL_IB_AR_THRESHOLD", "NCCL_IB_CUDA_SUPPORT", "NCCL_IB_MERGE_NICS", "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_CROSS_NIC", "NCCL_NVLS_ENABLE", "NCCL_NVLS_CHUNKSIZE", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
    "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ",
    "NCCL_NET_SHARED_BUFFERS", "NCCL_NET_SHARED_COMMS", "NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN",
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_NVL_CHUNKSIZE",
    "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_P2P_LL_THRESHOLD", "NCCL_SHM_DISABLE", "NCCL_PXN_DISABLE",
    "NCCL_P2P_PXN_LEVEL", "NCCL_COLLNET_ENABLE", "NCCL_COLLNET_NODE_THRESHOLD", "NCCL_TOPO_FILE",
    "NCCL_TOPO_DUMP_FILE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_LAUNCH_MODE",
    "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_GRAPH_REGISTER", "NCCL_LOCAL_REGISTER",
    "NCCL_DMABUF_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_NVB_DISABLE",
    "NCCL_IGNORE_CPU_AFFINITY", "NCCL_CONF_FILE", "NCCL_HOSTID", "NCCL_COMM_BLOCKING",
    "NCCL_GRAPH_MIXING_SUPPORT", "NCCL_SET_STACK_SIZE", "NCCL_SET_THREAD_NAME", "NCCL_RUNTIME_CONNECT",
    "NCCL_WORK_FIFO_DEPTH", "NCCL_ALLOC_P2P_NET_LL_BUFFERS", "NCCL_SINGLE_RING_THRESHOLD",
    "NCCL_LL_THRESHOLD", "NCCL_TREE_THRESHOLD", "NCCL_LL128_NTHREADS", "NCCL_CTA_POLICY",
    "NCCL_NVLS_TREE_ENABLE", "NCCL_PAT_ENABLE", "NCCL_MNNVL_ENABLE", "NCCL_IB_ECE_ENABLE",
    "NCCL_NET_OVERHEAD", "NCCL_IB_USE_INLINE", "NCCL_NCHANNELS_PER_NET_PEER", "NCCL_MIN_P2P_NCHANNELS",
    "NCCL_MAX_P2P_NCHANNELS", "NCCL_NVLINK_SHARP_ENABLE", "NCCL_PROFILER_PLUGIN", "NCCL_ENV_PLUGIN",
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SETTING_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


def _err(key: str, msg: str) -> SweepConfigError:
    return SweepConfigError(f"{key}: {msg}")


def _check_list(key: str, value: str, valid: Sequence[str]) -> None:
    """NCCL's list syntax: [^]a,b,c (case-insensitive), or per collective `allreduce:a,b;allgather:^c`
    (NCCL >= 2.24). NCCL silently skips tokens it does not know, so we refuse them here."""
    text = str(value).strip()
    if not text:
        raise _err(key, f"empty value; valid values: {', '.join(valid)} (comma lists allowed, ^ to exclude)")
    parts = text.split(";") if (";" in text or ":" in text) else [text]
    lower = {v.lower(): v for v in valid}
    for part in parts:
        part = part.strip()
        if ":" in part:
            func, _, part = part.partition(":")
            if func.strip().lower() not in {f.lower() for f in NCCL_FUNCS}:
                raise _err(key, f"unknown collective {func.strip()!r} in {value!r}; valid collectives: "
                                f"{', '.join(NCCL_FUNCS)} (form 'allreduce:Ring,Tree;allgather:Ring')")
        tokens = part.lstrip("^").split(",")
        for tok in tokens:
            if tok.strip().lower() not in lower:
                near = difflib.get_close_matches(tok.strip().lower(), list(lower), n=1)
                hint = f" (did you mean {lower[near[0]]}?)" if near else ""
                raise _err(key, f"unknown value {tok.strip()!r} in {value!r}{hint}; valid values: "
                                f"{', '.join(valid)} (comma lists allowed, ^ to exclude)")


def _check_int(key: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        v = int(str(value).strip(), 0)
    except ValueError:
        raise _err(key, f"{value!r} is not an integer") from None
    if v < lo or (hi is not None and v > hi):
        raise _err(key, f"{v} is out of range: valid values are {lo}..{hi if hi is not None else 'any'}")
    return v


def _check_choice(key: str, value: Any, valid: Sequence[str]) -> None:
    if str(value) not in valid:
        raise _err(key, f"{value!r} is not valid; valid values: {', '.join(valid)}")


def check_env(env: Mapping[str, Any], where: str = "env") -> dict[str, str | None]:
    """Validate one setting's variables; returns them as strings (None = unset)."""
    out: dict[str, str | None] = {}
    for key, value in env.items():
        key = str(key)
        full = f"{where}.{key}"
        if not _ENV_NAME.match(key):
            raise _err(full, "is not an environment variable name")
        if value is None:
            out[key] = None
            continue
        if isinstance(value, (list, dict, tuple)):
            raise _err(full, f"must be a single value (string or number), got {value!r}")
        if isinstance(value, bool):
            value = int(value)
        sval = str(value)
        if key == "NCCL_ALGO":
            _check_list(full, sval, NCCL_ALGOS)
        elif key == "NCCL_PROTO":
            _check_list(full, sval, NCCL_PROTOS)
        elif key in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS"):
            _check_int(full, sval, 1, 64)
        elif key in ("NCCL_BUFFSIZE", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_NVL_CHUNKSIZE",
                     "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_NVLS_CHUNKSIZE"):
            _check_int(full, sval, 1)
        elif key == "NCCL_IB_QPS_PER_CONNECTION":
            _check_int(full, sval, 1, 128)
        elif key in ("NCCL_SOCKET_NTHREADS",):
            _check_int(full, sval, 1, 16)
        elif key in ("NCCL_NSOCKS_PERTHREAD",):
            _check_int(full, sval, 1, 64)
        elif key == "NCCL_NTHREADS":
            v = _check_int(full, sval, 64, 512)
            if v % 32:
                raise _err(full, f"{v} must be a multiple of 32 (64..512)")
        elif key == "NCCL_CROSS_NIC":
            _check_choice(full, sval, ("0", "1", "2"))
        elif key in ("NCCL_NVLS_ENABLE", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
                     "NCCL_PXN_DISABLE", "NCCL_COLLNET_ENABLE", "NCCL_NET_GDR_READ", "NCCL_CUMEM_ENABLE",
                     "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_SPLIT_DATA_ON_QPS",
                     "NCCL_NVB_DISABLE", "NCCL_DMABUF_ENABLE", "NCCL_NET_SHARED_BUFFERS", "NCCL_NVLS_TREE_ENABLE"):
            _check_choice(full, sval, ("0", "1") if key != "NCCL_IB_PCI_RELAXED_ORDERING" else ("0", "1", "2"))
        elif key == "NCCL_NET_GDR_LEVEL":
            if sval.upper() not in NET_GDR_LEVELS:
                _check_int(full, sval, 0, 5)
        elif key in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME"):
            if not sval.strip():
                raise _err(full, "must not be empty (leave the variable out for the default)")
        elif key == "OMP_NUM_THREADS":
            _check_int(full, sval, 1)
        elif key.startswith("NCCL_") and key not in KNOWN_NCCL:
            near = difflib.get_close_matches(key, KNOWN_NCCL, n=1, cutoff=0.8)
            if near:
                raise _err(full, f"unknown NCCL variable (NCCL would silently ignore it); did you mean {near[0]}?")
        out[key] = sval
    mn, mx = out.get("NCCL_MIN_NCHANNELS"), out.get("NCCL_MAX_NCHANNELS")
    if mn is not None and mx is not None and int(mn, 0) > int(mx, 0):
        raise _err(f"{where}.NCCL_MIN_NCHANNELS", f"{mn} is larger than NCCL_MAX_NCHANNELS={mx}")
    return out


# ----------------------------------------------------------------------------------------------
# The sweep description.

DEFAULTS: dict[str, Any] = {
    "name": None,
    "description": "",
    "cluster": None,
    "nodes": [1],
    "tasks_per_node": None,  # default: the cluster's (GPUs per node where it has GPUs), else 1
    "gpus_per_node": None,
    "cpus_per_task": None,
    "partition": None, "account": None, "qos": None, "constraint": None,
    "time_min": 30,
    "exclusive": True,
    "array_parallelism": 64,
    "setup": [],
    "env": {},  # exported for every setting, before the setting's own
    "baseline": "default",
    "settings": {},
    "grid": {},
    "bench": {},
    "srun_args": [],
}
BENCH_DEFAULTS: dict[str, Any] = {
    "ops": ["all_reduce", "all_gather", "reduce_scatter"],
    "min_bytes": "1K", "max_bytes": "1G", "factor": 2, "dtype": "float32",
    "warmup": 5, "iters": 20, "repeats": 3, "backend": "auto", "timeout": 300,
}


@dataclass
class Element:
    """One array element: a setting on a node count."""
    setting: str
    nodes: int
    tasks_per_node: int
    env: dict  # the setting's own variables (None = unset)
    base_env: dict  # cluster.env + sweep env, exported first
    dir: str
    bench_args: list
    srun_args: list = field(default_factory=list)
    cpus_per_task: int | None = None
    python: str = sys.executable


@dataclass
class Sweep:
    name: str
    out: Path
    baseline: str
    settings: dict  # name -> env
    nodes: list
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int | None
    slurm: dict  # partition, account, qos, constraint, time_min, exclusive, array_parallelism, setup
    bench: dict
    elements: list
    description: str = ""
    source: str = ""
    base_env: dict = field(default_factory=dict)  # cluster.env + the sweep's env:, under every setting


def resolve_path(spec: str) -> Path:
    """A sweep file path, or a name in conf/sweep/."""
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    cand = conf_dir() / "sweep" / f"{spec}.yaml"
    if cand.is_file():
        return cand
    known = sorted(x.stem for x in (conf_dir() / "sweep").glob("*.yaml"))
    raise SweepConfigError(f"sweep {spec!r}: no such file, and not a name in conf/sweep/ "
                           f"(known: {', '.join(known)})")


def load(spec: str | Path | Mapping, overrides: Sequence[str] = ()) -> dict:
    """The sweep as a plain dict: file (or name, or mapping) + dotted overrides (`bench.iters=5`)."""
    if isinstance(spec, Mapping):
        cfg = OmegaConf.create(dict(spec))
        source = "<mapping>"
    else:
        path = resolve_path(str(spec))
        cfg = OmegaConf.load(path)
        source = str(path)
    if overrides:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        except Exception as e:  # noqa: BLE001 - OmegaConf raises several types
            raise SweepConfigError(f"cannot apply overrides {list(overrides)}: {e}") from None
    raw = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(raw, dict):
        raise SweepConfigError(f"{source}: a sweep file is a mapping, got {type(raw).__name__}")
    raw.setdefault("_source", source)
    return raw


def _cluster(name: str | None, overrides: dict):
    """The cluster group as the training launchers see it (composed and typed against the schema),
    with the sweep's own values for the keys it sets."""
    if name and not (conf_dir() / "cluster" / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in (conf_dir() / "cluster").glob("*.yaml"))
        raise SweepConfigError(f"cluster: {name!r} is not in conf/cluster/ (known: {', '.join(known)})")
    try:
        cfg = compose([f"cluster={name}"] if name else [], resolve_paths=False)
    except ConfigError as e:
        raise SweepConfigError(f"cluster: {e}") from None
    cluster = OmegaConf.structured(cfg.cluster)  # the overrides validated against the schema's types
    try:
        for key, value in overrides.items():
            if value is not None:
                cluster[key] = value
    except Exception as e:  # noqa: BLE001 - OmegaConf raises several types
        raise SweepConfigError(f"cluster: {e}") from None
    return OmegaConf.to_object(cluster)


def _expand(axes: Sequence[tuple[str, Sequence]]) -> list[list]:
    """The elements of `axes` as `python -m hpctrain -m` expands its sweeps (one order, one limit: a job
    array's size), refused as this sweep's errors."""
    # heavy: the multirun module brings Hydra's override grammar and the planner (~0.3 s), only when a
    # sweep is built
    from hpctrain.launch.multirun import expand_axes

    try:
        return expand_axes(axes)
    except ConfigError as e:
        raise SweepConfigError(str(e)) from None


def _grid_name(combo: Sequence[tuple[str, Any]]) -> str:
    """`NCCL_ALGO=Ring, NCCL_PROTO=LL128` -> `algo-ring_proto-ll128` (a directory name)."""
    parts = []
    for k, v in combo:
        short = (k[5:] if k.startswith("NCCL_") else k).lower()
        val = re.sub(r"[^a-z0-9.+]+", "-", str(v).lower().replace("^", "no-")).strip("-") or "none"
        parts.append(f"{short}-{val}")
    return "_".join(parts)


def build(raw: Mapping, out: str | Path) -> Sweep:
    """Validate a loaded sweep and expand it into elements; raises SweepConfigError."""
    unknown = sorted(set(raw) - set(DEFAULTS) - {"_source"})
    if unknown:
        raise SweepConfigError(f"unknown key(s) {unknown} in the sweep; valid keys: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k in ("name",)}}
    src = raw.get("_source", "")
    name = cfg["name"] or (Path(src).stem if src and src != "<mapping>" else "sweep")

    for key in ("tasks_per_node", "gpus_per_node"):
        v = cfg[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "tasks_per_node" else 0)):
            raise SweepConfigError(f"{key}: {v!r} must be an integer >= {1 if key == 'tasks_per_node' else 0}")
    cl = _cluster(cfg["cluster"], {k: cfg[k] for k in ("gpus_per_node", "cpus_per_task", "partition", "account",
                                                      "qos", "constraint")})
    # One task per GPU where the nodes have GPUs (hpctrain.core.spec.ranks_per_node), unless the sweep says.
    tpn = cfg["tasks_per_node"] or ranks_per_node(cl)
    gpus, cpt = cl.gpus_per_node, cl.cpus_per_task

    nodes = cfg["nodes"]
    nodes = [nodes] if isinstance(nodes, int) else list(nodes)
    if not nodes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in nodes):
        raise SweepConfigError(f"nodes: {cfg['nodes']!r} must be a node count or a list of them (each >= 1)")
    nodes = sorted(set(nodes))

    bench = {**BENCH_DEFAULTS, **(cfg["bench"] or {})}
    bad = sorted(set(bench) - set(BENCH_DEFAULTS))
    if bad:
        raise SweepConfigError(f"bench: unknown key(s) {bad}; valid keys: {', '.join(BENCH_DEFAULTS)}")
    try:
        ops = C.parse_ops(bench["ops"])
    except ValueError as e:
        raise SweepConfigError(f"bench.ops: {e}") from None
    try:
        lo, hi = parse_size(bench["min_bytes"]), parse_size(bench["max_bytes"])
        C.sizes(lo, hi, float(bench["factor"]))
    except ValueError as e:
        raise SweepConfigError(f"bench.min_bytes/max_bytes/factor: {e}") from None
    if str(bench["dtype"]) not in C.DTYPES:
        raise SweepConfigError(f"bench.dtype: {bench['dtype']!r} is not valid; valid: {', '.join(sorted(C.DTYPES))}")
    if bench["backend"] not in ("auto", "nccl", "gloo"):
        raise SweepConfigError(f"bench.backend: {bench['backend']!r} is not valid; valid: auto, nccl, gloo")
    for key, lo_ in (("warmup", 0), ("iters", 1), ("repeats", 1), ("timeout", 1)):
        _check_int(f"bench.{key}", bench[key], lo_)

    base_env = {**check_env(dict(cl.env or {}), "cluster.env"), **check_env(cfg["env"] or {}, "env")}

    settings: dict[str, dict] = {}
    for sname, env in (cfg["settings"] or {}).items():
        sname = str(sname)
        if not _SETTING_NAME.match(sname):
            raise SweepConfigError(f"settings.{sname}: a setting name becomes a directory: use letters, digits "
                                   "and _ . + = - (not starting with a punctuation mark)")
        if env is not None and not isinstance(env, Mapping):
            raise SweepConfigError(f"settings.{sname}: must be a mapping of environment variables, got {env!r}")
        settings[sname] = check_env(env or {}, f"settings.{sname}")
    grid = cfg["grid"] or {}
    if grid:
        for pairs in _expand([(f"grid.{k}", [(k, v) for v in (vs if isinstance(vs, list) else [vs])])
                              for k, vs in grid.items()]):
            env = check_env(dict(pairs), "grid")
            gname = _grid_name(pairs)
            if gname in settings:
                raise SweepConfigError(f"grid: the setting {gname!r} also appears under settings:")
            settings[gname] = env
    if not settings:
        raise SweepConfigError("settings: the sweep has no settings (give `settings:` and/or `grid:`)")
    baseline = str(cfg["baseline"])
    if baseline not in settings:
        if baseline == "default" and "default" not in settings:
            settings = {"default": {}, **settings}
        else:
            raise SweepConfigError(f"baseline: {baseline!r} is not one of the settings ({', '.join(settings)})")

    out = Path(out)
    bench_args = ["--ops", ",".join(ops), "--min-bytes", str(bench["min_bytes"]), "--max-bytes",
                  str(bench["max_bytes"]), "--factor", str(bench["factor"]), "--dtype", str(bench["dtype"]),
                  "--warmup", str(bench["warmup"]), "--iters", str(bench["iters"]), "--repeats",
                  str(bench["repeats"]), "--backend",
                  str(bench["backend"]), "--timeout", str(bench["timeout"])]
    srun_args = [str(a) for a in (cfg["srun_args"] or [])]
    elements = []
    for (sname, env), k in _expand([("settings", list(settings.items())), ("nodes", nodes)]):
        d = out / (sname if len(nodes) == 1 else f"{sname}_{k}n")
        elements.append(Element(sname, k, tpn, env, base_env, str(d), bench_args, srun_args, cpt))
    time_min = _check_int("time_min", cfg["time_min"], 1)
    slurm = {"time_min": time_min, "exclusive": bool(cfg["exclusive"]),
             "array_parallelism": _check_int("array_parallelism", cfg["array_parallelism"], 1),
             "setup": list(cl.setup or []) + list(cfg["setup"] or []),
             "options": allocation(cl, f"sweep-{name}", nodes=max(nodes), tasks_per_node=tpn,
                                   more={"time": f"{time_min}:00", **({"exclusive": True} if cfg["exclusive"] else {})})}
    return Sweep(name=str(name), out=out, baseline=baseline, settings=settings, nodes=nodes, tasks_per_node=tpn,
                 gpus_per_node=gpus, cpus_per_task=cpt, slurm=slurm,
                 bench={**bench, "ops": ops}, elements=elements, description=str(cfg["description"] or ""),
                 source=src, base_env=base_env)


# ----------------------------------------------------------------------------------------------
# What one array element does (inside its batch script, on the first node of its allocation).

def srun_command(el: Element) -> list[str]:
    cmd = ["srun", f"--nodes={el.nodes}", f"--ntasks={el.nodes * el.tasks_per_node}",
           f"--ntasks-per-node={el.tasks_per_node}", "--kill-on-bad-exit=1", "--export=ALL"]
    if el.cpus_per_task:
        cmd.append(f"--cpus-per-task={el.cpus_per_task}")
    cmd += el.srun_args
    cmd += [el.python, "-u", "-m", "hpctrain.bench.collectives", "--out-dir", el.dir, "--setting", el.setting,
            *el.bench_args]
    return cmd


def element_env(el: Element, base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    for layer in (el.base_env, el.env):
        for k, v in layer.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
    env["HPCTRAIN_BENCH_SETTING"] = el.setting
    pkg_root = str(Path(__file__).resolve().parents[2])  # hpctrain importable on every node
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_element(el: Element) -> dict:
    """Run one setting's benchmark under srun; raise with the log's tail if it fails."""
    d = Path(el.dir)
    d.mkdir(parents=True, exist_ok=True)
    cmd = srun_command(el)
    meta = {**asdict(el), "command": cmd, "job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"), "nodelist": os.environ.get("SLURM_JOB_NODELIST"),
            "started": _dt.datetime.now().isoformat(timespec="seconds")}
    (d / "setting.json").write_text(json.dumps(meta, indent=2) + "\n")
    t0 = time.monotonic()
    with open(d / "bench.log", "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.write("# env: " + " ".join(f"{k}={v}" for k, v in {**el.base_env, **el.env}.items()) + "\n")
        log.flush()
        rc = subprocess.call(cmd, env=element_env(el, os.environ), stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - t0
    rows = 0
    if (d / "results.jsonl").is_file():
        rows = sum(1 for line in (d / "results.jsonl").read_text().splitlines() if line.strip())
    meta.update(rc=rc, seconds=round(seconds, 1), rows=rows)
    (d / "setting.json").write_text(json.dumps(meta, indent=2) + "\n")
    if rc != 0:
        tail = "\n".join((d / "bench.log").read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"setting {el.setting!r} on {el.nodes} node(s) failed (srun exit {rc}); "
                           f"{d / 'bench.log'} ends with:\n{tail}")
    return {"setting": el.setting, "nodes": el.nodes, "dir": el.dir, "rows": rows, "seconds": round(seconds, 1)}


# ----------------------------------------------------------------------------------------------
# Submission.

def executor_parameters(sw: Sweep) -> dict:
    """submitit SlurmExecutor parameters for the array: the allocation of the training launchers
    (hpctrain.launch.allocation) for the largest node count; each element is one process in the
    batch script that starts its own srun (use_srun=False)."""
    params = submitit_parameters(sw.slurm["options"], own_srun=True)
    params.update(array_parallelism=sw.slurm["array_parallelism"], stderr_to_stdout=True)
    if sw.slurm["setup"]:
        params["setup"] = list(sw.slurm["setup"])
    return params


def sbatch_text(sw: Sweep) -> str:
    """What the array's batch script asks Slurm for (for --dry-run); submitit writes the script itself."""
    options = {**sw.slurm["options"], "array": f"0-{len(sw.elements) - 1}%{sw.slurm['array_parallelism']}"}
    return "\n".join(["#!/bin/bash", *sbatch_lines(options), *sw.slurm["setup"],
                      f"# each element: {shlex.join(srun_command(sw.elements[0]))} (one per setting)"]) + "\n"


def manifest(sw: Sweep) -> dict:
    return {"name": sw.name, "description": sw.description, "source": sw.source, "baseline": sw.baseline,
            "settings": sw.settings, "base_env": sw.base_env, "nodes": sw.nodes, "tasks_per_node": sw.tasks_per_node,
            "gpus_per_node": sw.gpus_per_node, "bench": sw.bench, "slurm": sw.slurm,
            "elements": [{"setting": e.setting, "nodes": e.nodes, "dir": Path(e.dir).name} for e in sw.elements],
            "created": _dt.datetime.now().isoformat(timespec="seconds")}


def submit(sw: Sweep, force: bool = False):
    """Submit the sweep as one job array; returns the submitit jobs (one per element)."""
    # heavy: submitit (~0.15 s), only when submitting
    import submitit

    mf = sw.out / "sweep.json"
    if mf.exists() and not force:
        raise SweepConfigError(f"{sw.out} already holds a sweep ({mf}); choose another --out or pass --force")
    sw.out.mkdir(parents=True, exist_ok=True)
    ex = submitit.SlurmExecutor(folder=sw.out / "slurm" / "%j")
    ex.update_parameters(**executor_parameters(sw))
    data = manifest(sw)
    mf.write_text(json.dumps(data, indent=2) + "\n")
    jobs = ex.map_array(run_element, sw.elements)
    array_id = jobs[0].job_id.split("_")[0] if jobs else None
    data.update(array_job=array_id, job_ids=[j.job_id for j in jobs],
                submitted=_dt.datetime.now().isoformat(timespec="seconds"))
    mf.write_text(json.dumps(data, indent=2) + "\n")
    return jobs


def wait(jobs, poll_s: float = 2.0) -> list[tuple[Any, BaseException | None]]:
    """Wait for every element; (job, exception or None) each."""
    out = []
    for j in jobs:
        try:
            j.result()
            out.append((j, None))
        except Exception as e:  # noqa: BLE001 - report every element, do not stop at the first failure
            out.append((j, e))
    return out


def describe(sw: Sweep) -> str:
    lines = [f"sweep {sw.name!r}: {len(sw.settings)} setting(s) x {len(sw.nodes)} node count(s) = "
             f"{len(sw.elements)} array element(s); {sw.tasks_per_node} task(s)/node"
             + (f", {sw.gpus_per_node} GPU(s)/node" if sw.gpus_per_node else "")
             + f"; baseline {sw.baseline!r}; ops {', '.join(sw.bench['ops'])}; "
               f"{sw.bench['min_bytes']}..{sw.bench['max_bytes']} x{sw.bench['factor']} {sw.bench['dtype']}"]
    for e in sw.elements:
        env = " ".join(f"{k}={'(unset)' if v is None else v}" for k, v in e.env.items()) or "(no variables)"
        lines.append(f"  {Path(e.dir).name:<32} nodes={e.nodes:<3} {env}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="a sweep file, or the name of one in conf/sweep/")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. nodes=[2,4] bench.max_bytes=256M")
    ap.add_argument("--out", default=None, help="the sweep directory (default outputs/sweeps/<name>-<time>)")
    ap.add_argument("--dry-run", action="store_true", help="check and print the elements and batch script only")
    ap.add_argument("--wait", action="store_true", help="wait until every element has finished")
    ap.add_argument("--report", action="store_true", help="with --wait: run the report afterwards")
    ap.add_argument("--force", action="store_true", help="submit into a directory that already holds a sweep")
    a = ap.parse_intermixed_args(argv)
    try:
        raw = load(a.sweep, a.overrides)
        name = raw.get("name") or Path(raw.get("_source", "sweep")).stem
        out = Path(a.out or f"outputs/sweeps/{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}").resolve()
        sw = build(raw, out)
    except SweepConfigError as e:
        print(f"hpctrain.bench.sweep: {e}", file=sys.stderr)
        return 2
    print(describe(sw))
    if a.dry_run:
        print("\n# batch script of the array (submitit writes it at submission):\n" + sbatch_text(sw))
        return 0
    try:
        jobs = submit(sw, force=a.force)
    except SweepConfigError as e:
        print(f"hpctrain.bench.sweep: {e}", file=sys.stderr)
        return 2
    print(f"submitted array job {jobs[0].job_id.split('_')[0]} ({len(jobs)} elements); results in {sw.out}\n"
          f"report: python -m hpctrain.report.nccl_report {sw.out}")
    if not a.wait:
        return 0
    failed = [(j, e) for j, e in wait(jobs) if e is not None]
    for j, e in failed:
        lines = str(e).splitlines()
        ours = [x for x in lines if "failed (srun exit" in x]  # run_element's own message, inside submitit's
        print(f"element {j.job_id} failed: {(ours or lines or [type(e).__name__])[-1].strip()}", file=sys.stderr)
    if a.report:
        report.main([str(sw.out)])
    return 1 if failed else 0


if __name__ == "__main__":
    # Run main() from the module under its import name, not as __main__: submitit pickles
    # run_element and the Element objects by reference to hpctrain.bench.sweep that way (by value from
    # __main__, the dataclass arrives without its fields).
    from hpctrain.bench.sweep import main as _main

    sys.exit(_main())
