"""The run directory: fixed at submission, reused by every restart of the run.

<run.dir>/config.yaml   the resolved config, the single source of truth for every rank
<run.dir>/metrics.jsonl one JSON object per logged step
<run.dir>/logs/         per-rank logs
<run.dir>/checkpoints/  step-NNNNNNNN/ sharded checkpoints
<run.dir>/outcome.json  how the last start of the run ended: completed | preempted (resume by rerunning)
<run.dir>/attempts/N/   what the ranks of the run's N-th start said about themselves: where each rank
                        ran, health check results, hang reports and stacks, errors
<run.dir>/attempts.jsonl      one record per start of the ranks (supervisor)
<run.dir>/interruptions.jsonl one record per interruption: cause, ranks, nodes, work lost, recovery

<run.dir>/.hpctrain-output.json  the marker that makes it an hpctrain run directory (hpctrain.core.outdir)
<run.dir>/.lock         held by whoever drives the run (RunLock): one start at a time

A checkpoint is complete or absent: `checkpoints/step-NNNNNNNN/` with DCP's `.metadata` and our
`hpctrain.json` (hpctrain.checkpoint.directories writes it that way). Discovery is here, without torch,
because the login node asks too: it refuses to start over a run's checkpoints unless told to resume.

One run owns its directory. hpctrain writes only into an absent or empty directory or its own run
directory (the marker, or for one from before the marker: hpctrain's config.yaml beside logs/), and a
start is refused while another start of the run holds the lock (docs/failures.md, "One run, one
run directory").
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from hpctrain.core import outdir
from hpctrain.core.compose import ConfigError, to_yaml
from hpctrain.core.hf_format import HFError, read_small
from hpctrain.core.schema import Config


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(cfg: Config) -> Path:
    """Check, create and mark run.dir (own_run_dir), then write logs/ and config.yaml."""
    run_dir = own_run_dir(cfg.run.dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    return run_dir


# ------------------------------------------------------------------------- whose directory it is

RUN_TOOL = "python -m hpctrain"  # the owner a run directory's marker names
LOCK = ".lock"
# What hpctrain writes at the top of a run directory (the marker's list; anything else there is left alone).
RUN_ENTRIES = ("config.yaml", "plan.json", "metrics.jsonl", "logs", "checkpoints", "outcome.json", "attempts",
               "attempts.jsonl", "interruptions.jsonl", "checkpoints.jsonl", "job.sbatch", "chain.sh", "chain.json",
               "submitit", "k8s.yaml", "profile", "tensorboard", "wandb", "mlruns", LOCK)
# Entries the run keeps its own files in: anything but a directory there fails every rank.
RUN_SUBDIRS = {"checkpoints": "checkpoints", "logs": "per-rank logs", "attempts": "per-start reports"}
CONFIG_SECTIONS = {"model", "train", "run", "checkpoint"}  # what any hpctrain config.yaml has at its top


class RunDirError(ConfigError):
    """A run.dir hpctrain may not write into; the message names it and the fix."""


def run_dir_override_problem(overrides: Sequence[str]) -> str | None:
    """An empty run.dir on the command line (`run.dir=`): the config would make it the current
    directory, which is rarely what was meant and may hold anything."""
    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        if eq and key == "run.dir" and not value.strip().strip("'\"").strip():
            return (f"{o!r}: run.dir is empty. Fix: name the run's directory, e.g. run.dir=outputs/<name> "
                    "(run.dir=. for the current directory, if it is empty or a run directory)")
    return None


def from_before_the_marker(run_dir: Path) -> bool:
    """A run directory hpctrain wrote before it marked them: its config.yaml (a mapping with the
    config's sections) beside logs/, the first two things every start wrote."""
    import yaml  # PyYAML, OmegaConf's own reader

    if not (run_dir / "logs").is_dir():
        return False
    try:
        data = yaml.safe_load(read_small(run_dir / "config.yaml", 1 << 20))
    except (HFError, yaml.YAMLError, RecursionError, ValueError):
        return False
    return isinstance(data, dict) and CONFIG_SECTIONS <= set(data)


def layout_problem(run_dir: str | os.PathLike) -> str | None:
    """An entry the run keeps its files in (checkpoints/, logs/, attempts/) that is not a directory."""
    for name, what in RUN_SUBDIRS.items():
        p = Path(run_dir) / name
        if (p.exists() or p.is_symlink()) and not p.is_dir():
            kind = "a broken symbolic link" if not p.exists() else "a file" if p.is_file() else "not a directory"
            return (f"{p} is {kind}, not a directory: the run keeps its {what} there. Fix: move it out of the "
                    f"run directory (hpctrain did not write it), or choose another run.dir")
    return None


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Refuse, before anything is written, a run.dir that is not hpctrain's to write into: a file, a
    directory holding what hpctrain did not write, or one whose checkpoints/ or logs/ is not a directory."""
    problem = layout_problem(run_dir) if Path(run_dir).is_dir() else None
    if problem:
        raise RunDirError(problem)
    try:
        outdir.check_in_place(run_dir, RUN_TOOL, from_before_the_marker)
    except outdir.OutputDirError as e:
        raise RunDirError(f"run.dir={e}") from None


def own_run_dir(run_dir: str | os.PathLike) -> Path:
    """run.dir checked (check_run_dir), created, and marked as an hpctrain run directory before anything
    else is written into it."""
    check_run_dir(run_dir)
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        outdir.mark(path, RUN_TOOL, list(RUN_ENTRIES))
    except OSError as e:  # a file where a parent should be, no permission, a full disk
        raise RunDirError(f"run.dir={run_dir} cannot be created or written ({e.strerror}: {e.filename}). "
                          "Fix: choose a run.dir in a directory you can write to") from None
    return path


# ------------------------------------------------------------------------------ the run's lock
#
# POSIX record locks (fcntl F_SETLK, through fcntl.lockf), not flock(2): Linux NFS clients turn flock into
# them anyway, GPFS keeps them cluster-wide, and Lustre honours both only when mounted with -o flock
# (node-local with -o localflock; ENOSYS without either). A POSIX lock belongs to the process and
# goes when the process closes ANY descriptor of the file: the holder never opens the lock file a
# second time (_HELD answers for it), and its children (ranks) never inherit it.

HEARTBEAT_S = 30.0  # the holder touches the lock file this often
STALE_S = 300.0  # a holder seen by its record alone, on another host, silent this long is taken to be gone
UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP}
_HELD: dict[str, "RunLock"] = {}  # realpath of run.dir -> the lock this process holds on it


class RunDirBusy(RunDirError):
    """Another start of the run holds its directory's lock."""


def slurm_job(env: Mapping[str, str]) -> str | None:
    """The Slurm job a process runs in: `<array job>_<task>` for an array task (its own job, whose
    plain id would name the whole array), else the job id; None outside Slurm."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat), to tell it from a later
    process given the same pid; None where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def own_record(env: Mapping[str, str]) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": process_start(pid), "job": slurm_job(env),
            "restarts": int(env.get("SLURM_RESTART_COUNT", "0") or 0), "started": time.time()}


def parse_record(data: bytes) -> dict | None:
    """The holder record a lock file holds; None when it is empty (released) or not one."""
    try:
        rec = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("host"), str) and isinstance(rec.get("pid"), int)
    return rec if ok else None


def earlier_start_of(rec: dict, me: dict) -> bool:
    """`rec` is this Slurm job's own earlier start (before a requeue): Slurm runs one start of a job at
    a time, so that one is over."""
    return (me.get("job") is not None and rec.get("job") == me["job"]
            and isinstance(rec.get("restarts"), int) and rec["restarts"] < me["restarts"])


def holder_alive(rec: dict, heartbeat_age_s: float, me: dict) -> bool:
    """Does the holder `rec`, seen by its record (not by a lock), still run? On this host its pid answers
    (the same process, by its start time); on another its heartbeat (the lock file's mtime) is recent."""
    if earlier_start_of(rec, me):
        return False
    if rec["host"] == me["host"]:
        try:
            os.kill(rec["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive
            pass
        start = process_start(rec["pid"])
        return rec.get("pid_start") is None or start is None or start == rec["pid_start"]
    return heartbeat_age_s < STALE_S


def describe_holder(rec: dict) -> str:
    job = f", Slurm job {rec['job']}" if rec.get("job") else ""
    since = (f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec['started']))}"
             if isinstance(rec.get("started"), (int, float)) else "")
    return f"host {rec['host']}, pid {rec['pid']}{job}{since}"


def busy_message(run_dir: Path, rec: dict | None, heartbeat_age_s: float | None = None) -> str:
    """Why a start is refused: who holds run_dir, and what to do. `heartbeat_age_s`: the holder was
    found by its record alone (no lock seen), its heartbeat that old."""
    who = describe_holder(rec) if rec else "a process that has not written its record yet"
    if rec and rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname():
        who += " (this process)"
    seen = ""
    if rec and heartbeat_age_s is not None:
        seen = ("; seen by its record, whose process still runs on this host" if rec["host"] == socket.gethostname()
                else f"; seen by its record, its last heartbeat {heartbeat_age_s:.0f} s ago: its lock is not seen from "
                     "this host (the file system's locks are node-local, or it has none). If that start is gone (its "
                     f"node lost), remove {run_dir / LOCK}, or wait until its heartbeat is {STALE_S:.0f} s old")
    stop = f"kill {rec['pid']} on {rec['host']}" if rec else "stop it"
    if rec and rec.get("job"):
        stop += f", or scancel {rec['job']}"
    return (f"run.dir={run_dir} is in use by another start of this run ({who}{seen}), which holds "
            f"{run_dir / LOCK}. Two starts on one run directory delete each other's checkpoints and resume from "
            f"each other's. Fix: wait for it to end, or stop it ({stop}) and run this again to resume; or give "
            f"this start another run.dir")


class RunLock:
    """The exclusive lock on a run directory, held by whoever drives the run (the launcher's process,
    the Slurm job's supervisor) for the run's whole life: restarts within a job keep it, a requeued
    job takes it again. `take` refuses while another holds it (RunDirBusy, naming the holder); a
    record left by a holder that is gone (crashed, killed) is taken over with a note. Where the file
    system has no working locks, the holder record alone decides, with a warning; where its locks are
    node-local, the record of a holder on another host still counts while its heartbeat is fresh."""

    def __init__(self, run_dir: Path, fd: int, record: dict, locked: bool):
        self.run_dir, self.fd, self.record, self.locked = run_dir, fd, record, locked
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="hpctrain-run-lock")
        self._beat.start()

    @classmethod
    def take(cls, run_dir: str | os.PathLike, env: Mapping[str, str] | None = None, wait_s: float = 0.0,
             poll_s: float = 1.0) -> "RunLock":
        """Lock `run_dir` (which exists and is hpctrain's). `wait_s`: how long to wait for a holder that
        may be gone (wait_for_lock); 0: refuse at once."""
        run_dir = Path(run_dir)
        env = os.environ if env is None else env
        key = os.path.realpath(run_dir)
        if key in _HELD:
            raise RunDirBusy(busy_message(run_dir, _HELD[key].record))
        fd = open_lock_file(run_dir)
        try:
            me = own_record(env)
            locked, previous = wait_for_lock(fd, run_dir, me, wait_s, poll_s)
            stale = previous if previous and (previous["pid"], previous["host"]) != (me["pid"], me["host"]) else None
            orphans = running_ranks(run_dir, me["host"]) if stale else []
            if orphans:  # its driver was killed (SIGKILL); its ranks, in sessions of their own, go on
                raise RunDirBusy(
                    f"run.dir={run_dir}: the start that held {run_dir / LOCK} ({describe_holder(stale)}) is gone, "
                    f"but its ranks still run here (pids {', '.join(map(str, orphans))}) and write into the run "
                    f"directory. Fix: stop them (kill {' '.join(map(str, orphans))}), then run this again to resume")
            write_record(fd, me)
            if not locked and read_record(fd) != me:  # another start wrote its record at the same moment
                raise RunDirBusy(busy_message(run_dir, read_record(fd)))
        except OSError as e:  # ESTALE, EIO, a full disk or quota: said, not a traceback
            os.close(fd)
            raise RunDirError(f"{run_dir / LOCK}: the run's lock cannot be taken ({e.strerror or e}). Fix: check "
                              f"the file system of run.dir (space, quota, a stale NFS handle), then run this again") from None
        except BaseException:
            os.close(fd)
            raise
        if stale:
            print(f"hpctrain: note: {run_dir / LOCK} named {describe_holder(stale)}, which no longer holds it "
                  "(it ended without letting go: killed, crashed, or its node lost): taken over", file=sys.stderr,
                  flush=True)
        lock = _HELD[key] = cls(run_dir, fd, me, locked)
        return lock

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)
            except OSError:
                pass  # the next beat tries again; a holder on this host is judged by its pid anyway

    def release(self) -> None:
        """Empty the record (a clean end: the next start has nothing to take over) and let go."""
        if self.fd < 0:
            return
        self._stop.set()
        self._beat.join()  # not touching the descriptor's number once it is closed (and perhaps reused)
        _HELD.pop(os.path.realpath(self.run_dir), None)
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # releases the POSIX lock
        self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def running_ranks(run_dir: Path, host: str) -> list[int]:
    """Ranks of the run's newest start (<attempt dir>/ranks.json) still running on `host`, this one."""
    starts = [p for p in (run_dir / ATTEMPTS).glob("*") if p.name.isdigit()]
    if not starts:
        return []
    try:
        where = json.loads((max(starts, key=lambda p: int(p.name)) / "ranks.json").read_text())
        pids = [int(pid) for rank, pid in where["pids"].items() if where["hosts"].get(rank) == host]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [pid for pid in pids if is_rank(pid)]


def is_rank(pid: int) -> bool:
    """Process `pid` runs and is hpctrain's (its command line says so: a pid may have been reused)."""
    try:
        return b"hpctrain" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def open_lock_file(run_dir: Path) -> int:
    path = run_dir / LOCK
    try:
        # O_NOFOLLOW: a symlink there would have the record written into whatever it points at.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RunDirError(f"{path} cannot be opened as the run's lock file ({e.strerror}). Fix: if it is not "
                          "hpctrain's (a symbolic link, a directory), move it away; else make it writable") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirError(f"{path} is not a regular file, so it cannot be the run's lock file. Fix: move it away")
    return fd


def try_lock(fd: int) -> str:
    """"locked", "busy", or "unsupported" (the file system has no working record locks)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "locked"
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return "busy"
        if e.errno in UNSUPPORTED:
            return "unsupported"
        raise


def wait_for_lock(fd: int, run_dir: Path, me: dict, wait_s: float, poll_s: float) -> tuple[bool, dict | None]:
    """(locked, the record an earlier holder left): `fd` locked (True) or its file system found without
    locks (False, with a warning), and no live holder named in its record. The record counts even where
    the lock was free: with node-local locks (Lustre -o localflock, NFS local_lock) a holder on another
    host is seen only by its heartbeat, and on this host a live holder's pid answers. RunDirBusy while
    another holds it: at once where it surely does (its lock is held, by another Slurm job than this
    one), else after up to `wait_s` for it to go (this job's own earlier start, before a requeue; a
    holder on another host until its heartbeat is STALE_S old)."""
    deadline = time.monotonic() + wait_s
    warned = False
    while True:
        state = try_lock(fd)
        rec = read_record(fd)
        age = heartbeat_age(fd)
        if state == "unsupported" and not warned:
            warned = True
            print(f"hpctrain: warning: the file system of {run_dir} does not support file locks: hpctrain falls "
                  f"back to the holder record in {run_dir / LOCK} (host, pid, a heartbeat every {HEARTBEAT_S:.0f} s), "
                  "which refuses a start while the holder lives but not two started at the same moment. Fix: "
                  "mount it with locks (Lustre: -o flock; NFS: without nolock or local_lock); docs/failures.md",
                  file=sys.stderr, flush=True)
        if state != "busy" and not (rec and holder_alive(rec, age, me)):
            return state == "locked", rec
        if state == "locked":
            fcntl.lockf(fd, fcntl.LOCK_UN)  # not ours while its holder may live
        # Surely another job's: its lock held, its record written and its heartbeat fresh. An empty record is
        # a holder between its lock and its record, or letting go; a silent heartbeat, a lost node's lock that
        # its NFS server keeps to the end of the lease: both waited for.
        sure = state == "busy" and me.get("job") is not None and rec is not None \
            and not earlier_start_of(rec, me) and age < 2 * HEARTBEAT_S
        if sure or time.monotonic() >= deadline:
            raise RunDirBusy(busy_message(run_dir, rec, None if state == "busy" else age))
        time.sleep(poll_s)


def read_record(fd: int) -> dict | None:
    return parse_record(os.pread(fd, 1 << 16, 0))


def write_record(fd: int, rec: dict) -> None:
    data = (json.dumps(rec) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def heartbeat_age(fd: int) -> float:
    return max(0.0, time.time() - os.fstat(fd).st_mtime)


OUTCOME = "outcome.json"


def write_outcome(run_dir: str | os.PathLike, outcome: dict) -> None:
    write_atomic(Path(run_dir) / OUTCOME, json.dumps({k: v for k, v in outcome.items() if v is not None}))


def read_outcome(run_dir: str | os.PathLike) -> dict | None:
    """outcome.json; None when absent or not a JSON object (damaged)."""
    try:
        out = json.loads((Path(run_dir) / OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def clear_outcome(run_dir: str | os.PathLike) -> None:
    try:
        os.unlink(Path(run_dir) / OUTCOME)
    except FileNotFoundError:
        pass


# ----------------------------------------------------------------------------------------- checkpoints

STEP_RE = re.compile(r"^step-(\d{8})$")
INFO = "hpctrain.json"
DCP_METADATA = ".metadata"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return (STEP_RE.match(path.name) is not None and (path / DCP_METADATA).is_file()
            and (path / INFO).is_file())


def list_complete(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def list_incomplete(root: str | os.PathLike) -> list[Path]:
    """`step-*` directories that lack their metadata: damaged after the commit, never loaded."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_RE.match(p.name) and p.is_dir() and not is_complete(p))


def read_info(path: Path) -> dict:
    return json.loads((path / INFO).read_text())


def overwrite_problem(run_dir: str | os.PathLike, resume: bool) -> str | None:
    """Why a run may not start in `run_dir`: it holds checkpoints and checkpoint.resume=false."""
    existing = list_complete(Path(run_dir) / "checkpoints")
    if existing and not resume:
        return (f"{run_dir} already holds checkpoints (newest step {existing[-1][0]}) and "
                "checkpoint.resume=false: refusing to overwrite them. Fix: choose another run.dir, "
                "or drop checkpoint.resume=false to continue that run")
    return None


# ----------------------------------------------------------------------------- restarts

ATTEMPTS = "attempts"
# Errors a rank raises because a peer died, not on its own account (in attempts/N/error-rank-R.json).
ECHOES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
          "NCCL communicator was aborted", "ProcessGroupGloo", "TCPStore", "recvValue", "Timed out waiting")
INTERRUPTIONS = "interruptions.jsonl"
# The cause of an interruption a person asked for (Ctrl-C, kill): not charged to goodput while they wait.
STOPPED = "stopped"
CHECKPOINT_LOG = "checkpoints.jsonl"  # one line per completed save: step, seconds, blocked_s, async, bytes


def attempt_dir(run_dir: str | os.PathLike, attempt: int) -> Path:
    return Path(run_dir) / ATTEMPTS / str(attempt)


# What the records of each run file hold, where the readers (supervisor, reports, goodput) use it:
# field -> kind. A record whose field has another kind is left out as malformed, like a line that is
# not a JSON object: a hand edit or a damaged file costs that line, never the command reading it.
# Kinds: "int", "number" (int or float, NaN allowed: a diverged loss), "finite" (a finite number),
# "str", "ints"/"strings" (lists of them); "!" marks a field every record has, "?" one that may be null.
RECORDS = {
    "metrics.jsonl": {"step": "int!", "time": "finite", "loss": "number", "val_loss": "number", "val_ppl": "number",
                      "step_time_s": "finite", "tokens_per_s": "number", "mfu": "number", "mem_bytes": "number",
                      "tokens": "number", "step_time_min": "number", "step_time_max": "number"},
    "attempts.jsonl": {"start": "finite!", "end": "finite", "attempt": "int", "rc": "int?", "nodes": "strings"},
    INTERRUPTIONS: {"cause": "str!", "detail": "str?", "ranks": "ints", "nodes": "strings", "time": "finite",
                    "attempt": "int", "checkpoint_step": "int", "last_step": "int", "steps_redone": "finite",
                    "failed_at": "finite?", "detect_s": "finite?", "restarted_at": "finite?",
                    "first_step_at": "finite?", "recover_s": "finite?"},
    CHECKPOINT_LOG: {"step": "int!", "seconds": "finite", "blocked_s": "finite", "bytes": "int", "time": "finite"},
}


def _is_kind(v, kind: str) -> bool:
    if kind == "str":
        return isinstance(v, str)
    if kind in ("ints", "strings"):
        return isinstance(v, list) and all(_is_kind(x, {"ints": "int", "strings": "str"}[kind]) for x in v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if kind == "int":
        return isinstance(v, int)
    return kind == "number" or math.isfinite(v)


def json_kind(v) -> str:
    """The JSON name of a parsed value's type, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def record_problem(record, kinds: dict[str, str]) -> str | None:
    """Why `record` (one parsed line) is not a record of the file whose field kinds are `kinds`."""
    if not isinstance(record, dict):
        return f"a JSON {json_kind(record)}, not an object"
    for key, kind in kinds.items():
        base = kind.rstrip("!?")
        if key not in record:
            if kind.endswith("!"):
                return f"no {key!r}"
            continue
        v = record[key]
        if v is None and kind.endswith("?"):
            continue
        if not _is_kind(v, base):
            want = {"int": "a whole number", "number": "a number", "finite": "a finite number", "str": "a string",
                    "ints": "a list of whole numbers", "strings": "a list of strings"}[base]
            return f"{key}={json.dumps(v)[:40]} is not {want}"
    return None


def read_jsonl_checked(path: str | os.PathLike, kinds: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    """(records, skipped) of a JSON-lines file; ([], []) when it is absent or unreadable. `kinds`
    (default: RECORDS for the file's name) says what each field holds. A line that is not JSON, not an
    object, or holds a field of another kind is left out and named in `skipped` as 'file:line: why';
    the last line without its newline (a write in progress, or cut short by a crash) is left out silently."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return [], []
    kinds = RECORDS.get(Path(path).name, {}) if kinds is None else kinds
    out, skipped = [], []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if i < len(lines):  # the last piece has no newline: being written, or cut by a crash
                skipped.append(f"{path}:{i}: not JSON ({line.strip()[:40]!r})")
            continue
        problem = record_problem(record, kinds)
        if problem is None:
            out.append(record)
        else:
            skipped.append(f"{path}:{i}: {problem}")
    return out, skipped


def read_jsonl(path: str | os.PathLike, warn: bool = False) -> list[dict]:
    """The records of a JSON-lines file (see read_jsonl_checked): malformed lines are left out, each
    named on stderr when `warn`."""
    records, skipped = read_jsonl_checked(path)
    if warn:
        warn_skipped(skipped)
    return records


def warn_skipped(skipped: list[str], stream=None) -> None:
    """One stderr line per skipped line (the first 10, then a count)."""
    stream = stream or sys.stderr
    for s in skipped[:10]:
        print(f"warning: {s}; line skipped", file=stream)
    if len(skipped) > 10:
        print(f"warning: {len(skipped) - 10} more malformed lines skipped", file=stream)


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """One line more; a last line left without its newline (a crash mid-write) is ended first, so the
    new record does not join it."""
    end_torn_line(path)
    with open(path, "ab") as f:
        f.write((json.dumps(record) + "\n").encode())


def end_torn_line(path: str | os.PathLike) -> None:
    """End the file's last line if a crash mid-write left it without its newline (no-op otherwise)."""
    try:
        with open(path, "r+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
    except FileNotFoundError:
        pass


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    write_atomic(Path(path), "".join(json.dumps(r) + "\n" for r in records))
