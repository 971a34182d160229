"""The node agent's torch-free parts and the generation plan file (issue 47): what the supervisor learns
of a rank's state, where a run's snapshots live on a node, and what a surviving rank reads to rejoin.
The whole path (agents, generations, restores) runs in tests/test_data_exactly_once.py (local) and
tests/test_slurm_memory.py (Slurm)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from hpctrain.core.generations import rank_env, read_plan, wait_next
from hpctrain.launch.agent import memory_dir, rank_state, run_id

from helpers import wait_until


def test_a_stopped_rank_is_told_from_a_running_one():
    """SIGSTOP shows as `T` in /proc/<pid>/stat (after the command name, which may hold spaces and
    parentheses). Mutant: the state read at a fixed field (wrong for such names), or `T` not mapped."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert rank_state(p.pid) == "running"
        os.kill(p.pid, signal.SIGSTOP)
        wait_until(lambda: rank_state(p.pid) == "stopped", "the stopped state", timeout_s=5)
        os.kill(p.pid, signal.SIGCONT)
        wait_until(lambda: rank_state(p.pid) == "running", "the running state", timeout_s=5)
    finally:
        p.kill()
        p.wait()


def test_each_run_and_job_has_its_own_snapshot_directory(tmp_path):
    """Two runs on one node, or the same run dir in two jobs, never share files; the name holds what
    the agent may delete. Mutant: the run id not in the name."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert memory_dir("/dev/shm", a, "17", "n1") != memory_dir("/dev/shm", b, "17", "n1")
    assert memory_dir("/dev/shm", a, "17", "n1") != memory_dir("/dev/shm", a, "18", "n1")
    assert memory_dir("/dev/shm", a, "17", "n1") != memory_dir("/dev/shm", a, "17", "n2")
    assert memory_dir("/dev/shm", a, None, "n1").name == f"hpctrain-local-{run_id(a)}-n1"
    assert len(run_id(a)) == 8


def plan(g: int, survivors: list[int]) -> dict:
    return {"generation": g, "world": 4, "master_addr": "n1", "master_port": 16001,
            "rank_nodes": {"0": "n1", "1": "n1", "2": "n2", "3": "n2"}, "agents": {}, "ring": ["n1", "n2"],
            "lost": [], "previous_rank_nodes": None, "previous_ring": None, "survivors": survivors}


def write(run_dir, p: dict) -> None:
    d = run_dir / "attempts" / str(p["generation"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(json.dumps(p))


def test_rank_env_places_the_rank_on_its_node():
    """Mutant: LOCAL_RANK taken as the global rank (rank 3 is the second on n2: local rank 1)."""
    env = rank_env(plan(2, []), 3)
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                   "MASTER_PORT": "16001", "HPCTRAIN_ATTEMPT": "2", "HPCTRAIN_LAUNCHER": "agent"}


def test_a_survivor_rejoins_only_a_plan_that_keeps_it(tmp_path):
    """The next generation's plan names the survivors: a rank it keeps goes on in that generation; a rank
    it does not keep ends (the agent forks a new one). Mutants: the first later plan taken whatever it
    says; a plan of another generation's number in the directory accepted; waiting forever."""
    write(tmp_path, plan(3, [0, 2]))
    assert wait_next(tmp_path, 2, 0, timeout_s=1) == 3
    assert wait_next(tmp_path, 2, 1, timeout_s=1) is None
    (tmp_path / "attempts" / "5").mkdir(parents=True)
    (tmp_path / "attempts" / "5" / "plan.json").write_text(json.dumps(plan(4, [1])))  # misfiled: ignored
    assert read_plan(tmp_path, 5) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(wait_next(tmp_path, 3, 1, timeout_s=0.3)), daemon=True)
    waiter.start()
    waiter.join(30)  # no next plan: gives up (after its timeout), never waits on forever
    assert got == [None]


def test_a_spare_takes_the_lost_nodes_place():
    """n1 lost from [n1, n2] with the spare n3: [n3, n2], so rank 1 stays on n2 in its process and only
    n1's ranks move. Mutant: the usable nodes in allocation order ([n2, n3]: every rank moves)."""
    from hpctrain.launch.supervise import keep_places

    assert keep_places(["n1", "n2"], ["n2", "n3"], 2) == ["n3", "n2"]
    assert keep_places(["n1", "n2"], ["n1", "n3"], 2) == ["n1", "n3"]
    assert keep_places(["n1", "n2"], ["n1", "n2", "n3"], 2) == ["n1", "n2"]
    assert keep_places([], ["n1", "n2", "n3"], 2) == ["n1", "n2"]  # the first start


def test_memory_dir_must_be_a_tmpfs(tmp_path):
    """Snapshots on a disk or a shared file system are not the node's memory (and a shared one would be
    every node's). Mutant: any directory accepted."""
    from hpctrain.core.replica import fs_type, memory_root_problem

    mounts = tmp_path / "mounts"
    mounts.write_text("tmpfs /dev/shm tmpfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\nnfs:/x /shared nfs rw 0 0\n")
    assert fs_type("/dev/shm/a", str(mounts)) == "tmpfs" and fs_type("/shared/a", str(mounts)) == "nfs"
    assert fs_type("/sharedx", str(mounts)) == "ext4"  # a prefix of the name is not the mount point
    assert memory_root_problem(str(tmp_path / "none")).endswith("is not a directory on " + __import__("socket").gethostname())
