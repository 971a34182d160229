"""Checkpoint tools that need no cluster.

    python -m hpctrain.checkpoint export <step dir> <out dir> --format hf [--dtype bf16|fp32|fp16|keep]
    python -m hpctrain.checkpoint export <step dir> <file> [--dtype ...]
    python -m hpctrain.checkpoint list <run dir>

`export --format hf` writes a Hugging Face Llama directory (config.json, generation_config.json,
safetensors files of at most --shard-gb with their index, Hugging Face's names, the tokenizer, and a
fine-tuned model's base's generation config and chat template) that transformers' from_pretrained
loads, streaming one tensor at a time (hpctrain.checkpoint.hf_weights), into a new or empty directory or an
earlier export, which it replaces whole (hpctrain.core.outdir). Without --format hf: one consolidated
file with hpctrain's parameter names, safetensors when <file> ends in .safetensors, otherwise
torch.save of a flat {name: tensor} dict. Either way from a checkpoint of any layout. From an adapter-only
checkpoint (checkpoint.weights=adapters) the frozen base's tensors are read from the model.init_from it
records, or from --base DIR where the base moved, checked first to be the base it was trained on
(hpctrain.checkpoint.base); --format peft writes the adapters alone and reads no base.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hpctrain.checkpoint import directories as store
from hpctrain.checkpoint.safe import DamagedCheckpoint, SafeReader, check_files, read_metadata
from hpctrain.checkpoint.hf_weights import ModelTensors, export_hf
from hpctrain.checkpoint.validate import read_info
from hpctrain.core import hf_format as hf
from hpctrain.core.compose import ConfigError
from hpctrain.core.outdir import OutputDirError


EXPORTED_BY = "hpctrain.checkpoint export"  # in a safetensors export's metadata: the file is ours to replace


def single_file_problem(out: Path) -> str | None:
    """Why the single-file export may not write `out`: a directory, or a file it did not write (only a
    safetensors file whose metadata says it came from this command is replaced)."""
    if out.is_dir():
        return (f"{out} is a directory. Fix: name a file (model.safetensors, or .pt), or export a Hugging Face "
                "directory with --format hf")
    if out.exists() or out.is_symlink():
        if out.suffix == ".safetensors" and not out.is_symlink():
            try:
                with safe_open(str(out), "pt") as f:
                    if (f.metadata() or {}).get("exported_by") == EXPORTED_BY:
                        return None
            except Exception:  # not a safetensors file at all: not ours either
                pass
        return (f"{out} exists and was not written by this command. Fix: choose a new file name, or remove "
                f"{out} if it is not needed")
    return None


def export(step_dir: Path, out: Path, dtype: str = "keep", base: Path | None = None) -> dict:
    problem = single_file_problem(out)
    if problem:
        raise OutputDirError(problem)
    md = read_metadata(step_dir)
    check_files(step_dir, md)
    keys = {k for k in md.state_dict_metadata if k.startswith("model.")}
    state: dict = {}
    # Reads every model tensor whole, in one process, without a process group.
    _load_state_dict(state, storage_reader=SafeReader(str(step_dir)),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    flat = {k[len("model."):]: v for k, v in _flatten(state).items() if k.startswith("model.")}
    # (a checkpoint without hpctrain.json, torch's alone, holds every weight: the single file needs no more)
    info = read_info(step_dir) if (step_dir / "hpctrain.json").exists() else {}
    if info.get("weights") == "adapters":  # the frozen base, from model.init_from (or --base), checked
        export_config_check(step_dir)
        src = ModelTensors(step_dir, md, info, base)
        flat.update({n: src.read(n) for n in src.names() if n not in flat})
    for k, v in flat.items():
        t = v.detach().contiguous()
        if dtype != "keep":
            t = t.to({"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype])
        flat[k] = t
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed over: a failed export leaves an earlier one whole.
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        if out.suffix == ".safetensors":
            save_file(flat, str(tmp), metadata={"format": "pt", "source": str(step_dir), "exported_by": EXPORTED_BY})
        else:
            torch.save(flat, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
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


def listing(run_dir: Path, errors: list | None = None) -> list[str]:
    """One line per complete checkpoint of a run, oldest first, under a header; none: []. A checkpoint
    whose hpctrain.json cannot be read is left out, and why goes to `errors`."""
    rows = []
    for step, path in store.list_complete(run_dir / "checkpoints"):
        try:
            info = read_info(path)
        except DamagedCheckpoint as e:
            if errors is not None:
                errors.append(str(e))
            continue
        progress = info.get("progress")
        tokens = progress.get("tokens_seen") if isinstance(progress, dict) else None
        tokens = format(tokens, ",") if type(tokens) is int else "?"
        when = info.get("time")
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) \
            if type(when) in (int, float) and 0 <= when < 1e11 else "?"
        rows.append(f"{step:>10}  {saved:<19}  {info['world_size']:>5}  {tokens:>14}  {path}")
    return [f"{'step':>10}  {'saved':<19}  {'world':>5}  {'tokens':>14}  directory", *rows] if rows else []


def export_config_check(step_dir: Path) -> None:
    """The Hugging Face and PEFT exports build the model's config from hpctrain.json's config: it must be
    an object with model and data sections (DamagedCheckpoint otherwise, naming the file)."""
    config = read_info(step_dir).get("config")
    if not isinstance(config, dict) or not all(isinstance(config.get(k), dict) for k in ("model", "data")) \
            or type(config["data"].get("seq_len")) is not int or config["data"]["seq_len"] < 1:
        raise DamagedCheckpoint(f"{step_dir / store.INFO} holds no config with a model section and a data.seq_len: "
                                "the export takes the model's shape and context length from them")


def complete_near(path: Path) -> str:
    """What to give instead of `path`: the complete checkpoints in it (a run or checkpoints directory) or
    beside it."""
    for root in (path / "checkpoints", path, path.parent):
        found = store.list_complete(root) if root.is_dir() else []
        if found:
            return "Complete checkpoints: " + ", ".join(str(p) for _, p in found)
    return "No complete checkpoint in or beside it: list a run's with `python -m hpctrain.checkpoint list RUN_DIR`."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.checkpoint", description="A run's checkpoints: list them, or export one's weights.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="a checkpoint's weights as one safetensors file, or a Hugging Face "
                       "directory (--format hf)", description="Consolidate a sharded checkpoint's weights: one "
                       "safetensors file (--format file), or a Hugging Face directory that transformers "
                       "loads (--format hf: config.json, safetensors shards and their index).")
    e.add_argument("step_dir", type=Path, help="a complete checkpoint: RUN_DIR/checkpoints/step-NNNNNNNN")
    e.add_argument("out", type=Path, help="the file (--format file) or new directory (--format hf) to write")
    e.add_argument("--dtype", choices=("keep", "bf16", "fp32", "fp16"), default="keep",
                   help="the weights' type in the output; keep: as trained (default: %(default)s)")
    e.add_argument("--format", choices=("file", "hf", "peft"), default="file",
                   help="file: one safetensors file; hf: a Hugging Face directory (Llama, Qwen3, Mixtral, Qwen3-MoE), "
                        "a LoRA run's adapters merged into the weights; peft: a LoRA run's adapters as a PEFT "
                        "adapter directory (default: %(default)s)")
    e.add_argument("--shard-gb", type=float, default=5.0, help="with --format hf: the largest safetensors file, GB (default: %(default)s)")
    e.add_argument("--base", type=Path, default=None,
                   help="an adapter-only checkpoint's (checkpoint.weights=adapters) base model, where it is no longer "
                        "at the model.init_from it records; checked to be the same weights (default: that path)")
    ls = sub.add_parser("list", help="complete checkpoints of a run: step, save time, world size, tokens",
                        description="The complete checkpoints of a run, oldest first: step, save time, world "
                        "size and tokens trained on. Exit 1 when there is none.")
    ls.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    args = ap.parse_args(argv)

    if args.cmd == "list":
        errors: list[str] = []
        rows = listing(args.run_dir, errors)
        if rows:
            print("\n".join(rows))
        for err in errors:
            print(f"error: {err}", file=sys.stderr)
        if errors:
            return 2
        if not rows:
            print(f"no complete checkpoint in {args.run_dir / 'checkpoints'} (a run saves with "
                  "checkpoint.every=N)", file=sys.stderr)
            return 1
        return 0
    if not store.is_complete(args.step_dir):
        print(f"error: {args.step_dir} is not a complete checkpoint (a step-NNNNNNNN directory with "
              f"{store.DCP_METADATA} and {store.INFO}). {complete_near(args.step_dir)}", file=sys.stderr)
        return 2
    try:
        if args.format != "file":  # both read the run's config from hpctrain.json
            export_config_check(args.step_dir)
        if args.base is not None and args.format != "peft" and read_info(args.step_dir).get("weights") != "adapters":
            raise hf.HFError(f"--base {args.base}: {args.step_dir} holds every weight, it reads no base (only an "
                             "adapter-only checkpoint, checkpoint.weights=adapters, does). Fix: leave --base out")
        if args.format == "peft":
            from hpctrain.checkpoint.peft_format import AdapterError, export_peft

            try:
                config = export_peft(args.step_dir, args.out, args.base)
            except AdapterError as err:
                raise hf.HFError(str(err)) from None
            print(f"wrote a PEFT LoRA adapter (rank {config['r']}, alpha {config['lora_alpha']:g}, "
                  f"{', '.join(config['target_modules'])}) -> {args.out}")
            return 0
        if args.format == "hf":
            notes: list[str] = []
            index = export_hf(args.step_dir, args.out, args.dtype, int(args.shard_gb * 1e9), notes, args.base)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            files = sorted(set(index["weight_map"].values()))
            arch = json.loads((args.out / hf.CONFIG).read_text())["architectures"][0]
            print(f"wrote a Hugging Face {arch}: {len(index['weight_map'])} tensors, "
                  f"{index['metadata']['total_size'] / 1e9:.3f} GB in {len(files)} file(s) -> {args.out}")
            return 0
        flat = export(args.step_dir, args.out, args.dtype, args.base)
    except (DamagedCheckpoint, OutputDirError, hf.HFError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # hpctrain.json's model config, as compose checks it
        print(f"error: {args.step_dir / store.INFO}'s config: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a shard file that cannot be read (permissions, I/O error)
        print(f"error: {args.step_dir}: {err.strerror or err} ({err.filename or 'read'})", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in flat.values())
    print(f"wrote {len(flat)} tensors, {n:,} parameters -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
