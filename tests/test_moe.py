"""Mixture-of-Experts: the presets' parameter counts against the published ones; the grouped GEMM against
the per-expert loop; the routers against routing written here; Hugging Face round trips through
transformers' MixtralForCausalLM and Qwen3MoeForCausalLM; resume across expert-parallel sizes. (Training
numerics of every MoE layout against transformers: tests/test_layouts.py.)"""
from __future__ import annotations

import json
from dataclasses import replace
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from hpctrain.core import hf_format as hf
from hpctrain.core.compose import compose
from hpctrain.core.flops import param_counts
from hpctrain.core.schema import ModelConfig, MoEConfig
from hpctrain.launch.local import launch
from hpctrain.train.metrics import read_metrics

from helpers import run_cli

import transformers  # noqa: E402 (a dev dependency: the independent reference; a missing one fails)

# Published totals and active parameters, and the unit of their last digit: the cards round or cut
# (Qwen3-30B-A3B's 3.35B active is published as 3.3B), so a count within one unit is the published one.
PUBLISHED = {
    "mixtral_8x7b": (46.7e9, 12.9e9, 0.1e9),  # Mixtral of Experts (Jiang et al. 2024): 46.7B total, 12.9B active
    "qwen3_30b_a3b": (30.5e9, 3.3e9, 0.1e9),  # Qwen3 model card: 30.5B total, 3.3B activated
    "qwen3_235b_a22b": (235e9, 22e9, 1e9),  # Qwen3 model card: 235B total, 22B activated
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    total, active, rounding = PUBLISHED[name]
    c = param_counts(compose(["+experiment=tiny", f"model={name}"]).model)
    assert abs(c["total"] - total) <= rounding and abs(c["active"] - active) <= rounding, (c["total"], c["active"])


@given(st.integers(0, 200), st.integers(0, 9), st.integers(0, 210), st.integers(0, 5))
def test_moe_layer_count_is_the_count_of_moe_layers(n_layers, experts, first_dense, every):
    """The planner's arithmetic count against the per-block rule the model is built from. Mutant caught:
    first_dense counted as a block index instead of a count (one routing block too many or too few)."""
    from hpctrain.core.shape import moe_layer_count, moe_layers

    m = replace(ModelConfig(), n_layers=n_layers, moe=replace(MoEConfig(), experts=experts, first_dense=first_dense,
                                                                every=every))
    assert moe_layer_count(m) == len(moe_layers(m))


def test_deepseek_v3_sized_preset_is_within_half_a_percent_of_the_published_counts():
    # Standard attention in place of MLA (docs/moe.md): 671B total, 37B active in the report.
    c = param_counts(compose(["+experiment=tiny", "model=deepseek_v3"]).model)
    assert abs(c["total"] / 671e9 - 1) < 0.005 and abs(c["active"] / 37e9 - 1) < 0.005, (c["total"], c["active"])


def test_parameter_counts_equal_the_built_model():
    """The arithmetic (the planner's) against the module (every kind of block: dense, MoE, shared)."""
    from hpctrain.models.llama import build_meta, count_params

    m = ModelConfig(n_layers=4, qk_norm=True, head_dim=16,
                    moe=MoEConfig(experts=6, top_k=2, ffn_dim=48, shared_experts=1, first_dense=1, every=1))
    assert param_counts(m)["total"] == count_params(build_meta(m, 32))
    a = param_counts(m)
    # One token uses the router, 2 of 6 routed and the shared expert of each of the 3 MoE blocks.
    assert a["total"] - a["active"] == 3 * 4 * 3 * 128 * 48


# ------------------------------------------------------------------------- the layer, one process

def _moe(**moe) -> "torch.nn.Module":
    from hpctrain.models.moe import MoE

    torch.manual_seed(0)
    layer = MoE(ModelConfig(dim=32, moe=MoEConfig(**{"experts": 4, "top_k": 2, "ffn_dim": 16, **moe})))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    layer.router.bias.zero_()
    return layer


def test_a_capacity_factor_keeps_each_experts_first_slots():
    """The capacity rule written here from the router's own picks: expert e computes its first
    ceil(c x tokens x top_k / experts) slots in token order, a dropped slot adds nothing to its token
    (the residual carries it), and the layer counts the dropped ones. Mutants: one capacity for all the
    slots instead of one per expert; the last slots kept instead of the first; dropped slots computed."""
    import torch.nn.functional as F

    c, tokens, k, experts = 0.75, 40, 2, 4
    layer = _moe(capacity_factor=c, grouped_mm=False).train()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        idx, weight, _, _ = layer.router(x)
        y = layer(x)
    cap = math.ceil(c * tokens * k / experts)
    taken, dropped, want = [0] * experts, 0, torch.zeros_like(x)
    w1, w2, w3 = layer.experts.w1.detach(), layer.experts.w2.detach(), layer.experts.w3.detach()
    for t in range(tokens):
        for j in range(k):
            e = int(idx[t, j])
            if taken[e] == cap:
                dropped += 1
                continue
            taken[e] += 1
            want[t] += weight[t, j] * (F.silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T
    assert 0 < dropped < tokens * k // 2
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert layer.stats.dropped.item() == dropped


@pytest.mark.parametrize("capacity", [0.0, 0.75])
def test_grouped_gemm_equals_the_per_expert_loop(capacity):
    """Forward and every gradient; with a capacity factor some slots are dropped on both paths alike.
    Mutant caught: grouped offsets off by one expert, a transposed weight, capacity applied on one path."""
    x = torch.randn(2, 24, 32)
    out, grads = [], []
    for grouped in (True, False):
        layer = _moe(capacity_factor=capacity, grouped_mm=grouped)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        out.append(y.detach())
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
        if capacity:
            assert layer.stats.dropped > 0
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_unaligned_shapes_fall_back_to_the_loop():
    from hpctrain.models.moe import aligned

    assert not aligned(torch.empty(3, 15)) and aligned(torch.empty(3, 16)) and aligned(torch.empty(3, 8, dtype=torch.bfloat16))
    layer = _moe(ffn_dim=15)  # 60-byte rows: torch._grouped_mm refuses them
    layer(torch.randn(1, 8, 32)).sum().backward()


def test_sigmoid_router_picks_on_score_plus_bias_and_weights_by_score():
    """DeepSeek-V3's routing written here: the bias moves which experts win, never their weights."""
    layer = _moe(router="sigmoid", route_scale=2.5)
    x = torch.randn(40, 32)
    bias = torch.tensor([0.5, -0.5, 0.0, 0.25])
    layer.router.bias.copy_(bias)
    idx, weight, logits, _ = layer.router(x)
    scores = (x @ layer.router.weight.T).sigmoid()
    want = torch.topk(scores + bias, 2).indices
    assert torch.equal(idx, want)
    w = scores.gather(1, want)
    torch.testing.assert_close(weight, 2.5 * w / w.sum(1, keepdim=True))
    assert not torch.equal(want, torch.topk(scores, 2).indices)  # the bias did change some picks


def test_balancing_losses_reach_the_router_gradient_only():
    """The losses change no output, and their gradient is coef x d(loss)/d(router) (here compared with
    autograd of the same loss added to the output's). Mutant caught: _AuxGrad dropping the scale."""
    from hpctrain.models.moe import balance_losses

    x = torch.randn(1, 16, 32)
    plain, aux = _moe(), _moe(aux_loss_coef=0.3, z_loss_coef=0.01)
    aux.aux_scale = 0.5
    torch.testing.assert_close(plain(x), aux(x))
    y = aux(x)
    y.sum().backward()
    ref = _moe()
    y2 = ref(x)
    flat = x.reshape(-1, 32)
    idx, w, logits, probs = ref.router(flat)
    a, z = balance_losses(logits, probs, torch.bincount(idx.flatten(), minlength=4))
    (y2.sum() + 0.5 * (0.3 * a + 0.01 * z)).backward()
    torch.testing.assert_close(aux.router.weight.grad, ref.router.weight.grad)


def test_router_bias_is_checkpointed_state():
    """DeepSeek-V3's balancing bias moves every step outside the gradient: it is in the state dict a
    checkpoint saves (a persistent buffer; persistent=False would restart it at zero on every resume), and
    a meta-device model materialized for any layout starts it at zero."""
    from hpctrain.models.llama import build_meta

    m = ModelConfig(moe=MoEConfig(experts=4, router="sigmoid", bias_update_rate=0.01))
    model = build_meta(m, 16)
    assert {"layers.0.moe.router.bias", "layers.1.moe.router.bias"} <= set(model.state_dict())
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    assert all(float(b.abs().sum()) == 0 for n, b in model.named_buffers() if n.endswith("router.bias"))


def test_router_stats_count_a_recomputed_forward_once():
    """Activation checkpointing reruns the forward in backward; the step's load counts it once."""
    from hpctrain.parallel.activation import checkpointed

    layer = _moe()
    x = torch.randn(1, 16, 32, requires_grad=True)
    checkpointed(layer)(x).sum().backward()
    assert layer.stats.passes == 1 and layer.stats.load.sum().item() == 16 * 2


# ------------------------------------------------------------------------- config checks

@pytest.mark.parametrize("overrides,says", [
    (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 must be between 1 and model.moe.experts=4"),
    (["model.moe.experts=4", "model.moe.every=3"], "no block routes"),
    (["model.moe.experts=3", "parallel.ep=2"], "model.moe.experts=3 is not divisible by parallel.ep=2"),
    (["parallel.ep=2"], "the model has none (model.moe.experts=0)"),
    (["model.moe.experts=4", "parallel.ep=2", "parallel.zero=1"], "Fix: parallel.zero=2 or 3"),
    (["model.moe.experts=4", "parallel.ep=4"], "parallel.ep=4 does not divide parallel.dp_shard=2"),
    (["model.moe.experts=4", "model.moe.capacity_factor=-1"], "model.moe.capacity_factor=-1.0 must be"),
    (["model.moe.experts=4", "model.moe.imbalance=0.5"], "model.moe.imbalance=0.5 must be between 1 (an even split)"),
    (["model.moe.experts=4", "model.moe.top_k=2", "model.moe.imbalance=3"], "and experts / top_k = 2 (one expert"),
    (["model.moe.experts=4", "model.moe.imbalance=nan"], "model.moe.imbalance=nan must be between"),
])
def test_bad_moe_configs_are_refused_on_the_login_node(overrides, says):
    from hpctrain.checks.config_checks import problems

    found = problems(compose(["+experiment=tiny", *overrides]))
    assert any(says in f for f in found), found


def test_export_of_a_model_no_format_holds_is_refused_before_writing():
    m = compose(["+experiment=tiny", "model=deepseek_v3"]).model
    with pytest.raises(hf.HFError, match="moe.shared_experts=1.*--format file"):
        hf.architecture(m)
    assert hf.architecture(compose(["+experiment=tiny", "model=qwen3_30b_a3b"]).model) == "qwen3_moe"
    assert hf.architecture(compose(["+experiment=tiny", "model=mixtral_8x7b"]).model) == "mixtral"


def test_config_json_round_trip_of_both_formats():
    for name in ("mixtral_8x7b", "qwen3_235b_a22b"):
        m = compose(["+experiment=tiny", f"model={name}"]).model
        assert hf.mismatches(m, hf.model_keys(hf.to_config(m, 4096))) == []
        # transformers reads what we write, and what it writes back (its own key names) reads as the same model
        theirs = transformers.AutoConfig.for_model(**hf.to_config(m, 4096))
        assert type(theirs).__name__ == {"mixtral_8x7b": "MixtralConfig", "qwen3_235b_a22b": "Qwen3MoeConfig"}[name]
        assert hf.mismatches(m, hf.model_keys(theirs.to_dict())) == []


def test_the_balancing_loss_reaches_the_model_as_transformers_own(tmp_path):
    """transformers' Qwen3-MoE with one MoE layer and output_router_logits: under model=hf the gradient
    our balancing loss gives the router, and through it the layers below, is the one transformers'
    load_balancing_loss_func gives at router_aux_loss_coef (with one MoE layer pooling changes nothing).
    Mutants: another loss scale or formula; the bias of a sigmoid router or z-loss leaking in."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from hpctrain.checkpoint.hf_weights import load_hf
    from hpctrain.models.llama import Llama

    torch.manual_seed(3)
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                      tie_word_embeddings=False, intermediate_size=192, moe_intermediate_size=64,
                                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
                                      router_aux_loss_coef=0.02, output_router_logits=True)
    theirs = transformers.Qwen3MoeForCausalLM(cfg).train()
    theirs.save_pretrained(tmp_path)
    m = compose(["+experiment=tiny", "model=hf", f"model.init_from={tmp_path}"]).model
    assert m.moe.aux_loss_coef == pytest.approx(0.02) and m.moe.z_loss_coef == 0.0
    ours = Llama(m, 64).train()
    load_hf([ours], tmp_path, m)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    (ours(x) * 0).sum().backward()  # only the balancing loss's gradient: _AuxGrad injects it in backward
    out = theirs(input_ids=x, output_router_logits=True)
    (0.02 * load_balancing_loss_func(out.router_logits, 4, 2) + 0 * out.logits.sum()).backward()
    mine, them = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for a, b in (("layers.1.moe.router.weight", "model.layers.1.mlp.gate.weight"),
                 ("layers.0.attention.wq.weight", "model.layers.0.self_attn.q_proj.weight")):
        assert them[b].grad.abs().max() > 0
        assert torch.allclose(mine[a].grad, them[b].grad, rtol=1e-5, atol=1e-9), (a, mine[a].grad, them[b].grad)


def test_transformers_pooled_coefficient_is_ours_times_the_moe_layers():
    """config.json's router_aux_loss_coef is pooled over the MoE layers and counts only with
    output_router_logits; model=hf takes coef / MoE layers (0 when transformers trains without it) unless
    the command line says otherwise, and the export writes it back. Mutants: the coefficient copied as it
    is (3x too strong here); output_router_logits ignored; config.json overriding the command line; a
    preset refused for an init_from whose coefficient differs."""
    m = compose(["+experiment=tiny", "model=moe_tiny", "model.n_layers=3", "model.moe.aux_loss_coef=0.01"]).model
    c = hf.to_config(m, 64)
    assert c["router_aux_loss_coef"] == pytest.approx(0.03) and c["output_router_logits"] is True
    assert hf.training_keys(c) == {"moe.aux_loss_coef": pytest.approx(0.01)}
    assert hf.training_keys({**c, "output_router_logits": False}) == {"moe.aux_loss_coef": 0.0}
    assert "moe.aux_loss_coef" not in hf.model_keys(c)  # a training choice, not the shape
    assert hf.mismatches(replace(m, moe=replace(m.moe, aux_loss_coef=0.5)), hf.model_keys(c)) == []
    off = hf.to_config(replace(m, moe=replace(m.moe, aux_loss_coef=0.0)), 64)
    assert off["output_router_logits"] is False and off["router_aux_loss_coef"] == 0.0


def test_model_hf_keeps_the_balancing_coefficient_the_command_line_gives(tmp_path):
    m = compose(["+experiment=tiny", "model=moe_tiny", "model.n_layers=3", "model.moe.aux_loss_coef=0.01"]).model
    (tmp_path / hf.CONFIG).write_text(json.dumps(hf.to_config(m, 64)))
    base = ["+experiment=tiny", "model=hf", f"model.init_from={tmp_path}"]
    assert compose(base).model.moe.aux_loss_coef == pytest.approx(0.01)
    assert compose([*base, "model.moe.aux_loss_coef=0.2"]).model.moe.aux_loss_coef == 0.2
    assert compose([*base, "model.moe.aux_loss_coef=0"]).model.moe.aux_loss_coef == 0.0


# ------------------------------------------------------------------------- Hugging Face, multi-rank

def transformers_moe(kind: str, d: Path) -> Path:
    """A MoE model initialised by transformers itself and saved in its published layout."""
    torch.manual_seed(3)
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                  num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=192, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:  # the first block dense (mlp_only_layers), a head width apart from hidden / heads
        cfg = transformers.Qwen3MoeConfig(intermediate_size=192, moe_intermediate_size=64, num_experts=4, head_dim=16,
                                          mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(d)
    return d


@pytest.mark.slow
def test_import_of_a_transformers_moe_starts_where_transformers_is(tmp_path):
    """model=hf from transformers' own Mixtral and Qwen3-MoE checkpoints (per-expert tensors) under expert
    parallel, each rank reading only its experts' slices (one launch for both): the first loss is
    transformers' on the same batch, the second that of transformers + torch's AdamW (balancing loss at
    config.json's coefficient), and the same under FSDP2 without ep (the stacked experts sharded on dim 0).
    Mutant caught: an expert's slice read at another expert's offset, router weights transposed."""
    from reference import reference_run

    dirs = {kind: transformers_moe(kind, tmp_path / kind) for kind in ("mixtral", "qwen3_moe")}
    common = ["+experiment=tiny", "train.global_batch=8", "train.micro_batch=2", "model=hf"]
    # expert parallel (each rank reads its experts' slices), and FSDP2 alone (its shard of the stacked experts)
    layouts = {f"model.init_from={d} parallel.ep={ep}": d for d in dirs.values() for ep in (2, 1)}
    out = tmp_path / "out.json"
    worker = str(Path(__file__).with_name("hf_worker.py"))
    assert launch(tmp_path / "ranks", 2, cmd=[sys.executable, worker, "first_loss", str(out), str(dirs["mixtral"]),
                                              *layouts]) == 0
    got = json.loads(out.read_text())
    wants = {}  # one reference per checkpoint: ep 2 and ep 1 of the same checkpoint share it
    for layout, d in layouts.items():
        cfg = compose([*common, f"model.init_from={d}"])
        # transformers' pooled coefficient over the MoE layers: Mixtral's 2, Qwen3's 1 (mlp_only_layers=[0])
        layers = 2 if "mixtral" in str(d) else 1
        assert cfg.model.moe.experts == 4 and cfg.model.moe.aux_loss_coef == pytest.approx(0.02 / layers)
        if d not in wants:
            wants[d] = reference_run(cfg, 2, init_dir=d)["loss"]
        want = wants[d]
        for step in range(2):
            assert abs(got[layout][step] - want[step]) <= 2e-5 * max(1, want[step]), (layout, got[layout], want)


EP_COMMON = ("+experiment=tiny", "model=moe_tiny", "train.steps=9", "train.global_batch=8", "train.micro_batch=2",
             "optim.warmup_steps=2", "checkpoint.every=3", "checkpoint.keep=3")


@pytest.fixture(scope="module")
def ep2_launch(tmp_path_factory):
    """moe_tiny at ep 2 for 9 steps, checkpoints at 3, 6 and 9: the uninterrupted run the resumes are
    compared with, and the checkpoint the export reads; with what it printed."""
    d = tmp_path_factory.mktemp("ep2") / "run"
    return d, run_cli(*EP_COMMON, "parallel.ep=2", f"run.dir={d}")


@pytest.fixture(scope="module")
def ep2_run(ep2_launch):
    return ep2_launch[0]


def back_to(run: Path, step: int, dst: Path) -> Path:
    """A copy of a finished run as it stood after saving `step`: the later checkpoints and the outcome gone."""
    shutil.copytree(run, dst, symlinks=True)
    for ckpt in (dst / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    (dst / "outcome.json").unlink()
    return dst


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_resume_on_the_same_ep_is_bit_identical_and_on_other_ep_sizes_within_1e_5(tmp_path, ep2_run):
    """ep 2 -> ep 2 from step 3 (bit-identical), ep 2 -> ep 1 (one rank) from step 3, then -> ep 4 from
    step 6 of that run: every loss as the uninterrupted ep 2 run's, the data position carried over.
    Mutant caught: experts resharded in the wrong order, the data position not restored. (The balancing
    bias a resume must restore too: test_router_bias_is_checkpointed_state.)"""
    want = _losses(ep2_run)
    assert len(want) == 9
    rows = read_metrics(ep2_run)
    assert {"moe_aux_loss", "expert_share_min", "expert_share_max", "expert_share"} <= set(rows[-1])
    assert rows[-1]["expert_share_min"] <= 1.0 <= rows[-1]["expert_share_max"] and len(rows[-1]["expert_share"]) == 8

    same = back_to(ep2_run, 3, tmp_path / "same")
    out = run_cli(*EP_COMMON, "parallel.ep=2", f"run.dir={same}").stdout
    assert "resumed from checkpoint step 3" in out
    assert _losses(same) == want

    other = back_to(ep2_run, 3, tmp_path / "other")
    out = run_cli(*EP_COMMON, "parallel.ep=1", "launcher.nproc=1", f"run.dir={other}").stdout
    assert "resumed from checkpoint step 3" in out  # the ep 1 leg resumed too, not started afresh
    other = back_to(other, 6, tmp_path / "other-then")
    out = run_cli(*EP_COMMON, "parallel.ep=4", "launcher.nproc=4", f"run.dir={other}").stdout
    assert "resumed from checkpoint step 6" in out
    got = _losses(other)
    assert len(got) == 9
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (step, a, b)


@pytest.mark.slow
def test_expert_load_in_the_progress_line_and_per_layer_in_the_report(ep2_launch, tmp_path, monkeypatch):
    """Each logged step's progress line shows the least and most loaded expert's share (of any layer);
    metrics.jsonl keeps them per MoE layer too, and router.png draws them per layer against the steps.
    Mutants: the progress line without them; per-layer values not the layer's own (their extremes are not
    the step's); the report's per-layer heat map of other numbers, or not drawn."""
    from hpctrain.report import run_report as R

    d, proc = ep2_launch
    rows = read_metrics(d)
    for r in rows:
        line = next(line for line in proc.stdout.splitlines() if f" step {r['step']}/9 " in line)
        assert f"  expert share {r['expert_share_min']:.2f}-{r['expert_share_max']:.2f}" in line, line
        assert r["moe_layers"] == [0, 1]  # moe_tiny: both blocks route
        lo, hi = r["expert_share_min_by_layer"], r["expert_share_max_by_layer"]
        assert len(lo) == len(hi) == 2 and all(a <= 1.0 <= b for a, b in zip(lo, hi))
        assert min(lo) == pytest.approx(r["expert_share_min"], abs=1e-4)
        assert max(hi) == pytest.approx(r["expert_share_max"], abs=1e-4)
    drawn = []
    monkeypatch.setattr(R, "_save", lambda fig, path: drawn.append(fig) or path.name)
    assert R.plot_router(R.load(d), tmp_path) == "router.png"
    per_layer = {ax.get_title(): ax for ax in drawn[0].axes if ax.get_images() and "layer" in ax.get_ylabel()}
    for what, key in (("most", "expert_share_max_by_layer"), ("least", "expert_share_min_by_layer")):
        image = per_layer[f"the {what} loaded expert of each MoE layer"].get_images()[0].get_array()
        assert image.tolist() == [[r[key][layer] for r in rows] for layer in (0, 1)]  # layers x steps


@pytest.mark.slow
def test_export_of_an_ep_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, ep2_run):
    """--format hf of the ep 2 checkpoint: MixtralForCausalLM loads it with no missing or unexpected key
    and gives the logits of hpctrain's model loaded from the one-file export of the same checkpoint (our
    names, consolidated by DCP: no Hugging Face naming in that path)."""
    from safetensors.torch import load_file

    from hpctrain.checkpoint.__main__ import export
    from hpctrain.core.compose import load
    from hpctrain.models.llama import Llama

    run = ep2_run
    step = run / "checkpoints" / "step-00000009"
    proc = run_cli("export", str(step), str(tmp_path / "hf"), "--format", "hf", module="hpctrain.checkpoint")
    assert "MixtralForCausalLM" in proc.stdout
    theirs, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # The one-file export in this process (the command line's path is the --format hf call above; the
    # one-file command itself: test_checkpoint_resume's export test): one Python start fewer.
    export(step, tmp_path / "ours.safetensors")
    ours = Llama(load(run / "config.yaml").model, 64).eval()
    ours.load_state_dict(load_file(tmp_path / "ours.safetensors"))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = ours(tokens), theirs.eval()(input_ids=tokens).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


@pytest.mark.slow
def test_export_of_a_qwen3_moe_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    """Qwen3-MoE's layout (QK-norm, a dense first block, experts narrower than the dense SwiGLU, the
    mlp.experts.E.gate_proj names): a one-step checkpoint exported as hf loads in Qwen3MoeForCausalLM with
    no missing or unexpected key and gives the logits of our model loaded from the one-file export.
    Mutant: Mixtral's expert names written for a Qwen3 model (missing keys)."""
    from safetensors.torch import load_file

    from hpctrain.checkpoint.__main__ import export
    from hpctrain.checkpoint.hf_weights import export_hf
    from hpctrain.core.compose import load
    from hpctrain.models.llama import Llama

    run = tmp_path / "run"
    run_cli("+experiment=tiny", "model=moe_tiny", "model.qk_norm=true", "model.head_dim=16", "model.moe.ffn_dim=64",
            "model.moe.first_dense=1", "model.n_layers=3", "train.steps=1", "checkpoint.every=1", f"run.dir={run}")
    step = run / "checkpoints" / "step-00000001"
    cfg = load(run / "config.yaml").model
    assert hf.architecture(cfg) == "qwen3_moe"
    export_hf(step, tmp_path / "hf")
    theirs, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert theirs.config.mlp_only_layers == [0] and theirs.config.moe_intermediate_size == 64
    export(step, tmp_path / "ours.safetensors")
    ours = Llama(cfg, 64).eval()
    ours.load_state_dict(load_file(tmp_path / "ours.safetensors"))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = ours(tokens), theirs.eval()(input_ids=tokens).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


# ------------------------------------------------------------------------- the planner

@pytest.mark.parametrize("experiment", ["mixtral_8x7b", "qwen3_235b_a22b"])
def test_published_moe_models_plan_as_feasible_on_h100(experiment):
    """The presets' layouts pass every login-node check and fit an H100's 80 GB with their expert
    parallel split. Mutant caught: routed experts not divided by ep in the memory model (Qwen3-235B's
    experts, 2 bytes x 227 B / 256 ranks under ZeRO-3, would still fit; Mixtral's under ZeRO-2 over 64
    ranks keep 13.5 GiB of bf16 parameters, 8 x that unsplit)."""
    from hpctrain.checks.config_checks import check
    from hpctrain.plan.memory import job_of, memory
    from hpctrain.plan.throughput import throughput

    cfg = compose([f"+experiment={experiment}"])
    check(cfg)
    job = job_of(cfg)
    mem = memory(job)
    assert mem.fits, mem.problems
    t = throughput(job)
    assert t.breakdown["ep_exposed"] > 0 and 0.1 < t.mfu < 0.6
    # Expert parallel keeps 1/ep of the routed experts: the parameters a rank holds (before ZeRO) against
    # the same layout without it.
    from hpctrain.plan.memory import stage_params

    split, whole = stage_params(job, 0), stage_params(job.with_(layout=replace(job.spec.layout, ep=1)), 0)
    assert whole.total - split.total == pytest.approx(whole.experts * (1 - 1 / job.spec.layout.ep))


def test_planner_moe_terms_follow_the_layout():
    """ep moves expert state off a rank and adds all-to-all time; imbalance slows the experts;
    grouped-GEMM efficiency prices the expert GEMMs (each against the same job without the change)."""
    from hpctrain.plan.memory import job_of, memory
    from hpctrain.plan.throughput import throughput

    base = job_of(compose(["+experiment=mixtral_8x7b"]))
    one = base.with_(layout=replace(base.spec.layout, ep=1))
    assert memory(base).device["params"] < memory(one).device["params"]
    assert "ep_exposed" not in throughput(one).breakdown and throughput(base).breakdown["ep_exposed"] > 0
    skewed = base.with_(model=replace(base.model, moe=replace(base.model.moe, imbalance=1.5)))
    assert throughput(skewed).breakdown["compute"] > throughput(base).breakdown["compute"]
    slow = base.with_(cluster=replace(base.cluster, grouped_gemm_efficiency=0.5))
    assert throughput(slow).breakdown["compute"] > throughput(base).breakdown["compute"]
