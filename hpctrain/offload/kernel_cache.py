"""Where compiled kernels are cached: a directory of this user's own.

A process loads whatever shared object it finds in its kernel cache, so the cache must be writable by
nobody else. It used to be ./outputs/cache under the current directory, where on a shared directory
another user's `.so` could be loaded. Now: $XDG_CACHE_HOME/hpctrain/<kind> (default ~/.cache), made
0700, and used only while it is owned by this user and not writable by group or others; otherwise a
fresh private temporary directory for this process. TORCH_EXTENSIONS_DIR and TORCHINDUCTOR_CACHE_DIR,
when set, are the user's choice and are kept.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile

log = logging.getLogger("hpctrain")


def private_dir(kind: str, base: str | None = None) -> str:
    """This user's cache directory for `kind` (e.g. "torch_extensions"), created 0700 if absent."""
    base = base or os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "hpctrain", kind)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.makedirs(path, mode=0o700, exist_ok=True)
        problem = unsafe(path)
    except OSError as e:
        problem = str(e)
    if problem is None:
        return path
    fallback = tempfile.mkdtemp(prefix=f"hpctrain-{kind}-")
    log.warning("not using %s as a kernel cache (%s); building into %s for this process", path, problem, fallback)
    return fallback


def unsafe(path: str) -> str | None:
    """Why another user could put code into `path`, or swap it through its parent (the hpctrain
    directory of the cache), or None."""
    for d in (path, os.path.dirname(path)):
        st = os.stat(d)
        if st.st_uid != os.getuid():
            return f"{d} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"group or others may write to {d} (mode {stat.filemode(st.st_mode)})"
    return None


def use_private_cache(variable: str, kind: str) -> str:
    """Point `variable` at this user's cache for `kind` unless the user set it; returns its value."""
    if not os.environ.get(variable):
        os.environ[variable] = private_dir(kind)
    return os.environ[variable]
