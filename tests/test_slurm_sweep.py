"""Against the real single-machine Slurm (slurm/start.sh): a Hydra multirun becomes one job array and
its report compares every element; a chain of jobs carries a run past a time limit too short for it."""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from hpctrain.train.metrics import read_metrics

from helpers import run_cli
from test_slurm_requeue import BASE, ONE_PER_NODE, local_reference, losses
from test_slurm_submit import rank_logs, wait_for

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model


def sacct_states(job: str) -> dict[str, str]:
    """{job id (array tasks as <array>_<task>): state} from accounting."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "JobID,State"], capture_output=True,
                         text=True, timeout=30).stdout
    return {line.split("|")[0]: line.split("|")[1].split(" ")[0] for line in out.splitlines() if "|" in line}


def wait_all(jobs: list[str], timeout_s: float) -> dict[str, str]:
    for job in jobs:
        wait_for(job, timeout_s=timeout_s)
    return {j: s for job in jobs for j, s in sacct_states(job).items()}


@pytest.mark.slurm
def test_multirun_is_one_job_array_and_the_report_lists_every_element(slurm, tmp_path):  # noqa: F811
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "+experiment=tiny", "launcher=slurm", "cluster=local", "cluster.nodes=1", "train.steps=4",
                   "eval.every=2", "eval.batches=1", "optim.lr=1e-3,3e-3", "train.micro_batch=2,4",
                   "launcher.array_parallelism=2", f"run.dir={sweep}", timeout=120)
    m = re.search(r"submitted job array (\d+): 4 task\(s\), at most 2 at once", proc.stdout)
    assert m, proc.stdout + proc.stderr
    array = m.group(1)
    # One array of four tasks, bounded as asked.
    shown = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True, timeout=30).stdout
    states = wait_all([array], timeout_s=300)
    assert sorted(states) == [f"{array}_{i}" for i in range(4)], (states, shown)
    assert set(states.values()) == {"COMPLETED"}, states
    names = sorted(p.name for p in sweep.iterdir() if (p / "config.yaml").exists())
    assert names == ["optim.lr=0.001,train.micro_batch=2", "optim.lr=0.001,train.micro_batch=4",
                     "optim.lr=0.003,train.micro_batch=2", "optim.lr=0.003,train.micro_batch=4"]
    for name in names:  # each element ran its own overrides to the end
        run = sweep / name
        cfg = (run / "config.yaml").read_text()
        lr, mb = re.match(r"optim.lr=([\d.]+),train.micro_batch=(\d)", name).groups()
        assert f"lr: {lr}" in cfg and f"micro_batch: {mb}" in cfg
        assert [r["step"] for r in read_metrics(run) if "loss" in r][-1] == 4, rank_logs(run)[-2000:]
    rep = run_cli(str(sweep), module="hpctrain.report")
    assert "report:" in rep.stdout, rep.stdout + rep.stderr
    tsv = (sweep / "report" / "sweep.tsv").read_text().splitlines()
    assert len(tsv) == 5 and sorted(line.split("\t")[0] for line in tsv[1:]) == names, tsv
    # Sorted by best validation loss: the best comes first, each row's figures are the element's own.
    best = [float(line.split("\t")[5].split(" ")[0]) for line in tsv[1:]]
    assert best == sorted(best)
    for line in tsv[1:]:
        name, *_ = line.split("\t")
        val = [r["val_loss"] for r in read_metrics(sweep / name) if "val_loss" in r]
        assert line.split("\t")[5].startswith(f"{min(val):.4f}")
    assert (sweep / "report" / "sweep.png").stat().st_size > 10_000


@pytest.mark.slurm
def test_chain_carries_a_run_past_a_short_time_limit_and_stops_early(slurm, tmp_path):  # noqa: F811
    # A 3-minute limit (the shortest our login-node check lets signal_lead_s=15 through: USR2 may come
    # a minute early), the USR2 between 105 and 165 s into a link. The first link sleeps 3 s per step
    # (`attempt=0`: the first start only), so it gets at most 55 of the 60 steps done before its USR2,
    # whatever the machine's load. The second link (attempt 1) runs at full speed and finishes in
    # seconds; the third must be cancelled while it waits (queued links cost no time). Exactly two run.
    steps = 60
    run_dir = tmp_path / "run"
    proc = run_cli(*BASE, "launcher=slurm", "cluster=local", ONE_PER_NODE, f"train.steps={steps}", "checkpoint.every=10",
                   "cluster.time=00:03:00", "cluster.signal_lead_s=15", "launcher.chain=3", "cluster.max_requeues=0",
                   f"run.dir={run_dir}", "+cluster.env.HPCTRAIN_FAULT='slow_step:ms=3000,attempt=0'", timeout=120)
    assert "a chain of 3 jobs" in proc.stdout, proc.stdout + proc.stderr
    links = json.loads((run_dir / "chain.json").read_text())["jobs"]
    assert len(links) == 3
    deadline = time.monotonic() + 600
    states = {}
    while time.monotonic() < deadline:
        states = {j: sacct_states(j).get(j, "") for j in links}
        if all(s and s not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for s in states.values()):
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", *links], timeout=30)
        raise AssertionError(f"the chain did not end in 600 s: {states}")
    sup = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_log.out")))
    log = sup + "\n" + rank_logs(run_dir)
    # The first link could not finish: it stopped at its limit; a later one resumed and completed the run.
    assert states[links[0]] in ("TIMEOUT", "COMPLETED"), (states, log[-3000:])
    assert "SIGUSR2" in log and "resumed from checkpoint step" in log, log[-4000:]
    assert f"completed at step {steps}" in log, log[-4000:]
    # Finished in the second link: the third was cancelled while it waited (the chain stopped early).
    assert states[links[1]] == "COMPLETED" and states[links[2]] == "CANCELLED", (states, log[-3000:])
    assert "cancelled the rest of the chain" in log, log[-3000:]
    assert "requeueing job" not in log  # a link with a later one queued leaves the requeue to the chain
    assert losses(run_dir) == local_reference(tmp_path, steps)
