"""The run directory: fixed at submission, reused by every restart of the run.

<run.dir>/config.yaml   the resolved config, the single source of truth for every rank
<run.dir>/metrics.jsonl one JSON object per logged step
<run.dir>/logs/         per-rank logs
"""
from __future__ import annotations

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
