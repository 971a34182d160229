"""Adapter-only checkpoints (checkpoint.weights=adapters): a LoRA run on a base that transformers wrote
(save_pretrained) saves its adapters, their optimizer state and the small state alone; it resumes bit for
bit with the base re-read from model.init_from, refuses a changed base, exports the same model as a full
checkpoint of the same run, and the planner prices its checkpoints by the adapters. One Trainer run per
kind, in this process (world_of_one), shared by every test."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hpctrain.core.compose import compose

pytestmark = pytest.mark.slow

STEPS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = ["+experiment=tiny", "train.global_batch=4", "train.micro_batch=2", "optim.lr=0.01", "optim.warmup_steps=0",
          "model.lora.rank=4", "model.lora.alpha=8", f"train.steps={STEPS}", "checkpoint.every=2"]


def hf_base(out: Path, seed: int = 0, **save) -> Path:
    """A random tiny Llama of the run's shape, written by transformers (not by hpctrain)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpctrain.core import hf_format as hf

    cfg = compose(COMMON)
    c = hf.to_config(cfg.model, cfg.data.seq_len)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
                     ).save_pretrained(out, **save)
    return out


def trainer(run_dir: Path, base: Path | None, *extra: str):
    from hpctrain.train.loop import Trainer

    init = [f"model.init_from={base}"] if base else []
    cfg = compose([*COMMON, *init, f"run.dir={run_dir}", *extra])
    return Trainer.of(cfg, str(run_dir), torch.device("cpu"))


def adapters_of(t) -> dict:
    return {n: p.detach().clone() for n, p in t.parts[0].named_parameters() if n.endswith(("lora_A", "lora_B"))}


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def runs(world_of_one, tmp_path_factory):
    """The same LoRA run twice, uninterrupted, saving every 2 steps: adapters only (checkpoint.weights=auto
    picks it: LoRA with model.init_from) and every weight (full); and a third stopped after 2 steps."""
    d = tmp_path_factory.mktemp("adapter_ckpt")
    base = hf_base(d / "base")
    out = {"dir": d, "base": base}
    for kind, extra in (("adapters", ()), ("full", ("checkpoint.weights=full",)),
                        ("adapters_bf16", ("train.precision=bf16",)),
                        ("full_bf16", ("checkpoint.weights=full", "train.precision=bf16"))):
        t = trainer(d / kind, base, *extra)
        out[kind] = {"losses": t.fit().losses, "adapters": adapters_of(t), "run": d / kind}
    # stopped after 2 steps, saved by itself (adapters only), then resumed by a new trainer
    first = trainer(d / "stopped", base, "checkpoint.every=0")
    first.resume(lambda *a: None)
    head = [first.train_step()[0].item() for _ in range(2)]
    first.save()
    again = trainer(d / "stopped", base, "checkpoint.every=0")
    out["stopped"] = {"losses": head + again.fit().losses, "resumed_from": again.resumed_from,
                      "adapters": adapters_of(again), "run": d / "stopped"}
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_an_adapter_checkpoint_holds_adapter_sized_bytes(runs):
    """The checkpoint's bytes are the adapters (counted by PEFT on transformers' model) x 4 bytes (fp32) x 3
    (the adapters, Adam's two moments) plus small state; the full checkpoint of the same run holds the base
    too. Mutants: ModelState saving every weight under adapters (the checkpoint is base-sized), auto
    resolving to full under LoRA with model.init_from."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hpctrain.checkpoint.safe import read_metadata

    model = AutoModelForCausalLM.from_pretrained(str(runs["base"]))
    base_params = sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    adapter_params = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    small, full = step_dir(runs["adapters"]["run"], 4), step_dir(runs["full"]["run"], 4)
    info = json.loads((small / "hpctrain.json").read_text())
    assert info["weights"] == "adapters" and info["base"]["init_from"] == str(runs["base"])
    assert json.loads((full / "hpctrain.json").read_text())["weights"] == "full"
    keys = [k for k in read_metadata(small).state_dict_metadata if k.startswith("model.")]
    assert keys and all(k.endswith(("lora_A", "lora_B")) for k in keys)
    tensors = 3 * 4 * adapter_params
    have, whole = dir_bytes(small), dir_bytes(full)
    print(f"adapters: {adapter_params:,} parameters, {tensors:,} bytes of tensors; checkpoint {have:,} bytes; "
          f"full checkpoint {whole:,} bytes; base {base_params:,} parameters")
    assert tensors <= have <= tensors + 160_000  # hpctrain.json, DCP's metadata, the RNG's state
    assert whole >= have + 4 * (base_params - adapter_params)
    assert have < 0.2 * whole


def test_resume_from_adapters_is_bit_exact(runs):
    """Stopped after 2 steps and resumed (the base re-read from model.init_from): every loss and the final
    adapters equal the uninterrupted runs', which equal each other (the kind of checkpoint changes nothing).
    Mutants: the base not re-read (the run trains on hpctrain's own random init), the adapters or their
    moments not restored."""
    a, f, s = runs["adapters"], runs["full"], runs["stopped"]
    assert s["resumed_from"] == 2 and len(a["losses"]) == STEPS
    assert s["losses"] == a["losses"] == f["losses"]
    for n, t in a["adapters"].items():
        assert torch.equal(t, s["adapters"][n]) and torch.equal(t, f["adapters"][n]), n


def copy_run(src: Path, dst: Path, step: int) -> Path:
    """A run directory holding only `step`'s checkpoint of `src`."""
    shutil.copytree(step_dir(src, step), step_dir(dst, step))
    return dst


def test_a_changed_base_is_refused_and_a_moved_one_accepted(runs, tmp_path):
    """The checkpoint's base fingerprint against model.init_from: one tensor changed by 1e-3 is refused
    before anything is trained, with the tensor's name; the same weights elsewhere, re-sharded into two
    files by transformers, are the same base; no model.init_from names the recorded base. Mutants: no
    fingerprint check, a fingerprint of the files' names and sizes (the edit keeps both; the copy changes
    them)."""
    from safetensors.torch import load_file, save_file

    from hpctrain.checkpoint.manager import NoUsableCheckpoint

    changed = tmp_path / "changed"
    shutil.copytree(runs["base"], changed)
    w = load_file(str(changed / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"] += 1e-3
    save_file(w, str(changed / "model.safetensors"), metadata={"format": "pt"})
    run = copy_run(runs["adapters"]["run"], tmp_path / "run", 2)
    with pytest.raises(NoUsableCheckpoint) as e:
        trainer(run, changed).resume(lambda *a: None)
    assert (f"it was trained on the base model {runs['base']}, and model.init_from={changed} is not that model: its "
            "tensor model.layers.1.mlp.down_proj.weight differs") in str(e.value)
    with pytest.raises(NoUsableCheckpoint, match=f"re-read from model.init_from, which this run does not set. Fix: "
                                                 f"model.init_from={runs['base']}"):
        trainer(run, None).resume(lambda *a: None)
    moved = tmp_path / "moved"
    shutil.copytree(runs["base"], moved)
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(str(moved)).save_pretrained(tmp_path / "resharded",
                                                                                  max_shard_size="500KB")
    assert len(list((tmp_path / "resharded").glob("*.safetensors"))) > 1
    t = trainer(run, tmp_path / "resharded")
    t.resume(lambda *a: None)
    assert t.resumed_from == 2


def test_adapters_to_full_goes_on_with_the_base(runs, tmp_path):
    """checkpoint.weights changed between runs: an adapter-only checkpoint resumed by a run saving every weight
    (the base from model.init_from) ends as the uninterrupted run does, and its checkpoints hold every weight.
    Mutant: a full run loading an adapter-only checkpoint as if it held every weight (refused as missing)."""
    from hpctrain.checkpoint.safe import read_metadata

    run = copy_run(runs["adapters"]["run"], tmp_path / "run", 2)
    t = trainer(run, runs["base"], "checkpoint.weights=full")
    rest = t.fit().losses
    assert t.resumed_from == 2 and rest == runs["adapters"]["losses"][2:]
    md = read_metadata(step_dir(run, 4)).state_dict_metadata
    assert "model.layers.0.attention.wq.weight" in md


def export(*args: str):
    from helpers import run_main

    return run_main("hpctrain.checkpoint", "export", *map(str, args))


def test_export_of_adapters_equals_the_full_checkpoints(runs, tmp_path):
    """--format hf and the single file from the adapter-only checkpoint (the base read from the path it
    records, or --base) are the full checkpoint's, tensor for tensor; PEFT loads the --format peft adapter
    onto transformers' base with the merged export's logits. A changed or missing base is refused with the
    fix. Mutants: the base's tensors left out or cast to another dtype, --base ignored, no check of it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    small, full = step_dir(runs["adapters"]["run"], 4), step_dir(runs["full"]["run"], 4)
    exported = {}
    for fmt, name in (("hf", "model.safetensors"), ("file", None)):
        outs = exported[fmt] = {}
        for kind, src in (("adapters", small), ("full", full)):
            out = tmp_path / f"{kind}-{fmt}" / ("model.safetensors" if fmt == "file" else "")
            done = export(src, out, "--format", fmt)
            assert done.returncode == 0, done.stderr
            outs[kind] = load_file(str(out / name if name else out))
        assert outs["adapters"].keys() == outs["full"].keys() and len(outs["full"]) > 10
        for k, v in outs["full"].items():
            assert v.dtype == outs["adapters"][k].dtype and torch.equal(v, outs["adapters"][k]), (fmt, k)
    moved = tmp_path / "elsewhere"
    shutil.copytree(runs["base"], moved)
    done = export(small, tmp_path / "moved-hf", "--format", "hf", "--base", moved)
    assert done.returncode == 0, done.stderr
    moved_hf = load_file(str(tmp_path / "moved-hf" / "model.safetensors"))
    assert all(torch.equal(v, moved_hf[k]) for k, v in exported["hf"]["full"].items())
    other = hf_base(tmp_path / "other", seed=1)
    done = export(small, tmp_path / "bad", "--format", "hf", "--base", other)
    assert done.returncode == 2 and f"{other} is not the base {small} was trained on ({runs['base']}): its " \
                                   "tensor" in done.stderr and "Fix: --base DIR" in done.stderr
    done = export(small, tmp_path / "bad", "--format", "hf", "--base", tmp_path / "nowhere")
    assert done.returncode == 2 and "is not a directory (moved or deleted?). Fix: --base DIR" in done.stderr
    done = export(full, tmp_path / "bad", "--format", "hf", "--base", moved)
    assert done.returncode == 2 and "holds every weight, it reads no base" in done.stderr

    done = export(small, tmp_path / "peft", "--format", "peft")
    assert done.returncode == 0, done.stderr
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(str(runs["base"]), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adapters-hf"), dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, str(tmp_path / "peft"))(input_ids=x).logits
        torch.testing.assert_close(merged(input_ids=x).logits, theirs, rtol=1e-5, atol=1e-5)


def test_adapter_checkpoints_are_refused_where_they_cannot_work(runs, tmp_path):
    """On the login node: adapters without LoRA, adapters without a base; on resume: an adapter-only
    checkpoint in a run without LoRA, a full checkpoint without a base record continued as adapters.
    Mutants: any of those checks removed (the run without a base would save checkpoints it cannot resume)."""
    from hpctrain.checkpoint.manager import NoUsableCheckpoint
    from hpctrain.checks.config_checks import problems

    def said(*overrides: str) -> str:
        return "\n".join(problems(compose(["+experiment=tiny", *overrides])))

    assert ("checkpoint.weights=adapters with model.lora.rank=0: every weight is trained, there are no adapters to "
            "save apart. Fix: checkpoint.weights=auto (or full)") in said("checkpoint.weights=adapters")
    assert ("checkpoint.weights=adapters without model.init_from: the frozen base is this run's random "
            "initialisation") in said("checkpoint.weights=adapters", "model.lora.rank=4")
    assert "checkpoint.weights" not in said("checkpoint.weights=adapters", "model.lora.rank=4",
                                            f"model.init_from={runs['base']}")
    run = copy_run(runs["adapters"]["run"], tmp_path / "run", 2)
    with pytest.raises(NoUsableCheckpoint, match=r"made for a different model: model.layers.0.attention.wq.lora_A is in "
                                                 r"the checkpoint but not in this model"):
        trainer(run, runs["base"], "model.lora.rank=0").resume(lambda *a: None)
    old = copy_run(runs["full"]["run"], tmp_path / "old", 2)
    info = step_dir(old, 2) / "hpctrain.json"
    info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "base"}))
    with pytest.raises(NoUsableCheckpoint, match=r"records no base model .*Fix: checkpoint.weights=full"):
        trainer(old, runs["base"]).resume(lambda *a: None)


def test_the_planner_prices_adapter_checkpoints():
    """Llama 3 70B's LoRA preset with its base (model.init_from): the checkpoint holds the adapters (counted by
    PEFT on transformers' Llama 3 70B, built on the meta device) at 12 bytes each (their fp32 copy and Adam's
    two moments): 2.49 GB, of which the adapters themselves are 0.83 GB, against 144 GB with every weight;
    the save time falls with it. Mutants: the adapters' checkpoint priced as a full one, the optimizer
    state left out of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpctrain.core import hf_format as hf
    from hpctrain.plan import duration
    from hpctrain.plan.memory import job_of
    from hpctrain.plan.verdict import plan

    sizes = {}
    for kind in ("auto", "full"):
        cfg = compose(["+experiment=llama3_70b_lora", "model.init_from=/models/llama-3-70b", f"checkpoint.weights={kind}"])
        d = duration.duration(cfg, plan(job_of(cfg)))
        sizes[kind] = (d.checkpoint_bytes, d.save_s, duration.describe(d))
    c = hf.to_config(cfg.model, cfg.data.seq_len)

    def counted(layers: int) -> tuple[int, int]:  # (base, adapters) of the model cut to `layers` blocks
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")
                                                    and k != "num_hidden_layers"}, num_hidden_layers=layers))
        base = sum(p.numel() for p in model.parameters())
        peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
        return base, sum(p.numel() for p in peft.parameters() if p.requires_grad)

    (b1, a1), (b2, a2) = counted(1), counted(2)  # 80 blocks alike: the rest is the embedding, norm and head
    base, adapters = b1 + (b2 - b1) * (cfg.model.n_layers - 1), a1 + (a2 - a1) * (cfg.model.n_layers - 1)
    print(sizes["auto"][2], sizes["full"][2], f"adapters {adapters:,}, base {base:,}", sep="\n")
    assert sizes["auto"][0] == pytest.approx(12 * adapters, rel=1e-6) and 4 * adapters < 1e9
    assert sizes["full"][0] == pytest.approx(12 * adapters + 2 * base, rel=1e-6)  # the base in bf16
    assert sizes["auto"][1] < sizes["full"][1] / 40
    assert "checkpoint: 2.49 GB a save (the LoRA adapters and their optimizer state" in sizes["auto"][2]


def test_export_of_a_bf16_adapter_checkpoint_keeps_the_base_in_bf16(runs, tmp_path):
    """Under train.precision=bf16 a full LoRA checkpoint holds the frozen base in bf16 (store_frozen_as), the
    adapters in fp32: the export of the adapter-only checkpoint of the same run is the full one's, tensor for
    tensor and dtype for dtype. Mutant: the base typed as the adapters (fp32: twice the bytes, other values)."""
    from safetensors.torch import load_file

    outs = {}
    for kind in ("adapters_bf16", "full_bf16"):
        done = export(step_dir(runs[kind]["run"], 4), tmp_path / kind, "--format", "hf")
        assert done.returncode == 0, done.stderr
        outs[kind] = load_file(str(tmp_path / kind / "model.safetensors"))
    small, full = outs["adapters_bf16"], outs["full_bf16"]
    assert small.keys() == full.keys() and full["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for k, v in full.items():
        assert v.dtype == small[k].dtype and torch.equal(v, small[k]), k
