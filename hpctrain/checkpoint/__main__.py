"""Checkpoint tools that need no cluster.

    python -m hpctrain.checkpoint export <step dir> <out dir> --format hf [--dtype bf16|fp32|fp16|keep]
    python -m hpctrain.checkpoint export <step dir> <file> [--dtype ...]
    python -m hpctrain.checkpoint list <run dir>

`export --format hf` writes a Hugging Face Llama directory (config.json, safetensors files of at most
--shard-gb with their index, Hugging Face's names) that transformers' LlamaForCausalLM.from_pretrained
loads, streaming one tensor at a time (hpctrain.checkpoint.hf_weights), into a new or empty directory or an
earlier export, which it replaces whole (hpctrain.core.outdir). Without --format hf: one consolidated
file with hpctrain's parameter names, safetensors when <file> ends in .safetensors, otherwise
torch.save of a flat {name: tensor} dict. Either way from a checkpoint of any layout.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hpctrain.checkpoint import directories as store
from hpctrain.checkpoint.safe import DamagedCheckpoint, SafeReader, check_files, read_metadata
from hpctrain.checkpoint.hf_weights import export_hf
from hpctrain.core.outdir import OutputDirError


def export(step_dir: Path, out: Path, dtype: str = "keep") -> dict:
    md = read_metadata(step_dir)
    check_files(step_dir, md)
    keys = {k for k in md.state_dict_metadata if k.startswith("model.")}
    state: dict = {}
    # Reads every model tensor whole, in one process, without a process group.
    _load_state_dict(state, storage_reader=SafeReader(str(step_dir)),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    flat = {}
    for k, v in _flatten(state).items():
        if k.startswith("model."):
            t = v.detach().contiguous()
            if dtype != "keep":
                t = t.to({"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype])
            flat[k[len("model."):]] = t
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        save_file(flat, str(out), metadata={"format": "pt", "source": str(step_dir)})
    else:
        torch.save(flat, out)
    return flat


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write one consolidated weights file")
    e.add_argument("step_dir", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--dtype", choices=("keep", "bf16", "fp32", "fp16"), default="keep")
    e.add_argument("--format", choices=("file", "hf"), default="file",
                   help="hf: a Hugging Face Llama directory (out is a directory)")
    e.add_argument("--shard-gb", type=float, default=5.0, help="with --format hf: the largest safetensors file")
    ls = sub.add_parser("list", help="complete checkpoints of a run")
    ls.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)

    if args.cmd == "list":
        for step, path in store.list_complete(args.run_dir / "checkpoints"):
            info = store.read_info(path)
            print(f"{step:>10}  {path}  world {info.get('world_size')}  tokens {info.get('tokens_seen', 0):,}")
        return 0
    if not store.is_complete(args.step_dir):
        print(f"error: {args.step_dir} is not a complete checkpoint (a step-NNNNNNNN directory with "
              f"{store.DCP_METADATA} and {store.INFO})", file=sys.stderr)
        return 2
    try:
        if args.format == "hf":
            index = export_hf(args.step_dir, args.out, args.dtype, int(args.shard_gb * 1e9))
            files = sorted(set(index["weight_map"].values()))
            print(f"wrote a Hugging Face Llama: {len(index['weight_map'])} tensors, "
                  f"{index['metadata']['total_size'] / 1e9:.3f} GB in {len(files)} file(s) -> {args.out}")
            return 0
        flat = export(args.step_dir, args.out, args.dtype)
    except (DamagedCheckpoint, OutputDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in flat.values())
    print(f"wrote {len(flat)} tensors, {n:,} parameters -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
