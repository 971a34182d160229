"""Which samples each rank reads at each step, and a position that can be saved and restored.

The global stream is a permutation of the dataset per epoch (identity for endless synthetic data).
A sample of preference shards is a pair (chosen, rejected): global_batch and micro_batch count pairs, the
position too. Step k consumes samples [k * global_batch, (k + 1) * global_batch) of that stream; data-parallel
rank r takes the r-th contiguous slice and splits it into micro-batches. The position is a single
number, samples consumed, so a checkpoint made with one layout resumes on the same stream in another.
"""
from __future__ import annotations

import numpy as np
import torch


from hpctrain.models.loss import IGNORE  # a target the loss skips (torch's ignore_index, Hugging Face's label convention)


class StepSampler:
    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        assert global_batch % (dp_size * micro_batch) == 0
        self.ds, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n = len(dataset)
        self.shuffle = shuffle and self.n < 2**40
        self.position = 0  # samples consumed from the global stream
        self._perm_epoch, self._perm = -1, None

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def _index(self, k: int) -> int:
        epoch, j = divmod(k, self.n)
        if not self.shuffle:
            return j
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step, as (inputs, targets); a target outside
        the dataset's loss mask (chat data: every token but the assistant's) is IGNORE."""
        per_rank = self.global_batch // self.dp_size
        start = self.position + self.dp_rank * per_rank
        indices = [self._index(start + i) for i in range(per_rank)]
        t = torch.from_numpy(np.stack([self.ds[i] for i in indices]))
        self.position += self.global_batch
        # preference pairs (items of 2 rows): rows interleaved [chosen 1, rejected 1, chosen 2, ...], a
        # micro-batch of m pairs 2m rows, so that no split of the step cuts a pair
        rows = 2 if t.ndim == 3 else 1
        t = t.flatten(0, -2)
        y = t[:, 1:]
        if self.ds.has_loss_mask:  # chat data: untrained targets are ignored (-100)
            mask = torch.from_numpy(np.stack([self.ds.loss_mask(i) for i in indices])).flatten(0, -2)[:, 1:]
            y = torch.where(mask.bool(), y, IGNORE)
        return list(zip(t[:, :-1].split(rows * self.micro_batch), y.split(rows * self.micro_batch)))
