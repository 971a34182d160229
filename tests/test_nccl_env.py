"""NCCL/InfiniBand detection on fake sysfs trees."""
from __future__ import annotations

from pathlib import Path

from hpctrain.distributed.nccl import active_hcas, nccl_env, socket_ifname


def fake_sysfs(root: Path, hcas: dict[str, dict[str, str]], nets: dict[str, str]) -> Path:
    for dev, ports in hcas.items():
        for port, state in ports.items():
            p = root / "class" / "infiniband" / dev / "ports" / port
            p.mkdir(parents=True)
            (p / "state").write_text(state + "\n")
    for name, state in nets.items():
        p = root / "class" / "net" / name
        p.mkdir(parents=True)
        (p / "operstate").write_text(state + "\n")
    return root


def test_active_ports_only_exact_match(tmp_path):
    sysfs = fake_sysfs(tmp_path, {"mlx5_0": {"1": "4: ACTIVE"}, "mlx5_1": {"1": "1: DOWN"},
                                  "mlx5_10": {"1": "4: ACTIVE", "2": "4: ACTIVE"}},
                       {"lo": "unknown", "ib0": "up", "eth0": "up", "docker0": "up"})
    assert active_hcas(sysfs) == ["mlx5_0:1", "mlx5_10:1", "mlx5_10:2"]
    env = nccl_env(sysfs, env={})
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_10:1,mlx5_10:2"  # '=' : exact names, mlx5_1 not matched
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_no_infiniband_disables_ib_and_picks_ethernet(tmp_path):
    sysfs = fake_sysfs(tmp_path, {}, {"lo": "unknown", "docker0": "up", "veth12": "up", "enp5s0": "up",
                                      "eth1": "down"})
    env = nccl_env(sysfs, env={})
    assert env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in env
    assert socket_ifname(sysfs) == "enp5s0"


def test_user_and_cluster_settings_win(tmp_path):
    sysfs = fake_sysfs(tmp_path, {"mlx5_0": {"1": "4: ACTIVE"}}, {"ib0": "up"})
    env = nccl_env(sysfs, env={"NCCL_SOCKET_IFNAME": "bond0"},
                   overrides={"NCCL_IB_HCA": "mlx5_3", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "4"})
    assert "NCCL_SOCKET_IFNAME" not in env  # the user's environment already says
    assert env["NCCL_IB_HCA"] == "mlx5_3" and env["NCCL_ALGO"] == "Ring"
    assert "OMP_NUM_THREADS" not in env  # not ours to pass on here: the launcher exports cluster.env


def test_empty_sysfs(tmp_path):
    env = nccl_env(tmp_path, env={})
    assert env == {"NCCL_IB_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}


def test_flight_recorder_dumps_into_the_attempt(tmp_path):
    env = nccl_env(tmp_path, env={}, dump_prefix="/runs/a/attempts/2/nccl-trace-rank-")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/a/attempts/2/nccl-trace-rank-"
    mine = nccl_env(tmp_path, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/"},
                    dump_prefix="/runs/a/attempts/2/nccl-trace-rank-")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in mine
