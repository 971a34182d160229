"""The run directory: fixed at submission, reused by every restart of the run.

<run.dir>/config.yaml   the resolved config, the single source of truth for every rank
<run.dir>/metrics.jsonl one JSON object per logged step
<run.dir>/logs/         per-rank logs
<run.dir>/checkpoints/  step-NNNNNNNN/ sharded checkpoints
<run.dir>/outcome.json  how the last start of the run ended: completed | preempted (resume by rerunning)
<run.dir>/attempts/N/   what the ranks of the run's N-th start said about themselves: where each rank
                        ran, health check results, hang reports and stacks, errors
<run.dir>/attempts.jsonl      one record per start of the ranks (supervisor)
<run.dir>/interruptions.jsonl one record per interruption: cause, ranks, nodes, work lost, recovery

A checkpoint is complete or absent: `checkpoints/step-NNNNNNNN/` with DCP's `.metadata` and our
`hpctrain.json` (hpctrain.checkpoint.directories writes it that way). Discovery is here, without torch,
because the login node asks too: it refuses to start over a run's checkpoints unless told to resume.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from hpctrain.core.compose import to_yaml
from hpctrain.core.schema import Config


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.run.dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    return run_dir


OUTCOME = "outcome.json"


def write_outcome(run_dir: str | os.PathLike, outcome: dict) -> None:
    write_atomic(Path(run_dir) / OUTCOME, json.dumps({k: v for k, v in outcome.items() if v is not None}))


def read_outcome(run_dir: str | os.PathLike) -> dict | None:
    """outcome.json; None when absent or not a JSON object (damaged)."""
    try:
        out = json.loads((Path(run_dir) / OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def clear_outcome(run_dir: str | os.PathLike) -> None:
    try:
        os.unlink(Path(run_dir) / OUTCOME)
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------------------- checkpoints

STEP_RE = re.compile(r"^step-(\d{8})$")
INFO = "hpctrain.json"
DCP_METADATA = ".metadata"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return (STEP_RE.match(path.name) is not None and (path / DCP_METADATA).is_file()
            and (path / INFO).is_file())


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def list_incomplete(root: str | os.PathLike) -> list[Path]:
    """`step-*` directories that lack their metadata: damaged after the commit, never loaded."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_RE.match(p.name) and p.is_dir() and not is_complete(p))


def read_info(path: Path) -> dict:
    return json.loads((path / INFO).read_text())


def overwrite_problem(run_dir: str | os.PathLike, resume: bool) -> str | None:
    """Why a run may not start in `run_dir`: it holds checkpoints and checkpoint.resume=false."""
    existing = list_complete(Path(run_dir) / "checkpoints")
    if existing and not resume:
        return (f"{run_dir} already holds checkpoints (newest step {existing[-1][0]}) and "
                "checkpoint.resume=false: refusing to overwrite them. Fix: choose another run.dir, "
                "or drop checkpoint.resume=false to continue that run")
    return None


# ----------------------------------------------------------------------------- restarts

ATTEMPTS = "attempts"
# Errors a rank raises because a peer died, not on its own account (in attempts/N/error-rank-R.json).
ECHOES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
          "NCCL communicator was aborted", "ProcessGroupGloo", "TCPStore", "recvValue", "Timed out waiting")
INTERRUPTIONS = "interruptions.jsonl"
# The cause of an interruption a person asked for (Ctrl-C, kill): not charged to goodput while they wait.
STOPPED = "stopped"
CHECKPOINT_LOG = "checkpoints.jsonl"  # one line per completed save: step, seconds, blocked_s, async, bytes


def attempt_dir(run_dir: str | os.PathLike, attempt: int) -> Path:
    return Path(run_dir) / ATTEMPTS / str(attempt)


# What the records of each run file hold, where the readers (supervisor, reports, goodput) use it:
# field -> kind. A record whose field has another kind is left out as malformed, like a line that is
# not a JSON object: a hand edit or a damaged file costs that line, never the command reading it.
# Kinds: "int", "number" (int or float, NaN allowed: a diverged loss), "finite" (a finite number),
# "str", "ints"/"strings" (lists of them); "!" marks a field every record has, "?" one that may be null.
RECORDS = {
    "metrics.jsonl": {"step": "int!", "time": "finite", "loss": "number", "val_loss": "number", "val_ppl": "number",
                      "step_time_s": "finite", "tokens_per_s": "number", "mfu": "number", "mem_bytes": "number",
                      "tokens": "number", "step_time_min": "number", "step_time_max": "number"},
    "attempts.jsonl": {"start": "finite!", "end": "finite", "attempt": "int", "rc": "int?", "nodes": "strings"},
    INTERRUPTIONS: {"cause": "str!", "detail": "str?", "ranks": "ints", "nodes": "strings", "time": "finite",
                    "attempt": "int", "checkpoint_step": "int", "last_step": "int", "steps_redone": "finite",
                    "failed_at": "finite?", "detect_s": "finite?", "restarted_at": "finite?",
                    "first_step_at": "finite?", "recover_s": "finite?"},
    CHECKPOINT_LOG: {"step": "int!", "seconds": "finite", "blocked_s": "finite", "bytes": "int", "time": "finite"},
}


def _is_kind(v, kind: str) -> bool:
    if kind == "str":
        return isinstance(v, str)
    if kind in ("ints", "strings"):
        return isinstance(v, list) and all(_is_kind(x, {"ints": "int", "strings": "str"}[kind]) for x in v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if kind == "int":
        return isinstance(v, int)
    return kind == "number" or math.isfinite(v)


def json_kind(v) -> str:
    """The JSON name of a parsed value's type, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def record_problem(record, kinds: dict[str, str]) -> str | None:
    """Why `record` (one parsed line) is not a record of the file whose field kinds are `kinds`."""
    if not isinstance(record, dict):
        return f"a JSON {json_kind(record)}, not an object"
    for key, kind in kinds.items():
        base = kind.rstrip("!?")
        if key not in record:
            if kind.endswith("!"):
                return f"no {key!r}"
            continue
        v = record[key]
        if v is None and kind.endswith("?"):
            continue
        if not _is_kind(v, base):
            want = {"int": "a whole number", "number": "a number", "finite": "a finite number", "str": "a string",
                    "ints": "a list of whole numbers", "strings": "a list of strings"}[base]
            return f"{key}={json.dumps(v)[:40]} is not {want}"
    return None


def read_jsonl_checked(path: str | os.PathLike, kinds: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    """(records, skipped) of a JSON-lines file; ([], []) when it is absent or unreadable. `kinds`
    (default: RECORDS for the file's name) says what each field holds. A line that is not JSON, not an
    object, or holds a field of another kind is left out and named in `skipped` as 'file:line: why';
    the last line without its newline (a write in progress, or cut short by a crash) is left out silently."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return [], []
    kinds = RECORDS.get(Path(path).name, {}) if kinds is None else kinds
    out, skipped = [], []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if i < len(lines):  # the last piece has no newline: being written, or cut by a crash
                skipped.append(f"{path}:{i}: not JSON ({line.strip()[:40]!r})")
            continue
        problem = record_problem(record, kinds)
        if problem is None:
            out.append(record)
        else:
            skipped.append(f"{path}:{i}: {problem}")
    return out, skipped


def read_jsonl(path: str | os.PathLike, warn: bool = False) -> list[dict]:
    """The records of a JSON-lines file (see read_jsonl_checked): malformed lines are left out, each
    named on stderr when `warn`."""
    records, skipped = read_jsonl_checked(path)
    if warn:
        warn_skipped(skipped)
    return records


def warn_skipped(skipped: list[str], stream=None) -> None:
    """One stderr line per skipped line (the first 10, then a count)."""
    stream = stream or sys.stderr
    for s in skipped[:10]:
        print(f"warning: {s}; line skipped", file=stream)
    if len(skipped) > 10:
        print(f"warning: {len(skipped) - 10} more malformed lines skipped", file=stream)


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """One line more; a last line left without its newline (a crash mid-write) is ended first, so the
    new record does not join it."""
    end_torn_line(path)
    with open(path, "ab") as f:
        f.write((json.dumps(record) + "\n").encode())


def end_torn_line(path: str | os.PathLike) -> None:
    """End the file's last line if a crash mid-write left it without its newline (no-op otherwise)."""
    try:
        with open(path, "r+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
    except FileNotFoundError:
        pass


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    write_atomic(Path(path), "".join(json.dumps(r) + "\n" for r in records))
