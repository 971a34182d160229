"""Memory-mapped token shards: `meta.json` (the index) plus `<split>-NNNNN.bin` files of token ids.

meta.json names the tokenizer (its vocabulary size, end-of-document id and a copy of tokenizer.json
beside the shards), the dtype (uint8 for bytes, uint16 up to 65,536 ids, else uint32) and, per split
("train", "val"), its shards with their token counts. Documents are separated by the end-of-document
id. Sample j of a split is the window [j * seq_len, (j + 1) * seq_len + 1) of one shard: inputs and
targets overlap by one token, and no window crosses a shard boundary.
"""
from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import numpy as np

META = "meta.json"
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id."""
    if vocab_size <= 1 << 8:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(path: str | os.PathLike) -> dict | None:
    """The index of a shard directory; None when there is none. Directories from before splits
    (one "shards" list) read as a train split without validation."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None
    if "splits" not in meta and "shards" in meta:
        meta["splits"] = {"train": {"shards": meta["shards"], "tokens": meta.get("total_tokens", 0)}}
    return meta


def split_tokens(meta: dict, split: str) -> int:
    return sum(s["tokens"] for s in meta.get("splits", {}).get(split, {}).get("shards", []))


def longest_shard(meta: dict, split: str) -> int:
    return max((s["tokens"] for s in meta.get("splits", {}).get(split, {}).get("shards", [])), default=0)


class ShardDataset:
    def __init__(self, path: str | os.PathLike, seq_len: int, split: str = "train"):
        meta = read_meta(path)
        if meta is None:
            raise FileNotFoundError(f"{path}/{META} is missing: make shards with `python -m hpctrain.data.prepare`")
        part = meta["splits"].get(split)
        if part is None:
            raise ValueError(f"{path} has no {split} split: prepare it again with --val-fraction above 0")
        self.path, self.split, self.seq_len = str(path), split, seq_len
        self.vocab_size = meta["vocab_size"]
        dtype = np.dtype(meta["dtype"])
        self.shards = [np.memmap(Path(path) / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
                       for s in part["shards"]]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.starts = np.cumsum([0] + counts).tolist()
        if self.starts[-1] == 0:
            raise ValueError(f"the {split} split of {path} holds no shard of {seq_len + 1} tokens: "
                             f"lower data.seq_len or prepare larger shards")

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        k = bisect.bisect_right(self.starts, index) - 1
        off = (index - self.starts[k]) * self.seq_len
        return np.asarray(self.shards[k][off: off + self.seq_len + 1], dtype=np.int64)
