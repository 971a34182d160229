"""Per-rank random number generator states as JSON (torch CPU/CUDA, numpy, python), not pickles."""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


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
        # The devices this process sees now: a rank bound to one GPU where it saw all of them (or the other
        # way round) restores the ones both have (hpctrain's data and initialization draw from none).
        for i, s in enumerate(state["torch_cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)


def state_problem(state) -> str | None:
    """Why `state` (one rank's file) cannot be restored into this process's generators: the keys capture()
    writes, each generator's state of the size and range those generators take. None when it can."""
    if not isinstance(state, dict):
        return "not a JSON object"
    unknown = sorted(set(state) - {"torch_cpu", "numpy", "python", "torch_cuda"})
    missing = [k for k in ("torch_cpu", "numpy", "python") if k not in state]
    if unknown or missing:
        return f"holds no {missing[0]!r}" if missing else f"holds {unknown[0]!r}, which no generator here has"
    return (_bytes_problem("torch_cpu", state["torch_cpu"], torch.get_rng_state().numel())
            or _numpy_problem(state["numpy"]) or _python_problem(state["python"]) or _cuda_problem(state.get("torch_cuda")))


def _bytes_problem(key: str, value, size: int) -> str | None:
    if not isinstance(value, str) or len(value) > 4 * size:
        return f"{key} is not a base64 string of {size} bytes"
    try:
        n = len(base64.b64decode(value, validate=True))
    except ValueError as e:  # binascii.Error
        return f"{key} is not base64 ({e})"
    return None if n == size else f"{key} holds {n} bytes, the generator's state is {size}"


def _words(value, n: int, top: int) -> bool:
    """A list of n whole numbers in [0, top)."""
    return isinstance(value, list) and len(value) == n and all(type(v) is int and 0 <= v < top for v in value)


def _numpy_problem(value) -> str | None:
    kind, keys, *_ = np.random.get_state()
    if not isinstance(value, list) or len(value) != 5:
        return "numpy is not [kind, keys, pos, has_gauss, gauss]"
    if value[0] != kind or not _words(value[1], len(keys), 1 << 32) or type(value[2]) is not int \
            or not 0 <= value[2] <= len(keys) or value[3] not in (0, 1) or type(value[3]) is not int \
            or not _finite(value[4]):
        return (f"numpy is not a {kind} state ({kind!r}, {len(keys)} words below 2**32, a position up to "
                f"{len(keys)}, 0 or 1, a finite number)")
    return None


def _python_problem(value) -> str | None:
    version, mt, _ = random.getstate()
    if not isinstance(value, list) or len(value) != 3 or value[0] != version or type(value[0]) is not int \
            or not isinstance(value[1], list) or not _words(value[1][:-1], len(mt) - 1, 1 << 32) \
            or len(value[1]) != len(mt) or type(value[1][-1]) is not int or not 0 <= value[1][-1] <= len(mt) - 1 \
            or not (value[2] is None or _finite(value[2])):
        return (f"python is not random's state (version {version}, {len(mt) - 1} words below 2**32 and a "
                f"position up to {len(mt) - 1}, null or a finite number)")
    return None


def _cuda_problem(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return "torch_cuda is not a list of base64 strings"
    if not torch.cuda.is_available():  # not restored here (see restore)
        return None
    states = torch.cuda.get_rng_state_all()  # the devices both have are restored (see restore)
    return next((p for p in (_bytes_problem(f"torch_cuda[{i}]", s, states[i].numel()) for i, s in enumerate(value[:len(states)])) if p),
                None)


def _finite(v) -> bool:
    return type(v) in (int, float) and abs(v) < float("inf")


class RNG:
    """This rank's generators as checkpoint state: JSON per rank. After a change of world size ranks
    no longer correspond and the manager leaves them as seeded (hpctrain's data and initialization
    do not draw from them)."""

    per_rank = True

    def state_problem(self, state) -> str | None:
        return state_problem(state)

    def state_dict(self) -> dict:
        return capture()

    def load_state_dict(self, state: dict) -> None:
        restore(state)
