"""Slurm launchers: cluster input refused before submission, and real jobs on the local Slurm.

The first part is pure (time limits, sinfo parsing, submitit parameters). The tests marked `slurm`
need the single-machine Slurm of slurm/start.sh (partition debug, nodes n1 and n2, accounting):
they are skipped, with the reason, when sinfo does not answer. Each real job is tiny (5 steps,
4 ranks on 2 emulated nodes) and takes ~20 s on the 2-core VM.
"""
from __future__ import annotations

import json

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run_cli
from hpctrain.checks.config_checks import problems
from hpctrain.core.compose import compose
from hpctrain.checks.cluster_checks import (gpus_of, parse_sinfo, parse_time, partition_problems,
                                          time_problems)
from hpctrain.launch.slurm import executor_parameters

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
# 4 ranks (2 nodes x 2 tasks): tiny's global batch 16 needs micro batches of 4.
TINY_LOCAL = ["+experiment=tiny", "cluster=local", "train.steps=5", "train.micro_batch=4"]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


def local_cfg(*overrides: str):
    return compose(TINY_LOCAL + ["launcher=slurm", *overrides])


# ---------------------------------------------------------------- pure: time limits, sinfo, params

@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("90:00", 5400), ("0:90", 90), ("01:00:00", 3600), ("1:90:00", 9000), ("1-25", 176400),
    ("1-2:30", 95400), ("1-2:3:4", 93784), ("2-00:00:00", 172800), ("infinite", 0), ("UNLIMITED", 0), ("0", 0),
])
def test_parse_time_takes_what_sbatch_takes(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["1h", "-5", "1:2:3:4", " 5", "", "1-", "01:00:00 "])
def test_parse_time_refuses_what_sbatch_refuses(text):
    with pytest.raises(ValueError):
        parse_time(text)


@pytest.mark.slow
def test_time_problems():
    assert time_problems(local_cfg()) == []
    short = time_problems(local_cfg("cluster.time=00:02:00", "cluster.signal_lead_s=20"))
    assert len(short) == 1 and "cluster.time=00:02:00" in short[0] and "cluster.signal_lead_s=20" in short[0]
    assert "Fix: cluster.time=00:02:20" in short[0]
    assert time_problems(local_cfg("cluster.time=00:02:20", "cluster.signal_lead_s=20")) == []
    below_lead = time_problems(local_cfg("cluster.time=1", "cluster.signal_lead_s=120"))
    assert "too short" in below_lead[0]
    bad = time_problems(local_cfg("cluster.time=1h"))
    assert "cluster.time='1h' is not a Slurm time limit" in bad[0] and "Fix:" in bad[0]
    assert "cluster.signal_lead_s=0" in time_problems(local_cfg("cluster.signal_lead_s=0"))[0]
    assert time_problems(local_cfg("cluster.time=infinite")) == []  # no limit: no signal to lead


def test_time_checked_for_slurm_launchers_only():
    cfg = compose(TINY_LOCAL + ["launcher=local", "cluster.time=1h"])
    assert problems(cfg) == []
    cfg = compose(TINY_LOCAL + ["launcher=sbatch", "cluster.time=1h", "dry_run=true"])
    assert any("cluster.time" in p for p in problems(cfg))


def test_gres():
    assert gpus_of("(null)") == 0
    assert gpus_of("gpu:8") == 8
    assert gpus_of("gpu:h100:8(S:0-1)") == 8
    assert gpus_of("gpu:a100:4,gpu:v100:2") == 6
    assert gpus_of("gpu:h100:4(S:0,1),nvme:1") == 4


SINFO = """\
debug*|n1|4|(null)|infinite
debug*|n2|4|(null)|infinite
gpu|g1|64|gpu:h100:8(S:0-1)|2-00:00:00
gpu|g2|64|gpu:h100:8(S:0-1)|2-00:00:00
gpu|g3|32|gpu:h100:4|2-00:00:00
"""


@pytest.mark.slow
def test_partition_problems_from_sinfo_text():
    parts = parse_sinfo(SINFO)
    assert set(parts) == {"debug", "gpu"} and parts["debug"].default and not parts["gpu"].default
    assert partition_problems(local_cfg(), parts) == []
    assert partition_problems(local_cfg("cluster.partition=null"), parts) == []  # the default one

    msg = partition_problems(local_cfg("cluster.partition=nope"), parts)
    assert msg == ["cluster.partition=nope: no such partition on this cluster (sinfo lists debug, gpu). "
                   "Fix: cluster.partition=debug"]
    msg = partition_problems(local_cfg("cluster.tasks_per_node=5"), parts)
    assert "cluster.tasks_per_node=5" in msg[0] and "4 CPUs" in msg[0] and "cluster.tasks_per_node=4" in msg[0]
    msg = partition_problems(local_cfg("cluster.nodes=3"), parts)
    assert "cluster.nodes=3" in msg[0] and "only 2 nodes" in msg[0] and "Fix: cluster.nodes=2" in msg[0]

    gpu = ["cluster.partition=gpu", "cluster.cpus_per_task=8"]
    assert partition_problems(local_cfg(*gpu, "cluster.gpus_per_node=8"), parts) == []
    msg = partition_problems(local_cfg(*gpu, "cluster.gpus_per_node=16"), parts)
    assert "cluster.gpus_per_node=16" in msg[0] and "Fix: a cluster with 16 GPUs a node, or cluster.gpus_per_node=8" in msg[0]
    # An 8-GPU job on the default CPU partition: the fix is the partition with the GPUs, never 0 GPUs.
    msg = partition_problems(local_cfg("cluster.gpus_per_node=8", "cluster.cpus_per_task=8"), parts)
    assert "no node of cluster.partition=debug has more than 0 GPUs. Fix: cluster.partition=gpu" in msg[0]
    # two nodes hold 8 GPUs; the third only 4
    msg = partition_problems(local_cfg(*gpu, "cluster.gpus_per_node=8", "cluster.nodes=3"), parts)
    assert "only 2 nodes" in msg[0] and "Fix: cluster.nodes=2" in msg[0]
    msg = partition_problems(local_cfg(*gpu, "cluster.gpus_per_node=8", "cluster.time=3-00:00:00"), parts)
    assert "exceeds the time limit" in msg[0] and "cluster.time=48:00:00" in msg[0]


def test_partition_check_skipped_without_a_working_sinfo(monkeypatch, tmp_path):
    from hpctrain.checks import cluster_checks as cluster_check

    monkeypatch.setattr(cluster_check.shutil, "which", lambda name: None)
    assert cluster_check.partition_facts() is None
    monkeypatch.undo()
    fake = tmp_path / "sinfo"
    fake.write_text("#!/bin/sh\necho 'Unable to contact slurm controller' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert cluster_check.partition_facts() is None
    # A hung sinfo: given up on, and killed (not left behind), within the timeout.
    pid_file = tmp_path / "sinfo.pid"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    assert cluster_check.partition_facts(timeout_s=0.5) is None
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    fake.write_text("#!/bin/sh\nexit 1\n")
    cfg = local_cfg("cluster.partition=nope")  # not refused: nothing to ask
    assert not [p for p in problems(cfg) if "partition" in p]


@pytest.mark.slow
def test_executor_parameters():
    cfg = local_cfg()
    cfg.run.name = "my\\run"
    cfg.cluster.setup = ["module load x"]
    cfg.cluster.sbatch_extra = {"comment": "hi", "exclusive": True, "hint": False}
    p = executor_parameters(cfg, "/src/hpctrain")
    assert p["job_name"] == "my\\\\run"  # doubled: submitit quotes, sbatch's parser unescapes
    # submitit runs one process, the supervisor, which starts the ranks with srun: submitit is told of one
    # task, and the allocation's real shape goes to sbatch as additional parameters.
    assert (p["nodes"], p["ntasks_per_node"], p["use_srun"]) == (1, 1, False)
    assert (p["cpus_per_task"], p["time"]) == (1, 10)
    assert p["partition"] == "debug" and p["signal_delay_s"] == 20 and "gpus_per_node" not in p
    assert p["setup"] == ["module load x", "export PYTHONPATH=/src/hpctrain${PYTHONPATH:+:$PYTHONPATH}",
                          "export GLOO_SOCKET_IFNAME=lo", "export OMP_NUM_THREADS=1"]
    assert p["additional_parameters"] == {"nodes": 2, "ntasks_per_node": 2, "requeue": True, "no-kill": True,
                                          "open-mode": "append", "comment": "hi", "exclusive": True}
    assert executor_parameters(local_cfg("cluster.time=00:00:30"))["time"] == 1  # Slurm rounds up to minutes
    gpu = executor_parameters(local_cfg("cluster.gpus_per_node=8", "cluster.tasks_per_node=1"))
    assert gpu["gpus_per_node"] == 8 and gpu["additional_parameters"]["ntasks_per_node"] == 8


def test_submitit_script_snapshot():
    """The batch script submitit writes from these parameters (its own text, pinned submitit 1.5.4)."""
    from submitit.slurm.slurm import _make_sbatch_string

    cfg = local_cfg()
    text = _make_sbatch_string(command="python -u -m submitit.core._submit /runs/tiny/submitit",
                               folder="/runs/tiny/submitit", **executor_parameters(cfg, "/src/hpctrain"))
    path = SNAPSHOTS / "submitit_local.sh"
    if os.environ.get("HPCTRAIN_UPDATE_SNAPSHOTS") == "1":
        path.write_text(text)
    assert text == path.read_text()
    assert "#SBATCH --signal=USR2@20" in text and "#SBATCH --requeue" in text


# ---------------------------------------------------------------- the real local Slurm

def refused(*overrides: str) -> str:
    proc = run_cli(*TINY_LOCAL, *overrides, check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hpctrain: error: this config cannot run"), proc.stderr
    return proc.stderr


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["slurm", "sbatch"])
def test_cli_refusals(slurm, launcher, tmp_path):
    run_dir = tmp_path / "run"
    common = (f"launcher={launcher}", f"run.dir={run_dir}")
    err = refused(*common, "cluster.time=00:01:00", "cluster.signal_lead_s=20")
    assert "cluster.time=00:01:00 (60 s) is too short for cluster.signal_lead_s=20" in err
    assert "Fix: cluster.time=00:02:20" in err
    err = refused(*common, "cluster.partition=gpu")
    assert "cluster.partition=gpu: no such partition on this cluster (sinfo lists debug). " \
           "Fix: cluster.partition=debug" in err
    err = refused(*common, "cluster.tasks_per_node=8", "train.global_batch=64")
    assert "cluster.tasks_per_node=8 x cluster.cpus_per_task=1 = 8 CPUs per node" in err
    assert "has more than 4 CPUs" in err and "cluster.tasks_per_node=4" in err
    err = refused(*common, "cluster.nodes=3", "train.global_batch=24")
    assert "cluster.nodes=3 but cluster.partition=debug has only 2 nodes" in err
    assert not run_dir.exists()  # refused before anything was written or submitted


def wait_for(job: str, timeout_s: float = 240) -> str:
    """The job's final state from sacct (bounded wait; cancels the job when the time is up)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
        if not q.stdout.strip():  # left the queue (or squeue forgot it): ask accounting
            a = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True,
                               text=True, timeout=30)
            state = a.stdout.strip().split("\n")[-1].split(" ")[0] if a.stdout.strip() else ""
            if state in TERMINAL:
                return state
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} did not finish in {timeout_s} s (last state {state!r}); cancelled it")


def ranks_and_hosts(log_text: str) -> dict[int, str]:
    # run.py logs on every rank: "rank 3 of 4 on n2 (launcher slurm, ...)"
    return {int(r): host for r, host in re.findall(r"rank (\d+) of 4 on (\S+) \(launcher slurm", log_text)}


def rank_logs(run_dir: Path) -> str:
    """What every rank wrote (the supervisor's srun gives each its own file)."""
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank-*.log")))


def check_run(run_dir: Path, supervisor_log: str) -> None:
    log_text = supervisor_log + "\n" + rank_logs(run_dir)
    steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(steps) == 5, log_text[-3000:]
    hosts = ranks_and_hosts(log_text)
    assert set(hosts) == {0, 1, 2, 3}, log_text[-3000:]
    assert set(hosts.values()) == {"n1", "n2"}, hosts
    assert "completed at step 5" in log_text


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_script_runs_on_two_nodes(slurm, tmp_path):
    marker = tmp_path / "pwned"
    name = f'x"; touch {marker}; "$(touch {marker})`touch {marker}`'
    run_dir = tmp_path / "run"
    proc = run_cli(*TINY_LOCAL, "launcher=sbatch", f"run.dir={run_dir}", timeout=60)
    script = run_dir / "job.sbatch"
    assert f"sbatch {script}" in proc.stdout
    # A hostile name (set in the written config: the override grammar cannot type it) must reach
    # Slurm as a literal string. The batch script's setup line prints what Slurm recorded.
    cfg = compose(TINY_LOCAL + ["launcher=sbatch", f"run.dir={run_dir}"])
    cfg.run.name = name
    cfg.cluster.setup = ["printenv SLURM_JOB_NAME | sed 's/^/job name: /'"]
    from hpctrain.launch.sbatch import sbatch_script, source_root

    script.write_text(sbatch_script(cfg, str(run_dir), sys.executable, source_root()))
    t0 = time.monotonic()
    sub = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%j"], capture_output=True, text=True, timeout=30)
    state = wait_for(job)
    log = run_dir / "logs" / f"slurm-{job}.out"
    text = log.read_text(errors="replace") if log.exists() else ""
    assert state == "COMPLETED", f"job {job} ended {state}\n{text[-3000:]}"
    assert f"job name: {name}\n" in text
    if q.stdout.strip():  # still queued or running when asked
        assert q.stdout.strip() == name
    assert not marker.exists()
    check_run(run_dir, text)
    print(f"sbatch job {job}: {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.slurm
def test_launcher_slurm_submits_through_submitit(slurm, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    # Submitted on hold: the CLI can only have returned without waiting for the job.
    proc = run_cli(*TINY_LOCAL, "launcher=slurm", f"run.dir={run_dir}", "+cluster.sbatch_extra.hold=true",
                   timeout=120)
    m = re.search(r"submitted job (\d+)", proc.stdout)
    assert m, proc.stdout
    job = m.group(1)
    log = run_dir / "submitit" / f"{job}_0_log.out"
    assert f"tail -f {log}" in proc.stdout and f"run dir: {run_dir}" in proc.stdout
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True, timeout=30)
    assert q.stdout.split() == ["PENDING", "JobHeldUser"], q.stdout
    subprocess.run(["scontrol", "release", job], check=True, timeout=30)
    state = wait_for(job)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert state == "COMPLETED", f"job {job} ended {state}\n{text[-2000:]}\n{rank_logs(run_dir)[-3000:]}"
    check_run(run_dir, text)
    import submitit

    assert submitit.SlurmJob(folder=run_dir / "submitit", job_id=job).result() == 0  # the supervisor's
    # The same 4-rank layout on the local launcher trains the same model, step for step.
    local = tmp_path / "local"
    run_cli(*TINY_LOCAL, "launcher=local", "launcher.nproc=4", f"run.dir={local}", timeout=300)
    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert losses(run_dir) == losses(local)
    print(f"submitit job {job}: {time.monotonic() - t0:.1f} s")


@pytest.mark.slurm
def test_hostlist_parser_agrees_with_scontrol(slurm):
    from hpctrain.distributed.hostlist import expand

    # (Slurm 22.05 refuses a suffix after a bracket, "x[1-3]y"; our parser accepts it: not compared.)
    for hl in ("n[001-004,010],gpu-a[1-2]", "n1", "a[8-11]", "node[07-12]", "r[1-2]n[01-02]",
               "c[1,3,5-6],d9", "n[9-10]", "n[1-2],n[1-2]", "a1,b[01-03],c"):
        out = subprocess.run(["scontrol", "show", "hostnames", hl], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert expand(hl) == out.stdout.split(), hl
