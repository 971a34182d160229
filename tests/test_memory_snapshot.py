"""In-memory snapshots (issue 47, checkpoint.memory_every), the rank side: the snapshot file and its damage,
memory_plan.choose, the writer (slots, pruning, waiting when busy), a restore's checks; and one 2-rank gloo
launch that trains with snapshots, resumes a fresh Trainer in a new process group from memory (losses equal
the uninterrupted run's bit for bit), refuses a damaged copy on one rank as every rank, and prefers a newer
disk checkpoint. The launch runs this file as its worker (`python tests/test_memory_snapshot.py worker`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from hpctrain.core import snapfile
from hpctrain.checkpoint.memory_plan import choose, describe
from hpctrain.core.snapfile import DamagedSnapshot

HEADER = {"version": 1, "run": "abcd1234", "step": 6, "rank": 1, "world": 2, "layout": "L", "node": "n1",
          "plain": {"progress": {"step": 6}}, "scalars": {"optim.x.flag": 3}}


def blob(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


@pytest.fixture
def snap(tmp_path) -> Path:
    return snapfile.write(tmp_path / snapfile.name(6, 1), HEADER,
                          {"a": ("float32", [3, 5], blob(60, 1)), "b": ("int64", [], blob(8, 2)),
                           "empty": ("bfloat16", [0, 4], b"")})


# ---------------------------------------------------------------------------------------------- the file

def test_round_trip(snap):
    """Mutants: an offset not added to the payload's start; the crc not of the payload; a header field lost."""
    assert snap.name == "snap-s00000006-r00001.hsnap" and snapfile.parse_name(snap.name) == (6, 1)
    h = snapfile.verify(snap)
    assert {k: h[k] for k in HEADER} == HEADER
    assert h["_payload"] % snapfile.ALIGN == 0
    views = snapfile.tensor_views(snap, h)
    assert bytes(views["a"]) == blob(60, 1) and bytes(views["b"]) == blob(8, 2) and bytes(views["empty"]) == b""
    assert not [p for p in snap.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("name", [".tmp-snap-s00000006-r00001.hsnap", "snap-s6-r1.hsnap", "snap-s00000006-r00001.hsnap.x",
                                  "../snap-s00000006-r00001.hsnap", "snap-s00000006-r00001.pt"])
def test_other_names_are_not_snapshots(name):
    """Mutant: the regex not anchored (a temporary or a traversal name would be listed and served)."""
    assert snapfile.parse_name(name) is None


def _damaged(path: Path, match: str) -> None:
    with pytest.raises(DamagedSnapshot, match=match) as e:
        snapfile.verify(path)
    assert str(path) in str(e.value)


def test_truncated_payload(snap):
    """Mutant: bounds not checked against the file's size (a cut file read past its end)."""
    os.truncate(snap, snap.stat().st_size - 10)
    _damaged(snap, r"tensor '\w+' ends at payload byte \d+, beyond the file's payload of 118 bytes \(truncated\?\)")


def test_truncated_header_and_preamble(snap):
    os.truncate(snap, 16 + 100)
    _damaged(snap, r"truncated: its header claims \d+ bytes, the file holds 100 after the preamble")
    os.truncate(snap, 9)
    _damaged(snap, "truncated: 9 bytes, shorter than the 16-byte preamble")


def test_bad_magic(snap):
    data = bytearray(snap.read_bytes())
    data[0:8] = b"PK\x03\x04xxxx"
    snap.write_bytes(bytes(data))
    _damaged(snap, "is not a memory snapshot")


def test_oversize_header(snap):
    """Mutant: the header length trusted (a 2**60-byte read)."""
    data = bytearray(snap.read_bytes())
    data[8:16] = (1 << 60).to_bytes(8, "little")
    snap.write_bytes(bytes(data))
    _damaged(snap, "claims 1152921504606846976 bytes, over the limit")


def test_flipped_payload_byte(snap):
    """Mutant: verify skipping the checksum."""
    h = snapfile.read_header(snap)
    data = bytearray(snap.read_bytes())
    data[h["_payload"] + 3] ^= 0x40
    snap.write_bytes(bytes(data))
    _damaged(snap, r"the payload's checksum is [0-9a-f]{8}, its header says [0-9a-f]{8}")


def test_header_lies_about_a_tensor(tmp_path):
    """Mutants: nbytes not compared with the shape; overlapping tensors accepted; an unknown dtype accepted."""
    cases = [({"key": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 8}, "8 bytes for shape"),
             ({"key": "a", "dtype": "pickle", "shape": [4], "offset": 0, "nbytes": 16}, "entry 0 is not"),
             ({"key": "a", "dtype": "float32", "shape": [4], "offset": 1 << 40, "nbytes": 16}, "beyond the file")]
    for i, (entry, match) in enumerate(cases):
        p = tmp_path / f"s{i}"
        p.write_bytes(snapfile.write_header({**HEADER, "tensors": [entry], "payload_crc32": 0}) + bytes(16))
        _damaged(p, match)
    p = tmp_path / "overlap"
    two = [{"key": "a", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16},
           {"key": "b", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}]
    p.write_bytes(snapfile.write_header({**HEADER, "tensors": two, "payload_crc32": 0}) + bytes(64))
    _damaged(p, "'b' at offset 0 overlaps")
    p.write_bytes(snapfile.write_header({**HEADER, "rank": 2, "tensors": [], "payload_crc32": 0}))
    _damaged(p, "rank 2 of 2")


# ---------------------------------------------------------------------------------------------- choose

PLAN = {"rank_nodes": {"0": "n1", "1": "n2"}, "lost": [], "previous_rank_nodes": {"0": "n1", "1": "n2"},
        "previous_ring": ["n1", "n2"]}


def test_choose_newest_complete_step_own_preferred():
    """Mutants: the newest step of any rank (rank 1 has no 8); a peer copy chosen over the own node's."""
    inv = {"n1": [[0, 6, "own"], [0, 8, "own"], [1, 6, "peer"]], "n2": [[1, 6, "own"], [1, 4, "own"], [0, 6, "peer"]]}
    assert choose(inv, 2, None, PLAN) == {"kind": "memory", "step": 6, "source": {"0": "own", "1": "own"}}
    assert choose(inv, 2, 6, PLAN)["kind"] == "memory"  # as new as disk: memory


def test_choose_names_the_peer_node():
    """Rank 1 forked fresh on n3 (n2 lost): its copy is n1's replica. Mutant: "own" for a copy elsewhere."""
    plan = {**PLAN, "rank_nodes": {"0": "n1", "1": "n3"}, "lost": ["n2"], "previous_ring": ["n1", "n2"]}
    inv = {"n1": [[0, 6, "own"], [1, 6, "peer"]], "n3": []}
    c = choose(inv, 2, 4, plan)
    assert c == {"kind": "memory", "step": 6, "source": {"0": "own", "1": "n1"}}
    assert describe(c) == "restored step 6 from memory: rank 1 from the replica on n1"


def test_choose_disk_when_both_copies_lost():
    """Mutant: a rank without any copy ignored (memory chosen with a rank missing)."""
    plan = {"rank_nodes": {"0": "n1", "1": "n4"}, "lost": ["n2", "n3"],
            "previous_rank_nodes": {"0": "n1", "1": "n2"}, "previous_ring": ["n1", "n2", "n3"]}
    c = choose({"n1": [[0, 6, "own"]], "n4": []}, 2, 4, plan)
    assert c["kind"] == "disk" and c["step"] == 4
    assert c["why"] == ("rank 1's snapshots were on n2 (own) and n3 (replica), both lost: resuming from the disk "
                        "checkpoint of step 4")
    assert choose({}, 2, None, None)["why"] == "no memory snapshots on the live nodes: no disk checkpoint: starting from the beginning"


def test_choose_disk_when_disk_is_newer():
    """Mutant: > turned into < (an older memory step preferred to a newer disk checkpoint)."""
    inv = {"n1": [[0, 6, "own"], [1, 6, "own"]]}
    c = choose(inv, 2, 8, PLAN)
    assert c["kind"] == "disk" and c["step"] == 8 and "disk checkpoint of step 8 is newer" in c["why"]


def test_choose_disk_on_world_change():
    """Mutant: the world not compared (shards of 4 ranks loaded into 2)."""
    plan = {**PLAN, "previous_rank_nodes": {str(r): "n1" for r in range(4)}}
    inv = {"n1": [[r, 6, "own"] for r in range(4)]}
    assert choose(inv, 2, 2, plan)["why"].startswith("memory snapshots hold the shards of 4 ranks; the run continues on 2")
    c = choose(inv, 2, 2, None)  # without the plan's word: from the files themselves
    assert c["kind"] == "disk" and "hold the shards of 4 ranks; the run continues on 2" in c["why"]


def test_choose_world_change_names_a_rank_whose_copies_are_all_lost():
    """3 nodes lose n2 and n3 at once and the run goes on on n1 (world 3 -> 1): disk, for the world, and
    the message says rank 1's two copies went with the two nodes (no spare would have saved memory).
    Mutant: the lost copies not looked for when the world changed."""
    plan = {"rank_nodes": {"0": "n1"}, "previous_rank_nodes": {"0": "n1", "1": "n2", "2": "n3"},
            "previous_ring": ["n1", "n2", "n3"], "lost": ["n2", "n3"]}
    inv = {"n1": [[0, 12, "own"], [2, 12, "peer"]]}
    c = choose(inv, 1, 10, plan)
    assert c == {"kind": "disk", "step": 10, "why": "memory snapshots hold the shards of 3 ranks; the run continues "
                 "on 1 (rank 1's snapshots were on n2 (own) and n3 (replica), both lost): resuming from the disk "
                 "checkpoint of step 10"}


def test_choose_is_the_same_whatever_the_order():
    """Every rank computes it: mutant sorting nothing (the first node gathered wins)."""
    a = {"n2": [[1, 6, "own"], [0, 6, "peer"]], "n1": [[0, 6, "peer"], [1, 6, "peer"]]}
    b = dict(reversed(list(a.items())))
    plan = {**PLAN, "rank_nodes": {"0": "n3", "1": "n4"}}
    assert choose(a, 2, None, plan) == choose(b, 2, None, plan) == {"kind": "memory", "step": 6,
                                                                    "source": {"0": "n1", "1": "n1"}}


# ---------------------------------------------------------------------------------------------- the writer

class FakeManager:
    """What MemorySnapshots reads of a CheckpointManager: one sharded object's state dict and plain objects."""

    def __init__(self, run_dir: Path, rank: int = 0, world: int = 1, layout: str = "fsdp"):
        import torch

        self.run_dir, self.rank, self.world, self.total_steps = run_dir, rank, world, 100
        self.meta = {"layout": {"kind": layout}}
        self.w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        self.state = {"model": {"w": self.w, "b16": torch.ones(5, dtype=torch.bfloat16)},
                      "optim": {"w": {"step": torch.tensor(3.0), "flag": 7}}}
        self.progress = types.SimpleNamespace(step=0)
        prog = types.SimpleNamespace(state_dict=lambda: {"step": self.progress.step},
                                     load_state_dict=lambda s: setattr(self.progress, "step", s["step"]))
        self.objects = {"model": types.SimpleNamespace(sharded=True), "progress": prog}
        self.memory = None

    def _tensor_state(self):
        return self.state


def snapshots(tmp_path, **kw):
    from hpctrain.checkpoint.memory import MemorySnapshots

    m = FakeManager(tmp_path / "run", **kw)
    return m, MemorySnapshots(m, tmp_path / "mem", every=2, plan=None)


def take(m, ms, step):
    m.progress.step = step
    m.w.fill_(float(step))
    out = ms.after_step(step)
    ms.wait()
    return out


def test_writer_round_trip_prune_and_close(tmp_path):
    """Snapshots of steps 2..8: own/ keeps this rank's two newest and unlinks the older ones (never
    rewrites them: the agent may be sending one, and would send the new bytes under the old name); a
    restore puts tensors, scalars and plain states back; close leaves complete files only. Mutants: no
    pruning; a pruned file renamed into a slot and rewritten (same inode); close leaving .tmp- slots
    (tmpfs space); scalars not restored."""
    m, ms = snapshots(tmp_path)
    assert ms.after_step(3) == {}  # not due
    take(m, ms, 2)
    first = ms.own / snapfile.name(2, 0)
    held = open(first, "rb")  # the pusher's view of step 2's file
    before = held.read()
    for step in (4, 6, 8):
        assert "snapshot_ms" in take(m, ms, step)
    held.seek(0)
    assert held.read() == before, "a pruned snapshot was rewritten under a reader"
    held.close()
    assert sorted(os.listdir(ms.own)) == [snapfile.name(6, 0), snapfile.name(8, 0)]
    assert ms.inventory() == [[0, 6, "own"], [0, 8, "own"]]
    m.w.fill_(-1.0)
    m.state["optim"]["w"]["flag"] = 0
    m.progress.step = 0
    loaded = ms.prepare(6, "own", None, m.state)
    loaded.apply(m.objects)
    assert m.w.eq(6.0).all() and m.state["optim"]["w"]["flag"] == 7 and m.progress.step == 6
    ms.close()
    assert sorted(os.listdir(ms.own)) == [snapfile.name(6, 0), snapfile.name(8, 0)]
    assert not ms._thread.is_alive()


def test_writer_waits_when_busy(tmp_path, monkeypatch):
    """The writer thread still busy at the next due step: the loop waits for it (counted), and that step
    is snapshotted too: every rank must hold the same steps, or a rank's skip (its shard bigger, its writer
    slower) would leave no step that every rank has. Mutants: skipping the step; not counting the wait."""
    from hpctrain.checkpoint.memory import MemorySnapshots

    m, ms = snapshots(tmp_path)
    gate = threading.Event()
    real = MemorySnapshots._finish
    monkeypatch.setattr(MemorySnapshots, "_finish", lambda self, job: gate.wait(30) and real(self, job))
    assert "snapshot_ms" in ms.after_step(2)
    threading.Timer(0.3, gate.set).start()
    out = ms.after_step(4)  # held until the thread, at the gate, has written step 2
    assert out["snapshot_waited"] == 1 and out["snapshot_ms"] >= 200, out
    ms.wait()
    assert [s for _, s, _ in ms.inventory()] == [2, 4]
    assert take(m, ms, 6) == {"snapshot_ms": pytest.approx(0, abs=1e9), "snapshot_waited": 1}
    ms.close()


def test_close_without_wait_abandons_the_one_in_flight(tmp_path, monkeypatch):
    """After a failure: the snapshot being written is dropped, the thread joined. Mutant: finishing it
    (a half-updated state published as complete)."""
    from hpctrain.checkpoint.memory import MemorySnapshots

    m, ms = snapshots(tmp_path)
    take(m, ms, 2)
    gate = threading.Event()
    real = MemorySnapshots._finish
    monkeypatch.setattr(MemorySnapshots, "_finish", lambda self, job: gate.wait(30) and real(self, job))
    ms.after_step(4)
    threading.Timer(0.2, gate.set).start()  # the thread is in _finish, held: close comes first
    ms.close(wait=False)
    assert os.listdir(ms.own) == [snapfile.name(2, 0)]


def test_restore_refuses_another_layout_and_fetches_from_a_peer(tmp_path, monkeypatch):
    """A snapshot of another sharding at the same world is refused by name; a copy on another node is
    fetched through hpctrain.core.replica.get into fetched/ (a fake here). Mutants: the layout not
    compared; the peer's address not the plan's agent of that node."""
    from hpctrain.checkpoint.memory import MemorySnapshots, RestoreRefused

    m, ms = snapshots(tmp_path)
    take(m, ms, 2)
    ms.close()
    other = FakeManager(tmp_path / "run", layout="ddp")
    ms2 = MemorySnapshots(other, tmp_path / "mem", every=2)
    with pytest.raises(RestoreRefused, match=r"of layout .* \(another sharding of the state\)"):
        ms2.prepare(2, "own", None, other.state)
    ms2.close()

    far = tmp_path / "far"
    far.mkdir()
    os.replace(ms.own / snapfile.name(2, 0), far / snapfile.name(2, 0))
    calls = []

    def get(addr, name, dest, timeout_s=60, why=None):
        calls.append(addr)
        Path(dest).write_bytes((far / name).read_bytes())
        return True

    monkeypatch.setitem(sys.modules, "hpctrain.core.replica", types.SimpleNamespace(get=get))
    ms3 = MemorySnapshots(m, tmp_path / "mem", every=2)
    with pytest.raises(DamagedSnapshot, match="is in none of own/, peer/, fetched/"):
        ms3.prepare(2, "own", None, m.state)
    m.w.fill_(0)
    ms3.prepare(2, "n7", {"agents": {"n7": "n7:4001"}}, m.state).apply(m.objects)
    assert calls == ["n7:4001"] and m.w.eq(2.0).all()
    assert (tmp_path / "mem" / "fetched" / snapfile.name(2, 0)).is_file()
    ms3.close()


# ---------------------------------------------------------------------------------------------- 2 ranks

STEPS = 8
OVERRIDES = ["+experiment=tiny", "launcher.nproc=2", "parallel=fsdp", f"train.steps={STEPS}", "train.global_batch=4",
             "train.micro_batch=2", "data.seq_len=16", "optim.warmup_steps=1", "checkpoint.memory_every=2",
             "checkpoint.every=0", "train.log_every=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """One launch of 2 gloo ranks (this file as the worker); rank 0's JSON of what happened."""
    root = tmp_path_factory.mktemp("memory2")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(root), str(port)],
                              env=dict(os.environ, RANK=str(r), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:  # a rank left waiting in a collective its peer never joins
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return {**json.loads((root / "out.json").read_text()), "root": root}


@pytest.mark.slow
def test_resume_from_memory_is_bit_identical(two_ranks):
    """Trained to step 5 (snapshots at 2, 4; a failure at 5), then a new process group and Trainer in the same
    processes resume from memory at step 4 and train on: the losses equal an uninterrupted run's exactly.
    Mutants: the RNG (checked apart), data position, optimizer step counters or scheduler not restored; a
    DTensor's shard copied into a temporary instead of the parameter; the snapshot taken before the step."""
    r = two_ranks
    assert r["gen0"] == r["full"][:4]  # (step 5 failed before its row was written)
    assert r["restored2"] == {"kind": "memory", "step": 4, "source": {"0": "own", "1": "own"}}
    assert r["gen2_start"] == 4
    assert r["gen2"] == r["full"][4:], "bit-identical after a memory restore"
    assert r["gen2_rng_restored"] == [True, True]  # (the tiny model draws no random numbers while training)
    rows = r["full_rows"]
    assert [s for s, ms, _ in rows if ms is not None] == [2, 4, 6]  # not the last step: the run ends there
    assert all(ms >= 0 for _, ms, _ in rows if ms is not None)


@pytest.mark.slow
def test_damaged_copy_on_one_rank_falls_back_on_every_rank(two_ranks):
    """Rank 1's snapshot of step 4 with a flipped byte: one verdict for all ranks, disk (none here: the start),
    the reason in restored.json. Mutant: each rank deciding alone (rank 0 on memory, rank 1 on disk)."""
    r = two_ranks
    assert r["restored1"]["kind"] == "disk" and r["restored1"]["step"] is None
    assert "rank 1:" in r["restored1"]["why"] and "checksum" in r["restored1"]["why"]
    assert r["gen1_steps"] == [0, 0]


@pytest.mark.slow
def test_newer_disk_checkpoint_wins(two_ranks):
    """The run ended with a disk checkpoint of step 8; memory holds 6: disk. Mutant: memory always preferred."""
    r = two_ranks
    assert r["restored3"]["kind"] == "disk" and r["restored3"]["step"] == STEPS
    assert "disk checkpoint of step 8 is newer than the newest memory snapshot every rank has (step 6)" in r["restored3"]["why"]
    assert r["gen3_start"] == STEPS


def _worker(root: Path, port: int) -> None:
    """Each rank: generations of one run in one process, each with a new process group on one TCPStore,
    as the in-process restart does. gen 0 fails at step 5; gen 1 finds rank 1's copy damaged; gen 2 resumes
    from memory; gen 3 finds a newer disk checkpoint. A separate run trains uninterrupted."""
    import base64
    import shutil

    import torch
    import torch.distributed as dist

    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    rank, world = int(os.environ["RANK"]), 2
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    host = socket.gethostname()
    out: dict = {}

    def generation(g: int, run: Path, mem: Path, fault: str = "") -> Trainer:
        os.environ.update(HPCTRAIN_ATTEMPT=str(g), HPCTRAIN_MEMORY_DIR=str(mem), HPCTRAIN_FAULT=fault)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{run.name}-gen{g}", store), rank=rank,
                                world_size=world)
        if rank == 0 and g:  # the supervisor's plan: the same nodes, everybody survived
            plan = {"generation": g, "world": world, "rank_nodes": {"0": host, "1": host}, "agents": {},
                    "ring": [host], "lost": [], "previous_rank_nodes": {"0": host, "1": host},
                    "previous_ring": [host], "survivors": [0, 1]}
            (run / "attempts" / str(g)).mkdir(parents=True, exist_ok=True)
            (run / "attempts" / str(g) / "plan.json").write_text(json.dumps(plan))
        dist.barrier()
        return Trainer.of(cfg(run), str(run), torch.device("cpu"))

    def end(t: Trainer, wait: bool = True) -> None:
        t.close(wait=wait)
        dist.barrier()
        dist.destroy_process_group()

    cfgs: dict = {}

    def cfg(run: Path):
        if run not in cfgs:
            cfgs[run] = compose([*OVERRIDES, f"run.dir={run}"])
        return cfgs[run]

    full, run = root / "full", root / "run"
    for d in (full, run):
        d.mkdir(exist_ok=True)
    t = generation(0, full, root / "mem-full")
    out["full"] = t.fit().losses
    end(t)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    out["full_rows"] = [[r["step"], r.get("snapshot_ms"), r.get("snapshot_waited")] for r in rows]

    t = generation(0, run, root / "mem", fault="raise:step=5,attempt=0")
    try:
        t.fit()
        raise AssertionError("the injected failure at step 5 did not happen")
    except RuntimeError as e:
        assert "injected failure at step 5" in str(e), e
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()] if rank == 0 else []
    out["gen0"] = losses
    end(t)  # the step-4 snapshot complete on both ranks (a survivor would close(wait=False) after a real failure)

    damaged = root / "mem-damaged"  # gen 1: a copy of the node's memory with one byte of rank 1's step 4 flipped
    if rank == 0:
        shutil.copytree(root / "mem", damaged)
        f = damaged / "own" / snapfile.name(4, 1)
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    t = generation(1, run, damaged)
    t.resume(print)
    steps = [None] * world
    dist.all_gather_object(steps, t.step)
    out["gen1_steps"] = steps
    end(t)

    t = generation(2, run, root / "mem")
    torch.manual_seed(1234 + rank)  # this process's generators moved on since step 4: the restore must set them
    resume, seen = t.resume, {}

    def resume_and_look(warn):
        resume(warn)
        seen["rng"] = torch.get_rng_state().numpy().tobytes()

    t.resume = resume_and_look
    res = t.fit()  # resumes from memory at 4, trains to 8, saves the end on disk (checkpoint.final)
    header = snapfile.read_header(root / "mem" / "own" / snapfile.name(4, rank))
    mine = seen["rng"] == base64.b64decode(header["plain"]["rng"]["torch_cpu"])
    rng = [None] * world
    dist.all_gather_object(rng, mine)
    out["gen2_rng_restored"] = rng
    out["gen2_start"], out["gen2"] = t.resumed_from, res.losses
    end(t)

    t = generation(3, run, root / "mem")
    t.resume(print)
    out["gen3_start"] = t.step
    end(t)
    for g in (1, 2, 3):
        out[f"restored{g}"] = json.loads((run / "attempts" / str(g) / "restored.json").read_text())
    if rank == 0:
        (root / "out.json").write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may still be up


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    _worker(Path(sys.argv[2]), int(sys.argv[3]))


def test_a_fifo_or_a_link_is_not_read_as_a_snapshot(tmp_path):
    """A FIFO under a snapshot's name would block the reader forever; a symbolic link could point anywhere.
    Mutant: a plain open() (the FIFO hangs the test; the link is followed)."""
    real = tmp_path / "real.hsnap"
    real.write_bytes(b"x" * 64)
    fifo = tmp_path / snapfile.name(1, 0)
    os.mkfifo(fifo)
    with pytest.raises(DamagedSnapshot, match="is not a regular file"):
        snapfile.read_header(fifo)
    link = tmp_path / snapfile.name(2, 0)
    link.symlink_to(real)
    with pytest.raises(DamagedSnapshot, match="unreadable"):
        snapfile.read_header(link)
