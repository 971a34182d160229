"""The wheel carries every subpackage and conf/ (Hydra must find it in an installed hpctrain)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hpctrain.core.compose import conf_dir

REPO = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_for_the_wheel():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hpctrain").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "hpctrain.conf" in listed


def test_conf_dir_holds_every_group():
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    assert {"model", "parallel", "optim", "data", "checkpoint", "launcher", "cluster", "offload",
            "experiment"} <= groups


@pytest.mark.slow
def test_wheel_carries_conf(tmp_path):
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("hpctrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("hpctrain/conf/config.yaml", "hpctrain/conf/model/tiny.yaml", "hpctrain/conf/experiment/70b.yaml",
              "hpctrain/distributed/bootstrap.py", "hpctrain/checkpoint/manager.py"):
        assert f in names, f
