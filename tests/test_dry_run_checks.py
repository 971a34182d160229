"""The dry run makes every check a submission makes when a Slurm answers (the partition check too), says
which it skipped when none does, and one launcher's scheduler never refuses another launcher's job. A
fake `sinfo` on PATH plays the cluster: no Slurm needed."""
from __future__ import annotations

import os

import pytest

from hpctrain.__main__ import main

# A CPU-only default partition, and a GPU one: an 8-GPU job must go to `gpu`.
SINFO = "debug*|n1|4|(null)|infinite\ngpu|g1|128|gpu:h100:8(S:0-1)|2-00:00:00\ngpu|g2|128|gpu:h100:8|2-00:00:00\n"
SEVENTY = ["+experiment=70b", "dry_run=true", "cluster.nodes=2", "parallel.dp_shard=2"]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "sinfo"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncat <<'END'\n" + SINFO + "END\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")


def test_a_dry_run_refuses_what_the_submission_would(cluster, capsys):
    """Mutant: the old check skipped on a dry run (the dry run passed, the submission then refused)."""
    assert main([*SEVENTY, "cluster.partition=debug"]) == 2
    err = capsys.readouterr().err
    assert "cluster.partition=debug" in err and "Fix: cluster.partition=gpu" in err
    assert main([*SEVENTY, "cluster.partition=gpu"]) == 0


def test_a_dry_run_says_what_it_skipped_without_slurm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo
    assert main(SEVENTY) == 0
    assert "skipped the partition check a submission makes" in capsys.readouterr().out


def test_slurm_never_refuses_a_kubernetes_job(cluster, capsys):
    """Mutants: the experiment setting launcher.name itself (the old 70b.yaml: launcher=k8s stayed sbatch and was
    refused by the login node's Slurm); the partition check for every launcher."""
    k8s = ["launcher=k8s", "cluster.container_image=nvcr.io/nvidia/pytorch:24.05-py3", "launcher.k8s.volume_claim=runs"]
    assert main([*SEVENTY, *k8s, "cluster.partition=debug"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "kind: " in out and "skipped the partition check" not in out


def test_a_dry_run_says_which_launcher_sizes_the_world(tmp_path, monkeypatch, capsys):
    """A dry run prices what it would start: under launcher=local, launcher.nproc ranks on this machine, not
    the GPUs of the cluster named; it says so, and how to plan the cluster (`python -m hpctrain.plan`
    plans the cluster itself: tests/test_plan.py). Mutant caught: the 2 ranks planned without a word."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo
    assert main(["+experiment=tiny", "cluster=h100", "cluster.nodes=2", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "world: 2 ranks, launcher.nproc=2 of launcher=local" in out
    assert "not the 16 GPUs of cluster.nodes=2 x cluster.gpus_per_node=8. Fix: launcher=sbatch" in out
    assert main(["+experiment=tiny", "dry_run=true"]) == 0  # a CPU cluster: nothing to say
    assert "world:" not in capsys.readouterr().out
