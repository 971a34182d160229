"""Slurm input that would fail late, refused on the login node: time limits and partition shapes.

`time_problems(cfg)` is pure. `partition_problems(cfg, sinfo_text)` is pure too; `partition_facts()`
asks the live cluster (`sinfo`, with a timeout) and returns None where there is no sinfo or it does
not answer, in which case the partition checks are skipped: sbatch itself refuses what is left.
Messages name the key and a fix, like every check in `hpctrain.checks.config_checks`.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Optional
from hpctrain.core.schema import Config

SLURM_LAUNCHERS = ("slurm", "sbatch")
# Slurm delivers `--signal=<sig>@<lead>` up to this many seconds before the lead (its resolution).
SIGNAL_RESOLUTION_S = 60
# What a run needs at least between its start and the earliest signal: imports, rendezvous, a step.
MIN_WORK_S = 60
MAX_SIGNAL_LEAD_S = 65535  # Slurm keeps the lead in 16 bits
UNLIMITED = ("infinite", "unlimited")
TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
SINFO_FORMAT = "%P|%N|%c|%G|%l"  # with -N: one line per (partition, node)


def parse_time(text: Any) -> Optional[int]:
    """A Slurm time limit (`--time`) in seconds; 0 for no limit ("0", "infinite", "unlimited").
    Raises ValueError for anything sbatch would not take. Like sbatch, fields above 59 are accepted
    (`90:00` is 90 minutes); unlike it, negative values (sbatch reads them as no limit) are not."""
    s = str(text)
    if s.lower() in UNLIMITED:
        return 0
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ValueError(s)
    days, a, b, c = m.groups()
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, se = int(a), int(b or 0), int(c or 0)
        d = int(days)
    elif c is not None:  # HH:MM:SS
        d, h, mi, se = 0, int(a), int(b), int(c)
    elif b is not None:  # MM:SS
        d, h, mi, se = 0, 0, int(a), int(b)
    else:  # minutes
        d, h, mi, se = 0, 0, int(a), 0
    return ((d * 24 + h) * 60 + mi) * 60 + se


def minutes(text: Any) -> int:
    """The time limit in whole minutes, as Slurm keeps it (seconds round up); 0 = no limit."""
    return math.ceil(parse_time(text) / 60)


def fmt(seconds: int) -> str:
    h, rest = divmod(int(seconds), 3600)
    return f"{h:02d}:{rest // 60:02d}:{rest % 60:02d}"


def time_problems(cfg: Config) -> list[str]:
    c = cfg.cluster
    out = []
    lead = c.signal_lead_s
    if not 1 <= lead <= MAX_SIGNAL_LEAD_S:
        out.append(f"cluster.signal_lead_s={lead} must lie in 1..{MAX_SIGNAL_LEAD_S}: it is how many seconds "
                   "before the time limit Slurm sends USR2 so that all ranks can save. Fix: cluster.signal_lead_s=120")
        lead = None
    try:
        limit = parse_time(c.time)
    except ValueError:
        out.append(f"cluster.time={c.time!r} is not a Slurm time limit ({TIME_FORMATS}). "
                   "Fix: e.g. cluster.time=01:00:00 for one hour, cluster.time=2-00:00:00 for two days")
        return out
    if lead is not None and limit:
        need = lead + SIGNAL_RESOLUTION_S + MIN_WORK_S
        if limit < need:
            out.append(f"cluster.time={c.time} ({limit} s) is too short for cluster.signal_lead_s={lead}: Slurm "
                       f"sends USR2 {lead} s before the limit and up to {SIGNAL_RESOLUTION_S} s earlier still, "
                       f"which leaves less than {MIN_WORK_S} s to train. Fix: cluster.time={fmt(need)} or longer, "
                       "or a smaller cluster.signal_lead_s")
    return out


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: tuple  # (cpus, gpus) per node
    max_time_s: int  # 0 = no limit


def gpus_of(gres: str) -> int:
    """GPUs per node from sinfo's %G: `gpu:8`, `gpu:h100:8(S:0-1)`, `gpu:a100:4,gpu:v100:2`, `(null)`."""
    gres = re.sub(r"\([^)]*\)", "", gres or "")
    total = 0
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`sinfo -h -N -o '%P|%N|%c|%G|%l'` output -> partitions by name."""
    rows: dict[str, dict] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        part, node, cpus, gres, limit = fields
        default = part.endswith("*")
        name = part.rstrip("*")
        row = rows.setdefault(name, {"default": default, "nodes": {}, "limit": limit})
        row["nodes"][node] = (int(cpus) if cpus.isdigit() else 0, gpus_of(gres))
    out = {}
    for name, row in rows.items():
        try:
            max_time = parse_time(row["limit"])
        except ValueError:
            max_time = 0
        out[name] = Partition(name, row["default"], tuple(row["nodes"].values()), max_time)
    return out


def partition_facts(timeout_s: float = 10.0) -> Optional[dict[str, Partition]]:
    """The live cluster's partitions, or None without a working sinfo."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    try:
        proc = subprocess.run([sinfo, "-h", "-N", "-o", SINFO_FORMAT], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return parse_sinfo(proc.stdout) or None


def partition_check(cfg: Config) -> list[str]:
    """The partition check a submission makes (config_checks runs it, the planner labels by it): the live
    cluster's partition against the job, for Slurm's launchers only; [] where no Slurm answers sinfo."""
    if cfg.launcher.name not in SLURM_LAUNCHERS:
        return []
    partitions = partition_facts()
    return partition_problems(cfg, partitions) if partitions else []


def partition_problems(cfg: Config, partitions: dict[str, Partition]) -> list[str]:
    c = cfg.cluster
    names = ", ".join(sorted(partitions))
    if c.partition is None:
        defaults = [p for p in partitions.values() if p.default]
        if not defaults:
            return [f"cluster.partition is unset and this cluster has no default partition. "
                    f"Fix: cluster.partition=<one of {names}>"]
        part = defaults[0]
        key = f"the default partition ({part.name})"
    elif c.partition not in partitions:
        return [f"cluster.partition={c.partition}: no such partition on this cluster (sinfo lists {names}). "
                f"Fix: cluster.partition={sorted(partitions, key=lambda n: not partitions[n].default)[0]}"]
    else:
        part = partitions[c.partition]
        key = f"cluster.partition={part.name}"
    out = []
    gpus = c.gpus_per_node
    tasks = gpus if gpus > 0 else c.tasks_per_node
    cpus = tasks * c.cpus_per_task
    task_key = (f"cluster.gpus_per_node={gpus}" if gpus > 0 else f"cluster.tasks_per_node={tasks}")
    max_cpus = max((n[0] for n in part.nodes), default=0)
    max_gpus = max((n[1] for n in part.nodes), default=0)
    fitting = sum(1 for n_cpus, n_gpus in part.nodes if n_cpus >= cpus and n_gpus >= gpus)
    # The job asks for its spares too (cluster.spare_nodes: idle nodes that replace a lost one).
    spares = max(0, c.spare_nodes)
    asked = c.nodes + spares
    nodes_key = (f"cluster.nodes={c.nodes} + cluster.spare_nodes={spares} = {asked} nodes" if spares
                 else f"cluster.nodes={c.nodes}")

    def nodes_fix(n: int) -> str:
        return (f"cluster.nodes + cluster.spare_nodes = {n}" if spares else f"cluster.nodes={n}")
    if gpus > max_gpus:
        # The job's GPUs are what it was planned for: a partition that has them is the fix, not fewer GPUs.
        with_gpus = sorted(n for n, q in partitions.items() if max((g for _, g in q.nodes), default=0) >= gpus)
        fix = (f"cluster.partition={with_gpus[0]}" + (f" (partitions with {gpus} GPUs a node: {', '.join(with_gpus)})"
                                                      if len(with_gpus) > 1 else "")
               if with_gpus else f"a cluster with {gpus} GPUs a node, or cluster.gpus_per_node={max_gpus}"
               + ("" if max_gpus else " with cluster.tasks_per_node for a CPU run"))
        out.append(f"{task_key} but no node of {key} has more than {max_gpus} GPUs. Fix: {fix}")
    elif cpus > max_cpus:
        fix_tasks = max(1, max_cpus // max(1, c.cpus_per_task))
        out.append(f"{task_key} x cluster.cpus_per_task={c.cpus_per_task} = {cpus} CPUs per node, but no node "
                   f"of {key} has more than {max_cpus} CPUs. Fix: at most {fix_tasks} task(s) per node "
                   f"({'cluster.gpus_per_node' if gpus else 'cluster.tasks_per_node'}={fix_tasks}), "
                   "or fewer cluster.cpus_per_task")
    elif asked > len(part.nodes):
        out.append(f"{nodes_key} but {key} has only {len(part.nodes)} nodes. "
                   f"Fix: {nodes_fix(len(part.nodes))} (or fewer), or another partition")
    elif asked > fitting:
        out.append(f"{nodes_key} but only {fitting} nodes of {key} have {cpus} CPUs"
                   f"{f' and {gpus} GPUs' if gpus else ''} free for {tasks} tasks. "
                   f"Fix: {nodes_fix(fitting)} (or fewer), or fewer tasks per node")
    try:
        limit = parse_time(c.time)
    except ValueError:
        limit = None  # time_problems says so
    if limit is not None and part.max_time_s and (limit == 0 or limit > part.max_time_s):
        out.append(f"cluster.time={c.time} exceeds the time limit of {key} ({fmt(part.max_time_s)}). "
                   f"Fix: cluster.time={fmt(part.max_time_s)} or less (the run resumes after a requeue)")
    return out


_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNWRITABLE = ("\n", "\r", "\0")
# Variables bash gives a meaning of its own: `export NAME=value` in the batch script does not hand
# `value` to the job. Readonly ones end the script (set -e); RANDOM, SRANDOM, OPTIND and HISTCMD read
# the value as arithmetic, which runs a $(...) inside an array subscript however the value is quoted;
# the rest are replaced by bash's own value. Checked against bash 5.2; BASH_REMATCH was readonly
# before 5.1.
BASH_SPECIAL = frozenset((
    "BASHOPTS", "BASHPID", "BASH_ALIASES", "BASH_ARGC", "BASH_ARGV", "BASH_CMDS", "BASH_COMMAND", "BASH_COMPAT",
    "BASH_LINENO", "BASH_REMATCH", "BASH_SOURCE", "BASH_SUBSHELL", "BASH_VERSINFO", "BASH_XTRACEFD", "DIRSTACK",
    "EPOCHREALTIME", "EPOCHSECONDS", "EUID", "FUNCNAME", "GROUPS", "HISTCMD", "LINENO", "OPTIND", "PPID", "RANDOM",
    "SECONDS", "SHELLOPTS", "SRANDOM", "UID", "_"))
# The array script's own variable (hpctrain.launch.sbatch): an export of the same name would be lost.
SCRIPT_VARIABLES = frozenset(("run_dirs",))


def script_problems(cfg: Config, run_dir: Optional[str] = None) -> list[str]:
    """What cannot be written into a batch script's `#SBATCH` lines (sbatch's parser reads them, not
    the shell) or its environment: messages that name the key and the fix."""
    out = []
    c = cfg.cluster
    values = {"run.name": cfg.run.name, "run.dir": run_dir if run_dir is not None else cfg.run.dir}
    for key in ("mem", "time", "partition", "account", "qos", "constraint", "exclude"):
        values[f"cluster.{key}"] = getattr(c, key)
    for key, value in dict(c.sbatch_extra or {}).items():
        if not _OPTION.fullmatch(str(key).lstrip("-")):
            out.append(f"cluster.sbatch_extra has the key {str(key)!r}, which is not an sbatch option name. "
                       "Fix: use the long option without dashes, e.g. +cluster.sbatch_extra.mail-type=END")
        values[f"cluster.sbatch_extra.{key}"] = value
    for key, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        if any(ch in str(value) for ch in "\n\r"):
            out.append(f"{key}={str(value)!r} holds a line break, which cannot be written into an #SBATCH line "
                       f"(sbatch would read the rest as a new line). Fix: give {key} on one line")
        elif "\0" in str(value):
            out.append(f"{key}={str(value)!r} holds a NUL character, which no #SBATCH line, argument or path can "
                       f"hold. Fix: remove it from {key}")
    if "\\" in str(values["run.dir"]):
        out.append(f"run.dir={values['run.dir']!r} holds a backslash, which turns off Slurm's %j in the log file "
                   "name. Fix: choose a run.dir without backslashes")
    if cfg.launcher.name == "slurm" and "%" in str(values["run.dir"]):
        # submitit writes <run.dir>/submitit/%j_0_log.out as sbatch's --output unescaped, and reads
        # %j, %t, %A and %a in its own folder as job ids: the logs and its files would land elsewhere.
        out.append(f"run.dir={values['run.dir']!r} holds a %, which submitit passes to Slurm unescaped in the log "
                   "file's name (Slurm would read %j, %x, %u... as the job id, name, user). Fix: choose a run.dir "
                   "without %, or launcher=sbatch, whose script escapes it")
    for i, line in enumerate(c.setup or []):
        if "\0" in str(line):
            out.append(f"cluster.setup[{i}]={str(line)!r} holds a NUL character, which no shell line can hold. "
                       f"Fix: remove it from cluster.setup[{i}]")
    out.extend(env_name_problems(c.env))
    out.extend(shell_env_problems(c.env))
    return out


# What a mount's path cannot hold: pyxis splits mounts at commas and a mount at colons, and writes each
# into a shell `echo "SRC DST FLAGS"` line of enroot's config (before pyxis 0.24 without escaping spaces).
UNSAFE = re.compile(r'[\s,:"$`\\\x00]')
_MOUNT_SPECIAL = ("tmpfs", "umount")  # pyxis's mount sources that are not paths
_MOUNT_FLAGS = re.compile(r"[A-Za-z0-9_=-]+(\+[A-Za-z0-9_=-]+)*")
IMAGE_EXAMPLE = "nvcr.io/nvidia/pytorch:24.05-py3 or a squashfs file, /lustre/images/pytorch.sqsh"


def mount_point(path: str) -> Optional[str]:
    """`path`, or the nearest directory above it that pyxis can mount; None if only / is left."""
    p = PurePosixPath(path)
    for candidate in (p, *p.parents):
        if str(candidate) == "/":
            return None
        if not UNSAFE.search(str(candidate)):
            return str(candidate)
    return None


def container_problems(cfg: Config, run_dir: Optional[str] = None, source: Optional[str] = None) -> list[str]:
    """cluster.container_* that pyxis would refuse, ignore or misread (hpctrain.launch.container), with
    `source` the checkout mounted for hpctrain's code (None: installed). launcher=k8s uses the image for
    its pods and is not checked here."""
    c, launcher = cfg.cluster, cfg.launcher.name
    if launcher not in ("local", *SLURM_LAUNCHERS):
        return []
    image = c.container_image
    if image is None:
        out = []
        for key, value, unset in (("container_mounts", list(c.container_mounts or []), "[]"),
                                  ("container_workdir", c.container_workdir, "null")):
            if value:
                out.append(f"cluster.{key}={value} is set but cluster.container_image is not, so the ranks would "
                           f"run outside any container and cluster.{key} would be ignored. Fix: "
                           f"cluster.container_image=<image>, e.g. {IMAGE_EXAMPLE}; or cluster.{key}={unset} "
                           "to run without a container")
        return out
    if launcher == "local":
        # Not a warning: the run would train with this machine's Python and libraries while its
        # config names an image; the user finds out from versions in the logs, if at all.
        return [f"cluster.container_image={image} is set but launcher=local starts the ranks as processes on "
                "this machine, not with srun, so no container would run them. Fix: launcher=sbatch or "
                "launcher=slurm to run in the image (pyxis), or cluster.container_image=null to run here"]
    out = []
    if not str(image).strip() or any(ch.isspace() or ch == "\0" for ch in str(image)):
        out.append(f"cluster.container_image={str(image)!r} is empty or holds whitespace or a NUL character. Fix: "
                   f"cluster.container_image=<image>, e.g. {IMAGE_EXAMPLE}; or null for no container")
    elif str(image).startswith("."):
        out.append(f"cluster.container_image={image} is a relative path: the ranks start on other nodes. Fix: "
                   "the squashfs file's absolute path, e.g. cluster.container_image=/lustre/images/pytorch.sqsh")
    for i, mount in enumerate(c.container_mounts or []):
        out.extend(_mount_problems(f"cluster.container_mounts[{i}]", str(mount)))
    workdir = c.container_workdir
    if workdir is not None and not str(workdir).startswith("/"):
        out.append(f"cluster.container_workdir={str(workdir)!r} is not an absolute path inside the container. "
                   "Fix: e.g. cluster.container_workdir=/workspace, or null for the image's own working directory")
    elif workdir is not None and any(ch in str(workdir) for ch in _UNWRITABLE):
        out.append(f"cluster.container_workdir={str(workdir)!r} holds a line break. Fix: give it on one line")
    python = str(c.container_python)
    if not python.strip() or any(ch in python for ch in _UNWRITABLE):
        out.append(f"cluster.container_python={python!r} is not a command. Fix: cluster.container_python=python "
                   "(the image's python on its PATH) or an absolute path inside the image, e.g. /usr/bin/python3")
    for what, path in (("run.dir", run_dir if run_dir is not None else cfg.run.dir),
                       ("hpctrain's checkout (on the job's PYTHONPATH)", source)):
        if path and mount_point(str(path)) is None:
            fix = ("choose a run.dir whose path (or a directory above it, not /) has none of them"
                   if what == "run.dir" else
                   "install hpctrain (pip install .) instead of running it from this checkout, or move the checkout")
            out.append(f"{what} {str(path)!r} is mounted into the container, but it and every directory above it "
                       "hold a comma, colon, space, quote, $, ` or backslash, which pyxis's --container-mounts "
                       f"cannot carry. Fix: {fix}")
    return out


def _mount_problems(key: str, mount: str) -> list[str]:
    fmt = "SRC:DST[:FLAGS] (FLAGS joined by +, e.g. /lustre/data:/data:ro+rprivate)"
    if "," in mount:
        return [f"{key}={mount!r} holds a comma, which pyxis reads as the start of another mount. Fix: give each "
                f"mount as its own list item, as {fmt}"]
    parts = mount.split(":")
    if len(parts) > 3 or any(p == "" for p in parts):
        return [f"{key}={mount!r} is not a mount: pyxis takes {fmt}; paths cannot hold a colon. Fix: e.g. "
                "cluster.container_mounts=[/lustre/data:/data:ro]"]
    paths = [("source", parts[0])] + ([("destination", parts[1])] if len(parts) > 1 else [])  # no DST: SRC
    out = []
    if len(parts) == 3 and not _MOUNT_FLAGS.fullmatch(parts[2]):
        out.append(f"{key}={mount!r}: the flags {parts[2]!r} are not mount options joined by +. Fix: e.g. "
                   "ro, or ro+rprivate")
    for what, path in paths:
        if what == "source" and path in _MOUNT_SPECIAL:
            continue
        if not path.startswith("/"):
            out.append(f"{key}={mount!r}: the {what} {path!r} is not an absolute path. Fix: an absolute path, as "
                       f"{fmt}")
        elif UNSAFE.search(path):
            out.append(f"{key}={mount!r}: the {what} holds a space, quote, $, ` or backslash, which pyxis cannot "
                       f"pass to enroot. Fix: mount a directory above it whose path has none, as {fmt}")
    return out


def shell_env_problems(env) -> list[str]:
    """cluster.env that a batch script's `export NAME=value` cannot hand to the job as written (the
    Slurm launchers; a Kubernetes pod's env has no shell in between)."""
    out = []
    for key, value in dict(env or {}).items():
        name = str(key)
        if name in BASH_SPECIAL:
            out.append(f"cluster.env has the key {name!r}, a variable bash gives a meaning of its own: the batch "
                       f"script's `export {name}=...` would not pass the value on (bash keeps, refuses or "
                       "evaluates it). Fix: use another name")
        elif name in SCRIPT_VARIABLES:
            out.append(f"cluster.env has the key {name!r}, which the batch script uses itself (a sweep's run "
                       "directories). Fix: use another name")
        if value is not None and not isinstance(value, bool) and "\0" in str(value):
            out.append(f"cluster.env.{name}={str(value)!r} holds a NUL character, which no environment variable "
                       f"can hold. Fix: remove it from cluster.env.{name}")
    return out


def env_name_problems(env) -> list[str]:
    """cluster.env keys that are not environment variable names (a shell `export` or a pod's env refuses them)."""
    return [f"cluster.env has the key {str(key)!r}, which is not an environment variable name. "
            "Fix: use letters, digits and _ (not starting with a digit)"
            for key in dict(env or {}) if not _ENV_NAME.fullmatch(str(key))]
