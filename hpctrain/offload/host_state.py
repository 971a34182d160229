"""Where the flat optimizer state of offload=cpu lives (host memory; offload=nvme's files are in
nvme.py), the unit both stream it in, and the error offload raises."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from hpctrain.checkpoint.directio import aligned_empty


class OffloadError(RuntimeError):
    """Offloaded optimizer state cannot be placed or written; the message says why and what to do."""


@dataclass
class Chunk:
    """One unit of streaming; `fence` (an accelerator event) must complete before its buffers are reused."""
    index: int
    start: int
    stop: int
    views: dict = field(default_factory=dict)
    fence: Any = None


class HostStore:
    """offload=cpu: the flat state tensors in (pinned) host memory."""

    def __init__(self, numel: int, kinds: tuple, pin: bool, chunk_elems: int):
        self.numel, self.kinds = numel, kinds
        self.flat = {k: aligned_empty(numel * 4, pin).view(torch.float32).zero_() for k in kinds}
        self.chunk_elems = chunk_elems

    def host_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.flat.values())

    def chunks(self) -> list[tuple[int, int]]:
        return [(c, min(c + self.chunk_elems, self.numel)) for c in range(0, self.numel, self.chunk_elems)]

    def stream(self) -> Iterator[Chunk]:
        for i, (c0, c1) in enumerate(self.chunks()):
            yield Chunk(i, c0, c1, {k: t[c0:c1] for k, t in self.flat.items()})

    def view(self, kind: str, offset: int, numel: int) -> torch.Tensor:
        return standalone(self.flat[kind][offset:offset + numel])

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def standalone(view: torch.Tensor) -> torch.Tensor:
    """The same memory as the contiguous host tensor `view`, as a tensor whose storage starts at its
    first element. DCP's async stager copies a DTensor's storage only when the DTensor reports a
    non-zero data pointer, which a DTensor over a local tensor with a storage offset does (offset x
    element size, from a storage it then finds invalid): views of flat buffers must not carry offsets."""
    if view.numel() == 0:
        return torch.empty(view.shape, dtype=view.dtype)
    flat = view.reshape(-1)
    return torch.frombuffer(memoryview(flat.view(torch.uint8).numpy()), dtype=view.dtype).view(view.shape)
