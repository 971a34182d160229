"""A weighted mixture of datasets whose every sample is a pure function of its index.

The stream is cut into blocks of BLOCK samples. Each source gets a fixed quota of every block (its
weight's share, rounded by largest remainder), and a seeded permutation of the block decides which
slots are whose. Sample k is therefore source s's sample number `block * quota[s] + rank of k among
s's slots`, read through s's own permutation for that epoch of s. Nothing depends on how many ranks
read the stream or on what was read before, so the sampler's one number (samples consumed) resumes
and reshards a mixture exactly as it does one dataset.
"""
from __future__ import annotations

import numpy as np

BLOCK = 4096  # each source's share is exact per block, to 1/BLOCK


def quotas(weights: list[float], block: int = BLOCK) -> list[int]:
    """Integers summing to `block`, proportional to `weights` (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    q = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - q), kind="stable")[: block - int(q.sum())]:
        q[i] += 1
    return q.tolist()


class Mixture:
    def __init__(self, datasets: list, weights: list[float], seed: int, block: int = BLOCK):
        self.datasets, self.seed, self.block = datasets, seed, block
        self.quota = quotas(weights, block)
        if min(self.quota) == 0:
            raise ValueError(f"a weight below 1/{block} of the total gets no samples: {weights}")
        self.owner = np.repeat(np.arange(len(datasets)), self.quota)  # slot -> source, before shuffling
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}

    def __len__(self) -> int:
        return 2**62  # endless: each source starts its next epoch when it runs out

    def _slots(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if self._block_cache is None or self._block_cache[0] != b:
            owner = self.owner[np.random.default_rng([self.seed, 0x6D1, b]).permutation(self.block)]
            rank = np.empty(self.block, dtype=np.int64)
            for s in range(len(self.datasets)):
                mine = owner == s
                rank[mine] = np.arange(int(mine.sum()))
            self._block_cache = (b, owner, rank)
        return self._block_cache[1], self._block_cache[2]

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        cached = self._perm_cache.get(s)
        if cached is None or cached[0] != epoch:
            n = len(self.datasets[s])
            cached = (epoch, np.random.default_rng([self.seed, 0x50C, s, epoch]).permutation(n))
            self._perm_cache[s] = cached
        return cached[1]

    def source_of(self, k: int) -> tuple[int, int]:
        """(source, that source's sample number) of stream position k."""
        b, j = divmod(k, self.block)
        owner, rank = self._slots(b)
        s = int(owner[j])
        return s, b * self.quota[s] + int(rank[j])

    def sample_of(self, k: int) -> tuple[int, int, int]:
        """(source, that source's epoch, the sample's index in the source) of stream position k: a pure
        function of k, the weights and the seed, which tests compare across runs, resumes and layouts."""
        s, i = self.source_of(k)
        epoch, pos = divmod(i, len(self.datasets[s]))
        return s, epoch, int(self._perm(s, epoch)[pos])

    def _locate(self, k: int) -> tuple:
        """(the source dataset, its sample index) of stream position k."""
        s, _, index = self.sample_of(k)
        return self.datasets[s], index

    def __getitem__(self, k: int) -> np.ndarray:
        ds, index = self._locate(k)
        return ds[index]

    @property
    def has_loss_mask(self) -> bool:
        return any(d.has_loss_mask for d in self.datasets)

    def loss_mask(self, k: int) -> np.ndarray:
        """Sample k's loss mask; all ones for a source without one (plain text: every token trained)."""
        ds, index = self._locate(k)
        return ds.loss_mask(index) if ds.has_loss_mask else np.ones(ds.seq_len + 1, dtype=np.uint8)
