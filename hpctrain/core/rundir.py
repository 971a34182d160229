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
import os
import re
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
    try:
        return json.loads((Path(run_dir) / OUTCOME).read_text())
    except (OSError, ValueError):
        return None


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
INTERRUPTIONS = "interruptions.jsonl"
CHECKPOINT_LOG = "checkpoints.jsonl"  # one line per completed save: step, seconds, blocked_s, async, bytes


def attempt_dir(run_dir: str | os.PathLike, attempt: int) -> Path:
    return Path(run_dir) / ATTEMPTS / str(attempt)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a crash mid-write
    return out


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    write_atomic(Path(path), "".join(json.dumps(r) + "\n" for r in records))
