"""Checkpoint directories on disk: naming, the commit that makes one visible, discovery, retention.

A checkpoint is complete or absent. Ranks write into `.tmp-step-NNNNNNNN-<nonce>/`; only after every
rank finished and DCP wrote `.metadata`, rank 0 writes `hpctrain.json` and renames the directory to
`step-NNNNNNNN/`. Discovery lists only such directories; a torn save stays a `.tmp-*` that the next
save of the run sweeps away. Naming and discovery (what is complete) live in hpctrain.core.rundir, which
the login node uses too.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from hpctrain.checkpoint.validate import DamagedCheckpoint
from hpctrain.checkpoint.validate import read_info as read_checked_info
from hpctrain.core.rundir import (DCP_METADATA, INFO, is_complete, list_complete, list_incomplete,  # noqa: F401
                             read_info, step_name)

TMP_PREFIX = ".tmp-step-"


def tmp_dir(root: Path, step: int, nonce: str) -> Path:
    return root / f"{TMP_PREFIX}{step:08d}-{nonce}"


def disk_usage(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (its entries: a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, root: Path, step: int, info: dict) -> Path:
    """Make a fully written checkpoint visible. Called by one rank after all ranks finished."""
    write_json_durable(tmp / INFO, info)
    fsync_path(tmp)
    final = root / step_name(step)
    if final.exists():
        # The same step saved again (a preemption right after a periodic save): keep the new one.
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    return final


def newest_finite(complete: list[tuple[int, Path]]) -> Path | None:
    """The newest of these checkpoints whose hpctrain.json says its tensors were checked finite when it
    was saved (newest first: normally the first one read answers)."""
    for _, path in reversed(complete):
        try:
            if read_checked_info(path).get("finite") is True:
                return path
        except DamagedCheckpoint:
            continue
    return None


def doom(root: Path, keep: int, protect: tuple[Path | None, ...] = (), keep_every: int = 0) -> list[Path]:
    """Retention, the quick half: all but the newest `keep` complete checkpoints (never one in
    `protect`: the one just committed, the one the run resumed from; nor the newest one known finite,
    so that checkpoints of a diverged run written without the check never push out the last good one;
    nor a milestone: a step that is a multiple of `keep_every`) are renamed out of
    discovery's sight, and returned with every leftover temporary dir for `purge` to delete. A crash
    before the purge leaves `.del-*` dirs the next call picks up."""
    removed = []
    complete = list_complete(root)
    kept = {p.resolve() for p in (*protect, newest_finite(complete) if keep > 0 else None) if p is not None}
    for step, path in complete[:-keep] if keep > 0 else []:
        if path.resolve() in kept:
            continue
        if keep_every > 0 and step % keep_every == 0:
            continue
        # Rename first: a crash mid-delete must not leave a half-deleted dir that looks complete.
        doomed = path.with_name(f".del-{path.name}-{time.time_ns()}")
        os.rename(path, doomed)
        removed.append(doomed)
    for p in root.iterdir():
        if p.name.startswith((TMP_PREFIX, ".del-")) and p.is_dir() and p not in removed:
            removed.append(p)
    return removed


def purge(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
