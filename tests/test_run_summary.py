"""What a run says at its ends, without starting ranks (the quick loop): the summary the supervisor prints
and keeps in outcome.json when a run ends, the warning of a run that saves nothing, and the header's
trainable and frozen parameter counts, against PEFT's count of the same model. (The same summary of real
runs: test_validation.py, test_train_dist.py, test_supervise.py.)"""
from __future__ import annotations

import json
import shlex
import socket
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.core.rundir import prepare_run_dir, read_outcome, write_outcome
from hpctrain.launch.local import Ended
from hpctrain.launch.supervise import Supervisor
from hpctrain.report.goodput import measure

# A validation loss that rises after its best: the best and the last differ.
VAL = {2: 3.0, 4: 2.0, 6: 2.5}


class Runner:
    """Ranks that train 6 steps (validation every 2), save step 6 unless `save` is off, and complete."""

    def __init__(self, run_dir: Path, save: bool = True):
        self.run_dir, self.save = run_dir, save

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, attempt, nodes, env, poll) -> Ended:
        rows = [{"step": s, "loss": 5.0 - 0.5 * s, "tokens": 1024 * s, "step_time_s": 0.5, "time": 1000.0 + s,
                 **({"val_loss": VAL[s], "val_ppl": 1.0} if s in VAL else {})} for s in range(1, 7)]
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if self.save:
            step = self.run_dir / "checkpoints" / "step-00000006"
            step.mkdir(parents=True)
            (step / ".metadata").write_bytes(b"")
            (step / "hpctrain.json").write_text("{}")
        write_outcome(self.run_dir, {"status": "completed", "step": 6})
        return Ended(rc=0)

    def probe(self, nodes):
        return []

    def log_tail(self, rank, lines=20):
        return "above", ""


def finished(tmp_path: Path, *overrides: str, save: bool = True) -> Path:
    d = prepare_run_dir(compose(["+experiment=tiny", f"run.dir={tmp_path / 'run'}", *overrides]))
    assert Supervisor(d, Runner(d, save), slurm=False).run() == 0
    return d


def test_a_completed_run_says_what_it_leaves_and_keeps_it_in_outcome_json(tmp_path, capsys):
    """Mutants: the best validation loss taken as the last one; the summary not written into outcome.json;
    the export command naming another checkpoint than the newest."""
    d = finished(tmp_path)
    err = capsys.readouterr().err
    s = read_outcome(d)["summary"]
    g = measure(d)
    assert {k: s[k] for k in ("step", "tokens", "loss", "val_loss", "val_step", "best_val_loss", "best_val_step")} == \
        {"step": 6, "tokens": 6144, "loss": 2.0, "val_loss": 2.5, "val_step": 6, "best_val_loss": 2.0, "best_val_step": 4}
    assert s["goodput"] == g.goodput and s["wall_s"] == g.wall_s  # hpctrain.report.goodput's, not a second count
    ckpt = d / "checkpoints" / "step-00000006"
    assert s["checkpoint"] == str(ckpt)
    assert shlex.split(s["export"]) == ["python", "-m", "hpctrain.checkpoint", "export", str(ckpt), str(d / "hf"),
                                        "--format", "hf"]
    assert f"hpctrain: summary: 6 steps, 6,144 tokens trained in 0:00:" in err and f"goodput {g.goodput:.1%}" in err
    assert "hpctrain:   validation loss 2.5000 at step 6, best 2.0000 at step 4" in err
    assert f"hpctrain:   export it for transformers: {s['export']}" in err


def test_a_run_that_saves_nothing_says_so_and_names_the_key(tmp_path, capsys):
    """checkpoint.final=false with checkpoint.every=0 still runs; the header warns and the summary says no
    checkpoint was written, naming the keys. Mutants: the warning or the reason left out; a run that
    merely ended before its first save blamed on the keys."""
    from hpctrain.__main__ import summary

    off = ["checkpoint.final=false", "checkpoint.every=0"]
    assert "warning: checkpoint.final=false and checkpoint.every=0: this run saves no checkpoint" in \
        summary(compose(["+experiment=tiny", *off]))
    assert "warning" not in summary(compose(["+experiment=tiny"]))
    d = finished(tmp_path, *off, save=False)
    err = capsys.readouterr().err
    s = read_outcome(d)["summary"]
    assert s["checkpoint"] is None and "export" not in s
    assert "saving is off (checkpoint.final=false, checkpoint.every=0)" in s["no_checkpoint"]
    assert "hpctrain:   no checkpoint was written: saving is off (checkpoint.final=false" in err
    d = finished(tmp_path / "default", save=False)
    assert "checkpoint.final" not in read_outcome(d)["summary"]["no_checkpoint"]


LORA_TINY = ["+experiment=tiny", "model.lora.rank=4", "model.lora.alpha=8",
             "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]"]
LORA_70B = ["+experiment=llama3_70b_lora", "model.n_layers=2"]  # the experiment's adapters, 2 of its 80 blocks


def header_counts(cfg) -> tuple[int, int]:
    import re

    from hpctrain.__main__ import summary

    line = next(line for line in summary(cfg).splitlines() if line.startswith("trainable: "))
    trained, frozen = re.fullmatch(r"trainable: ([\d,]+) parameters \(.*\), frozen: ([\d,]+)", line).groups()
    return int(trained.replace(",", "")), int(frozen.replace(",", ""))


@pytest.mark.parametrize("overrides", [["+experiment=tiny"], LORA_TINY, LORA_70B], ids=["full", "lora-tiny", "lora-70b"])
def test_header_counts_trainable_and_frozen_parameters_as_peft_does(tmp_path, overrides):
    """The same shape built by transformers (on the meta device: no memory), with PEFT's adapters on the
    same layers: get_nb_trainable_parameters() gives (trainable, all). Mutants: a LoRA run's trainable
    count as the whole model's; frozen counted as total - adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpctrain.core import hf_format as hf
    from hpctrain.core.shape import HF_LINEAR

    cfg = compose(overrides)
    (tmp_path / "config.json").write_text(json.dumps(hf.to_config(cfg.model, cfg.data.seq_len)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    if cfg.model.lora.rank > 0:
        theirs = {ours: name for name, ours in HF_LINEAR.items()}
        model = get_peft_model(model, LoraConfig(r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha,
                                                 target_modules=[theirs.get(t, t) for t in cfg.model.lora.targets]))
        trained, everything = model.get_nb_trainable_parameters()
    else:
        trained = everything = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert header_counts(cfg) == (trained, everything - trained)
