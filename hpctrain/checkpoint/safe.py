"""Reading checkpoints without unpickling arbitrary objects, and checking one before loading it.

DCP stores its `.metadata` as a pickle. We read it with an unpickler that admits an exact list of
(module, name) pairs: DCP's own metadata classes, torch's Size and dtypes and plain containers; the
records it yields are checked (storage paths stay inside the checkpoint directory, byte ranges and
chunks are in range) before anything is opened. Tensors are read by DCP with
`torch.load(weights_only=True)` or by raw.py from those byte ranges; and we refuse checkpoints holding
pickled non-tensor items at all.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, StorageMeta,
                                                   TensorStorageMetadata)

from hpctrain.checkpoint import raw

# Exactly the globals DCP's `.metadata` pickle names: its record classes, a few plain types, torch's
# Size and dtypes. Nothing is admitted by module prefix, and no name may hold a dot (a protocol-4
# pickle would walk attributes through it: `filesystem` + `os.system` reaches os.system).
_META = "torch.distributed.checkpoint.metadata"
ALLOWED = {(_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a layout looked up by name, e.g. torch.strided
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # the checkpoint_id DCP records
    ("collections", "OrderedDict"),
} | {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bool",
                               "bytes", "slice")}


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says what is wrong with it."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from checkpoint metadata")


def read_metadata(path: str | os.PathLike):
    """The checkpoint's DCP metadata, unpickled through the allow-list and checked: every storage
    record points inside the checkpoint directory at a non-negative byte range, and every chunk lies
    inside its tensor. DamagedCheckpoint, naming the fault, otherwise."""
    meta_path = Path(path) / ".metadata"
    try:
        data = meta_path.read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{meta_path} is missing") from None
    try:
        md = _Unpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise DamagedCheckpoint(f"{meta_path} is unreadable ({type(e).__name__}: {e})") from None
    problem = _records_problem(md, Path(path))
    if problem:
        raise DamagedCheckpoint(f"{meta_path}: {problem}")
    return md


def _records_problem(md, root: Path) -> str | None:
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not DCP's Metadata"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data or {}, dict):
        return "its state_dict_metadata or storage_data is not a mapping"
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"the entry {fqn!r} is not a tensor or bytes record"
        if isinstance(item, TensorStorageMetadata):
            problem = _chunks_problem(fqn, item)
            if problem:
                return problem
    inside = root.resolve()
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts \
                or not (inside / rel).resolve().is_relative_to(inside):
            return f"the storage of {getattr(index, 'fqn', index)!r} is {rel!r}, outside the checkpoint directory"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            return f"the storage of {getattr(index, 'fqn', index)!r} has offset {offset!r}, length {length!r}"
    return None


def _chunks_problem(fqn: str, item) -> str | None:
    size = tuple(item.size)
    if not all(isinstance(n, int) and n >= 0 for n in size):
        return f"{fqn} has shape {list(size)}"
    for chunk in item.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                not isinstance(o, int) or not isinstance(n, int) or o < 0 or n < 0 or o + n > d
                for o, n, d in zip(offsets, sizes, size)):
            return f"a chunk of {fqn} (offsets {list(offsets)}, sizes {list(sizes)}) is outside its shape {list(size)}"
    return None


class SafeReader(FileSystemReader):
    """Reads `.raw` files (hpctrain's writer) itself and leaves `.distcp` files to DCP."""

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan, planner):
        mine, rest = raw.split_plan(plan, self.storage_data)
        raw.read_raw(str(self.path), self.metadata, self.storage_data, mine, planner)
        return super().read_data(rest, planner)

    def read_metadata(self, *args, **kwargs):
        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        raise DamagedCheckpoint(f"checkpoint item {read_item.dest_index.fqn} is a pickled object; "
                                "hpctrain checkpoints hold tensors only and will not unpickle it")


def check_files(path: str | os.PathLike, md=None) -> None:
    """Every byte range the metadata points at exists: catches missing and truncated shard files."""
    path = Path(path)
    md = md if md is not None else read_metadata(path)
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = path / rel
        if not f.is_file():
            raise DamagedCheckpoint(f"shard file {f} is missing")
        size = f.stat().st_size
        if size < end:
            raise DamagedCheckpoint(f"shard file {f} is truncated ({size} bytes, the metadata needs {end})")


def check_shapes(md, expected: dict[str, tuple]) -> None:
    """The checkpoint holds every tensor we will load, at the same global shape."""
    problems = []
    for fqn, shape in expected.items():
        item = md.state_dict_metadata.get(fqn)
        if item is None:
            problems.append(f"{fqn} is missing")
        elif not isinstance(item, TensorStorageMetadata):
            problems.append(f"{fqn} is not a tensor")
        elif tuple(item.size) != tuple(shape):
            problems.append(f"{fqn} has shape {list(item.size)} in the checkpoint but {list(shape)} in this model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise DamagedCheckpoint("it was made for a different model: " + "; ".join(problems[:3]) + more)
