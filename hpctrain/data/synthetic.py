"""Sequences with a learnable rule, generated from their index alone (no files, any length).

Each sequence starts at a random token and follows a fixed random permutation of the vocabulary
(token[i+1] = perm[token[i]]), so a model that learns the permutation drives the loss to zero,
and the loss of the first token (ln vocab) bounds how low a step's mean can go. The "val" split
follows the same rule from indices the training stream never reaches.
"""
from __future__ import annotations

import numpy as np

VAL_OFFSET = 2**62


class SyntheticDataset:
    """eos_id >= 0 and doc_len > 0: packed documents of doc_len tokens on average (exponentially
    distributed lengths), each starting at a random token, following the rule and ending with eos_id,
    which never occurs inside one."""

    has_loss_mask = False  # every token is trained (chat shards carry a mask: hpctrain.data.shards)

    def __init__(self, vocab_size: int, seq_len: int, seed: int, split: str = "train", eos_id: int = -1,
                 doc_len: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.offset = VAL_OFFSET if split == "val" else 0
        self.perm = np.random.default_rng([seed, 0xC0FFEE]).permutation(vocab_size)
        self.eos, self.doc_len = eos_id, doc_len if eos_id >= 0 else 0
        if self.doc_len:  # the rule skips eos_id
            self.next = self.perm.copy()
            self.next[self.next == eos_id] = self.perm[eos_id]
            self.next[eos_id] = eos_id

    def __len__(self) -> int:
        return VAL_OFFSET  # effectively endless: every index is a fresh sequence

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.offset + index])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        if self.doc_len:
            return self._documents(rng, out)
        out[0] = rng.integers(self.vocab_size)
        for i in range(self.seq_len):
            out[i + 1] = self.perm[out[i]]
        return out

    def _start(self, rng) -> int:
        t = int(rng.integers(self.vocab_size - 1))
        return t + (t >= self.eos)  # any token but eos_id

    def _documents(self, rng, out: np.ndarray) -> np.ndarray:
        left = 1 + int(rng.exponential(self.doc_len))  # tokens before this document's end
        out[0] = self._start(rng)
        for i in range(self.seq_len):
            if out[i] == self.eos:
                out[i + 1] = self._start(rng)
                left = 1 + int(rng.exponential(self.doc_len))
                continue
            left -= 1
            out[i + 1] = self.eos if left <= 0 else self.next[out[i]]
        return out
