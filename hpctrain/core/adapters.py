"""A PEFT LoRA adapter directory's config, read and checked without torch (the login node checks
model.lora.init_from with it; hpctrain.checkpoint.peft_format reads and writes the tensors)."""
from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter directory that cannot be used; the message says why and how to fix it."""


def read_adapter_config(path: str | os.PathLike, lora) -> dict:
    """adapter_config.json of an adapter directory, checked against model.lora (rank, alpha); cheap
    enough for the login node."""
    d = Path(path)
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{d / CONFIG} cannot be read ({e}): model.lora.init_from must be a PEFT adapter "
                           f"directory (adapter_config.json, adapter_model.safetensors)") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{d / CONFIG} is not a LoRA adapter's config")
    if cfg.get("r") != lora.rank or float(cfg.get("lora_alpha", -1)) != float(lora.alpha):
        raise AdapterError(f"{d} has rank {cfg.get('r')} and alpha {cfg.get('lora_alpha')}, the run asks for "
                           f"model.lora.rank={lora.rank} model.lora.alpha={lora.alpha}. Fix: set them to the adapter's")
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{d / CONFIG}: rsLoRA, DoRA and fan_in_fan_out adapters are not supported")
    if not (d / WEIGHTS).is_file():
        raise AdapterError(f"{d / WEIGHTS} is missing. Fix: export or download the adapter again")
    return cfg
