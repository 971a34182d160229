"""The checks a checkpoint's own records pass before training uses them: hpctrain.json and the per-rank
JSON (read as regular files of bounded size, parsed, checked against what the live objects hold), and
the tensors' values (finite). Each rule lives here once; the manager, the retention and the command line
call them. A failed check raises DamagedCheckpoint, whose message names the file, the entry and what
is wrong with it: the manager then falls back to an older checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hpctrain.core import hf_format as hf
from hpctrain.core.rundir import INFO

# hpctrain.json holds the config and a few counters (5 KB for the tiny model; a large config with a
# mixture of many data sets stays under 1 MB); a per-rank RNG file holds ~20 KB of generator state.
# Larger ones are not ours, and parsing them would cost memory for nothing.
INFO_BYTES = 16 << 20
PER_RANK_BYTES = 1 << 20
# Counters and positions are used as Python ints, then as numpy/torch int64 (data indices, steps).
MAX_INT = (1 << 63) - 1
# isfinite over a tensor allocates one bool per element: a shard that needs it is checked in slices of
# this many elements, so the check's temporary memory stays at 16 MB whatever the model.
FINITE_SLICE = 1 << 24


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says what is wrong with it."""


def read_json(path: Path, limit: int) -> object:
    """A checkpoint's JSON file, parsed: a regular file of at most `limit` bytes holding valid JSON."""
    try:
        data = hf.read_small(path, limit)
    except hf.HFError as e:
        raise DamagedCheckpoint(str(e).split(" Fix: ")[0]) from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise DamagedCheckpoint(f"{path} is not valid JSON ({_first_line(e)})") from None


def read_info(step_dir: Path) -> dict:
    """hpctrain.json of a checkpoint: a JSON object with a positive world size and, where recorded, a
    boolean `finite`."""
    path = Path(step_dir) / INFO
    info = read_json(path, INFO_BYTES)
    if not isinstance(info, dict):
        raise DamagedCheckpoint(f"{path} holds a JSON {_kind(info)}, not an object")
    world = info.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_INT:
        raise DamagedCheckpoint(f"{path} says world_size {world!r}: not a positive whole number")
    if type(info.get("finite", False)) is not bool:
        raise DamagedCheckpoint(f"{path} says finite {info['finite']!r}: not true or false")
    return info


def state_problem(where: str, saved, template) -> str | None:
    """Why `saved` (a plain state read back from JSON) cannot be loaded into an object whose own state
    is `template` (its state_dict() now): no key the template lacks (a scheduler would take it as an
    attribute), each value of the template's JSON kind (a whole number where it holds one, lists of its
    length), and every number finite and not negative, as counters, positions, seeds and learning rates
    are. None when it can. A key the template has and `saved` lacks is left to the object's
    load_state_dict: a checkpoint of an older hpctrain lacks the keys added since, and the object
    defaults them or refuses (the manager loads plain states before it commits to a checkpoint)."""
    if isinstance(template, dict):
        if not isinstance(saved, dict):
            return f"{where} is a JSON {_kind(saved)}, not an object"
        for key in saved:
            if key not in template:
                return f"{where} holds {_short(key)}, which this run's state has not"
        return next((p for p in (state_problem(f"{where}.{k}", saved[k], template[k]) for k in saved) if p), None)
    if isinstance(template, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(template):
            return f"{where} is {_short(saved)}, not a list of {len(template)}"
        return next((p for p in (state_problem(f"{where}[{i}]", s, t) for i, (s, t) in enumerate(zip(saved, template)))
                     if p), None)
    if template is None or isinstance(template, (bool, str)):
        return None if type(saved) is type(template) else f"{where} is {_short(saved)}, not {_kind_of_template(template)}"
    if isinstance(template, (int, float)):
        whole = isinstance(template, int)
        if isinstance(saved, bool) or not isinstance(saved, int if whole else (int, float)):
            return f"{where} is {_short(saved)}, not {'a whole number' if whole else 'a number'}"
        if not 0 <= saved <= MAX_INT:  # false for NaN and the infinities too
            return f"{where} is {saved!r}: it must be finite, at least 0 and at most {MAX_INT}"
        return None
    return f"{where}: this run's state holds a {type(template).__name__}, which a checkpoint cannot"


def plain_problems(path: Path, info: dict, objects: dict) -> str | None:
    """The first entry of hpctrain.json that the state object of its name cannot take (see
    state_problem, and the object's own state_problem where it has one)."""
    for name, obj in objects.items():
        if getattr(obj, "sharded", False) or getattr(obj, "per_rank", False):
            continue
        where = f"{Path(path) / INFO}'s {name}"
        if name not in info:
            if getattr(obj, "optional", False):  # a run that did not have it wrote this: the object starts afresh
                continue
            return f"{Path(path) / INFO} holds no {name} state (written by an older hpctrain)"
        saved, reads = info[name], getattr(obj, "reads", None)
        if reads is not None and isinstance(saved, dict):  # the object loads these keys and ignores the rest
            saved = {k: v for k, v in saved.items() if k in reads}
        problem = state_problem(where, saved, obj.state_dict()) or own_problem(obj, where, saved)
        if problem:
            return problem
    return None


def holds_problem(info: dict, objects: dict) -> str | None:
    """Why a tensor object cannot take what the checkpoint holds (ModelState.checkpoint_problem: an
    adapter-only checkpoint without its base, a changed base), or None."""
    for obj in objects.values():
        check = getattr(obj, "checkpoint_problem", None)
        problem = check(info) if check is not None and getattr(obj, "sharded", False) else None
        if problem:
            return problem
    return None


def own_problem(obj, where: str, state) -> str | None:
    """An object's own rule for its state, where it has one (`state_problem(state)`)."""
    check = getattr(obj, "state_problem", None)
    problem = check(state) if check is not None else None
    return f"{where}: {problem}" if problem else None


def read_per_rank(path: Path, obj) -> tuple[object, str | None]:
    """(a per-rank state file's state, why it cannot be used or None)."""
    try:
        state = read_json(path, PER_RANK_BYTES)
    except DamagedCheckpoint as e:
        return None, str(e)
    return state, own_problem(obj, str(path), state)


# ------------------------------------------------------------------------------- tensor values

def _local(t: torch.Tensor) -> torch.Tensor:
    """The elements this rank holds (a DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _all_finite(t: torch.Tensor) -> bool:
    """Every element finite, exactly: isfinite in slices, so that its bool copy stays small."""
    if t.is_contiguous() and t.numel() > FINITE_SLICE:
        return all(bool(torch.isfinite(s).all()) for s in t.view(-1).split(FINITE_SLICE))
    return bool(torch.isfinite(t).all())


def first_nonfinite(state: dict, prefix: str = "") -> str | None:
    """The name (DCP's: `model.layers.0...`) of the first tensor in `state` with a NaN or an infinity
    among this rank's elements, None when all are finite. One pass: a NaN or an infinity makes a
    tensor's sum non-finite, so each floating-point tensor is summed (no copy; 5 times faster than
    isfinite on CPU), the sums come back in one transfer per device, and only a tensor whose sum is not
    finite is checked element by element (a finite one whose sum overflowed passes there)."""
    named = [(name, _local(t).detach()) for name, t in _tensors(state, prefix) if t.is_floating_point()]
    by_device: dict = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    suspect = sorted(i for idx in by_device.values()
                     for i, ok in zip(idx, torch.isfinite(torch.stack([named[i][1].sum().double() for i in idx])).tolist())
                     if not ok)
    return next((named[i][0] for i in suspect if not _all_finite(named[i][1])), None)


def _tensors(node, prefix: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, torch.Tensor):
        yield prefix, node


# ------------------------------------------------------------------------------------ messages

def _kind(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def _kind_of_template(v) -> str:
    return {bool: "true or false", str: "a string", type(None): "null"}[type(v)]


def _short(v) -> str:
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool, type(None))) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def nonfinite_message(tensor: str, rank: int) -> str:
    return f"{tensor} holds a non-finite value (NaN or infinity) on rank {rank}"

