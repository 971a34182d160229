"""In-memory snapshots (checkpoint.memory_every): every rank copies its local shards and its plain states
into a file on the node's tmpfs (HPCTRAIN_MEMORY_DIR/own/, hpctrain.core.snapfile's format), which
the node's agent replicates to the partner node; a restart of the same layout loads the newest step every
rank has a copy of (hpctrain.checkpoint.memory_plan), through CheckpointManager.resume.

Writing, per due step (`after_step`): one synchronous copy of the local shards into a reused slot file
(mmap'ed, its pages reserved once with fallocate, so a full tmpfs is an error here and never a SIGBUS in
the loop); on CUDA a non_blocking copy into a reused pinned buffer and an event instead. A background
thread then (waits for the event and fills the file,) checksums the payload, writes the header, renames
the slot to its final name (complete or absent) and prunes this rank's files in own/ to the KEEP newest
steps, unlinking the pruned ones. If the thread is still busy at the next due step, the loop waits for
it (counted as `snapshot_waited`): every rank must snapshot the same steps, or no step would be one that
every rank has.

Reading: `prepare` locates a rank's file (own node, or fetched from another node's agent), verifies it
and checks it against the live state without changing anything; `apply` then copies it in. The manager
runs one collective verdict between the two.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from hpctrain.core import snapfile
from hpctrain.core.snapfile import DamagedSnapshot
from hpctrain.checkpoint.validate import first_nonfinite, own_problem, state_problem
from hpctrain.core import faults
from hpctrain.core.rundir import attempt_dir

log = logging.getLogger("hpctrain")

KEEP = 2  # complete steps of each rank kept in own/ (the agent's replicas: as many in peer/)
SLOTS = KEEP + 1  # files in use: the kept ones and the one being filled
OWN, PEER, FETCHED = "own", "peer", "fetched"
PLAN = "plan.json"


class RestoreRefused(RuntimeError):
    """A snapshot that exists and is intact but is not this run's state to load (run, world, layout, step)."""


def run_id(run_dir: str | os.PathLike) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]


def layout_id(layout: Optional[dict], world: int) -> str:
    """Changes when the sharding does (the engine layout, the world): local shards of another are not these."""
    return hashlib.sha1(json.dumps([layout, world], sort_keys=True).encode()).hexdigest()[:16]


def current_plan(run_dir: str | os.PathLike) -> Optional[dict]:
    """The supervisor's plan of this generation (attempts/<HPCTRAIN_ATTEMPT>/plan.json), None where there is
    none (torchrun, or agent mode off): memory restore is then off and a resume reads disk."""
    path = attempt_dir(run_dir, faults.attempt()) / PLAN
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): memory restore is off for this generation", path, e)
        return None
    return plan if isinstance(plan, dict) else None


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def leaves(state: dict, prefix: str = "") -> list[tuple[str, Any, Any, Any]]:
    """(key path, parent container, key in it, value) of every leaf: tensors and plain values. Dicts are
    walked, and lists or tuples that hold tensors; key paths join with "." as the manager's names do."""
    out = []

    def walk(pre, node):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            key = f"{pre}.{k}" if pre else str(k)
            if isinstance(v, dict) or (isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)):
                walk(key, v)
            else:
                out.append((key, node, k, v))

    walk(prefix, state)
    return out


@dataclass
class _Slot:
    """A reused file in own/ (named .tmp-… while it is being filled), mapped once."""
    path: Path
    size: int = 0
    start: int = 0  # the payload's
    mm: Optional[mmap.mmap] = None
    bytes: Optional[torch.Tensor] = None  # uint8 over the whole map
    views: dict = field(default_factory=dict)  # layout signature -> [destination tensors]

    def fit(self, start: int, size: int) -> None:
        """Make the file `size` bytes, its pages reserved (a full tmpfs raises OSError here)."""
        if self.mm is not None and self.size == size and self.start == start:
            return
        self.unmap()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size, self.start, self.views = size, start, {}
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    def destinations(self, sig: tuple, entries: list[dict]) -> list[torch.Tensor]:
        if sig not in self.views:
            self.views = {sig: [_typed(self.bytes, self.start + e["offset"], e) for e in entries]}
        return self.views[sig]

    def unmap(self) -> None:
        self.views, self.bytes = {}, None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view still held somewhere: the map goes with it
                pass
            self.mm = None


def _read_only(view: memoryview, e: dict) -> torch.Tensor:
    """A tensor over a mapped file's bytes (only read from: copied into the live state)."""
    dtype = getattr(torch, e["dtype"])
    if not e["nbytes"]:
        return torch.empty(e["shape"], dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=dtype).view(e["shape"])


def _typed(buf: torch.Tensor, at: int, e: dict) -> torch.Tensor:
    return buf[at:at + e["nbytes"]].view(getattr(torch, e["dtype"])).view(e["shape"])


@dataclass
class _Job:
    slot: _Slot
    step: int
    header: dict
    reserve: int
    event: Any = None  # CUDA: the copy into `pinned` is done when it is
    pinned: Optional[torch.Tensor] = None


class MemorySnapshots:
    def __init__(self, manager, directory: str | os.PathLike, every: int, plan: Optional[dict] = None):
        """`manager`: the CheckpointManager whose state is snapshotted (it gets `.memory` = self, and
        resume then tries memory first). `directory`: the node's memory directory (HPCTRAIN_MEMORY_DIR)."""
        self.manager, self.dir, self.every, self.plan = manager, Path(directory), int(every), plan
        self.rank, self.world = manager.rank, manager.world
        # The node's name as Slurm and the plan give it (the agent's --node), which a host's name may not be.
        self.node = os.environ.get("HPCTRAIN_NODE") or socket.gethostname()
        self.run = run_id(manager.run_dir)
        self.layout = layout_id(manager.meta.get("layout"), self.world)
        self.own = self.dir / OWN
        self.own.mkdir(parents=True, exist_ok=True)
        self.waited = 0  # due snapshots that waited for the previous one to be written
        self.taken = 0
        self.off: Optional[str] = None  # why snapshots stopped (a full tmpfs), once
        self._nonce = secrets.token_hex(3)
        self._made = 0  # slot file names given
        self.slot_files = 0  # slot files made (SLOTS when they are reused as they should be)
        self._free: list[_Slot] = []
        self._complete: dict[str, _Slot] = {}  # final file name -> its slot
        self._pinned: Optional[torch.Tensor] = None
        self._reserve = 0
        self._layout: Optional[tuple] = None  # (state dict, its local tensors, scalar leaves, signature, entries, size)
        self._job: Optional[_Job] = None
        self._cv = threading.Condition()
        self._stop = False
        self._abandon = False
        self._remove_stale()
        self._thread = threading.Thread(target=self._work, name=f"memory-snapshot-r{self.rank}", daemon=True)
        self._thread.start()
        manager.memory = self

    # ---------------------------------------------------------------- writing

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < self.manager.total_steps and self.off is None

    def after_step(self, step: int) -> dict:
        """Snapshot `step` when due. Returns the step's metrics: {"snapshot_ms": time the loop was held,
        waiting for a busy writer included} when taken, and {"snapshot_waited": count so far} once the loop
        had to wait for the writer."""
        if not self.due(step):
            return {}
        # Every rank snapshots the same steps: a rank that skipped one while its writer was busy would leave
        # no step that every rank has (restores need one). A writer still busy is waited for, and counted.
        t0 = time.perf_counter()
        with self._cv:
            if self._job is not None:
                self.waited += 1
            while self._job is not None:
                self._cv.wait()
        try:
            self._take(step)
        except OSError as e:  # no room on the tmpfs: the run goes on with disk checkpoints alone
            self.off = f"memory snapshots off from step {step}: {e.strerror or e} under {self.own}"
            log.warning("%s; restarts will read the disk checkpoints", self.off)
            return {}
        self.taken += 1
        out = {"snapshot_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        if self.waited:
            out["snapshot_waited"] = self.waited
        return out

    @torch.no_grad()  # (DTensor.to_local is then the local tensor itself, without autograd's wrapper)
    def _take(self, step: int) -> None:
        state = self.manager._tensor_state()
        if self._layout is None or self._layout[0] is not state:
            # What to copy, and where: built again only when the manager's state dict is (a tensor replaced).
            tensors = [(key, _local(v)) for key, _, _, v in leaves(state) if isinstance(v, torch.Tensor)]
            scalar = [(key, parent, k) for key, parent, k, v in leaves(state) if not isinstance(v, torch.Tensor)]
            sig = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors)
            entries, size = snapfile.place([(k, dtype_name(t), list(t.shape), t.numel() * t.element_size())
                                            for k, t in tensors])
            self._layout, self._reserve = (state, tensors, scalar, sig, entries, size), 0
        _, tensors, scalar, sig, entries, size = self._layout
        plain = {n: o.state_dict() for n, o in self.manager.objects.items() if not getattr(o, "sharded", False)}
        header = {"version": snapfile.VERSION, "run": self.run, "step": step, "rank": self.rank, "world": self.world,
                  "layout": self.layout, "node": self.node, "plain": plain,
                  "scalars": {key: parent[k] for key, parent, k in scalar}, "tensors": entries,
                  "payload_crc32": 0xFFFFFFFF}  # the widest value: the real one is filled in later
        if not self._reserve:  # room for the states' JSON to grow (RNG numbers' digits): the writer checks it
            need = len(json.dumps(header, separators=(",", ":")).encode())
            self._reserve = snapfile.payload_start(need + need // 2 + 4096) - 16
        start = snapfile.payload_start(self._reserve)
        slot = self._free.pop() if self._free else self._new_slot()
        try:
            slot.fit(start, start + size)
        except OSError:
            self._drop(slot)
            raise
        job = _Job(slot, step, header, self._reserve)
        if any(t.is_cuda for _, t in tensors):  # device -> pinned host buffer, asynchronously; the thread waits
            if self._pinned is None or self._pinned.numel() != size:
                self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            for (_, t), e in zip(tensors, entries):
                _typed(self._pinned, e["offset"], e).copy_(t, non_blocking=True)
            job.event, job.pinned = torch.cuda.Event(), self._pinned
            job.event.record()
        else:
            for (_, t), dst in zip(tensors, slot.destinations(sig, entries)):
                dst.copy_(t)
        with self._cv:
            self._job = job
            self._cv.notify()

    def _new_slot(self) -> _Slot:
        self.slot_files += 1
        return _Slot(self._slot_name())

    def _slot_name(self) -> Path:
        self._made += 1
        return self.own / f"{snapfile.TMP_PREFIX}slot{self._made}-r{self.rank:05d}-{self._nonce}"

    def _drop(self, slot: _Slot) -> None:
        slot.unmap()
        slot.path.unlink(missing_ok=True)

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._stop:
                    self._cv.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                if self._abandon or not self._finish(job):
                    self._free.append(job.slot)  # close(wait=False): not published
            except Exception as e:  # noqa: BLE001 - a snapshot lost is logged; training goes on
                log.warning("memory snapshot of step %d not written: %s: %s", job.step, type(e).__name__, e)
                self._drop(job.slot)
            with self._cv:
                self._job = None
                self._cv.notify_all()

    def _finish(self, job: _Job) -> bool:
        """Checksum, header, rename, prune; False when close(wait=False) came first (nothing published)."""
        slot = job.slot
        if job.event is not None:
            job.event.synchronize()
            slot.bytes[slot.start:slot.start + job.pinned.numel()].copy_(job.pinned)
        job.header["payload_crc32"] = snapfile.crc_of(slot.mm, slot.start, slot.size)
        try:
            head = snapfile.write_header(job.header, job.reserve)
        except ValueError:
            self._reserve = 0  # the states grew past the room left: the next snapshot makes more
            raise
        slot.mm[:len(head)] = head
        if self._abandon:
            return False
        final = snapfile.name(job.step, self.rank)
        os.replace(slot.path, self.own / final)
        slot.path = self.own / final
        self._complete[final] = slot
        try:
            self._prune(job.step)
        except OSError as e:  # the snapshot is published: a failed clean-up must not take it back
            log.warning("memory snapshots: pruning %s failed: %s", self.own, e)
        return True

    def _prune(self, newest: int) -> None:
        """This rank's files in own/: the KEEP newest steps up to `newest`; later ones are a future a
        restore discarded. Pruned files are unlinked, never written again: the agent's pusher may still be
        reading one (an open file outlives its name), and a file rewritten under it would reach the partner
        under the old step's name."""
        mine = sorted((s, f) for f in os.listdir(self.own) if (p := snapfile.parse_name(f)) and p[1] == self.rank
                      for s in (p[0],))
        kept = [f for s, f in mine if s <= newest][-KEEP:]
        for _, f in mine:
            if f in kept:
                continue
            slot = self._complete.pop(f, None)
            (self.own / f).unlink(missing_ok=True)  # gone already: the agent's cleanup
            if slot is not None:
                slot.unmap()

    def _remove_stale(self) -> None:
        """Slot files of this rank that an earlier process (or Trainer) left: not snapshots, only space."""
        tail = f"-r{self.rank:05d}-"
        for f in os.listdir(self.own):
            if f.startswith(snapfile.TMP_PREFIX + "slot") and tail in f:
                (self.own / f).unlink(missing_ok=True)

    def wait(self) -> None:
        """Until the snapshot being written, if any, is complete."""
        with self._cv:
            while self._job is not None:
                self._cv.wait()

    def close(self, wait: bool = True) -> None:
        """Stop the writer thread (joined: the Trainer may be rebuilt in this process). wait=True finishes
        the snapshot in flight; wait=False abandons it (after a failure its state may be half updated).
        Complete snapshots stay; this writer's slot files go."""
        with self._cv:
            self._abandon = not wait
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        for slot in self._free:
            self._drop(slot)
        self._free = []
        for slot in self._complete.values():
            slot.unmap()
        self._complete, self._pinned, self._layout = {}, None, None

    # ---------------------------------------------------------------- reading

    def inventory(self) -> list[list]:
        """[[rank, step, "own"|"peer"]] of the complete snapshot files on this node."""
        out = []
        for where in (OWN, PEER):
            try:
                names = os.listdir(self.dir / where)
            except FileNotFoundError:
                continue
            out += [[p[1], p[0], where] for f in names if (p := snapfile.parse_name(f))]
        return sorted(out)

    def locate(self, step: int, source: str, plan: Optional[dict]) -> Path:
        """This rank's snapshot of `step`: on this node ("own", or this node's name), else fetched from the
        agent of node `source` into fetched/."""
        fname = snapfile.name(step, self.rank)
        if source in ("own", self.node):
            for where in (OWN, PEER, FETCHED):
                if (self.dir / where / fname).is_file():
                    return self.dir / where / fname
            raise DamagedSnapshot(f"{fname} is in none of {OWN}/, {PEER}/, {FETCHED}/ under {self.dir} on {self.node}")
        addr = ((plan or {}).get("agents") or {}).get(source)
        if not addr:
            raise DamagedSnapshot(f"{fname} is on {source}, and the plan names no agent there")
        from hpctrain.core.replica import get  # the node agent's transfers (torch-free)

        dest = self.dir / FETCHED / fname
        dest.parent.mkdir(parents=True, exist_ok=True)
        why: list = []
        if not get(addr, fname, dest, why=why):
            raise DamagedSnapshot(why[0] if why else f"fetching {fname} from the agent of {source} ({addr}) failed")
        return dest

    def prepare(self, step: int, source: str, plan: Optional[dict], state: dict) -> "Loaded":
        """Locate, verify and check this rank's snapshot of `step` against the live `state` (the manager's
        _tensor_state()) and objects, changing nothing. DamagedSnapshot / RestoreRefused say why not."""
        path = self.locate(step, source, plan)
        header = snapfile.verify(path)
        for what, want in (("run", self.run), ("world", self.world), ("rank", self.rank), ("step", step),
                           ("layout", self.layout)):
            if header[what] != want:
                raise RestoreRefused(f"{path} is of {what} {header[what]!r}, this run's is {want!r}"
                                     + (" (another sharding of the state)" if what in ("world", "layout") else ""))
        entries = {t["key"]: t for t in header["tensors"]}
        live = leaves(state)
        tensors = {k: v for k, _, _, v in live if isinstance(v, torch.Tensor)}
        scalars = {k for k, _, _, v in live if not isinstance(v, torch.Tensor)}
        extra, missing = sorted(set(entries) - set(tensors)), sorted(set(tensors) - set(entries))
        if extra or missing:
            raise RestoreRefused(f"{path} " + (f"holds {extra[0]!r}, which this rank's state has not" if extra
                                              else f"holds no {missing[0]!r}"))
        if scalars != set(header["scalars"]):
            raise RestoreRefused(f"{path}'s plain values {sorted(header['scalars'])} are not this state's {sorted(scalars)}")
        for k, t in tensors.items():
            e, loc = entries[k], _local(t)
            if e["dtype"] != dtype_name(loc) or e["shape"] != list(loc.shape):
                raise RestoreRefused(f"{path}: {k} is {e['dtype']} {e['shape']}, this rank's is "
                                     f"{dtype_name(loc)} {list(loc.shape)} (another sharding)")
        views = snapfile.tensor_views(path, header)
        sources = {k: _read_only(views[k], entries[k]) for k in tensors}
        bad = first_nonfinite(sources)
        if bad:
            raise RestoreRefused(f"{path}: {bad} holds a NaN or an infinity")
        plain = header["plain"]
        for name, obj in self.manager.objects.items():
            if getattr(obj, "sharded", False):
                continue
            where = f"{path}'s {name}"
            if name not in plain:
                raise RestoreRefused(f"{path} holds no {name} state")
            saved, reads = plain[name], getattr(obj, "reads", None)
            if reads is not None and isinstance(saved, dict):
                saved = {k: v for k, v in saved.items() if k in reads}
            problem = state_problem(where, saved, obj.state_dict()) or own_problem(obj, where, saved)
            if problem:
                raise RestoreRefused(problem)
        progress = plain.get("progress")
        if isinstance(progress, dict) and progress.get("step") != step:
            raise RestoreRefused(f"{path}'s progress says step {progress.get('step')!r}, its name and header {step}")
        return Loaded(path, header, live, sources)


@dataclass
class Loaded:
    """A checked snapshot, ready to be copied into the live state."""
    path: Path
    header: dict
    live: list
    sources: dict

    def forget_fetched(self) -> None:
        """A file fetched from another node's agent for this restore: removed once loaded (the node keeps
        only its own ranks' snapshots and its partner's replicas)."""
        if self.path.parent.name == FETCHED:
            self.path.unlink(missing_ok=True)

    @torch.no_grad()
    def apply(self, objects: dict) -> None:
        """Tensors into the live state dict in place (a DTensor's local shard), plain values replaced, then
        the plain objects' states loaded: what a disk resume leaves, before manager._restore."""
        for key, parent, k, v in self.live:
            if isinstance(v, torch.Tensor):
                _local(v).copy_(self.sources[key])
            else:
                parent[k] = self.header["scalars"][key]
        for name, obj in objects.items():
            if not getattr(obj, "sharded", False):
                obj.load_state_dict(self.header["plain"][name])
