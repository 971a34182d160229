"""Hydra multirun sweeps (`python -m hpctrain -m ...`) and job chains: the expansion against Hydra's own
sweeper, the refusals, the array batch script, chain.sh, and a local sweep with its report."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from hpctrain.core.compose import ConfigError, compose
from hpctrain.launch import chain
from hpctrain.launch.multirun import dir_name, expand
from hpctrain.launch.sbatch import sbatch_script

from helpers import check_snapshot, run_cli



def hydra_basic_sweeper(overrides: list[str]) -> list[list[str]]:
    """Hydra's own BasicSweeper expansion: the independent reference for ours."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [list(job) for batch in batches for job in batch]


@pytest.mark.parametrize("overrides", [
    ["optim.lr=1e-4,3e-4,1e-3", "train.micro_batch=1,2"],
    ["train.steps=5", "train.micro_batch=range(1,4)", "optim.lr=choice(0.1,0.2)"],
    ["+experiment=tiny", "train.seed=range(0,10,3)", "logger=[tensorboard,wandb]"],
])
def test_expansion_is_hydras(overrides):
    fixed, sweep = expand(overrides)
    ours = [[*fixed, *element] for element in sweep]
    theirs = hydra_basic_sweeper(overrides)
    # Hydra keeps every override in its place; ours puts the fixed ones first: same sets, same order.
    assert [sorted(o) for o in ours] == [sorted(t) for t in theirs]
    assert len(ours) == len(theirs)


def test_glob_sweeps_a_groups_options():
    _, sweep = expand(["parallel=glob(*,exclude=auto)"])
    assert sweep == [["parallel=ddp"], ["parallel=fsdp"]]


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=5"], "no override sweeps"),
    (["train.steps=glob(*)"], "train.steps is not a group"),
    (["train.steps=range(1,2000)"], "at most 1000"),
])
def test_expansion_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        expand(overrides)


def test_dir_names_are_override_dirnames_safe_for_paths():
    assert dir_name(["optim.lr=0.001", "+train.x=a/b c"]) == "optim.lr=0.001,train.x=a_b_c"
    long = dir_name([f"k{i}=value" for i in range(60)])
    assert len(long) <= 200 and long != dir_name([f"k{i}=value" for i in range(61)])


@pytest.mark.slow
def test_sweep_refusals_name_every_bad_element_and_start_nothing(tmp_path):
    proc = run_cli("-m", "+experiment=tiny", "optim.lr=1e-3,-1,x", f"run.dir={tmp_path / 's'}", check=False)
    assert proc.returncode == 2
    assert "2 of 3 sweep elements cannot run; nothing was started" in proc.stderr
    assert "[1] optim.lr=-1" in proc.stderr and "must be positive" in proc.stderr
    assert "[2] optim.lr=x" in proc.stderr and "not a valid float" in proc.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_job_array_needs_one_allocation(tmp_path):
    proc = run_cli("-m", "+experiment=tiny", "launcher=sbatch", "cluster=local", "cluster.nodes=1,2",
                   f"run.dir={tmp_path / 's'}", "dry_run=true", check=False)
    assert proc.returncode == 2
    assert "different allocations" in proc.stderr and "a job array has one allocation" in proc.stderr


@pytest.mark.slow
def test_chain_needs_slurm():
    proc = run_cli("+experiment=tiny", "launcher.chain=2", "dry_run=true", check=False)
    assert proc.returncode == 2 and "launcher.chain=2 chains Slurm jobs" in proc.stderr


def test_array_script_snapshot():
    cfg = compose(["+experiment=tiny", "launcher=sbatch", "cluster=local", "run.dir=/runs/sweep",
                   "launcher.array_parallelism=2"])
    dirs = ["/runs/sweep/optim.lr=0.001", "/runs/sweep/optim.lr=0.003", "/runs/sweep/it's"]
    text = sbatch_script(cfg, "/runs/sweep", "/usr/bin/python3", array_dirs=dirs, array_parallelism=2)
    check_snapshot("sweep_array.sbatch", text)
    # bash itself picks task i's directory, quotes and all
    body = text.split("set -euo pipefail", 1)[1].split("# 1 node")[0].replace("set -u", "")
    for i, d in enumerate(dirs):
        out = subprocess.run(["bash", "-c", body + 'printf %s "${run_dirs[$SLURM_ARRAY_TASK_ID]}"'],
                             env={"SLURM_ARRAY_TASK_ID": str(i), "PATH": os.environ["PATH"]},
                             capture_output=True, text=True)
        assert out.stdout == d, out.stderr


def test_chain_script_submits_each_link_after_the_previous(tmp_path):
    """chain.sh run against a fake sbatch that records its arguments and answers ids 101, 102, 103."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/bash\necho \"$@\" >> \"$CALLS\"\nn=$(wc -l < \"$CALLS\")\necho \"$((100 + n));cluster\"\n")
    fake.chmod(0o755)
    for run_dirs, written in ((None, {tmp_path: ["101", "102", "103"]}),
                              ([tmp_path / "a", tmp_path / "b"], {tmp_path / "a": ["101_0", "102_0", "103_0"],
                                                                  tmp_path / "b": ["101_1", "102_1", "103_1"]})):
        for d in written:
            d.mkdir(exist_ok=True)
        calls = tmp_path / "calls"
        calls.unlink(missing_ok=True)
        script = tmp_path / "chain.sh"
        script.write_text(chain.chain_script(tmp_path / "job.sbatch", 3, run_dirs))
        proc = subprocess.run(["bash", str(script)], env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}",
                                                          "CALLS": str(calls)}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert calls.read_text().splitlines() == [
            f"--parsable {tmp_path / 'job.sbatch'}",
            f"--parsable --dependency=afterany:101 {tmp_path / 'job.sbatch'}",
            f"--parsable --dependency=afterany:102 {tmp_path / 'job.sbatch'}"]
        for d, ids in written.items():
            assert chain.read_chain(d) == ids


def test_later_links():
    jobs = ["7", "8", "9"]
    assert chain.later_links(jobs, {"SLURM_JOB_ID": "7"}) == ["8", "9"]
    assert chain.later_links(jobs, {"SLURM_JOB_ID": "9"}) == []
    assert chain.later_links(jobs, {"SLURM_JOB_ID": "5"}) == []  # not a link of this chain
    assert chain.later_links(["4_1", "6_1"], {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "4",
                                              "SLURM_ARRAY_TASK_ID": "1"}) == ["6_1"]
    assert chain.later_links(jobs, {}) == []


@pytest.mark.slow
def test_local_sweep_runs_every_element_and_the_report_compares_them(tmp_path):
    sweep = tmp_path / "sweep"
    # One rank per element: the sweep, not data parallelism, is under test here.
    proc = run_cli("-m", "+experiment=tiny", "launcher.nproc=1", "train.steps=4", "eval.every=2", "eval.batches=1",
                   "optim.lr=1e-3,1e-2", f"run.dir={sweep}", timeout=300)
    assert "sweep done: 2 of 2 completed" in proc.stdout, proc.stdout + proc.stderr
    record = json.loads((sweep / "sweep.json").read_text())
    assert [e["name"] for e in record["elements"]] == ["optim.lr=0.001", "optim.lr=0.01"]
    for e in record["elements"]:
        text = (sweep / e["name"] / "config.yaml").read_text()  # the element's own resolved config
        assert f"lr: {e['name'].split('=')[1]}" in text
        assert (sweep / e["name"] / "outcome.json").exists()
    run_cli(str(sweep), module="hpctrain.report")
    rows = (sweep / "report" / "sweep.tsv").read_text().splitlines()
    assert rows[0].startswith("element\tstatus") and len(rows) == 3
    assert all("\tcompleted\t4\t" in r for r in rows[1:])
    # The larger learning rate learns faster over 4 steps: it is listed first (best validation loss).
    assert rows[1].startswith("optim.lr=0.01\t"), rows
    # Once done, a second run of the same sweep resumes every element: nothing is trained again.
    again = run_cli("-m", "+experiment=tiny", "launcher.nproc=1", "train.steps=4", "eval.every=2", "eval.batches=1",
                    "optim.lr=1e-3,1e-2", f"run.dir={sweep}", timeout=300)
    assert again.stderr.count("already completed at step 4: nothing to do") == 2, again.stderr
    assert f"give a new run.dir (run.dir={sweep / 'optim.lr=0.01'}-2)" in again.stderr  # the way on
