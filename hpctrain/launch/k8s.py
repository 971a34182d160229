"""launcher=k8s: the run as Kubernetes objects in <run.dir>/k8s.yaml, for `kubectl apply -f`.

`manifest(cfg, run_dir)` is pure (plain dicts; it imports no Kubernetes client and reads no
environment), like the sbatch script (hpctrain.launch.sbatch). It returns, in the order to apply:

- a headless Service (clusterIP None) whose selector is the pods' labels, named like the Job: with
  the pods' `subdomain` set to it, pod i of the Job is `<name>-i.<name>.<namespace>.svc` (an Indexed
  Job's pod hostname is `<job>-<index>`). publishNotReadyAddresses, so a pod's name resolves as soon
  as it has an address, not only once it is ready;
- with launcher.k8s.volume_claim unset, a ConfigMap holding config.yaml: the pod's run directory is an
  emptyDir then, empty at start (a single node only, and the run directory goes with the pod);
- an Indexed Job of cluster.nodes pods (completions = parallelism = nodes), one per node (a required
  pod anti-affinity on the node's hostname), each asking for cluster.gpus_per_node GPUs
  (nvidia.com/gpu), cluster.cpus_per_task CPUs per rank and cluster.mem, with /dev/shm an in-memory
  emptyDir of launcher.k8s.shm_gb (it counts against the pod's memory), cluster.env in its
  environment, and the run directory's parent mounted from the claim at the same path in every pod.

Each pod runs `python -m hpctrain.launch.k8s_pod` (hpctrain.launch.k8s_pod.pod_main) around torchrun, which starts one
rank per GPU (`python -m hpctrain.run <run_dir>`, whose bootstrap reads torchrun's RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT). The ranks find each other through torchrun's c10d
rendezvous on pod 0 (`<name>-0.<name>.<namespace>.svc:<launcher.k8s.port>`); pod_main tells pod 0 to
host it (torch would otherwise guess from DNS, which may not know the pod yet) and gives every start
of the ranks a store of its own (torchrun_env: torch 2.13 keeps the last start's addresses in the
shared one, and a restart fails or hangs), and maps the run's outcome to the pod's exit status
(pod_exit). Checked on one machine with two such "pods" (JOB_COMPLETION_INDEX 0 and 1): a rank
killed restarts every rank from the newest checkpoint, and SIGTERM to one pod saves and exits
EXIT_REQUEUE from both. NCCL/InfiniBand
settings are chosen on each node by the ranks themselves (hpctrain.distributed.nccl), as under Slurm;
cluster.env overrides them.

Restarts, as the supervisor does them on Slurm (every rank stops together and all start again from
the newest complete checkpoint, at most launcher.max_restarts times):

- a rank fails (crash, hang caught by the watchdog, unhealthy GPU): torchrun stops every rank of its
  pod, and through the rendezvous the other pods' torchrun stop theirs; all start again from the
  newest checkpoint, at most launcher.max_restarts times (`--max-restarts`);
- a pod fails as a whole (torchrun out of restarts, the container killed for memory, pod 0 and with
  it the rendezvous lost): restartPolicy Never, so the Job replaces the pod, perhaps on another node,
  and the replacement joins the next rendezvous; at most launcher.max_restarts times per pod
  (backoffLimitPerIndex), then the Job fails (maxFailedIndexes 0) and every pod is stopped;
- a pod disrupted (preempted, evicted, its node drained or lost: the DisruptionTarget condition), or
  every rank saved after SIGTERM and stopped (pod_main exits EXIT_REQUEUE): the pods are replaced
  without counting, as Slurm requeues a preempted job, and resume from that checkpoint.

What the Slurm supervisor does and this does not: stop at once on a failure identical to the last,
leave a bad node out and re-plan the layout for fewer nodes, count attempts (HPCTRAIN_ATTEMPT stays 0:
every start writes to <run.dir>/attempts/0, and a fault injected "once" fires at every start). torchrun
gives the ranks 30 s after SIGTERM to save before it kills them.

The run directory must be prepared where the pods see it: mount the claim on the machine that runs
`python -m hpctrain ... launcher=k8s` at the parent of run.dir (the pods mount it there too), e.g.
the claim at /mnt/runs and run.dir=/mnt/runs/llama-8b. Data (data.path, data.sources,
model.init_from) must be at its configured path in the pods too: in the image or on the claim. The
image (cluster.container_image) must hold torch and hpctrain.

The Job's spec cannot change once applied: after it ended (or to change it), `kubectl delete -f` then
`kubectl apply -f` again; the run resumes from the newest checkpoint on the claim.
"""
from __future__ import annotations

import inspect
import json
import os
import shlex
import sys
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import yaml

from hpctrain.core.compose import ConfigError, to_yaml as config_yaml
from hpctrain.checks.k8s_checks import gib_quantity, k8s_problems, memory_quantity, object_name, subdomain
from hpctrain.launch.k8s_pod import EXIT_REQUEUE
from hpctrain.core.spec import ranks_per_node
from hpctrain.core.schema import Config

MANIFEST_NAME = "k8s.yaml"
CONTAINER = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
LABEL_APP = "app.kubernetes.io/name"
LABEL_RUN = "app.kubernetes.io/instance"
CONFIG_DIR = "/etc/hpctrain"  # the ConfigMap's config.yaml, with launcher.k8s.volume_claim unset
# Pods start as their images arrive (the first pull of a large image takes minutes): the rendezvous
# waits this long for all of them, and the other pods as long for pod 0's store.
RENDEZVOUS_TIMEOUT_S = 1800

# ------------------------------------------------------------------------------------------ names

def rendezvous_host(name: str, namespace: str) -> str:
    """Pod 0 of the Job, through the headless Service of the same name."""
    return f"{name}-0.{name}.{namespace}.svc"


def labels(name: str) -> dict[str, str]:
    return {LABEL_APP: "hpctrain", LABEL_RUN: name}


# ---------------------------------------------------------------------------------------- manifest

def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _literal(text: str) -> str:
    """Kubernetes expands $(VAR) in a container's command and env values; $$ stands for one $."""
    return text.replace("$", "$$")


def torchrun_command(cfg: Config, run_dir: str) -> list[str]:
    """What each pod runs, under pod_main: one torchrun agent per node, one rank per GPU (or per
    task on CPU nodes), meeting at pod 0."""
    c = cfg.cluster
    name, port = object_name(cfg.run.name), cfg.launcher.k8s.port
    t = RENDEZVOUS_TIMEOUT_S
    return [str(c.container_python), "-m", "torch.distributed.run",
            f"--nnodes={c.nodes}", f"--nproc-per-node={ranks_per_node(c)}",
            f"--max-restarts={cfg.launcher.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_host(name, cfg.launcher.k8s.namespace)}:{port}",
            f"--rdzv-id={name}", f"--rdzv-conf=join_timeout={t},read_timeout={t}",
            "-m", "hpctrain.run", str(run_dir)]


def manifest(cfg: Config, run_dir: str) -> list[dict]:
    """The Service, the ConfigMap (no volume claim only) and the Job of this run, as plain dicts in
    the order to apply. Raises ConfigError for what k8s_problems() refuses."""
    found = k8s_problems(cfg, run_dir)
    if found:
        raise ConfigError("cannot write the Kubernetes manifest:\n" + "\n".join(f"  - {p}" for p in found))
    c, k = cfg.cluster, cfg.launcher.k8s
    run_dir = str(run_dir)
    name, ns = object_name(cfg.run.name), k.namespace
    pod_labels = labels(name)

    def meta(obj_name: str) -> dict:
        return {"name": obj_name, "namespace": ns, "labels": dict(pod_labels)}

    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(name),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": dict(pod_labels),
                        "ports": [{"name": "rendezvous", "port": k.port, "targetPort": k.port,
                                   "protocol": "TCP"}]}}
    objs = [service]

    mounts = [{"name": "run", "mountPath": str(PurePosixPath(run_dir).parent)},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    run_volume = ({"persistentVolumeClaim": {"claimName": k.volume_claim}} if k.volume_claim is not None
                  else {"emptyDir": {}})
    volumes = [{"name": "run", **run_volume},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": gib_quantity(k.shm_gb)}}]
    entry = [str(c.container_python), "-u", "-m", "hpctrain.launch.k8s_pod", "--run-dir", run_dir]
    if k.volume_claim is None:
        config_map = f"{name}-config"
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(config_map),
                     "data": {"config.yaml": config_yaml(cfg)}})
        mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config_map}})
        entry += ["--seed-config", f"{CONFIG_DIR}/config.yaml"]

    env = {"PYTHONUNBUFFERED": "1"}
    env.update({str(key): _text(value) for key, value in dict(c.env or {}).items()})
    requests, limits = {"cpu": str(c.cpus_per_task * ranks_per_node(c))}, {}
    memory = memory_quantity(c.mem)
    if memory:
        requests["memory"] = limits["memory"] = memory
    if c.gpus_per_node > 0:
        limits[GPU_RESOURCE] = str(c.gpus_per_node)
    container = {"name": CONTAINER, "image": str(c.container_image),
                 "command": [_literal(a) for a in [*entry, "--", *torchrun_command(cfg, run_dir)]]}
    if c.container_workdir:
        container["workingDir"] = str(c.container_workdir)
    container.update({
        "env": [{"name": key, "value": _literal(value)} for key, value in env.items()],
        "ports": [{"name": "rendezvous", "containerPort": k.port, "protocol": "TCP"}],
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        "volumeMounts": mounts})

    # Never, not OnFailure: the kubelet would restart a failed container in place, on the same node,
    # alone. Here torchrun restarts the ranks in place (all of them, every pod), and a pod that fails as
    # a whole is replaced by the Job, maybe on another node (podFailurePolicy and backoffLimitPerIndex
    # need Never too). See the module's docstring.
    pod: dict[str, Any] = {"subdomain": name, "restartPolicy": "Never"}
    if k.service_account is not None:
        pod["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod["nodeSelector"] = {str(key): _text(value) for key, value in dict(k.node_selector).items()}
    pod["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": dict(pod_labels)}, "topologyKey": "kubernetes.io/hostname"}]}}
    pod["containers"] = [container]
    pod["volumes"] = volumes

    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(name),
           "spec": {"completionMode": "Indexed", "completions": c.nodes, "parallelism": c.nodes,
                    # Each pod may be replaced max_restarts times; one index out of them fails the Job.
                    "backoffLimitPerIndex": cfg.launcher.max_restarts, "maxFailedIndexes": 0,
                    # Not counted: disruptions (preemption, eviction, a node drained or lost) and ranks that
                    # saved after SIGTERM (pod_main's EXIT_REQUEUE): Slurm's requeue.
                    "podFailurePolicy": {"rules": [
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                        {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                             "values": [EXIT_REQUEUE]}}]},
                    "template": {"metadata": {"labels": dict(pod_labels)}, "spec": pod}}}
    objs.append(job)
    return objs


def shell_word(text: str) -> str:
    """`text` as one word for a shell (bash, zsh, ksh), in printable characters only: shlex.quote() where
    that is printable, else ANSI-C quoting ($'...') with every character that is not printable as its
    UTF-8 bytes (\\xHH), so that a line break of any kind (U+0085, U+2028, ...) never reaches the
    text: it goes into YAML comments and onto the terminal."""
    text = str(text)
    if text.isprintable():
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape")))
    return "$'" + "".join(out) + "'"


def commands(objs: list[dict], path: str) -> dict[str, str]:
    """How to apply, follow and delete these objects."""
    job = next(o for o in objs if o["kind"] == "Job")
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    nodes = job["spec"]["completions"]
    quoted = shell_word(str(path))
    return {"apply": f"kubectl apply -f {quoted}",
            "logs": (f"kubectl logs -f -n {ns} job/{name}" if nodes == 1 else
                     f"kubectl logs -f -n {ns} -l {LABEL_RUN}={name} --prefix --max-log-requests={nodes}"),
            "status": f"kubectl get -n {ns} pods -l {LABEL_RUN}={name} -o wide",
            "delete": f"kubectl delete -f {quoted}",
            "after_delete": ("the run directory stays on the claim; apply again to resume" if _on_claim(job) else
                             "the run directory, an emptyDir, goes with the pod")}


def _on_claim(job: dict) -> bool:
    """Whether the Job's run directory is on a PersistentVolumeClaim (else an emptyDir)."""
    return any("persistentVolumeClaim" in v for v in job["spec"]["template"]["spec"]["volumes"])


def comment(text: str) -> str:
    """One YAML comment line holding `text`. YAML ends a comment at any line break, U+0085, U+2028 and
    U+2029 included (PyYAML and kubectl's go-yaml alike), and refuses control characters: every
    character that is not printable is written as its escape (\\u2028), so the text stays one line."""
    return "# " + "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def to_yaml(objs: list[dict], path: Optional[str] = None) -> str:
    """The objects as one multi-document YAML file, after comment lines saying how to use it. The
    objects go through PyYAML's safe dumper (which quotes and escapes what a plain scalar cannot hold);
    text in the comments goes through comment(), paths in them through shell_word()."""
    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, data: str):  # config.yaml in the ConfigMap as a block, not one quoted line
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    Dumper.add_representer(str, text)
    job = next((o for o in objs if o["kind"] == "Job"), None)
    config = shell_word(str(PurePosixPath(path).parent / "config.yaml")) if path is not None else "<run dir>/config.yaml"
    head = [f"Written by `python -m hpctrain ... launcher=k8s`; the run's config: {config}"]
    if job is not None and path is not None:
        cmd = commands(objs, path)
        head = [f"hpctrain run {job['metadata']['name']}: {job['spec']['completions']} pod(s), one per node.",
                f"  apply:  {cmd['apply']}", f"  logs:   {cmd['logs']}", f"  status: {cmd['status']}",
                f"  delete: {cmd['delete']}  ({cmd['after_delete']})", *head]
    body = yaml.dump_all(objs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1 << 16)
    return "\n".join(comment(line) for line in head) + "\n---\n" + body


def manifest_text(cfg: Config, run_dir: str) -> str:
    """<run_dir>/k8s.yaml as write() writes it (pure)."""
    return to_yaml(manifest(cfg, run_dir), str(Path(run_dir) / MANIFEST_NAME))


# -------------------------------------------------------------------------------------- validation

class InvalidManifest(ConfigError):
    """An object the Kubernetes API's schema refuses."""


def validate(objs: list[dict]) -> None:
    """Every object read into the kubernetes client's model of its kind (V1Service, V1ConfigMap,
    V1Job, ...) the way the client reads the API server's answers, through the public
    `ApiClient.deserialize` (client 37: `deserialize(json_text, "V1Job", "application/json")`;
    older clients take a response object with `.data`). The models refuse a missing required field;
    client 37's (pydantic, strict) also a value of the wrong type ("2" for an int, 8 for a quantity
    string). Both drop keys they do not know and older ones convert types, so the model is written
    back (`ApiClient.sanitize_for_serialization`) and must equal the object: that catches a misspelt
    or misplaced key and a converted value. As the API server would, names must be DNS-1123 and a
    Job's containers must name their image.
    Raises InvalidManifest. The client is imported here only: the login node otherwise never loads it."""
    try:
        # optional and heavy (kubernetes, ~1 s): loaded only to validate a manifest
        import kubernetes.client.models as models
        from kubernetes.client.api_client import ApiClient
    except ImportError as e:
        raise InvalidManifest(f"validating the manifest needs the kubernetes client ({e}). "
                              "Fix: pip install 'hpctrain[k8s]'") from None
    api = ApiClient()
    takes_text = "response_text" in inspect.signature(api.deserialize).parameters

    class Response:  # what older clients' deserialize reads
        def __init__(self, data: str):
            self.data = data

    for obj in objs:
        what = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        version = str(obj.get("apiVersion", "")).split("/")[-1]
        model = f"{version.capitalize()}{obj.get('kind')}"
        if not hasattr(models, model):
            raise InvalidManifest(f"{what}: the kubernetes client has no model {model} "
                                  f"(apiVersion {obj.get('apiVersion')!r}, kind {obj.get('kind')!r})")
        text = json.dumps(obj)
        try:
            parsed = (api.deserialize(text, model, "application/json") if takes_text
                      else api.deserialize(Response(text), model))
        except Exception as e:  # pydantic's ValidationError, older models' ValueError, ...
            raise InvalidManifest(f"{what} does not fit the Kubernetes API's {model}: {e}") from None
        where = _first_difference(obj, api.sanitize_for_serialization(parsed))
        if where is not None:
            raise InvalidManifest(f"{what}: {where}")
        meta = obj.get("metadata") or {}
        if not subdomain(meta.get("name")):
            raise InvalidManifest(f"{what}: metadata.name {meta.get('name')!r} is not a DNS-1123 name")
        # The schema leaves a container's image optional (for templates that others fill in); the API
        # server refuses a Job's pod without one.
        template = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        for i, container in enumerate(template.get("containers") or []):
            if not container.get("image"):
                raise InvalidManifest(f"{what}: spec.template.spec.containers[{i}] has no image")


def _first_difference(given: Any, back: Any, path: str = "") -> Optional[str]:
    """Where the model's copy differs from the object (None: nowhere)."""
    if isinstance(given, dict) and isinstance(back, dict):
        for key, value in given.items():
            here = f"{path}.{key}" if path else str(key)
            if key not in back:
                return f"{here} is not a field of the Kubernetes API here (the model dropped it)"
            found = _first_difference(value, back[key], here)
            if found:
                return found
        return None
    if isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        for i, (a, b) in enumerate(zip(given, back)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if given != back or type(given) is not type(back):
        return f"{path}: {given!r} reads back as {back!r}"
    return None


def validation_note(objs: list[dict]) -> str:
    """validate() where the kubernetes client is installed; a line saying what was done."""
    try:
        # optional dependency (kubernetes): its absence is noted, not an error
        import kubernetes
    except ImportError:
        return "not validated: the kubernetes client is not installed (pip install 'hpctrain[k8s]')"
    validate(objs)
    return f"validated against the Kubernetes API's schema (kubernetes client {kubernetes.__version__})"


# ------------------------------------------------------------------------------- the login node

def write(cfg: Config, run_dir: str) -> Path:
    """Write <run_dir>/k8s.yaml (atomically), validated where the kubernetes client is installed."""
    objs = manifest(cfg, str(run_dir))
    validation_note(objs)
    return _write(objs, run_dir)


def _write(objs: list[dict], run_dir: str) -> Path:
    path = Path(run_dir) / MANIFEST_NAME
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(to_yaml(objs, str(path)), encoding="utf-8")  # what kubectl reads
    os.replace(tmp, path)
    return path


def preview(cfg: Config) -> str:
    """dry_run=true: the manifest that would be written to <run.dir>/k8s.yaml, between markers;
    nothing is written."""
    objs = manifest(cfg, str(cfg.run.dir))
    note = validation_note(objs)
    path = str(Path(str(cfg.run.dir)) / MANIFEST_NAME)
    return f"--- {path} (not written; {note}) ---\n{to_yaml(objs, path)}---\n"


def launch(cfg: Config, run_dir: str) -> int:
    """launcher=k8s: write <run_dir>/k8s.yaml and say how to apply, follow and delete it."""
    try:
        objs = manifest(cfg, str(run_dir))
        note = validation_note(objs)
        path = _write(objs, str(run_dir))
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    cmd = commands(objs, str(path))
    name = object_name(cfg.run.name)
    renamed = "" if name == str(cfg.run.name) else f" (run.name {cfg.run.name!r} as a Kubernetes name)"
    what = ", ".join(o["kind"] for o in objs)
    print(f"wrote {path}: {what} {name}{renamed}; {note}\n"
          f"start it with:\n  {cmd['apply']}\n"
          f"follow it:\n  {cmd['logs']}\n  {cmd['status']}\n"
          f"stop and delete it ({cmd['after_delete']}):\n  {cmd['delete']}")
    if cfg.launcher.k8s.volume_claim is None:
        print("note: launcher.k8s.volume_claim is unset, so checkpoints live in the pod and are lost with it "
              "(a replaced pod starts from scratch); set it to keep the run")
    return 0
