"""data.sources: a weighted mixture whose every sample is a function of its stream position, so it is
deterministic, resumable from the sampler's one number, and the same on any number of ranks."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hpctrain.data.mixture import BLOCK, Mixture, quotas
from hpctrain.train.sampler import StepSampler


class Tagged:
    """Source s's sample i is [s, i, i, ...]: a batch tells which source and sample it came from."""

    has_loss_mask = False  # the dataset protocol (hpctrain.data): every token trained

    def __init__(self, s: int, n: int, seq_len: int = 3):
        self.s, self.n, self.seq_len = s, n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return np.array([self.s] + [i] * self.seq_len, dtype=np.int64)


def mixture(weights=(3.0, 1.0, 0.5), sizes=(1000, 37, 5000), seed=7, block=BLOCK) -> Mixture:
    return Mixture([Tagged(s, n) for s, n in enumerate(sizes)], list(weights), seed, block)


def test_quotas_are_the_largest_remainder_shares():
    for weights, block in [((3, 1, 0.5), 4096), ((1, 1, 1), 100), ((0.7, 0.2, 0.1), 10), ((5,), 64)]:
        q = quotas(list(weights), block)
        exact = [w / sum(weights) * block for w in weights]
        assert sum(q) == block
        assert all(abs(a - b) < 1 for a, b in zip(q, exact)), (q, exact)


def test_each_block_holds_every_source_in_its_share():
    m = mixture()
    q = quotas([3.0, 1.0, 0.5])
    for b in (0, 1, 7):
        got = Counter(int(m[k][0]) for k in range(b * BLOCK, (b + 1) * BLOCK))
        assert [got[s] for s in range(3)] == q
    # Slots are shuffled inside a block, not laid out source after source.
    first = [int(m[k][0]) for k in range(64)]
    assert len(set(first)) > 1


def test_every_source_is_read_once_per_epoch_of_its_own():
    m = mixture(sizes=(200, 37, 500), block=256)
    seen = {0: [], 1: [], 2: []}
    for k in range(6 * 256):
        s, i = (int(v) for v in m[k][:2])
        seen[s].append(i)
    for s, n in enumerate((200, 37, 500)):
        full, rest = divmod(len(seen[s]), n)
        for e in range(full):  # each complete epoch of source s is a permutation of its samples
            assert sorted(seen[s][e * n:(e + 1) * n]) == list(range(n))
        if full >= 2:  # and the epochs are shuffled differently
            assert seen[s][:n] != seen[s][n:2 * n]


def test_deterministic_and_seeded():
    a, b, c = mixture(seed=7), mixture(seed=7), mixture(seed=8)
    ks = [0, 1, 5, 4095, 4096, 123_456, 10**9]
    assert all(np.array_equal(a[k], b[k]) for k in ks)
    assert any(not np.array_equal(a[k], c[k]) for k in ks)
    # Random access equals reading in order (no hidden state in the caches).
    fresh = mixture(seed=7)
    assert all(np.array_equal(fresh[k], a[k]) for k in reversed(ks))


@pytest.mark.parametrize("dp", [2, 4])
def test_ranks_resume_and_reshard_on_one_stream(dp):
    """dp ranks together read what one rank reads; a position saved on dp ranks resumes on 1."""
    def rows(sampler, steps):
        out = []
        for _ in range(steps):
            out += [tuple(r) for x, y in sampler.next_step() for r in np.c_[x.numpy(), y.numpy()[:, -1:]]]
        return out

    one = rows(StepSampler(mixture(), 16, 2, 0, 1, seed=0), 6)
    samplers = [StepSampler(mixture(), 16, 2, r, dp, seed=0) for r in range(dp)]
    together = []
    for _ in range(3):
        for s in samplers:
            together += rows(s, 1)
    assert together == one[: 3 * 16]
    resumed = StepSampler(mixture(), 16, 2, 0, 1, seed=0)
    resumed.load_state_dict(samplers[0].state_dict())
    assert rows(resumed, 3) == one[3 * 16:]


def test_a_weight_too_small_for_a_block_is_refused():
    with pytest.raises(ValueError, match="below 1/4096"):
        mixture(weights=(1.0, 1e-6))
