"""`mpiexec -n 2 python -m hpctrain.run <run_dir>` bootstraps through mpi4py (pip-installed MPICH) and
trains exactly like the local launcher."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hpctrain.core.compose import compose
from hpctrain.train.metrics import read_metrics
from hpctrain.core.rundir import prepare_run_dir

from helpers import REPO, run_cli

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

ARGS = ("+experiment=tiny", "train.steps=3")


def test_mpiexec_bootstrap_matches_local_launcher(tmp_path):
    mpiexec = shutil.which("mpiexec")
    assert mpiexec, "mpiexec not found: `pip install mpich` (the dev extra does)"
    run = tmp_path / "mpi"
    prepare_run_dir(compose([*ARGS, f"run.dir={run}"]))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in [k for k in env if k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or k.startswith("SLURM_")]:
        env.pop(k)
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "hpctrain.run", str(run)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launcher mpi" in proc.stderr and "rank 1 of 2" in proc.stderr

    local = tmp_path / "local"
    run_cli(*ARGS, f"run.dir={local}")
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(local)]
