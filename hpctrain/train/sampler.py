"""Which samples each rank reads at each step, and a position that can be saved and restored.

The global stream is a permutation of the dataset per epoch (identity for endless synthetic data).
A sample of preference shards is a pair (chosen, rejected): global_batch and micro_batch count pairs, the
position too. Step k consumes samples [k * global_batch, (k + 1) * global_batch) of that stream; data-parallel
rank r takes the r-th contiguous slice and splits it into micro-batches. The position is a single
number, samples consumed, so a checkpoint made with one layout resumes on the same stream in another.

The data trace (HPCTRAIN_DATA_TRACE=1; off by default) is the proof of that: each rank appends, per step
it reads, {"attempt", "step", "dp_rank", "dp", "positions"} (the global stream positions of its samples)
to <run_dir>/attempts/<HPCTRAIN_ATTEMPT>/data-rank-<R>.jsonl; tests/test_data_exactly_once.py compares
the positions of a run resumed many times with an uninterrupted one's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch


from hpctrain.models.loss import IGNORE  # a target the loss skips (torch's ignore_index, Hugging Face's label convention)


TRACE_ENV = "HPCTRAIN_DATA_TRACE"


def data_trace(run_dir: str | os.PathLike, env: dict | None = None) -> Path | None:
    """The run directory to trace the training stream into when HPCTRAIN_DATA_TRACE=1, else None (the
    trace costs nothing then: next_step tests one attribute)."""
    return Path(run_dir) if (os.environ if env is None else env).get(TRACE_ENV, "") == "1" else None


def trace_record(attempt: int, step: int, dp_rank: int, dp: int, positions: list[int]) -> dict:
    """One line of the data trace: the global stream positions data-parallel rank `dp_rank` of `dp` read
    for optimizer step `step` (1-based, as metrics.jsonl counts) in attempt `attempt`."""
    return {"attempt": attempt, "step": step, "dp_rank": dp_rank, "dp": dp, "positions": positions}


class StepSampler:
    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True, trace: str | os.PathLike | None = None):
        """`trace`: the run directory to append the data trace to (data_trace(run_dir)); None: no trace.
        Only the training stream's sampler gets one: validation reads the same samples every time."""
        assert global_batch % (dp_size * micro_batch) == 0
        self.ds, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.trace = Path(trace) if trace is not None else None
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

    def _write_trace(self, positions: list[int]) -> None:
        # The attempt is read now, not at construction: an in-process restart moves a live rank to the
        # next generation (HPCTRAIN_ATTEMPT in its environment) with a new sampler, but read it late anyway.
        # The file is named by the global rank: with tp, pp or cp several ranks share a dp rank.
        from hpctrain.core.faults import attempt
        from hpctrain.core.rundir import attempt_dir

        g = attempt()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else self.dp_rank
        path = attempt_dir(self.trace, g) / f"data-rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rec = trace_record(g, self.position // self.global_batch + 1, self.dp_rank, self.dp_size, positions)
        with open(path, "a") as f:  # one whole line per write: a rank killed later leaves its lines whole
            f.write(json.dumps(rec) + "\n")

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step, as (inputs, targets); a target outside
        the dataset's loss mask (chat data: every token but the assistant's) is IGNORE."""
        per_rank = self.global_batch // self.dp_size
        start = self.position + self.dp_rank * per_rank
        if self.trace is not None:
            self._write_trace(list(range(start, start + per_rank)))
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
