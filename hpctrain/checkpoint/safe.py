"""Reading checkpoints without unpickling arbitrary objects, and checking one before loading it.

DCP stores its `.metadata` as a pickle. We read it with an unpickler that admits only DCP's own
metadata classes and plain containers (weights_only semantics); tensors are read by DCP with
`torch.load(weights_only=True)`; and we refuse checkpoints holding pickled non-tensor items at all.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from hpctrain.checkpoint import raw

ALLOWED_MODULES = ("torch.distributed.checkpoint.", "collections")
ALLOWED = {
    ("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                              "bool", "bytes", "slice", "getattr")
} | {("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
     ("torch.serialization", "_get_layout"),  # a layout looked up by name, e.g. torch.strided
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # the checkpoint_id DCP records


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says what is wrong with it."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(ALLOWED_MODULES) or (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from checkpoint metadata")


def read_metadata(path: str | os.PathLike):
    meta_path = Path(path) / ".metadata"
    try:
        data = meta_path.read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{meta_path} is missing") from None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise DamagedCheckpoint(f"{meta_path} is unreadable ({type(e).__name__}: {e})") from None


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
