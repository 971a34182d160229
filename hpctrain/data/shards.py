"""Memory-mapped token shards: `meta.json` (the index) plus `<split>-NNNNN.bin` files of token ids.

meta.json names the tokenizer (its vocabulary size, end-of-document id and a copy of tokenizer.json
beside the shards), the dtype (uint8 for bytes, uint16 up to 65,536 ids, else uint32) and, per split
("train", "val"), its shards with their token counts. Documents are separated by the end-of-document
id. Sample j of a split is the window [j * seq_len, (j + 1) * seq_len + 1) of one shard: inputs and
targets overlap by one token, and no window crosses a shard boundary. `max_token_id` (prepare writes it)
is the largest id in the shards: the login node compares it with model.vocab_size. Shards without it
(from elsewhere) are checked on the ranks instead, each shard once when first read: an id past the
embedding would otherwise be an IndexError on every restart (a device assert on a GPU).

meta.json is read as a regular file of bounded size (hpctrain.core.hf_format.read_small): a FIFO or a
device in its place is refused at once instead of hanging or filling the login node's memory.
"""
from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

META = "meta.json"
SPLITS = ("train", "val")
DTYPES = ("uint8", "uint16", "uint32")  # what hpctrain.data.prepare writes (dtype_for)
MAX_VOCAB = 1 << 32  # uint32 ids
# meta.json lists every shard (~100 bytes each): 64 MiB is some 600,000 shards, tens of TB of tokens.
META_BYTES = 64 << 20
COUNTS = ("window", "documents", "tokens", "trained_tokens", "files", "text_bytes")  # where present
MAX_COUNT = 1 << 53  # a count past this is no corpus's (and no longer exact as a JSON number elsewhere)
_MAX_IDS: dict[tuple, int] = {}  # (real path, size, mtime) of a shard -> its largest id, once per process


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id."""
    if vocab_size <= 1 << 8:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(path: str | os.PathLike) -> dict | None:
    """The index of a shard directory; None when there is none, or it is not a JSON object (problems()
    says why). Directories from before splits (one "shards" list) read as a train split without validation."""
    try:
        meta = json.loads(_meta_bytes(Path(path) / META))
    except (OSError, ValueError, RecursionError):  # HFError (not a regular file, too large) is a ValueError
        return None
    return _upgraded(meta) if isinstance(meta, dict) else None


def _meta_bytes(meta_path: Path) -> bytes:
    from hpctrain.core.hf_format import read_small

    return read_small(meta_path, META_BYTES)


def _upgraded(meta: dict) -> dict:
    if "splits" not in meta and "shards" in meta:
        meta["splits"] = {"train": {"shards": meta["shards"], "tokens": meta.get("total_tokens", 0)}}
    return meta


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def problems(path: str | os.PathLike, splits: Sequence[str] | None = None, limit: int = 5) -> list[str]:
    """What keeps the shard directory `path` from being read, each naming the file and the fix: meta.json
    missing, unreadable or malformed; a shard file of `splits` (default: every split) missing, outside the
    directory, or of another length than meta.json says (cut short by a copy, or left from another
    prepare). Empty when it can be read. Reads meta.json and the shards' sizes only (one stat each): cheap
    on the login node."""
    from hpctrain.core.hf_format import HFError

    d = Path(path)
    again = f"Fix: prepare it again: python -m hpctrain.data.prepare <corpus> {d}"
    recopy = f"Fix: copy the directory again from where it was prepared, or prepare it again: " \
             f"python -m hpctrain.data.prepare <corpus> {d}"
    meta_path = d / META
    if not (meta_path.exists() or meta_path.is_symlink()):
        return [f"{meta_path} is missing: not a directory made by hpctrain.data.prepare, or that was interrupted "
                f"(it writes {META} last). {again}"]
    try:
        raw = json.loads(_meta_bytes(meta_path))
    except HFError as e:  # not a regular file (a FIFO, a device), too large, unreadable
        return [f"{str(e).split('. Fix:')[0]}. {recopy}"]
    except (ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON
        return [f"{meta_path} is not valid JSON ({e}): damaged. {recopy}"]
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", type(None): "null"}.get(type(raw), "a number")
        return [f"{meta_path} holds {kind}, not the JSON object hpctrain.data.prepare writes. {again}"]
    meta = _upgraded(raw)
    out = []
    vocab = meta.get("vocab_size")
    if not _whole(vocab) or not 1 <= vocab <= MAX_VOCAB:
        out.append(f"{meta_path}: vocab_size={json.dumps(vocab)[:40]} must be a positive whole number, at most "
                   f"{MAX_VOCAB:,} (uint32 ids). {again}")
        vocab = None
    out.extend(f"{meta_path}: {p}. {again}" for p in _value_problems(meta, vocab))
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        out.append(f"{meta_path}: dtype={json.dumps(dtype)} is not one of {', '.join(DTYPES)}. {again}")
        dtype = None
    wanted, splits = splits, meta.get("splits")
    if not isinstance(splits, dict) or not all(isinstance(v, dict) and isinstance(v.get("shards"), list)
                                               for v in splits.values()):
        out.append(f"{meta_path}: \"splits\" must map each split (train, val) to an object with a \"shards\" "
                   f"list. {again}")
        return out
    itemsize = np.dtype(dtype).itemsize if dtype else None
    for split, part in splits.items():
        if wanted is not None and split not in wanted:
            continue
        for i, shard in enumerate(part["shards"]):
            where = f"{meta_path}: splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                out.append(f"{where}={json.dumps(shard)[:60]} is not an object {{file, tokens}}. {again}")
                continue
            name, tokens = shard.get("file"), shard.get("tokens")
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                out.append(f"{where}: file={json.dumps(name)} is not the name of a file in {d}. {again}")
                continue
            if not _whole(tokens) or tokens < 0:
                out.append(f"{where}: tokens={json.dumps(tokens)} must be a whole number, 0 or more. {again}")
                continue
            f = d / name
            try:
                size = f.stat().st_size
            except (OSError, ValueError):  # ValueError: a name with a NUL
                out.append(f"{f} is missing ({META} lists it in the {split} split with {tokens:,} tokens). {recopy}")
                continue
            if not f.is_file():
                out.append(f"{f} is not a file ({META} lists it as a shard of the {split} split). {recopy}")
            elif "mask" in shard and _mask_problem(d, shard, tokens):
                out.append(_mask_problem(d, shard, tokens) + f" {recopy}")
            elif itemsize and size != tokens * itemsize:
                have = f"{size:,} bytes ({size // itemsize:,} tokens of {dtype})"
                why = ("cut short: an interrupted copy or prepare" if size < tokens * itemsize else
                       "longer than that: not the file this meta.json describes")
                out.append(f"{f} holds {have} but {META} says {tokens:,} tokens ({tokens * itemsize:,} bytes): "
                           f"{why}. {recopy}")
    return out[:limit] + ([f"... and {len(out) - limit} more like these"] if len(out) > limit else [])


def _value_problems(meta: dict, vocab: int | None) -> list[str]:
    """meta.json's numbers and flags that are read (by the login node, the planner, the ranks), by type and
    range; absent ones are fine (directories from before them)."""
    out = []
    below = f" below vocab_size={vocab}" if vocab else ""
    for key in ("eos_id", "max_token_id"):  # ids: into the embedding
        v = meta.get(key)
        if key in meta and not (_whole(v) and 0 <= v < (vocab or MAX_VOCAB)):
            out.append(f"{key}={json.dumps(v)[:40]} must be a token id: a whole number from 0{below}")
    counts = [(key, meta.get(key)) for key in COUNTS if key in meta]
    splits = meta.get("splits") if isinstance(meta.get("splits"), dict) else {}
    counts += [(f"splits.{s}.{key}", part[key]) for s, part in splits.items() if isinstance(part, dict)
               for key in COUNTS if key in part]
    out.extend(f"{key}={json.dumps(v)[:40]} must be a whole number from 0 to {MAX_COUNT:,}" for key, v in counts
               if not (_whole(v) and 0 <= v <= MAX_COUNT))
    for key in ("loss_mask", "packed"):
        if key in meta and not isinstance(meta[key], bool):
            out.append(f"{key}={json.dumps(meta[key])[:40]} must be true or false")
    return out


def _mask_problem(d: Path, shard: dict, tokens: int) -> str | None:
    name = shard["mask"]
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        return f"{d / META}: mask={json.dumps(name)[:60]} is not the name of a file in {d}."
    try:
        size = (d / name).stat().st_size
    except (OSError, ValueError):
        return f"{d / name} (the loss mask of {shard['file']}) is missing."
    if not (d / name).is_file():
        return f"{d / name} (the loss mask of {shard['file']}) is not a file."
    if size != tokens:
        return f"{d / name} holds {size:,} bytes but its shard has {tokens:,} tokens (one mask byte each)."
    return None


def split_tokens(meta: dict, split: str) -> int:
    return sum(s["tokens"] for s in meta.get("splits", {}).get(split, {}).get("shards", []))


def longest_shard(meta: dict, split: str) -> int:
    return max((s["tokens"] for s in meta.get("splits", {}).get(split, {}).get("shards", [])), default=0)


class ShardDataset:
    """A split of a shard directory as samples of seq_len + 1 ids. `vocab_size`: the model's
    (model.vocab_size), which every id must be below (meta.json's vocab_size where None)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, split: str = "train", vocab_size: int | None = None):
        if not ((Path(path) / META).exists() or (Path(path) / META).is_symlink()):
            raise FileNotFoundError(f"{path}/{META} is missing: make shards with `python -m hpctrain.data.prepare`")
        found = problems(path, [split])  # checked on the login node too; the directory may have changed since
        if found:
            raise ValueError(f"{path} cannot be read as token shards: " + "; ".join(found))
        meta = read_meta(path)
        part = meta["splits"].get(split)
        if part is None:
            raise ValueError(f"{path} has no {split} split: prepare it again with --val-fraction above 0")
        self.path, self.split, self.seq_len = str(path), split, seq_len
        self.vocab_size = meta["vocab_size"]
        self.id_limit = (vocab_size, "model.vocab_size") if vocab_size else (meta["vocab_size"], f"{META}'s vocab_size")
        dtype = np.dtype(meta["dtype"])
        self.shards = [np.memmap(Path(path) / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
                       for s in part["shards"]]
        # Chat and prompt data (prepare --format chat|prompt): 1 per token the loss is computed on.
        self.has_loss_mask = bool(part["shards"]) and all("mask" in s for s in part["shards"])
        self.masks = [np.memmap(Path(path) / s["mask"], dtype=np.uint8, mode="r", shape=(s["tokens"],))
                      for s in part["shards"]] if self.has_loss_mask else []
        self.files = [Path(path) / s["file"] for s in part["shards"]]
        self.ids_checked: set[int] = set()
        if "max_token_id" in meta:  # recorded by prepare (and range-checked by problems()): no shard to read
            self._refuse_id(meta["max_token_id"], f"{Path(path) / META} (max_token_id)")
            self.ids_checked = set(range(len(self.shards)))
        # Preference shards (prepare --format preference): item j is pair j, its two sequences (chosen, then
        # rejected) each in a window of its own, `stride` tokens apart (window + 1: windows that do not
        # overlap; a directory may say otherwise in meta.json), a window's tail past its shard padding.
        self.pairs = bool(meta.get("pairs"))
        self.stride = int(meta.get("stride", seq_len + 1))
        self.pad_id = int(meta.get("eos_id", 0) or 0)
        if self.pairs:
            lead = seq_len + 1 - self.stride  # the tokens a window shares with the next one's start
            counts = [max(0, -(-(len(s) - lead) // (2 * self.stride))) for s in self.shards]
        else:
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.starts = np.cumsum([0] + counts).tolist()
        if self.starts[-1] == 0:
            raise ValueError(f"the {split} split of {path} holds no shard of {seq_len + 1} tokens: "
                             f"lower data.seq_len or prepare larger shards")

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        """seq_len + 1 ids; a pair (self.pairs) as (2, seq_len + 1): chosen, rejected."""
        k, off = self._locate(index)
        if self.pairs:
            return self._pair(self.shards[k], off, self.pad_id, np.int64)
        return np.asarray(self.shards[k][off: off + self.seq_len + 1], dtype=np.int64)

    def loss_mask(self, index: int) -> np.ndarray:
        """Sample `index`'s loss mask (1: the token is trained as a target), aligned with its tokens."""
        k, off = self._locate(index)
        if self.pairs:
            return self._pair(self.masks[k], off, 0, np.uint8)
        return np.asarray(self.masks[k][off: off + self.seq_len + 1], dtype=np.uint8)

    def _pair(self, data, off: int, pad: int, dtype) -> np.ndarray:
        out = np.full((2, self.seq_len + 1), pad, dtype=dtype)
        for i in range(2):
            part = data[off + i * self.stride: off + i * self.stride + self.seq_len + 1]
            out[i, :len(part)] = part
        return out

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        k = bisect.bisect_right(self.starts, index) - 1
        if k not in self.ids_checked:
            self._check_ids(k)
        return k, (index - self.starts[k]) * (2 * self.stride if self.pairs else self.seq_len)

    def _check_ids(self, k: int) -> None:
        """Shard k's ids are below the limit: one pass over the file, once per process (a shard from
        elsewhere: meta.json does not say its largest id)."""
        f = self.files[k]
        st = f.stat()
        key = (os.path.realpath(f), st.st_size, st.st_mtime_ns)
        if key not in _MAX_IDS:
            _MAX_IDS[key] = int(self.shards[k].max()) if len(self.shards[k]) else -1
        self._refuse_id(_MAX_IDS[key], str(f))
        self.ids_checked.add(k)

    def _refuse_id(self, largest: int, where: str) -> None:
        limit, name = self.id_limit
        if largest >= limit:
            again = f"python -m hpctrain.data.prepare <corpus> {self.path} --tokenizer <the model's tokenizer>"
            fix = (f"model.vocab_size={largest + 1} or more if the tokenizer has that many ids, else prepare the "
                   f"shards again with the model's tokenizer: {again}" if name == "model.vocab_size" else
                   f"prepare the shards again (their {META} says fewer ids than they hold): {again}")
            raise ValueError(f"{where} holds token id {largest:,}, but {name}={limit:,}: ids must be below it (an id "
                             f"indexes the embedding's {limit:,} rows). Fix: {fix}")
