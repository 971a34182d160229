"""Validation in the loop (eval.every, eval.batches) on the example corpus, through the CLI with 2 ranks:
logged to metrics.jsonl, TensorBoard and the progress line; it never moves the training stream; a run
that crashed and resumed logs the same training and validation losses to the last bit. (That every
layout computes the same validation loss as transformers is in test_layouts.py.)"""
from __future__ import annotations

import json
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


def test_the_run_ends_with_a_summary_of_its_own_records(with_eval):
    """The summary the run prints, and keeps in outcome.json, is metrics.jsonl's (the last record of each
    step), goodput's and the newest checkpoint's. Mutants: the summary left out of outcome.json or not
    printed; tokens, losses or goodput counted anew instead of read from the run's records."""
    from hpctrain.report.goodput import measure

    d, proc = with_eval
    rows = read_jsonl(d / "metrics.jsonl")
    val = [r for r in rows if "val_loss" in r]
    best = min(val, key=lambda r: r["val_loss"])
    s = json.loads((d / "outcome.json").read_text())["summary"]
    g = measure(d)
    assert (s["step"], s["tokens"], s["loss"]) == (12, rows[-1]["tokens"], rows[-1]["loss"])
    assert (s["val_loss"], s["val_step"], s["best_val_loss"], s["best_val_step"]) == \
        (val[-1]["val_loss"], 12, best["val_loss"], best["step"])
    # The same figures as hpctrain.report.goodput's (read, not timed anew): no speed is asserted here.
    assert not g.problems and (s["goodput"], s["wall_s"]) == (g.goodput, g.wall_s)
    assert s["checkpoint"] == str(d / "checkpoints" / "step-00000012")
    said = [line.removeprefix("hpctrain: ") for line in proc.stderr.splitlines()[-6:]]
    assert said[0] == "completed at step 12", proc.stderr[-2000:]
    assert said[1].startswith(f"summary: 12 steps, {rows[-1]['tokens']:,} tokens trained in ")
    assert said[1].endswith(f"goodput {g.goodput:.1%}")
    assert said[2:] == [f"  training loss {rows[-1]['loss']:.4f} at step 12",
                        f"  validation loss {val[-1]['val_loss']:.4f} at step 12, best {best['val_loss']:.4f} "
                        f"at step {best['step']}",
                        f"  newest checkpoint: {s['checkpoint']}", f"  export it for transformers: {s['export']}"]


def test_rank_0_writes_to_its_log_file_what_the_terminal_got(with_eval):
    """logs/rank-0.log holds rank 0's lines as the terminal got them, in their order: its progress and
    events (stdout, after the launcher's plan line) and its log (stderr, every line the supervisor did not
    write). Mutants: rank 0 on the terminal only (no file); only one of its two streams copied."""
    d, proc = with_eval
    out = proc.stdout.splitlines()
    rank0_out = out[next(i for i, line in enumerate(out) if line.startswith("plan: ")) + 1:]
    rank0_err = [line for line in proc.stderr.splitlines() if not line.startswith("hpctrain: ")]
    assert any("val loss" in line for line in rank0_out) and any(line.startswith("[rank 0]") for line in rank0_err)
    log = (d / "logs" / "rank-0.log").read_text().splitlines()
    assert sorted(log) == sorted(rank0_out + rank0_err)
    assert [line for line in log if line in set(rank0_out)] == rank0_out


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
    # rank 0's log file holds both of its starts, the restarted one after the first
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert 0 <= log.index("(launcher local, backend gloo, device cpu, attempt 0)") < \
        log.index("(launcher local, backend gloo, device cpu, attempt 1)")
