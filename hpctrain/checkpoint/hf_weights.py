"""Weights in and out of the Hugging Face formats (names and shapes in hpctrain.core.hf_format).

In: `load_hf(parts, path)` fills this rank's parameters (any layout: FSDP2, TP, PP shards, offloaded)
from a directory of safetensors files with DCP's HuggingFaceStorageReader: every rank plans its reads
from its own shards and reads only those slices; no tensor is materialized whole anywhere.
The experts of a Mixture-of-Experts layer, one stacked (experts, ...) tensor here and one tensor per
expert there, are read the same way by hand: each rank reads the slices of the experts its shard holds
(safetensors' get_slice).

Out: `export_hf(step_dir, out_dir, dtype)` writes config.json and safetensors files of at most
`shard_bytes` with their index, from a checkpoint of any layout, one tensor at a time: the headers are
planned from the checkpoint's metadata before any tensor is read, then each tensor is read (resharded
by DCP into one whole tensor), cast, written and dropped, so memory stays at the largest tensor.
out_dir is new, empty, or an earlier export (hpctrain.core.outdir): the export is built beside it and
swapped in whole, so no weights file of an earlier export (a single model.safetensors beside new
shards) stays for transformers to load, and files the export did not write are never touched.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hpctrain.core import hf_format as hf
from hpctrain.core import outdir
from hpctrain.core.compose import model_config
from hpctrain.core.shape import is_adapter
from hpctrain.checkpoint.safe import SafeReader, check_files, read_metadata
from hpctrain.core.rundir import read_info
from hpctrain.data.shards import read_meta

SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOOL = "hpctrain.checkpoint export --format hf"  # the name in the marker of its output directories


def load_hf(parts: list, path: str | os.PathLike, model) -> int:
    """Load a Hugging Face model's weights into this rank's model parts; all ranks call it together.
    `model`: the ModelConfig (its tied output projection is the embedding, not stored separately).
    Returns how many tensors this rank loaded."""
    arch = hf.architecture(model)
    state, experts = {}, {}
    for part in parts:
        for name, t in get_model_state_dict(part).items():
            if name == "output.weight" and model.tie_embeddings:
                continue  # the embedding is loaded; the output is the same tensor
            if name.endswith("moe.router.bias"):
                continue  # the balancing bias starts at zero; no Hugging Face format holds it
            if is_adapter(name):
                continue  # adapters: PEFT's format (model.lora.init_from), never the base model's
            if hf.is_expert(name):
                experts[hf.to_hf(name, arch)] = t
            else:
                state[hf.to_hf(name, arch)] = t
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path), thread_count=4))
    if experts:
        _load_experts(experts, Path(path))
    return len(state) + len(experts)


@torch.no_grad()
def _load_experts(experts: dict, path: Path) -> None:
    """Fill each stacked expert tensor's local shard from the per-expert tensors ("{e}" in the name)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    where = hf.tensors(path)
    opened: dict = {}
    for pattern, t in experts.items():
        if isinstance(t, DTensor):
            local = t.to_local()
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        else:
            local, shape, offset = t, tuple(t.shape), (0,) * t.ndim
        if local.numel() == 0:
            continue
        (e0, r0, c0), (ne, nr, nc) = offset, shape
        for e in range(e0, e0 + ne):
            name = pattern.format(e=e)
            file = path / where[name][2]
            f = opened.get(file) or opened.setdefault(file, safe_open(str(file), "pt"))
            local[e - e0].copy_(f.get_slice(name)[r0:r0 + nr, c0:c0 + nc])


# ------------------------------------------------------------------------------------------ export

def _plan_shards(sizes: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    shards, cur, used = [], [], 0
    for name, n in sizes:
        if cur and used + n > shard_bytes:
            shards.append(cur)
            cur, used = [], 0
        cur.append(name)
        used += n
    if cur:
        shards.append(cur)
    return shards


def export_hf(step_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "keep",
              shard_bytes: int = 5 << 30) -> dict:
    """Write the checkpoint's model as a Hugging Face Llama directory; returns the index."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    md = read_metadata(step_dir)
    check_files(step_dir, md)
    info = read_info(step_dir)
    model_cfg = model_config(info["config"]["model"])
    arch = hf.architecture(model_cfg)  # HFError before anything is written when no format holds the model
    names = [k[len("model."):] for k in md.state_dict_metadata if k.startswith("model.")]
    # The balancing bias shifts which experts are picked; no Hugging Face format here holds it.
    names = [n for n in names if not n.endswith("moe.router.bias")]
    # A LoRA run's adapters are merged into their layers' weights (W + alpha / rank B A): a plain model.
    adapted = {n[:-len("lora_A")] + "weight" for n in names if n.endswith("lora_A")}
    names = [n for n in names if not is_adapter(n)]
    if model_cfg.tie_embeddings:
        names = [n for n in names if n != "output.weight"]
    order = sorted(names, key=_hf_order)
    target = {n: DTYPES[dtype] if dtype != "keep" else md.state_dict_metadata[f"model.{n}"].properties.dtype
              for n in order}
    sizes = [(n, md.state_dict_metadata[f"model.{n}"].size.numel() * target[n].itemsize) for n in order]
    shards = _plan_shards(sizes, shard_bytes)
    with outdir.replacing(out_dir, TOOL) as tmp:  # refuses a directory holding files it did not write
        return _write(step_dir, tmp, md, info, model_cfg, order, target, shards, arch, adapted)


def _read(step_dir: Path, name: str) -> torch.Tensor:
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(str(step_dir)),
                     planner=_EmptyStateDictLoadPlanner(keys={f"model.{name}"}), no_dist=True)
    return state["model"][name] if "model" in state else state[f"model.{name}"]


def _write(step_dir: Path, out_dir: Path, md, info: dict, model_cfg, order: list[str], target: dict,
           shards: list[list[str]], arch: str, adapted: set = frozenset()) -> dict:
    """Write the planned safetensors files, their index, config.json and the tokenizer into the new,
    empty directory `out_dir`; returns the index."""
    seq_len = info["config"]["data"]["seq_len"]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, offset = {}, 0
        for n in shard:
            shape = list(md.state_dict_metadata[f"model.{n}"].size)
            names = hf.hf_names(n, arch, shape[0])
            if hf.is_expert(n):
                shape = shape[1:]  # one tensor per expert, each expert's bytes contiguous in ours
            nbytes = md.state_dict_metadata[f"model.{n}"].size.numel() * target[n].itemsize // len(names)
            for name in names:
                header[name] = {"dtype": SAFETENSORS_DTYPE[target[n]], "shape": shape,
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(out_dir / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for n in shard:
                t = _read(step_dir, n)
                if n in adapted:  # in fp32, then cast: the update may be far below the weight's bf16 step
                    layer = n[:-len("weight")]
                    update = _read(step_dir, layer + "lora_B").float() @ _read(step_dir, layer + "lora_A").float()
                    t = t.float() + update * (model_cfg.lora.alpha / model_cfg.lora.rank)
                f.write(t.detach().to(target[n]).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                weight_map.update({name: fname for name in hf.hf_names(n, arch, t.shape[0])})
                total += t.numel() * target[n].itemsize
                del t
            f.flush()
            os.fsync(f.fileno())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / hf.INDEX).write_text(json.dumps(index, indent=1))
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[target[order[0]]]
    config = hf.to_config(model_cfg, seq_len, dtype_name)
    config.update(_copy_tokenizer(info["config"], out_dir))
    (out_dir / hf.CONFIG).write_text(json.dumps(config, indent=1))
    return index


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(run_config: dict, out_dir: Path) -> dict:
    """Put the tokenizer the run trained with beside the weights (from the shard directory, else
    from model.init_from), so that AutoTokenizer loads the export as it is; returns the config.json
    keys naming its end-of-document id."""
    data = run_config.get("data", {})
    paths = [s["path"] for s in data.get("sources") or []] or [data.get("path")]
    candidates = [(p, (read_meta(p) or {}).get("eos_id")) for p in paths if p and p != "???"]
    if run_config["model"].get("init_from"):
        candidates.append((run_config["model"]["init_from"], None))
    for src, eos_id in candidates:
        if (Path(src) / "tokenizer.json").is_file():
            for name in TOKENIZER_FILES:
                if (Path(src) / name).is_file():
                    shutil.copyfile(Path(src) / name, out_dir / name)
            return {} if eos_id is None else {"eos_token_id": eos_id}
    return {}


def _hf_order(name: str) -> tuple:
    """Embedding, blocks in order, final norm, output: the order transformers writes."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return (1, int(i), rest)
    return (0 if name.startswith("tok_") else 2, 0, name)
