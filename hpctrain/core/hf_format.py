"""The Hugging Face formats of Llama, Qwen3, Mixtral and Qwen3-MoE, without torch: `config.json` against our model keys, tensor names,
and the tensors a directory of safetensors files holds (read from their headers).

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the bytes (https://huggingface.co/docs/safetensors). A model in several files has
`model.safetensors.index.json` ({"weight_map": {name: file}}). The login node reads only headers: a
model of any size is checked in milliseconds, before any rank starts.

Nothing is read as something else: a config.json key that makes the checkpoint another model than
hpctrain's blocks (FEATURES: biases, another activation, sliding windows, a RoPE scaling hpctrain does
not implement, ...) is refused with its value and what hpctrain implements; a key left out takes
transformers' default (DEFAULTS); sizes are bounded by arithmetic before any loop over the layers
(MAX_TENSORS, MAX_ELEMENTS); and every tensor of the files must be one the model has (problems).

The small files of a model directory (config.json, tokenizer_config.json, chat templates) are read with
`read_small`: a regular file (a symlink's target), at most SMALL_FILE_BYTES, so that a FIFO or a device
named like one neither hangs nor fills memory. `inside` resolves a file to copy out of a user's
directory: a regular file whose real path lies inside that directory, or nothing.

    python -m hpctrain.core.hf_format config DIR     the model keys of DIR's config.json, as overrides
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
from pathlib import Path

from hpctrain.core.schema import ModelConfig, MoEConfig
from hpctrain.core.shape import expert_ffn, head_dim, moe_layer, moe_layer_count

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# The safetensors dtypes the loader (safetensors.torch) reads, and their bytes per element.
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8}
FLOAT_DTYPES = {"F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ"}
MAX_HEADER = 100_000_000  # bytes: the safetensors library refuses a longer header
# config.json, tokenizer_config.json, generation_config.json, chat templates: published ones are at most a
# few MB (a tokenizer_config.json listing 100k+ added tokens); a larger one is not such a file.
SMALL_FILE_BYTES = 64 << 20
# Tensors some checkpoints hold that are derived from config.json, which transformers leaves unread too:
# the RoPE frequencies of older Llama conversions (recomputed from rope_theta).
DERIVED = (".rotary_emb.inv_freq",)
AGAIN = "Fix: download it again (the file is damaged, or not a safetensors file)"

# hpctrain name -> Hugging Face name; {i}: the block.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Qwen3 and Qwen3-MoE
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# Mixture-of-Experts layers, by architecture: the router, and each expert's three matrices ({e}: the
# expert), as the published checkpoints store them (one 2-D tensor per expert and matrix).
MOE_NAMES = {
    "mixtral": {"moe.router.weight": "block_sparse_moe.gate.weight",
                "moe.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
                "moe.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
                "moe.experts.w3": "block_sparse_moe.experts.{e}.w3.weight"},
    "qwen3_moe": {"moe.router.weight": "mlp.gate.weight",
                  "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
                  "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
                  "moe.experts.w3": "mlp.experts.{e}.up_proj.weight"},
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


class HFError(ValueError):
    """A Hugging Face directory that cannot be used; the message names the file and the fix."""


def read_small(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of one of a model directory's small files: a regular file (symlinks followed), at most
    `limit` bytes, checked on the open file before reading it; HFError (OSError's text, or what the
    path is instead) otherwise. `limit`: SMALL_FILE_BYTES unless given."""
    limit = SMALL_FILE_BYTES if limit is None else limit
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is then refused as not regular).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise HFError(f"{path} cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise HFError(f"{path} is not a regular file ({file_kind(st.st_mode)}). Fix: replace it with the "
                          f"file it should be")
        if st.st_size > limit:
            raise HFError(f"{path} is {st.st_size:,} bytes, more than such a file can be ({limit:,}). Fix: replace "
                          f"it with the model's own")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise HFError(f"{path} is more than {limit:,} bytes. Fix: replace it with the model's own")
    return data


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words (from its st_mode)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def confinement_root(directory: str | os.PathLike) -> Path:
    """The folder whose files `inside` accepts for `directory`: the directory itself, or for a snapshot
    of the Hugging Face cache the repository folder that holds its snapshots and their blobs
    (huggingface_hub's cache layout: models--ORG--NAME/{blobs,refs,snapshots/REV})."""
    root = Path(os.path.realpath(directory))
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--")) \
            and (repo / "blobs").is_dir():
        return repo
    return root


def _cache_blob(real: Path) -> bool:
    """A file of huggingface_hub's download cache (models--ORG--NAME/blobs/HASH): where the files of a
    `huggingface-cli download --local-dir` directory lead (hub < 0.23 linked large files, a Llama 3
    tokenizer.json among them, from the local directory into the cache)."""
    return real.parent.name == "blobs" and real.parent.parent.name.startswith(("models--", "datasets--")) \
        and (real.parent.parent / "snapshots").is_dir()


def inside(directory: str | os.PathLike, name: str) -> tuple[Path | None, str | None]:
    """(the real path of directory/name, None) when it is a regular file that lies inside `directory`
    once every symlink is resolved; (None, why not) when it is something else; (None, None) when absent.
    For copying files out of a user's directory: nothing that did not come from inside it. A snapshot
    of the Hugging Face download cache (<cache>/models--ORG--NAME/snapshots/REV, its files symlinks
    into ../../blobs) is confined to its repository's folder models--ORG--NAME instead, and a file that
    leads into such a cache's blobs is accepted from any directory (_cache_blob)."""
    root = confinement_root(directory)
    p = Path(directory) / name
    if not (p.exists() or p.is_symlink()):
        return None, None
    real = Path(os.path.realpath(p))
    if real != root and root not in real.parents and not _cache_blob(real):
        return None, f"{p} leads outside {directory} (to {real})"
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        return None, f"{p} cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(mode):
        return None, f"{p} is {file_kind(mode)}"
    return real, None


def architecture(m: ModelConfig) -> str:
    """The Hugging Face model_type that holds a model of these keys (HFError naming what none holds):
    llama; qwen3 (QK-norm); mixtral (MoE in every layer, softmax top-k renormalised, experts as wide as
    model.ffn_dim); qwen3_moe (QK-norm, MoE every moe.every-th layer after moe.first_dense)."""
    e = m.moe
    if e.experts == 0:
        return "qwen3" if m.qk_norm else "llama"
    why = []
    if e.shared_experts:
        why.append(f"moe.shared_experts={e.shared_experts}")
    if e.router != "softmax" or e.bias_update_rate > 0:
        why.append(f"moe.router={e.router}" + (f" with moe.bias_update_rate={e.bias_update_rate}"
                                               if e.bias_update_rate > 0 else ""))
    if e.route_scale != 1.0:
        why.append(f"moe.route_scale={e.route_scale}")
    if not why and m.qk_norm:
        return "qwen3_moe"
    if not why and e.norm_topk and e.every == 1 and e.first_dense == 0 and (e.ffn_dim or m.ffn_dim) == m.ffn_dim:
        return "mixtral"
    if not why:
        why.append("no QK-norm (Qwen3-MoE has it) and dense layers or experts narrower than model.ffn_dim, or "
                   "moe.norm_topk=false (Mixtral has neither)")
    raise HFError("no Hugging Face architecture hpctrain writes holds this model: " + "; ".join(why) +
                  ". Mixtral and Qwen3-MoE are written; export the weights as one file (--format file) instead")


def to_hf(name: str, arch: str = "llama") -> str:
    """hpctrain's parameter name -> the Hugging Face name (an expert tensor: its `{e}` left to fill)."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        if rest.startswith("moe."):
            return f"model.layers.{i}." + MOE_NAMES[arch][rest]
        return NAMES[f"layers.{{i}}.{rest}"].format(i=i)
    return NAMES[name]


def is_expert(name: str) -> bool:
    """A stacked (experts, ...) tensor that Hugging Face stores as one tensor per expert."""
    return ".moe.experts." in name


def hf_names(name: str, arch: str, experts: int) -> list[str]:
    """The Hugging Face tensors one of our parameters is stored as: one, or one per expert in order."""
    out = to_hf(name, arch)
    return [out.format(e=e) for e in range(experts)] if is_expert(name) else [out]


def expected_shapes(m: ModelConfig) -> dict[str, tuple]:
    """Hugging Face name -> shape, for a model config (the tied output projection is not stored);
    HFError when there would be too many to list (count_problem)."""
    hd, arch, f = head_dim(m), architecture(m), expert_ffn(m)
    too_big = count_problem(m.n_layers, m.moe.experts)
    if too_big:
        raise HFError(f"model.n_layers={m.n_layers}: {too_big}")
    attention = {"attention_norm.weight": (m.dim,), "attention.wq.weight": (m.n_heads * hd, m.dim),
                 "attention.wk.weight": (m.n_kv_heads * hd, m.dim), "attention.wv.weight": (m.n_kv_heads * hd, m.dim),
                 "attention.wo.weight": (m.dim, m.n_heads * hd), "ffn_norm.weight": (m.dim,)}
    if m.qk_norm:
        attention.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    dense = {"feed_forward.w1.weight": (m.ffn_dim, m.dim), "feed_forward.w3.weight": (m.ffn_dim, m.dim),
             "feed_forward.w2.weight": (m.dim, m.ffn_dim)}
    moe = {"moe.router.weight": (m.moe.experts, m.dim), "moe.experts.w1": (f, m.dim), "moe.experts.w3": (f, m.dim),
           "moe.experts.w2": (m.dim, f)}
    out = {to_hf("tok_embeddings.weight"): (m.vocab_size, m.dim), to_hf("norm.weight"): (m.dim,)}
    for i in range(m.n_layers):
        block = {**attention, **(moe if moe_layer(m, i) else dense)}
        for k, shape in block.items():
            out.update({n: shape for n in hf_names(f"layers.{i}.{k}", arch, m.moe.experts)})
    if not m.tie_embeddings:
        out[to_hf("output.weight")] = (m.vocab_size, m.dim)
    return out


# ------------------------------------------------------------------------------------ config.json

def read_config(path: str | Path) -> dict:
    """model.init_from's config.json, checked: a JSON object of a Llama with the keys model_keys() reads,
    each of its kind and range, no option hpctrain does not implement, sizes it can list (HFError naming
    the file, the key and the fix)."""
    p = Path(path) / CONFIG
    if not Path(path).is_dir():
        raise HFError(f"model.init_from={path} is not a directory. Fix: point model.init_from at a Hugging Face "
                      "model directory (config.json and *.safetensors)")
    if not (p.exists() or p.is_symlink()):  # a FIFO or a device is there: read_small names it
        raise HFError(f"model.init_from={path} has no {CONFIG}: it is not a Hugging Face model directory. Fix: "
                      "point model.init_from at the directory that holds config.json and the *.safetensors files")
    raw = read_small(p)
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise HFError(f"{p} is not valid JSON ({e}). Fix: download config.json again") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{p} holds a JSON {_json_kind(cfg)}, not an object of keys. Fix: download config.json again")
    arch = cfg.get("model_type")
    if arch not in (*ARCHITECTURES, None):
        raise HFError(f"{p} describes a {arch!r} model; hpctrain trains these model_types: {', '.join(ARCHITECTURES)}")
    _check_config(cfg, str(p))
    return cfg


def _json_kind(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v) -> bool:
    """A finite number above 0 (JSON's NaN and Infinity are numbers to Python's json)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# config.json keys -> what each must be; model_keys() reads them.
_WHOLE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_OPTIONAL_WHOLE = ("num_key_value_heads", "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "decoder_sparse_step")
_OPTIONAL_POSITIVE = ("rms_norm_eps", "rope_theta")
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _config_problems(hf: dict) -> list[str]:
    out = []
    show = lambda k, v: f"{k}={json.dumps(v)[:60]}"  # noqa: E731 - as the file holds it
    for k in _WHOLE:
        if k not in hf or hf[k] is None:
            out.append(f"{k} is missing")
        elif not (_whole(hf[k]) and hf[k] > 0):
            out.append(f"{show(k, hf[k])} must be a positive whole number")
    for k in _OPTIONAL_WHOLE:
        if hf.get(k) is not None and not (_whole(hf[k]) and hf[k] > 0):
            out.append(f"{show(k, hf[k])} must be a positive whole number (or absent)")
    for k in _OPTIONAL_POSITIVE:
        if hf.get(k) is not None and not _positive(hf[k]):
            out.append(f"{show(k, hf[k])} must be a finite number above 0")
    if hf.get("tie_word_embeddings") is not None and not isinstance(hf["tie_word_embeddings"], bool):
        out.append(f"{show('tie_word_embeddings', hf['tie_word_embeddings'])} must be true or false")
    for key in ("rope_scaling", "rope_parameters"):
        scaling = hf.get(key)
        if scaling is None:
            continue
        if not isinstance(scaling, dict):
            out.append(f"{show(key, scaling)} must be an object (or null)")
            continue
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is not None and not isinstance(kind, str):
            out.append(f"{key}.rope_type={json.dumps(kind)[:60]} must be a string")
        inner = scaling.get("rope_theta")
        if inner is not None and not _positive(inner):
            out.append(f"{show(key + '.rope_theta', inner)} must be a finite number above 0")
        elif inner is not None and _positive(hf.get("rope_theta")) and inner != hf["rope_theta"]:
            # transformers 5 takes the block's (its setdefault keeps it), earlier versions the top-level key
            out.append(f"rope_theta={hf['rope_theta']} but {key}.rope_theta={inner}: transformers' versions read "
                       f"different ones, so they must agree")
        if kind == "llama3":
            for k in _LLAMA3:
                v = scaling.get(k)
                if v is None:
                    out.append(f"{key}.{k} is missing (Llama 3.1's 'llama3' scaling needs {', '.join(_LLAMA3)})")
                elif not _positive(v) or (k == _LLAMA3[-1] and not _whole(v)):
                    what = "a positive whole number" if k == _LLAMA3[-1] else "a finite number above 0"
                    out.append(f"{show(key + '.' + k, v)} must be {what}")
    if not out:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if head_dim * heads != hf["hidden_size"] and hf.get("head_dim") is None:
            out.append(f"hidden_size {hf['hidden_size']} is not a multiple of {heads} heads and config.json gives "
                       "no head_dim")
        if head_dim % 2:
            out.append(f"head_dim {head_dim} must be even for rotary embeddings")
        only = hf.get("mlp_only_layers") or []
        if hf.get("model_type") == "qwen3_moe" and not (isinstance(only, list) and only == list(range(len(only)))):
            out.append(f"mlp_only_layers={json.dumps(only)[:60]}: hpctrain keeps dense only the first k layers "
                       "(model.moe.first_dense), so it must be [0, 1, ..., k-1] or empty")
        kv = hf.get("num_key_value_heads") or heads
        if heads % kv:
            out.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return out


def _check_config(hf: dict, where: str) -> None:
    found = _config_problems(hf)
    if found:
        raise HFError(f"{where}: " + "; ".join(found) + ". Fix: download config.json again (the model's own, "
                      "from where its weights came), or correct those keys")
    found = _unsupported(hf)
    if found:
        one = len(found) == 1
        raise HFError(f"{where}: " + "; ".join(found) + f". hpctrain does not implement {'this' if one else 'these'}: "
                      f"the model it would train is not the checkpoint's. Fix: a model without "
                      f"{'it' if one else 'them'} (Llama, Qwen3, Mixtral, Qwen3-MoE as published)")
    size = _size_problem(hf)
    if size:
        raise HFError(f"{where}: {size}. Fix: the model's own config.json (these sizes are not a model's)")


# transformers' values for keys config.json leaves out (LlamaConfig, Qwen3Config, MixtralConfig and
# Qwen3MoeConfig, 4.x and 5.x alike): a config.json without them is the model transformers builds.
DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "decoder_sparse_step": 1},
}


def _given(hf: dict, key: str):
    """config.json's value of `key`, or transformers' default for the model_type (no model_type: Llama)."""
    v = hf.get(key)
    return DEFAULTS.get(hf.get("model_type") or "llama", DEFAULTS["llama"]).get(key) if v is None else v


def _off(*values):
    """A FEATURES test: the key absent, null, or one of `values` (false is not 0, nor true 1)."""
    return lambda v, hf: v is None or any(v == o and type(v) is not bool or v is o for o in values)


def _whole_sequence(v, hf) -> bool:
    """Qwen3's use_sliding_window: windowed layers are those from max_window_layers on (Qwen3-MoE: all)."""
    if not v or hf.get("sliding_window") is None:
        return True
    last = hf.get("max_window_layers", 28)
    return hf.get("model_type") == "qwen3" and _whole(last) and last >= hf["num_hidden_layers"]


_DENSE_ATTN = ("llama", "qwen3", "qwen3_moe")  # the model_types whose attention reads attention_bias
# config.json keys that change the model: (key, the model_types whose transformers model reads it (None:
# all), whether a value is one hpctrain implements, what the key does, what hpctrain implements).
FEATURES = (
    ("hidden_act", None, lambda v, hf: v in (None, "silu", "swish"), "the feed-forward's activation",
     "silu (swish)"),
    ("attention_bias", _DENSE_ATTN, _off(False), "biases in the attention projections", "false"),
    ("mlp_bias", ("llama",), _off(False), "biases in the feed-forward", "false"),
    ("attention_dropout", None, _off(0), "dropout on the attention weights in training", "0.0"),
    ("partial_rotary_factor", None, _off(1), "RoPE on part of each head", "1.0"),
    ("quantization_config", None, _off(), "quantized weights", "none: F32, BF16 or F16 weights"),
    ("router_jitter_noise", ("mixtral",), _off(0), "noise on the router's input in training", "0.0"),
    ("sliding_window", ("mixtral",), _off(), "attention to the last sliding_window tokens only",
     "null: attention to the whole sequence"),
    ("use_sliding_window", ("qwen3", "qwen3_moe"), _whole_sequence,
     "sliding-window attention in the layers from max_window_layers on", "false: attention to the whole sequence"),
    ("layer_types", None, lambda v, hf: v is None or (isinstance(v, list) and set(v) <= {"full_attention"}),
     "an attention kind per layer", "full_attention in every layer"),
)
ROPE_TYPES = ("default", "llama3")  # rope_scaling / rope_parameters' rope_type that hpctrain implements


def _unsupported(hf: dict) -> list[str]:
    """config.json's settings that change the model and that hpctrain does not implement, each with its
    value and what hpctrain has instead (read after _config_problems: the sizes are whole numbers)."""
    kind = hf.get("model_type") or "llama"
    out = [f"{k}={json.dumps(hf[k])[:60]}: {what}; hpctrain implements {ours}" for k, types, ok, what, ours in FEATURES
           if k in hf and (types is None or kind in types) and not ok(hf[k], hf)]
    for key in ("rope_scaling", "rope_parameters"):
        scaling = hf.get(key) or {}
        rope = scaling.get("rope_type", scaling.get("type"))
        if any(isinstance(v, dict) for v in scaling.values()):
            out.append(f"{key}={json.dumps(scaling)[:60]}: a RoPE per layer type; hpctrain implements one for "
                       f"all layers")
        elif rope not in (None, *ROPE_TYPES):
            out.append(f"{key}.rope_type={json.dumps(rope)[:40]}: a RoPE scaling; hpctrain implements "
                       f"{' and '.join(ROPE_TYPES)} (Llama 3.1's)")
        if not _off(1)(scaling.get("partial_rotary_factor"), hf):
            out.append(f"{key}.partial_rotary_factor={json.dumps(scaling['partial_rotary_factor'])[:40]}: RoPE on "
                       f"part of each head; hpctrain implements 1.0")
    return out


# The most tensors a model may have: ten times the largest published model's (Kimi K2, 61 layers of 384
# experts: about 70,000). The login node lists them (expected_shapes) before any rank starts.
MAX_TENSORS = 1_000_000
MAX_ELEMENTS = 2**63 - 1  # torch counts a tensor's elements in a 64-bit integer


def count_problem(layers: int, experts: int) -> str | None:
    """Why a model of `layers` blocks of up to `experts` experts has too many tensors to list, by
    arithmetic alone (before any loop over its layers)."""
    tensors = layers * (12 + 3 * experts) + 3  # per block: at most 9 + 2 QK-norm + router, 3 per expert
    if tensors <= MAX_TENSORS:
        return None
    return (f"{layers:,} layers" + (f" of {experts:,} experts" if experts else "") + f" are up to {tensors:,} "
            f"tensors, more than hpctrain reads ({MAX_TENSORS:,}, ten times the largest published model's)")


def elements_problem(dim: int, widths: dict) -> str | None:
    """Why a model whose largest tensor is dim x max(widths) cannot be made (torch's element count)."""
    key = max(widths, key=widths.get)
    if dim * widths[key] <= MAX_ELEMENTS:
        return None
    return (f"{key}={widths[key]:,} x {dim:,} is a tensor of {dim * widths[key]:,} elements, more than torch counts "
            f"({MAX_ELEMENTS:,})")


def _size_problem(hf: dict) -> str | None:
    """count_problem and elements_problem of a config.json (its sizes already checked as whole numbers)."""
    heads, dim, experts = hf["num_attention_heads"], hf["hidden_size"], _experts(hf)
    widths = {"vocab_size": hf["vocab_size"], "intermediate_size": hf["intermediate_size"],
              "num_attention_heads x head_dim": heads * (hf.get("head_dim") or dim // heads),
              "moe_intermediate_size": _given(hf, "moe_intermediate_size") or 0, "num_experts": experts}
    found = count_problem(hf["num_hidden_layers"], experts)
    if found:
        return f"num_hidden_layers={hf['num_hidden_layers']}: {found}"
    found = elements_problem(dim, widths)
    return found and f"hidden_size={dim}: {found}"


def model_keys(hf: dict) -> dict:
    """Our model.* keys from a Hugging Face Llama config.json (HFError when it lacks one or holds a
    value of another kind: read_config() checks the same, naming the file)."""
    if not isinstance(hf, dict):
        raise HFError(f"{CONFIG} holds a JSON {_json_kind(hf)}, not an object of keys. Fix: download it again")
    _check_config(hf, CONFIG)
    heads = hf["num_attention_heads"]
    given_hd = hf.get("head_dim")
    keys = {"dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "head_dim": given_hd if given_hd and given_hd * heads != hf["hidden_size"] else 0,
            "qk_norm": hf.get("model_type") in ("qwen3", "qwen3_moe"),
            "n_kv_heads": hf.get("num_key_value_heads") or heads, "ffn_dim": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "norm_eps": float(_given(hf, "rms_norm_eps")),
            "rope_theta": float(_given(hf, "rope_theta")),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": 0.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
            "rope_original_max_seq_len": 8192}
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind == "llama3":  # the other kinds but "default" were refused (_unsupported)
        keys.update(rope_scaling=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]))
    if hf.get("rope_theta") is None and scaling and scaling.get("rope_theta") is not None:
        keys["rope_theta"] = float(scaling["rope_theta"])
    keys.update(_moe_keys(hf))
    return keys


def _experts(hf: dict) -> int:
    """The routed experts of a MoE layer that config.json gives (0: a dense model_type)."""
    kind = hf.get("model_type")
    if kind == "mixtral":
        return _given(hf, "num_local_experts")
    if kind == "qwen3_moe":  # published config.json files say num_experts; transformers 5 writes num_local_experts
        return hf.get("num_experts") or hf.get("num_local_experts") or _given(hf, "num_experts")
    return 0


def _moe_keys(hf: dict) -> dict:
    """model.moe.* from a Mixtral or Qwen3-MoE config.json, as dotted keys ({} for a dense model)."""
    kind = hf.get("model_type")
    if kind == "mixtral":
        experts, ffn, every, dense = _experts(hf), 0, 1, 0
        norm = True
    elif kind == "qwen3_moe":
        experts = _experts(hf)
        ffn = _given(hf, "moe_intermediate_size")
        every, norm = _given(hf, "decoder_sparse_step"), bool(hf.get("norm_topk_prob", False))
        dense = len(hf.get("mlp_only_layers") or [])  # _config_problems: they are the first layers
    else:
        return {}
    return {"moe.experts": experts, "moe.top_k": _given(hf, "num_experts_per_tok"), "moe.ffn_dim": ffn,
            "moe.every": every, "moe.first_dense": dense, "moe.norm_topk": norm, "moe.router": "softmax",
            "moe.shared_experts": 0, "moe.route_scale": 1.0}


def training_keys(hf: dict) -> dict:
    """The training defaults a Mixtral or Qwen3-MoE config.json carries, as dotted model keys: the
    balancing loss's coefficient, which a run may set otherwise (model=hf takes it when the command line
    does not). transformers pools every MoE layer's routing into one loss (load_balancing_loss_func)
    and adds it only with output_router_logits; hpctrain sums one loss per MoE layer, whose gradient
    into each router is the pooled one's times the MoE layers (equal with one MoE layer, or with every
    layer routing alike). So router_aux_loss_coef / MoE layers, or 0 where transformers trains without
    the loss (the published configs say output_router_logits: false)."""
    keys = _moe_keys(hf)
    aux = hf.get("router_aux_loss_coef")
    if not keys.get("moe.experts"):
        return {}
    if not (hf.get("output_router_logits") and _positive(aux)):
        return {"moe.aux_loss_coef": 0.0}
    moe = MoEConfig(**{k[len("moe."):]: v for k, v in keys.items()})
    layers = moe_layer_count(ModelConfig(n_layers=int(hf["num_hidden_layers"]), moe=moe))
    return {"moe.aux_loss_coef": float(aux) / max(1, layers)}


def router_aux_loss_coef(m: ModelConfig) -> float:
    """transformers' pooled coefficient for ours (training_keys, the other way)."""
    return m.moe.aux_loss_coef * max(1, moe_layer_count(m))


def to_config(m: ModelConfig, max_seq_len: int, dtype: str = "float32") -> dict:
    """config.json for a model config (what transformers' LlamaConfig, Qwen3Config, MixtralConfig or
    Qwen3MoeConfig reads: architecture() picks)."""
    arch = architecture(m)
    cfg = {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_size": m.dim,
           "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
           "head_dim": head_dim(m), "intermediate_size": m.ffn_dim, "vocab_size": m.vocab_size,
           "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "tie_word_embeddings": bool(m.tie_embeddings),
           "max_position_embeddings": max_seq_len, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None}
    if m.rope_scaling > 0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling,
                               "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                               "original_max_position_embeddings": m.rope_original_max_seq_len}
    e = m.moe
    # the balancing loss as transformers would train it on: pooled over the MoE layers (training_keys)
    balance = dict(router_aux_loss_coef=router_aux_loss_coef(m), output_router_logits=e.aux_loss_coef > 0)
    if arch == "mixtral":
        cfg.update(num_local_experts=e.experts, num_experts_per_tok=e.top_k, router_jitter_noise=0.0, **balance)
    elif arch == "qwen3_moe":
        cfg.update(num_experts=e.experts, num_experts_per_tok=e.top_k, moe_intermediate_size=expert_ffn(m),
                   decoder_sparse_step=e.every, mlp_only_layers=list(range(e.first_dense)), norm_topk_prob=e.norm_topk,
                   **balance)
    return cfg


def mismatches(m: ModelConfig, hf_keys: dict) -> list[str]:
    """Our model keys that disagree with the directory's config.json, each with both values."""
    out = []
    for k, v in hf_keys.items():
        ours = m
        for part in k.split("."):
            ours = getattr(ours, part)
        same = math.isclose(ours, v, rel_tol=1e-9) if isinstance(v, float) else ours == v
        if not same:
            out.append(f"model.{k}={ours} but config.json says {v}")
    return out


# ------------------------------------------------------------------------------------ safetensors

def read_header(path: Path) -> dict:
    """{name: {dtype, shape, data_offsets}} of one safetensors file, checked as the safetensors library
    checks it when a rank opens the file: a JSON object of entries with a known dtype, a shape of whole
    numbers 0 or more, and data_offsets holding exactly the shape's bytes; the tensors' bytes one after
    another from the start of the data, without gaps or overlaps, to the end of the file. HFError
    naming the file, the tensor and the fix when not."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFError(f"{path} is truncated: {size} bytes, not even a header. Fix: download it again")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise HFError(f"{path} is truncated: its header says {n} bytes, the file has {size}. "
                              "Fix: download it again")
            if n > MAX_HEADER:
                raise HFError(f"{path}: its header would be {n:,} bytes, more than safetensors allows "
                              f"({MAX_HEADER:,}). {AGAIN}")
            header = json.loads(f.read(n))
    except HFError:
        raise
    except OSError as e:
        raise HFError(f"{path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8
        raise HFError(f"{path} is not a safetensors file (unreadable header: {e}). {AGAIN}") from None
    if not isinstance(header, dict):
        raise HFError(f"{path}: its header is a JSON {_json_kind(header)}, not an object of tensors. {AGAIN}")
    meta = header.pop("__metadata__", None)
    found = []
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        found.append("__metadata__ must be an object of strings")
    spans = []
    for name, v in header.items():
        problem = _entry_problem(v)
        if problem:
            found.append(f"tensor {name}: {problem}")
        else:
            spans.append((*v["data_offsets"], name))
    data = size - 8 - n
    if not found:
        at, before = 0, None
        for begin, end, name in sorted(spans, key=lambda t: (t[0], t[1])):
            if begin < at:
                found.append(f"tensor {name}: data_offsets [{begin}, {end}] overlap those of {before}, "
                             f"which end at {at}")
            elif begin > at:
                found.append(f"tensor {name}: data_offsets [{begin}, {end}] leave bytes {at}..{begin} of the data "
                             f"to no tensor" + (f" (after {before})" if before else ""))
            if end > at:
                at, before = end, name
        if not found and at > data:
            raise HFError(f"{path} is truncated: its tensors need {8 + n + at} bytes, the file has {size}. "
                          "Fix: download it again")
        if not found and at < data:
            found.append(f"{data - at} bytes after the last tensor's data, which safetensors does not allow")
        found += [f"tensor {name}: data_offsets [{begin}, {end}] reach past the end of the file (its data is "
                  f"{data} bytes)" for begin, end, name in spans if end > data and found]
    if found:
        more = f"; ... and {len(found) - 5} more" if len(found) > 5 else ""
        raise HFError(f"{path} is damaged: " + "; ".join(found[:5]) + more + f". {AGAIN}")
    return header


def _entry_problem(v) -> str | None:
    """Why one header entry is not {dtype, shape, data_offsets} of a tensor whose bytes fit its shape."""
    if not isinstance(v, dict):
        return f"{json.dumps(v)[:60]} is not an object with dtype, shape and data_offsets"
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return f"dtype {json.dumps(dtype)[:40]} is not one the loader reads ({', '.join(DTYPE_BYTES)})"
    if not isinstance(shape, list) or not all(_whole(d) and d >= 0 for d in shape):
        return f"shape {json.dumps(shape)[:60]} is not a list of whole numbers, 0 or more"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"data_offsets {json.dumps(offsets)[:60]} is not [begin, end] with 0 <= begin <= end"
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        return (f"shape {shape} of {dtype} is {need} bytes, but data_offsets {offsets} hold "
                f"{offsets[1] - offsets[0]}")
    return None


def tensors(path: str | Path) -> dict[str, tuple[str, tuple, str]]:
    """Hugging Face name -> (dtype, shape, file) over the directory's safetensors files: every
    *.safetensors file in it (the ranks' loader reads them all) and those model.safetensors.index.json
    names (which must be there)."""
    d = Path(path)
    index = d / INDEX
    files = {p.name for p in d.glob("*.safetensors")}
    if index.is_file():
        try:  # it names no more tensors than the headers may hold
            weight_map = json.loads(read_small(index, MAX_HEADER))["weight_map"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:  # HFError is a ValueError
            raise HFError(f"{index} is not a safetensors index ({type(e).__name__}: {e}). Fix: download it "
                          "again, or remove it (the *.safetensors files are read without it)") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f not in ("", ".", "..") and "/" not in f and "\\" not in f
                for f in weight_map.values()):
            raise HFError(f"{index}: \"weight_map\" must map each tensor name to the name of a file in {d}. "
                          "Fix: download it again, or remove it (the *.safetensors files are read without it)")
        for name in sorted(set(weight_map.values())):
            if not (d / name).is_file():
                raise HFError(f"{d / name} is listed in {INDEX} but missing. Fix: download it")
        files |= set(weight_map.values())
    if not files:
        raise HFError(f"{d} holds no *.safetensors files. Fix: download the model's weights into it")
    out = {}
    for name in sorted(files):
        p = d / name
        if not p.is_file():
            raise HFError(f"{p} is not a file. Fix: remove it, or download the file it should be")
        for k, v in read_header(p).items():
            out[k] = (v["dtype"], tuple(v["shape"]), name)
    return out


def problems(m: ModelConfig, path: str | Path) -> list[str]:
    """What keeps the directory from initializing a model of config `m`: config.json disagreeing
    with the model keys, or damaged; tensors missing, damaged, of another shape, or not floating point.
    Empty when it fits."""
    try:
        keys = model_keys(read_config(path))
        found = mismatches(m, keys)
        if found:
            return [f"model.init_from={path}: " + "; ".join(found) + ". Fix: model=hf (the shape from "
                    "config.json), or the model keys config.json gives"]
        have = tensors(path)
    except HFError as e:
        return [str(e)]
    try:
        wanted = expected_shapes(m)
    except HFError as e:
        return [f"model.init_from={path}: {e}"]
    out = []
    for name, shape in wanted.items():
        if name not in have:
            out.append(f"{path}: no tensor {name}")
        elif have[name][1] != shape:
            out.append(f"{Path(path) / have[name][2]}: {name} has shape {list(have[name][1])}, the model needs "
                       f"{list(shape)}. Fix: a checkpoint of this model's shape")
        elif have[name][0] not in FLOAT_DTYPES:
            out.append(f"{Path(path) / have[name][2]}: {name} is {have[name][0]}, not floating point: the model's "
                       f"weights are. Fix: a checkpoint in F32, BF16 or F16")
    out = out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else [])
    unused = sorted(n for n in have if n not in wanted and not n.endswith(DERIVED))
    if unused:
        few = ", ".join(unused[:3]) + (f", ... ({len(unused)} in all)" if len(unused) > 3 else "")
        out.append(f"{path} holds {len(unused)} tensor{'s' * (len(unused) > 1)} that a model of its config.json "
                   f"does not have (hpctrain would train without them: another model): {few}. Fix: the config.json "
                   f"these weights came with, or weights of this model")
        if m.tie_embeddings and "lm_head.weight" in unused:
            # transformers unties the two when the file holds both with different values: another model
            out.append(f"{path}: lm_head.weight beside a tied embedding (tie_word_embeddings true) is a separate "
                       "output layer to transformers unless it equals the embedding. Fix: model.tie_embeddings=false "
                       "to train it as one, or remove lm_head.weight from the files if it is a copy")
    return out


# ------------------------------------------------------------------------------------ command line

def _override(value) -> str:
    """A value as a command-line override writes it (Hydra's booleans, floats that stay floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hpctrain.core.hf_format",
                                 description="Read a Hugging Face model directory as hpctrain does (no torch).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="the model keys a directory's config.json gives, as overrides",
                       description="Print the model.* keys that DIR's config.json gives, one override a line "
                                   "(model=hf model.init_from=DIR takes them itself; another model preset with "
                                   "model.init_from must agree with them).")
    c.add_argument("dir", type=Path, help="a Hugging Face model directory (config.json and *.safetensors)")
    args = ap.parse_args(argv)
    try:
        keys = model_keys(read_config(args.dir))
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"model.{k}={_override(v)}" for k, v in keys.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
