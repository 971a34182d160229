"""Containers through pyxis/enroot (`cluster.container_image`): the flags of the srun step that starts
the ranks. Pure functions of the cluster config; without an image there are none, and nothing changes.

The batch script and the supervisor (hpctrain.launch.supervise, torch-free) stay on the batch host;
the supervisor starts each attempt's ranks with one srun step (hpctrain.launch.runners.SrunRunner),
and only that step runs in the image, through pyxis's srun options:

    srun <nodes, tasks, output...> --container-image=IMAGE --container-mounts=MOUNTS
         [--container-workdir=DIR] --container-env=NAMES  <container_python> -u -m hpctrain.run RUN_DIR

What pyxis does, and what follows here (NVIDIA/pyxis: args.c, pyxis_slurmstepd.c; --container-env
since pyxis 0.15):
- the image: enroot's `[USER@][REGISTRY#]IMAGE[:TAG]`, or a squashfs file. A Docker reference with a
  registry (`nvcr.io/nvidia/pytorch:24.05-py3`, the form launcher=k8s takes) would be looked up on
  Docker Hub, so its first `/` becomes `#` (`nvcr.io#nvidia/pytorch:24.05-py3`); the rest passes as is.
- mounts: `SRC[:DST[:FLAGS]]` (no DST: the same path inside), separated by commas, the flags of one
  mount by `+` ("ro+rprivate"). cluster.container_mounts come first, then the run directory and, when
  hpctrain runs from a checkout (the job's PYTHONPATH names it), the checkout, both at the same path
  inside and last, so that a user mount of a parent directory cannot hide them. A path pyxis cannot
  carry (a sweep element's run directory `optim.lr=0.001,train.micro_batch=2` holds a comma) is
  mounted through the nearest directory above it that it can (the sweep's directory).
- environment: pyxis hands the step's environment to the container, but a variable the image defines
  itself (its Dockerfile ENV) keeps the image's value, and PATH, LD_LIBRARY_PATH and LD_PRELOAD never
  cross. `--container-env=NAMES` keeps the host's value for: MASTER_PORT (the supervisor's, a new port
  per attempt; enroot's PyTorch hook would otherwise set one port per job), PYTHONPATH (the checkout)
  and every key of cluster.env (the user's setting wins over the image's default) but those three.
- no --container-name: a named container outlives the job under pyxis's default container_scope=global
  (an unpacked image left on every node per job), and a fixed name would reuse an older image. Each
  attempt creates the container afresh (enroot keeps the image's layers in its cache).
- the home directory: as the site's enroot configures it (ENROOT_MOUNT_HOME); no flag either way.
- the supervisor's node probe (`srun ... true`) runs outside the container.
"""
from __future__ import annotations

import shlex
import sys
import textwrap
import zlib
from typing import Optional

from hpctrain.checks.cluster_checks import mount_point
from hpctrain.core.schema import ClusterConfig

# pyxis never passes these from the host into the container; forcing them would put host paths there.
IMAGE_ONLY_ENV = ("PATH", "LD_LIBRARY_PATH", "LD_PRELOAD")


def master_port(job_id: str, attempt: int) -> int:
    """The rendezvous port of one attempt: the one hpctrain.distributed.bootstrap.slurm_port picks (the login
    tier imports no rank code; tests/test_container.py holds the two equal)."""
    key = job_id if attempt == 0 else f"{job_id}.{attempt}"
    return 16000 + zlib.crc32(key.encode()) % 16000


def enabled(cluster: ClusterConfig) -> bool:
    return cluster.container_image is not None


def pyxis_image(image: str) -> str:
    """cluster.container_image as enroot reads it: a registry's host (a first component with a dot, a
    port or `localhost`, as Docker decides) separated from the image by `#`."""
    image = str(image)
    if image.startswith(("/", ".")) or "#" in image or "://" in image or "/" not in image:
        return image
    host, rest = image.split("/", 1)
    registry = host.rpartition("@")[2]
    if "." in registry or ":" in registry or registry == "localhost":
        return f"{host}#{rest}"
    return image


def mounts(cluster: ClusterConfig, run_dir: str, source: Optional[str] = None) -> list[str]:
    """cluster.container_mounts, then the run directory and the checkout (or the nearest directory above
    each that pyxis can mount), each at the same path."""
    out = [str(m) for m in (cluster.container_mounts or [])]
    for path in (str(run_dir), source):
        point = mount_point(path) if path else None
        if point and f"{point}:{point}" not in out and point not in out:
            out.append(f"{point}:{point}")
    return out


def env_names(cluster: ClusterConfig, source: Optional[str] = None) -> list[str]:
    """The variables whose host value must win over the image's (--container-env)."""
    names = ["MASTER_PORT", *(["PYTHONPATH"] if source else []),
             *(str(k) for k in dict(cluster.env or {}) if str(k) not in IMAGE_ONLY_ENV)]
    return list(dict.fromkeys(names))


def srun_args(cluster: ClusterConfig, run_dir: str, source: Optional[str] = None) -> list[str]:
    """pyxis's options for the ranks' srun step; [] without cluster.container_image."""
    if not enabled(cluster):
        return []
    args = [f"--container-image={pyxis_image(cluster.container_image)}",
            f"--container-mounts={','.join(mounts(cluster, run_dir, source))}"]
    if cluster.container_workdir is not None:
        args.append(f"--container-workdir={cluster.container_workdir}")
    args.append(f"--container-env={','.join(env_names(cluster, source))}")
    return args


def python(cluster: ClusterConfig, host: str = sys.executable) -> str:
    """The ranks' interpreter: the image's (cluster.container_python) in a container, else `host`."""
    return str(cluster.container_python) if enabled(cluster) else host


def describe(cluster: ClusterConfig, run_dir: str, source: Optional[str] = None, array: bool = False) -> list[str]:
    """Comment lines for the batch script: the srun step's container flags, one per line. `array`: a
    job array's script, `run_dir` then a placeholder for the task's run directory."""
    if not enabled(cluster):
        return []
    args = srun_args(cluster, run_dir, source)
    rank = [python(cluster), "-u", "-m", "hpctrain.run", str(run_dir)]
    parts = [shlex.quote(a) for a in args] + [" ".join(shlex.quote(a) for a in rank)]
    note = ("Mounted besides cluster.container_mounts, at the same path: the run directory"
            + (" and hpctrain's checkout (on PYTHONPATH above)" if source else "") + ". --container-env keeps "
            "these variables' values from here where the image sets its own (its PATH and libraries stay).")
    if array:
        note += (f" {run_dir}: the array task's run directory (run_dirs below), or the sweep's directory where "
                 "the task's name holds a comma (a sweep over several keys).")
    lines = ["# container (pyxis/enroot, cluster.container_*): this script and the supervisor run here, on the",
             "# batch host; the supervisor's srun step runs every rank inside the image:",
             "#   srun <nodes, tasks, logs> \\",
             *[f"#     {p} \\" for p in parts[:-1]],
             f"#     {parts[-1]}",
             *("# " + line for line in textwrap.wrap(note, 98))]
    return lines
