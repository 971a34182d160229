"""The login node never imports torch (nor the trackers wandb, mlflow, tensorboard): composing, checking
and planning are pure Python."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys
    import hpctrain.__main__ as cli
    from hpctrain.checks.config_checks import check
    from hpctrain.core.compose import compose

    assert "torch" not in sys.modules, "importing hpctrain.__main__ imported torch"
    for overrides in (["+experiment=tiny"], ["+experiment=tiny", "model=70b"],
                      ["model=70b", "launcher.name=slurm", "cluster.nodes=8", "cluster.gpus_per_node=8",
                       "train.global_batch=128", "train.micro_batch=1", "dry_run=true"]):
        cfg = compose(overrides)
        check(cfg)
        cli.summary(cfg)
    assert "torch" not in sys.modules, "composing/checking/planning imported torch"
    rc = cli.main(["+experiment=70b", "dry_run=true", "run.dir=" + sys.argv[1]])
    assert rc == 0, rc
    assert "torch" not in sys.modules, "a dry run imported torch"
    for heavy in ("wandb", "mlflow", "tensorboard", "kubernetes"):  # trackers start on rank 0; k8s validates late
        assert heavy not in sys.modules, f"the login node imported {heavy}"
    print("NO_TORCH_OK")
""")


def test_login_node_does_not_import_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO_TORCH_OK" in proc.stdout
    assert "70,553,706,496" in proc.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
