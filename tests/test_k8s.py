"""launcher=k8s: <run.dir>/k8s.yaml is a pure function of the config, snapshot-tested, and every
object is read into the kubernetes client's model of its kind (the Kubernetes API's own schema; no
cluster). The pod's entry point (pod_main) is run here around a stand-in for torchrun.

The snapshot lives in tests/snapshots/k8s_2node.yaml. After an intended change, rewrite it with
`HPCTRAIN_UPDATE_SNAPSHOTS=1 pytest tests/test_k8s.py` and review the diff.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath

import pytest
import yaml

from hpctrain.core.compose import ConfigError, compose, load, to_yaml
from hpctrain.launch import k8s, k8s_pod
from hpctrain.checks import k8s_checks as k8s_check

from helpers import check_snapshot, set_key

REPO = Path(__file__).resolve().parent.parent

# Every key the manifest reads is given, so that edits to conf/cluster/h100.yaml (the planner's
# figures) do not change the snapshot; dicts are set on the composed config.
TWO_NODES = [
    "+experiment=tiny", "launcher=k8s", "cluster=h100", "run.name=llama-8b", "run.dir=/mnt/runs/llama-8b",
    "cluster.nodes=2", "cluster.gpus_per_node=8", "cluster.tasks_per_node=1", "cluster.cpus_per_task=12",
    "cluster.mem=1000G", "cluster.container_image=registry.example.com/ml/hpctrain:0.1.0",
    "cluster.container_python=python3", "launcher.max_restarts=5", "launcher.k8s.namespace=ml",
    "launcher.k8s.volume_claim=llm-runs", "launcher.k8s.shm_gb=128", "launcher.k8s.service_account=trainer",
    "launcher.k8s.port=29400",
]
TWO_NODES_SET = {
    "cluster.env": {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
                    "NOTE": "costs $(HOME) and $5", "FLAG": True},
    "launcher.k8s.node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "training"},
}
ONE_NODE = ["+experiment=tiny", "launcher=k8s", "cluster.nodes=1", "cluster.tasks_per_node=2",
            "cluster.container_image=registry.example.com/ml/hpctrain:0.1.0", "run.dir=/tmp/runs/tiny"]


def two_nodes():
    cfg = compose(TWO_NODES)
    for key, value in TWO_NODES_SET.items():
        set_key(cfg, key, value)
    return cfg


def kinds(objs):
    return {o["kind"]: o for o in objs}


def container_of(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def arg(command, flag):
    found = [a.split("=", 1)[1] for a in command if a.startswith(flag + "=")]
    assert len(found) == 1, (flag, command)
    return found[0]


# ------------------------------------------------------------------------------ the manifest's text

def test_snapshot():
    cfg = two_nodes()
    assert k8s_check.k8s_problems(cfg) == []
    check_snapshot("k8s_2node.yaml", k8s.manifest_text(cfg, cfg.run.dir))


def test_text_reads_back_as_the_objects():
    for cfg in (two_nodes(), compose(ONE_NODE)):
        objs = k8s.manifest(cfg, cfg.run.dir)
        text = k8s.manifest_text(cfg, cfg.run.dir)
        assert list(yaml.safe_load_all(text)) == objs
        assert "kubectl apply -f " + str(Path(cfg.run.dir) / "k8s.yaml") in text.split("---")[0]


def test_pure(monkeypatch, tmp_path):
    cfg = two_nodes()
    first = k8s.manifest_text(cfg, cfg.run.dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    monkeypatch.setenv("HOME", "/elsewhere")
    assert k8s.manifest_text(cfg, cfg.run.dir) == first


# ------------------------------------------------------------------- the Kubernetes API's schema

@pytest.mark.slow
def test_every_object_validates():
    two = k8s.manifest(two_nodes(), "/mnt/runs/llama-8b")
    assert [o["kind"] for o in two] == ["Service", "Job"]
    k8s.validate(two)
    one = k8s.manifest(compose(ONE_NODE), "/tmp/runs/tiny")
    assert [o["kind"] for o in one] == ["Service", "ConfigMap", "Job"]
    k8s.validate(one)


BREAKS = {
    "container without a name": (lambda j: container_of(j).pop("name"), "name"),
    "container without an image": (lambda j: container_of(j).pop("image"), "no image"),
    "completions as a string": (lambda j: j["spec"].__setitem__("completions", "2"), "completions"),
    "GPU limit as a number": (lambda j: container_of(j)["resources"]["limits"].__setitem__(k8s.GPU_RESOURCE, 8),
                              "nvidia.com/gpu"),
    "misspelt key": (lambda j: j["spec"]["template"]["spec"].__setitem__("subDomain", "x"), "subDomain"),
    "misplaced key": (lambda j: j["spec"].__setitem__("restartPolicy", "Never"), "restartPolicy"),
    "no pod template": (lambda j: j["spec"].pop("template"), "template"),
    "command not a list": (lambda j: container_of(j).__setitem__("command", "python -m hpctrain.run"), "command"),
    "bad name": (lambda j: j["metadata"].__setitem__("name", "Llama_8B"), "DNS-1123"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_validation_can_fail(case):
    objs = k8s.manifest(two_nodes(), "/mnt/runs/llama-8b")
    k8s.validate(objs)
    broken = copy.deepcopy(objs)
    change, message = BREAKS[case]
    change(kinds(broken)["Job"])
    with pytest.raises(k8s.InvalidManifest, match=message.replace(".", r"\.")):
        k8s.validate(broken)


def test_service_validation_can_fail():
    objs = k8s.manifest(two_nodes(), "/mnt/runs/llama-8b")
    kinds(objs)["Service"]["spec"]["selector"] = ["app"]
    with pytest.raises(k8s.InvalidManifest, match="Service/llama-8b"):
        k8s.validate(objs)


# ----------------------------------------------------------------------------------- structure

def test_job_and_service_fit_together():
    cfg = two_nodes()
    objs = kinds(k8s.manifest(cfg, cfg.run.dir))
    svc, job = objs["Service"], objs["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == cfg.cluster.nodes == 2
    # Headless, selecting exactly this Job's pods; the pods' subdomain is the Service.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] and svc["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["ports"][0]["port"] == cfg.launcher.k8s.port
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "ml"
    # One pod per node.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == job["spec"]["template"]["metadata"]["labels"]
    assert pod["serviceAccountName"] == "trainer"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "training"}


def test_ranks_meet_at_pod_zero():
    cfg = two_nodes()
    objs = kinds(k8s.manifest(cfg, cfg.run.dir))
    job = objs["Job"]
    command = container_of(job)["command"]
    entry, torchrun = command[:command.index("--")], command[command.index("--") + 1:]
    assert entry == ["python3", "-u", "-m", "hpctrain.launch.k8s_pod", "--run-dir", "/mnt/runs/llama-8b"]
    assert torchrun[:3] == ["python3", "-m", "torch.distributed.run"]
    assert torchrun[-3:] == ["-m", "hpctrain.run", "/mnt/runs/llama-8b"]
    pod0 = f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}.ml.svc"
    assert arg(torchrun, "--rdzv-endpoint") == f"{pod0}:{cfg.launcher.k8s.port}"
    assert arg(torchrun, "--rdzv-backend") == "c10d"
    assert arg(torchrun, "--nnodes") == "2"
    assert arg(torchrun, "--nproc-per-node") == "8"  # one rank per GPU (not cluster.tasks_per_node=1)


def test_restarts_match_the_in_job_restart():
    cfg = two_nodes()
    job = kinds(k8s.manifest(cfg, cfg.run.dir))["Job"]
    command = container_of(job)["command"]
    # Ranks: torchrun restarts all of them (every pod, through the rendezvous) max_restarts times.
    assert arg(command, "--max-restarts") == str(cfg.launcher.max_restarts) == "5"
    # Pods: each may be replaced max_restarts times; one index out of them fails the whole Job.
    spec = job["spec"]
    assert spec["backoffLimitPerIndex"] == cfg.launcher.max_restarts
    assert spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert {"action": "Ignore", "onExitCodes": {"containerName": k8s.CONTAINER, "operator": "In",
                                                "values": [k8s.EXIT_REQUEUE]}} in rules


def test_resources_shm_env_and_volume():
    cfg = two_nodes()
    job = kinds(k8s.manifest(cfg, cfg.run.dir))["Job"]
    pod, c = job["spec"]["template"]["spec"], container_of(job)
    assert c["image"] == cfg.cluster.container_image
    assert c["resources"]["limits"][k8s.GPU_RESOURCE] == "8"
    assert c["resources"]["requests"]["cpu"] == str(12 * 8)  # cpus_per_task per rank
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "1000Gi"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1" and env["NCCL_DEBUG"] == "WARN"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["FLAG"] == "true"
    assert env["NOTE"] == "costs $$(HOME) and $$5"  # Kubernetes would expand $(HOME)
    # The claim holds run.dir: mounted at a directory that contains it, in every pod.
    covering = [path for path in mounts if PurePosixPath(cfg.run.dir).is_relative_to(path) and path != "/"]
    assert covering, mounts
    assert volumes[mounts[covering[0]]]["persistentVolumeClaim"] == {"claimName": "llm-runs"}


def test_cpu_nodes_and_defaults():
    cfg = compose(ONE_NODE)
    job = kinds(k8s.manifest(cfg, cfg.run.dir))["Job"]
    c = container_of(job)
    assert k8s.GPU_RESOURCE not in c["resources"].get("limits", {})
    assert "memory" not in c["resources"]["requests"]  # cluster.mem unset: no request
    assert arg(c["command"], "--nproc-per-node") == "2"  # cluster.tasks_per_node
    assert job["spec"]["template"]["spec"].get("serviceAccountName") is None
    assert "nodeSelector" not in job["spec"]["template"]["spec"]


def test_single_node_carries_its_config():
    """No claim: the pod's run directory is an emptyDir, so config.yaml travels in a ConfigMap."""
    cfg = compose(ONE_NODE)
    objs = kinds(k8s.manifest(cfg, cfg.run.dir))
    cm, job = objs["ConfigMap"], objs["Job"]
    assert cm["data"]["config.yaml"] == to_yaml(cfg)
    c, pod = container_of(job), job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if volumes[m["name"]].get("configMap"))
    assert volumes[mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert c["command"][c["command"].index("--seed-config") + 1] == f"{mount['mountPath']}/config.yaml"
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp/runs")
    assert volumes[run["name"]] == {"name": run["name"], "emptyDir": {}}


def test_names():
    assert k8s_check.object_name("llama-8b") == "llama-8b"
    assert k8s_check.object_name("Llama_3.1 8B!") == "llama-3-1-8b"
    assert k8s_check.object_name("70b") == "run-70b"  # a Service's name starts with a letter
    long_a, long_b = "x" * 80 + "a", "x" * 80 + "b"
    a, b = k8s_check.object_name(long_a), k8s_check.object_name(long_b)
    assert len(a) <= k8s_check.NAME_MAX and len(f"{a}-99999") <= 63 and a != b
    assert k8s_check.object_name("___") == ""
    cfg = two_nodes()
    cfg.run.name = "My Run"
    job = kinds(k8s.manifest(cfg, cfg.run.dir))["Job"]
    assert job["metadata"]["name"] == "my-run"


def test_memory_quantities():
    assert k8s_check.memory_quantity("500G") == "500Gi"
    assert k8s_check.memory_quantity("64000") == "64000Mi"  # Slurm's default unit is MB (MiB)
    assert k8s_check.memory_quantity("2t") == "2Ti"
    assert k8s_check.memory_quantity("0") is None and k8s_check.memory_quantity(None) is None
    with pytest.raises(ValueError):
        k8s_check.memory_quantity("lots")
    assert k8s_check.gib_quantity(64.0) == "64Gi" and k8s_check.gib_quantity(0.5) == "512Mi"


# ------------------------------------------------------------------------------------ refusals

def refusal(cfg, *words):
    found = [p for p in k8s_check.k8s_problems(cfg) if all(w in p for w in words)]
    assert len(found) == 1 and "Fix:" in found[0], k8s_check.k8s_problems(cfg)
    with pytest.raises(ConfigError, match="cannot write the Kubernetes manifest"):
        k8s.manifest(cfg, cfg.run.dir)
    return found[0]


def test_refuses_missing_image():
    cfg = two_nodes()
    cfg.cluster.container_image = None
    msg = refusal(cfg, "cluster.container_image", "unset")
    assert "cluster.container_image=<registry/image:tag>" in msg


def test_refuses_pyxis_image():
    cfg = two_nodes()
    cfg.cluster.container_image = "nvcr.io#nvidia/pytorch:24.05-py3"
    refusal(cfg, "pyxis")


def test_refuses_several_nodes_without_a_claim():
    cfg = two_nodes()
    cfg.launcher.k8s.volume_claim = None
    msg = refusal(cfg, "cluster.nodes=2", "launcher.k8s.volume_claim")
    assert "launcher.k8s.volume_claim=<" in msg and "cluster.nodes=1" in msg
    cfg.cluster.nodes = 1
    assert k8s_check.k8s_problems(cfg) == []


@pytest.mark.parametrize("key,value,words", [
    ("run.dir", "outputs/llama-8b", ("run.dir=outputs/llama-8b", "relative")),
    ("run.dir", "/llama-8b", ("run.dir=/llama-8b", "'/'")),
    ("run.name", "___", ("run.name",)),
    ("launcher.k8s.namespace", "ML_Team", ("launcher.k8s.namespace",)),
    ("launcher.k8s.volume_claim", "My Claim", ("launcher.k8s.volume_claim",)),
    ("launcher.k8s.port", 70000, ("launcher.k8s.port",)),
    ("cluster.mem", "lots", ("cluster.mem",)),
])
def test_other_refusals(key, value, words):
    cfg = two_nodes()
    set_key(cfg, key, value)
    refusal(cfg, *words)


def test_bad_env_name_refused():
    cfg = two_nodes()
    cfg.cluster.env["BAD-NAME"] = 1
    refusal(cfg, "BAD-NAME", "environment variable")


# --------------------------------------------------------------------------- the login node

LIGHT = textwrap.dedent("""
    import sys
    import hpctrain.launch.k8s as k8s
    from hpctrain.core.compose import compose

    def loaded():
        return sorted({m.split(".")[0] for m in sys.modules} & {"kubernetes", "torch"})

    assert loaded() == [], loaded()
    cfg = compose(%r)
    text = k8s.manifest_text(cfg, cfg.run.dir)
    assert loaded() == [], loaded()
    k8s.validate(k8s.manifest(cfg, cfg.run.dir))
    assert loaded() == ["kubernetes"], loaded()
    print("LIGHT_OK")
""") % (ONE_NODE,)


@pytest.mark.slow
def test_login_node_stays_light():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", LIGHT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "LIGHT_OK" in proc.stdout, proc.stdout + proc.stderr


def test_write_launch_and_preview(tmp_path, capsys):
    cfg = two_nodes()
    run_dir = tmp_path / "runs" / "llama-8b"
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True)
    assert k8s.launch(cfg, str(run_dir)) == 0
    path = run_dir / "k8s.yaml"
    assert path.read_text() == k8s.manifest_text(cfg, str(run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["k8s.yaml"]  # no temporary file left
    out = capsys.readouterr().out
    assert f"kubectl apply -f {path}" in out
    assert "kubectl logs -f -n ml -l app.kubernetes.io/instance=llama-8b" in out
    assert f"kubectl delete -f {path}" in out
    assert "validated against the Kubernetes API" in out
    shown = k8s.preview(cfg)
    assert k8s.manifest_text(cfg, str(run_dir)) in shown and "(not written" in shown
    cfg.cluster.container_image = None
    assert k8s.launch(cfg, str(run_dir)) == 2
    assert "cluster.container_image" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- in the pod

def test_with_host():
    cmd = ["python", "-m", "torch.distributed.run", "--rdzv-conf=join_timeout=9", "-m", "hpctrain.run", "/r"]
    assert k8s_pod.with_host(cmd, True)[3] == "--rdzv-conf=join_timeout=9,is_host=true"
    assert k8s_pod.with_host(cmd, False)[3] == "--rdzv-conf=join_timeout=9,is_host=false"
    with pytest.raises(ValueError):
        k8s_pod.with_host(["python", "-m", "hpctrain.run"], True)


def test_pod_exit():
    preempted, completed = {"status": "preempted"}, {"status": "completed"}
    assert k8s_pod.pod_exit(0, completed, False) == 0
    assert k8s_pod.pod_exit(0, preempted, False) == k8s.EXIT_REQUEUE  # a peer was signalled, we saved
    assert k8s_pod.pod_exit(1, preempted, True) == k8s.EXIT_REQUEUE  # torchrun itself got SIGTERM
    assert k8s_pod.pod_exit(1, preempted, False) == 1  # failed without being asked to stop
    assert k8s_pod.pod_exit(-9, completed, True) == 0  # stopped by pod_main after the run completed
    assert k8s_pod.pod_exit(1, None, True) == 1
    assert k8s_pod.pod_exit(-9, None, False) == 137


# A stand-in for torchrun: records its arguments and environment, then ends as told.
FAKE = textwrap.dedent("""
    import json, os, sys, time
    run_dir, how = sys.argv[1], sys.argv[2]
    with open(os.path.join(run_dir, "fake.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "share": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}, f)
    if how in ("completed", "preempted", "linger"):
        with open(os.path.join(run_dir, "outcome.json"), "w") as f:
            json.dump({"status": "preempted" if how == "linger" else how, "step": 3}, f)
    if how == "linger":  # as torchrun's agent waiting at its exit barrier for a peer that is gone
        import signal
        def stop(*_):
            open(os.path.join(run_dir, "terminated"), "w").close()
            sys.exit(1)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(60)
    sys.exit(3 if how == "fail" else 0)
""")


def run_pod(tmp_path, monkeypatch, index, how, seed=None, **kw):
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", str(index))
    opts = ["--run-dir", str(run_dir)] + (["--seed-config", str(seed)] if seed else [])
    rc = k8s_pod.pod_main([*opts, "--", sys.executable, "-c", FAKE, str(run_dir), how, "--rdzv-conf=join_timeout=5"],
                      **kw)
    return rc, json.loads((run_dir / "fake.json").read_text())


@pytest.mark.slow
def test_pod_main(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = compose(ONE_NODE)
    seed = tmp_path / "configmap" / "config.yaml"
    seed.parent.mkdir()
    seed.write_text(to_yaml(cfg))
    # Pod 0 seeds config.yaml into the empty run directory and hosts the rendezvous.
    rc, seen = run_pod(tmp_path, monkeypatch, 0, "completed", seed=seed)
    assert rc == 0
    assert load(run_dir / "config.yaml") == cfg and (run_dir / "logs").is_dir()
    assert seen["argv"][-1] == "--rdzv-conf=join_timeout=5,is_host=true"
    assert seen["share"] == "1"
    # Another pod does not host it, and does not clear an outcome it finds.
    rc, seen = run_pod(tmp_path, monkeypatch, 1, "fail")
    assert rc == 3 and seen["argv"][-1] == "--rdzv-conf=join_timeout=5,is_host=false"
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "completed"
    # Pod 0 clears the last start's outcome before torchrun starts: a failure stays a failure.
    rc, _ = run_pod(tmp_path, monkeypatch, 0, "fail")
    assert rc == 3 and not (run_dir / "outcome.json").exists()
    # The ranks saved and stopped: the pods go back to the Job without counting a failure.
    rc, _ = run_pod(tmp_path, monkeypatch, 0, "preempted")
    assert rc == k8s.EXIT_REQUEUE


def test_pod_main_stops_a_lingering_torchrun(tmp_path, monkeypatch):
    rc, _ = run_pod(tmp_path, monkeypatch, 0, "linger", grace_s=0.5, poll_s=0.1)
    assert rc == k8s.EXIT_REQUEUE
    assert (tmp_path / "run" / "terminated").exists()  # SIGTERM first, so that torchrun can clean up


def test_stale_outcome_is_not_this_runs(tmp_path, monkeypatch):
    """A pod other than 0 may start before pod 0 cleared the last Job's outcome: it must not stop
    its torchrun for it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "outcome.json").write_text(json.dumps({"status": "preempted"}))
    watch = k8s_pod.OutcomeWatch(run_dir)
    assert watch.final() is None
    (run_dir / "outcome.json").unlink()
    (run_dir / "outcome.json").write_text(json.dumps({"status": "completed", "step": 9}))
    assert watch.final() == {"status": "completed", "step": 9}


def test_single_node_launch_says_the_run_goes_with_the_pod(tmp_path, capsys):
    cfg = compose(ONE_NODE)
    cfg.run.dir = str(tmp_path / "tiny")
    (tmp_path / "tiny").mkdir()
    assert k8s.launch(cfg, cfg.run.dir) == 0
    out = capsys.readouterr().out
    assert "Service, ConfigMap, Job" in out and "launcher.k8s.volume_claim is unset" in out
    assert "goes with the pod" in (tmp_path / "tiny" / "k8s.yaml").read_text().split("---")[0]


@pytest.mark.slow
def test_the_cli_writes_the_manifest_and_refuses_a_missing_image(tmp_path):
    """`python -m hpctrain ... launcher=k8s`: a dry run prints the manifest and writes nothing; a launch
    writes <run.dir>/k8s.yaml (the same text as manifest_text) and says how to apply it."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = [sys.executable, "-m", "hpctrain", "+experiment=tiny", "launcher=k8s", f"run.dir={tmp_path / 'run'}"]
    image = "cluster.container_image=registry.example/hpctrain:1"
    dry = subprocess.run([*common, image, "dry_run=true"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "kind: Job" in dry.stdout and "dry run: nothing started" in dry.stdout
    assert not (tmp_path / "run" / "k8s.yaml").exists()
    run = subprocess.run([*common, image], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    written = (tmp_path / "run" / "k8s.yaml").read_text()
    cfg = load(tmp_path / "run" / "config.yaml")
    assert written == k8s.manifest_text(cfg, str(tmp_path / "run"))
    assert f"kubectl apply -f {tmp_path / 'run' / 'k8s.yaml'}" in run.stdout
    bad = subprocess.run(common, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cluster.container_image, which is unset" in bad.stderr
