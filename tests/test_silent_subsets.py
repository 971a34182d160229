"""No silent subsets: what a model directory or an adapter holds that hpctrain would not use is refused,
naming the file, the key or tensors and the fix, before anything is loaded (hpctrain issue 43).

PEFT and transformers are the independent references: the adapters are PEFT's own (get_peft_model on a
tiny transformers Llama, save_pretrained), the config.json files transformers' own (save_pretrained of
its config classes), and the values a config.json leaves out are transformers' defaults. Each test names
the mutant of the checking code it catches.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from hpctrain.core import hf_format as hf
from hpctrain.core.adapters import AdapterError, adapter_shapes, read_adapter_config
from hpctrain.core.schema import LoRAConfig, ModelConfig

ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
HF_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = dict(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=64)


def model(targets=ALL, rank=2, alpha=4.0, **over) -> ModelConfig:
    return ModelConfig(**{**SHAPE, **over}, lora=LoRAConfig(rank=rank, alpha=alpha, targets=list(targets)))


def refused(d: Path, m: ModelConfig, with_model: bool = True) -> str:
    with pytest.raises(AdapterError) as e:
        read_adapter_config(d, m.lora, m if with_model else None)
    return str(e.value)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """make(name, **LoraConfig options): a PEFT adapter of rank 2, alpha 4, all seven linears (unless
    target_modules says otherwise) on a tiny transformers Llama of SHAPE, saved by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("adapters")

    def make(name: str, **options) -> Path:
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=64, head_dim=8))
        options = {"r": 2, "lora_alpha": 4, "target_modules": HF_ALL, **options}
        get_peft_model(base, LoraConfig(**options)).save_pretrained(root / name)
        return root / name

    return make


def edit_config(d: Path, **keys) -> Path:
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **keys}))
    return d


# --- adapter_config.json options ----------------------------------------------------------------

@pytest.mark.slow
def test_a_plain_peft_adapter_is_every_adapter_of_the_model(adapters):
    """PEFT's saved tensors are exactly adapter_shapes (names and shapes), so it is accepted with the
    tensor check. Mutants: lora_A / lora_B shapes swapped, a layer's adapters left out of adapter_shapes,
    an option of PEFT's plain config (inference_mode, megatron_core, loftq_config {}) refused."""
    from safetensors import safe_open

    d = adapters("plain")
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert adapter_shapes(model()) == theirs and len(theirs) == 28
    read_adapter_config(d, model().lora, model())


# option -> (LoraConfig options, what the refusal must name). Mutant of each: its key moved from OFF to
# NO_EFFECT (accepted with any value), or the whole check of adapter_config.json's keys removed.
OPTIONS = {
    "alpha_pattern": (dict(alpha_pattern={"q_proj": 16}), 'alpha_pattern={"q_proj": 16}'),
    "rank_pattern": (dict(rank_pattern={"q_proj": 4}), 'rank_pattern={"q_proj": 4}'),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), 'modules_to_save=["lm_head"]'),
    "bias": (dict(bias="lora_only"), 'bias="lora_only"'),
    "lora_bias": (dict(lora_bias=True), "lora_bias=true"),
    "trainable_token_indices": (dict(trainable_token_indices=[1, 2]), "trainable_token_indices=[1, 2]"),
    "use_dora": (dict(use_dora=True), "use_dora=true"),
    "use_rslora": (dict(use_rslora=True), "use_rslora=true"),
    "layers_to_transform": (dict(layers_to_transform=[0], layers_pattern="layers"), "layers_to_transform=[0]"),
    "exclude_modules": (dict(exclude_modules=["model.layers.1.self_attn.q_proj"]), "exclude_modules="),
    "pissa": (dict(init_lora_weights="pissa"), 'init_lora_weights="pissa"'),
}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_peft_options_hpctrain_does_not_implement_are_refused_by_key(adapters, option):
    options, named = OPTIONS[option]
    msg = refused(adapters(option, **options), model(), with_model=False)  # the login node's call
    assert named in msg and "hpctrain does not implement" in msg and "Fix: an adapter trained as plain LoRA" in msg


@pytest.mark.slow
def test_the_login_node_refuses_an_adapter_option(adapters):
    """config_checks calls read_adapter_config on model.lora.init_from. Mutant: the OFF check removed."""
    from hpctrain.checks.config_checks import problems
    from hpctrain.core.compose import compose

    d = adapters("login", modules_to_save=["lm_head"])
    said = "\n".join(problems(compose(["+experiment=tiny", "model.lora.rank=2", "model.lora.alpha=4",
                                       f"model.lora.init_from={d}"])))
    assert 'modules_to_save=["lm_head"]' in said and "adapter_config.json" in said


def test_an_unknown_option_is_accepted_only_unset(tmp_path):
    """A key of a newer PEFT: unset (null, false, {}) passes, set is refused by name. Mutant: unknown
    keys accepted whatever their value (only OFF's checked)."""
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"")
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                       "target_modules": HF_ALL, "new_option": None, "other": {}}))
    read_adapter_config(d, model().lora)
    edit_config(d, new_option={"on": True})
    assert 'new_option={"on": true} (an option hpctrain does not know)' in refused(d, model(), with_model=False)


@pytest.mark.parametrize("key, value, named", [
    ("lora_alpha", "abc", 'lora_alpha="abc"'), ("lora_alpha", [4], "lora_alpha=[4]"),
    ("lora_alpha", "4", 'lora_alpha="4"'), ("lora_alpha", None, "lora_alpha=null"),
    ("lora_alpha", True, "lora_alpha=true"), ("r", "2", 'r="2"'), ("r", 2.5, "r=2.5"), ("r", 0, "r=0"),
    ("target_modules", ".*q_proj", 'target_modules=".*q_proj"'), ("target_modules", [1], "target_modules=[1]"),
])
def test_adapter_config_values_of_the_wrong_kind_are_refused_not_a_traceback(tmp_path, key, value, named):
    """Mutant: the kind checks of r and lora_alpha removed (float("abc") raises ValueError, float([4])
    TypeError: a traceback on the login node; "4" and true pass as 4.0 and 1.0); target_modules' list
    check removed (a regular expression read as its characters)."""
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"")
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                       "target_modules": HF_ALL, key: value}))
    msg = refused(d, model(), with_model=False)
    assert named in msg and "Fix:" in msg


# --- adapter tensors: none dropped, none missing ---------------------------------------------------

@pytest.mark.slow
def test_seven_target_modules_into_one_target_are_refused(adapters):
    """The probe's case: 24 of 28 tensors would be dropped. On the login node target_modules is compared
    with model.lora.targets; where adapter_config.json understates them, the tensors themselves are
    (with the model: the ranks' check, and the login node's where config_checks passes the model).
    Mutants: _target_problems removed; the unused-tensor check of tensor_problems removed."""
    d = adapters("seven")
    msg = refused(d, model(["wq"]), with_model=False)
    assert "target_modules gives adapters to q_proj, k_proj" in msg and \
           "Fix: model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj,up_proj]" in msg
    edit_config(d, target_modules=["q_proj"])  # a config.json that lies about its tensors
    msg = refused(d, model(["wq"]))
    assert "holds 24 tensors this run's model has no adapter for" in msg and "(24 in all)" in msg
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in msg
    assert "Fix: model.lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj,up_proj]" in msg


@pytest.mark.slow
def test_tensors_the_model_needs_but_the_adapter_lacks_are_refused(adapters):
    """target_modules as full paths of layer 0 only (PEFT adapts what it names): layer 1's 14 adapters
    would keep their initial values. Mutant: the missing-tensor check removed."""
    d = adapters("layer0", target_modules=[f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
                                           for p in HF_ALL])
    read_adapter_config(d, model().lora)  # the layers are not the config's to say: the tensors are
    msg = refused(d, model())
    assert "lacks 14 of the model's 28 adapter tensors" in msg
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in msg


@pytest.mark.slow
def test_another_rank_is_refused_by_shape(adapters):
    """adapter_config.json claims the run's rank; the tensors are rank 4. Mutant: the shape check removed."""
    d = edit_config(adapters("rank4", r=4), r=2)
    msg = refused(d, model())
    assert "self_attn.q_proj.lora_A.weight is F32 [4, 16], the model's [2, 16]" in msg


@pytest.mark.slow
def test_the_ranks_load_nothing_from_an_adapter_with_unused_tensors(adapters):
    """load_peft (every rank) checks the whole file before copying: a plain adapter fills all 28
    adapters with PEFT's values; one whose config understates its targets fills none. Mutant: load_peft
    reading the config without the model (the tensor check skipped): 4 of 28 filled, 24 dropped."""
    import torch
    from safetensors.torch import load_file

    from hpctrain.checkpoint.peft_format import load_peft, peft_name
    from hpctrain.models.llama import Llama
    from hpctrain.models.lora import apply_lora

    def fresh(m):
        net = Llama(m, 32)
        apply_lora(net, 2, 4.0, 0.0, tuple(m.lora.targets))
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.fill_(0.5)
        return net

    d = adapters("ranks")
    net = fresh(model())
    assert load_peft([net], d, model()) == 28
    theirs = load_file(str(d / "adapter_model.safetensors"))
    for n, p in net.named_parameters():
        if n.endswith(("lora_A", "lora_B")):
            assert torch.equal(p.detach(), theirs[peft_name(n, "llama")]), n
    edit_config(d, target_modules=["q_proj"])
    one = model(["wq"])
    net = fresh(one)
    with pytest.raises(AdapterError, match="holds 24 tensors"):
        load_peft([net], d, one)
    assert all(bool((p == 0.5).all()) for p in net.parameters())  # nothing copied


# --- files that are not regular files ----------------------------------------------------------------

def _feed_fifo(path: Path, text: str) -> threading.Thread:
    """A writer for the FIFO, so that a reader that waits for one gets `text` instead of hanging."""
    def write():
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:  # the reader refused the FIFO and is gone
            pass
    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def _release(path: Path, t: threading.Thread) -> None:
    try:  # a reader that comes and goes lets a writer still waiting in open() finish
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass
    t.join(5)


def test_a_fifo_as_adapter_config_is_refused_not_waited_on(tmp_path):
    """Mutant: adapter_config.json read with read_text (it waited on the FIFO for a writer; here the
    writer gives "{}", so the mutant says r is missing instead of naming the FIFO)."""
    d = tmp_path / "a"
    d.mkdir()
    os.mkfifo(d / "adapter_config.json")
    (d / "adapter_model.safetensors").write_bytes(b"")
    t = _feed_fifo(d / "adapter_config.json", "{}")
    try:
        msg = refused(d, model(), with_model=False)
    finally:
        _release(d / "adapter_config.json", t)
    assert "adapter_config.json is not a regular file (a FIFO)" in msg


def test_a_device_as_adapter_config_and_a_fifo_as_its_weights_are_named(tmp_path):
    """/dev/zero as adapter_config.json (endless) and a FIFO as adapter_model.safetensors (is_file() is
    false: it was called missing). Mutants: read_text for the config (reads /dev/zero forever); the
    weights' regular-file check folded into "is missing"."""
    d = tmp_path / "a"
    d.mkdir()
    os.symlink("/dev/zero", d / "adapter_config.json")
    assert "adapter_config.json is not a regular file (a character device)" in refused(d, model(), False)
    os.remove(d / "adapter_config.json")
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": HF_ALL}))
    os.mkfifo(d / "adapter_model.safetensors")
    assert "adapter_model.safetensors is not a regular file (a FIFO)" in refused(d, model(), False)


def test_a_fifo_or_device_as_config_json_is_named_as_such(tmp_path):
    """read_config said such a directory had no config.json. Mutant: read_config's is_file() test back."""
    for kind, make in (("a FIFO", os.mkfifo), ("a character device", lambda p: os.symlink("/dev/zero", p))):
        d = tmp_path / kind.replace(" ", "_")
        d.mkdir()
        make(d / hf.CONFIG)
        with pytest.raises(hf.HFError, match=f"config.json is not a regular file \\({kind}\\)"):
            hf.read_config(d)


def test_tokenizer_files_linked_outside_the_base_are_not_exported(tmp_path):
    """model.init_from's tokenizer files as symlinks to a secret: left out of the export, with a note
    (already so before issue 43). Mutant: _copy_inside copying directory/name as found (shutil follows
    the link; _copy_tokenizer's own test of tokenizer.json alone leaves tokenizer_config.json to it)."""
    from hpctrain.checkpoint.hf_weights import _copy_tokenizer

    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    (tmp_path / "secret").write_text("password")
    os.symlink(tmp_path / "secret", base / "tokenizer.json")
    notes: list = []
    assert _copy_tokenizer({"model": {"init_from": str(base)}, "data": {}}, out, notes) == {}
    assert list(out.iterdir()) == [] and "tokenizer.json leads outside" in notes[0]
    os.remove(base / "tokenizer.json")
    (base / "tokenizer.json").write_text("{}")  # its own, inside: copied; its config a link out: not
    os.symlink(tmp_path / "secret", base / "tokenizer_config.json")
    _copy_tokenizer({"model": {"init_from": str(base)}, "data": {}}, out, notes)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]
    assert any("tokenizer_config.json leads outside" in n for n in notes)


# --- config.json: options hpctrain does not implement ----------------------------------------------

TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64)


def saved(tmp_path: Path, cls: str, **options) -> Path:
    """transformers' config class `cls` of TINY sizes with `options`, saved by transformers."""
    import transformers

    d = tmp_path / f"{cls}-{len(list(tmp_path.iterdir()))}"
    getattr(transformers, cls)(**TINY, **options).save_pretrained(d)
    return d


@pytest.mark.parametrize("cls", ["LlamaConfig", "Qwen3Config", "MixtralConfig", "Qwen3MoeConfig"])
def test_transformers_own_config_json_reads_as_transformers_builds_it(tmp_path, cls):
    """The plain config of each architecture passes (the checks are not stricter than what
    transformers writes), and its values are transformers' own. Mutant: a FEATURES test that refuses
    the value transformers writes for an option that is off (sliding_window: null, layer_types)."""
    import transformers

    d = saved(tmp_path, cls, **({"num_local_experts": 4} if "Mo" in cls or "Mixtral" in cls else {}))
    keys = hf.model_keys(hf.read_config(d))
    theirs = getattr(transformers, cls).from_pretrained(d)
    assert keys["norm_eps"] == theirs.rms_norm_eps and keys["rope_theta"] == theirs.rope_parameters["rope_theta"]


# transformers config class, options -> what the refusal names. Mutant of each: its FEATURES row removed
# (or, for RoPE, _unsupported's rope_type test): the option was read as if absent.
FEATURE_CASES = {
    "llama-attention-bias": ("LlamaConfig", dict(attention_bias=True), "attention_bias=true"),
    "llama-mlp-bias": ("LlamaConfig", dict(mlp_bias=True), "mlp_bias=true"),
    "llama-gelu": ("LlamaConfig", dict(hidden_act="gelu"), 'hidden_act="gelu"'),
    "llama-attention-dropout": ("LlamaConfig", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    "llama-yarn": ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 16}),
                   'rope_parameters.rope_type="yarn"'),
    "llama-partial-rotary": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 0.5}),
                             "rope_parameters.partial_rotary_factor=0.5"),
    "qwen3-attention-bias": ("Qwen3Config", dict(attention_bias=True, head_dim=8), "attention_bias=true"),
    "qwen3-sliding": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=8),
                      "use_sliding_window=true"),
    "mixtral-sliding": ("MixtralConfig", dict(sliding_window=8, num_local_experts=4), "sliding_window=8"),
    "mixtral-jitter": ("MixtralConfig", dict(router_jitter_noise=0.1, num_local_experts=4), "router_jitter_noise=0.1"),
    "qwen3-moe-sliding": ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=8, num_experts=4,
                                                 head_dim=8), "use_sliding_window=true"),
}


@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_config_json_options_hpctrain_does_not_implement_are_refused(tmp_path, case):
    cls, options, named = FEATURE_CASES[case]
    d = saved(tmp_path, cls, **options)
    with pytest.raises(hf.HFError) as e:
        hf.read_config(d)
    msg = str(e.value)
    assert named in msg and "hpctrain implements" in msg and str(d / hf.CONFIG) in msg and "Fix:" in msg


def test_a_qwen3_window_that_no_layer_uses_is_accepted(tmp_path):
    """use_sliding_window with max_window_layers at the layer count: transformers makes every layer full
    attention. Mutant: use_sliding_window refused whatever max_window_layers says."""
    import transformers

    d = saved(tmp_path, "Qwen3Config", use_sliding_window=True, sliding_window=8, max_window_layers=2, head_dim=8)
    assert set(transformers.Qwen3Config.from_pretrained(d).layer_types) == {"full_attention"}
    hf.read_config(d)


def test_a_rope_theta_said_twice_differently_is_refused(tmp_path):
    """transformers 5 takes rope_parameters' rope_theta, earlier versions the top-level one; hpctrain took
    the top-level one. Mutant: the agreement check removed (rope_theta 10000 read, transformers 500000)."""
    import transformers

    d = tmp_path / "m"
    d.mkdir()
    cfg = {"model_type": "llama", **TINY, "rope_theta": 10000.0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    (d / hf.CONFIG).write_text(json.dumps(cfg))
    assert transformers.AutoConfig.from_pretrained(d).rope_parameters["rope_theta"] == 500000.0
    with pytest.raises(hf.HFError, match="rope_theta=10000.0 but rope_parameters.rope_theta=500000.0"):
        hf.read_config(d)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_keys_config_json_leaves_out_are_transformers_defaults(tmp_path, model_type):
    """rms_norm_eps, rope_theta and the experts left out: transformers' defaults for the model_type
    (hpctrain took 1e-5 and 10000 for all, 2 experts per token and none for Qwen3-MoE: another model).
    Mutant: DEFAULTS back to hpctrain's old constants."""
    import transformers

    d = tmp_path / model_type
    d.mkdir()
    (d / hf.CONFIG).write_text(json.dumps({"model_type": model_type, **TINY, "head_dim": 8}))
    keys, theirs = hf.model_keys(hf.read_config(d)), transformers.AutoConfig.from_pretrained(d)
    assert keys["norm_eps"] == theirs.rms_norm_eps and keys["rope_theta"] == theirs.rope_parameters["rope_theta"]
    if model_type in ("mixtral", "qwen3_moe"):
        assert keys["moe.experts"] == (getattr(theirs, "num_local_experts", None) or theirs.num_experts)
        assert keys["moe.top_k"] == theirs.num_experts_per_tok
    if model_type == "qwen3_moe":
        assert keys["moe.ffn_dim"] == theirs.moe_intermediate_size


# --- config.json sizes bounded before any loop -------------------------------------------------------

@pytest.mark.parametrize("edit, named", [
    ({"num_hidden_layers": 10**8}, ["num_hidden_layers=100000000", "1,000,000"]),
    ({"model_type": "qwen3_moe", "num_experts": 10**8, "head_dim": 8},
     ["100,000,000 experts", "more than hpctrain reads (1,000,000"]),
    ({"vocab_size": 10**19}, ["vocab_size=10,000,000,000,000,000,000 x 16", "more than torch counts"]),
])
def test_sizes_that_would_hang_the_login_node_are_refused_with_the_limit(tmp_path, edit, named):
    """hf.problems listed 10**8 layers' tensors (minutes, GBs). Mutant: _size_problem's call in
    _check_config removed (read_config then returns, and problems() loops)."""
    d = tmp_path / "m"
    d.mkdir()
    (d / hf.CONFIG).write_text(json.dumps({"model_type": "llama", **TINY, **edit}))
    with pytest.raises(hf.HFError) as e:
        hf.read_config(d)
    for part in named:
        assert part in str(e.value)


@pytest.mark.slow
def test_a_model_too_deep_to_list_is_refused_before_its_adapters_are_listed(adapters):
    """model.n_layers from the command line, no config.json to bound it: expected_shapes refuses before
    its loop. Mutant: count_problem's call in expected_shapes removed (the loop over 10**8 layers)."""
    msg = refused(adapters("deep"), model(n_layers=10**8))
    assert "model.n_layers=100000000" in msg and "1,000,000" in msg


# --- model.init_from tensors the model would not use --------------------------------------------------

@pytest.mark.slow
def test_checkpoint_tensors_outside_config_json_are_refused(tmp_path):
    """transformers' own checkpoint of a Llama with attention biases, its config.json then saying
    attention_bias false: its 8 bias tensors would be dropped. A tied model's lm_head.weight likewise;
    older conversions' rotary_emb.inv_freq (recomputed from rope_theta, left unread by transformers too)
    is accepted. Mutants: the unused-tensor check of problems() removed; DERIVED emptied."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "m"
    LlamaForCausalLM(LlamaConfig(**TINY, attention_bias=True, head_dim=8)).save_pretrained(d)
    cfg = json.loads((d / hf.CONFIG).read_text())
    (d / hf.CONFIG).write_text(json.dumps({**cfg, "attention_bias": False}))
    m = ModelConfig(**SHAPE, rope_theta=cfg["rope_parameters"]["rope_theta"], norm_eps=cfg["rms_norm_eps"])
    (msg,) = hf.problems(m, d)
    assert "holds 8 tensors that a model of its config.json does not have" in msg and "(8 in all)" in msg
    assert "model.layers.0.self_attn.k_proj.bias" in msg
    weights = load_file(str(d / "model.safetensors"))
    plain = {k: v for k, v in weights.items() if not k.endswith(".bias")}
    plain["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(plain, str(d / "model.safetensors"))
    assert hf.problems(m, d) == []
    tied = ModelConfig(**SHAPE, rope_theta=m.rope_theta, norm_eps=m.norm_eps, tie_embeddings=True)
    (d / hf.CONFIG).write_text(json.dumps({**cfg, "attention_bias": False, "tie_word_embeddings": True}))
    # transformers keeps such an lm_head.weight as an output layer of its own (untied) where it differs
    msg, hint = hf.problems(tied, d)
    assert "holds 1 tensor that a model of its config.json does not have" in msg and "lm_head.weight" in msg
    assert "Fix: model.tie_embeddings=false" in hint
