"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, the tensors named
as PEFT's LoraModel names them on a transformers model (base_model.model.<the layer's Hugging Face
name>.lora_A.weight). `export_peft` writes a checkpoint's adapters so that peft.PeftModel.from_pretrained
loads them; `load_peft` reads such a directory into a model's adapters (model.lora.init_from).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpctrain.core import hf_format as hf
from hpctrain.core import outdir
from hpctrain.core.shape import is_adapter
from hpctrain.core.adapters import (CONFIG, PREFIX, WEIGHTS, AdapterError, peft_name,  # noqa: F401 (re-exported)
                                    read_adapter_config)

TOOL = "hpctrain.checkpoint export --format peft"


def adapter_config(lora, arch: str, base: str | None) -> dict:
    """PEFT's LoraConfig fields for model.lora."""
    from hpctrain.core.shape import HF_LINEAR

    to_hf = {v: k for k, v in HF_LINEAR.items()}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora.rank), "lora_alpha": float(lora.alpha),
            "lora_dropout": float(lora.dropout), "target_modules": sorted(to_hf.get(t, t) for t in lora.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base,
            "auto_mapping": {"base_model_class": arch, "parent_library": "transformers.models"}}


def export_peft(step_dir: str | os.PathLike, out_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> dict:
    """Write the adapters of a LoRA run's checkpoint as a PEFT adapter directory; returns its config.
    `base`: the base model to name in it (base_model_name_or_path) instead of the run's model.init_from,
    checked first to be the base the adapters were trained on where the checkpoint records one."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from hpctrain.checkpoint.directories import read_info
    from hpctrain.checkpoint.safe import SafeReader, check_files, read_metadata
    from hpctrain.checkpoint.hf_weights import model_config

    step_dir, out_dir = Path(step_dir), Path(out_dir)
    md = read_metadata(step_dir)
    check_files(step_dir, md)
    info = read_info(step_dir)
    model_cfg = model_config(info["config"]["model"])
    keys = {k for k in md.state_dict_metadata if k.startswith("model.") and is_adapter(k)}
    if not keys or model_cfg.lora.rank <= 0:
        raise AdapterError(f"{step_dir} holds no LoRA adapters (a run without model.lora.rank). Fix: export its "
                           f"weights with --format hf instead")
    arch = hf.architecture(model_cfg)
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(str(step_dir)), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    flat = state["model"] if "model" in state else {k[len("model."):]: v for k, v in state.items()}
    tensors = {peft_name(k, arch): v.detach().contiguous() for k, v in flat.items()}
    if base is not None and isinstance(info.get("base"), dict):
        from hpctrain.checkpoint.hf_weights import base_of

        base_of(step_dir, info, base)  # HFError when it is not the same weights
    config = adapter_config(model_cfg.lora, arch, str(base) if base is not None else info["config"]["model"].get("init_from"))
    with outdir.replacing(out_dir, TOOL) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=1))
    return config


def read_adapter(path: str | os.PathLike, model_cfg) -> dict:
    """{PEFT name: tensor} of an adapter directory, checked first against the model's adapters
    (read_adapter_config: its options and every tensor's name and shape, from the header)."""
    from safetensors.torch import load_file

    d = Path(path)
    read_adapter_config(d, model_cfg.lora, model_cfg)
    try:
        return load_file(str(d / WEIGHTS))
    except Exception as e:  # safetensors raises its own error type on a damaged file
        raise AdapterError(f"{d / WEIGHTS} cannot be read ({e}). Fix: export or download the adapter again") from None


def load_peft(parts: list, path: str | os.PathLike, model_cfg) -> int:
    """Fill the adapters of this rank's model parts from a PEFT adapter directory; all ranks call it
    together. Each rank keeps its own slice of every full tensor (DTensor parameters: FSDP2, TP).
    Returns how many tensors it filled."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    arch = hf.architecture(model_cfg)
    tensors = read_adapter(path, model_cfg)
    n = 0
    with torch.no_grad():
        for part in parts:
            # the plain model's names, whatever wraps it; the values are the parameters themselves
            for name, p in get_model_state_dict(part).items():
                if not is_adapter(name):
                    continue
                key = peft_name(name, arch)
                if key not in tensors:
                    raise AdapterError(f"{path}/{WEIGHTS} has no {key}: its target_modules differ from "
                                       f"model.lora.targets. Fix: set model.lora.targets to the adapter's")
                full = tensors[key].to(p.dtype)
                if tuple(full.shape) != tuple(p.shape):
                    raise AdapterError(f"{path}: {key} is {tuple(full.shape)}, this model's is {tuple(p.shape)}")
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                                         src_data_rank=None).to_local())
                else:
                    p.copy_(full)
                n += 1
    return n
