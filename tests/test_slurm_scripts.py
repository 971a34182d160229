"""slurm/stop.sh and slurm/kill_node.sh kill every process in an emulated node's UTS namespace. A
namespace file that names this machine's own namespace (a stale or hand-edited one) would make them kill
everything here, the test suite's ranks included (which then die of SIGTERM with nothing in their logs).
No Slurm is needed: a private state directory holds only the bad namespace file."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import REPO, skip_or_fail

@pytest.fixture(autouse=True)
def as_root():
    if os.geteuid() != 0:
        skip_or_fail("slurm/stop.sh and kill_node.sh run as root", "the Slurm script tests")


@pytest.fixture
def bystander():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def own_namespace_dir(tmp_path, node: str):
    (tmp_path / "pids").mkdir()
    (tmp_path / "pids" / f"slurmd-{node}.ns").write_text(os.readlink("/proc/self/ns/uts") + "\n")
    return dict(os.environ, HPCTRAIN_SLURM_DIR=str(tmp_path))


def test_stop_never_kills_by_this_machines_namespace(tmp_path, bystander):
    """Mutant: stop.sh without its guard (the bystander, and this test, get SIGTERM)."""
    env = own_namespace_dir(tmp_path, "n9")
    proc = subprocess.run(["bash", str(REPO / "slurm" / "stop.sh"), "slurmd-n9"], env=env, capture_output=True,
                          text=True, timeout=60)
    time.sleep(0.2)
    assert bystander.poll() is None, proc.stdout + proc.stderr
    assert "names this machine's own UTS namespace" in proc.stderr


def test_kill_node_never_kills_by_this_machines_namespace(tmp_path, bystander):
    """Mutant: kill_node.sh without its guard (SIGKILL to everything here)."""
    env = own_namespace_dir(tmp_path, "n9")
    proc = subprocess.run(["bash", str(REPO / "slurm" / "kill_node.sh"), "n9"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and bystander.poll() is None
    assert "names this machine's own namespace" in proc.stderr
