"""launcher=k8s input that Kubernetes (or the pods) would refuse late, refused on the login node.

`k8s_problems(cfg, run_dir)` is pure, like the Slurm checks in hpctrain.checks.cluster_checks: an image
Kubernetes can pull, a shared volume for more than one node, a run directory the pods see at the same
absolute path, names Kubernetes takes. `object_name(run.name)` is the rule that names a run's objects,
shared with hpctrain.launch.k8s (which writes them). Messages name the key and a fix.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import Any, Optional

from hpctrain.checks.cluster_checks import env_name_problems
from hpctrain.core.schema import Config

NAME_MAX = 50  # the pods' hostnames are <name>-<index>: a DNS label (63) with room for the index
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SLURM_MEM = re.compile(r"(\d+)([KMGT]?)", re.IGNORECASE)
IMAGE_EXAMPLE = "nvcr.io/nvidia/pytorch:24.05-py3 with hpctrain installed, or your registry's image"


def object_name(run_name: Any) -> str:
    """The Kubernetes name of a run's objects, from run.name: lower case, every run of other
    characters than a-z and 0-9 one '-', a letter first (a Service's name is a DNS-1035 label), at
    most NAME_MAX characters (a long name is cut and ends in a hash of the whole). '' when run.name
    has no letter or digit at all."""
    raw = str(run_name)
    name = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    if name and not name[0].isalpha():
        name = "run-" + name
    if len(name) > NAME_MAX:
        name = name[:NAME_MAX - 7].rstrip("-") + "-" + hashlib.sha1(raw.encode()).hexdigest()[:6]
    return name


def memory_quantity(mem: Any) -> Optional[str]:
    """cluster.mem (Slurm's --mem: MB by default, K/M/G/T suffixes, 1024-based; 0 = all of the
    node's memory) as a Kubernetes quantity; None for 0 (no request). ValueError otherwise."""
    if mem is None:
        return None
    m = _SLURM_MEM.fullmatch(str(mem).strip())
    if not m:
        raise ValueError(mem)
    n, unit = int(m.group(1)), (m.group(2) or "M").upper()
    return None if n == 0 else f"{n}{unit}i"


def gib_quantity(gb: float) -> str:
    """launcher.k8s.shm_gb (GiB) as a Kubernetes quantity."""
    return f"{int(gb)}Gi" if float(gb).is_integer() else f"{max(1, round(gb * 1024))}Mi"


def k8s_problems(cfg: Config, run_dir: Optional[str] = None) -> list[str]:
    """What a Job of this config could not run with, refused on the login node: messages that name
    the key and the fix, like every check in hpctrain.checks.config_checks."""
    out = []
    c, k = cfg.cluster, cfg.launcher.k8s
    image = c.container_image
    if image is None or not str(image).strip():
        out.append("launcher=k8s runs the ranks in pods of cluster.container_image, which is unset. "
                   f"Fix: cluster.container_image=<registry/image:tag>, e.g. {IMAGE_EXAMPLE}")
    elif any(ch.isspace() for ch in str(image)) or "#" in str(image) or str(image).startswith(("/", ".")) \
            or str(image).endswith(".sqsh"):
        out.append(f"cluster.container_image={image} is not an image reference Kubernetes can pull (a "
                   "pyxis 'registry#image' or a squashfs file is for Slurm). "
                   "Fix: cluster.container_image=<registry/image:tag>, e.g. nvcr.io/nvidia/pytorch:24.05-py3")
    if k.volume_claim is None and c.nodes > 1:
        out.append(f"launcher=k8s with cluster.nodes={c.nodes} and no launcher.k8s.volume_claim: each pod would "
                   "have a run directory of its own (an emptyDir), but the ranks share checkpoints and logs "
                   "there. Fix: launcher.k8s.volume_claim=<a ReadWriteMany PersistentVolumeClaim>, mounted "
                   "at run.dir's parent here too; or cluster.nodes=1")
    if k.volume_claim is not None and not subdomain(k.volume_claim):
        out.append(f"launcher.k8s.volume_claim={k.volume_claim!r} is not a PersistentVolumeClaim name "
                   "(lower case letters, digits, '-' and '.'). Fix: the name `kubectl get pvc` shows")
    rd = str(run_dir if run_dir is not None else cfg.run.dir)
    path = PurePosixPath(rd)
    if not path.is_absolute():
        out.append(f"run.dir={rd} is relative, but the pods see the run directory at the same absolute path "
                   "(the claim mounted at its parent). Fix: run.dir=<where the claim is mounted here>/"
                   f"{cfg.run.name}")
    elif len(path.parts) < 3:
        out.append(f"run.dir={rd}: the pods mount the run directory's parent ({path.parent}), which cannot be "
                   f"'/'. Fix: run.dir=/mnt/runs/{cfg.run.name} with the claim mounted at /mnt/runs")
    if any(ch in rd for ch in "\n\r"):
        out.append(f"run.dir={rd!r} holds a line break. Fix: give run.dir on one line")
    # Any other character reaches k8s.yaml escaped (yaml.safe_dump; its comments through
    # hpctrain.launch.k8s.comment). A NUL cannot reach a process: paths, arguments and the
    # environment are C strings.
    nul = {"run.dir": rd, "cluster.container_image": image, "cluster.container_python": c.container_python,
           "cluster.container_workdir": c.container_workdir,
           **{f"cluster.env.{key}": value for key, value in dict(c.env or {}).items()},
           **{f"launcher.k8s.node_selector.{key}": value for key, value in dict(k.node_selector or {}).items()}}
    for key, value in nul.items():
        if value is not None and "\0" in str(value):
            out.append(f"{key}={str(value)!r} holds a NUL character, which no path, argument or environment "
                       f"variable of a pod can hold. Fix: remove it from {key}")
    if not object_name(cfg.run.name):
        out.append(f"run.name={cfg.run.name!r} holds no letter or digit to name the Kubernetes objects after. "
                   "Fix: e.g. run.name=llama-8b")
    if not (isinstance(k.namespace, str) and _DNS_LABEL.fullmatch(k.namespace) and len(k.namespace) <= 63):
        out.append(f"launcher.k8s.namespace={k.namespace!r} is not a namespace name (a DNS label: lower case "
                   "letters, digits and '-'). Fix: the name `kubectl get namespaces` shows, e.g. default")
    if k.service_account is not None and not subdomain(k.service_account):
        out.append(f"launcher.k8s.service_account={k.service_account!r} is not a service account name. "
                   "Fix: the name `kubectl get serviceaccounts` shows, or null for the namespace's default")
    if not 1 <= k.port <= 65535:
        out.append(f"launcher.k8s.port={k.port} is not a TCP port. Fix: launcher.k8s.port=29500")
    for key, value in dict(k.node_selector or {}).items():
        if isinstance(value, (dict, list)) or value is None:
            out.append(f"launcher.k8s.node_selector.{key}: a node label's value must be a string. "
                       f"Fix: +launcher.k8s.node_selector.{key}=<value>")
    try:
        memory_quantity(c.mem)
    except ValueError:
        out.append(f"cluster.mem={c.mem} is not a Slurm memory size. Fix: e.g. cluster.mem=500G, or 0 for "
                   "no memory request")
    out.extend(env_name_problems(c.env))
    if not str(c.container_python).strip():
        out.append("cluster.container_python is empty. Fix: cluster.container_python=python")
    if cfg.launcher.max_restarts < 0:
        out.append(f"launcher.max_restarts={cfg.launcher.max_restarts} must be 0 or more")
    return out


def subdomain(name: Any) -> bool:
    """A DNS-1123 subdomain, as Kubernetes names most objects."""
    return isinstance(name, str) and len(name) <= 253 and _DNS_SUBDOMAIN.fullmatch(name) is not None
