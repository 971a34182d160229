"""Direct (O_DIRECT) file I/O helpers shared by checkpoints and NVMe offload: the alignment rule,
aligned (optionally page-locked) host buffers, and opening a file with O_DIRECT where the file
system allows it, buffered otherwise."""
from __future__ import annotations

import errno
import logging
import os

import torch

log = logging.getLogger("hpctrain")

ALIGN = 4096


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose address is a multiple of ALIGN (O_DIRECT's rule),
    page-locked when `pin` (only where an accelerator exists)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


def open_direct(path: str, direct: bool, mode: int = 0o600) -> tuple[int, bool]:
    """Create `path` (it must not exist) read-write; with O_DIRECT when asked and the file system
    allows it. Returns (fd, whether O_DIRECT is on)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("%s: the file system refuses O_DIRECT; using buffered I/O", os.path.dirname(path))
    return os.open(path, flags, mode), False


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
