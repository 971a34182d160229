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
    def __init__(self, vocab_size: int, seq_len: int, seed: int, split: str = "train"):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.offset = VAL_OFFSET if split == "val" else 0
        self.perm = np.random.default_rng([seed, 0xC0FFEE]).permutation(vocab_size)

    def __len__(self) -> int:
        return VAL_OFFSET  # effectively endless: every index is a fresh sequence

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.offset + index])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        out[0] = rng.integers(self.vocab_size)
        for i in range(self.seq_len):
            out[i + 1] = self.perm[out[i]]
        return out
