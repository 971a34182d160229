"""Staging for async saves: copy this rank's state into host buffers that are allocated once, with
the staged state dict (its DTensor wrappers included) built once and reused by every later save.

DCP's DefaultStager also reuses its buffers, but rebuilds the staged state dict on every save,
allocating a tensor (a DTensor, through DTensor's dispatcher) per item: on a model with a few
hundred tensors that costs as much as the copy itself, and the training loop waits for all of it.
Here a save copies local shards into the buffers and nothing else; only a change in the state's
structure (names, shapes, dtypes, placements) rebuilds them.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


def _leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))
    else:
        yield path, node


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _signature(t: torch.Tensor) -> tuple:
    spec = (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None
    loc = _local(t)
    return tuple(t.shape), tuple(loc.shape), loc.dtype, spec


class ReusingStager(AsyncStager):
    _synchronize_after_execute = False  # stage() returns with the copy complete

    def __init__(self, pin_memory: bool = False):
        self.pin = pin_memory
        self._key = None
        self._staged = None
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, state_dict: dict) -> dict:
        leaves = list(_leaves(state_dict))
        key = tuple((p, _signature(v)) if isinstance(v, torch.Tensor) else (p, None) for p, v in leaves)
        if key != self._key:
            self._build(state_dict, leaves)
            self._key = key
        cuda = False
        for path, v in leaves:
            if isinstance(v, torch.Tensor):
                src = _local(v).detach()
                cuda = cuda or src.is_cuda
                self._buffers[path].copy_(src, non_blocking=self.pin)
            else:
                _set(self._staged, path, copy.deepcopy(v))  # ints, floats, strings: a snapshot
        if cuda:
            torch.cuda.synchronize()  # the training step may change the sources next
        return self._staged

    def _build(self, state_dict: dict, leaves: list) -> None:
        self._buffers = {}
        self._staged = _skeleton(state_dict)
        for path, v in leaves:
            if not isinstance(v, torch.Tensor):
                continue
            loc = _local(v)
            buf = torch.empty(loc.shape, dtype=loc.dtype, device="cpu", pin_memory=self.pin)
            self._buffers[path] = buf
            if isinstance(v, DTensor):
                buf = DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False,
                                         shape=v.shape, stride=v.stride())
            _set(self._staged, path, buf)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers, self._staged, self._key = {}, None, None


def _skeleton(node):
    if isinstance(node, dict):
        return {k: _skeleton(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_skeleton(v) for v in node]
    return None


def _set(root, path: tuple, value) -> None:
    for k in path[:-1]:
        root = root[k]
    root[path[-1]] = value


class InPlaceStager(AsyncStager):
    """No staging: the save writes the live tensors. For a save that is waited for at once (nothing
    changes them meanwhile), so blocking and async saves share one path without a copy."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
