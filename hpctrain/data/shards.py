"""Memory-mapped token shards: `meta.json` plus `shard-NNNNN.bin` files of uint8/uint16 token ids.

Sample j of a shard is the window [j * seq_len, (j + 1) * seq_len + 1): inputs and targets
overlap by one token, and no window crosses a shard boundary.
"""
from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import numpy as np

META = "meta.json"


def read_meta(path: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None


class ShardDataset:
    def __init__(self, path: str | os.PathLike, seq_len: int):
        meta = read_meta(path)
        if meta is None:
            raise FileNotFoundError(f"{path}/{META} is missing: make shards with `python -m hpctrain.data.prepare`")
        self.seq_len = seq_len
        self.vocab_size = meta["vocab_size"]
        dtype = np.dtype(meta["dtype"])
        self.shards = [np.memmap(Path(path) / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
                       for s in meta["shards"]]
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.starts = np.cumsum([0] + counts).tolist()
        if self.starts[-1] == 0:
            raise ValueError(f"{path} holds fewer than {seq_len + 1} tokens per shard: lower data.seq_len")

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        k = bisect.bisect_right(self.starts, index) - 1
        off = (index - self.starts[k]) * self.seq_len
        return np.asarray(self.shards[k][off: off + self.seq_len + 1], dtype=np.int64)
