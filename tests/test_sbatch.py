"""launcher=sbatch: the batch script is a pure function of the config, snapshot-tested, quoted.

Snapshots live in tests/snapshots/. After an intended change, rewrite them with
`HPCTRAIN_UPDATE_SNAPSHOTS=1 pytest tests/test_sbatch.py` and review the diff.
The script running under the real Slurm is tested in tests/test_slurm_submit.py.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from hpctrain.checks.config_checks import problems
from hpctrain.core.compose import ConfigError, compose
from hpctrain.launch.sbatch import directives, sbatch_script

from helpers import check_snapshot, set_key

PYTHON = "/opt/venv/bin/python"
HOSTILE = 'x"; rm -rf ~; "'

# Every cluster key the script reads is given here, so that edits to conf/cluster/h100.yaml (the
# planner's figures) do not change the snapshot. Values Hydra's override grammar would need quoting
# for are set on the composed config.
H100_LIKE = [
    "+experiment=70b", "launcher=sbatch", "run.name=llama-70b", "run.dir=/lustre/runs/llama-70b",
    "cluster=h100", "cluster.nodes=8", "cluster.gpus_per_node=8", "cluster.tasks_per_node=8",
    "cluster.cpus_per_task=16", "cluster.mem=0", "cluster.time=2-00:00:00", "cluster.signal_lead_s=300",
    "cluster.partition=h100", "cluster.account=proj-llm", "cluster.qos=high",
]
H100_SET = {
    "constraint": "ib&h100",
    "exclude": "gpu-a[001-004],gpu-b017",
    "setup": ["module load cuda/12.4 nccl", "source /lustre/envs/torch/bin/activate"],
    "env": {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
            "GREETING": "it's a test"},
    "sbatch_extra": {"exclusive": True, "mail_type": "END,FAIL", "comment": "backslash\\here", "hint": False},
}
@pytest.fixture(autouse=True)
def no_live_cluster(monkeypatch):
    """These tests are about the text: the partition checks against sinfo are not theirs."""
    monkeypatch.setattr("hpctrain.checks.cluster_checks.partition_facts", lambda *a, **k: None)


TINY = ["+experiment=tiny", "launcher=sbatch", "cluster=local", "train.micro_batch=4"]


def config(case: str):
    if case == "tiny_local":
        return compose(TINY + ["run.dir=/scratch/runs/tiny"])
    if case == "h100_70b":
        cfg = compose(H100_LIKE)
        for key, value in H100_SET.items():
            set_key(cfg.cluster, key, value)
        return cfg
    if case == "hostile_name":
        cfg = compose(TINY)
        cfg.run.name = HOSTILE
        cfg.run.dir = "/scratch/runs/it's $(pwd) 100%"
        return cfg
    raise KeyError(case)


CASES = ("tiny_local", "h100_70b", "hostile_name")


def script_for(case: str, pythonpath: str | None = None) -> str:
    cfg = config(case)
    assert problems(cfg) == [], problems(cfg)
    return sbatch_script(cfg, cfg.run.dir, PYTHON, pythonpath)


@pytest.mark.parametrize("case", CASES)
def test_snapshot(case):
    check_snapshot(f"{case}.sbatch", script_for(case))


def test_snapshot_with_checkout_on_pythonpath():
    check_snapshot("tiny_local_pythonpath.sbatch", script_for("tiny_local", "/home/me/src/hpctrain"))


def test_scripts_are_valid_bash():
    for case in CASES:
        proc = subprocess.run(["bash", "-n"], input=script_for(case), text=True, capture_output=True)
        assert proc.returncode == 0, (case, proc.stderr)


def sbatch_unquote(value: str) -> str:
    """sbatch's #SBATCH argument parser (22.05, verified against it in test_slurm_submit.py): shell
    quotes, and a backslash escapes the next character even inside single quotes."""
    out, quote, i = [], None, 0
    while i < len(value):
        ch = value[i]
        if ch == "\\" and i + 1 < len(value):
            out.append(value[i + 1])
            i += 2
            continue
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def sbatch_lines(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --"):].partition("=")
            found[name] = sbatch_unquote(value) if value else True
    return found


def test_hostile_values_stay_literal():
    text = script_for("hostile_name")
    assert f"#SBATCH --job-name={shlex.quote(HOSTILE)}" in text
    opts = sbatch_lines(text)
    assert opts["job-name"] == HOSTILE
    # Slurm's filename pattern: %% is a literal %, %j the job id.
    assert opts["output"] == "/scratch/runs/it's $(pwd) 100%%/logs/slurm-%j.out"
    supervisor = [line for line in text.splitlines() if "hpctrain.launch.supervise" in line][0]
    assert shlex.split(supervisor)[-1] == "/scratch/runs/it's $(pwd) 100%"
    # The name reaches the body nowhere but in a comment.
    body = text.split("set -euo pipefail", 1)[1]
    assert HOSTILE not in body


def test_backslash_survives_sbatch_parser():
    opts = sbatch_lines(script_for("h100_70b"))
    assert opts["comment"] == "backslash\\here"
    assert opts["constraint"] == "ib&h100"
    assert opts["exclude"] == "gpu-a[001-004],gpu-b017"


def test_allocation_and_signal():
    opts = sbatch_lines(script_for("h100_70b"))
    assert opts["nodes"] == "8" and opts["ntasks-per-node"] == "8" and opts["gpus-per-node"] == "8"
    assert opts["signal"] == "USR2@300"  # no B:, so every task gets it
    assert opts["requeue"] is True and opts["open-mode"] == "append"
    assert opts["exclusive"] is True and opts["mail-type"] == "END,FAIL"
    assert "hint" not in opts  # false = left out
    local = sbatch_lines(script_for("tiny_local"))
    assert local["ntasks-per-node"] == "2" and "gpus-per-node" not in local
    assert "account" not in local and "qos" not in local  # only those set


def test_env_values_quoted():
    text = script_for("h100_70b")
    assert "export GREETING='it'\"'\"'s a test'" in text
    assert "export NCCL_IB_HCA=mlx5" in text
    # setup runs as written, before the exports, without `set -u`
    assert text.index("module load cuda/12.4 nccl") < text.index("export NCCL_IB_HCA")
    assert "set +u\nmodule load cuda/12.4 nccl\nsource /lustre/envs/torch/bin/activate\nset -u" in text


@pytest.mark.slow
def test_newline_refused():
    for key in ("run.name", "cluster.account", "cluster.sbatch_extra.comment", "cluster.time"):
        cfg = config("tiny_local")
        set_key(cfg, key, "a\nb" if not key.endswith("comment") else "c\rd")
        found = [p for p in problems(cfg) if "line break" in p]
        assert len(found) == 1 and found[0].startswith(key) and "Fix:" in found[0], found
        with pytest.raises(ConfigError, match="line break"):
            sbatch_script(cfg, cfg.run.dir, PYTHON)
    cfg = config("tiny_local")
    with pytest.raises(ConfigError, match="run.dir"):
        sbatch_script(cfg, "/runs/a\nb", PYTHON)


def test_bad_keys_refused():
    cfg = config("tiny_local")
    cfg.cluster.env["BAD-NAME"] = 1
    cfg.cluster.sbatch_extra["a b"] = 1
    found = problems(cfg)
    assert any("BAD-NAME" in p and "environment variable" in p for p in found), found
    assert any("'a b'" in p and "sbatch option" in p for p in found), found


def test_pure(monkeypatch, tmp_path):
    cfg = config("h100_70b")
    first = sbatch_script(cfg, cfg.run.dir, PYTHON)
    assert sbatch_script(cfg, cfg.run.dir, PYTHON) == first

    class NoEnviron(dict):
        def __getitem__(self, key):
            raise AssertionError(f"sbatch_script read os.environ[{key!r}]")

        get = __contains__ = __getitem__

    def no_subprocess(*a, **k):
        raise AssertionError("sbatch_script ran a process")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "environ", NoEnviron())
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    assert sbatch_script(cfg, cfg.run.dir, PYTHON) == first
    assert not list(tmp_path.iterdir())  # wrote nothing


def test_directives_order_is_stable():
    cfg = config("tiny_local")
    assert list(directives(cfg, "/r"))[:4] == ["job-name", "nodes", "ntasks-per-node", "cpus-per-task"]


DRY_RUN = """
import sys, time
t0 = time.monotonic()
import hpctrain.__main__ as cli
rc = cli.main(["+experiment=70b", "launcher=sbatch", "dry_run=true", "run.dir=" + sys.argv[1]])
assert rc == 0, rc
assert "torch" not in sys.modules, "the sbatch dry run imported torch"
print(f"DRY_RUN_OK {time.monotonic() - t0:.2f}")
"""


@pytest.mark.slow
def test_dry_run_prints_the_script_without_torch(tmp_path):
    """`+experiment=70b launcher=sbatch dry_run=true`: the script is shown, nothing is written, no torch."""
    from helpers import REPO

    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", DRY_RUN, str(run_dir)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"--- {run_dir}/job.sbatch (not written) ---" in proc.stdout
    assert "#SBATCH --nodes=8" in proc.stdout and "#SBATCH --gpus-per-node=8" in proc.stdout
    assert f"-m hpctrain.launch.supervise {run_dir}" in proc.stdout
    assert "dry run: nothing started" in proc.stdout
    assert not run_dir.exists()
    print(f"dry run: {float(proc.stdout.split('DRY_RUN_OK ')[1]):.2f} s")  # fast because no torch, as asserted
