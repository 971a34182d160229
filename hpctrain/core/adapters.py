"""A PEFT LoRA adapter directory, read and checked without torch: adapter_config.json against
model.lora, and the tensors adapter_model.safetensors holds (from its header) against the adapters of
the model (the login node checks model.lora.init_from with it; hpctrain.checkpoint.peft_format reads
and writes the tensors).

Nothing of an adapter is dropped silently. hpctrain's adapters are plain LoRA: y = W x + (alpha / r)
B A x on the linear layers of model.lora.targets in every block. adapter_config.json's keys are of three
kinds: those read (peft_type, r, lora_alpha, target_modules), those that do not change the adapted model
(NO_EFFECT: accepted with any value), and options that do, which hpctrain does not implement (OFF:
accepted only unset, as PEFT writes them when they are off); a key hpctrain does not know is accepted
only unset too. Every tensor of the file must be one of the model's adapters, of its shape, and every
adapter of the model must be in the file.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from hpctrain.core import hf_format as hf
from hpctrain.core.shape import HF_LINEAR, LORA_TARGETS, moe_layer

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's LoraModel around a transformers model
# PEFT's target_modules when adapter_config.json gives none (its mapping for llama, qwen3 and mixtral)
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
READ = ("peft_type", "r", "lora_alpha", "target_modules")
# Keys that do not change the adapted model, with why.
NO_EFFECT = {
    "base_model_name_or_path": "where the base model came from",
    "revision": "the base model's revision",
    "task_type": "the model class PEFT wraps",
    "inference_mode": "whether PEFT trains the adapters",
    "auto_mapping": "the base model's class",
    "peft_version": "the PEFT version that saved it",
    "lora_dropout": "dropout while training: the run's model.lora.dropout applies",
    "init_lora_weights": "how the adapters started (the saved weights replace them); only those in PLAIN_INITS",
    "eva_config": "EVA's initialization (the saved weights replace it)",
    "megatron_core": "the module megatron_config names (megatron_config must be unset)",
    "qalora_group_size": "read only with use_qalora (which must be unset)",
    "ensure_weight_tying": "read only with modules_to_save or trainable_token_indices (which must be unset)",
    "runtime_config": "settings of the process that loads it",
}
# Options that change the model, which hpctrain does not implement: accepted only unset.
OFF = {
    "alpha_pattern": "a lora_alpha of its own for some modules",
    "rank_pattern": "a rank of its own for some modules",
    "modules_to_save": "whole modules trained and saved beside the adapters",
    "bias": "biases trained with the adapters",
    "lora_bias": "a bias on every lora_B",
    "use_dora": "DoRA's magnitude vectors",
    "use_rslora": "rsLoRA's scale alpha / sqrt(r)",
    "fan_in_fan_out": "weights stored transposed (GPT-2's Conv1D)",
    "layers_to_transform": "adapters in some layers only",
    "layers_pattern": "the layers layers_to_transform counts",
    "exclude_modules": "modules taken out of target_modules",
    "trainable_token_indices": "trained rows of the embedding",
    "layer_replication": "layers repeated into a deeper model",
    "target_parameters": "adapters on parameters (MoE experts)",
    "use_qalora": "QA-LoRA's pooled input",
    "megatron_config": "Megatron's parallel linear layers",
    "loftq_config": "LoftQ's quantized base weights",
    "corda_config": "CorDA's base weights (the adapters' part taken out of them)",
    "lora_ga_config": "LoRA-GA's base weights (the adapters' part taken out of them)",
    "velora_config": "VeLoRA's compressed activations",
    "monteclora_config": "MonteCLoRA's sampled adapters",
    "alora_invocation_tokens": "activated LoRA (adapters on the tokens after an invocation only)",
    "arrow_config": "Arrow's routing among several adapters",
    "kasa_config": "KaSA's singular-value adapters",
    "use_bdlora": "BD-LoRA's block-diagonal adapters",
}
# init_lora_weights values that only start the adapters: the others (pissa, olora, corda, loftq,
# lora_ga) change the base weights the adapters were trained on, or select a variant (mica).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
PLAIN = {"bias": '"none"', "init_lora_weights": "true"}  # a plain LoRA's value where it is not null (or false, {})
_ATTENTION = ("wq", "wk", "wv", "wo")


class AdapterError(ValueError):
    """An adapter directory that cannot be used; the message says why and how to fix it."""


def peft_name(name: str, arch: str) -> str:
    """hpctrain's layers.0.attention.wq.lora_A -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    layer, which = name.rsplit(".", 1)
    return PREFIX + hf.to_hf(f"{layer}.weight", arch)[:-len("weight")] + f"{which}.weight"


def read_adapter_config(path: str | os.PathLike, lora, model=None) -> dict:
    """adapter_config.json of an adapter directory, checked against model.lora (rank, alpha, targets,
    no option hpctrain does not implement); with `model` (the ModelConfig) also adapter_model.safetensors'
    tensors against the model's adapters, from its header. Cheap enough for the login node.
    AdapterError naming the file, the key or tensors, and the fix."""
    d = Path(path)
    if not ((d / CONFIG).exists() or (d / CONFIG).is_symlink()):
        raise AdapterError(f"{d / CONFIG} is missing: model.lora.init_from must be a PEFT adapter directory "
                           f"(adapter_config.json, adapter_model.safetensors). Fix: point it at one")
    try:
        cfg = json.loads(hf.read_small(d / CONFIG))
    except hf.HFError as e:  # a FIFO, a device, too big, unreadable
        raise AdapterError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise AdapterError(f"{d / CONFIG} is not JSON ({e}). Fix: export or download the adapter again") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{d / CONFIG} is not a LoRA adapter's config")
    found = _config_problems(cfg, lora, d)
    weights = d / WEIGHTS
    if not (weights.exists() or weights.is_symlink()):
        found.append(f"{weights} is missing. Fix: export or download the adapter again")
    elif not weights.is_file():
        found.append(f"{weights} is not a regular file ({hf.file_kind(os.stat(weights).st_mode)}). Fix: export "
                     f"or download the adapter again")
    if not found and model is not None:
        found = tensor_problems(d, model)
    if found:
        raise AdapterError("; ".join(found))
    return cfg


def _show(v) -> str:
    return json.dumps(v)[:60]


def _unset(key: str, v) -> bool:
    """The value PEFT writes for an option that is off."""
    return v is None or v is False or v == {} or v == [] or v == "" or (key == "bias" and v == "none")


def _config_problems(cfg: dict, lora, d: Path) -> list[str]:
    """What in adapter_config.json keeps the adapter from being model.lora's, each with the fix."""
    out, where = [], d / CONFIG
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
        out.append(f"{where}: r={_show(r)} must be a positive whole number (the adapters' rank)")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0):
        out.append(f"{where}: lora_alpha={_show(alpha)} must be a finite number above 0 (the update's scale "
                   f"alpha / r)")
    if out:
        return [p + ". Fix: export or download the adapter again" for p in out]
    if r != lora.rank or float(alpha) != float(lora.alpha):
        out.append(f"{d} has rank {r} and alpha {alpha}, the run asks for model.lora.rank={lora.rank} "
                   f"model.lora.alpha={lora.alpha}. Fix: set them to the adapter's")
    on = [k for k, v in cfg.items() if k not in READ and k not in NO_EFFECT and not _unset(k, v)]
    init = cfg.get("init_lora_weights", True)
    if not any(init is p or (isinstance(p, str) and init == p) for p in PLAIN_INITS):
        on.append("init_lora_weights")
    if on:
        what = {**OFF, "init_lora_weights": f"an initialization that changes the base weights or the layer; "
                                            f"hpctrain reads {', '.join(json.dumps(p) for p in PLAIN_INITS)}"}
        listed = "; ".join(f"{k}={_show(cfg[k])} ({what.get(k, 'an option hpctrain does not know')})" for k in on)
        one = len(on) == 1
        plain = ", ".join(f"{k}={PLAIN.get(k, 'null')}" for k in on)
        out.append(f"{where}: {listed}: hpctrain does not implement {'this' if one else 'these'}, and the adapter "
                   f"without {'it' if one else 'them'} is another model. Fix: an adapter trained as plain LoRA "
                   f"({plain})")
    out += _target_problems(cfg.get("target_modules"), lora, where)
    return out


def _target_problems(given, lora, where: Path) -> list[str]:
    """target_modules (PEFT: a module whose name is an entry or ends in "." + an entry) against
    model.lora.targets, by the linear layers they name; which layers get them is the tensors' check."""
    if given is None:
        given = list(PEFT_DEFAULT_TARGETS)
    if not (isinstance(given, list) and all(isinstance(t, str) for t in given)):
        return [f"{where}: target_modules={_show(given)} is not a list of module names (a string is PEFT's "
                f"regular expression, which hpctrain does not read). Fix: list the modules: "
                f"target_modules=[\"q_proj\", ...]"]
    kinds = {t.rsplit(".", 1)[-1] for t in given}
    other = sorted(kinds - set(HF_LINEAR))
    if other:
        return [f"{where}: target_modules names {', '.join(other)}, which {'is' if len(other) == 1 else 'are'} "
                f"not among the linear layers of a block that hpctrain adapts ({', '.join(HF_LINEAR)}). Fix: an "
                f"adapter of those layers only"]
    ours = {HF_LINEAR.get(t, t) for t in lora.targets}
    if {HF_LINEAR[k] for k in kinds} != ours:
        names = sorted(kinds, key=list(HF_LINEAR).index)
        return [f"{where}: target_modules gives adapters to {', '.join(names)}, the run to model.lora.targets="
                f"[{','.join(lora.targets)}]. Fix: model.lora.targets=[{','.join(names)}]"]
    return []


def adapter_shapes(model) -> dict[str, tuple]:
    """PEFT name -> shape of every adapter tensor of a model with model.lora: lora_A (r, in) and lora_B
    (out, r) of each targeted linear layer of each block (a Mixture-of-Experts block's routed experts
    have none)."""
    try:
        arch, base = hf.architecture(model), hf.expected_shapes(model)  # bounded: hf_format.MAX_TENSORS
    except hf.HFError as e:
        raise AdapterError(f"model.lora.init_from: {e}") from None
    r, out = model.lora.rank, {}
    targets = [t for t in LORA_TARGETS if t in {HF_LINEAR.get(x, x) for x in model.lora.targets}]
    for i in range(model.n_layers):
        for t in targets:
            if t not in _ATTENTION and moe_layer(model, i):
                continue
            layer = f"layers.{i}.{'attention' if t in _ATTENTION else 'feed_forward'}.{t}"
            rows, cols = base[hf.to_hf(f"{layer}.weight", arch)]
            out[peft_name(f"{layer}.lora_A", arch)] = (r, cols)
            out[peft_name(f"{layer}.lora_B", arch)] = (rows, r)
    return out


def _adapted_layer(name: str) -> str | None:
    """q_proj for PEFT's ...self_attn.q_proj.lora_A.weight; None for a tensor of anything else."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2:] in (["lora_A", "weight"], ["lora_B", "weight"]) and parts[-3] in HF_LINEAR:
        return parts[-3]
    return None


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def tensor_problems(path: str | os.PathLike, model) -> list[str]:
    """adapter_model.safetensors' tensors (its header) against the model's adapters: none the model has
    no place for, none missing, each of its shape and floating point."""
    f = Path(path) / WEIGHTS
    try:
        have = hf.read_header(f)
    except hf.HFError as e:
        return [f"{e}"]
    wanted = adapter_shapes(model)
    out = []
    unused = sorted(n for n in have if n not in wanted)
    if unused:
        kinds = sorted({k for k in map(_adapted_layer, have) if k}, key=list(HF_LINEAR).index)
        ours = {HF_LINEAR.get(t, t) for t in model.lora.targets}
        fix = (f"model.lora.targets=[{','.join(kinds)}] (the layers the file adapts) and the model the adapter was "
               f"trained on" if kinds and {HF_LINEAR[k] for k in kinds} != ours
               else "the model the adapter was trained on, or an adapter of LoRA tensors only")
        out.append(f"{f} holds {len(unused)} tensor{'s' * (len(unused) > 1)} this run's model has no adapter for "
                   f"(they would be dropped): {_few(unused)}. Fix: {fix}")
    missing = [n for n in wanted if n not in have]
    if missing:
        out.append(f"{f} lacks {len(missing)} of the model's {len(wanted)} adapter tensors (they would stay at "
                   f"their initial values): {_few(missing)}. Fix: model.lora.targets and the model the adapter "
                   f"was trained on")
    wrong = [n for n in wanted if n in have and (tuple(have[n]["shape"]) != wanted[n]
                                                 or have[n]["dtype"] not in hf.FLOAT_DTYPES)]
    if wrong:
        listed = "; ".join(f"{n} is {have[n]['dtype']} {have[n]['shape']}, the model's {list(wanted[n])}"
                           for n in wrong[:3])
        out.append(f"{f}: {listed}" + (f"; ... ({len(wrong)} in all)" if len(wrong) > 3 else "") + ". Fix: the "
                   f"model the adapter was trained on, its weights floating point")
    return out
