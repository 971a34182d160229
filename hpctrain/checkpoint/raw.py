"""DCP storage that writes tensors as raw bytes in large aligned requests, and reads them back.

DCP's FileSystemWriter runs `torch.save` once per tensor through a Python stream: a zip archive
per item, small writes, and page-cache traffic that the final fsync has to flush. Here a rank writes
one `.raw` file: each writer thread streams its share of the tensors into its own aligned region of
it through a page-aligned bounce buffer with O_DIRECT (the disk's own sequential path, no page cache
to flush or pollute), in requests of BUFFER bytes, and one fsync ends it. Where the file system refuses O_DIRECT (tmpfs) the same requests go
through the page cache. DCP still plans the save and writes `.metadata`, so resharding on load,
the commit protocol and the metadata checks are unchanged; the metadata points at (file, offset,
length) as before, and the dtype and shape come from the metadata itself, so no pickle is read.

Files ending in `.distcp` (checkpoints written by DCP's own writer) are still read by DCP.
"""
from __future__ import annotations

import dataclasses
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import WriteResult

from hpctrain.checkpoint.directio import ALIGN, aligned_empty, open_direct, round_up
from hpctrain.checkpoint.directories import fsync_path

SUFFIX = ".raw"
BUFFER = 16 << 20


_thread = threading.local()


def _bounce_buffer() -> torch.Tensor:
    """This thread's page-aligned bounce buffer, allocated once: a run's writer threads live as long
    as the run (the checkpoint manager's pool), and touching 16 MiB of fresh pages per thread at
    every save is a fixed cost of several ms. Page-locked where an accelerator exists: device tensors
    are copied into it directly."""
    buf = getattr(_thread, "buffer", None)
    if buf is None:
        buf = _thread.buffer = aligned_empty(BUFFER, pin=torch.cuda.is_available())
    return buf


class _Region:
    """One writer thread's contiguous share of a rank's file, starting on an ALIGN boundary: bytes are
    appended through a page-aligned bounce buffer and leave in whole BUFFER-sized requests."""

    def __init__(self, fd: int, direct: bool, start: int):
        self.fd, self.direct = fd, direct
        self.view = _bounce_buffer()
        self.fill = 0  # bytes waiting in the buffer
        self.flushed = start  # file offset where the buffer starts
        self.end = start  # file offset after the last byte appended

    def append(self, data: torch.Tensor) -> int:
        """Append a flat uint8 tensor (on any device); returns its offset in the file."""
        offset, n, i = self.end, data.numel(), 0
        while i < n:
            k = min(BUFFER - self.fill, n - i)
            self.view[self.fill:self.fill + k].copy_(data[i:i + k])
            self.fill += k
            i += k
            if self.fill == BUFFER:
                self._write(BUFFER)
        self.end += n
        return offset

    def _write(self, nbytes: int) -> None:
        mv, done = memoryview(self.view[:nbytes].numpy()), 0
        while done < nbytes:
            done += os.pwrite(self.fd, mv[done:], self.flushed + done)
        self.flushed += self.fill
        self.fill = 0

    def close(self) -> None:
        """Write what is left, padded to ALIGN with zeros (inside this region's aligned share)."""
        if self.fill:
            pad = -self.fill % ALIGN if self.direct else 0
            self.view[self.fill:self.fill + pad].zero_()
            self._write(self.fill + pad)


def _as_bytes(data) -> torch.Tensor:
    if isinstance(data, io.BytesIO):
        raw = bytearray(data.getbuffer())
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    # A device tensor stays where it is: its slices are copied straight into the bounce buffer.
    return data.detach().contiguous().reshape(-1).view(torch.uint8)


def _split(items: list, bins: int) -> list[list]:
    """(item, bytes) pairs, largest first onto the least-loaded bin: each thread writes about the same
    number of bytes."""
    bins = max(1, min(bins, len(items)))
    out, load = [[] for _ in range(bins)], [0] * bins
    for pair in sorted(items, key=lambda p: p[1].numel(), reverse=True):
        i = load.index(min(load))
        out[i].append(pair)
        load[i] += pair[1].numel()
    return [b for b in out if b]


class RawWriter(FileSystemWriter):
    """One file per rank (`__<rank>_0.raw`, like the disk's own sequential-write test: one file,
    several writers, one fsync), cut into `thread_count` aligned regions written in parallel, by
    `pool`'s threads where given (a run keeps one pool for all its saves). `also_sync`: small files
    this rank wrote into the checkpoint beside DCP (per-rank JSON), made durable with its data, before
    the save's closing collective, so that no rank's part is missing when the checkpoint is committed."""

    def __init__(self, path, *args, pool: Optional[ThreadPoolExecutor] = None, also_sync: Sequence = (),
                 **kwargs):
        super().__init__(path, *args, **kwargs)
        self.pool, self.also_sync = pool, list(also_sync)

    def write_data(self, plan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0{SUFFIX}"
        items = [(item, _as_bytes(planner.resolve_data(item))) for item in plan.items]
        shares = _split(items, self.thread_count)
        starts, at = [], 0
        for share in shares:
            starts.append(at)
            at += round_up(sum(data.numel() for _, data in share), ALIGN)
        results: list[list[WriteResult]] = [[] for _ in shares]
        fd, direct = open_direct(os.path.join(self.path, name), True, mode=0o644)  # readable like DCP's files
        try:
            def write_share(n: int) -> None:
                region = _Region(fd, direct, starts[n])
                for item, data in shares[n]:
                    offset = region.append(data)
                    results[n].append(WriteResult(index=item.index, size_in_bytes=data.numel(),
                                                  storage_data=_StorageInfo(name, offset, data.numel())))
                region.close()

            pool = self.pool or ThreadPoolExecutor(max(1, len(shares)))
            try:
                for f in [pool.submit(write_share, n) for n in range(len(shares))]:
                    f.result()  # the first failure (ENOSPC, EIO) propagates to DCP, which fails the save
            finally:
                if pool is not self.pool:
                    pool.shutdown()
            if shares:
                os.ftruncate(fd, starts[-1] + sum(data.numel() for _, data in shares[-1]))  # the last pad
            if self.sync_files:
                os.fsync(fd)
                for extra in {*self.also_sync, *(os.path.dirname(p) for p in self.also_sync)}:
                    fsync_path(extra)
        finally:
            os.close(fd)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([r for share in results for r in share])
        return fut


def read_raw(root: str, metadata, storage_data: dict, items: list, planner, threads: int = 4) -> None:
    """Fill the planner's tensors from `.raw` files: `threads` readers over each file's requests in
    file order, each item read straight into its destination when the destination is the whole
    stored chunk (the common case)."""
    per_file: dict[str, list] = {}
    for req in items:
        per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)
    tasks = []
    for rel, reqs in per_file.items():
        reqs = sorted(reqs, key=lambda r: storage_data[r.storage_index].offset)
        total = sum(storage_data[r.storage_index].length for r in reqs)
        share, acc = [], 0
        for r in reqs:  # consecutive runs of about total / threads bytes
            share.append(r)
            acc += storage_data[r.storage_index].length
            if acc >= total / threads:
                tasks.append((rel, share))
                share, acc = [], 0
        if share:
            tasks.append((rel, share))

    def read_file(rel: str, reqs: list) -> list:
        done = []
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        try:
            for req in sorted(reqs, key=lambda r: storage_data[r.storage_index].offset):
                info = storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(_pread(fd, info, bytearray(info.length), rel)))
                    continue
                target = planner.resolve_tensor(req).detach()
                md = metadata.state_dict_metadata[req.storage_index.fqn]
                sizes = _chunk_sizes(md, req.storage_index)
                whole = tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)
                if whole and target.device.type == "cpu" and target.is_contiguous() and \
                        target.dtype == md.properties.dtype:
                    _pread(fd, info, target.reshape(-1).view(torch.uint8).numpy(), rel)
                else:
                    stored = torch.empty(sizes, dtype=md.properties.dtype)
                    _pread(fd, info, stored.reshape(-1).view(torch.uint8).numpy(), rel)
                    for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        stored = stored.narrow(dim, off, n)
                    target.copy_(stored)
                done.append((req, target))
        finally:
            os.close(fd)
        return done

    with ThreadPoolExecutor(max(1, min(threads, len(tasks)))) as pool:
        futures = [pool.submit(read_file, rel, reqs) for rel, reqs in tasks]
        for f in futures:
            for req, target in f.result():
                planner.commit_tensor(req, target)


def _chunk_sizes(md, index) -> tuple:
    if index.index is not None and index.index < len(md.chunks) and \
            tuple(md.chunks[index.index].offsets) == tuple(index.offset):
        return tuple(md.chunks[index.index].sizes)
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return tuple(chunk.sizes)
    raise KeyError(f"{index.fqn}: no stored chunk at offset {list(index.offset)}")


def _pread(fd: int, info, dest, rel: str):
    view, done = memoryview(dest).cast("B"), 0
    if view.nbytes != info.length:
        raise ValueError(f"{rel}: item of {info.length} bytes does not match its tensor ({view.nbytes} bytes)")
    while done < info.length:
        n = os.preadv(fd, [view[done:]], info.offset + done)
        if n == 0:
            raise EOFError(f"{rel} is truncated: it ends at byte {info.offset + done}, the metadata needs {info.offset + info.length}")
        done += n
    return dest


def split_plan(plan, storage_data: dict):
    """(raw items, plan of everything else) for a DCP load plan."""
    raw = [r for r in plan.items if storage_data[r.storage_index].relative_path.endswith(SUFFIX)]
    rest = [r for r in plan.items if not storage_data[r.storage_index].relative_path.endswith(SUFFIX)]
    return raw, dataclasses.replace(plan, items=rest)
