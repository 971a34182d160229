"""Validation in the loop (eval.every, eval.batches) on the example corpus, through the CLI with 2 ranks:
logged to metrics.jsonl, TensorBoard and the progress line; it never moves the training stream; a run
that crashed and resumed logs the same training and validation losses to the last bit. (That every
layout computes the same validation loss as transformers is in test_layouts.py.)"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpctrain.core.rundir import read_jsonl

from helpers import run_cli

pytestmark = pytest.mark.slow


def common(shards: Path) -> tuple[str, ...]:
    return ("+experiment=tiny", "data=shards", f"data.path={shards}", "model.vocab_size=512", "data.seq_len=64",
            "train.steps=12", "checkpoint.every=4", "optim.warmup_steps=2", "eval.batches=2")


def curve(run_dir: Path, key: str) -> list:
    return [(r["step"], r[key]) for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]


@pytest.fixture(scope="module")
def with_eval(example_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("with_eval")
    proc = run_cli(*common(example_shards), "eval.every=5", "logger=tensorboard", f"run.dir={d}")
    return d, proc


def test_validation_is_logged_everywhere_and_falls(with_eval):
    d, proc = with_eval
    val = curve(d, "val_loss")
    assert [s for s, _ in val] == [5, 10, 12]  # every 5 steps and after the last
    for (s, loss), (_, ppl) in zip(val, curve(d, "val_ppl")):
        assert math.isclose(ppl, math.exp(loss), rel_tol=1e-9)
    assert val[-1][1] < val[0][1] < math.log(512) + 0.5, val  # it learns from real text
    assert "val loss" in proc.stdout + proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("val/loss")] == [(s, round(v, 5)) for s, v in val]


def test_validation_does_not_move_the_training_stream(with_eval, example_shards, tmp_path):
    run_cli(*common(example_shards), "eval.every=0", f"run.dir={tmp_path}")
    assert curve(tmp_path, "loss") == curve(with_eval[0], "loss")
    assert curve(tmp_path, "val_loss") == []


def test_a_crashed_run_resumes_training_and_validation_bit_for_bit(with_eval, example_shards, tmp_path):
    proc = run_cli(*common(example_shards), "eval.every=5", f"run.dir={tmp_path}",
                   env={"HPCTRAIN_FAULT": "crash:step=7,rank=1"})
    assert "completed at step 12" in proc.stderr
    assert [r["checkpoint_step"] for r in read_jsonl(tmp_path / "interruptions.jsonl")] == [4]
    assert curve(tmp_path, "loss") == curve(with_eval[0], "loss")
    assert curve(tmp_path, "val_loss") == curve(with_eval[0], "val_loss")
