"""Asynchronous file I/O for offloaded optimizer state.

A pool of `queue_depth` threads issues `os.preadv`/`os.pwritev` of at most `block_bytes` each: the
system calls run without the GIL, so up to `queue_depth` requests are in flight while the caller
computes. One logical request (a chunk of a state tensor) is split into blocks and returned as a
`Batch` that can be waited on or given a completion callback (the streaming optimizer chains "read the
next chunk into this buffer" onto "the write-back of this buffer finished").

With O_DIRECT the page cache is bypassed (what an NVMe drive shared with the OS needs): offsets,
lengths and buffer addresses must be multiples of ALIGN, which hpctrain.checkpoint.directio.aligned_empty and
the callers' layouts guarantee. File systems that refuse O_DIRECT (older tmpfs, some network file systems) get
buffered I/O instead, with a note in the log.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from hpctrain.checkpoint.directio import ALIGN

log = logging.getLogger("hpctrain")

class Batch:
    """Completion of a group of block requests: `wait()` returns when all are done (raising the first
    error), callbacks run once, in the thread that finished the last block (or at once if done)."""

    def __init__(self, n: int, what: str):
        self._left = n
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._callbacks: list[Callable[["Batch"], None]] = []
        self.error: Optional[BaseException] = None
        self.what = what
        self._finished = n == 0
        if n == 0:
            self._event.set()

    def _block_done(self, error: Optional[BaseException]) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left:
                return
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:  # before waiters wake: whoever waited sees the callbacks' effects
            try:
                cb(self)
            except BaseException as e:  # a callback's failure is this batch's failure
                if self.error is None:
                    self.error = e
        self._event.set()

    def add_done_callback(self, cb: Callable[["Batch"], None]) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append(cb)
                return
        cb(self)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise self.error


class AsyncIO:
    """Thread-pool I/O: `read(fd, buf, offset)` / `write(...)` return a Batch at once."""

    def __init__(self, queue_depth: int = 8, block_bytes: int = 8 << 20):
        if queue_depth < 1 or block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"queue_depth={queue_depth} must be >= 1 and block_bytes={block_bytes} a "
                             f"positive multiple of {ALIGN}")
        self.queue_depth, self.block_bytes = queue_depth, block_bytes
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="hpctrain-aio")

    def read(self, fd: int, buf: torch.Tensor, offset: int, what: str = "") -> Batch:
        return self._submit(fd, buf, offset, False, what)

    def write(self, fd: int, buf: torch.Tensor, offset: int, what: str = "") -> Batch:
        return self._submit(fd, buf, offset, True, what)

    def _submit(self, fd: int, buf: torch.Tensor, offset: int, write: bool, what: str) -> Batch:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("I/O buffers must be contiguous host tensors")
        mv = memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else memoryview(b"")
        n = len(mv)
        starts = range(0, n, self.block_bytes)
        batch = Batch(len(starts), what)
        for s in starts:
            self._pool.submit(self._run, fd, mv[s:s + self.block_bytes], offset + s, write, batch)
        return batch

    @staticmethod
    def _run(fd: int, mv: memoryview, offset: int, write: bool, batch: Batch) -> None:
        err = None
        try:
            done, n = 0, len(mv)
            while done < n:
                k = (os.pwritev(fd, [mv[done:]], offset + done) if write
                     else os.preadv(fd, [mv[done:]], offset + done))
                if k <= 0:
                    if write:
                        raise OSError(errno.EIO, "pwritev wrote nothing")
                    raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done}")
                done += k
        except BaseException as e:  # handed to whoever waits on the batch
            err = e
        batch._block_done(err)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
