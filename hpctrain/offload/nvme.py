"""offload=nvme: optimizer state in per-rank files, streamed through a few host buffers.

Each kind of state (exp_avg, exp_avg_sq, and master weights with offload.master_on_nvme) is one file
per rank holding the flat fp32 space of hpctrain.offload.cpu. A step walks it chunk by chunk through
`buffer_count` buffer sets: reads run ahead of the update, each chunk is written back as soon as it is
updated, and a buffer set is read into again as soon as its write-back finished, so with enough buffers
the disk is busy the whole step (hpctrain.offload.aio: `queue_depth` threads, requests of `block_mb`).

The files are created in `offload.path` with names saying who made them
(`hpctrain-offload-<host>-<pid>-r<rank>-<kind>.bin`), their space is reserved at once (fallocate: a
disk that cannot hold them stops the run at the start, never in the middle of a step), and they are
unlinked right after opening: the data lives as long as this process holds them open and disappears
when it ends, however it ends (a finished run, an exception, a kill).

Checkpoints read and load the state through memory maps of these files (`view`): no copy of the state
is made in host memory. The next step flushes the maps before the files are accessed with O_DIRECT.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import socket
import threading
from types import SimpleNamespace
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from hpctrain.checkpoint.directio import ALIGN, aligned_empty, open_direct
from hpctrain.offload.aio import AsyncIO, Batch
from hpctrain.core.disk import writable_dir_problem
from hpctrain.offload.host_state import Chunk, OffloadError

log = logging.getLogger("hpctrain")

# Free space kept beyond the state files: checkpoints and logs may share the file system.
MARGIN_BYTES = 64 << 20


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_dir(path: Optional[str]) -> str:
    """The offload directory, or an OffloadError naming what is wrong with it."""
    if not path:
        raise OffloadError("offload.target=nvme needs a directory for the optimizer state files. "
                           "Fix: offload.path=<directory on a fast local disk>")
    problem = writable_dir_problem("offload.path", path)
    if problem:
        raise OffloadError(problem)
    return os.path.abspath(os.path.expanduser(str(path)))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class NvmeStore:
    def __init__(self, numel: int, kinds: tuple, cfg: SimpleNamespace, pin: bool, chunk_elems: int):
        self.numel, self.kinds = numel, kinds
        self.nbytes = numel * 4
        self.chunk_elems = chunk_elems
        self.dir = check_dir(cfg.path)
        rank = _rank()
        need = self.nbytes * len(kinds)
        free = shutil.disk_usage(self.dir).free
        what = f"{len(kinds)} files of {_gb(self.nbytes)} ({', '.join(kinds)} for {numel / 1e6:.1f} M elements)"
        if free < need + MARGIN_BYTES:
            raise OffloadError(
                f"offload.path={self.dir} has {_gb(free)} free but rank {rank} needs {_gb(need)} for its "
                f"optimizer state ({what}) plus {_gb(MARGIN_BYTES)} of margin; nothing was written. Fix: free "
                "space there, point offload.path at a larger disk, or shard over more ranks")
        self.fds: dict[str, int] = {}
        self._maps: list = []
        self._views: dict[str, mmap.mmap] = {}
        self.direct = True
        stem = f"hpctrain-offload-{socket.gethostname()}-{os.getpid()}-r{rank}"
        try:
            for kind in kinds:
                name = os.path.join(self.dir, f"{stem}-{kind}.bin")
                fd, direct = open_direct(name, bool(cfg.direct_io))
                self.fds[kind] = fd
                self.direct &= direct
                os.unlink(name)  # lives while open; gone when this process ends, however it ends
                if self.nbytes:
                    os.posix_fallocate(fd, 0, self.nbytes)  # reserve the space now: no ENOSPC mid-step
        except OSError as e:
            self.close()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.dir).free
                raise OffloadError(
                    f"offload.path={self.dir} is full: reserving rank {rank}'s optimizer state ({what}) failed "
                    f"with {_gb(free)} free (other ranks or programs use the same disk); nothing "
                    "was written. Fix: free space there or point offload.path at a larger disk") from None
            raise OffloadError(f"cannot create the optimizer state files in offload.path={self.dir}: {e}") from None
        if not self.direct:
            log.info("offload.path=%s: buffered I/O (O_DIRECT %s)", self.dir,
                     "off" if not cfg.direct_io else "refused by the file system")
        nbuf = max(1, min(max(2, int(cfg.buffer_count)), len(self.chunks())))  # no more sets than chunks
        self.sets = [{k: aligned_empty(chunk_elems * 4, pin).view(torch.float32) for k in kinds}
                     for _ in range(nbuf)]
        block = max(ALIGN, (getattr(cfg, "block_bytes", None) or int(cfg.block_mb) << 20) // ALIGN * ALIGN)
        self.io = AsyncIO(max(1, int(cfg.queue_depth)), block)
        log.info("offload: rank %d state in %s (%s, %d buffers of %.0f MiB per kind, queue depth %d)", rank,
                 self.dir, what, nbuf, chunk_elems * 4 / 2**20, self.io.queue_depth)

    def host_bytes(self) -> int:
        return sum(t.numel() * 4 for s in self.sets for t in s.values())

    def chunks(self) -> list[tuple[int, int]]:
        return [(c, min(c + self.chunk_elems, self.numel)) for c in range(0, self.numel, self.chunk_elems)]

    # ------------------------------------------------------------ streaming

    def _io(self, write: bool, k: int, c0: int, c1: int, bufs: dict) -> list[Batch]:
        # chunks start on ALIGN boundaries; the last one ends at numel, itself a multiple of 1024 elements
        op = self.io.write if write else self.io.read
        return [op(self.fds[kind], bufs[kind][:c1 - c0], c0 * 4, f"{kind}[{c0}:{c1}]") for kind in self.kinds]

    def stream(self) -> Iterator[Chunk]:
        """Yield each chunk with its buffers filled from the files; the chunk is written back when the
        caller asks for the next one (the caller may set `chunk.fence`, an event the buffers' reuse
        waits for). Returns after every write finished; raises OffloadError on an I/O error."""
        self.release()
        chunks = self.chunks()
        n, nbuf = len(chunks), len(self.sets)
        lock = threading.Lock()
        reads: dict[int, list[Batch]] = {}
        ready = [threading.Event() for _ in range(n)]
        writes: list[Batch] = []
        failed: list[BaseException] = []

        def issue_read(k: int, s: int) -> None:
            c0, c1 = chunks[k]
            batches = self._io(False, k, c0, c1, self.sets[s])
            with lock:
                reads[k] = batches
            ready[k].set()

        def after_write(k: int, s: int, fence, batches: list[Batch]) -> None:
            """In the I/O thread that finished the last write of chunk k: refill its buffers with k + nbuf."""
            left = [len(batches)]

            def done(b: Batch) -> None:
                with lock:
                    if b.error is not None:
                        failed.append(b.error)
                    left[0] -= 1
                    if left[0]:
                        return
                if k + nbuf < n:
                    if failed:
                        ready[k + nbuf].set()  # wake the consumer, which reports the failure
                        return
                    if fence is not None:
                        fence.synchronize()
                    issue_read(k + nbuf, s)

            for b in batches:
                b.add_done_callback(done)

        for k in range(min(nbuf, n)):
            issue_read(k, k)
        try:
            for k in range(n):
                s = k % nbuf
                ready[k].wait()
                self._raise_if(failed, "writing", k)
                with lock:
                    batches = reads.pop(k, [])
                try:
                    for b in batches:
                        b.wait()
                except OSError as e:
                    raise self._error("reading", chunks[k], e) from None
                c0, c1 = chunks[k]
                chunk = Chunk(k, c0, c1, {kind: buf[:c1 - c0] for kind, buf in self.sets[s].items()})
                yield chunk
                wb = self._io(True, k, c0, c1, self.sets[s])
                writes.extend(wb)
                after_write(k, s, chunk.fence, wb)
        finally:
            for b in writes:  # never leave a write in flight on a buffer someone may reuse
                b._event.wait()
            for ks in list(reads.values()):
                for b in ks:
                    b._event.wait()
        errors = [b.error for b in writes if b.error is not None]
        self._raise_if(errors, "writing", None)

    def _raise_if(self, errors: list, doing: str, k: Optional[int]) -> None:
        if errors:
            raise self._error(doing, None, errors[0])

    def _error(self, doing: str, rng, e: BaseException) -> OffloadError:
        where = f" (elements {rng[0]}:{rng[1]})" if rng else ""
        hint = ("the disk is full" if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                else "an I/O error")
        return OffloadError(f"{doing} the offloaded optimizer state in {self.dir}{where} failed: {e} ({hint}). "
                            "This step's update is incomplete: restart the run to resume from the newest "
                            "complete checkpoint, after fixing the disk")

    # ------------------------------------------------------------ checkpoint views

    def view(self, kind: str, offset: int, numel: int) -> torch.Tensor:
        """A tensor backed by the file itself (a shared memory map): reads and in-place writes go to
        the file. Valid until `release()` (the next step). Its storage starts at its first element
        (see hpctrain.offload.host_state.standalone)."""
        if not numel:
            return torch.empty(0, dtype=torch.float32)
        mm = self._views.get(kind)
        if mm is None:
            mm = self._views[kind] = mmap.mmap(self.fds[kind], self.nbytes, mmap.MAP_SHARED,
                                               mmap.PROT_READ | mmap.PROT_WRITE)
            self._maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.float32, count=numel, offset=offset * 4)

    def release(self) -> None:
        """Take the views back: flush what a checkpoint load wrote, unmap where no view is held."""
        if not self._maps:
            return
        self._views = {}
        for mm in self._maps:
            mm.flush()
            try:
                mm.close()
            except BufferError:  # someone still holds a view: the map goes with it
                pass
        self._maps = []

    def close(self) -> None:
        self.release()
        io = getattr(self, "io", None)
        if io is not None:
            io.close()
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
