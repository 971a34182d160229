"""The file of one rank's in-memory snapshot (checkpoint.memory_every): its format, a writer, and a reader
that needs no torch (the node agent serves these files, and checks them, without it).

    bytes 0-7    b"HPCSNAP1"
    bytes 8-15   the header's length H (u64, little endian)
    16..16+H     the header: JSON (an object), possibly followed by spaces
    P = 16 + H rounded up to 4096: the payload, each tensor at P + its `offset`

Header: version, run (the run's id), step, rank, world, layout (changes when the sharding does), node
(where it was written), plain ({object: state_dict} of this rank's non-sharded objects), scalars ({key
path: value}, the non-tensor leaves of the sharded objects' state dicts), tensors ([{key, dtype, shape,
offset, nbytes}], offsets relative to P) and payload_crc32 (of the bytes from P to the end of the file).

A file is complete or absent: it is written as `.tmp-<name>` and renamed. A checkpoint is data, never
code: no pickle, and every length and offset is checked against the file before it is used, as
hpctrain.checkpoint.validate does for disk checkpoints.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import stat
import struct
import zlib
from pathlib import Path
from typing import Optional

MAGIC = b"HPCSNAP1"
VERSION = 1
HEADER_MAX = 16 << 20  # a header is JSON of a few states and a list of tensors: far below this
ALIGN = 4096  # the payload's start
TENSOR_ALIGN = 64  # each tensor's: any dtype's element size divides it
NAME_RE = re.compile(r"^snap-s(\d{8})-r(\d{5})\.hsnap$")
TMP_PREFIX = ".tmp-"
# Element sizes of the dtypes a snapshot may hold (torch's names without "torch.").
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
            "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}
_CHUNK = 64 << 20  # bytes checksummed at a time when reading (zlib releases the GIL for each)


class DamagedSnapshot(ValueError):
    """A snapshot file that must not be loaded; the message names the file and the fault."""


def name(step: int, rank: int) -> str:
    return f"snap-s{step:08d}-r{rank:05d}.hsnap"


def parse_name(filename: str) -> Optional[tuple[int, int]]:
    """(step, rank) of a complete snapshot's file name; None for anything else (temporary files too)."""
    m = NAME_RE.match(filename)
    return (int(m.group(1)), int(m.group(2))) if m else None


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def payload_start(header_len: int) -> int:
    return align(16 + header_len, ALIGN)


def place(tensors: list[tuple[str, str, list, int]]) -> tuple[list[dict], int]:
    """The header's tensor entries for [(key, dtype, shape, nbytes)], each at the next TENSOR_ALIGN
    offset of the payload, and the payload's size."""
    entries, off, seen = [], 0, set()
    for key, dtype, shape, nbytes in tensors:
        if key in seen:
            raise ValueError(f"two tensors of a snapshot have the key {key!r}")
        seen.add(key)
        entries.append({"key": key, "dtype": dtype, "shape": list(shape), "offset": off, "nbytes": nbytes})
        off = align(off + nbytes, TENSOR_ALIGN)
    return entries, off


def write_header(header: dict, reserve: int = 0) -> bytes:
    """Bytes 0 .. the payload's start: magic, length, the header's JSON padded with spaces to `reserve`
    bytes of header (so that a writer that placed the payload first can fill in the checksum last)."""
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if reserve and len(text) > reserve:
        raise ValueError(f"a snapshot header of {len(text)} bytes does not fit the {reserve} reserved")
    size = max(len(text), reserve)
    if size > HEADER_MAX:
        raise ValueError(f"a snapshot header of {size} bytes is over the limit of {HEADER_MAX}")
    text += b" " * (size - len(text))
    head = MAGIC + struct.pack("<Q", size) + text
    return head + b"\0" * (payload_start(size) - len(head))


def write(path: str | os.PathLike, header: dict, blobs: dict) -> Path:
    """A whole snapshot at once: `header` without tensors/payload_crc32, `blobs` {key: (dtype, shape, bytes)}.
    Written as .tmp-<name> and renamed. (The ranks' writer, hpctrain.checkpoint.memory, fills reused
    files in place instead; this one is for tools and tests.)"""
    path = Path(path)
    entries, size = place([(k, d, s, memoryview(b).nbytes) for k, (d, s, b) in blobs.items()])
    payload = bytearray(size)
    for e, (_, _, b) in zip(entries, blobs.values()):
        payload[e["offset"]:e["offset"] + e["nbytes"]] = memoryview(b).cast("B")
    head = write_header({**header, "tensors": entries, "payload_crc32": zlib.crc32(payload)})
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(payload)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------ reading

def open_regular(path: Path):
    """The file for reading, if it is a regular file reached without a symbolic link: a FIFO would block the
    reader, a link could point at anything (O_NONBLOCK: opening a FIFO does not wait for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DamagedSnapshot(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_header(path: str | os.PathLike) -> dict:
    """The checked header of a snapshot file, with `_payload` (the payload's start) and `_size` (the
    file's) added; DamagedSnapshot names what is wrong. The payload's checksum is verify's."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(16)
            if len(head) < 16:
                raise DamagedSnapshot(f"{path} is truncated: {size} bytes, shorter than the 16-byte preamble")
            if head[:8] != MAGIC:
                raise DamagedSnapshot(f"{path} is not a memory snapshot (its first bytes are {head[:8]!r}, "
                                      f"not {MAGIC!r})")
            (n,) = struct.unpack("<Q", head[8:16])
            if n > HEADER_MAX:
                raise DamagedSnapshot(f"{path}: its header claims {n} bytes, over the limit of {HEADER_MAX}")
            if 16 + n > size:
                raise DamagedSnapshot(f"{path} is truncated: its header claims {n} bytes, the file holds "
                                      f"{size - 16} after the preamble")
            text = f.read(n)
    except OSError as e:
        raise DamagedSnapshot(f"{path} unreadable ({e.strerror or e})") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise DamagedSnapshot(f"{path}: its header is not JSON ({e})") from None
    problem = header_problem(header, size, payload_start(n))
    if problem:
        raise DamagedSnapshot(f"{path}: {problem}")
    return {**header, "_payload": payload_start(n), "_size": size}


def header_problem(h, size: int, start: int) -> Optional[str]:
    """Why a parsed header cannot describe a file of `size` bytes whose payload starts at `start`."""
    if not isinstance(h, dict):
        return "its header is not a JSON object"
    kinds = {"version": int, "run": str, "step": int, "rank": int, "world": int, "layout": str, "node": str,
             "plain": dict, "scalars": dict, "tensors": list, "payload_crc32": int}
    for k, kind in kinds.items():
        if type(h.get(k)) is not kind:
            return f"its header's {k!r} is missing or not a {kind.__name__}"
    if h["version"] != VERSION:
        return f"it is of format version {h['version']}, this hpctrain reads {VERSION}"
    if not 0 <= h["rank"] < h["world"] or h["step"] < 0:
        return f"its header says rank {h['rank']} of {h['world']}, step {h['step']}"
    if start > size:
        return f"it is truncated: the payload starts at byte {start}, the file has {size}"
    payload, end = size - start, 0
    for i, t in enumerate(h["tensors"]):
        if not isinstance(t, dict) or type(t.get("key")) is not str or t.get("dtype") not in ITEMSIZE \
                or not isinstance(t.get("shape"), list) or not all(type(d) is int and d >= 0 for d in t["shape"]) \
                or type(t.get("offset")) is not int or type(t.get("nbytes")) is not int:
            return f"its tensor entry {i} is not {{key, dtype (one of {', '.join(ITEMSIZE)}), shape, offset, nbytes}}"
        numel = 1
        for d in t["shape"]:
            numel *= d
        if t["nbytes"] != numel * ITEMSIZE[t["dtype"]]:
            return (f"tensor {t['key']!r}: {t['nbytes']} bytes for shape {t['shape']} of {t['dtype']} "
                    f"({numel * ITEMSIZE[t['dtype']]} expected)")
        if t["offset"] < end or t["offset"] % TENSOR_ALIGN:
            return f"tensor {t['key']!r} at offset {t['offset']} overlaps the one before it or is misaligned"
        end = t["offset"] + t["nbytes"]
        if end > payload:
            return (f"tensor {t['key']!r} ends at payload byte {end}, beyond the file's payload of {payload} "
                    "bytes (truncated?)")
    return None


def crc_of(buf, start: int, end: int) -> int:
    """CRC-32 of buf[start:end] (anything with the buffer protocol), in chunks: zlib lets go of the GIL
    for each, so a writer thread checksumming does not stop the training loop."""
    view, crc = memoryview(buf), 0
    try:
        for a in range(start, end, _CHUNK):
            crc = zlib.crc32(view[a:min(end, a + _CHUNK)], crc)
    finally:
        view.release()
    return crc


def verify(path: str | os.PathLike) -> dict:
    """read_header, then the payload's checksum: the header of a snapshot fit to load, else DamagedSnapshot."""
    header = read_header(path)
    with open_regular(path) as f:
        if header["_size"] == header["_payload"]:
            crc = 0
        else:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                crc = crc_of(mm, header["_payload"], header["_size"])
    if crc != header["payload_crc32"]:
        raise DamagedSnapshot(f"{path}: the payload's checksum is {crc:08x}, its header says "
                              f"{header['payload_crc32']:08x} (a byte changed, or the file was cut)")
    return header


def tensor_views(path: str | os.PathLike, header: dict) -> dict[str, memoryview]:
    """{key: read-only memoryview of the tensor's bytes} (mapped, not read): `header` is read_header's of
    this very file (its bounds were checked against it)."""
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size != header["_size"]:
            raise DamagedSnapshot(f"{path} changed size since its header was read")
        if header["_size"] == 0:
            return {}
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view, p = memoryview(mm), header["_payload"]
    return {t["key"]: view[p + t["offset"]:p + t["offset"] + t["nbytes"]] for t in header["tensors"]}
