"""DCP storage that writes tensors as raw bytes in large aligned requests, and reads them back.

DCP's FileSystemWriter runs `torch.save` once per tensor through a Python stream: a zip archive
per item, small writes, and page-cache traffic that the final fsync has to flush. Here each writer
thread streams its share of this rank's tensors into one `.raw` file through a page-aligned bounce
buffer with O_DIRECT (the disk's own sequential path, no page cache to flush or pollute), in
requests of BUFFER bytes. Where the file system refuses O_DIRECT (tmpfs) the same requests go
through the page cache. DCP still plans the save and writes `.metadata`, so resharding on load,
the commit protocol and the metadata checks are unchanged; the metadata points at (file, offset,
length) as before, and the dtype and shape come from the metadata itself, so no pickle is read.

Files ending in `.distcp` (checkpoints written by DCP's own writer) are still read by DCP.
"""
from __future__ import annotations

import dataclasses
import errno
import io
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

SUFFIX = ".raw"
ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block
BUFFER = 16 << 20


class _Sink:
    """Appends bytes to one file; writes leave in whole BUFFER-sized aligned requests."""

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            self.fd, self.direct = os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.fd, self.direct = os.open(path, flags, 0o644), False
        self.buf = mmap.mmap(-1, BUFFER)  # anonymous mappings are page-aligned
        self.view = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.fill = 0  # bytes waiting in the buffer
        self.flushed = 0  # file offset where the buffer starts
        self.length = 0  # bytes appended

    def append(self, data: torch.Tensor) -> int:
        """Append a flat uint8 tensor (on any device); returns its offset in the file."""
        start, n, i = self.length, data.numel(), 0
        while i < n:
            k = min(BUFFER - self.fill, n - i)
            self.view[self.fill:self.fill + k].copy_(data[i:i + k])
            self.fill += k
            i += k
            if self.fill == BUFFER:
                self._write(BUFFER)
        self.length += n
        return start

    def _write(self, nbytes: int) -> None:
        mv, done = memoryview(self.buf)[:nbytes], 0
        while done < nbytes:
            done += os.pwrite(self.fd, mv[done:], self.flushed + done)
        mv.release()
        self.flushed += self.fill
        self.fill = 0

    def close(self, fsync: bool) -> None:
        try:
            if self.fill:
                pad = -self.fill % ALIGN if self.direct else 0
                self.view[self.fill:self.fill + pad].zero_()
                self._write(self.fill + pad)
                os.ftruncate(self.fd, self.length)
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            del self.view
            self.buf.close()


def _as_bytes(data) -> torch.Tensor:
    if isinstance(data, io.BytesIO):
        raw = bytearray(data.getbuffer())
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    # A device tensor stays where it is: its slices are copied straight into the bounce buffer.
    return data.detach().contiguous().reshape(-1).view(torch.uint8)


def _item_bytes(item) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 0
    return item.tensor_data.size.numel() * torch._utils._element_size(item.tensor_data.properties.dtype)


def _split(items: list, bins: int) -> list[list]:
    """Largest first onto the least-loaded bin: each thread gets about the same number of bytes."""
    bins = max(1, min(bins, len(items)))
    out, load = [[] for _ in range(bins)], [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        i = load.index(min(load))
        out[i].append(item)
        load[i] += _item_bytes(item)
    return out


class RawWriter(FileSystemWriter):
    def write_data(self, plan, planner) -> torch.futures.Future:
        prefix = plan.storage_data.prefix
        results: list[WriteResult] = []
        lock = threading.Lock()

        def write_file(n: int, items: list) -> None:
            name = f"{prefix}{n}{SUFFIX}"
            sink = _Sink(os.path.join(self.path, name))
            mine = []
            try:
                for item in items:
                    data = _as_bytes(planner.resolve_data(item))
                    offset = sink.append(data)
                    mine.append(WriteResult(index=item.index, size_in_bytes=data.numel(),
                                            storage_data=_StorageInfo(name, offset, data.numel())))
            finally:
                sink.close(self.sync_files)
            with lock:
                results.extend(mine)

        buckets = _split(plan.items, self.thread_count)
        with ThreadPoolExecutor(len(buckets)) as pool:
            for f in [pool.submit(write_file, n, b) for n, b in enumerate(buckets)]:
                f.result()  # the first failure (ENOSPC, EIO) propagates to DCP, which fails the save
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut


def read_raw(root: str, metadata, storage_data: dict, items: list, planner, threads: int = 4) -> None:
    """Fill the planner's tensors from `.raw` files: one thread per file, each item read straight
    into its destination when the destination is the whole stored chunk (the common case)."""
    per_file: dict[str, list] = {}
    for req in items:
        per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)

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

    with ThreadPoolExecutor(max(1, min(threads, len(per_file)))) as pool:
        futures = [pool.submit(read_file, rel, reqs) for rel, reqs in per_file.items()]
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
