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

Beside the weights: the tokenizer the run trained with (the shard directory's, else model.init_from's)
with its chat template files, and, from a fine-tuned model's base (model.init_from), its
generation_config.json and chat templates, and in config.json its max_position_embeddings (or
data.seq_len where that is longer), RoPE description and bos/eos/pad ids. Without a base: the tokenizer's
bos/eos ids (the shards' end-of-document id as eos) and a generation_config.json made from config.json,
as transformers' GenerationConfig.from_model_config makes it. Files are copied out of a user's directory
only when they are regular files inside it once symlinks are resolved (hf_format.inside); one that is
not is left out, with a note.
"""
from __future__ import annotations

import json
import math
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
from hpctrain.data.chat import TEMPLATE_FILES
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


def frozen_dtype(info: dict) -> torch.dtype:
    """The dtype a LoRA run stores its frozen base in: its compute dtype (bf16, fp16; fp32 otherwise)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(info["config"]["train"].get("precision"), torch.float32)


class ModelTensors:
    """The model's tensors an export writes, by hpctrain's name: those the checkpoint holds and, from an
    adapter-only checkpoint (checkpoint.weights=adapters), the frozen base's, read from the model.init_from
    it records (or `base`, where the base moved) once its fingerprint is found equal to the recorded one
    (hpctrain.checkpoint.base), in the parameters' dtype as a full checkpoint would hold them."""

    def __init__(self, step_dir: Path, md, info: dict, base: str | os.PathLike | None = None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.step_dir = Path(step_dir)
        self.meta = {k[len("model."):]: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
                     if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
        self.base, self._from_base, self._opened = None, set(), {}
        if info.get("weights") != "adapters":
            return
        from hpctrain.models.llama import build_meta
        from hpctrain.parallel.stateful import in_base

        self.base = base_of(self.step_dir, info, base)
        model_cfg = model_config(info["config"]["model"])
        self.arch, self._where = hf.architecture(model_cfg), hf.tensors(self.base)
        # the dtype a full checkpoint of the run holds its frozen base in (hpctrain.models.lora.store_frozen_as:
        # the compute dtype), not the adapters' (fp32 masters under bf16: the base would double in size)
        dtype = frozen_dtype(info)
        for name, p in build_meta(model_cfg, info["config"]["data"]["seq_len"]).named_parameters():
            if name not in self.meta and in_base(name):
                self.meta[name] = (tuple(p.shape), dtype)
                self._from_base.add(name)

    def names(self) -> list[str]:
        return list(self.meta)

    def numel(self, name: str) -> int:
        return math.prod(self.meta[name][0])

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]

    def read(self, name: str) -> torch.Tensor:
        if name not in self._from_base:
            return _read(self.step_dir, name)
        from safetensors import safe_open

        parts = []
        for hf_name in hf.hf_names(name, self.arch, self.meta[name][0][0]):
            file = self.base / self._where[hf_name][2]
            f = self._opened.get(file) or self._opened.setdefault(file, safe_open(str(file), "pt"))
            parts.append(f.get_tensor(hf_name))
        return (torch.stack(parts) if hf.is_expert(name) else parts[0]).to(self.meta[name][1])


def base_of(step_dir: Path, info: dict, base: str | os.PathLike | None) -> Path:
    """The base an adapter-only checkpoint's export reads: `base` (--base), else the model.init_from it
    records; HFError with the fix when it is not there or is not the base the adapters were trained on."""
    from hpctrain.checkpoint.base import difference

    recorded = info.get("base") if isinstance(info.get("base"), dict) else {}
    at = recorded.get("init_from")
    path = Path(base) if base else Path(at) if at else None
    if path is None:
        raise hf.HFError(f"{step_dir} holds only the LoRA adapters and records no base model. Fix: --base DIR, the "
                         "Hugging Face directory it was trained on")
    if not path.is_dir():
        said = "--base" if base else "the base it records (model.init_from)"
        raise hf.HFError(f"{step_dir} holds only the LoRA adapters; {said}, {path}, is not a directory (moved or "
                         "deleted?). Fix: --base DIR, the Hugging Face directory of the base it was trained on")
    why = difference(recorded, path)
    if why:
        raise hf.HFError(f"{path} is not the base {step_dir} was trained on ({at}): {why}. Fix: --base DIR, the "
                         "base it was trained on (a copy elsewhere is fine)")
    return path


def export_hf(step_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "keep",
              shard_bytes: int = 5 << 30, notes: list | None = None, base: str | os.PathLike | None = None) -> dict:
    """Write the checkpoint's model as a Hugging Face Llama directory; returns the index. `notes` gets
    what the export left out or could not take from the base (files outside it, a config.json gone).
    `base`: an adapter-only checkpoint's base where it is no longer at the model.init_from it records."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    md = read_metadata(step_dir)
    check_files(step_dir, md)
    info = read_info(step_dir)
    model_cfg = model_config(info["config"]["model"])
    arch = hf.architecture(model_cfg)  # HFError before anything is written when no format holds the model
    src = ModelTensors(step_dir, md, info, base)
    names = src.names()
    # The balancing bias shifts which experts are picked; no Hugging Face format here holds it.
    names = [n for n in names if not n.endswith("moe.router.bias")]
    # A LoRA run's adapters are merged into their layers' weights (W + alpha / rank B A): a plain model.
    adapted = {n[:-len("lora_A")] + "weight" for n in names if n.endswith("lora_A")}
    names = [n for n in names if not is_adapter(n)]
    if model_cfg.tie_embeddings:
        names = [n for n in names if n != "output.weight"]
    order = sorted(names, key=_hf_order)
    target = {n: DTYPES[dtype] if dtype != "keep" else src.dtype(n) for n in order}
    sizes = [(n, src.numel(n) * target[n].itemsize) for n in order]
    shards = _plan_shards(sizes, shard_bytes)
    with outdir.replacing(out_dir, TOOL) as tmp:  # refuses a directory holding files it did not write
        return _write(src, tmp, info, model_cfg, order, target, shards, arch, adapted,
                      notes if notes is not None else [])


def _nf4_base(w: torch.Tensor, name: str, info: dict) -> torch.Tensor:
    """A QLoRA run's base weight as it trained on it: NF4 of each tensor-parallel shard (the checkpoint's
    layout's tp) in its frozen dtype, dequantised (hpctrain.parallel.quantize.dequantised), as PEFT's QLoRA
    merges (merge_and_unload into the dequantised weights): the merged model computes what the run did."""
    from hpctrain.parallel.quantize import dequantised

    tp = int((info.get("layout") or {}).get("tp", 1))
    frozen = frozen_dtype(info)
    return dequantised(w, name, tp, frozen)


def _read(step_dir: Path, name: str) -> torch.Tensor:
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(str(step_dir)),
                     planner=_EmptyStateDictLoadPlanner(keys={f"model.{name}"}), no_dist=True)
    return state["model"][name] if "model" in state else state[f"model.{name}"]


def _write(src: ModelTensors, out_dir: Path, info: dict, model_cfg, order: list[str], target: dict,
           shards: list[list[str]], arch: str, adapted: set = frozenset(), notes: list | None = None) -> dict:
    """Write the planned safetensors files, their index, config.json, generation_config.json, the
    tokenizer and the base's files into the new, empty directory `out_dir`; returns the index."""
    notes = [] if notes is None else notes
    seq_len = info["config"]["data"]["seq_len"]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, offset = {}, 0
        for n in shard:
            shape = list(src.meta[n][0])
            names = hf.hf_names(n, arch, shape[0])
            if hf.is_expert(n):
                shape = shape[1:]  # one tensor per expert, each expert's bytes contiguous in ours
            nbytes = src.numel(n) * target[n].itemsize // len(names)
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
                t = src.read(n)
                if n in adapted:  # in fp32, then cast: the update may be far below the weight's bf16 step
                    layer = n[:-len("weight")]
                    if str(model_cfg.lora.quantize) == "nf4":  # QLoRA: into the base the adapters trained on
                        t = _nf4_base(t, n, info)
                    update = src.read(layer + "lora_B").float() @ src.read(layer + "lora_A").float()
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
    config.update(_copy_tokenizer(info["config"], out_dir, notes))
    base = info["config"]["model"].get("init_from")
    if base:
        config.update(_from_base(base, model_cfg, seq_len, notes))
        if config.get("rope_scaling", 0) is None:  # the base says it as rope_parameters alone
            del config["rope_scaling"]
        for name in BASE_FILES:  # the tokenizer's own template, copied with it, stays
            if not (out_dir / name).exists():
                _copy_inside(base, name, out_dir, notes)
    if not (out_dir / GENERATION_CONFIG).exists():  # transformers' GenerationConfig.from_model_config
        generation = {"_from_model_config": True, **{k: config[k] for k in TOKEN_IDS if config.get(k) is not None}}
        (out_dir / GENERATION_CONFIG).write_text(json.dumps(generation, indent=1))
    (out_dir / hf.CONFIG).write_text(json.dumps(config, indent=1))
    return index


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *TEMPLATE_FILES)
GENERATION_CONFIG = "generation_config.json"
BASE_FILES = (GENERATION_CONFIG, *TEMPLATE_FILES)  # copied from model.init_from when it has them
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _copy_inside(directory: str | os.PathLike, name: str, out_dir: Path, notes: list) -> bool:
    """Copy directory/name into out_dir when it is a regular file inside `directory` (symlinks resolved);
    a note says why not when it is something else. False when nothing was copied."""
    real, why = hf.inside(directory, name)
    if real is None:
        if why and f"{why}: not copied into the export" not in notes:
            notes.append(f"{why}: not copied into the export")
        return False
    shutil.copyfile(real, out_dir / name)
    return True


def _copy_tokenizer(run_config: dict, out_dir: Path, notes: list | None = None) -> dict:
    """Put the tokenizer the run trained with beside the weights (from the shard directory, else
    from model.init_from), with its chat template files, so that AutoTokenizer loads the export as it
    is; returns the config.json keys naming its bos and eos ids (eos: the shards' end-of-document id)."""
    notes = [] if notes is None else notes
    data = run_config.get("data", {})
    paths = [s["path"] for s in data.get("sources") or []] or [data.get("path")]
    candidates = [(p, (read_meta(p) or {}).get("eos_id")) for p in paths if p and p != "???"]
    if run_config["model"].get("init_from"):
        candidates.append((run_config["model"]["init_from"], None))
    for src, eos_id in candidates:
        real, why = hf.inside(src, "tokenizer.json")
        if real is None:
            if why:
                notes.append(f"{why}: the tokenizer is not copied from {src}")
            continue
        for name in TOKENIZER_FILES:
            _copy_inside(src, name, out_dir, notes)
        ids = _tokenizer_ids(out_dir)
        return ids if eos_id is None else {**ids, "eos_token_id": eos_id}
    return {}


def _tokenizer_ids(out_dir: Path) -> dict:
    """bos/eos/pad ids of the tokenizer copied into out_dir: its tokenizer_config.json's tokens, looked up
    in its tokenizer.json (a token it lacks, or an unreadable file: no id)."""
    from tokenizers import Tokenizer

    from hpctrain.data.chat import token_text

    try:
        cfg = json.loads(hf.read_small(out_dir / "tokenizer_config.json"))
        tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    except Exception:  # absent, not JSON, not a tokenizer: the ids stay unset, as before
        return {}
    out = {}
    for key in TOKEN_IDS:
        text = token_text(cfg.get(key[:-len("_id")])) if isinstance(cfg, dict) else None
        if text is not None and tok.token_to_id(text) is not None:
            out[key] = tok.token_to_id(text)
    return out


def _from_base(base: str, model_cfg, seq_len: int, notes: list) -> dict:
    """config.json keys a fine-tuned model keeps from its base's config.json: max_position_embeddings
    (data.seq_len where the run trained on longer sequences), bos/eos/pad ids, and its RoPE description
    as written (rope_scaling, rope_parameters) when its model keys are still the run's."""
    try:
        cfg = json.loads(hf.read_small(Path(base) / hf.CONFIG))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as e:  # HFError is a ValueError: absent, not a regular file, too big
        notes.append(f"the base model's {Path(base) / hf.CONFIG} cannot be read ({e}): config.json has "
                     f"max_position_embeddings={seq_len} (data.seq_len) and the tokenizer's token ids")
        return {}
    out = {k: cfg[k] for k in TOKEN_IDS if cfg.get(k) is not None}
    longest = cfg.get("max_position_embeddings")
    if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0:
        out["max_position_embeddings"] = max(longest, seq_len)
    try:
        same = not hf.mismatches(model_cfg, hf.model_keys(cfg))
    except hf.HFError:
        same = False
    if same and any(k in cfg for k in ("rope_scaling", "rope_parameters")):
        out.update({k: cfg.get(k) for k in ("rope_scaling", "rope_parameters") if k in cfg})
        out.setdefault("rope_scaling", None)  # none but the base's
    return out


def _hf_order(name: str) -> tuple:
    """Embedding, blocks in order, final norm, output: the order transformers writes."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return (1, int(i), rest)
    return (0 if name.startswith("tok_") else 2, 0, name)
