"""The Llama model: published parameter counts, shapes, causality, grouped-query attention, init."""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from hpctrain.core.schema import ModelConfig
from hpctrain.models.llama import (Attention, Llama, apply_rope, build_meta, count_params, head_dim,
                                   init_param_)
from hpctrain.core.flops import param_counts

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
MODEL_YAMLS = sorted(p.stem for p in CONF.glob("*.yaml"))


def model_config(name: str) -> ModelConfig:
    """The preset's keys over the schema's defaults (model=hf's shape keys are those defaults)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name}.yaml")))


# Meta AI's published totals for Llama 3 / 3.1 / 3.2.
PUBLISHED = {"8b": 8_030_261_248, "70b": 70_553_706_496, "405b": 405_853_388_800, "1b": 1_235_814_400}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name):
    model = build_meta(model_config(name), 16)
    assert next(model.parameters()).device.type == "meta"
    assert count_params(model) == PUBLISHED[name]


def test_1b_ties_embeddings():
    model = build_meta(model_config("1b"), 16)
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("name", MODEL_YAMLS)
def test_param_count_arithmetic_matches_model(name):
    m = model_config(name)
    model = build_meta(m, 16)
    counts = param_counts(m)
    assert count_params(model) == counts["total"]
    # Every block is dense or routes (model.moe): each kind's count as the arithmetic has it.
    moe_block = counts["moe_block"] + m.moe.experts * counts["expert"]
    for i, block in model.layers.items():
        assert count_params(block) == (moe_block if hasattr(block, "moe") else counts["dense_block"]), i
    if not m.moe.experts:
        assert counts["per_block"] == count_params(model.layers["0"])
    assert counts["embedding"] == model.tok_embeddings.weight.numel()


SEQ = 32


def tiny_args(**kw) -> ModelConfig:
    return ModelConfig(**kw)


def init_model(a: ModelConfig, seed: int = 0) -> Llama:
    torch.manual_seed(1234)  # init_param_ must not depend on the global generator
    model = Llama(a, SEQ)
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        init_param_(name, p, a, gen)
    return model.eval()


def test_forward_shape():
    a = tiny_args()
    model = init_model(a)
    tokens = torch.randint(0, a.vocab_size, (3, 17))
    with torch.no_grad():
        out = model(tokens)
    assert out.shape == (3, 17, a.vocab_size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_causal():
    a = tiny_args()
    model = init_model(a)
    tokens = torch.randint(0, a.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % a.vocab_size
    with torch.no_grad():
        out, out2 = model(tokens), model(changed)
    torch.testing.assert_close(out[:, :10], out2[:, :10], rtol=0, atol=0)
    assert not torch.allclose(out[:, 10:], out2[:, 10:])


def _attention_reference(attn: Attention, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Multi-head attention with each KV head repeated for its group of query heads, written out."""
    b, s, _ = x.shape
    q = apply_rope(attn.wq(x).view(b, s, attn.n_heads, attn.head_dim), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, s, attn.n_kv_heads, attn.head_dim), rope).transpose(1, 2)
    v = attn.wv(x).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    group = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / attn.head_dim ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    return attn.wo(out)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1), (8, 2)])
def test_attention_matches_reference(n_heads, n_kv_heads):
    a = tiny_args(dim=64, n_heads=n_heads, n_kv_heads=n_kv_heads)
    model = init_model(a)
    attn = model.layers["0"].attention
    x = torch.randn(2, 12, a.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = attn(x, model.rope)
        want = _attention_reference(attn, x, model.rope)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_model_runs_and_trains():
    a = tiny_args(n_heads=8, n_kv_heads=2, dim=64)
    model = init_model(a).train()
    assert model.layers["0"].attention.wk.weight.shape == (2 * head_dim(a), a.dim)
    tokens = torch.randint(0, a.vocab_size, (2, 9))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_init_param_deterministic_per_seed():
    a = tiny_args()
    shapes = dict((n, p.shape) for n, p in build_meta(a, SEQ).named_parameters())
    for name, shape in shapes.items():
        t1, t2, t3 = (torch.empty(shape) for _ in range(3))
        init_param_(name, t1, a, torch.Generator().manual_seed(7))
        torch.manual_seed(999)  # the global generator must not matter
        init_param_(name, t2, a, torch.Generator().manual_seed(7))
        init_param_(name, t3, a, torch.Generator().manual_seed(8))
        assert torch.equal(t1, t2), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(t1, t3), name


def test_init_whole_model_reproducible_and_shaped():
    a = tiny_args()
    m1, m2, m3 = init_model(a, seed=0), init_model(a, seed=0), init_model(a, seed=1)
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s1["layers.0.attention.wq.weight"], s3["layers.0.attention.wq.weight"])
    assert torch.equal(s1["layers.0.attention_norm.weight"], torch.ones(a.dim))
    assert torch.equal(s1["norm.weight"], torch.ones(a.dim))
    wq, wo = s1["layers.0.attention.wq.weight"], s1["layers.0.attention.wo.weight"]
    assert wq.std().item() == pytest.approx(a.init_std, rel=0.2)
    assert wo.std().item() < wq.std().item()  # residual outputs scaled down with depth
    assert "rope" not in s1  # derived from the config, never checkpointed
