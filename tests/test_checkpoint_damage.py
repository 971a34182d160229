"""Damaged checkpoints, full disks and retention, in this process on a world of one rank (fast)."""
from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpctrain.checkpoint import directories as store
from hpctrain.checkpoint.manager import NoUsableCheckpoint, SaveFailed
from hpctrain.core.compose import compose
from hpctrain.train.preempt import Preemption
from hpctrain.train.loop import Trainer

BASE = ("+experiment=tiny", "launcher.nproc=1", "train.global_batch=4", "train.micro_batch=2",
        "data.seq_len=16", "optim.warmup_steps=1")


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trainer(run_dir: Path, *overrides: str) -> Trainer:
    cfg = compose([*BASE, f"run.dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer.of(cfg, str(run_dir), torch.device("cpu"))


@pytest.fixture
def two_checkpoints(tmp_path) -> Path:
    """A run with complete checkpoints at steps 2 and 4."""
    run = tmp_path / "run"
    trainer(run, "train.steps=4", "checkpoint.every=2").fit()
    assert [s for s, _ in store.list_complete(run / "checkpoints")] == [2, 4]
    return run


def resume(run: Path, *overrides: str) -> tuple[Trainer, list[str]]:
    warnings: list[str] = []
    t = trainer(run, "train.steps=6", "checkpoint.every=2", *overrides)
    t.resume(warnings.append)
    return t, warnings


def shard(run: Path, step: int) -> Path:
    """The largest data file of the checkpoint (the first to be truncated by a full disk)."""
    files = (run / "checkpoints" / store.step_name(step)).glob("__*")
    return max(files, key=lambda f: f.stat().st_size)


@pytest.mark.slow
def test_resumes_from_newest(two_checkpoints):
    t, warnings = resume(two_checkpoints)
    assert t.step == 4 and warnings == []
    assert t.sampler.position == 4 * 4  # data position restored


@pytest.mark.slow
def test_truncated_shard_falls_back_with_warning(two_checkpoints):
    f = shard(two_checkpoints, 4)
    os.truncate(f, f.stat().st_size // 2)
    t, warnings = resume(two_checkpoints)
    assert t.step == 2
    assert any("truncated" in w and f.name in w for w in warnings), warnings
    assert any("older checkpoint step-00000002" in w for w in warnings)


@pytest.mark.slow
def test_missing_shard_falls_back_with_warning(two_checkpoints):
    shard(two_checkpoints, 4).unlink()
    t, warnings = resume(two_checkpoints)
    assert t.step == 2 and any("is missing" in w for w in warnings), warnings


@pytest.mark.slow
def test_missing_metadata_is_ignored_with_warning(two_checkpoints):
    (two_checkpoints / "checkpoints" / "step-00000004" / ".metadata").unlink()
    t, warnings = resume(two_checkpoints)
    assert t.step == 2
    assert any("step-00000004" in w and "not a complete checkpoint" in w for w in warnings), warnings


@pytest.mark.slow
def test_other_model_shape_is_refused_with_clear_error(two_checkpoints):
    with pytest.raises(NoUsableCheckpoint) as e:
        resume(two_checkpoints, "model.dim=64")
    msg = str(e.value)
    assert "different model" in msg and "shape" in msg and "Fix:" in msg


@pytest.mark.slow
def test_all_damaged_stops_with_clear_error(two_checkpoints):
    for step in (2, 4):
        shard(two_checkpoints, step).unlink()
    with pytest.raises(NoUsableCheckpoint) as e:
        resume(two_checkpoints)
    assert "step-00000002" in str(e.value) and "step-00000004" in str(e.value)


@pytest.mark.slow
def test_load_step_picks_an_older_one_and_names_bad_steps(two_checkpoints):
    t, _ = resume(two_checkpoints, "checkpoint.load_step=2")
    assert t.step == 2
    with pytest.raises(NoUsableCheckpoint, match=r"load_step=3.*complete steps: 2, 4"):
        resume(two_checkpoints, "checkpoint.load_step=3")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.slow
def test_metadata_pickle_with_foreign_objects_is_not_unpickled(two_checkpoints):
    meta = two_checkpoints / "checkpoints" / "step-00000004" / ".metadata"
    meta.write_bytes(pickle.dumps(_Evil()))
    t, warnings = resume(two_checkpoints)
    assert t.step == 2
    assert any("refusing to unpickle" in w and "system" in w for w in warnings), warnings


@pytest.mark.slow
@pytest.mark.parametrize("record", ["step", "progress"])
def test_a_copied_checkpoint_claiming_another_step_is_skipped(two_checkpoints, record):
    """The review's copy of a checkpoint renamed step-00000009 with "step": 99 in its hpctrain.json:
    the resumed run said "completed at step 99" and trained nothing. Mutant: no check of the records
    against the directory name (t.step becomes 99, or 4 with progress claiming 99)."""
    import json
    import shutil

    root = two_checkpoints / "checkpoints"
    fake = root / store.step_name(9)
    shutil.copytree(root / store.step_name(4), fake)
    info = json.loads((fake / store.INFO).read_text())
    if record == "step":
        info["step"] = 99
    else:
        info["step"], info["progress"]["step"] = 9, 99
    (fake / store.INFO).write_text(json.dumps(info))
    t, warnings = resume(two_checkpoints)
    assert t.step == 4 and t.ckpt.loaded == root / store.step_name(4)
    assert any("step-00000009" in w and "says step 99" in w and "directory name says step 9" in w
               for w in warnings), warnings


@pytest.mark.slow
def test_retention_keeps_the_checkpoint_the_run_resumed_from(two_checkpoints):
    """checkpoint.keep=1 after a resume from step 4: later saves (6, 8) have only been written, never
    loaded, so step 4 stays until a later resume loads a newer one. Mutant: protecting only the
    checkpoint just committed (step 4 deleted at step 6's commit)."""
    t = trainer(two_checkpoints, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=1")
    t.fit()
    names = sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == [store.step_name(4), store.step_name(8)], names
    # The next resume loads step 8, and from then on step 4 is an ordinary old checkpoint.
    t = trainer(two_checkpoints, "train.steps=10", "checkpoint.every=2", "checkpoint.keep=1")
    t.fit()
    names = sorted(p.name for p in (two_checkpoints / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == [store.step_name(8), store.step_name(10)], names


class StopAt(Preemption):
    """A preemption request that arrives during step `step`, as a signal would."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.trainer = step, None

    def agreed(self, device=None, group=None) -> bool:
        self.requested_by = "test" if self.trainer.step == self.step else None
        return super().agreed(device, group)


@pytest.mark.slow
def test_preempted_then_resumed_matches_uninterrupted(tmp_path):
    whole = trainer(tmp_path / "a", "train.steps=6").fit().losses
    t = trainer(tmp_path / "b", "train.steps=6")
    stop = StopAt(3)
    stop.trainer = t
    first = t.fit(stop)
    assert first.status == "preempted" and first.step == 3 and first.checkpoint.endswith("step-00000003")
    rest = trainer(tmp_path / "b", "train.steps=6").fit().losses
    assert first.losses + rest == whole


@pytest.mark.slow
def test_retention_keeps_newest_and_sweeps_temporaries(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step-00000001-dead").mkdir(parents=True)  # a torn save of a crash
    trainer(run, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.keep_every=4").fit()
    # the newest two, and step 4 a milestone (checkpoint.keep_every reaches the manager's retention)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004", "step-00000005", "step-00000006"]


def test_retention_keeps_milestones(tmp_path):
    """checkpoint.keep_every: multiples of it outlive the newest `keep` (mutant: the milestone test
    dropped from doom, or keep_every not passed by the manager, leaves only the newest two)."""
    from hpctrain.checkpoint.directories import doom
    from hpctrain.core.rundir import DCP_METADATA, INFO, step_name

    root = tmp_path / "checkpoints"
    for step in range(1, 8):
        d = root / step_name(step)
        d.mkdir(parents=True)
        (d / DCP_METADATA).write_bytes(b"")
        (d / INFO).write_text("{}")
    doomed = doom(root, keep=2, keep_every=3)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == \
        [step_name(s) for s in (3, 6, 7)]
    assert len(doomed) == 4  # steps 1, 2, 4, 5 renamed out of sight


@pytest.mark.slow
@pytest.mark.parametrize("blocking", [True, False])
def test_later_saves_hold_current_values_and_replaced_tensors(tmp_path, blocking):
    """A save reuses the state dict of the previous one while its tensors are the same objects:
    in-place updates show, and a tensor replaced in the optimizer's state is noticed."""
    run = tmp_path / "run"
    t = trainer(run, "train.steps=4", "checkpoint.every=0")
    t.train_step()
    t.step = 1
    t.save(blocking=blocking)
    t.train_step()  # updates parameters and moments in place
    t.step = 2
    t.save(blocking=blocking)
    p = t.params[0]
    t.optimizer.state[p]["exp_avg"] = torch.full_like(t.optimizer.state[p]["exp_avg"], 7.0)  # replaced
    t.step = 3
    t.save(blocking=blocking)
    t.ckpt.close()
    for step, want_sevens in ((2, False), (3, True)):
        fresh = trainer(run, "train.steps=4", f"checkpoint.load_step={step}")
        fresh.resume(lambda w: None)
        got = fresh.optimizer.state[fresh.params[0]]["exp_avg"]
        assert bool((got.full_tensor() if hasattr(got, "full_tensor") else got).eq(7.0).all()) is want_sevens
        if step == 2:  # the values after the second step, not the first
            for a, b in zip(fresh.params, t.params):
                assert torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                                   b.full_tensor() if hasattr(b, "full_tensor") else b)


@pytest.fixture
def tiny_disk(tmp_path):
    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk-{size}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs to simulate a full disk: {r.stderr.decode()}")
        mounted.append(mnt)
        return mnt

    mounted: list[Path] = []
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)])


def test_disk_full_during_save_fails_cleanly(tiny_disk):
    # One checkpoint of this model is ~5.5 MB: it cannot fit in 2 MB; the write itself fails.
    run = tiny_disk("2m") / "run"
    with pytest.raises(SaveFailed) as e:
        trainer(run, "train.steps=2", "checkpoint.every=2").fit()
    assert "No space left on device" in str(e.value) and "no earlier checkpoint" in str(e.value)
    assert list((run / "checkpoints").iterdir()) == []  # the torn pieces are gone


@pytest.mark.slow
def test_full_disk_refuses_next_save_and_keeps_previous(tiny_disk):
    # 8 MB: the first checkpoint fits, the second (beside the first) cannot.
    run = tiny_disk("8m") / "run"
    t = trainer(run, "train.steps=4", "checkpoint.every=2")
    with pytest.raises(SaveFailed) as e:
        t.fit()
    assert "No space left on device" in str(e.value) and "step-00000002, is intact" in str(e.value)
    assert [s for s, _ in store.list_complete(run / "checkpoints")] == [2]
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())
    again, warnings = resume(run)
    assert again.step == 2 and warnings == []
