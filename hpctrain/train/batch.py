"""What the model gets beside a micro-batch's tokens: the document of each token (data.document_mask),
its position where that is not its index (positions restarting per document, context-parallel chunks),
and this cp rank's part of all of them."""
from __future__ import annotations

from typing import Optional

import torch

from hpctrain.parallel.context import sequence_index, shard_sequence


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) document index of each token: the end-of-document tokens before it (an EOS belongs
    to the document it ends)."""
    ends = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(ends, 1) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document."""
    b, s = documents.shape
    index = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 1).values


class BatchLayout:
    """Turns a micro-batch (inputs, targets) into (inputs, targets, model keyword arguments) for this rank."""

    def __init__(self, eos_id: Optional[int], document_mask: bool, restart_positions: bool, cp_rank: int = 0,
                 cp: int = 1):
        self.eos_id = eos_id if document_mask else None
        self.restart = restart_positions and document_mask
        self.cp_rank, self.cp = cp_rank, cp

    @property
    def plain(self) -> bool:
        return self.eos_id is None and self.cp == 1

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if self.plain:
            return x, y, {}
        docs = document_ids(x, self.eos_id) if self.eos_id is not None else None
        kw = {}
        if self.restart:
            kw["positions"] = shard_sequence(document_positions(docs), self.cp_rank, self.cp)
        elif self.cp > 1:  # the positions of this rank's chunks in the whole sequence
            kw["positions"] = sequence_index(x.shape[1], self.cp_rank, self.cp).to(x.device).expand(x.shape[0], -1)
        if docs is not None:
            kw["documents"] = shard_sequence(docs, self.cp_rank, self.cp)
        return shard_sequence(x, self.cp_rank, self.cp), shard_sequence(y, self.cp_rank, self.cp), kw
