"""Directories a run writes to, judged the same way on the login node (before launch) and on the
ranks (at start, where a path is node-local)."""
from __future__ import annotations

import os
from typing import Optional


def writable_dir_problem(key: str, path: Optional[str]) -> Optional[str]:
    """What keeps `path` (the value of config key `key`) from being a directory this user can create
    files in, with the fix; None when it is one."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        return (f"{key}={path} does not exist. Fix: mkdir -p {path}, or point {key} at an existing "
                "directory on a fast local disk")
    if not os.path.isdir(path):
        return f"{key}={path} is not a directory. Fix: point {key} at a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{key}={path} is not writable by this user. Fix: chmod it, or choose another directory"
    return None
