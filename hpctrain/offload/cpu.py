"""AdamW whose state lives off the accelerator: in host memory (offload=cpu) or in files (offload=nvme).

Layout. Every parameter this rank updates (its local shard: FSDP2/TP parameters are DTensors and only
`to_local()` is touched; under ZeRO-1 only the parameters ZeroRedundancyOptimizer gives this rank)
gets a segment of one flat fp32 index space, each segment starting on a 4 KiB boundary. The two
moments (and, where they are not the parameters themselves, the fp32 master weights) are flat tensors
over that space: host tensors (pinned when an accelerator exists), or files streamed through a few
chunk buffers (hpctrain.offload.nvme).

Step. The space is walked chunk by chunk. For each chunk: gradients come to the host (on an
accelerator: asynchronous copies into pinned staging, the next chunk's copy overlapping this chunk's
update; on a CPU device they are read where they are), the single-pass AdamW kernel updates master
weights and moments and writes the low-precision weights when the parameters are bf16/fp16, and the
updated weights go back to the device (asynchronous copies on a stream of their own). On a CPU device
with fp32 parameters the parameters are the master weights: the kernel updates them in place.
Gradients are taken at `step()`, after the trainer clipped them in place, so clipping needs nothing
here. Under FSDP2 (ZeRO 2/3 without tensor parallel) the parameters this optimizer sees are already
on the host (hpctrain.parallel.data_parallel.apply_fsdp with host_params): FSDP2 moved each gradient shard there
as backward produced it, and no staging is needed.

Checkpoints. `state[p]` holds `step`, `exp_avg`, `exp_avg_sq` (DTensors when `p` is one, so DCP
reshards them) exactly as torch.optim.AdamW names them, plus `master` for bf16/fp16 parameters (their
fp32 weights exist only here). The tensors are views of the host state, or of the files (memory
maps) with offload=nvme: a save reads them, a load writes them in place. Reading `state` marks the
views as handed out; the next `step()` takes them back (flushing the maps) and, where fp32 master
weights are kept apart from fp32 parameters (an accelerator), re-reads them from the parameters,
which a load may have replaced.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from hpctrain.offload.adam_kernel import AdamKernel
from hpctrain.checkpoint.directio import aligned_empty, round_up
from hpctrain.core.schema import OffloadConfig
from hpctrain.offload.host_state import Chunk, HostStore, OffloadError, standalone
from hpctrain.offload.nvme import NvmeStore

log = logging.getLogger("hpctrain")

ALIGN_ELEMS = 1024  # 4 KiB of fp32: every segment (and chunk) starts on an O_DIRECT boundary
MOMENTS = ("exp_avg", "exp_avg_sq")
# A compiled (Inductor) kernel call holds the GIL (the C++ one does not): its calls are kept this short
# so that the I/O threads can issue their next requests between them.
MAX_CALL = 1 << 21

# The schema's knobs and defaults (OffloadConfig), with target=cpu, and three that only tests and
# benchmarks set: sizes finer than MiB, and a CPU model run through the accelerator code path.
DEFAULTS = {**{f.name: f.default for f in fields(OffloadConfig)}, "target": "cpu",
            "chunk_bytes": None, "block_bytes": None, "emulate_device": False}


def settings(cfg: OffloadConfig | dict | None = None, **overrides) -> SimpleNamespace:
    """The offload knobs from an OffloadConfig (or dict, or None) with defaults for missing ones."""
    out = dict(DEFAULTS)
    if cfg is not None:
        for k in DEFAULTS:
            v = cfg.get(k, None) if hasattr(cfg, "get") else getattr(cfg, k, None)
            if v is not None:
                out[k] = v
    out.update(overrides)
    return SimpleNamespace(**out)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`view` (this rank's part) presented as `p` is: a DTensor with p's mesh and placements."""
    if isinstance(p, DTensor):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return view


@dataclass
class Slot:
    param: torch.Tensor
    group: int
    index: int
    offset: int  # first element in the flat space
    numel: int
    separate_master: bool  # fp32 master weights kept apart from the parameter
    expose_master: bool  # ... and saved with the optimizer state (low-precision parameters)

    @property
    def local(self) -> torch.Tensor:
        return local_tensor(self.param).view(-1)


@dataclass
class Piece:
    slot: Slot
    a: int  # [a, b) within the slot's local tensor
    b: int
    x: int  # position of `a` within the chunk


class HostAdamW(Optimizer):
    """AdamW (torch.optim.AdamW's arithmetic and state names) with host- or file-resident state.

    `offload`: an OffloadConfig (target cpu|nvme, path, kernel, pin_memory, chunk_mb, buffer_count,
    queue_depth, block_mb, direct_io, master_on_nvme), a dict, or None for host memory with defaults.
    State is created on first use (first step, or the first read of `state`), so parameter groups may
    still be added after construction, as ZeroRedundancyOptimizer does.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, offload: OffloadConfig | dict | None = None):
        self.offload = settings(offload)
        self.kernel = AdamKernel(self.offload.kernel)
        self._store = None
        self._exposed: Optional[dict] = None
        self._master_stale = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    # ------------------------------------------------------------ the state mapping

    @property
    def state(self) -> dict:  # type: ignore[override]
        """Per-parameter state as torch.optim.AdamW holds it (views of the offloaded tensors)."""
        if self.__dict__.get("_store", None) is None and not self.param_groups:
            return self.__dict__.setdefault("_empty_state", {})
        self._ensure_setup()
        if self._exposed is None:
            self._exposed = self._make_views()
        return self._exposed

    @state.setter
    def state(self, value) -> None:
        if value:  # Optimizer.__init__ assigns an empty defaultdict; anything else is not supported
            raise NotImplementedError("HostAdamW state is loaded in place through `state[p]` tensors")

    def add_param_group(self, param_group: dict) -> None:
        if self.__dict__.get("_store") is not None:
            raise RuntimeError("HostAdamW: parameter groups must be added before the first step")
        super().add_param_group(param_group)

    def _make_views(self) -> dict:
        out = {}
        for s in self._slots:
            shape = local_tensor(s.param).shape
            st = {"step": self._steps[s.index]}
            for k in MOMENTS:
                st[k] = like_param(self._store.view(k, s.offset, s.numel).view(shape), s.param)
            if s.expose_master:
                st["master"] = like_param(standalone(self._master_view(s, 0, s.numel)).view(shape), s.param)
            out[s.param] = st
        if any(s.separate_master and not s.expose_master for s in self._slots):
            self._master_stale = True  # a load may replace the parameters: re-read them next step
        return out

    def _release_views(self) -> None:
        if self._exposed is not None:
            self._exposed = None
            self._store.release()

    # ------------------------------------------------------------ setup

    def _ensure_setup(self) -> None:
        if self._store is not None:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        device = local_tensor(params[0]).device if params else torch.device("cpu")
        emulate = bool(self.offload.emulate_device) and device.type == "cpu"
        on_host = device.type == "cpu" and not emulate
        slots, off = [], 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                loc = local_tensor(p)
                if not loc.is_contiguous():
                    raise OffloadError(f"offload needs contiguous local parameter shards; got one of shape "
                                       f"{tuple(loc.shape)} with strides {loc.stride()}")
                if loc.device != device:
                    raise OffloadError(f"parameters on several devices ({device}, {loc.device})")
                lowp = loc.dtype != torch.float32
                if lowp and loc.dtype not in (torch.bfloat16, torch.float16):
                    raise OffloadError(f"offloaded AdamW supports fp32, bf16 and fp16 parameters, not {loc.dtype}")
                slots.append(Slot(p, gi, len(slots), off, loc.numel(), separate_master=lowp or not on_host,
                                  expose_master=lowp))
                off += round_up(loc.numel(), ALIGN_ELEMS)
        self._slots, self._numel, self._device = slots, off, device
        self._pin = bool(self.offload.pin_memory) and not on_host and _accelerator_available()
        self._steps = torch.zeros(len(slots), dtype=torch.float32)
        any_master = any(s.separate_master for s in slots)
        chunk_bytes = getattr(self.offload, "chunk_bytes", None) or int(self.offload.chunk_mb) << 20
        chunk = max(ALIGN_ELEMS, round_up(int(chunk_bytes) // 4, ALIGN_ELEMS))
        chunk = min(chunk, max(ALIGN_ELEMS, off))  # no buffer larger than the state itself
        kinds = MOMENTS
        if self.offload.target == "nvme":
            master_in_file = any_master and bool(self.offload.master_on_nvme)
            kinds = MOMENTS + (("master",) if master_in_file else ())
            self._store = NvmeStore(off, kinds, self.offload, self._pin, chunk)
            self._master_flat = (aligned_empty(off * 4, self._pin).view(torch.float32)
                                 if any_master and not master_in_file else None)
        else:
            self._store = HostStore(off, kinds, self._pin, chunk if not on_host else max(off, 1))
            self._master_flat = aligned_empty(off * 4, self._pin).view(torch.float32) if any_master else None
        # the compiled kernel holds the GIL: short calls let the I/O threads run between them
        self._pieces = self._cut(self._store.chunks(), MAX_CALL if self.kernel.active == "compile" else None)
        self._stage = None
        if not on_host:
            self._stage = _DeviceStaging(device, self._store.chunk_elems, self._pin,
                                         _HostStreams if emulate else None)
        if any_master:
            self._init_master()
        log.info("offloaded AdamW: %d tensors, %.1f M elements, state in %s (%s kernel%s)", len(slots),
                 sum(s.numel for s in slots) / 1e6, self._store.__class__.__name__,
                 self.kernel.active, "" if on_host else f", device {device}")

    def _cut(self, chunks: list[tuple[int, int]], max_call: Optional[int]) -> list[list[Piece]]:
        out = []
        for c0, c1 in chunks:
            pieces = []
            for s in self._slots:
                lo, hi = max(c0, s.offset), min(c1, s.offset + s.numel)
                step = max_call or max(1, hi - lo)
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    pieces.append(Piece(s, a - s.offset, b - s.offset, a - c0))
            out.append(pieces)
        return out

    def _master_view(self, s: Slot, a: int, b: int, chunk: Optional[Chunk] = None) -> torch.Tensor:
        if self._master_flat is not None:
            return self._master_flat[s.offset + a:s.offset + b]
        if chunk is not None:  # master weights streamed with the chunk
            x = s.offset + a - chunk.start
            return chunk.views["master"][x:x + b - a]
        return self._store.view("master", s.offset + a, b - a)

    @torch.no_grad()
    def _init_master(self, resync: bool = False) -> None:
        """fp32 master weights from the parameters: all of them at setup; with `resync` (after the state
        was handed out, when a load may have replaced the parameters) those of fp32 parameters only:
        the master weights of bf16/fp16 parameters are more precise than the parameters and are loaded
        with the optimizer state."""
        for chunk in self._store.stream():
            for pc in self._pieces[chunk.index]:
                s = pc.slot
                if s.separate_master and not (resync and s.expose_master):
                    self._master_view(s, pc.a, pc.b, chunk).copy_(s.local[pc.a:pc.b])
        self._master_stale = False

    # ------------------------------------------------------------ the step

    def host_bytes(self) -> int:
        """Host memory this optimizer holds for state (buffers included)."""
        self._ensure_setup()
        extra = self._master_flat.numel() * 4 if self._master_flat is not None else 0
        return self._store.host_bytes() + extra + self._steps.numel() * 4

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments and separate master weights) for this rank."""
        self._ensure_setup()
        return sum(s.numel * 4 * (2 + s.separate_master) for s in self._slots)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_setup()
        self._release_views()
        if self._master_stale:
            self._init_master(resync=True)
        live = [s for s in self._slots if s.param.grad is not None]
        if not live:
            return loss
        idx = torch.tensor([s.index for s in live])
        self._steps.index_add_(0, idx, torch.ones(len(live)))
        steps = self._steps.tolist()
        hyper = []
        for g in self.param_groups:
            b1, b2 = g["betas"]
            hyper.append(dict(lr=float(g["lr"]), beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                              weight_decay=float(g["weight_decay"])))
        grads = {s.index: local_tensor(s.param.grad).view(-1) for s in live}
        stage = self._stage
        if stage is not None:
            stage.begin()
        chunks = self._store.stream()
        try:
            for chunk in chunks:  # the store writes a chunk back when we ask for the next one
                if stage is not None:
                    for k in (chunk.index, chunk.index + 1):  # this chunk's gradients and the next one's
                        if k < len(self._pieces):
                            stage.fetch_grads(k, self._pieces[k], grads)
                self._update_chunk(chunk, grads, hyper, steps)
        finally:
            chunks.close()
            if stage is not None:
                stage.end()
        return loss

    def _update_chunk(self, chunk: Chunk, grads: dict, hyper: list, steps: list) -> None:
        stage = self._stage
        if stage is not None:
            stage.start_chunk(chunk.index)
        calls: dict[tuple, tuple] = {}  # (group, step, has out) -> lists for one multi-tensor kernel call
        puts = []
        for pc in self._pieces[chunk.index]:
            s = pc.slot
            if s.index not in grads:
                continue
            n = pc.b - pc.a
            g = stage.grad(pc, grads[s.index]) if stage is not None else grads[s.index][pc.a:pc.b]
            m = chunk.views["exp_avg"][pc.x:pc.x + n]
            v = chunk.views["exp_avg_sq"][pc.x:pc.x + n]
            out = None
            if not s.separate_master:  # fp32 parameters in host memory are the master weights
                master = s.local[pc.a:pc.b]
            else:
                master = self._master_view(s, pc.a, pc.b, chunk)
                if stage is None:
                    out = s.local[pc.a:pc.b]  # low-precision parameters on the host: written in the pass
                elif s.local.dtype != torch.float32:
                    out = stage.out(pc, s.local.dtype)  # ... or staged for the device
            key = (s.group, int(steps[s.index]), out is not None)
            lists = calls.setdefault(key, ([], [], [], [], []))
            for lst, t in zip(lists, (master, g, m, v, out)):
                lst.append(t)
            if stage is not None:
                puts.append((pc, out if out is not None else master))
        for (group, step, has_out), (ps, gs, ms, vs, outs) in calls.items():
            self.kernel.step_multi(ps, gs, ms, vs, outs if has_out else None, step=step, **hyper[group])
        if stage is not None:
            for pc, src in puts:
                stage.put_param(pc, pc.slot.local, src)
            chunk.fence = stage.fence()

    def close(self) -> None:
        """Release files and buffers now (they are released anyway when the optimizer is freed or the
        process ends)."""
        if self.__dict__.get("_store") is not None:
            self._exposed = None
            self._store.close()


class _DeviceStaging:
    """Accelerator side of the step: gradients device->host into pinned staging (one chunk ahead, on a
    stream of their own), updated weights host->device on another stream."""

    def __init__(self, device: torch.device, chunk_elems: int, pin: bool, mod=None):
        self.device = device
        self.mod = mod or getattr(torch, device.type)  # torch.cuda (or the accelerator's module)
        self.d2h = self.mod.Stream(device)
        self.h2d = self.mod.Stream(device)
        self.grad_buf = [aligned_empty(chunk_elems * 4, pin) for _ in range(2)]
        self.out_buf = [aligned_empty(chunk_elems * 2, pin) for _ in range(2)]
        self.out_done = [None, None]
        self.grad_ready: dict[int, Any] = {}
        self.current = 0

    def begin(self) -> None:
        # gradients are final (backward, reduction and clipping ran on the current stream)
        self.d2h.wait_stream(self.mod.current_stream(self.device))
        self.h2d.wait_stream(self.mod.current_stream(self.device))

    def fetch_grads(self, k: int, pieces: list[Piece], grads: dict) -> None:
        if k in self.grad_ready:
            return
        buf = self.grad_buf[k % 2]
        with self.mod.stream(self.d2h):
            for pc in pieces:
                g = grads.get(pc.slot.index)
                if g is None:
                    continue
                n, es = pc.b - pc.a, g.element_size()
                buf[pc.x * es:(pc.x + n) * es].view(g.dtype).copy_(g[pc.a:pc.b], non_blocking=True)
            ev = self.mod.Event()
            ev.record(self.d2h)
        self.grad_ready[k] = ev

    def start_chunk(self, k: int) -> None:
        self.current = k
        self.grad_ready.pop(k).synchronize()
        i = k % 2
        if self.out_done[i] is not None:  # the copy out of this staging buffer (two chunks ago) is over
            self.out_done[i].synchronize()
            self.out_done[i] = None

    def grad(self, pc: Piece, g: torch.Tensor) -> torch.Tensor:
        es = g.element_size()
        return self.grad_buf[self.current % 2][pc.x * es:(pc.x + pc.b - pc.a) * es].view(g.dtype)

    def out(self, pc: Piece, dtype: torch.dtype) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        return self.out_buf[self.current % 2][pc.x * es:(pc.x + pc.b - pc.a) * es].view(dtype)

    def put_param(self, pc: Piece, local: torch.Tensor, src: torch.Tensor) -> None:
        with self.mod.stream(self.h2d):
            local[pc.a:pc.b].copy_(src, non_blocking=True)

    def fence(self):
        ev = self.mod.Event()
        ev.record(self.h2d)
        self.out_done[self.current % 2] = ev
        return ev

    def end(self) -> None:
        # the next forward (current stream) sees the new weights; the host waits before touching
        # master weights or staging again
        self.mod.current_stream(self.device).wait_stream(self.h2d)
        self.h2d.synchronize()


class _HostStreams:
    """Stands in for torch.cuda in _DeviceStaging with offload emulate_device (tests on machines without
    an accelerator): the same staging code path, with copies that complete at once."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            pass

    @staticmethod
    def current_stream(device=None):
        return _HostStreams.Stream()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()
