"""cluster.container_image: the ranks' srun step runs them in the image through pyxis/enroot; the batch
script and the supervisor stay on the batch host, and without an image nothing changes.

The script's snapshot lives in tests/snapshots/ (rewrite after an intended change with
`HPCTRAIN_UPDATE_SNAPSHOTS=1 pytest tests/test_container.py` and review the diff); the snapshots
without a container are tests/test_sbatch.py's, which must stay as they are.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, run_cli
from hpctrain.core.compose import ConfigError
from hpctrain.distributed.bootstrap import slurm_port
from hpctrain.launch import container, runners
from hpctrain.launch.runners import SrunRunner
from hpctrain.launch.sbatch import sbatch_script
from hpctrain.checks.config_checks import problems
from test_sbatch import PYTHON, check_snapshot, config, no_live_cluster  # noqa: F401 (an autouse fixture)

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"  # as Docker and Kubernetes write it
PYXIS_IMAGE = "nvcr.io#nvidia/pytorch:24.05-py3"  # as enroot reads it
CHECKOUT = "/home/me/src/hpctrain"


def with_container(case: str = "h100_70b", **keys):
    cfg = config(case)
    cfg.cluster.container_image = IMAGE
    cfg.cluster.container_mounts = ["/lustre/data:/data:ro+rprivate", "/lustre/tokenizers"]
    for k, v in keys.items():
        setattr(cfg.cluster, k, v)
    return cfg


# ---------------------------------------------------------------- the batch script

def test_snapshot_with_container():
    cfg = with_container()
    assert problems(cfg) == [], problems(cfg)
    check_snapshot("h100_70b_container.sbatch", sbatch_script(cfg, cfg.run.dir, PYTHON, CHECKOUT))


def test_container_changes_only_a_comment():
    """The script's commands are those without a container: the image is the srun step's business."""
    plain = config("h100_70b")
    text = sbatch_script(with_container(), plain.run.dir, PYTHON, CHECKOUT)
    def commands(script: str) -> list[str]:
        return [line for line in script.splitlines() if line and (line[0] != "#" or line.startswith("#SBATCH"))]

    assert commands(text) == commands(sbatch_script(plain, plain.run.dir, PYTHON, CHECKOUT))
    assert f"#     '--container-image={PYXIS_IMAGE}' \\" in text
    mounts = ("/lustre/data:/data:ro+rprivate,/lustre/tokenizers,/lustre/runs/llama-70b:/lustre/runs/llama-70b,"
              f"{CHECKOUT}:{CHECKOUT}")
    assert f"#     --container-mounts={mounts} \\" in text
    for case in ("tiny_local", "hostile_name"):
        cfg = with_container(case)
        text = sbatch_script(cfg, cfg.run.dir, PYTHON)
        proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr
    # "it's $(pwd) 100%" cannot go into --container-mounts: the directory above it goes instead.
    assert ",/scratch/runs:/scratch/runs \\" in text


def test_unmountable_checkout_refused_in_the_script():
    """The checkout is known where the script is written: one pyxis cannot mount is refused there."""
    cfg = with_container()
    with pytest.raises(ConfigError, match="hpctrain's checkout .* Fix: install hpctrain"):
        sbatch_script(cfg, cfg.run.dir, PYTHON, "/my code,v2/hpctrain")


def test_array_script_names_the_task_run_dir():
    cfg = with_container("tiny_local")
    dirs = ["/scratch/sweep/optim.lr=0.001,train.micro_batch=2", "/scratch/sweep/optim.lr=0.002,train.micro_batch=2"]
    text = sbatch_script(cfg, "/scratch/sweep", PYTHON, CHECKOUT, array_dirs=dirs)
    assert "#     python -u -m hpctrain.run RUN_DIR" in text and "RUN_DIR: the array task's run directory" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # Each task's supervisor mounts its directory through the sweep's: the element's name holds a comma.
    assert container.mounts(cfg.cluster, dirs[0])[-1] == "/scratch/sweep:/scratch/sweep"


# ---------------------------------------------------------------- the srun step

JOB_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]"}
RUN = "/lustre/runs/llama-70b"


def runner(monkeypatch, cfg, source=CHECKOUT) -> SrunRunner:
    monkeypatch.setattr(runners, "hostnames", lambda nodelist: ["n1", "n2"])
    monkeypatch.setattr(runners, "source_root", lambda: source)
    return SrunRunner(cfg, Path(RUN), env=JOB_ENV)


def allocation_flags(overlap: bool) -> list[str]:
    """srun's options without a container, as SrunRunner wrote them before containers existed."""
    return ["srun", *(["--overlap"] if overlap else []), "--nodes=2", "--ntasks=16", "--ntasks-per-node=8",
            "--nodelist=n1,n2", "--kill-on-bad-exit=1", "--cpus-per-task=16", f"--output={RUN}/logs/rank-%t.log",
            "--open-mode=append"]


def test_srun_command_with_container(monkeypatch):
    cfg = with_container(container_workdir="/workspace", container_python="/usr/bin/python3")
    r = runner(monkeypatch, cfg)
    assert r.command(["n1", "n2"], attempt=1) == [
        *allocation_flags(overlap=True),
        f"--container-image={PYXIS_IMAGE}",
        f"--container-mounts=/lustre/data:/data:ro+rprivate,/lustre/tokenizers,{RUN}:{RUN},{CHECKOUT}:{CHECKOUT}",
        "--container-workdir=/workspace",
        "--container-env=MASTER_PORT,PYTHONPATH,NCCL_IB_HCA,NCCL_DEBUG,TORCH_NCCL_ASYNC_ERROR_HANDLING,GREETING",
        "/usr/bin/python3", "-u", "-m", "hpctrain.run", RUN]


def test_srun_command_installed_hpctrain(monkeypatch):
    """Installed (no checkout): nothing to mount for the code, PYTHONPATH left to the image."""
    cfg = with_container()
    cfg.cluster.env = {"PATH": "/host/bin", "LD_LIBRARY_PATH": "/host/lib", "NCCL_DEBUG": "INFO"}
    cmd = runner(monkeypatch, cfg, source=None).command(["n1"], attempt=0)
    i = cmd.index(f"--container-image={PYXIS_IMAGE}")
    assert cmd[i:] == [f"--container-image={PYXIS_IMAGE}",
                       f"--container-mounts=/lustre/data:/data:ro+rprivate,/lustre/tokenizers,{RUN}:{RUN}",
                       "--container-env=MASTER_PORT,NCCL_DEBUG",  # the image keeps its PATH and libraries
                       "python", "-u", "-m", "hpctrain.run", RUN]


def test_srun_command_without_container_is_unchanged(monkeypatch):
    r = runner(monkeypatch, config("h100_70b"))
    for attempt in (0, 3):
        assert r.command(["n1", "n2"], attempt) == [*allocation_flags(overlap=attempt > 0), sys.executable, "-u",
                                                    "-m", "hpctrain.run", RUN]
    assert r.step_env({"HPCTRAIN_ATTEMPT": "3"}, 3, base={"A": "1"}) == {"A": "1", "HPCTRAIN_ATTEMPT": "3"}


def test_step_env_sets_the_attempts_port(monkeypatch):
    r = runner(monkeypatch, with_container())
    env = r.step_env({"HPCTRAIN_ATTEMPT": "2"}, 2, base={"A": "1"})
    assert env == {"A": "1", "HPCTRAIN_ATTEMPT": "2", "MASTER_PORT": str(slurm_port("4242", 2))}
    assert r.step_env({}, 2, base={"MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"  # the user's own


def test_master_port_is_the_ranks_own():
    for job in ("1", "4242", "987654321"):
        for attempt in range(4):
            assert container.master_port(job, attempt) == slurm_port(job, attempt)


@pytest.mark.parametrize("image, pyxis", [
    (IMAGE, PYXIS_IMAGE), (PYXIS_IMAGE, PYXIS_IMAGE),
    ("me@nvcr.io/nvidia/pytorch:24.05-py3", "me@nvcr.io#nvidia/pytorch:24.05-py3"),
    ("localhost:5000/llm:1", "localhost:5000#llm:1"), ("ubuntu:22.04", "ubuntu:22.04"),
    ("nvidia/cuda:12.4.1-base-ubuntu22.04", "nvidia/cuda:12.4.1-base-ubuntu22.04"),  # Docker Hub: no registry
    ("/lustre/images/pytorch.sqsh", "/lustre/images/pytorch.sqsh"), ("docker://nvcr.io#a/b", "docker://nvcr.io#a/b")])
def test_image_as_enroot_reads_it(image, pyxis):
    assert container.pyxis_image(image) == pyxis


def test_mounts_without_duplicates_and_through_a_mountable_parent():
    cfg = with_container()
    cfg.cluster.container_mounts = [f"{RUN}:{RUN}", CHECKOUT]
    assert container.mounts(cfg.cluster, RUN, CHECKOUT) == [f"{RUN}:{RUN}", CHECKOUT]
    assert container.mounts(cfg.cluster, "/s/a=1,b=2", "/x y/src") == [f"{RUN}:{RUN}", CHECKOUT, "/s:/s"]


# ---------------------------------------------------------------- the supervisor, with a fake srun

FAKE_SRUN = """#!{python}
import json, os, sys
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "MASTER_PORT": os.environ.get("MASTER_PORT"),
                        "PYTHONPATH": os.environ.get("PYTHONPATH")}}) + "\\n")
run_dir = sys.argv[-1]
with open(os.path.join(run_dir, "outcome.json"), "w") as f:
    json.dump({{"status": "completed", "step": 1}}, f)
"""
FAKE_SCONTROL = "#!/bin/sh\necho n1\n"


@pytest.mark.slow
def test_batch_script_runs_the_ranks_in_the_image(tmp_path):
    """The written job.sbatch, run by bash as Slurm would (fake srun and scontrol on PATH): its
    supervisor starts the ranks with pyxis's flags, the image's python and the attempt's port."""
    run_dir = tmp_path / "run"
    run_cli("+experiment=tiny", "launcher=sbatch", "cluster=local", "train.micro_batch=4", f"run.dir={run_dir}",
            f"cluster.container_image={IMAGE}", "cluster.container_mounts=[/lustre/data:/data:ro]", timeout=120)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_SRUN_LOG=str(log), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="n1")
    proc = subprocess.run(["bash", str(run_dir / "job.sbatch")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    argv = call["argv"]
    i = argv.index(f"--container-image={PYXIS_IMAGE}")
    assert argv[i:] == [f"--container-image={PYXIS_IMAGE}",
                        f"--container-mounts=/lustre/data:/data:ro,{run_dir}:{run_dir},{REPO}:{REPO}",
                        "--container-env=MASTER_PORT,PYTHONPATH,GLOO_SOCKET_IFNAME,OMP_NUM_THREADS",
                        "python", "-u", "-m", "hpctrain.run", str(run_dir)]
    assert argv[:i][-1] == "--open-mode=append"
    assert call["MASTER_PORT"] == str(slurm_port("4242", 0))
    assert call["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


# ---------------------------------------------------------------- refused on the login node

def refusals(*overrides: str) -> list[str]:
    proc = run_cli("+experiment=tiny", "launcher=sbatch", "cluster=local", "dry_run=true", *overrides,
                   check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]


@pytest.mark.slow
def test_mounts_without_image_refused():
    (msg,) = refusals("cluster.container_mounts=[/a]")
    assert msg.startswith("cluster.container_mounts=['/a'] is set but cluster.container_image is not")
    assert "Fix: cluster.container_image=<image>" in msg and "cluster.container_mounts=[]" in msg


@pytest.mark.slow
def test_bad_mounts_refused():
    found = refusals(f"cluster.container_image={IMAGE}",
                     "cluster.container_mounts=['/a:/b:ro,rw',data:/data,/c::/d,/e:rel,'/g:/h:ro x','/s p:/q']")
    expect = [("cluster.container_mounts[0]='/a:/b:ro,rw' holds a comma", "Fix: give each mount as its own"),
              ("cluster.container_mounts[1]='data:/data': the source 'data' is not an absolute path", "Fix:"),
              ("cluster.container_mounts[2]='/c::/d' is not a mount", "Fix: e.g. cluster.container_mounts="),
              ("cluster.container_mounts[3]='/e:rel': the destination 'rel' is not an absolute path", "Fix:"),
              ("cluster.container_mounts[4]='/g:/h:ro x': the flags 'ro x' are not mount options", "Fix: e.g. ro"),
              ("cluster.container_mounts[5]='/s p:/q': the source holds a space", "Fix: mount a directory above")]
    assert len(found) == len(expect), found
    for msg, (start, fix) in zip(found, expect):
        assert msg.startswith(start) and fix in msg, (msg, start)


@pytest.mark.slow
def test_empty_or_relative_image_refused():
    (msg,) = refusals("cluster.container_image=''")
    assert msg.startswith("cluster.container_image='' is empty") and "Fix: cluster.container_image=<image>" in msg
    (msg,) = refusals("cluster.container_image=./pytorch.sqsh")
    assert msg.startswith("cluster.container_image=./pytorch.sqsh is a relative path") and "Fix:" in msg


@pytest.mark.slow
def test_image_with_local_launcher_refused():
    (msg,) = refusals("launcher=local", f"cluster.container_image={IMAGE}")
    assert msg.startswith(f"cluster.container_image={IMAGE} is set but launcher=local")
    assert "Fix: launcher=sbatch or launcher=slurm" in msg and "cluster.container_image=null" in msg


@pytest.mark.slow
def test_workdir_python_and_run_dir_refused():
    found = refusals(f"cluster.container_image={IMAGE}", "cluster.container_workdir=work",
                     "cluster.container_python=''", "run.dir='/a b,c/run'")
    assert len(found) == 3, found
    assert found[0].startswith("cluster.container_workdir='work' is not an absolute path") and "Fix:" in found[0]
    assert found[1].startswith("cluster.container_python='' is not a command") and "Fix:" in found[1]
    assert found[2].startswith("run.dir '/a b,c/run' is mounted into the container") and "Fix:" in found[2]


@pytest.mark.slow
def test_good_container_passes_the_dry_run():
    proc = run_cli("+experiment=tiny", "launcher=sbatch", "cluster=local", "dry_run=true",
                   f"cluster.container_image={IMAGE}", "cluster.container_mounts=[/lustre/data,/l/t:/t:ro]",
                   "cluster.container_workdir=/workspace", timeout=120)
    assert f"#     '--container-image={PYXIS_IMAGE}' \\" in proc.stdout
    assert "#     --container-workdir=/workspace \\" in proc.stdout
