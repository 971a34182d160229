"""A step whose loss or gradient norm is not finite (hpctrain.train.loop): its update is never applied;
train.on_nonfinite=stop ends the run there without a final save (outcome.json status nonfinite, the summary
naming the step, the last finite checkpoint kept as the newest), skip skips it up to
train.max_skipped_steps. In this process on a world of one rank (the decisions, weights compared before and
after), and one launch of two ranks where only rank 1's loss goes nan: both must stop."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from hpctrain.core.compose import compose
from hpctrain.core.rundir import list_complete, read_jsonl, read_outcome
from hpctrain.core.schema import OptimConfig
from hpctrain.launch.summary import summarize
from hpctrain.train.loop import Trainer
from hpctrain.train.optim import build_optimizer
from hpctrain.train.progress import Progress, Schedule
from helpers import run_cli
from reference import lr_at

BASE = ("+experiment=tiny", "launcher.nproc=1", "train.global_batch=4", "train.micro_batch=2",
        "data.seq_len=16", "optim.warmup_steps=1")


def trainer(run_dir: Path, *overrides: str) -> Trainer:
    cfg = compose([*BASE, f"run.dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer.of(cfg, str(run_dir), torch.device("cpu"))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state_of(t: Trainer) -> list[torch.Tensor]:
    """Every parameter and every optimizer moment, as copies."""
    moments = [_whole(v) for st in t.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [_whole(p) for p in t.params] + moments


def record_before_each_step(t: Trainer) -> dict[int, list[torch.Tensor]]:
    """step -> the trainer's state just before that step (1-based) ran."""
    before: dict[int, list[torch.Tensor]] = {}
    step = t.train_step

    def recorded():
        before[t.step + 1] = state_of(t)
        return step()

    t.train_step = recorded
    return before


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_diverging_run_stops_at_its_first_nonfinite_norm_with_clipping_off(tmp_path, world_of_one):
    """optim.lr=1e6 (the probe's diverging run) with optim.grad_clip=0: step 2's loss is still finite, its
    gradient norm is not. The run stops there: step 2's update is not applied (the weights and moments are
    those before it), no save follows, the step-1 checkpoint is the newest and outcome.json says so. Before,
    the run went on to "completed" and saved only nan checkpoints. Mutants: the norm not computed when
    clipping is off (the run goes on); the update applied before the check; the final save made anyway."""
    run = tmp_path / "run"
    t = trainer(run, "train.steps=4", "checkpoint.every=1", "optim.lr=1e6", "optim.grad_clip=0")
    before = record_before_each_step(t)
    out = t.fit()
    rows = read_jsonl(run / "metrics.jsonl")
    bad = [r["step"] for r in rows if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]))]
    assert out.status == "nonfinite" and bad == [out.nonfinite["step"]] == [out.step + 1] == [2]
    assert math.isfinite(out.nonfinite["loss"]) and not math.isfinite(out.nonfinite["grad_norm"])
    assert rows[-1]["nonfinite"] is True and not any(r.get("nonfinite") for r in rows[:-1])
    assert same(state_of(t), before[2])  # the stopped step changed nothing
    assert not same(before[2], before[1])  # (step 1 did train)
    assert [s for s, _ in list_complete(run / "checkpoints")] == [1]
    written = read_outcome(run)
    assert written["status"] == "nonfinite" and written["step"] == 1 and written["nonfinite"]["step"] == 2
    assert written["checkpoint"] == str(run / "checkpoints" / "step-00000001")


def test_skip_leaves_the_weights_unchanged_and_stops_past_max_skipped_steps(tmp_path, world_of_one, monkeypatch,
                                                                             capsys):
    """train.on_nonfinite=skip with train.max_skipped_steps=1; the loss of steps 2 and 4 made nan by the fault
    (gradients finite: only the loss tells). Step 2 is skipped: weights and Adam moments equal those before
    it, the step counts and the learning-rate schedule moves on (checked against tests/reference.py's);
    step 3 trains; step 4 is one skip too many and stops the run. Mutants: only the norm checked (step 2
    applied); skipped steps not counted against the limit; the skipped count missing from the progress
    line or the summary."""
    monkeypatch.setenv("HPCTRAIN_FAULT", "nonfinite:step=2,rank=0;nonfinite:step=4,rank=0")
    run = tmp_path / "run"
    t = trainer(run, "train.steps=5", "checkpoint.every=0", "train.on_nonfinite=skip", "train.max_skipped_steps=1")
    before = record_before_each_step(t)
    out = t.fit()
    assert out.status == "nonfinite" and out.nonfinite["step"] == 4 and out.step == 3 and t.progress.skipped == 1
    assert same(before[3], before[2])  # step 2: skipped, nothing changed
    assert not same(before[4], before[3])  # step 3: trained
    assert same(state_of(t), before[4])  # step 4: stopped
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert rows[2]["nonfinite"] is True and math.isnan(rows[2]["loss"]) and rows[2]["skipped_steps"] == 1
    assert "nonfinite" not in rows[3] and rows[3]["skipped_steps"] == 1 and rows[4]["nonfinite"] is True
    o = t.cfg.optim
    assert [rows[s]["lr"] for s in (1, 2, 3)] == pytest.approx([lr_at(s - 1, o, 5) for s in (1, 2, 3)])
    said = capsys.readouterr().out
    assert "step 2: loss nan" in said and "the update is skipped (1 of at most train.max_skipped_steps=1" in said
    assert "step 3/5" in said and "skipped 1" in said.split("step 3/5")[1].splitlines()[0]
    assert list_complete(run / "checkpoints") == []  # no final save after a stop
    s = summarize(run, t.cfg)
    assert s["skipped_steps"] == 1 and s["skipped"] == [2] and s["nonfinite"]["step"] == 4 and s["step"] == 3
    assert "train.max_skipped_steps now 1" in s["nonfinite_fix"]


def test_a_resume_with_a_lower_lr_trains_with_it():
    """The summary's advice (lower optim.lr, run the same command again) resumes at the checkpoint's place in
    the schedule with the config's new peak; before, the checkpoint's saved base rate silently stayed.
    Mutant: Schedule.load_state_dict keeping the loaded base_lrs."""
    def sched(lr: float):
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.zeros(3)
        o = OptimConfig(lr=lr, warmup_steps=2)
        opt, s = build_optimizer([p], o, total_steps=10)
        return o, opt, s

    _, opt, s = sched(1.0)
    for _ in range(4):
        opt.step()
        s.step()
    saved = json.loads(json.dumps(Schedule(s, opt).state_dict()))  # as hpctrain.json holds it
    o, opt2, s2 = sched(0.1)
    Schedule(s2, opt2).load_state_dict(saved)
    assert s2.last_epoch == 4 and opt2.param_groups[0]["lr"] == pytest.approx(lr_at(4, o, 10))
    opt2.step()
    s2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(5, o, 10))


def test_the_skipped_count_is_kept_in_checkpoints():
    """train.max_skipped_steps bounds the whole run, resumes included; checkpoints from before the count
    load as 0. Mutant: `skipped` left out of Progress.state_dict."""
    p = Progress(step=7, tokens_seen=70, skipped=2)
    q = Progress()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q == p
    q.load_state_dict({"step": 3, "tokens_seen": 30})
    assert q == Progress(step=3, tokens_seen=30, skipped=0)


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_stops_every_rank_and_keeps_the_last_finite_checkpoint(tmp_path):
    """Two ranks; rank 1's loss of step 4 is nan, its gradients finite, rank 0's loss finite: the loss,
    averaged before the update, carries it to rank 0, and both stop at step 4 without applying it. No save
    after: checkpoint.every=2 left step 2, and no final save of step 3 follows. outcome.json and the summary
    the supervisor prints name step 4, the newest checkpoint as the last finite one, and what to change.
    (launcher.max_restarts=0: the supervisor restarts a non-finite run as it does a crash.) Mutants: the
    loss reduced after the decision (rank 0 trains on, rank 1 stops: a crash); the final save made."""
    run = tmp_path / "run"
    proc = run_cli("+experiment=tiny", f"run.dir={run}", "train.steps=6", "checkpoint.every=2", "train.global_batch=4",
                   "train.micro_batch=2", "data.seq_len=16", "launcher.max_restarts=0", check=False,
                   env={"HPCTRAIN_FAULT": "nonfinite:step=4,rank=1"})
    out = read_outcome(run)
    assert out is not None and out["status"] == "nonfinite", proc.stderr[-3000:]
    assert proc.returncode != 0
    newest = run / "checkpoints" / "step-00000002"
    assert out["step"] == 3 and out["nonfinite"]["step"] == 4 and out["checkpoint"] == str(newest)
    assert [s for s, _ in list_complete(run / "checkpoints")] == [2]
    s = out["summary"]
    assert s["step"] == 3 and s["checkpoint"] == str(newest) and s["nonfinite"]["step"] == 4
    err = proc.stderr
    assert "hpctrain:   the loss or gradient norm went non-finite at step 4 (loss nan, gradient norm 1." in err
    assert f"hpctrain:   newest checkpoint: {newest}, the last finite one (step 2, before step 4)" in err
    assert "Fix: lower optim.lr (now 0.003), or raise optim.warmup_steps (now 5)" in err
    assert "resumes from step 2" in err
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["nonfinite"] is True
    assert all(math.isfinite(r["loss"]) for r in rows[:3]) and math.isnan(rows[-1]["loss"])
