"""Replica transfer between node agents: each node's memory snapshots are copied to a partner node, so
that a lost node's ranks can restore from the copy (issue 47). Torch-free: it runs in the node agent.

The node-local memory directory (HPCTRAIN_MEMORY_DIR) holds own/ (snapshots written by the ranks on this
node), peer/ (replicas received from the partner node) and fetched/ (files a rank fetched before loading).
Snapshot files are named snap-s{step:08d}-r{rank:05d}.hsnap; anything else is never sent, served or kept.

Protocol (one request per TCP connection, ASCII header lines, then raw bytes):
    PUT <name> <nbytes> <crc32>\\n <bytes>   ->  OK\\n | ERR <why>\\n
        written to peer/.tmp-<name>-<n>, checked against crc32 (zlib, decimal), os.replace'd to peer/<name>,
        then peer/ is pruned to the 2 newest steps of that rank: complete or absent, as on disk.
    GET <name>\\n                           ->  <nbytes> <crc32>\\n <bytes> | NONE\\n
        served from own/, else peer/.

    server = ReplicaServer(directory); port = server.start(); ...; server.stop()
    pusher = Pusher(directory, partner=lambda: "n2:40002").start(); ...; pusher.stop()
    put("n2:40002", path); get("n2:40002", name, dest) -> bool
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import threading
import zlib
from pathlib import Path
from typing import Callable, Optional

from hpctrain.core import snapfile

log = logging.getLogger("hpctrain.replica")

NAME = snapfile.NAME_RE  # the snapshot files' names: nothing else is sent or stored
KEEP_STEPS = 2  # per rank in peer/: the newest and the one before it (the newest may be mid-replace elsewhere)
MAX_BYTES = 1 << 40  # one rank's snapshot; a larger announced size is a damaged or hostile header
LINE_MAX = 256  # a header line is ~60 characters
CHUNK = 1 << 20
IO_TIMEOUT_S = 30.0  # a peer that sends nothing for this long is dead (a lost node gives no RST)
PUSH_EVERY_S = 0.1


class ReplicaError(OSError):
    """A transfer that did not complete: refused by the peer, cut, or damaged (the message says which)."""


parse_name = snapfile.parse_name  # (step, rank) of a snapshot's name; None for paths, temporaries, foreign files


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"replica address {addr!r} is not HOST:PORT")
    return host, int(port)


def newest_per_rank(folder: Path) -> dict[int, tuple[int, str]]:
    """rank -> (step, name) of the newest complete snapshot file in `folder` ({} when it does not exist)."""
    best: dict[int, tuple[int, str]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return best
    for name in names:
        sr = parse_name(name)
        if sr and (sr[1] not in best or sr[0] > best[sr[1]][0]):
            best[sr[1]] = (sr[0], name)
    return best


def prune(folder: Path, rank: int, keep: int = KEEP_STEPS) -> list[str]:
    """Remove `rank`'s snapshot files in `folder` but those of its `keep` newest steps; returns the removed names."""
    mine = sorted(((sr[0], n) for n in os.listdir(folder) if (sr := parse_name(n)) and sr[1] == rank), reverse=True)
    gone = []
    for _, name in mine[keep:]:
        try:
            os.unlink(folder / name)
            gone.append(name)
        except FileNotFoundError:  # a concurrent prune got it first
            pass
    return gone


def file_crc(fd: int, nbytes: int) -> int:
    """zlib.crc32 of the first nbytes of an open file, read in chunks (pread: the offset stays at 0)."""
    crc, off = 0, 0
    while off < nbytes:
        b = os.pread(fd, min(CHUNK, nbytes - off), off)
        if not b:
            raise ReplicaError(f"file shrank while read: {off} of {nbytes} bytes")
        crc = zlib.crc32(b, crc)
        off += len(b)
    return crc


# ----------------------------------------------------------------------------------------- wire helpers

def _recv_line(sock: socket.socket) -> str:
    """One header line without its newline; byte by byte so that no payload byte is read ahead."""
    buf = bytearray()
    while True:
        b = sock.recv(1)
        if not b:
            raise ReplicaError(f"connection closed after {len(buf)} bytes of a header line")
        if b == b"\n":
            return buf.decode("ascii", "replace")
        buf += b
        if len(buf) > LINE_MAX:
            raise ReplicaError(f"header line longer than {LINE_MAX} bytes")


def _receive(sock: socket.socket, path: Path, nbytes: int, mode: int) -> int:
    """`nbytes` from `sock` into a new file (`mode`: O_EXCL, or O_TRUNC for the caller's own temporary);
    the crc32 of what came."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | mode, 0o600)
    try:
        return _recv_to_file(sock, fd, nbytes)
    finally:
        os.close(fd)


def _recv_to_file(sock: socket.socket, fd: int, nbytes: int) -> int:
    """Copy exactly nbytes from the socket into fd; returns their crc32. Raises when the peer stops early."""
    buf = bytearray(min(CHUNK, max(nbytes, 1)))
    view = memoryview(buf)
    crc, got = 0, 0
    while got < nbytes:
        n = sock.recv_into(view, min(len(buf), nbytes - got))
        if n == 0:
            raise ReplicaError(f"connection closed after {got} of {nbytes} bytes")
        crc = zlib.crc32(view[:n], crc)
        _write_all(fd, view[:n])
        got += n
    return crc


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _send_file(sock: socket.socket, fd: int, nbytes: int) -> None:
    with os.fdopen(os.dup(fd), "rb") as f:  # a dup: closing the file object leaves the caller's fd open
        sent = sock.sendfile(f, 0, nbytes)
    if sent != nbytes:
        raise ReplicaError(f"sent {sent} of {nbytes} bytes")


def _parse_size_crc(fields: list[str], max_bytes: int) -> tuple[int, int]:
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        raise ReplicaError(f"expected '<nbytes> <crc32>', got {' '.join(fields)[:80]!r}")
    nbytes, crc = int(fields[0]), int(fields[1])
    if nbytes > max_bytes:
        raise ReplicaError(f"{nbytes} bytes is over the bound of {max_bytes}")
    if crc >= 1 << 32:
        raise ReplicaError(f"crc32 {crc} does not fit 32 bits")
    return nbytes, crc


# ----------------------------------------------------------------------------------------------- server

class ReplicaServer:
    """Receives the partner node's snapshots into peer/ and serves own/ and peer/ files to other nodes."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = MAX_BYTES, io_timeout_s: float = IO_TIMEOUT_S,
                 bind: str = "0.0.0.0"):
        """`bind`: the address to listen on (the node's own; 127.0.0.1 for a run on one machine)."""
        self.bind = bind
        self.directory = Path(directory)
        self.peer = self.directory / "peer"
        self.max_bytes = max_bytes
        self.io_timeout_s = io_timeout_s
        self.port: Optional[int] = None
        self.received: list[str] = []  # names stored in peer/, in order (tests and logs count them)
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._tmp_ids = itertools.count()
        self._lock = threading.Lock()  # prune and os.replace of peer/ one at a time

    def start(self) -> int:
        self.peer.mkdir(mode=0o700, parents=True, exist_ok=True)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.bind, 0))
        s.listen(16)
        s.settimeout(0.2)  # accept wakes up to see stop()
        self._sock, self.port = s, s.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="replica-server", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._stop.set()
        if self._sock:
            try:  # wakes the blocked accept at once (Linux), rather than at its next 0.2 s timeout
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread:
            self._thread.join(timeout=5)
        if self._sock:
            self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            # One thread per connection: a slow or dead peer never holds up a GET another rank waits on.
            threading.Thread(target=self._handle, args=(conn, peer), name="replica-conn", daemon=True).start()

    def _handle(self, conn: socket.socket, peer) -> None:
        with conn:
            conn.settimeout(self.io_timeout_s)
            try:
                words = _recv_line(conn).split(" ")
                if words[0] == "PUT" and len(words) == 4:
                    reply = self._put(conn, words[1], words[2:])
                elif words[0] == "GET" and len(words) == 2:
                    self._get(conn, words[1])
                    return
                else:
                    reply = f"ERR unknown request {' '.join(words)[:80]!r}"
                conn.sendall((reply + "\n").encode())
            except (OSError, ReplicaError) as e:  # cut, timed out, or the reply could not be sent
                log.warning("replica: request from %s:%s failed: %s", peer[0], peer[1], e)

    def _put(self, conn: socket.socket, name: str, fields: list[str]) -> str:
        sr = parse_name(name)
        if sr is None:
            return f"ERR bad name {name[:80]!r}: not snap-sNNNNNNNN-rNNNNN.hsnap"
        try:
            nbytes, crc = _parse_size_crc(fields, self.max_bytes)
        except ReplicaError as e:
            return f"ERR {e}"
        # A unique temporary per connection: a retry while a cut transfer still times out never shares it.
        tmp = self.peer / f".tmp-{name}-{next(self._tmp_ids)}"
        try:
            got = _receive(conn, tmp, nbytes, os.O_EXCL)
            if got != crc:
                raise ReplicaError(f"crc mismatch: the bytes give {got}, the header says {crc}")
            # The snapshot's own header must say what its name says: a file read while its writer
            # replaced it would otherwise be kept as another step's (restores check it again).
            head = snapfile.read_header(tmp)
            if (head.get("step"), head.get("rank")) != sr:
                raise ReplicaError(f"the file holds step {head.get('step')} of rank {head.get('rank')}, its name "
                                   f"says step {sr[0]} of rank {sr[1]}")
            with self._lock:
                os.replace(tmp, self.peer / name)
                prune(self.peer, sr[1])
                self.received.append(name)
        except (OSError, ReplicaError, snapfile.DamagedSnapshot) as e:
            tmp.unlink(missing_ok=True)
            log.warning("replica: PUT %s refused: %s", name, e)
            return f"ERR {e}"
        return "OK"

    def _get(self, conn: socket.socket, name: str) -> None:
        if parse_name(name) is None:
            conn.sendall(f"ERR bad name {name[:80]!r}\n".encode())
            return
        for sub in ("own", "peer"):
            try:
                # Opened once: a prune or replace after this point cannot change what is sent.
                fd = os.open(self.directory / sub / name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                nbytes = os.fstat(fd).st_size
                conn.sendall(f"{nbytes} {file_crc(fd, nbytes)}\n".encode())
                _send_file(conn, fd, nbytes)
            finally:
                os.close(fd)
            return
        conn.sendall(b"NONE\n")


# ----------------------------------------------------------------------------------------------- client

def _connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = split_addr(addr)
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.settimeout(timeout_s)
    return s


def put(addr: str, path: Path, timeout_s: float = 60) -> None:
    """Send one snapshot file to the replica server at addr (HOST:PORT); raises ReplicaError/OSError unless stored."""
    path = Path(path)
    if parse_name(path.name) is None:
        raise ReplicaError(f"{path.name!r} is not a snapshot file name (snap-sNNNNNNNN-rNNNNN.hsnap)")
    fd = os.open(path, os.O_RDONLY)
    try:
        nbytes = os.fstat(fd).st_size
        crc = file_crc(fd, nbytes)
        with _connect(addr, timeout_s) as s:
            s.sendall(f"PUT {path.name} {nbytes} {crc}\n".encode())
            _send_file(s, fd, nbytes)
            reply = _recv_line(s)
    finally:
        os.close(fd)
    if reply != "OK":
        raise ReplicaError(f"{addr} refused {path.name}: {reply}")


def get(addr: str, name: str, dest: Path, timeout_s: float = 60, why: Optional[list] = None) -> bool:
    """Fetch snapshot `name` from the replica server at addr into dest (complete or absent: written next to it as
    .tmp-, crc-checked, os.replace'd). False when the server has no such file or the transfer failed; the reason
    is logged and appended to `why` when given."""
    dest = Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{threading.get_ident()}"
    try:
        if parse_name(name) is None:
            raise ReplicaError(f"{name!r} is not a snapshot file name")
        with _connect(addr, timeout_s) as s:
            s.sendall(f"GET {name}\n".encode())
            line = _recv_line(s)
            if line == "NONE":
                raise FileNotFoundError(f"{addr} has no {name}")
            if line.startswith("ERR"):
                raise ReplicaError(f"{addr}: {line}")
            nbytes, crc = _parse_size_crc(line.split(" "), MAX_BYTES)
            got = _receive(s, tmp, nbytes, os.O_TRUNC)
        if got != crc:
            raise ReplicaError(f"crc mismatch fetching {name} from {addr}: the bytes give {got}, the header says {crc}")
        os.replace(tmp, dest)
        return True
    except (OSError, ReplicaError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        msg = f"fetching {name} from {addr} failed: {e}"
        log.warning("replica: %s", msg)
        if why is not None:
            why.append(msg)
        return False


# ----------------------------------------------------------------------------------------------- pusher

class Pusher:
    """Every 0.1 s, sends the newest complete own/ file of each rank to the partner node's replica server, once
    per (name, partner address). Older files not yet sent are skipped: only the newest snapshot matters, and a
    slow link must not fall further behind. A failed push is tried again the next round."""

    def __init__(self, directory: str | os.PathLike, partner: Callable[[], Optional[str]],
                 on_pushed: Optional[Callable[[str, str], None]] = None, every_s: float = PUSH_EVERY_S,
                 timeout_s: float = 60):
        self.own = Path(directory) / "own"
        self.partner = partner
        self.on_pushed = on_pushed
        self.every_s = every_s
        self.timeout_s = timeout_s
        # (name, addr) in order, each once; bounded: a long run pushes a file per rank per step
        self.pushed: collections.deque = collections.deque(maxlen=4096)
        self.failures = 0
        self._done: set[tuple[str, str]] = set()
        self._warned: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Pusher":
        self._thread = threading.Thread(target=self._loop, name="replica-pusher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.timeout_s + 5)

    def wait_pushed(self, name: str, timeout_s: float, addr: Optional[str] = None) -> bool:
        """True once `name` was pushed (to `addr`, when given) within timeout_s."""
        def done() -> bool:
            return any(n == name and (addr is None or a == addr) for n, a in self.pushed)
        with self._cond:
            return self._cond.wait_for(done, timeout=timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.push_round()
            except Exception as e:  # the pusher must outlive anything one round meets
                log.warning("replica: push round failed: %s", e)

    def push_round(self) -> None:
        addr = self.partner()
        if not addr:
            return  # no partner (a single node): nothing to replicate to
        newest = [name for _, (_, name) in sorted(newest_per_rank(self.own).items())]
        # Forget what is no longer anybody's newest file: the record stays as small as the folder.
        self._done = {d for d in self._done if d[0] in newest}
        self._warned = {d for d in self._warned if d[0] in newest}
        for name in newest:
            if (name, addr) in self._done or self._stop.is_set():
                continue
            try:
                put(addr, self.own / name, timeout_s=self.timeout_s)
            except FileNotFoundError:
                continue  # pruned by its rank meanwhile: the newer file comes next round
            except (OSError, ReplicaError, ValueError) as e:
                self.failures += 1
                if (name, addr) not in self._warned:  # once, not 10 times a second
                    self._warned.add((name, addr))
                    log.warning("replica: pushing %s to %s failed (trying again): %s", name, addr, e)
                continue
            self._done.add((name, addr))
            with self._cond:
                self.pushed.append((name, addr))
                self._cond.notify_all()
            if self.on_pushed:
                self.on_pushed(name, addr)


# ------------------------------------------------------------------ the node's memory directory

LOCAL_FS = ("tmpfs", "ramfs")


def fs_type(path: str, mounts: str = "/proc/mounts") -> Optional[str]:
    """The file system type of the mount holding `path` (the longest mount point above it)."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return None
    return kind


def memory_root_problem(root: str) -> Optional[str]:
    """Why checkpoint.memory_dir cannot hold snapshots on this node, or None: it must be an existing
    directory on a tmpfs (RAM of this node, gone with it; a shared or disk file system is neither)."""
    if not os.path.isdir(root):
        return f"checkpoint.memory_dir={root} is not a directory on {socket.gethostname()}"
    kind = fs_type(root)
    if kind not in LOCAL_FS:
        return (f"checkpoint.memory_dir={root} is on a {kind or 'unknown'} file system on {socket.gethostname()}, "
                "not a tmpfs: snapshots must be in the node's memory. Fix: checkpoint.memory_dir=/dev/shm")
    return None
