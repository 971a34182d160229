"""The frozen base an adapter-only checkpoint leaves out (checkpoint.weights=adapters): model.init_from,
re-read on resume and on export, and its fingerprint, which the checkpoint records so that a changed
base is refused rather than trained on (or merged into) in silence.

The fingerprint is of the tensors, not of the files: for each tensor of the directory's safetensors
files (by its Hugging Face name), its dtype, its shape and SAMPLES slices of SAMPLE_BYTES of its data (the
start, the end and evenly between: a tensor of up to SAMPLES x SAMPLE_BYTES bytes is hashed whole),
sha256'd; the checkpoint keeps each tensor's digest (16 hex digits) and one digest over them all. So the
same weights at another path, re-sharded into other files or behind a download cache's symlinks, are the
same base; another model, another fine-tune of the same model (which moves every weight), a tensor of
another dtype or shape, a missing or extra tensor are not, and the message names the first tensor that
differs. Cost: the headers and SAMPLES small reads a tensor, about 15 MB and 3,000 reads for a 70B
model in 30 files (a full sha256 of its 140 GB would take minutes at every resume); computed once a
process. What it can miss: an edit confined to bytes between the samples of a tensor (a few rows
changed by hand); a full hash would be needed for that.

No torch here: the login node and the export's checks import it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Optional

from hpctrain.core import hf_format as hf

METHOD = "safetensors-sampled-v1"  # what a recorded fingerprint was made with: only like is compared
SAMPLES = 4
SAMPLE_BYTES = 4096

_cache: dict = {}  # (directory, its files' names, sizes and mtimes) -> fingerprint


def _offsets(nbytes: int) -> list[int]:
    """Where the samples of a tensor of `nbytes` start (all of it when it is small)."""
    if nbytes <= SAMPLES * SAMPLE_BYTES:
        return [0]
    last = nbytes - SAMPLE_BYTES
    return sorted({round(last * i / (SAMPLES - 1)) for i in range(SAMPLES)})


def fingerprint(path: str | os.PathLike) -> dict:
    """{method, tensors, digest, per_tensor: {Hugging Face name: 16 hex digits}} of the safetensors
    weights in `path`; HFError (hf_format's, naming the file and the fix) when they cannot be read."""
    d = Path(path)
    where = hf.tensors(d)  # every file's header checked, as the ranks' loader needs them
    files = sorted({f for _, _, f in where.values()})
    stamp = (str(d.resolve()), tuple((f, (s := (d / f).stat()).st_size, s.st_mtime_ns) for f in files))
    if stamp in _cache:
        return _cache[stamp]
    per = {}
    for fname in files:
        p = d / fname
        header = hf.read_header(p)
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            for name, v in header.items():
                if name == "__metadata__" or where.get(name, (None, None, None))[2] != fname:
                    continue
                begin, end = v["data_offsets"]
                h = hashlib.sha256(json.dumps([v["dtype"], v["shape"]]).encode())
                for off in _offsets(end - begin):
                    f.seek(8 + n + begin + off)
                    h.update(f.read(min(SAMPLE_BYTES if end - begin > SAMPLES * SAMPLE_BYTES else end - begin,
                                        end - begin - off)))
                per[name] = h.hexdigest()[:16]
    digest = hashlib.sha256(json.dumps(sorted(per.items())).encode()).hexdigest()[:32]
    out = {"method": METHOD, "tensors": len(per), "digest": digest, "per_tensor": per}
    _cache[stamp] = out
    return out


def record(path: str | os.PathLike) -> dict:
    """What a checkpoint records of its base: where it was read from, and its fingerprint."""
    return {"init_from": str(path), **fingerprint(path)}


def difference(recorded: dict, path: str | os.PathLike) -> Optional[str]:
    """Why the weights in `path` are not the base `recorded` (a checkpoint's record), or None when they are
    the same; the message names the first tensor that differs."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("per_tensor"), dict):
        return "the checkpoint's record of its base is missing or damaged"
    try:
        now = fingerprint(path)
    except hf.HFError as e:
        return f"its weights cannot be read ({e})"
    if recorded.get("method") != METHOD:
        return (f"the checkpoint's fingerprint of its base was made by another method ({recorded.get('method')!r}, "
                f"this hpctrain makes {METHOD!r}) and cannot be compared")
    if recorded.get("digest") == now["digest"]:
        return None
    old, new = recorded["per_tensor"], now["per_tensor"]
    gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if gone:
        return f"it has no tensor {gone[0]}" + (f" (and {len(gone) - 1} more are missing)" if len(gone) > 1 else "")
    if added:
        return f"it has a tensor {added[0]} the base had not" + (f" (and {len(added) - 1} more)" if len(added) > 1 else "")
    changed = [k for k in sorted(old) if old[k] != new[k]]
    if changed:
        return (f"its tensor {changed[0]} differs (dtype, shape or values)"
                + (f", and {len(changed) - 1} more" if len(changed) > 1 else ""))
    return "its fingerprint differs"
