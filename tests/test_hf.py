"""Hugging Face interop and transformers as the independent reference: logits of hpctrain's Llama equal
transformers' LlamaForCausalLM's on the same weights (tiny, small, GQA, tied embeddings, Llama 3.1 RoPE
scaling); export -> transformers -> the same logits; model.init_from in FSDP2, TP2 and PP2 -> the first
step's loss is transformers' on the same batch; the export of a TP2 x PP2 checkpoint equals the export of
the one-rank checkpoint of the same weights; bad directories are refused with the file and the fix."""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpctrain.core import hf_format as hf
from hpctrain.core.compose import ConfigError, compose
from hpctrain.launch.local import launch
from hpctrain.models.llama import Llama
from hpctrain.checks.config_checks import check

from helpers import run_cli
from reference import hf_dir

import transformers  # noqa: E402 (a dev dependency: the independent reference; a missing one fails)
WORKER = str(Path(__file__).with_name("hf_worker.py"))
LOGIT_TOL = 1e-5  # fp32, relative to the largest logit

SHAPES = {
    "tiny": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=256),
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=8192),
    "gqa": dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300),
    "tied": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=200, tie_embeddings=True),
    # Short original context and a low theta: Llama 3.1's scaling changes every frequency band at these lengths.
    "rope_scaling": dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=100, rope_theta=10000.0,
                         rope_scaling=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                         rope_original_max_seq_len=16),
}


def model_and_hf(shape: dict, tmp: Path, seq: int = 64):
    """hpctrain's Llama with weights that make attention matter (std 1/sqrt(fan in): a uniform attention
    would hide a RoPE or scaling bug), written as a Hugging Face directory through hpctrain's names and
    config.json, and transformers' model loaded from it."""
    from safetensors.torch import save_file

    from hpctrain.core.schema import ModelConfig

    m = ModelConfig(**shape)
    ours = Llama(m, seq)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    sd = {hf.to_hf(n): p.detach().clone() for n, p in ours.named_parameters()}  # tied: one name
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / hf.CONFIG).write_text(json.dumps(hf.to_config(m, seq)))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    return ours.eval(), theirs, m


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_logits_equal_transformers(tmp_path, name):
    ours, theirs, m = model_and_hf(SHAPES[name], tmp_path)
    tokens = torch.randint(0, m.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(tokens), theirs(input_ids=tokens).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= LOGIT_TOL
    if name == "rope_scaling":  # the scaling is exercised: without it the logits are far off
        plain = Llama(dataclasses.replace(m, rope_scaling=0.0), 64).eval()
        plain.load_state_dict(ours.state_dict())
        plain.init_buffers()
        with torch.no_grad():
            assert ((plain(tokens) - b).abs().max() / b.abs().max()).item() > 1e-3


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 3-step run of the tiny model with its step-3 checkpoint, shared by the export tests."""
    run = tmp_path_factory.mktemp("trained") / "run"
    run_cli("+experiment=tiny", "train.steps=3", "checkpoint.every=3", f"run.dir={run}")
    return run


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, trained):
    run = trained
    out = tmp_path / "hf"
    proc = run_cli("export", str(run / "checkpoints" / "step-00000003"), str(out), "--format", "hf",
                   module="hpctrain.checkpoint")
    assert "Hugging Face" in proc.stdout
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    from safetensors.torch import load_file

    from hpctrain.core.compose import load

    cfg = load(run / "config.yaml")
    ours = Llama(cfg.model, 64).eval()
    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(f))
    ours.load_state_dict({n: weights[hf.to_hf(n)] for n, _ in ours.named_parameters()})
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = ours(tokens), theirs.eval()(input_ids=tokens).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= LOGIT_TOL
    assert json.loads((out / hf.INDEX).read_text())["metadata"]["total_size"] == 459392 * 4


@pytest.mark.slow
def test_export_in_bf16_shards(tmp_path, trained):
    from hpctrain.checkpoint.hf_weights import export_hf

    index = export_hf(trained / "checkpoints" / "step-00000003", tmp_path / "hf", "bf16", shard_bytes=200_000)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    have = hf.tensors(tmp_path / "hf")
    assert all(dtype == "BF16" for dtype, _, _ in have.values()) and len(have) == len(hf.expected_shapes(
        compose(["+experiment=tiny"]).model))
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert next(theirs.parameters()).dtype == torch.bfloat16


def first_loss_in_transformers(cfg, d: Path) -> float:
    from hpctrain.data import build_dataset

    theirs = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    data = build_dataset(cfg)
    rows = torch.stack([torch.as_tensor(data[i]) for i in range(cfg.train.global_batch)])
    logits = theirs(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()


LAYOUTS = {2: ["parallel.zero=3", "parallel.tp=2 parallel.dp_shard=1", "parallel.pp=2 parallel.dp_shard=1",
              "parallel.zero=3 offload=cpu"]}


@pytest.mark.slow
def test_init_from_in_every_layout_starts_where_transformers_is(tmp_path):
    from reference import reference_run

    common = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2"]
    d = hf_dir(compose([*common, "train.seed=7"]), tmp_path / "hf")  # not the weights a fresh run would draw
    cfg = compose([*common, "model=hf", f"model.init_from={d}"])
    check(cfg)
    want = first_loss_in_transformers(cfg, d)
    # The second step too (transformers + torch AdamW from the same weights): an optimizer that kept
    # weights of its own from before the import (offload's master copy) would show there.
    second = reference_run(compose([*common, "train.seed=7"]), 2)["loss"][1]
    out = tmp_path / "out.json"
    rc = launch(tmp_path / "ranks", 2, cmd=[sys.executable, WORKER, "first_loss", str(out), str(d), *LAYOUTS[2]])
    assert rc == 0
    got = json.loads(out.read_text())
    for layout in LAYOUTS[2]:
        assert abs(got[layout][0] - want) <= 2e-5 * max(1, want), (layout, got[layout], want)
        assert abs(got[layout][1] - second) <= 2e-5 * max(1, second), (layout, got[layout], second)


@pytest.mark.slow
def test_export_of_a_tp2_pp2_checkpoint_equals_the_one_rank_export(tmp_path):
    from safetensors.torch import load_file

    from hpctrain.checkpoint.hf_weights import export_hf

    out = {}
    for world, layout in ((4, "parallel.tp=2 parallel.pp=2 parallel.dp_shard=1"), (1, "parallel.dp_shard=1")):
        run = tmp_path / f"w{world}"
        rc = launch(tmp_path / f"ranks{world}", world, cmd=[sys.executable, WORKER, "save_init", str(run), layout])
        assert rc == 0
        export_hf(run / "checkpoints" / "step-00000000", tmp_path / f"hf{world}")
        out[world] = load_file(tmp_path / f"hf{world}" / "model.safetensors")
    assert out[4].keys() == out[1].keys()
    assert all(torch.equal(out[4][k], out[1][k]) for k in out[1])


# --- bad directories, refused before any rank starts ---------------------------------------------

def refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        check(compose(["+experiment=tiny", *overrides]))
    return str(e.value)


@pytest.mark.slow
def test_bad_hf_directories(tmp_path):
    cfg = compose(["+experiment=tiny"])
    good = hf_dir(cfg, tmp_path / "good")
    assert "no config.json" in refusal(f"model.init_from={tmp_path}")
    # Another shape: config.json disagrees with the model keys, both values named.
    other = compose(["+experiment=tiny", "model.dim=64", "model.ffn_dim=128"])
    odd = hf_dir(other, tmp_path / "other")
    msg = refusal(f"model.init_from={odd}")
    assert "model.dim=128 but config.json says 64" in msg and "Fix: model=hf" in msg
    # config.json agrees, the tensors do not: the file is named.
    (odd / hf.CONFIG).write_text((good / hf.CONFIG).read_text())
    msg = refusal(f"model.init_from={odd}")
    assert f"{odd / 'model.safetensors'}: model.embed_tokens.weight has shape [256, 64], the model needs [256, 128]" in msg
    # A truncated file.
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / hf.CONFIG).write_text((good / hf.CONFIG).read_text())
    data = (good / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = refusal(f"model.init_from={cut}")
    assert f"{cut / 'model.safetensors'} is truncated" in msg and "download it again" in msg
    (cut / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    assert "is truncated: its header says" in refusal(f"model.init_from={cut}")
    # model=hf takes the shape from config.json and needs the directory.
    assert compose(["+experiment=tiny", "model=hf", f"model.init_from={odd}"]).model.dim == 128
    with pytest.raises(ConfigError, match="model=hf takes the model's shape .* Fix: add model.init_from"):
        compose(["+experiment=tiny", "model=hf"])
    proc = run_cli("+experiment=tiny", f"model.init_from={tmp_path / 'nowhere'}", check=False)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_config_round_trip():
    m = compose(["model=8b"]).model
    keys = hf.model_keys(hf.to_config(m, 8192))
    assert hf.mismatches(m, keys) == []
    assert keys["rope_scaling"] == 8.0 and keys["n_kv_heads"] == 8


def test_hf_format_config_prints_the_model_keys(tmp_path):
    """`python -m hpctrain.core.hf_format config DIR` (model.init_from's help names it) prints the model
    keys of DIR's config.json as overrides, which compose to a model that config.json agrees with; a bad
    DIR is an error, exit 2. (tests/test_docs.py checks that every command the text names exists.)
    Mutants: hf_format without its __main__ block (the command printed nothing and exited 0), a key
    printed in a form the command line reads otherwise (a bool as Python's True)."""
    import subprocess

    other = compose(["+experiment=tiny", "model.dim=64", "model.ffn_dim=96", "model.rope_theta=5e5",
                     "model.tie_embeddings=true"]).model
    (tmp_path / hf.CONFIG).write_text(json.dumps(hf.to_config(other, 64)))
    done = subprocess.run([sys.executable, "-m", "hpctrain.core.hf_format", "config", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert "model.dim=64" in lines and "model.tie_embeddings=true" in lines
    model = compose(["+experiment=tiny", *lines]).model
    assert hf.mismatches(model, hf.model_keys(hf.read_config(tmp_path))) == []
    done = subprocess.run([sys.executable, "-m", "hpctrain.core.hf_format", "config", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not a directory" in done.stderr


def test_a_base_in_the_download_cache_is_confined_to_its_repository_folder(tmp_path):
    """huggingface_hub's cache: snapshots/REV/config.json -> ../../blobs/HASH. Its blobs are the model's
    own files and are copied; a link out of models--ORG--NAME is not. Mutants: confined to the snapshot
    folder (the cache's tokenizer and config left out of every export); no confinement at all."""
    from hpctrain.core.hf_format import inside

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "blobs" / "deadbeef").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/deadbeef")
    (tmp_path / "secret").write_text("key")
    (snap / "tokenizer.json").symlink_to(tmp_path / "secret")
    real, why = inside(snap, "config.json")
    assert (real, why) == (repo / "blobs" / "deadbeef", None)
    real, why = inside(snap, "tokenizer.json")
    assert real is None and "leads outside" in why, why
    # A plain directory named like a snapshot but outside any cache repository stays confined to itself.
    plain = tmp_path / "snapshots" / "x"
    plain.mkdir(parents=True)
    (plain / "config.json").symlink_to("../../secret")
    assert inside(plain, "config.json")[0] is None
    # A --local-dir download of an older huggingface_hub: its large files link into the cache's blobs.
    # Mutant: _cache_blob always False (the Llama 3 tokenizer of such a directory refused).
    local = tmp_path / "Llama-3.1-8B"
    local.mkdir()
    (local / "tokenizer.json").symlink_to(repo / "blobs" / "deadbeef")
    assert inside(local, "tokenizer.json") == (repo / "blobs" / "deadbeef", None)
    (tmp_path / "blobs").mkdir()  # a folder merely named blobs, outside a cache repository
    (tmp_path / "blobs" / "key").write_text("key")
    (local / "secret.json").symlink_to(tmp_path / "blobs" / "key")
    assert inside(local, "secret.json")[0] is None
