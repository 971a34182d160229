"""The run directory: fixed at submission, reused by every restart of the run.

<run.dir>/config.yaml   the resolved config, the single source of truth for every rank
<run.dir>/metrics.jsonl one JSON object per logged step
<run.dir>/logs/         per-rank logs
<run.dir>/checkpoints/  step-NNNNNNNN/ sharded checkpoints
<run.dir>/outcome.json  how the last start of the run ended: completed | preempted (resume by rerunning)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import OmegaConf


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(cfg) -> Path:
    run_dir = Path(cfg.run.dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
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
