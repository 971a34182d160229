"""Which launcher started a process (pure: environment dicts in, DistEnv out), and Slurm hostlists."""
from __future__ import annotations

import pytest

from hpctrain.distributed import hostlist
from hpctrain.distributed.bootstrap import BootstrapError, DistEnv, detect, slurm_port
from hpctrain.launch.local import rank_env

# What a login shell or a batch script carries anyway: must not confuse detection.
NOISE = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "USER": "u"}


def test_nothing_is_single():
    assert detect(dict(NOISE)) == DistEnv("single", 0, 1, 0, 1, None, None)
    assert detect({}).note == ""


def test_local_launcher():
    env = rank_env(1, 4, 29999, base=dict(NOISE))
    assert detect(env) == DistEnv("local", 1, 4, 1, 4, "127.0.0.1", 29999)


def test_torchrun():
    env = {**NOISE, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node7", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc",
           "GROUP_RANK": "1"}
    assert detect(env) == DistEnv("torchrun", 5, 8, 1, 4, "node7", 29400)


def test_rank_world_size_defaults():
    d = detect({"RANK": "2", "WORLD_SIZE": "3"})
    assert (d.rank, d.world, d.local_rank, d.local_world) == (2, 3, 2, 3)
    assert (d.master_addr, d.master_port) == ("127.0.0.1", 29500)


def srun_env(**extra) -> dict:
    env = {**NOISE, "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-3]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    env.update(extra)
    return env


def test_srun_step():
    assert detect(srun_env()) == DistEnv("slurm", 3, 4, 1, 2, "n1", slurm_port("4242"))


def test_srun_step_master_from_env_and_job_nodelist():
    d = detect(srun_env(MASTER_ADDR="head", MASTER_PORT="12345"))
    assert (d.master_addr, d.master_port) == ("head", 12345)
    env = srun_env(SLURM_JOB_NODELIST="gpu-a[07-08]")
    del env["SLURM_STEP_NODELIST"]
    assert detect(env).master_addr == "gpu-a07"


@pytest.mark.parametrize("tasks_per_node, local_world", [("4", 4), ("2(x3)", 2), ("4(x2),2", 4)])
def test_srun_tasks_per_node_forms(tasks_per_node, local_world):
    assert detect(srun_env(SLURM_STEP_TASKS_PER_NODE=tasks_per_node)).local_world == local_world


def test_srun_without_nodelist():
    env = srun_env()
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    with pytest.raises(BootstrapError, match="NODELIST"):
        detect(env)


def test_batch_script_body_is_single_process():
    env = {**NOISE, "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_LOCALID": "0"}
    d = detect(env)
    assert (d.launcher, d.rank, d.world, d.local_rank, d.local_world) == ("single", 0, 1, 0, 1)
    assert d.master_addr is None and d.master_port is None
    assert "batch script" in d.note and "srun" in d.note


def test_open_mpi():
    env = {**NOISE, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "3", "PMIX_SIZE": "8"}
    assert detect(env) == DistEnv("mpi", 3, 8, 1, 2, None, None)


def test_mpich_pmi():
    env = {**NOISE, "PMI_RANK": "2", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
    assert detect(env) == DistEnv("mpi", 2, 6, 0, 3, None, None)


def test_pmix_only():
    env = {**NOISE, "PMIX_RANK": "1", "PMIX_SIZE": "2", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"}
    assert detect(env) == DistEnv("mpi", 1, 2, 1, 2, None, None)


def test_slurm_port():
    assert slurm_port("123456") == slurm_port("123456")  # fixed across a job's requeues
    assert slurm_port("123456") != slurm_port("123457")
    ports = {slurm_port(str(j)) for j in range(1000, 1200)}
    lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert all(1024 <= p < lo for p in ports), (lo, hi)  # never an ephemeral port a connection holds
    assert len(ports) > 190  # and spread out
    assert len(ports) > 190  # jobs sharing a node rarely collide


# --- hostlists ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n1,n2", ["n1", "n2"]),
    (" n1 , n2 ", ["n1", "n2"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("a[08-11]", ["a08", "a09", "a10", "a11"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[5]", ["n5"]),
    ("n[001-004,010],gpu-a[1-2]", ["n001", "n002", "n003", "n004", "n010", "gpu-a1", "gpu-a2"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[1-2]-ib[0-1]", ["n1-ib0", "n1-ib1", "n2-ib0", "n2-ib1"]),
    ("node-1,node-[3,5-6]", ["node-1", "node-3", "node-5", "node-6"]),
    ("n[9-10]", ["n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n1,n1", ["n1", "n1"]),
    ("", []),
])
def test_hostlist_expand(text, hosts):
    assert hostlist.expand(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[]", "n[1,,2]", "n[1-]", "n[x]",
                                 "n[1-2]]"])
def test_hostlist_bad(bad):
    with pytest.raises(ValueError):
        hostlist.expand(bad)


def test_hostlist_first():
    assert hostlist.first("gpu[003-004],cpu1") == "gpu003"
    with pytest.raises(ValueError):
        hostlist.first("")


def test_default_threads_take_what_the_rank_was_given():
    """OMP_NUM_THREADS first, then Slurm's cpus per task, then the cores shared among the node's ranks.
    Mutant: cores / local ranks always (on cluster=local's one task per 2-core node: 2 threads spinning
    against each other, with OMP_NUM_THREADS=1 asked)."""
    from hpctrain.distributed.bootstrap import default_threads

    assert default_threads({"OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": "4"}, 1, cores=16) == 1
    assert default_threads({"SLURM_CPUS_PER_TASK": "4"}, 1, cores=16) == 4
    assert default_threads({}, 4, cores=16) == 4
    assert default_threads({"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "x"}, 3, cores=16) == 5
    assert default_threads({}, 8, cores=2) == 1
