"""Replica transfer between node agents (hpctrain.core.replica): two servers on localhost, real sockets."""
from __future__ import annotations

import os
import socket
import time
import zlib

import pytest

from hpctrain.core import replica
from hpctrain.core.replica import Pusher, ReplicaError, ReplicaServer, get, parse_name, prune, put


def name(step: int, rank: int) -> str:
    return f"snap-s{step:08d}-r{rank:05d}.hsnap"


def snap(step: int, rank: int, payload: bytes = b"") -> bytes:
    """A real snapshot file's bytes (the server reads the header of what it stores)."""
    import tempfile
    from pathlib import Path

    from hpctrain.core import snapfile

    with tempfile.TemporaryDirectory() as d:
        path = snapfile.write(Path(d) / name(step, rank), {"version": snapfile.VERSION, "run": "r", "step": step,
                                                          "rank": rank, "world": 2, "layout": "l", "node": "n1",
                                                          "plain": {}, "scalars": {}},
                              {"w": ("uint8", [len(payload)], payload)} if payload else {})
        return path.read_bytes()


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(label: str):
        d = tmp_path / label
        (d / "own").mkdir(parents=True)
        s = ReplicaServer(d)
        s.start()
        made.append(s)
        return s, d, f"127.0.0.1:{s.port}"

    yield make
    for s in made:
        s.stop()


def wait_until(cond, timeout_s: float = 3.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def request(addr: str, header: bytes, body: bytes = b"", close_early: bool = False) -> str:
    """A raw request; the server's reply line ('' when it closed without one)."""
    host, port = replica.split_addr(addr)
    with socket.create_connection((host, port), timeout=3) as s:
        s.sendall(header + body)
        if close_early:
            return ""
        s.shutdown(socket.SHUT_WR)
        return s.makefile("rb").readline().decode().strip()


def test_put_then_get_is_byte_equal_from_peer_and_own(servers, tmp_path):
    # Mutants: a payload byte read ahead into the header line (byte-by-byte readline replaced by a buffered
    # read); the last chunk dropped; GET looking only in own/ (the replica in peer/ is what a lost node's
    # partner serves).
    _, a_dir, _ = servers("a")
    _, b_dir, b = servers("b")
    data = snap(7, 1, os.urandom(3 * replica.CHUNK + 12345))
    src = a_dir / "own" / name(7, 1)
    src.write_bytes(data)
    put(b, src)
    assert (b_dir / "peer" / name(7, 1)).read_bytes() == data
    dest = tmp_path / "fetched" / name(7, 1)
    dest.parent.mkdir()
    assert get(b, name(7, 1), dest) is True
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == [name(7, 1)]  # no temporary left
    # own/ is served too (a rank's own node answers a fetch for it), and wins over peer/.
    (b_dir / "own" / name(7, 1)).write_bytes(b"own copy")
    assert get(b, name(7, 1), dest) and dest.read_bytes() == b"own copy"


def test_get_of_a_missing_name_is_false_and_writes_nothing(servers, tmp_path):
    # Mutant: NONE parsed as a size line (ValueError escaping, or an empty file written to dest).
    _, _, b = servers("b")
    why: list = []
    assert get(b, name(1, 0), tmp_path / name(1, 0), why=why) is False
    assert list(tmp_path.glob("*hsnap*")) == [] and "has no" in why[0]


def test_get_from_a_dead_address_is_false_with_the_reason(tmp_path):
    # Mutant: get raising on a refused connection (the resume path expects a bool and a reason).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
    why: list = []
    assert get(f"127.0.0.1:{port}", name(1, 0), tmp_path / name(1, 0), timeout_s=2, why=why) is False
    assert "failed" in why[0]


def test_a_transfer_cut_mid_file_leaves_nothing_in_peer(servers):
    # Mutants: the file written straight to peer/<name> (a half file would look complete); the temporary
    # not removed when the sender goes away.
    _, b_dir, b = servers("b")
    peer = b_dir / "peer"
    data = os.urandom(200_000)
    header = f"PUT {name(5, 0)} {len(data)} {zlib.crc32(data)}\n".encode()
    with socket.create_connection(replica.split_addr(b), timeout=3) as s:
        s.sendall(header + data[: len(data) // 2])
        # Mid-transfer: only a temporary exists, which no reader takes for a snapshot.
        assert wait_until(lambda: any(p.name.startswith(".tmp-") for p in peer.iterdir()))
        assert [p.name for p in peer.iterdir() if parse_name(p.name)] == []
    assert wait_until(lambda: not any(peer.iterdir())), list(peer.iterdir())


def test_crc_mismatch_is_refused_and_nothing_kept(servers):
    # Mutant: the crc not compared (the damaged file os.replace'd into peer/).
    _, b_dir, b = servers("b")
    data = b"x" * 1000
    reply = request(b, f"PUT {name(5, 0)} {len(data)} {zlib.crc32(data) ^ 1}\n".encode(), data)
    assert reply.startswith("ERR crc mismatch"), reply
    assert list((b_dir / "peer").iterdir()) == []


@pytest.mark.parametrize("bad", ["../x", "../snap-s00000001-r00000.hsnap", "snap-s1-r0.hsnap",
                                 ".tmp-snap-s00000001-r00000.hsnap", "snap-s00000001-r00000.hsnap.bak",
                                 "/etc/passwd", "snap-s00000001-r00000.hsnap/../../x"])
def test_bad_names_are_refused(servers, tmp_path, bad):
    # Mutants: the name joined to peer/ unchecked (path traversal: ../x lands outside peer/); a regex without
    # its anchors (search instead of a full match lets 'x.bak' or '../snap-...' through).
    _, b_dir, b = servers("b")
    reply = request(b, f"PUT {bad} 3 {zlib.crc32(b'abc')}\n".encode(), b"abc")
    assert reply.startswith("ERR bad name"), reply
    assert request(b, f"GET {bad}\n".encode()).startswith("ERR bad name")
    assert list((b_dir / "peer").iterdir()) == [] and not (tmp_path / "x").exists()
    with pytest.raises(ReplicaError, match="not a snapshot file name"):
        f = tmp_path / "x"
        f.write_bytes(b"abc")
        put(b, f)


@pytest.mark.parametrize("header, words", [
    ("PUT {n} 99999999999999 0\n", "over the bound"),
    ("PUT {n} 3 4294967296\n", "does not fit 32 bits"),
    ("PUT {n} -3 0\n", "expected '<nbytes> <crc32>'"),
    ("DELETE {n}\n", "unknown request"),
])
def test_bad_headers_are_refused_with_the_reason(servers, header, words):
    # Mutants: no bound on nbytes (a damaged header makes the server wait for a terabyte); int() accepting '-3'.
    _, b_dir, b = servers("b")
    reply = request(b, header.format(n=name(1, 0)).encode())
    assert reply.startswith("ERR") and words in reply, reply
    assert list((b_dir / "peer").iterdir()) == []


def test_peer_is_pruned_to_the_two_newest_steps_per_rank(servers, tmp_path):
    # Mutants: prune over all ranks together (rank 1's only files dropped by rank 0's newer steps); keep=1.
    _, b_dir, b = servers("b")
    src = tmp_path / "src"
    src.mkdir()
    for step, rank in [(10, 1), (10, 0), (20, 0), (30, 0), (40, 0)]:
        (src / name(step, rank)).write_bytes(snap(step, rank))
        put(b, src / name(step, rank))
    assert {p.name for p in (b_dir / "peer").iterdir()} == {name(30, 0), name(40, 0), name(10, 1)}
    # The pure function alone, ignoring foreign files.
    (src / "notes.txt").write_text("kept")
    assert sorted(prune(src, 0, keep=1)) == [name(10, 0), name(20, 0), name(30, 0)]
    assert (src / "notes.txt").exists()


def test_parse_name():
    # Mutant: \d+ instead of the fixed widths (two spellings of one step would both be kept).
    assert parse_name(name(12, 3)) == (12, 3)
    assert parse_name("snap-s000000012-r00003.hsnap") is None
    with pytest.raises(ValueError, match="not HOST:PORT"):
        replica.split_addr("n2")


def test_pusher_pushes_the_newest_file_per_rank_once_and_skips_older(servers):
    # Mutants: every own/ file pushed (older ones too); the newest re-pushed every round ((name, partner)
    # not remembered); files sorted by name across ranks (rank 1's newest never chosen).
    _, a_dir, _ = servers("a")
    b_srv, b_dir, b = servers("b")
    own = a_dir / "own"
    for step, rank in [(10, 0), (20, 0), (10, 1)]:
        (own / name(step, rank)).write_bytes(snap(step, rank))
    (own / f".tmp-{name(30, 0)}").write_bytes(b"half")  # being written: never pushed
    p = Pusher(a_dir, partner=lambda: b).start()
    try:
        assert p.wait_pushed(name(20, 0), 3) and p.wait_pushed(name(10, 1), 3)
        (own / name(30, 0)).write_bytes(snap(30, 0))
        assert p.wait_pushed(name(30, 0), 3)
    finally:
        p.stop()
    assert b_srv.received.count(name(10, 1)) == 1  # not again in the round that pushed step 30
    assert name(10, 0) not in b_srv.received
    assert {x.name for x in (b_dir / "peer").iterdir()} == {name(20, 0), name(30, 0), name(10, 1)}
    assert (b_dir / "peer" / name(30, 0)).read_bytes() == snap(30, 0)


def test_pusher_retries_after_a_failure_and_pushes_again_to_a_new_partner(servers):
    # Mutants: a failed push recorded as done (never retried); "once per name" instead of once per
    # (name, partner) (a replacement partner never gets the newest file).
    _, a_dir, _ = servers("a")
    b_srv, b_dir, b = servers("b")
    c_srv, _, c = servers("c")
    (a_dir / "own" / name(3, 0)).write_bytes(snap(3, 0))
    (b_dir / "peer").rmdir()  # the partner refuses for now (ERR: no peer/)
    target = {"addr": b}
    seen = []
    p = Pusher(a_dir, partner=lambda: target["addr"], on_pushed=lambda n, a: seen.append((n, a)), timeout_s=2)
    p.start()
    try:
        assert wait_until(lambda: p.failures >= 1)
        (b_dir / "peer").mkdir()  # the same partner accepts again: the same file goes to it next round
        assert p.wait_pushed(name(3, 0), 3, addr=b)
        target["addr"] = c
        assert p.wait_pushed(name(3, 0), 3, addr=c)
        target["addr"] = None  # no partner: nothing is tried
        failures = p.failures
        time.sleep(0.25)
        assert p.failures == failures
    finally:
        p.stop()
    assert seen == [(name(3, 0), b), (name(3, 0), c)]
    assert b_srv.received == c_srv.received == [name(3, 0)]


def test_a_file_whose_header_says_another_step_is_refused(servers, tmp_path):
    """A snapshot read while its writer replaced it arrives whole (its crc matches) but holds another step:
    kept, a restore of that step would load the wrong state. Mutant: the header not checked against the name."""
    _, b_dir, b = servers("b")
    f = tmp_path / name(8, 1)
    f.write_bytes(snap(11, 1))
    with pytest.raises(ReplicaError, match="holds step 11 of rank 1, its name says step 8 of rank 1"):
        put(b, f)
    f.write_bytes(b"not a snapshot file, but long enough")
    with pytest.raises(ReplicaError, match="is not a memory snapshot"):
        put(b, f)
    assert list((b_dir / "peer").iterdir()) == []
