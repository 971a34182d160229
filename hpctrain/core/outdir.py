"""Output directories that a tool owns: it writes only into an absent or empty directory, or into its
own earlier output, and never deletes a file it did not write.

A tool's output is built in a new sibling directory (`.NAME.partial-*`) and swapped in whole once
complete, so a run that fails or is interrupted leaves the previous output as it was. The finished
directory holds MARKER, naming the tool and the files it wrote: that is how the next run knows the
directory is its own. A directory with anything else in it is refused, with the fix.

    with replacing(out, "hpctrain.data.prepare") as tmp:
        ...write every file into tmp...

A directory a tool keeps and adds to in place (a run directory: every start of the run writes into it)
uses the same marker (`mark`, written before anything else) and the same refusal (`check_in_place`):
absent, empty, or the tool's own, else refused; what else such a directory holds is left alone.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

MARKER = ".hpctrain-output.json"
SHOWN = 5  # foreign names quoted in a refusal


class OutputDirError(ValueError):
    """An output directory the tool may not write into; the message names it and the fix."""


def read_marker(out: Path) -> dict | None:
    """{"tool": ..., "files": [...]} of the output in `out`, or None where there is no valid marker."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError, RecursionError):  # absent, unreadable, not JSON, or nested absurdly deep
        return None
    ok = (isinstance(marker, dict) and isinstance(marker.get("tool"), str) and isinstance(marker.get("files"), list)
          and all(isinstance(f, str) for f in marker["files"]))
    return marker if ok else None


def foreign(out: Path, tool: str) -> list[str]:
    """The entries of the existing directory `out` that `tool` did not write (empty: it may replace them)."""
    names = sorted(os.listdir(out))
    marker = read_marker(out)
    if marker is None or marker["tool"] != tool:
        return names
    ours = set(marker["files"]) | {MARKER}
    # A directory is never ours: the tools write flat files only.
    return [n for n in names if n not in ours or ((out / n).is_dir() and not (out / n).is_symlink())]


def target(out: str | os.PathLike) -> Path:
    """The directory to replace: a symlink's target, so that the link keeps pointing at the output."""
    out = Path(out)
    return Path(os.path.realpath(out)) if out.is_symlink() else Path(os.path.abspath(out))


def check(out: str | os.PathLike, tool: str) -> None:
    """Refuse, before any work, an `out` that `tool` may not replace."""
    path = target(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise OutputDirError(f"{out} is a file, not a directory. Fix: name a new or empty directory for {tool}'s output")
    if os.path.samefile(path, os.getcwd()):  # renaming it away would leave this process in a deleted directory
        raise OutputDirError(f"{out} is the current directory, which {tool} cannot replace. "
                             f"Fix: run it from another directory, or name a subdirectory for the output")
    names = foreign(path, tool)
    if names:
        raise OutputDirError(refusal(out, tool, names, read_marker(path)))


def refusal(out: str | os.PathLike, tool: str, names: list[str], marker: dict | None) -> str:
    """Why `tool` may not write into `out`, which holds `names` it did not write (and `marker`)."""
    if marker is not None and marker["tool"] != tool:
        what = f"is the output of {marker['tool']}, not of {tool}"
    else:
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        what = f"holds files {tool} did not write ({shown})"
    return (f"{out} {what}: refusing to write there, as that would overwrite or delete what is there. "
            f"Fix: choose a new or empty directory, or remove {out} if nothing in it is needed")


def check_in_place(out: str | os.PathLike, tool: str, recognise: Callable[[Path], bool] | None = None) -> None:
    """Refuse, before anything is written, an existing `out` that `tool` writes into in place unless it
    is empty or `tool`'s own: its marker names `tool`, or (a directory from before markers)
    `recognise(out)` says so. The tool writes only its own names there, so anything else it holds
    (a user's notes, an export) stays and does not make it foreign."""
    path = target(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise OutputDirError(f"{out} is a file, not a directory. Fix: name a new or empty directory for {tool}")
    names = sorted(os.listdir(path))
    marker = read_marker(path)
    if not names or (marker is not None and marker["tool"] == tool):
        return
    if marker is None and recognise is not None and recognise(path):
        return
    raise OutputDirError(refusal(out, tool, names, marker))


def mark(out: str | os.PathLike, tool: str, files: list[str]) -> None:
    """Make the existing directory `out` recognisably `tool`'s (MARKER naming `files`, what the tool
    writes there); written only when it says something else, atomically."""
    path = target(out)
    want = {"tool": tool, "files": sorted(files)}
    if read_marker(path) == want:
        return
    tmp = path / f".{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(want, indent=1) + "\n")
    os.replace(tmp, path / MARKER)


def begin(out: str | os.PathLike, tool: str) -> Path:
    """Check `out`, then make the empty sibling directory the new output is built in."""
    check(out, tool)
    path = target(out)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # a file where a parent directory should be, no permission, a full disk
        raise OutputDirError(f"cannot create {tmp.name} beside {out}, where {tool} builds its output "
                             f"({e.strerror}: {e.filename}). Fix: name a directory whose parent you can write to") from None
    if path.is_dir():
        shutil.copymode(path, tmp)  # the permissions the user gave the directory stay
    return tmp


def commit(tmp: Path, out: str | os.PathLike, tool: str) -> None:
    """Mark `tmp` as `tool`'s output and put it in place of `out`; the previous output is then deleted,
    file by file, only what its marker names."""
    files = sorted(os.listdir(tmp))
    (tmp / MARKER).write_text(json.dumps({"tool": tool, "files": files}, indent=1) + "\n")
    try:
        check(out, tool)  # again: something may have been put into out while the output was built
    except OutputDirError as e:
        raise OutputDirError(f"{e}. The new output is complete in {tmp}: move it where you want it") from None
    path = target(out)
    old = tmp.with_name(tmp.name.replace(".partial-", ".old-")) if path.exists() else None
    try:
        if old is not None:
            os.rename(path, old)
        os.rename(tmp, path)
    except OSError as e:
        if old is not None and old.exists() and not path.exists():
            os.rename(old, path)
        discard(tmp)
        raise OutputDirError(f"could not put the new output in place of {out} ({e}). "
                             f"Fix: choose a new directory (not a mount point) for {tool}'s output") from None
    if old is not None:
        _remove_own(old)


def _remove_own(old: Path) -> None:
    """Delete the previous output: only the files its marker names (all of it, as checked)."""
    marker = read_marker(old)
    ours = set(marker["files"]) | {MARKER} if marker else set()
    for name in os.listdir(old):
        p = old / name
        if name in ours and (p.is_symlink() or not p.is_dir()):
            p.unlink()
    try:
        old.rmdir()
    except OSError:
        pass  # something not ours appeared in it: it stays, in `old`, rather than be deleted


def discard(tmp: Path) -> None:
    """Remove an unfinished output: everything in `tmp` was written by this run."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def replacing(out: str | os.PathLike, tool: str) -> Iterator[Path]:
    """The directory to write `tool`'s new output into; it replaces `out` when the block ends without
    an error, and is removed when the block fails."""
    tmp = begin(out, tool)
    try:
        yield tmp
    except BaseException:
        discard(tmp)
        raise
    commit(tmp, out, tool)


# ---------------------------------------------------------------------------------------------
# Single files a tool writes where the user names them (a plot, a JSON): written over only when the tool
# wrote them itself, which they say inside (a PNG's "Software" text, a JSON's "written_by").


def png_software(path: Path) -> str | None:
    """The "Software" text chunk of a PNG file (matplotlib's savefig(metadata=...)), or None."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return None
            while True:
                head = f.read(8)
                if len(head) < 8:
                    return None
                size, kind = int.from_bytes(head[:4], "big"), head[4:]
                if kind in (b"IDAT", b"IEND") or size > 1 << 20:
                    return None
                data = f.read(size)
                f.read(4)  # CRC
                if kind == b"tEXt" and data.startswith(b"Software\x00"):
                    return data[len(b"Software\x00"):].decode("latin-1")
    except OSError:
        return None


def written_by(path: Path) -> str | None:
    """The tool a PNG or JSON file says wrote it, or None."""
    if path.suffix.lower() == ".png":
        return png_software(path)
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        return doc.get("written_by") if isinstance(doc, dict) and isinstance(doc.get("written_by"), str) else None
    return None


def file_problem(out: str | os.PathLike, tool: str) -> str | None:
    """Why `tool` may not write the file `out`: a directory, or an existing file it did not write."""
    out = Path(out)
    if out.is_dir():
        return f"{out} is a directory. Fix: name a file for {tool}'s output"
    if (out.exists() or out.is_symlink()) and (out.is_symlink() or written_by(out) != tool):
        return (f"{out} exists and was not written by {tool}: refusing to overwrite it. Fix: choose a new "
                f"file name, or remove {out} if it is not needed")
    return None
