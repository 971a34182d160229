"""Saving and resuming the whole training state with torch.distributed.checkpoint (DCP).

The manager is given the training state as named Stateful objects (state_dict() / load_state_dict())
and owns the policy: every `checkpoint.every` steps (async where asked), at the end of the run, and
when the ranks agree to stop. Where each object's state goes:

- `sharded = True` (model, optimizer): tensors, as they live on the ranks, through DCP, which
  reshards on load; keys `<name>.<key>` (e.g. `model.layers.0.attention.wq.weight`). Such objects
  also give `key()`, the identity of their tensors, so an unchanged state dict is reused;
- `per_rank = True` (random generators): JSON in `<name>/rank-NNNNN.json` from every rank, restored
  only when the world size is unchanged;
- anything else (step counters, data position, LR schedule): JSON from rank 0 in `hpctrain.json`
  under the object's name, never a pickle.

There is one save path: a blocking save is an async save (staged in place, without a copy) that is
waited for at once; an async one stages into reused host buffers and is waited for by the next save
or the end of the run.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hpctrain.checkpoint import directories as store
from hpctrain.checkpoint.memory import RestoreRefused
from hpctrain.core.snapfile import DamagedSnapshot
from hpctrain.checkpoint.save_planner import ReusingSavePlanner
from hpctrain.checkpoint.raw import RawWriter
from hpctrain.checkpoint.safe import (DamagedCheckpoint, SafeReader, TensorOnlyLoadPlanner, check_files,
                                      check_shapes, read_metadata)
from hpctrain.checkpoint.stager import InPlaceStager, ReusingStager
from hpctrain.checkpoint.validate import (first_nonfinite, holds_problem, nonfinite_message, plain_problems, read_info,
                                          read_per_rank)
from hpctrain.core.rundir import CHECKPOINT_LOG, append_jsonl, overwrite_problem
from hpctrain.core.faults import wrap_writer
from hpctrain.core.schema import CheckpointConfig

log = logging.getLogger("hpctrain")


class NoUsableCheckpoint(RuntimeError):
    pass


class SaveFailed(RuntimeError):
    pass


@dataclass
class Pending:
    future: Any
    tmp: Path
    step: int
    info: dict
    started: float
    blocking: bool


def expected_shapes(state: dict) -> dict[str, tuple]:
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = tuple(node.shape)  # a DTensor reports its global shape

    walk("", state)
    return out


def _holds_tensors(node) -> bool:
    if isinstance(node, dict):
        return any(_holds_tensors(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensors(v) for v in node)
    return isinstance(node, torch.Tensor)


class CheckpointManager:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, state: dict, total_steps: int,
                 meta: Optional[dict] = None):
        """`state`: name -> Stateful. `cfg`: the checkpoint section. `meta`: JSON written beside
        the state (the config, the layout) for people and tools; never read back into training."""
        self.run_dir, self.root = Path(run_dir), Path(run_dir) / "checkpoints"
        self.cfg, self.objects, self.total_steps = cfg, dict(state), total_steps
        self.meta = dict(meta or {})
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pending: Optional[Pending] = None
        self._pg = None  # saves run their collectives on a group of their own (see save)
        self._stager: Optional[ReusingStager] = None
        self.last_saved: Optional[int] = None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        self.saves: list[dict] = []  # timings, for benchmarks and logs
        self._purge: Optional[threading.Thread] = None
        self._saved_state: Optional[tuple] = None  # (key, DCP state dict) of the last save
        self._planner: Optional[ReusingSavePlanner] = None
        self._pool = None
        self._checked: set = set()  # plain state objects whose state was found tensor-free
        self.loaded: Optional[Path] = None  # the checkpoint this run resumed from: retention keeps it
        # hpctrain.checkpoint.memory.MemorySnapshots, which sets itself here: resume then tries memory first
        self.memory = None
        self.restored: Optional[dict] = None  # what resume loaded, as restored.json records it
        self._tainted: Optional[str] = None  # a memory restore failed after changing the state: why

    # ---------------------------------------------------------------- policy

    def after_step(self, step: int) -> None:
        """Every `checkpoint.every` steps, before the last (the end of a run is saved by finish)."""
        every = self.cfg.every
        if every and step % every == 0 and step < self.total_steps:
            self.save(step, blocking=not self.cfg.async_save)

    def finish(self, step: int) -> None:
        """The end of a completed run is always kept when saving is on."""
        if self.cfg.every and self.last_saved != step:
            self.save(step, blocking=True)

    # ---------------------------------------------------------------- saving

    def save(self, step: int, blocking: bool = True) -> None:
        """All ranks call this together. A state with a NaN or an infinity in any rank's tensors is not
        saved (it would become the checkpoint a restart resumes from): the save is skipped and logged."""
        self.wait()
        t0 = time.perf_counter()
        state = self._tensor_state()
        nonce = self._start(step, first_nonfinite(state))
        if nonce is None:
            return
        tmp = store.tmp_dir(self.root, step, nonce)
        tmp.mkdir(parents=True, exist_ok=True)  # every rank: the nonce makes the name fresh
        plain, per_rank = self._write_plain(tmp)
        # finite: every tensor was checked before the save (retention keeps the newest such checkpoint).
        info = {"step": step, "world_size": self.world, "time": time.time(), "finite": True, **plain, **self.meta,
                "torch": torch.__version__}
        if self.rank == 0:  # what the tensors are (an adapter-only checkpoint and its base): rank 0 writes it
            for obj in self._tensor_objects().values():
                info.update(obj.record() if hasattr(obj, "record") else {})
        writer = wrap_writer(RawWriter(str(tmp), thread_count=max(1, self.cfg.threads), pool=self._io_pool(),
                                       also_sync=per_rank), step, self.rank)
        if self._pg is None:
            # DCP's collectives from its writer thread, interleaved with FSDP's on the default group,
            # abort the process: they get a gloo group of their own (gloo also carries host tensors).
            self._pg = dist.new_group(backend="gloo")
            self._stager = ReusingStager(pin_memory=torch.cuda.is_available())
        # A blocking save waits for the write right away, so it can write the live tensors; an async
        # one copies them first into host buffers that the next step may not touch.
        stager = InPlaceStager() if blocking else self._stager
        with _gc_paused():
            future = dcp.async_save(state, storage_writer=writer, planner=self._planner,
                                    process_group=self._pg, async_stager=stager)
        self.pending = Pending(future, tmp, step, info, t0, blocking)
        if blocking:
            self.wait()
        else:
            self.saves.append({"step": step, "blocked_s": time.perf_counter() - t0, "async": True})

    def _write_plain(self, tmp: Path) -> tuple[dict, list]:
        """Per-rank JSON into the checkpoint now (fsync'd by the writer thread, off the loop's path);
        returns those files and what rank 0 writes into hpctrain.json at commit."""
        shared, per_rank = {}, []
        for name, obj in self.objects.items():
            if getattr(obj, "sharded", False):
                continue
            state = obj.state_dict()
            if name not in self._checked:  # once per object: its kind of state does not change
                if _holds_tensors(state):
                    raise TypeError(f"checkpoint state {name!r} holds tensors: mark it sharded (see this module)")
                self._checked.add(name)
            if getattr(obj, "per_rank", False):
                path = tmp / name / f"rank-{self.rank:05d}.json"
                path.parent.mkdir(exist_ok=True)
                path.write_text(json.dumps(state))  # made durable by the writer, with the tensors
                per_rank.append(path)
            else:
                shared[name] = state
        return shared, per_rank

    def _tensor_objects(self) -> dict:
        return {n: o for n, o in self.objects.items() if getattr(o, "sharded", False)}

    def _tensor_state(self) -> dict:
        """The DCP state dict, built again only when a tensor in it was replaced (building it asks DCP
        for every parameter's name and placement: tens of ms the loop would wait for at every save)."""
        objs = self._tensor_objects()
        key = tuple(o.key() for o in objs.values())
        if self._saved_state is None or self._saved_state[0] != key:
            state = {n: o.state_dict() for n, o in objs.items()}
            key = tuple(o.key() for o in objs.values())  # building may create state (the optimizer's)
            self._saved_state = (key, state)  # holding the state keeps the ids unique
            self._planner = ReusingSavePlanner()  # plans this state dict's writes once
        return self._saved_state[1]

    def _io_pool(self):
        """The writer threads, started once for the run."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.cfg.threads), thread_name_prefix="checkpoint-write")
        return self._pool

    def wait(self) -> None:
        """Finish the save in flight, if any (a new save and the end of a run both wait)."""
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        try:
            with _gc_paused():
                p.future.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            self._abandon(p.tmp, p.step, e)
        self._commit(p)

    def close(self, wait: bool = True) -> None:
        """The end of a run: the last save is on disk and old checkpoints are deleted. wait=False is the
        teardown after a failure (the Trainer is rebuilt in this process): a save in flight is dropped, not
        waited for (its collectives may never return), and the memory snapshot writer is stopped."""
        if wait:
            self.wait()
        else:
            self.pending = None  # left incomplete on disk: resume ignores it, the next commit's retention removes it
        if self.memory is not None:
            self.memory.close(wait=wait)
        self._join_purge()
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
            self._pool = None

    def _join_purge(self) -> None:
        if self._purge is not None:
            self._purge.join()
            self._purge = None

    def _start(self, step: int, nonfinite: Optional[str]) -> Optional[str]:
        """One collective opens a save: every rank says which of its tensors is not finite, if any;
        rank 0 refuses a save that cannot fit, judged by the previous checkpoint's size, before a byte is
        written, and names the temporary directory. None: the save is skipped (a tensor is not finite)."""
        space = None
        if self.rank == 0:
            good = store.list_complete(self.root)
            if good:
                need, free = store.disk_usage(good[-1][1]), store.free_bytes(self.root)
                if free < need * 1.05 and self._purge is not None:
                    self._join_purge()  # the space of the checkpoints being deleted counts
                    free = store.free_bytes(self.root)
                if free < need * 1.05:
                    space = (f"No space left on device for it: {_mb(free)} free under {self.root}, "
                             f"the previous checkpoint took {_mb(need)}")
        verdicts = self._gather((nonfinite, space, f"{secrets.randbits(32):08x}"))
        bad = next(((rank, v[0]) for rank, v in enumerate(verdicts) if v[0]), None)
        if bad:
            self._skip(step, nonfinite_message(bad[1], bad[0]))
            return None
        if verdicts[0][1]:
            self._fail(step, verdicts[0][1])
        return verdicts[0][2]

    def _gather(self, mine) -> list:
        """Every rank's `mine`, by rank: one collective."""
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def _first_fault(self, mine: Optional[str]) -> Optional[str]:
        """The lowest rank's fault (None when no rank has one), the same on every rank."""
        fault = next(((r, v) for r, v in enumerate(self._gather(mine)) if v), None)
        return None if fault is None else fault[1] if fault[0] == 0 else f"rank {fault[0]}: {fault[1]}"

    def _skip(self, step: int, why: str) -> None:
        if self.rank == 0:
            good = store.list_complete(self.root)
            kept = f"the newest complete checkpoint, {good[-1][1]}, is kept" if good else "there is no earlier checkpoint"
            log.warning("checkpoint of step %d not saved: %s; %s", step, why, kept)

    def _abandon(self, tmp: Path, step: int, error: BaseException) -> None:
        """A save failed on some rank (full disk, I/O error): drop its pieces, keep the last good one."""
        cause = _root_cause(error)
        free = store.free_bytes(self.root)
        space = free < 64 << 20
        if space:  # torch's writer hides ENOSPC behind "unexpected pos": name it
            cause = f"No space left on device ({_mb(free)} free under {self.root}; {cause})"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self._fail(step, cause, space)

    def _fail(self, step: int, cause: str, space: bool = True) -> None:
        good = store.list_complete(self.root)
        kept = f"the newest complete checkpoint, {good[-1][1]}, is intact" if good else "there is no earlier checkpoint"
        fix = ("Fix: free space, or point run.dir at a larger file system" if space else
               "If another rank died, its log says why; restarting the run resumes from the intact checkpoint")
        raise SaveFailed(f"saving the checkpoint of step {step} failed: {cause}; {kept}. {fix}") from None

    def _commit(self, p: Pending) -> None:
        # DCP returns on every rank only after the coordinator wrote .metadata: everything is on disk.
        if self.rank == 0:
            final = store.commit(p.tmp, self.root, p.step, p.info)
            # Renamed out of sight now; deleting the bytes takes long and runs beside the training.
            # The checkpoint we resumed from is the newest one known to load: newer ones have only been
            # written, so retention does not delete it on their strength (at most keep + 1 are on disk).
            doomed = store.doom(self.root, self.cfg.keep, protect=(final, self.loaded), keep_every=self.cfg.keep_every)
            self._join_purge()
            self._purge = threading.Thread(target=store.purge, args=(doomed,), name="checkpoint-purge", daemon=True)
            self._purge.start()
        if p.blocking:
            dist.barrier(group=self._pg)  # nobody reads the checkpoint before it is visible
            self.saves.append({"step": p.step, "blocked_s": time.perf_counter() - p.started, "async": False})
        self.last_saved = p.step
        seconds = time.perf_counter() - p.started
        log.info("checkpoint step %d saved (%.2f s)", p.step, seconds)
        if self.rank == 0:  # for people and the run report: how long saves take, and how long they block
            blocked = next((r["blocked_s"] for r in reversed(self.saves) if r["step"] == p.step), seconds)
            append_jsonl(self.run_dir / CHECKPOINT_LOG, {
                "step": p.step, "seconds": round(seconds, 4), "blocked_s": round(blocked, 4),
                "async": not p.blocking, "bytes": store.disk_usage(final), "time": time.time()})

    # --------------------------------------------------------------- loading

    def candidates(self) -> list[tuple[int, Path]]:
        """Complete checkpoints to try, newest first (or only the one checkpoint.load_step names)."""
        complete = store.list_complete(self.root)
        if self.cfg.load_step is not None:
            chosen = [(s, p) for s, p in complete if s == self.cfg.load_step]
            if not chosen:
                have = ", ".join(str(s) for s, _ in complete) or "none"
                raise NoUsableCheckpoint(f"checkpoint.load_step={self.cfg.load_step}: no complete checkpoint "
                                         f"of that step in {self.root} (complete steps: {have})")
            return chosen
        return complete[::-1]

    def resume(self, on_warning: Callable[[str], None]) -> Optional[int]:
        """Load the newest usable checkpoint into every state object; returns its step, or None when
        the run directory holds none. Damaged ones are skipped with a warning naming the fault.
        With memory snapshots (self.memory) and a plan of this generation, the newest snapshot every
        rank has is loaded instead where it is at least as new as the disk's (_resume_memory), and
        rank 0 records which in attempts/<generation>/restored.json."""
        problem = overwrite_problem(self.run_dir, self.cfg.resume)
        if problem:
            raise NoUsableCheckpoint(problem)
        if not self.cfg.resume:
            return None
        if self.memory is None:
            return self._resume_disk(on_warning)
        step, why = self._resume_memory()
        if step is not None:
            return step
        log.info("resuming from disk: %s", why)
        step = self._resume_disk(on_warning)
        self._record({"kind": "disk", "step": step, "why": why})
        return step

    def _resume_memory(self) -> tuple[Optional[int], str]:
        """(step, "") after loading the memory snapshot memory_plan.choose picks, or (None, why not). Every
        rank takes the same branches: the inventories and the verdicts are gathered."""
        from hpctrain.checkpoint.memory_plan import choose, describe

        if self.cfg.load_step is not None:
            return None, f"checkpoint.load_step={self.cfg.load_step} names a disk checkpoint"
        plan = self.memory.plan
        complete = store.list_complete(self.root) if self.rank == 0 else []
        try:
            inventory = self.memory.inventory()
        except OSError as e:  # said by every rank's verdict below: no rank leaves the others in a collective
            inventory = None
            log.warning("memory snapshots unreadable: %s", e)
        # Gathered whatever this rank found: a plan one rank could not read (yet) must not send it alone
        # down the disk path while the others gather here.
        mine = (self.memory.node, inventory, complete[-1][0] if complete else None, plan is not None)
        gathered = self._gather(mine)
        if not all(g[3] for g in gathered):
            return None, "no plan for this generation (attempts/<N>/plan.json) on every rank: memory restore is off"
        if any(g[1] is None for g in gathered):
            return None, "a rank could not list its node's memory snapshots"
        inventories: dict = {}
        for host, inv, _, _ in gathered:
            inventories.setdefault(host, []).extend(inv)
        choice = choose(inventories, self.world, gathered[0][2], plan)
        if choice["kind"] != "memory":
            return None, choice["why"]
        step = choice["step"]
        self._saved_state = None
        state = self._tensor_state()
        loaded, fault = None, None
        try:
            loaded = self.memory.prepare(step, choice["source"][str(self.rank)], plan, state)
        except Exception as e:  # noqa: BLE001 - a rank that raised here would leave the others in the collective
            fault = str(e) if isinstance(e, (DamagedSnapshot, RestoreRefused)) else _first_line(e)
        fault = self._first_fault(fault)
        if fault is None:
            try:
                loaded.apply(self.objects)
            except Exception as e:  # noqa: BLE001 - as above
                fault = f"{loaded.path} could not be loaded: {_first_line(e)}"
            fault = self._first_fault(fault)
            if fault is not None:  # the state is part memory's now: only a complete load may replace it
                self._tainted = fault
        if fault is not None:
            return None, f"the memory snapshot of step {step} is unusable: {fault}"
        self._restore(state)
        loaded.forget_fetched()  # a copy fetched from another node is not kept beside the node's own
        self.last_saved = None  # nothing of this state is on disk
        if self.rank == 0:
            log.info("%s", describe(choice))
        self._record(choice)
        return step, ""

    def _record(self, what: dict) -> None:
        """restored.json of this generation (rank 0): how the resume went, for the supervisor and people."""
        self.restored = what
        if self.rank == 0:
            from hpctrain.core import faults
            from hpctrain.core.rundir import attempt_dir

            d = attempt_dir(self.run_dir, faults.attempt())
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / "restored.json.tmp"
            tmp.write_text(json.dumps(what) + "\n")
            os.replace(tmp, d / "restored.json")

    def _resume_disk(self, on_warning: Callable[[str], None]) -> Optional[int]:
        for path in store.list_incomplete(self.root):
            on_warning(f"ignoring {path}: it is not a complete checkpoint (no {store.DCP_METADATA} or "
                       f"{store.INFO}; a save was interrupted, or files were removed)")
        cands = self.candidates()
        if not cands:
            if self._tainted:
                raise NoUsableCheckpoint(f"a memory restore failed after loading part of the state "
                                         f"({self._tainted}) and {self.root} holds no checkpoint to replace it")
            return None
        self._saved_state = None  # a load may replace tensors
        problems = []
        for step, path in cands:
            self._select(path)  # which tensors it holds (adapters only, or every weight) is its own record's
            state = self._tensor_state()
            wanted = self._all_shapes(expected_shapes(state))
            verdict, plain = self._verify(step, path, wanted)
            if verdict is None:
                try:
                    with _gc_paused():
                        dcp.load(state, storage_reader=SafeReader(str(path)), planner=TensorOnlyLoadPlanner())
                except BaseException as e:  # DCP's CheckpointException is a BaseException
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    verdict = f"loading failed: {_first_line(e)}"
            if verdict is None:  # a NaN loaded would be trained on, and saved again
                bad = first_nonfinite(state)
                verdict = self._first_fault(nonfinite_message(bad, self.rank) if bad else self._load_plain(path, plain))
            if verdict is None:
                self._restore(state)
                self.loaded, self._tainted = path, None
                if problems:
                    on_warning(f"resumed from the older checkpoint {path.name} instead")
                self.last_saved = step
                return step
            msg = f"checkpoint {path} is unusable: {verdict}"
            problems.append(msg)
            on_warning(msg + ("; trying an older one" if (step, path) != cands[-1] else ""))
        raise NoUsableCheckpoint("no usable checkpoint in " + str(self.root) + ":\n  " + "\n  ".join(problems)
                                 + "\nFix: each line says why; a checkpoint of another model or config resumes "
                                   "with that config; to start afresh, use a new run.dir (these checkpoints stay "
                                   "as they are); checkpoint.load_step picks a good one")

    def _select(self, path: Path) -> None:
        """Tell the tensor objects that list what a checkpoint holds (ModelState) its hpctrain.json."""
        try:
            info = read_info(path)
        except DamagedCheckpoint:
            info = None  # _verify says why it is unusable
        for obj in self._tensor_objects().values():
            if hasattr(obj, "select"):
                obj.select(info)

    def _load_plain(self, path: Path, plain: dict) -> Optional[str]:
        """Load the plain states _verify checked (a per-rank one only where it found it) into their
        objects; why one would not take its state, or None. A later checkpoint's load replaces what a
        refused one left, as it does the tensors."""
        for name, state in plain.items():
            try:
                self.objects[name].load_state_dict(state)
            except Exception as e:  # noqa: BLE001 - the state is the checkpoint's; the code loaded its own saves
                where = (path / name / f"rank-{self.rank:05d}.json" if getattr(self.objects[name], "per_rank", False)
                         else f"{path / store.INFO}'s {name}")
                return f"{where} cannot be loaded into this run's {name} ({_first_line(e)})"
        return None

    def _restore(self, tensors: dict) -> None:
        for name, obj in self.objects.items():
            if getattr(obj, "sharded", False):
                obj.load_state_dict(tensors[name])

    def _claims_problem(self, step: int, info: dict) -> Optional[str]:
        """A copied or edited checkpoint claims a step its directory name does not: resuming from it
        would skip training (or repeat it) and let retention delete real checkpoints."""
        recorded = {store.INFO: info.get("step")}
        for name, obj in self.objects.items():
            state = info.get(name)
            if not getattr(obj, "sharded", False) and isinstance(state, dict) and "step" in state:
                recorded[f"{store.INFO}'s {name}"] = state["step"]
        for where, value in recorded.items():
            if type(value) is not int or value != step:
                return (f"{where} says step {value!r}, its directory name says step {step}: it was copied "
                        "or edited by hand")
        return None

    def _all_shapes(self, mine: dict) -> dict:
        """Every rank's expected tensors (pipeline stages and ZeRO-1 owners differ per rank)."""
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        out = {}
        for d in gathered:
            out.update(d)
        return out

    def _verify(self, step: int, path: Path, wanted: dict) -> tuple[Optional[str], dict]:
        """Rank 0 checks the metadata, the files and hpctrain.json's records (which must agree with the
        directory's name, with each other and with the objects they will be loaded into); every rank
        checks its own per-rank files. Returns the first fault (the same on every rank: one collective)
        and the plain states to restore."""
        problem, plain = None, {}
        try:
            if self.rank == 0:
                md = read_metadata(path)
                check_files(path, md)
                check_shapes(md, wanted, tuple(f"{n}." for n, o in self.objects.items() if getattr(o, "exact_keys", False)))
            info = read_info(path)  # every rank: the checks are cheap, and each rank loads what it checked
            claims = self._claims_problem(step, info) or plain_problems(path, info, self.objects)
            if self.rank == 0 and not claims:  # its base read and compared once, on rank 0
                claims = holds_problem(info, self.objects)
            if claims:
                raise DamagedCheckpoint(claims)
            plain = {n: info[n] for n, o in self.objects.items()
                     if not getattr(o, "sharded", False) and not getattr(o, "per_rank", False) and n in info}
            plain.update(self._per_rank_states(path, info))
        except DamagedCheckpoint as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - a rank that raised here would leave the others in the collective
            problem = f"{path} unreadable ({type(e).__name__}: {e})"
        return self._first_fault(problem), plain

    def _per_rank_states(self, path: Path, info: dict) -> dict:
        """This rank's per-rank states, checked; none after a change of world size (ranks no longer
        correspond)."""
        out = {}
        if info["world_size"] != self.world:
            return out
        for name, obj in self.objects.items():
            if not getattr(obj, "per_rank", False):
                continue
            mine = path / name / f"rank-{self.rank:05d}.json"
            if not mine.is_file():
                log.warning("%s is missing: %s not restored", mine, name)
                continue
            state, problem = read_per_rank(mine, obj)
            if problem:
                raise DamagedCheckpoint(problem)
            out[name] = state
        return out


@contextlib.contextmanager
def _gc_paused():
    """No cyclic GC while ranks wait on each other: a full collection in a process holding torch
    takes 0.1-0.4 s, and unpickling DCP's plans and metadata sets one off on one rank while the
    others wait for it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _root_cause(e: BaseException) -> str:
    """DCP wraps each rank's exception; the OSError inside says what actually happened."""
    seen, stack = set(), [e]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError):
            return f"{cur.strerror or cur} ({getattr(cur, 'filename', '') or 'write'})"
        stack.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)
        for failure in (getattr(cur, "failures", None) or {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
            # A failure from another rank arrives as text only: look for the errno there.
            text = "".join(failure[1].format()) if isinstance(failure, tuple) and hasattr(failure[1], "format") else ""
            for known in ("No space left on device", "Disk quota exceeded", "Read-only file system",
                          "Permission denied", "Input/output error"):
                if known in text:
                    return known
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
