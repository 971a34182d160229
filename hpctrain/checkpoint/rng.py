"""Per-rank random number generator states as JSON (torch CPU/CUDA, numpy, python), not pickles."""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


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


class RNG:
    """This rank's generators as checkpoint state: JSON per rank. After a change of world size ranks
    no longer correspond and the manager leaves them as seeded (hpctrain's data and initialization
    do not draw from them)."""

    per_rank = True

    def state_dict(self) -> dict:
        return capture()

    def load_state_dict(self, state: dict) -> None:
        restore(state)
