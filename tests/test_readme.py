"""The README's "Train on your own text" and "Fine-tune" commands, as written there, with fewer steps:
prepare the example corpus, train with validation, export, load in transformers and generate; then
prepare its conversations, fine-tune LoRA adapters on that model, export them in PEFT's format and
generate through transformers + PEFT; then prepare its preference pairs and DPO-tune that model."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def readme_block(section: str) -> str:
    text = (REPO / "README.md").read_text()
    body = text[text.index(f"## {section}\n"):]
    return re.search(r"```bash\n(.*?)```", body, re.S).group(1)


def test_real_text_to_transformers_end_to_end(tmp_path):
    script = readme_block("Train on your own text") + readme_block("Fine-tune") + readme_block("Preference-tune")
    # A quarter of the standard library's text is enough to see the validation loss fall in 40 steps.
    for old, new in [("hpctrain.data.example data/example", "hpctrain.data.example data/example --mb 0.5"),
                     ("data/example", str(tmp_path / "example")), ("outputs/text", str(tmp_path / "text")),
                     ("train.steps=300", "train.steps=40"), ("checkpoint.every=100", "checkpoint.every=40"),
                     ("eval.every=50", "eval.every=10"), ("step-00000300", "step-00000040"),
                     ("outputs/sft", str(tmp_path / "sft")), ("outputs/dpo", str(tmp_path / "dpo")),
                     (f"run.dir={tmp_path / 'sft'}", f"run.dir={tmp_path / 'sft'} train.steps=20 eval.every=10 "
                                                     "eval.batches=2 checkpoint.every=20"), ("step-00000100", "step-00000020")]:
        assert old in script, old  # the README still says what this test runs
        script = script.replace(old, new)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # data.example's "next:" is the README's prepare line (it suggested another validation split).
    prepare = next(line for line in script.splitlines() if "hpctrain.data.prepare" in line)
    assert f"next: {prepare}" in proc.stdout, proc.stdout[:2000]
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "text" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert len(val) == 4 and val[-1] < val[0], val  # the validation loss falls
    generated = proc.stdout.strip().splitlines()
    assert any(line.startswith("Return the number of") for line in generated), proc.stdout[-2000:]
    # Fine-tuning: the loss on the assistant's tokens falls, the adapter is PEFT's, the chat generates.
    sft = [r for r in map(json.loads, (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines())]
    val = [r["val_loss"] for r in sft if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0], val
    assert sorted(p.name for p in (tmp_path / "sft" / "adapter").iterdir()) == [
        ".hpctrain-output.json", "adapter_config.json", "adapter_model.safetensors"]
    assert "<|im_start|>user\nWhat is os.path.join for?<|im_end|>\n<|im_start|>assistant\n" in proc.stdout, \
        proc.stdout[-2000:]
    # Preference tuning: the policy learns to prefer the docstring's answer to the evasive one (from a margin of
    # 0, policy = reference, to a positive one), and the report draws the rewards.
    dpo = [r for r in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert dpo[0]["rewards/margins"] == 0.0 and abs(dpo[0]["loss"] - 0.6931472) < 1e-4, dpo[0]
    last = dpo[-5:]  # (a step's 8 pairs are a noisy sample: the last five steps')
    assert sum(r["rewards/margins"] for r in last) > 0 and sum(r["rewards/accuracies"] for r in last) / 5 > 0.5, last
    assert (tmp_path / "dpo" / "report" / "preference.png").is_file()
    assert sorted(p.name for p in (tmp_path / "text" / "hf").iterdir()) == [
        ".hpctrain-output.json",  # the export's marker: a second export may replace the directory
        "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"]


def sample_lines() -> list[str]:
    """The tiny run's output as docs/training.md shows it."""
    text = (REPO / "docs" / "training.md").read_text()
    body = text[text.index("## What the tiny run does"):]
    return re.search(r"```\n(.*?)```", body, re.S).group(1).splitlines()


def same(shown: str, printed: str) -> bool:
    """A printed line is the one shown, but for this machine's speed, memory and ETA and the run dir."""
    machine = re.compile(r"[\d,.]+ tok/s  mfu [\d.]+%  mem [\d.]+ GiB  eta [\d:]+$")
    if shown.startswith("run dir: "):
        return printed.startswith("run dir: ") and printed.endswith(shown.split("/.../")[1])
    return machine.sub("", shown) == machine.sub("", printed)


def test_the_readme_commands_print_and_do_what_the_docs_say(tmp_path):
    """The README's first run and its "Survive failures" block, as written, in a fresh directory (the hang
    line and the interactive first line are left to tests/test_supervise.py). Mutants: the old sample
    (loss 0.6795 at step 30, "0.000 B parameters"), examples that shared outputs/tiny (the fault did nothing
    on a completed run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```")[0].splitlines()[2]
    assert first == "python -m hpctrain +experiment=tiny"
    proc = subprocess.run(first.split(), cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = (proc.stdout + proc.stderr).splitlines()
    for shown in sample_lines():
        if shown != "...":
            assert any(same(shown, p) for p in printed), f"docs/training.md shows {shown!r}; the run printed:\n" + \
                "\n".join(printed[:40])
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "outputs" / "tiny" / "metrics.jsonl").read_text().splitlines())]
    readme = (REPO / "README.md").read_text()
    assert f"the loss starts at {losses[0]:.2f}" in readme and losses[-1] < 0.01 and "ends below 0.01" in readme
    again = subprocess.run(first.split(), cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert "already completed" in again.stderr and "give a new run.dir" in again.stderr

    block = [line for line in readme_block("Survive failures").splitlines()
             if line.startswith(("HPCTRAIN_FAULT=\"crash", "python -m hpctrain.report.goodput"))]
    assert len(block) == 2
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(block)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "crashed: rank 1" in proc.stderr and "completed at step 60" in proc.stderr
    assert re.search(r"^goodput \d+\.\d%", proc.stdout, re.M) and "crashed" in proc.stdout
