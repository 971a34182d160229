"""train.precision=fp16: dynamic loss scaling (hpctrain.train.scaler, torch.amp.GradScaler) with fp32 master
weights, on CPU (autocast float16 under DDP and ZeRO-1, float16 parameters gathered by FSDP2).

In this process on one rank: the loss scale's course under injected overflows against torch.amp.GradScaler's
own on a toy model fed the same pattern (the independent reference), each overflow step skipped (weights and
moments unchanged) without counting as train.on_nonfinite's non-finite step, recorded in metrics.jsonl, the
progress line and the run summary; an infinity at a scale below 1 taken for the model's, not the scale's; a
run stopped at a checkpoint and resumed equal to the uninterrupted one (losses and scales, bit for bit);
20 steps tracking fp32 within 1%; the checkpoint's "scaler" entry checked like every other state, and
checkpoints across precisions; bf16 refused on V100 and T4 with the fix.

In one launch of two ranks: 20 steps on DDP, ZeRO-1, FSDP2 (ZeRO-3), TP 2, PP 2, the host optimizer
(offload=cpu and nvme) and expert parallel (MoE) tracking the fp32 run within 1%; and an infinity written
into rank 1's gradient alone (after the reduction, where no collective carries it by itself) under TP 2,
PP 2 and DDP skips that step on both ranks, halves the scale on both, leaves both ranks' weights unchanged,
and a run resumed from a checkpoint in between carries on as the uninterrupted one.

Also the worker of that launch: python tests/test_fp16.py OUT.json STEPS 'job overrides' ...
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

TRACK_TOL = 0.01  # the issue: fp16 tracks fp32 within 1% (every step here)
# The gradient norm too (AdamW's update is blind to a constant factor in the gradients: the loss alone would
# not show gradients left scaled; the norm, which clipping reads, does).
NORM_TOL = 0.05
STEPS = 20
# A loss well above zero for the whole run (the tiny preset's 3e-3 learns the synthetic rule to ~0.02), so
# that 1% of it measures fp16's error.
COMMON = ["+experiment=tiny", "train.global_batch=4", "train.micro_batch=2", "data.seq_len=32", "optim.lr=1e-3",
          "optim.warmup_steps=2", "checkpoint.every=0"]
PP, TP = "parallel.pp=2 parallel.dp_shard=1", "parallel.tp=2 parallel.dp_shard=1"
MOE_EP = "model=moe_tiny parallel.ep=2"
TRACKED = ["parallel.zero=0", "parallel.zero=1", "parallel.zero=3", TP, PP, "parallel.zero=3 offload=cpu",
           "parallel.zero=1 offload=cpu", "parallel.zero=3 offload=nvme offload.direct_io=false offload.path=@tmp",
           MOE_EP]


def reference_of(layout: str) -> str:
    """The fp32 job a layout's fp16 run is compared with: the same model from the same start."""
    return f"fp32:{MOE_EP}" if layout == MOE_EP else "fp32:parallel.zero=0"

# Overflows injected at steps 2 and 7 with growth_interval 3: the scale halves after step 2, doubles after
# the clean steps 3, 4, 5 and halves again after step 7. The resumed run starts from the step-4 checkpoint,
# where GradScaler's count of clean steps is 2: lose it, or the scale, and steps 5-8 differ.
INF_STEPS, INF_AT, SAVED_AT, GROWTH = 8, (2, 7), 4, 3
# Rank 1's infinity, written after the reduction, in a gradient rank 0 does not hold: under TP in the
# replicated attention_norm weight, under PP on the last stage (the global norm carries it to every rank, but
# GradScaler's own found_inf stays rank 1's), and under DDP (whose norm, over gradients already alike, is
# reduced over no rank: only the trainer's all-reduce of the verdict carries it).
INF_LAYOUTS = {TP: "attention_norm", PP: "output", "parallel.zero=0": "output"}
WORKER = str(Path(__file__).resolve())


# ------------------------------------------------------------------ the worker (each rank of a launch)

def _trainer(overrides: list, run: str, world: int, steps: int):
    import torch

    from rank_worker import compose_once
    from hpctrain.train.loop import Trainer

    cfg = compose_once([*COMMON, f"launcher.nproc={world}", f"train.steps={steps}", *overrides], run)
    os.makedirs(run, exist_ok=True)
    return Trainer.of(cfg, run, torch.device("cpu"))


def _local_state(t) -> list:
    """Copies of this rank's parameters and optimizer tensors (its shards)."""
    from torch.distributed.tensor import DTensor

    def local(v):
        return (v.to_local() if isinstance(v, DTensor) else v).detach().clone()

    opt = getattr(t.optimizer, "optim", t.optimizer)
    return [local(p) for p in t.params] + [local(v) for st in opt.state.values() for v in st.values()
                                           if hasattr(v, "detach")]


def _steps(t, n: int, watch: tuple = ()) -> dict:
    """n steps: loss, the scale each ran with, what became of each, and for the steps in `watch` whether
    this rank's weights and optimizer state came out of it unchanged."""
    import torch

    out = {"loss": [], "norm": [], "scale": [], "update": [], "unchanged": {}}
    for _ in range(n):
        before = _local_state(t) if t.step + 1 in watch else None
        loss, norm = t.train_step()
        out["loss"].append(loss.item())
        out["norm"].append(float(norm))
        out["scale"].append(t.step_scale)
        out["update"].append(t.update)
        if before is not None:
            out["unchanged"][t.step] = all(torch.equal(a, b) for a, b in zip(before, _local_state(t)))
    return out


def _one(job: str, d: str, de) -> dict:
    import torch.distributed as dist

    steps = int(sys.argv[2])
    kind, _, layout = job.partition(":")
    over = layout.replace("@tmp", d).split()  # (rank 0's directory: compose_once sends its config)
    if kind in ("fp32", "fp16"):
        got = _steps(_trainer([*over, f"train.precision={kind}"], os.path.join(d, "run"), de.world, steps), steps)
        return {"loss": got["loss"], "norm": got["norm"]}
    # kind "inf": the injected overflows, every rank's view of them, and a resume in between
    os.environ["HPCTRAIN_FAULT"] = ";".join(f"infgrad:step={s},rank=1,param={INF_LAYOUTS[layout]}" for s in INF_AT)
    try:
        fp16 = ["train.precision=fp16", f"train.fp16.growth_interval={GROWTH}"]
        # one directory for both ranks' checkpoint (each rank's `d` is its own)
        run = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])),
                           "inf-" + "".join(c if c.isalnum() else "_" for c in layout))
        t = _trainer([*over, *fp16], run, de.world, INF_STEPS)
        first = _steps(t, SAVED_AT, watch=INF_AT)
        t.save()
        last = _steps(t, INF_STEPS - SAVED_AT, watch=INF_AT)
        mine = {k: first[k] + last[k] for k in ("loss", "scale", "update")}
        mine.update(unchanged={**first["unchanged"], **last["unchanged"]}, skipped=t.progress.skipped,
                    overflows=t.scaler.overflows)
        del t
        t2 = _trainer([*over, *fp16], run, de.world, INF_STEPS)
        t2.resume(lambda *a: None)
        resumed = _steps(t2, INF_STEPS - SAVED_AT)
        mine.update(resumed_from=t2.resumed_from, resumed_loss=resumed["loss"], resumed_scale=resumed["scale"],
                    resumed_overflows=t2.scaler.overflows)
    finally:
        os.environ.pop("HPCTRAIN_FAULT", None)
    every = [None] * de.world
    dist.all_gather_object(every, mine)
    return every


def worker_main() -> None:
    from rank_worker import over_layouts, run_rank_of_layouts

    run_rank_of_layouts(lambda: over_layouts(sys.argv[1], sys.argv[3:], _one))


# ------------------------------------------------------------------ the reference: torch's own GradScaler

def gradscaler_scales(overflow: list[bool], init_scale: float, growth_interval: int) -> list[float]:
    """The scale each step runs with under torch.amp.GradScaler on a one-process toy model, an infinity
    put into its gradient at the steps `overflow` marks."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for bad in overflow:
        scales.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if bad:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scales


def test_the_reference_gradscaler_halves_and_grows():
    """The reference itself: halves after an overflow, doubles after growth_interval clean steps."""
    assert gradscaler_scales([False, True, False, False, False, False], 8.0, 3) == [8, 8, 4, 4, 4, 8]


# ------------------------------------------------------------------ one rank, in this process

BASE = [*COMMON, "launcher.nproc=1"]


def trainer(run_dir: Path, *overrides: str):
    import torch

    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    cfg = compose([*BASE, f"run.dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer.of(cfg, str(run_dir), torch.device("cpu"))


def test_overflows_skip_the_step_halve_the_scale_and_are_recorded(tmp_path, world_of_one, monkeypatch, capsys):
    """Overflows at steps 2, 6 and 7 (growth_interval 3, init_scale 1024) on one rank, under fit(): the scale
    of every step equals torch.amp.GradScaler's fed the same pattern; each overflow step leaves the weights
    and Adam moments as they were, counts as a step (the schedule moves on) but not as a non-finite one
    (progress.skipped stays 0, no `nonfinite` in its row), and metrics.jsonl carries loss_scale on every row,
    `overflow: true` on the overflow rows (written whatever train.log_every says) and the run's count in
    overflow_steps; the progress line shows the scale; the run summary counts them. Mutants: the scale not
    updated (or updated by the local found_inf only, which here is the same: the scale still must follow
    GradScaler's rules: growth every growth_interval clean steps, backoff 0.5); the update applied on an
    overflow; an overflow counted against train.max_skipped_steps (on_nonfinite=stop would end the run);
    loss_scale or overflow missing from the rows; the progress line without the scale."""
    from hpctrain.core.rundir import read_jsonl
    from hpctrain.launch.summary import describe, summarize
    from test_nonfinite import record_before_each_step, same

    at = (2, 6, 7)
    monkeypatch.setenv("HPCTRAIN_FAULT", ";".join(f"infgrad:step={s},rank=0" for s in at))
    run = tmp_path / "run"
    steps = 10
    t = trainer(run, f"train.steps={steps}", "train.precision=fp16", "train.fp16.init_scale=1024",
                "train.fp16.growth_interval=3", "train.log_every=4", "train.on_nonfinite=stop")
    before = record_before_each_step(t)
    out = t.fit()
    assert out.status == "completed" and out.step == steps and t.progress.skipped == 0 and t.scaler.overflows == 3
    for s in at:
        assert same(before[s + 1], before[s]), s  # the overflow step changed nothing
    assert not same(before[4], before[3])  # a clean step trained
    rows = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    assert sorted(rows) == [2, 4, 6, 7, 8, 10]  # log_every=4, and every overflow step
    ref = gradscaler_scales([s in at for s in range(1, steps + 1)], 1024.0, 3)
    assert ref == [1024, 1024, 512, 512, 512, 1024, 512, 256, 256, 256]  # (what the pattern makes)
    assert {s: r["loss_scale"] for s, r in rows.items()} == {s: ref[s - 1] for s in rows}
    assert [s for s, r in rows.items() if r.get("overflow") is True] == list(at)
    assert not any("nonfinite" in r or "skipped_steps" in r for r in rows.values())
    assert [rows[s].get("overflow_steps") for s in sorted(rows)] == [1, 1, 2, 3, 3, 3]
    assert all(math.isfinite(r["loss"]) for r in rows.values()) and not math.isfinite(rows[2]["grad_norm"])
    said = capsys.readouterr().out
    line = said.split("step 6/10")[1].splitlines()[0]
    assert "scale 1024 overflow: no update" in line and "overflows 2" in line, line
    assert "scale 256" in said.split("step 10/10")[1].splitlines()[0]
    s = summarize(run, t.cfg)
    assert s["overflow_steps"] == 3 and s["loss_scale"] == 256
    assert any("3 steps skipped on an fp16 gradient overflow" in line for line in describe(s)), describe(s)


def test_resume_restores_the_scale_bit_for_bit(tmp_path, world_of_one, monkeypatch):
    """Overflows at steps 2 and 7 (growth_interval 3): a run stopped after step 4's checkpoint (an injected
    error at step 5) and started again equals the uninterrupted run in every row's loss and loss_scale, bit
    for bit; the checkpoint holds the scale and GradScaler's count of clean steps. Mutants: the scaler left
    out of the checkpoint (the resumed run restarts at init_scale); its growth tracker not restored (the
    scale doubles two steps late); overflows not restored (overflow_steps restarts)."""
    from hpctrain.core.rundir import read_jsonl

    fp16 = ["train.steps=8", "train.precision=fp16", "train.fp16.growth_interval=3", "checkpoint.every=4",
            "train.log_every=1"]
    inf = ";".join(f"infgrad:step={s},rank=0" for s in (2, 7))
    monkeypatch.setenv("HPCTRAIN_FAULT", inf)
    whole = tmp_path / "whole"
    trainer(whole, *fp16).fit()
    monkeypatch.setenv("HPCTRAIN_FAULT", f"{inf};raise:step=5,rank=0")
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="injected failure at step 5"):
        trainer(cut, *fp16).fit()
    info = json.loads((cut / "checkpoints" / "step-00000004" / "hpctrain.json").read_text())
    assert info["scaler"] == {"scale": 32768.0, "growth_tracker": 2, "overflows": 1}
    monkeypatch.setenv("HPCTRAIN_FAULT", inf)
    t = trainer(cut, *fp16)
    t.fit()
    assert t.resumed_from == 4
    keys = ("step", "loss", "grad_norm", "loss_scale", "overflow", "overflow_steps")
    a, b = ([{k: r.get(k) for k in keys} for r in read_jsonl(d / "metrics.jsonl")] for d in (whole, cut))
    assert [r["loss_scale"] for r in a] == [65536, 65536, 32768, 32768, 32768, 65536, 65536, 32768]
    assert a == b


def assert_tracks(fp32: dict, fp16: dict) -> None:
    """Every step's loss within 1% of fp32's and gradient norm within 5%; not all equal (fp16 did run), and
    the loss falling (it trained)."""
    for what, tol in (("loss", TRACK_TOL), ("norm", NORM_TOL)):
        a, b = fp32[what], fp16[what]
        assert len(a) == len(b) == STEPS and all(abs(x - y) <= tol * x for x, y in zip(a, b)), (what, a, b)
    assert fp32["loss"] != fp16["loss"] and fp32["loss"][-1] < fp32["loss"][0] - 0.5


def test_an_overflow_below_a_scale_of_one_is_a_nonfinite_gradient(tmp_path, world_of_one, monkeypatch):
    """An infinity that halving cannot cure (the scale already below 1: train.fp16.init_scale=0.5 here) is the
    model's, not the scale's: train.on_nonfinite=stop ends the run at that step, its row `nonfinite`, not
    `overflow`. Mutant: every infinite gradient under fp16 taken for an overflow (the scale would halve
    towards zero for ever, every step skipped)."""
    monkeypatch.setenv("HPCTRAIN_FAULT", "infgrad:step=2,rank=0")
    t = trainer(tmp_path / "run", "train.steps=3", "train.precision=fp16", "train.fp16.init_scale=0.5",
                "train.on_nonfinite=stop")
    out = t.fit()
    assert out.status == "nonfinite" and out.nonfinite["step"] == 2 and t.scaler.overflows == 0
    from hpctrain.core.rundir import read_jsonl

    last = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last["nonfinite"] is True and "overflow" not in last and last["loss_scale"] == 0.5


def test_fp16_tracks_fp32_on_one_rank(tmp_path, world_of_one):
    """20 steps of fp16 (autocast float16, fp32 master weights) against fp32 from the same start. Mutants: the
    loss scale left in the reported loss (x65536); the gradients not unscaled (the norm 65536 times fp32's)."""
    def run(prec: str) -> dict:
        t = trainer(tmp_path / prec, f"train.steps={STEPS}", f"train.precision={prec}")
        steps = [t.train_step() for _ in range(STEPS)]
        return {"loss": [loss.item() for loss, _ in steps], "norm": [float(norm) for _, norm in steps]}

    assert_tracks(run("fp32"), run("fp16"))


def test_the_balancing_losses_are_scaled_with_the_loss(tmp_path, world_of_one):
    """An MoE model whose balancing loss dominates the gradient (coefficient 10): its gradient, injected by the
    routers beside the loss's, must carry the loss scale too, or unscaling divides it by 65536 (found in
    review: fp16's gradient norm was the norm without the balancing loss). Mutant: set_aux_scale not given the
    scaler's value."""
    def run(prec: str) -> list:
        # a scale of 256: 65536 x that balancing gradient overflows fp16 at step 2 (a skipped step, rightly)
        t = trainer(tmp_path / prec, "train.steps=2", f"train.precision={prec}", "model=moe_tiny",
                    "model.moe.aux_loss_coef=10", *(["train.fp16.init_scale=256"] if prec == "fp16" else []))
        return [float(t.train_step()[1]) for _ in range(2)]

    fp32, fp16 = run("fp32"), run("fp16")
    assert all(abs(a - b) <= 0.01 * a for a, b in zip(fp32, fp16)), (fp32, fp16)


def test_the_scaler_entry_is_checked_like_every_checkpoint_state():
    """hpctrain.json's "scaler" goes through hpctrain.checkpoint.validate as every plain state does: a
    negative, zero or non-number scale, a key this run's scaler has not is refused with the file and the
    entry named; a good one loads. A checkpoint without the entry (fp32, bf16, an older hpctrain) starts the
    scale afresh. Mutants: no state_problem (a zero scale
    loads and every gradient becomes 0); the scaler's state not JSON-plain."""
    import torch

    from hpctrain.checkpoint.validate import plain_problems
    from hpctrain.train.scaler import LossScaler

    s = LossScaler(torch.device("cpu"), 1024, 5)
    good = json.loads(json.dumps({"scaler": {"scale": 256.0, "growth_tracker": 3, "overflows": 2}}))
    assert plain_problems(Path("ck"), good, {"scaler": s}) is None
    s.load_state_dict(good["scaler"])
    assert (s.value, s.scaler.get_scale(), s.scaler.get_growth_interval(), s.overflows) == (256.0, 256.0, 5, 2)
    assert s.state_dict() == good["scaler"]
    for bad, says in [({"scale": -1.0, "growth_tracker": 0}, "scaler.scale is -1.0"),
                      ({"scale": 0.0, "growth_tracker": 0}, "a loss scale must be above 0"),
                      ({"scale": "big", "growth_tracker": 0}, "not a number"),
                      ({"scale": 2.0, "growth_tracker": 1.5}, "not a whole number"),
                      ({"scale": 2.0}, "holds no 'growth_tracker'"),
                      ({"scale": 2.0, "growth_tracker": 0, "found_inf": 1}, "holds \"found_inf\"")]:
        problem = plain_problems(Path("ck"), {"scaler": bad}, {"scaler": s})
        assert problem and says in problem and "ck/hpctrain.json's scaler" in problem, (bad, problem)
    assert plain_problems(Path("ck"), {}, {"scaler": s}) is None  # written without fp16: a fresh scale


def test_checkpoints_across_precisions(tmp_path, world_of_one):
    """A checkpoint of an fp16 run resumes under fp32 (its scaler entry unread); one written without fp16
    resumes under fp16 with a fresh scale (a bf16 run moved to V100s). Mutant: the entry required of every
    run (the checkpoints of every earlier run would be refused)."""
    run = tmp_path / "run"
    trainer(run, "train.steps=1", "train.precision=fp16", "checkpoint.every=1").fit()
    t = trainer(run, "train.steps=2", "train.precision=fp32", "checkpoint.every=1")
    t.fit()
    assert t.resumed_from == 1 and t.step == 2 and t.scaler is None
    other = tmp_path / "other"
    trainer(other, "train.steps=1", "train.precision=fp32", "checkpoint.every=1").fit()
    t = trainer(other, "train.steps=2", "train.precision=fp16", "train.fp16.init_scale=1024")
    t.fit()
    assert t.resumed_from == 1 and t.step == 2 and t.scaler.value == 1024.0


@pytest.mark.parametrize("cluster", ["v100", "t4"])
def test_bf16_is_refused_on_gpus_without_it_with_the_fix(cluster):
    """The login node refuses bf16 (and fp8) on V100 and T4 presets, naming the key, the GPU and the fix
    train.precision=fp16; fp16 passes there. Mutant: the precision rule's compute-capability test removed."""
    from test_config import assert_mentions, refusal

    from hpctrain.checks.config_checks import check, compose_checked

    over = (f"cluster={cluster}", "launcher.nproc=1")
    assert_mentions(refusal(*over, "train.precision=bf16"), "train.precision=bf16", f"cluster={cluster}",
                    "no bf16", "Fix: train.precision=fp16")
    assert_mentions(refusal(*over, "train.precision=fp8"), "Fix: train.precision=fp16")
    check(*compose_checked(["+experiment=tiny", *over, "train.precision=fp16"]))


# ------------------------------------------------------------------ two ranks, one launch

@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """One launch of two ranks for the jobs of the tests this session runs (-k selects fewer)."""
    from hpctrain.launch.local import launch

    chosen = {(i.originalname, i.callspec.params.get("layout")) for i in request.session.items
              if i.module.__name__ == __name__ and hasattr(i, "callspec")}
    tracked = [l for l in TRACKED if ("test_fp16_tracks_fp32_on_two_ranks", l) in chosen]
    jobs = list(dict.fromkeys(reference_of(l) for l in tracked)) + [f"fp16:{l}" for l in tracked] + [
        f"inf:{l}" for l in INF_LAYOUTS if ("test_an_inf_on_one_rank_skips_the_step_on_every_rank", l) in chosen]
    d = tmp_path_factory.mktemp("fp16")
    rc = launch(d, 2, cmd=[sys.executable, WORKER, str(d / "out.json"), str(STEPS), *jobs])
    assert rc == 0, (d / "logs").as_posix()
    return json.loads((d / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", TRACKED)
def test_fp16_tracks_fp32_on_two_ranks(launched, layout):
    """20 steps of fp16 on each dense layout (FSDP2 with float16 parameters; DDP, ZeRO-1 and TP under
    autocast; the pipeline scaling inside its loss function; the host optimizer of offload=cpu reading the
    unscaled gradients; expert parallel's experts beside the dense weights) against fp32 from the same start.
    Mutants: the pipeline's reported loss left scaled; the gradients not unscaled."""
    assert_tracks(launched[reference_of(layout)], launched[f"fp16:{layout}"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(INF_LAYOUTS))
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(launched, layout):
    """Rank 1's gradient alone gets an infinity at steps 2 and 7 (growth_interval 3): on both ranks those
    steps are overflows (not train.on_nonfinite's skips), both ranks' weights and optimizer state come out
    of them unchanged, and both ranks' scales follow torch.amp.GradScaler's on the same pattern; a run
    resumed from the step-4 checkpoint gives the same losses and scales as the uninterrupted one, bit for
    bit. Mutants: GradScaler's per-rank found_inf deciding the scale (the agreed flag left out: under PP and
    DDP rank 0 keeps its scale; under TP DTensor's dispatcher reduces found_inf over the TP mesh itself); the
    verdict not all-reduced (under DDP, whose norm no collective reduces, rank 0 steps and keeps its scale)."""
    ranks = launched[f"inf:{layout}"]
    ref = gradscaler_scales([s in INF_AT for s in range(1, INF_STEPS + 1)], 65536.0, GROWTH)
    for rank, r in enumerate(ranks):
        assert r["scale"] == ref, (rank, r["scale"], ref)
        assert [i + 1 for i, u in enumerate(r["update"]) if u == "overflow"] == list(INF_AT), (rank, r["update"])
        assert r["unchanged"] == {str(s): True for s in INF_AT}, rank
        assert r["skipped"] == 0 and r["overflows"] == len(INF_AT)
        assert r["resumed_from"] == SAVED_AT and r["resumed_overflows"] == len(INF_AT)
        assert r["resumed_loss"] == r["loss"][SAVED_AT:] and r["resumed_scale"] == r["scale"][SAVED_AT:], rank
    assert ranks[0]["loss"] == ranks[1]["loss"] and all(map(math.isfinite, ranks[0]["loss"]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker_main()
