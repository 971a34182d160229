"""Per-rank random number generator states as JSON (torch CPU/CUDA, numpy, python), not pickles."""
from __future__ import annotations

import base64
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("hpctrain")


def _path(ckpt: Path, rank: int) -> Path:
    return ckpt / "rng" / f"rank-{rank:05d}.json"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {"torch_cpu": _b64(torch.get_rng_state()),
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "python": [version, list(mt), gauss_next]}
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, mt, gauss_next = state["python"]
    random.setstate((version, tuple(mt), gauss_next))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])


def save(ckpt: Path, rank: int) -> None:
    path = _path(ckpt, rank)
    path.parent.mkdir(exist_ok=True)
    with open(path, "w") as f:
        json.dump(capture(), f)
        f.flush()
        os.fsync(f.fileno())


def load(ckpt: Path, rank: int, same_world: bool) -> None:
    """Restore this rank's generators. After a change of world size ranks no longer correspond:
    the generators keep their fresh seeding (hpctrain's data and init do not draw from them)."""
    path = _path(ckpt, rank)
    if same_world and path.is_file():
        restore(json.loads(path.read_text()))
    elif same_world:
        log.warning("%s is missing: random generators not restored", path)
