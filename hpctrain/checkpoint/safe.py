"""Reading checkpoints without unpickling arbitrary objects, and checking one whole before loading it.

DCP stores its `.metadata` as a pickle. We read it only when it is a regular file of at most
MAX_METADATA_BYTES, with an unpickler that admits an exact list of (module, name) pairs: DCP's own
metadata classes, torch's Size and dtypes and plain containers, each bounded (see _Unpickler). The records
it yields are then checked as a whole before anything is allocated or opened: counts and shapes within
the bounds below, the chunks of every tensor tiling it exactly (no element left unwritten, none written
twice), one storage record per chunk, inside the checkpoint directory and as long as the chunk, and the
planner's paths matching the keys. Tensors are read by DCP with `torch.load(weights_only=True)` or by
raw.py from those byte ranges; and we refuse checkpoints holding pickled non-tensor items at all.
"""
from __future__ import annotations

import io
import math
import os
import pickle
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.serialization import _get_layout

from hpctrain.checkpoint import raw
from hpctrain.checkpoint.validate import DamagedCheckpoint  # noqa: F401  (raised from here since before validate)
from hpctrain.core import hf_format as hf

# ---------------------------------------------------------------------------------------------- bounds
# A pickle costs ~143 bytes per stored chunk (measured: 409,600 chunk records with their storage records)
# and ~15 times its size in memory once unpickled. Llama 3 405B with its Adam moments is ~3,400 sharded
# tensors; at 1,024 shards each (FSDP 128 x TP 8 on 16k GPUs) that is 3.5 M chunks, a ~500 MB file.
# Twice that is refused unread: a larger file is no checkpoint of ours, and reading it would take more
# memory than a rank can spare.
MAX_METADATA_BYTES = 1 << 30
MAX_CHUNKS = MAX_METADATA_BYTES // 128  # 8.4 M: no real file under the cap holds more chunk records
MAX_CHUNKS_PER_TENSOR = 1 << 17  # one shard per rank of a 131,072-rank job
MAX_DIMS = 32  # our tensors have at most 4
MAX_NUMEL = 1 << 40  # 500 times the largest tensor of a 405B model (its 2.1e9-element embedding)
MAX_BYTE = 1 << 62  # byte offsets and lengths: far past any file, still exact in int64
MAX_NAME = 4096  # characters of a tensor's name or of a path: PATH_MAX
MAX_DEPTH = 16  # levels of a state dict (ours: 3)
# Candidate pairs the overlap test may compare in one tensor: a grid of r x c shards costs n * min(r, c)
# (FSDP 1,024 x TP 8: 8 k); only a layout nobody writes comes near.
MAX_PAIRS = 1 << 22

_META = "torch.distributed.checkpoint.metadata"
_RECORDS = {(_META, c.__name__): c for c in (Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                              TensorStorageMetadata, ChunkStorageMetadata, BytesStorageMetadata)}
_RECORDS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo


def _one_of(kinds: tuple, limit: int):
    """Arguments: none, or one of `kinds` of at most `limit` items (characters, elements)."""
    def check(args) -> str | None:
        if len(args) > 1 or (args and (type(args[0]) not in kinds or _length(args[0]) > limit)):
            return f"it takes at most one {' or '.join(k.__name__ for k in kinds)} of at most {limit:,} items"
        return None
    return check


def _size_args(args) -> str | None:
    if len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > MAX_DIMS or not all(
            type(v) is int and 0 <= v <= MAX_NUMEL for v in args[0]):
        return f"a shape is one list of at most {MAX_DIMS} whole numbers from 0 to {MAX_NUMEL:,}"
    return None


def _names_args(count: int):
    def check(args) -> str | None:
        if len(args) > count or not all(type(a) is str for a in args) or sum(map(len, args)) > MAX_NAME:
            return f"it takes at most {count} strings of {MAX_NAME} characters in all"
        return None
    return check


def _device_args(args) -> str | None:
    if not 1 <= len(args) <= 2 or type(args[0]) is not str or len(args[0]) > 64 or (
            len(args) == 2 and not (type(args[1]) is int and 0 <= args[1] < 1 << 16)):
        return "a device is a name and an index"
    return None


def _enum_args(args) -> str | None:
    return None if len(args) == 1 and type(args[0]) is int and 0 <= args[0] < 16 else "it takes one small number"


def _slice_args(args) -> str | None:
    return None if len(args) <= 3 and all(a is None or type(a) is int for a in args) else "it takes three numbers"


def _bytes_args(args) -> str | None:
    # Never a number: bytes(n) allocates n zero bytes (the 45-byte `torch.Size(bytes(3 * 10**8))`).
    return _one_of((bytes, bytearray, list, tuple), 1 << 20)(args)


_CONTAINERS = (list, tuple, dict, set, frozenset, OrderedDict)
_SCALARS = (int, float, bool, str)
# Every callable the pickle may name, with the check its arguments pass (the pickle calls it with REDUCE).
_CALLS = {
    ("torch", "Size"): (torch.Size, _size_args),
    ("torch", "device"): (torch.device, _device_args),
    ("torch.serialization", "_get_layout"): (_get_layout, _names_args(1)),  # a layout by name: torch.strided
    (_META, "_MEM_FORMAT_ENCODING"): (_MEM_FORMAT_ENCODING, _enum_args),
    ("pathlib", "PosixPath"): (PosixPath, _names_args(256)),  # the checkpoint_id DCP records
    ("pathlib", "PurePosixPath"): (PurePosixPath, _names_args(256)),
    ("collections", "OrderedDict"): (OrderedDict, _one_of(_CONTAINERS, 1 << 20)),
    **{("builtins", c.__name__): (c, _one_of(_CONTAINERS, 1 << 20)) for c in (dict, list, tuple, set, frozenset)},
    # str() of a container would spell out every element (a list of a thousand references to one long
    # string): only a scalar, of at most 64 characters or digits.
    **{("builtins", c.__name__): (c, _one_of(_SCALARS, 64)) for c in (int, float, str, bool)},
    ("builtins", "bytes"): (bytes, _bytes_args),
    ("builtins", "slice"): (slice, _slice_args),
}
# Exactly the globals DCP's `.metadata` pickle may name: its record classes, a few plain types, torch's
# Size and dtypes. Nothing is admitted by module prefix, and no name may hold a dot (a protocol-4
# pickle would walk attributes through it: `filesystem` + `os.system` reaches os.system).
ALLOWED = set(_RECORDS) | set(_CALLS)


def _length(v) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return len(str(abs(v))) if abs(v) < 1 << 256 else 1 << 30  # digits, without converting a huge one
    return len(v) if hasattr(v, "__len__") else 1


def _brief(args) -> str:
    """The arguments of a refused call, described without spelling out a large one."""
    def one(a) -> str:
        if type(a) in (int, float, bool) or a is None:
            return repr(a) if _length(a) <= 24 else f"an int of {_length(a):,} digits"
        if isinstance(a, (str, bytes)) and len(a) <= 24:
            return repr(a)
        if isinstance(a, (tuple, list)) and len(a) <= 8 and all(type(v) in (int, str) and _length(v) <= 24 for v in a):
            return repr(a)
        return f"a {type(a).__name__} of {_length(a):,} items"
    return ", ".join(one(a) for a in args)


class _Unpickler(pickle.Unpickler):
    """The allow-list, bounded. DCP's record classes are built the way DCP pickles them (NEWOBJ with no
    arguments, then BUILD): a call of one (REDUCE) would run its __init__ on any arguments
    (MetadataIndex copies its offset into a torch.Size), so their stand-ins refuse it. Every other
    admitted callable takes only the arguments its check allows, and all of them together may create
    no more elements than the file has bytes (a real file makes one Size of a few ints per ~40 bytes):
    a small file cannot ask for memory or time beyond a fixed multiple of its size."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.size = len(data)
        self.budget = len(data) + 4096
        # Made for this file alone: nothing a pickle does to them outlives its load.
        self.admitted = {key: _stand_in(cls) for key, cls in _RECORDS.items()}
        self.admitted.update({key: self._bounded(f"{key[0]}.{key[1]}", fn, check)
                              for key, (fn, check) in _CALLS.items()})

    def find_class(self, module: str, name: str):
        found = self.admitted.get((module, name))
        if found is not None:
            return found
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from checkpoint metadata")

    def _bounded(self, qualname: str, fn, check):
        def call(*args):
            problem = check(args)
            if problem:
                raise pickle.UnpicklingError(f"refusing {qualname}({_brief(args)}): {problem}")
            self.budget -= 1 + sum(_length(a) for a in args if not isinstance(a, (int, float)))
            if self.budget < 0:
                raise pickle.UnpicklingError(f"refusing {qualname}(...): the pickle asks its calls for more elements "
                                             f"than the file has bytes ({self.size:,})")
            return fn(*args)
        return call


def _stand_in(cls):
    """A type that NEWOBJ can use to make an empty `cls` (then filled by BUILD), which refuses to be
    called (REDUCE) or changed."""
    qualname = f"{cls.__module__}.{cls.__name__}"

    class Refusing(type):
        def __call__(self, *args, **kwargs):
            raise pickle.UnpicklingError(f"refusing to call {qualname}({_brief(args)}): DCP builds it empty and "
                                         "fills it in")

        def __setattr__(self, name, value):
            raise pickle.UnpicklingError(f"refusing to change {qualname}.{name}")

    def new(stand_in, *args, **kwargs):
        if args or kwargs:
            raise pickle.UnpicklingError(f"refusing {qualname} built from arguments ({_brief(args)})")
        return object.__new__(cls)

    return Refusing(cls.__name__, (), {"__new__": new})


def read_metadata(path: str | os.PathLike):
    """The checkpoint's DCP metadata, read within MAX_METADATA_BYTES, unpickled through the bounded
    allow-list and checked whole (see _records_problem). DamagedCheckpoint, naming the fault, otherwise."""
    meta_path = Path(path) / ".metadata"
    data = _metadata_bytes(meta_path)
    try:
        md = _Unpickler(data).load()
    except Exception as e:
        raise DamagedCheckpoint(f"{meta_path} is unreadable ({type(e).__name__}: {e})") from None
    try:
        problem = _records_problem(md, Path(path))
    except (AttributeError, TypeError, ValueError, OverflowError, KeyError, IndexError) as e:
        # a record built empty and never filled (NEWOBJ without BUILD) lacks the fields the checks read
        problem = f"a record is incomplete or malformed ({type(e).__name__}: {e})"
    if problem:
        raise DamagedCheckpoint(f"{meta_path}: {problem}")
    return md


def _metadata_bytes(meta_path: Path) -> bytes:
    try:
        size = meta_path.stat().st_size
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{meta_path} is missing") from None
    except OSError as e:
        raise DamagedCheckpoint(f"{meta_path} cannot be read ({e.strerror or e})") from None
    if size > MAX_METADATA_BYTES:
        raise DamagedCheckpoint(f"{meta_path} is {size:,} bytes, more than checkpoint metadata can be "
                                f"({MAX_METADATA_BYTES:,}: a 405B model on 16k GPUs writes ~500 MB)")
    try:
        return hf.read_small(meta_path, MAX_METADATA_BYTES)
    except hf.HFError as e:  # not a regular file, or grew while being read
        raise DamagedCheckpoint(str(e).split(" Fix: ")[0]) from None


def _records_problem(md, root: Path) -> str | None:
    """Why the unpickled metadata cannot be used: each check in turn, the first fault named."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not DCP's Metadata"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict) \
            or not isinstance(md.planner_data, dict):
        return "its state_dict_metadata, storage_data or planner_data is not a mapping"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return f"its storage_meta is a {type(md.storage_meta).__name__}"
    entries = (_entry_problem(fqn, item) for fqn, item in md.state_dict_metadata.items())
    return _counts_problem(md) or next((p for p in entries if p), None) or _storage_problem(md, root) \
        or _planner_problem(md)


def _counts_problem(md) -> str | None:
    """The sizes of the collections, by len() alone, before anything walks them: a few bytes of pickle can
    reference one list millions of times."""
    entries = md.state_dict_metadata
    if len(entries) > MAX_CHUNKS:
        return f"it lists {len(entries):,} tensors and objects, more than the {MAX_CHUNKS:,} a checkpoint may hold"
    total = 0
    for fqn, item in entries.items():
        chunks = getattr(item, "chunks", [])
        if not isinstance(chunks, list):
            return f"the chunks of {fqn!r} are a {type(chunks).__name__}, not a list"
        if len(chunks) > MAX_CHUNKS_PER_TENSOR:
            return f"{fqn} has {len(chunks):,} chunks, more than the {MAX_CHUNKS_PER_TENSOR:,} a tensor may have"
        total += len(chunks)
        if total > MAX_CHUNKS:
            return f"its tensors have more than {MAX_CHUNKS:,} chunks in all"
    if len(md.storage_data) > total + len(entries):
        return f"it has {len(md.storage_data):,} storage records for {total:,} chunks"
    if len(md.planner_data) > len(entries):
        return f"its planner_data has {len(md.planner_data):,} entries for {len(entries):,} tensors and objects"
    return None


def _entry_problem(fqn, item) -> str | None:
    if not isinstance(fqn, str) or len(fqn) > MAX_NAME or \
            not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
        return f"the entry {_brief([fqn])} is not a tensor or bytes record"
    if isinstance(item, BytesStorageMetadata):
        return None
    if not isinstance(getattr(item, "properties", None), TensorProperties) or \
            not isinstance(item.properties.dtype, torch.dtype):
        return f"{fqn} has no dtype"
    return _size_problem(fqn, item) or _chunks_problem(fqn, item)


def _whole(values, count: int | None = None) -> bool:
    """A list or tuple of `count` (any number up to MAX_DIMS where None) whole numbers in [0, MAX_NUMEL]."""
    return isinstance(values, (tuple, list)) and len(values) <= MAX_DIMS and (count is None or len(values) == count) \
        and all(type(v) is int and 0 <= v <= MAX_NUMEL for v in values)


def _size_problem(fqn: str, item) -> str | None:
    if not _whole(item.size):
        return f"{fqn} has shape {_brief([item.size])}: at most {MAX_DIMS} whole numbers from 0 to {MAX_NUMEL:,}"
    if math.prod(item.size) > MAX_NUMEL:
        return f"{fqn} has shape {list(item.size)}: more than {MAX_NUMEL:,} elements"
    return None


def _chunks_problem(fqn: str, item) -> str | None:
    """Every chunk lies inside its tensor, and together they tile it exactly: their volumes add up to
    the tensor's and no two overlap. A gap would leave elements as the loader allocated them (the export
    wrote uninitialised memory, a resume kept the random init); an overlap writes some twice."""
    size = tuple(item.size)
    for chunk in item.chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not isinstance(chunk, ChunkStorageMetadata) or not _whole(offsets, len(size)) or \
                not _whole(sizes, len(size)) or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            return (f"a chunk of {fqn} (offsets {_brief([offsets])}, sizes {_brief([sizes])}) is outside its "
                    f"shape {list(size)}")
    covered, numel = sum(math.prod(c.sizes) for c in item.chunks), math.prod(size)
    if covered != numel:
        return (f"the chunks of {fqn} hold {covered:,} elements, the tensor {numel:,}: "
                f"{'part of it is in no chunk' if covered < numel else 'some elements are stored twice'}")
    pair = _overlapping([c for c in item.chunks if math.prod(c.sizes)])
    if isinstance(pair, str):
        return f"the {len(item.chunks):,} chunks of {fqn} {pair}"
    if pair:
        a, b = pair
        return (f"two chunks of {fqn} overlap: offsets {list(a.offsets)} sizes {list(a.sizes)} and offsets "
                f"{list(b.offsets)} sizes {list(b.sizes)} (and part of it is in no chunk)")
    return None


def _overlapping(chunks: list):
    """Two chunks that share an element, None if none do, or a reason the test was not run. A sweep:
    sorted by their start along the dimension with the most distinct starts, a chunk can only meet the
    ones that start before it ends there (a grid of r x c shards: those of its own row)."""
    if len(chunks) < 2:
        return None
    lo = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    hi = lo + np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    if lo.shape[1] == 0:  # a 0-d tensor: two chunks of one element are the same element
        return chunks[0], chunks[1]
    axis = max(range(lo.shape[1]), key=lambda k: len(np.unique(lo[:, k])))
    order = np.argsort(lo[:, axis], kind="stable")
    lo, hi = lo[order], hi[order]
    n = len(order)
    counts = np.searchsorted(lo[:, axis], hi[:, axis], side="left") - np.arange(n) - 1
    if counts.sum() > MAX_PAIRS:
        return (f"overlap each other along every dimension too often to check ({int(counts.sum()):,} pairs, at "
                f"most {MAX_PAIRS:,})")
    first = np.repeat(np.arange(n), counts)
    second = first + 1 + np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)
    hit = np.flatnonzero(np.all((lo[first] < hi[second]) & (lo[second] < hi[first]), axis=1))
    if len(hit):
        return chunks[order[first[hit[0]]]], chunks[order[second[hit[0]]]]
    return None


def _storage_problem(md, root: Path) -> str | None:
    """One storage record per chunk, inside the checkpoint directory, as long as the chunk's bytes (a
    `.raw` item is exactly those bytes; a `.distcp` item wraps them in torch.save's zip, so is longer)."""
    for index, info in md.storage_data.items():
        fqn = getattr(index, "fqn", index)
        rel = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or \
                fqn not in md.state_dict_metadata:
            return f"the storage record {_brief([fqn])} names no tensor of the checkpoint"
        if not isinstance(rel, str) or not rel or len(rel) > MAX_NAME:
            return f"the storage of {fqn!r} is {_brief([rel])}, not a file name"
        # Both writers name files flat in the checkpoint directory: a name alone, checked without the disk
        # (every rank reads the metadata; thousands of stat calls each would load a parallel file system).
        # Where a name leads once symlinks are followed is checked by check_files, on one rank.
        if "/" in rel or "\0" in rel or rel in (".", ".."):
            return f"the storage of {fqn!r} is {rel!r}, outside the checkpoint directory"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(type(v) is int and 0 <= v < MAX_BYTE for v in (offset, length)):
            return f"the storage of {fqn!r} has offset {offset!r}, length {length!r}"
        if not rel.endswith((raw.SUFFIX, ".distcp")) or getattr(info, "transform_descriptors", None):
            return f"the storage of {fqn!r} is {rel!r}: not hpctrain's {raw.SUFFIX} or DCP's .distcp, untransformed"
    matched = 0
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        width = item.properties.dtype.itemsize
        for chunk in item.chunks:
            info = md.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                return f"the chunk of {fqn} at offsets {list(chunk.offsets)} has no storage record"
            matched += 1
            need = math.prod(chunk.sizes) * width
            if info.length != need and (info.relative_path.endswith(raw.SUFFIX) or info.length < need):
                return (f"the storage of {fqn} at offsets {list(chunk.offsets)} is {info.length:,} bytes in "
                        f"{info.relative_path}; its chunk holds {need:,}")
    tensor_records = sum(1 for index in md.storage_data
                         if isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata))
    if matched != tensor_records:
        return (f"{tensor_records:,} tensor storage records for {matched:,} chunks: two chunks share their offsets, "
                "or a record belongs to no chunk")
    return None


def _planner_problem(md) -> str | None:
    """DCP's loader rebuilds the state dict from planner_data (export does: every key's path): the path
    of each key, names joined with dots. Our state is nested dicts, so no path holds a list index (an
    index of 10**10 made the loader grow a list until memory ran out)."""
    for fqn in md.state_dict_metadata:
        path = md.planner_data.get(fqn)
        if type(path) is not tuple or not 1 <= len(path) <= MAX_DEPTH or \
                not all(type(p) is str and p for p in path) or ".".join(path) != fqn:
            return (f"planner_data of {fqn!r} is {_brief([path])}: a tuple of at most {MAX_DEPTH} names that "
                    f"joined with dots spell the key")
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
    inside = path.resolve()
    for rel, end in sorted(ends.items()):
        f = path / rel
        if not f.is_file():
            raise DamagedCheckpoint(f"shard file {f} is missing")
        if f.resolve().parent != inside:  # a symlink out of the checkpoint (its bytes would be exported)
            raise DamagedCheckpoint(f"shard file {rel!r} of {path} leads outside the checkpoint directory "
                                    f"(to {f.resolve()})")
        size = f.stat().st_size
        if size < end:
            raise DamagedCheckpoint(f"shard file {f} is truncated ({size} bytes, the metadata needs {end})")


def check_shapes(md, expected: dict[str, tuple], exact: tuple[str, ...] = ()) -> None:
    """The checkpoint holds every tensor we will load, at the same global shape, and under each prefix
    in `exact` (`model.`) no tensor this model lacks: loading would drop it silently (another model's
    layers, or a LoRA run's adapters resumed without LoRA)."""
    problems = [f"{fqn} is in the checkpoint but not in this model" for fqn in md.state_dict_metadata
                if fqn.startswith(exact) and fqn not in expected] if exact else []
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
