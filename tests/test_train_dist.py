"""Multi-rank training on CPU/gloo against the single-process reference, through the real CLI."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.train.metrics import read_metrics

from helpers import run_cli, run_main
from reference import reference_losses

STEPS = 6
# fp32 on CPU: the layouts sum the same numbers in a different order (micro-batches, shards),
# which moves the loss in its 6th-7th significant digit.
TOL = 1e-5

COMMON = ("+experiment=tiny", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
          "optim.warmup_steps=2")


@pytest.fixture(scope="module")
def reference():
    return reference_losses(compose(COMMON), STEPS)


# FSDP2 and DDP at dp 2 through the CLI against the reference: test_checkpoint_resume.py (its
# uninterrupted runs); every layout in-process: test_layouts.py.


@pytest.mark.slow
def test_tiny_experiment_loss_falls(tmp_path):
    proc = run_cli("+experiment=tiny", "train.steps=30", f"run.dir={tmp_path}")
    rows = read_metrics(tmp_path)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert first > 5.0  # ~ln(256) at initialization
    assert last < 0.5 * first, [r["loss"] for r in rows]
    assert "step 30/30" in proc.stdout and "tok/s" in proc.stdout and "eta" in proc.stdout
    # No checkpoint key given: the last step is saved (checkpoint.final), and the command the summary
    # gives exports it for transformers. Mutant: the old default (nothing saved, nothing to export).
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000030"]
    (export,) = [line.split(": ", 2)[2] for line in proc.stderr.splitlines()
                 if line.startswith("hpctrain:   export it for transformers: ")]
    argv = shlex.split(export)
    assert argv[:5] == ["python", "-m", "hpctrain.checkpoint", "export", str(tmp_path / "checkpoints" / "step-00000030")]
    done = run_main("hpctrain.checkpoint", *argv[3:])
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}


@pytest.mark.slow
def test_bf16_mixed_precision_tracks_fp32(tmp_path, reference):
    """bf16 compute with fp32 master weights and fp32 gradient reduction stays near the fp32 run."""
    # Saving off (no final save: it would only cost time here): the run starts all the same, and says so.
    proc = run_cli(*COMMON, "train.precision=bf16", "checkpoint.final=false", f"run.dir={tmp_path}")
    assert "warning: checkpoint.final=false and checkpoint.every=0: this run saves no checkpoint" in proc.stdout
    assert "no checkpoint was written: saving is off (checkpoint.final=false" in proc.stderr
    assert not any((tmp_path / "checkpoints").iterdir())
    got = [r["loss"] for r in read_metrics(tmp_path)]
    ref_loss, _ = reference
    for step, (a, b) in enumerate(zip(got, ref_loss), 1):
        assert abs(a - b) <= 3e-2 * max(1.0, abs(b)), (step, a, b)


@pytest.mark.slow
def test_token_shards_train_with_tensorboard(tmp_path):
    import sysconfig

    shards = tmp_path / "shards"
    src = Path(sysconfig.get_paths()["stdlib"]) / "json"
    run_cli(str(src), str(shards), module="hpctrain.data.prepare")
    run = tmp_path / "run"
    run_cli("+experiment=tiny", "data=shards", f"data.path={shards}", "data.seq_len=32", "train.steps=4",
            "logger=tensorboard", f"run.dir={run}")
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_3d_layout_on_8_local_ranks_is_accepted_from_the_cli():
    """pp 2 x dp_shard 2 x tp 2 on 8 local CPU processes, as a user types it: the planner once refused
    it for host memory, pricing every CPU rank like a GPU rank. Its numbers against the reference, on 8
    ranks of the same local launcher: test_layouts.py (world 8)."""
    proc = run_cli(*COMMON, "launcher.nproc=8", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2",
                   "dry_run=true", check=False)
    assert proc.returncode == 0, proc.stderr
    assert "pp 2 x dp_replicate 1 x dp_shard 2 x tp 2 = 8 ranks" in proc.stdout, proc.stdout
    assert "host per node" in proc.stdout and "Traceback" not in proc.stderr
