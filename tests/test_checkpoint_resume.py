"""Checkpoints end to end through the CLI on 2 (and 4) CPU ranks: exact resume after a USR2,
resharded resume, a rank killed mid-save, async saves, export. The uninterrupted runs every resume is
compared with are themselves compared with the single-process reference (tests/reference.py)."""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpctrain.core.compose import compose
from hpctrain.train.metrics import read_metrics

from helpers import REPO, run_cli, run_main
from reference import reference_losses

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

STEPS = 12
COMMON = ("+experiment=tiny", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
          "optim.warmup_steps=2")
RESHARD_TOL = 1e-5  # fp32: a different layout sums in a different order


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def rank_pids(run_dir: Path) -> list[int]:
    """The ranks' own word (attempts/0/ranks.json): a forked rank's command line is its fork server's."""
    try:
        return [int(p) for p in json.loads((run_dir / "attempts" / "0" / "ranks.json").read_text())["pids"].values()]
    except (OSError, ValueError, KeyError):
        return []


def interrupt_at(run_dir: Path, step: int, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Start the run, send USR2 to a random rank once `step` is logged, wait for the exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", *overrides, f"run.dir={run_dir}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= step:
            pids = rank_pids(run_dir)
            if pids:
                os.kill(random.choice(pids), signal.SIGUSR2)
                break
        time.sleep(0.02)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# The uninterrupted FSDP2 run saves every 2 steps in the background, keeping 2: the resumed runs below
# (which save only when stopped) equal it bit for bit, so the async saves did not change the run; its
# checkpoints are the ones the export, list and refusal tests work on.
ASYNC = ("checkpoint.every=2", "checkpoint.keep=2", "checkpoint.async_save=true")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per-step losses of uninterrupted runs, FSDP2 (saving asynchronously) and DDP, dp=2."""
    out = {}
    for parallel in ("fsdp", "ddp"):
        d = tmp_path_factory.mktemp(f"full-{parallel}")
        run_cli(*COMMON, f"parallel={parallel}", *(ASYNC if parallel == "fsdp" else ()), f"run.dir={d}")
        out[f"{parallel}-dir"] = d
        out[parallel] = losses(d)
        assert len(out[parallel]) == STEPS
        out[f"{parallel}-rows"] = read_metrics(d)
    return out


@functools.lru_cache(maxsize=None)
def single_process() -> tuple:
    """transformers' Llama trained in one process on the whole batch (both layouts compare with it)."""
    return reference_losses(compose(COMMON), STEPS)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_uninterrupted_cli_runs_match_single_process(uninterrupted, parallel):
    """FSDP2 and DDP at dp 2 through the real CLI (launcher, rank entry, data, metrics.jsonl) against
    transformers' Llama trained in one process on the whole batch."""
    rows = uninterrupted[f"{parallel}-rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ref_loss, ref_norm = single_process()
    for r, loss, norm in zip(rows, ref_loss, ref_norm):
        assert abs(r["loss"] - loss) <= RESHARD_TOL * max(1.0, abs(loss)), (r["step"], r["loss"], loss)
        assert abs(r["grad_norm"] - norm) <= 1e-4 * max(1.0, norm), (r["step"], r["grad_norm"], norm)
    for key in ("step", "loss", "lr", "tokens_per_s", "mfu", "mem_bytes"):
        assert key in rows[-1]


def stop_point(parallel: str) -> int:
    return random.Random(parallel).randint(3, 8)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Runs stopped by a USR2 to a random rank, by layout; each test resumes its own copy (a run directory
    holds its path only in config.yaml, which the resume writes anew). FSDP2 dp 2 is the first half of
    three tests."""
    made = {}

    def of(parallel: str, dst: Path) -> subprocess.CompletedProcess:
        if parallel not in made:
            d = tmp_path_factory.mktemp(f"stopped-{parallel}") / "run"
            made[parallel] = (d, interrupt_at(d, stop_point(parallel), *COMMON, f"parallel={parallel}"))
        src, proc = made[parallel]
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        return proc

    return of


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_usr2_then_resume_is_bit_identical(tmp_path, uninterrupted, stopped, parallel):
    first = stopped(parallel, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "run the same command again to resume" in first.stderr
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step-")
    stopped_at = int(saved[0].split("-")[1])
    assert stop_point(parallel) <= stopped_at < STEPS
    assert len(losses(tmp_path)) == stopped_at

    second = run_cli(*COMMON, f"parallel={parallel}", f"run.dir={tmp_path}")
    assert f"resumed from checkpoint step {stopped_at}" in second.stdout
    assert losses(tmp_path) == uninterrupted[parallel]  # bit-identical, every step


def stopped_step(run_dir: Path) -> int:
    (name,) = [p.name for p in (run_dir / "checkpoints").iterdir()]
    return int(name.split("-")[1])


@pytest.mark.parametrize("first,then", [
    (("parallel=fsdp", "launcher.nproc=2"), ("parallel=ddp", "launcher.nproc=1")),  # FSDP2 dp2 -> DDP dp1
    # (FSDP2 dp 4 -> 2: the kill -9 test below)
    # ZeRO-1 x TP 2, dp 2 (replicated DTensor parameters, moments saved by their owners only) -> FSDP2 dp2
    (("parallel=ddp", "parallel.zero=1", "parallel.tp=2", "launcher.nproc=4"), ("parallel=fsdp", "launcher.nproc=2")),
    # FSDP2 dp2 -> ZeRO-1 x PP 2, dp 2 (each owner loads its share of the moments)
    (("parallel=fsdp", "launcher.nproc=2"), ("parallel=ddp", "parallel.zero=1", "parallel.pp=2", "launcher.nproc=4")),
    # FSDP2 dp2 -> each sequence over cp 2 (the same stream of whole sequences, split inside the step)
    (("parallel=fsdp", "launcher.nproc=2"), ("parallel=fsdp", "parallel.cp=2", "launcher.nproc=2")),
])
def test_resharded_resume_continues_the_same_run(tmp_path, uninterrupted, stopped, first, then):
    if first == ("parallel=fsdp", "launcher.nproc=2"):  # the default layout: the usr2 test's stopped run
        proc = stopped("fsdp", tmp_path)
    else:
        proc = interrupt_at(tmp_path, 4, *COMMON, *first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    k = stopped_step(tmp_path)
    resumed = run_cli(*COMMON, *then, f"run.dir={tmp_path}")
    assert f"resumed from checkpoint step {k}" in resumed.stdout
    got, want = losses(tmp_path), uninterrupted["fsdp"]
    assert len(got) == STEPS
    # The same data stream after the switch (data position resharded), the same model within
    # the reordering of fp32 sums a different layout brings.
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= RESHARD_TOL * max(1.0, abs(b)), (step, k, a, b)


def test_kill9_mid_save_keeps_previous_checkpoint_and_resumes_on_fewer_ranks(tmp_path, uninterrupted):
    """FSDP2 dp 4 with rank 1 SIGKILLed in the middle of the step-6 save; the run then resumes from step 3
    on dp 2 (a lost node) and continues the same run. The first run stops at its first failure
    (launcher.max_restarts=0): kill_in_save fires in every attempt, so a restart would only repeat the
    torn save on 4 ranks before giving up."""
    proc = run_cli(*COMMON, "launcher.nproc=4", "checkpoint.every=3", "launcher.max_restarts=0",
                   f"run.dir={tmp_path}", check=False, env={"HPCTRAIN_FAULT": "kill_in_save:step=6,rank=1"})
    assert proc.returncode != 0 and "rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    # The torn save never became visible: at most a .tmp-step-00000006-* remains (rank 0 removes it
    # when it sees the save fail, unless it is killed first).
    assert "step-00000003" in names and "step-00000006" not in names

    again = run_cli(*COMMON, "launcher.nproc=2", "checkpoint.every=3", f"run.dir={tmp_path}")
    assert "resumed from checkpoint step 3" in again.stdout
    got, want = losses(tmp_path), uninterrupted["fsdp"]
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= RESHARD_TOL * max(1.0, abs(b)), (step, a, b)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert not any(n.startswith(".tmp") for n in names)  # swept by the next successful save


@pytest.fixture(scope="module")
def async_run(uninterrupted) -> Path:
    return uninterrupted["fsdp-dir"]


def test_async_saves_complete(async_run):
    names = sorted(p.name for p in (async_run / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000012"]  # the last save waited for, older ones pruned


def test_export_consolidates_weights(tmp_path, async_run):
    step_dir = async_run / "checkpoints" / "step-00000012"
    out = tmp_path / "model.safetensors"
    assert run_main("hpctrain.checkpoint", "export", str(step_dir), str(out)).returncode == 0
    from safetensors.torch import load_file

    from hpctrain.models.llama import Llama

    weights = load_file(str(out))
    cfg = compose(COMMON)
    model = Llama(cfg.model, cfg.data.seq_len)
    model.load_state_dict(weights, strict=True)  # every name and shape of the plain model
    x = torch.randint(0, cfg.model.vocab_size, (1, 16))
    assert torch.isfinite(model(x)).all()

    bad = run_main("hpctrain.checkpoint", "export", str(async_run / "checkpoints"), str(out))
    assert bad.returncode == 2 and "not a complete checkpoint" in bad.stderr
    assert f"Complete checkpoints: {step_dir.parent / 'step-00000010'}, {step_dir}" in bad.stderr  # what to give instead


def test_checkpoint_list_counts_the_tokens_each_one_trained_on(tmp_path, async_run):
    """Mutant: tokens read from a key the checkpoint does not have (every row said "tokens 0")."""
    cfg = compose(COMMON)
    out = run_main("hpctrain.checkpoint", "list", str(async_run)).stdout.splitlines()
    assert out[0].split() == ["step", "saved", "world", "tokens", "directory"]
    rows = [line.split() for line in out[1:]]
    assert [(r[0], r[3], r[4], r[-1]) for r in rows] == [
        (str(step), "2", f"{step * cfg.train.global_batch * cfg.data.seq_len:,}",
         str(async_run / "checkpoints" / f"step-{step:08d}")) for step in (10, 12)]
    none = run_main("hpctrain.checkpoint", "list", str(tmp_path))
    assert none.returncode == 1 and "no complete checkpoint in" in none.stderr and "checkpoint.every=N" in none.stderr


def test_resume_false_refuses_to_overwrite(async_run):
    before = sorted(p.name for p in (async_run / "checkpoints").iterdir())
    proc = run_main("hpctrain", *COMMON, "checkpoint.resume=false", f"run.dir={async_run}")
    assert proc.returncode == 2
    assert "refusing to overwrite" in proc.stderr and "checkpoint.resume=false" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (async_run / "checkpoints").iterdir()) == before
