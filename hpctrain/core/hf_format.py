"""The Hugging Face Llama format, without torch: `config.json` against our model keys, tensor names,
and the tensors a directory of safetensors files holds (read from their headers).

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the bytes (https://huggingface.co/docs/safetensors). A model in several files has
`model.safetensors.index.json` ({"weight_map": {name: file}}). The login node reads only headers: a
model of any size is checked in milliseconds, before any rank starts.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from hpctrain.core.schema import ModelConfig

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}

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
}


class HFError(ValueError):
    """A Hugging Face directory that cannot be used; the message names the file and the fix."""


def to_hf(name: str) -> str:
    """hpctrain's parameter name -> the Hugging Face name."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return NAMES[f"layers.{{i}}.{rest}"].format(i=i)
    return NAMES[name]


def expected_shapes(m: ModelConfig) -> dict[str, tuple]:
    """Hugging Face name -> shape, for a model config (the tied output projection is not stored)."""
    hd = m.dim // m.n_heads
    block = {"attention_norm.weight": (m.dim,), "attention.wq.weight": (m.n_heads * hd, m.dim),
             "attention.wk.weight": (m.n_kv_heads * hd, m.dim), "attention.wv.weight": (m.n_kv_heads * hd, m.dim),
             "attention.wo.weight": (m.dim, m.n_heads * hd), "ffn_norm.weight": (m.dim,),
             "feed_forward.w1.weight": (m.ffn_dim, m.dim), "feed_forward.w3.weight": (m.ffn_dim, m.dim),
             "feed_forward.w2.weight": (m.dim, m.ffn_dim)}
    out = {to_hf("tok_embeddings.weight"): (m.vocab_size, m.dim), to_hf("norm.weight"): (m.dim,)}
    for i in range(m.n_layers):
        out.update({to_hf(f"layers.{i}.{k}"): v for k, v in block.items()})
    if not m.tie_embeddings:
        out[to_hf("output.weight")] = (m.vocab_size, m.dim)
    return out


# ------------------------------------------------------------------------------------ config.json

def read_config(path: str | Path) -> dict:
    p = Path(path) / CONFIG
    if not Path(path).is_dir():
        raise HFError(f"model.init_from={path} is not a directory. Fix: point model.init_from at a Hugging Face "
                      "model directory (config.json and *.safetensors)")
    if not p.is_file():
        raise HFError(f"model.init_from={path} has no {CONFIG}: it is not a Hugging Face model directory. Fix: "
                      "point model.init_from at the directory that holds config.json and the *.safetensors files")
    try:
        cfg = json.loads(p.read_text())
    except ValueError as e:
        raise HFError(f"{p} is not valid JSON ({e})") from None
    arch = cfg.get("model_type")
    if arch not in ("llama", None):
        raise HFError(f"{p} describes a {arch!r} model; hpctrain trains Llama models (model_type 'llama')")
    return cfg


def model_keys(hf: dict) -> dict:
    """Our model.* keys from a Hugging Face Llama config.json."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise HFError(f"head_dim {head_dim} x {heads} heads != hidden_size {hf['hidden_size']}: hpctrain's Llama "
                      "needs hidden_size = heads x head_dim")
    keys = {"dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads, "ffn_dim": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "norm_eps": hf.get("rms_norm_eps", 1e-5),
            "rope_theta": float(hf.get("rope_theta", 10000.0)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": 0.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
            "rope_original_max_seq_len": 8192}
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if scaling and kind not in (None, "default"):
        if kind != "llama3":
            raise HFError(f"RoPE scaling {kind!r} is not supported (Llama 3.1's 'llama3' is)")
        keys.update(rope_scaling=float(scaling["factor"]), rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]))
    if "rope_theta" not in hf and scaling and "rope_theta" in scaling:
        keys["rope_theta"] = float(scaling["rope_theta"])
    return keys


def to_config(m: ModelConfig, max_seq_len: int, dtype: str = "float32") -> dict:
    """config.json for a model config (what transformers' LlamaConfig reads)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.dim,
           "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
           "head_dim": m.dim // m.n_heads, "intermediate_size": m.ffn_dim, "vocab_size": m.vocab_size,
           "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "tie_word_embeddings": bool(m.tie_embeddings),
           "max_position_embeddings": max_seq_len, "hidden_act": "silu", "attention_bias": False,
           "mlp_bias": False, "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None}
    if m.rope_scaling > 0:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling,
                               "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                               "original_max_position_embeddings": m.rope_original_max_seq_len}
    return cfg


def mismatches(m: ModelConfig, hf_keys: dict) -> list[str]:
    """Our model keys that disagree with the directory's config.json, each with both values."""
    out = []
    for k, v in hf_keys.items():
        ours = getattr(m, k)
        same = math.isclose(ours, v, rel_tol=1e-9) if isinstance(v, float) else ours == v
        if not same:
            out.append(f"model.{k}={ours} but config.json says {v}")
    return out


# ------------------------------------------------------------------------------------ safetensors

def read_header(path: Path) -> dict:
    """{name: {dtype, shape, data_offsets}} of one safetensors file; HFError naming it when damaged."""
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
            header = json.loads(f.read(n))
    except OSError as e:
        raise HFError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise HFError(f"{path} is not a safetensors file (unreadable header: {e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise HFError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}. "
                      "Fix: download it again")
    header.pop("__metadata__", None)
    return header


def tensors(path: str | Path) -> dict[str, tuple[str, tuple, str]]:
    """Hugging Face name -> (dtype, shape, file) over the directory's safetensors files."""
    d = Path(path)
    index = d / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise HFError(f"{index} is not a safetensors index ({e})") from None
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise HFError(f"{d} holds no *.safetensors files. Fix: download the model's weights into it")
    out = {}
    for name in files:
        p = d / name
        if not p.is_file():
            raise HFError(f"{p} is listed in {INDEX} but missing. Fix: download it")
        for k, v in read_header(p).items():
            out[k] = (v["dtype"], tuple(v["shape"]), name)
    return out


def problems(m: ModelConfig, path: str | Path) -> list[str]:
    """What keeps the directory from initializing a model of config `m`: config.json disagreeing
    with the model keys, tensors missing or of another shape. Empty when it fits."""
    try:
        keys = model_keys(read_config(path))
        found = mismatches(m, keys)
        if found:
            return [f"model.init_from={path}: " + "; ".join(found) + ". Fix: model=hf (the shape from "
                    "config.json), or the model keys config.json gives"]
        have = tensors(path)
    except HFError as e:
        return [str(e)]
    except KeyError as e:
        return [f"{Path(path) / CONFIG} lacks {e}: not a Llama config"]
    out = []
    for name, shape in expected_shapes(m).items():
        if name not in have:
            out.append(f"{path}: no tensor {name}")
        elif have[name][1] != shape:
            out.append(f"{Path(path) / have[name][2]}: {name} has shape {list(have[name][1])}, the model needs "
                       f"{list(shape)}. Fix: a checkpoint of this model's shape")
    return out[:5] + ([f"... and {len(out) - 5} more"] if len(out) > 5 else [])
