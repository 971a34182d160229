"""One run owns its run.dir (hpctrain.core.rundir): a second start on a directory whose lock another start
holds is refused at once with the holder's host and pid, and the first runs on as if alone; a lock left by
a process that is gone is taken over with a note (unless that start's ranks still run); without working
file locks the holder record decides. An empty run.dir, a user's directory, or a checkpoints/ or logs/
that is not a directory is refused before anything is written, and the user's files stay byte for byte."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.core import rundir
from hpctrain.core.compose import compose, to_yaml
from hpctrain.core.outdir import MARKER
from hpctrain.core.rundir import LOCK, RunDirBusy, RunDirError, RunLock, check_run_dir, own_run_dir, read_jsonl
from hpctrain.launch.supervise import supervise

from helpers import REPO, run_cli, run_main, wait_until

COMMON = ("+experiment=tiny", "train.steps=4", "checkpoint.every=2", "optim.warmup_steps=1")
HOST = socket.gethostname()
USERS = {"config.yaml": b"my own config\n", "plan.json": b'{"mine": true}\n', "outcome.json": b"{}\n",
         "notes.txt": b"do not lose\n"}


def files(d: Path) -> dict[str, bytes]:
    """Every entry of `d` (recursively) and the bytes of its files."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(d.rglob("*"))}


def users_dir(d: Path, entries: dict[str, bytes] = USERS) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in entries.items():
        (d / name).write_bytes(data)
    return files(d)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def write_lock(d: Path, **record) -> None:
    (d / LOCK).write_text(json.dumps({"host": HOST, "started": time.time() - 60, **record}))


HOLD = """
import sys, time
from hpctrain.core.rundir import RunLock
lock = RunLock.take(sys.argv[1])
print("held", flush=True)
if sys.argv[2] == "stdin":
    sys.stdin.read()
else:
    time.sleep(float(sys.argv[2]))
lock.release()
"""


def holder(d: Path, hold: str = "stdin", env: dict | None = None) -> subprocess.Popen:
    """Another process holding d's lock (until its stdin closes, or for `hold` seconds)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d), hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, **(env or {})}, cwd=REPO)
    assert p.stdout.readline().strip() == "held"
    return p


def prepared(d: Path) -> dict[str, bytes]:
    """What python -m hpctrain writes before it starts the ranks (they write the rest)."""
    return {name: (d / name).read_bytes() for name in ("config.yaml", "plan.json", MARKER)}


def losses(d: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(d / "metrics.jsonl")]


# ----------------------------------------------------------------------------------- two starts


@pytest.mark.slow
def test_a_second_start_is_refused_and_the_first_finishes_as_if_alone(tmp_path):
    """Two starts on one run.dir: the second (with another learning rate, so that any file of its own in
    the directory would change the first's numbers) is refused before it writes anything, naming the
    holder's host and pid; the first ends bit for bit like the same command alone in another directory.
    Mutants: no lock in python -m hpctrain (the second starts too), the lock taken after config.yaml is
    written (the first's files change)."""
    alone = tmp_path / "alone"
    run_cli(*COMMON, f"run.dir={alone}")
    shared = tmp_path / "shared"
    out = tmp_path / "first.out"
    with open(out, "w") as f:
        first = subprocess.Popen([sys.executable, "-m", "hpctrain", *COMMON, f"run.dir={shared}"], cwd=REPO,
                                 stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        # The lock is taken before config.yaml and plan.json are written: once the plan is said, it is held.
        wait_until(lambda: "plan: " in out.read_text() or first.poll() is not None, "the first start's plan", 300)
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock, whatever the machine's load, until it goes on
        before = prepared(shared)
        second = run_cli(*COMMON, "optim.lr=0.5", f"run.dir={shared}", check=False)
        os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"run.dir={shared} is in use by another start of this run (host {HOST}, pid {first.pid}" in second.stderr
        assert f"kill {first.pid} on {HOST}" in second.stderr and "Traceback" not in second.stderr
        assert "plan: " not in second.stdout
        assert prepared(shared) == before  # the first's config.yaml, plan.json and marker, untouched
        assert first.wait(timeout=600) == 0, out.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.wait()
    assert losses(shared) == losses(alone) and len(losses(alone)) == 4
    assert len(read_jsonl(shared / "attempts.jsonl")) == 1  # the second never started ranks there
    assert (shared / LOCK).read_bytes() == b""  # let go at the end: nothing for the next start to take over


# ----------------------------------------------------------------------------------------- the lock


def test_a_live_holder_is_named_by_the_lock_the_supervisor_and_the_login_node(tmp_path, capsys):
    """The lock is a real one between processes. Mutant: try_lock saying "locked" when it is busy."""
    d = own_run_dir(tmp_path / "run")
    (d / "config.yaml").write_text(to_yaml(compose(["+experiment=tiny", f"run.dir={d}"])))
    (d / "logs").mkdir()
    p = holder(d)
    try:
        with pytest.raises(RunDirBusy, match=f"host {HOST}, pid {p.pid}, since "):
            RunLock.take(d)
        assert supervise(d) == 2
        assert f"pid {p.pid}" in capsys.readouterr().err
        before = files(d)
        proc = run_main("hpctrain", "+experiment=tiny", "launcher=sbatch", f"run.dir={d}")
        assert proc.returncode == 2 and f"pid {p.pid}" in proc.stderr
        assert files(d) == before  # no job.sbatch, config.yaml as it was: refused before submitting
    finally:
        p.kill()
        p.wait()
    # Killed without letting go: its record is left, the lock is free.
    with RunLock.take(d) as lock:
        assert lock.locked and lock.record["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"named host {HOST}, pid {p.pid}" in err and "taken over" in err


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path, capsys):
    """Mutant: any record taken for a holder (a crashed run could never be resumed)."""
    d = own_run_dir(tmp_path / "run")
    pid = dead_pid()
    write_lock(d, pid=pid, job="4242")
    lock = RunLock.take(d)
    try:
        assert lock.record["pid"] == os.getpid()
        err = capsys.readouterr().err
        assert f"note: {d / LOCK} named host {HOST}, pid {pid}, Slurm job 4242" in err and "taken over" in err
    finally:
        lock.release()
    assert (d / LOCK).read_bytes() == b""


def test_this_process_cannot_take_its_own_lock_twice(tmp_path):
    """POSIX locks belong to the process: a second take here would succeed, and closing it would drop the
    first. Mutant: no _HELD check."""
    d = own_run_dir(tmp_path / "run")
    with RunLock.take(d):
        with pytest.raises(RunDirBusy, match=r"pid \d+, since .*\(this process\)"):
            RunLock.take(d)
        p = subprocess.run([sys.executable, "-c", HOLD, str(d), "0"], capture_output=True, text=True, cwd=REPO)
        assert p.returncode != 0 and "is in use by another start" in p.stderr  # still held for others
    RunLock.take(d).release()


def test_a_lock_file_that_cannot_be_written_is_said_not_a_traceback(tmp_path, monkeypatch):
    """A full disk, a quota or a stale NFS handle while the record is written: a message naming the lock
    file and what to check, and the lock left free. Mutant: the OSError let through."""
    d = own_run_dir(tmp_path / "run")

    def full(fd, rec):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(rundir, "write_record", full)
    with pytest.raises(RunDirError, match=r"\.lock: the run's lock cannot be taken \(Disk quota exceeded\)\. Fix: "):
        RunLock.take(d)
    monkeypatch.undo()
    RunLock.take(d).release()  # nothing held on


def test_a_dead_holders_ranks_still_running_are_named(tmp_path):
    """A driver killed with SIGKILL leaves its ranks running (sessions of their own): its lock is free,
    its ranks still write. Mutant: no running_ranks check."""
    d = own_run_dir(tmp_path / "run")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "hpctrain.run"])
    try:
        (d / "attempts" / "3").mkdir(parents=True)
        (d / "attempts" / "3" / "ranks.json").write_text(json.dumps({"hosts": {"0": HOST, "1": "elsewhere"},
                                                                     "pids": {"0": rank.pid, "1": 1}}))
        gone = dead_pid()
        write_lock(d, pid=gone)
        for _ in range(2):  # the record stays for the next try to find
            with pytest.raises(RunDirBusy, match=f"its ranks still run here \\(pids {rank.pid}\\).*Fix: stop them "
                                                 f"\\(kill {rank.pid}\\)"):
                RunLock.take(d)
        assert json.loads((d / LOCK).read_text())["pid"] == gone
    finally:
        rank.kill()
        rank.wait()
    RunLock.take(d).release()  # gone now: taken over


def test_a_requeued_job_waits_for_its_own_earlier_start(tmp_path, monkeypatch):
    """The requeued job's supervisor finds the lock still held by the job's earlier start (NFS lets go at
    the end of the lease): it waits for it, and refuses another job's at once. Mutants: no wait; a wait
    for any holder."""
    d = own_run_dir(tmp_path / "run")
    p = holder(d, env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        def no_wait(_s):
            raise AssertionError("waited for another job's lock")
        with monkeypatch.context() as m, pytest.raises(RunDirBusy, match="Slurm job 77"):
            m.setattr(rundir.time, "sleep", no_wait)  # another job: at once, however long it may wait
            RunLock.take(d, env={"SLURM_JOB_ID": "78"}, wait_s=600)
        p.stdin.close()  # the earlier start ends while this one waits for it
        with RunLock.take(d, env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, wait_s=600, poll_s=0.05) as lock:
            assert lock.locked and lock.record["restarts"] == 1
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("seen", ["letting go", "silent"])
def test_another_jobs_lock_is_waited_for_while_its_holder_may_be_gone(tmp_path, monkeypatch, seen):
    """Held by another Slurm job, but with its record emptied (a holder letting go, or between its lock
    and its record) or its heartbeat silent (a lost node's lock kept to the end of the NFS lease): waited
    for, not refused at once (CI saw the first). Mutants: an empty record counted as surely busy; the
    heartbeat's age ignored."""
    d = own_run_dir(tmp_path / "run")
    p = holder(d, env={"SLURM_JOB_ID": "77"})
    try:
        if seen == "letting go":
            monkeypatch.setattr(rundir, "read_record", lambda fd: None)
        else:
            monkeypatch.setattr(rundir, "heartbeat_age", lambda fd: 10 * rundir.HEARTBEAT_S)
        sleep = rundir.time.sleep

        def holder_ends(s):  # the first wait: the holder goes
            p.stdin.close()
            p.wait()
            sleep(s)
        monkeypatch.setattr(rundir.time, "sleep", holder_ends)
        with RunLock.take(d, env={"SLURM_JOB_ID": "78"}, wait_s=60, poll_s=0.01) as lock:
            assert lock.locked
    finally:
        p.kill()
        p.wait()


def test_with_node_local_locks_another_hosts_fresh_record_still_counts(tmp_path):
    """Lustre -o localflock or NFS local_lock: the lock is free here while a start on another node holds
    its own. Its record, refreshed by its heartbeat, still refuses; once silent for STALE_S it is taken
    over. Mutant: the record ignored whenever the lock was free."""
    d = own_run_dir(tmp_path / "run")
    write_lock(d, host="node-17", pid=1, job="900")
    with pytest.raises(RunDirBusy, match=r"host node-17, pid 1, Slurm job 900.*its last heartbeat \d+ s ago: its lock "
                                         r"is not seen from this host.*Fix: wait for it to end, or stop it \(kill 1 "
                                         r"on node-17, or scancel 900\)"):
        RunLock.take(d)
    old = time.time() - rundir.STALE_S - 60
    os.utime(d / LOCK, (old, old))
    with RunLock.take(d) as lock:
        assert lock.locked


# -------------------------------------------------------------------- without working file locks


@pytest.fixture
def no_locks(monkeypatch, capsys):
    """A file system whose lock call fails as unsupported (Lustre without -o flock: ENOSYS)."""
    def lockf(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(rundir.fcntl, "lockf", lockf)
    yield
    assert "does not support file locks" in capsys.readouterr().err


def test_without_file_locks_a_live_holder_on_this_host_is_refused(tmp_path, no_locks):
    """Mutant: the fallback ignoring the record."""
    d = own_run_dir(tmp_path / "run")
    live = subprocess.Popen(["sleep", "600"])
    try:
        write_lock(d, pid=live.pid, pid_start=rundir.process_start(live.pid))
        with pytest.raises(RunDirBusy, match=f"host {HOST}, pid {live.pid}"):
            RunLock.take(d)
        # The same pid, another process (the start time differs): the pid was reused, the holder is gone.
        write_lock(d, pid=live.pid, pid_start=rundir.process_start(live.pid) - 1)
        lock = RunLock.take(d)
        assert not lock.locked and json.loads((d / LOCK).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        live.kill()
        live.wait()
    write_lock(d, pid=dead_pid())
    RunLock.take(d).release()


def test_without_file_locks_another_hosts_holder_counts_while_its_heartbeat_is_fresh(tmp_path, no_locks):
    """Mutant: the fallback taking any other host's record for alive (or for gone)."""
    d = own_run_dir(tmp_path / "run")
    write_lock(d, host="node-17", pid=1, job="900")
    with pytest.raises(RunDirBusy, match=r"host node-17, pid 1, Slurm job 900.*its last heartbeat \d+ s ago"):
        RunLock.take(d)
    old = time.time() - rundir.STALE_S - 60
    os.utime(d / LOCK, (old, old))
    RunLock.take(d).release()
    # A requeued job's own earlier start (Slurm runs one at a time): gone, whatever its heartbeat.
    write_lock(d, host="node-17", pid=1, job="900", restarts=0)
    with RunLock.take(d, env={"SLURM_JOB_ID": "900", "SLURM_RESTART_COUNT": "1"}) as lock:
        assert not lock.locked


# ------------------------------------------------------------------------------ whose directory


def test_an_empty_run_dir_is_refused_with_the_key(tmp_path, monkeypatch):
    """`run.dir=` would be the current directory. Mutant: no run_dir_override_problem in python -m
    hpctrain (the dry run then succeeds in the current directory)."""
    monkeypatch.chdir(tmp_path)
    for argv in (["run.dir=", "dry_run=true"], ["run.dir=''"], ["-m", "optim.lr=1e-3,2e-3", "run.dir="]):
        proc = run_main("hpctrain", "+experiment=tiny", *argv)
        assert proc.returncode == 2, proc.stdout[-2000:]
        assert "run.dir is empty. Fix: name the run's directory" in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_a_users_directory_is_refused_and_left_byte_for_byte(tmp_path, multirun):
    """Mutant: check_in_place accepting a directory without the marker."""
    d = tmp_path / "mine"
    before = users_dir(d)
    argv = ["-m", "optim.lr=1e-3,2e-3"] if multirun else []
    proc = run_main("hpctrain", *argv, "+experiment=tiny", f"run.dir={d}")
    assert proc.returncode == 2
    assert f"run.dir={d} holds files python -m hpctrain{' -m' if multirun else ''} did not write " \
           "(config.yaml, notes.txt, outcome.json, plan.json): refusing to write there" in proc.stderr
    assert files(d) == before  # not even the marker or the lock file


@pytest.mark.parametrize("name", ["checkpoints", "logs"])
@pytest.mark.parametrize("where", ["new", "run"])
def test_checkpoints_or_logs_that_is_a_file_is_refused(tmp_path, name, where, capsys):
    """In a directory holding only that file, and in an existing run directory (resume): refused with what
    it is, by the login node, the supervisor and a rank started without either (torchrun, mpiexec).
    Mutants: no layout_problem in check_run_dir (a traceback from mkdir, or the ranks crashing on it), or
    in the rank's entry."""
    d = tmp_path / "run"
    if where == "run":
        assert run_main("hpctrain", "+experiment=tiny", "launcher=sbatch", f"run.dir={d}").returncode == 0
        if (d / name).is_dir():
            (d / name).rmdir()
    before = users_dir(d, {name: b"a file of mine\n"})
    message = f"{d / name} is a file, not a directory: the run keeps its "
    proc = run_main("hpctrain", "+experiment=tiny", "launcher=sbatch", f"run.dir={d}")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if where == "run":
        assert supervise(d) == 2 and message in capsys.readouterr().err
        rank = subprocess.run([sys.executable, "-m", "hpctrain.run", str(d)], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"}, timeout=300)
        assert rank.returncode == 2 and message in rank.stderr and "Traceback" not in rank.stderr, rank.stderr
    assert files(d) == before


def test_a_run_directory_from_before_the_marker_is_resumed_and_marked(tmp_path):
    """hpctrain's config.yaml beside logs/ (what every start wrote first) is a run directory; a user's notes
    in it stay. A config.yaml alone (`python -m hpctrain --cfg > config.yaml`) is not. Mutant:
    from_before_the_marker saying no (every old run refused) or yes (a user's config.yaml written over)."""
    d = tmp_path / "old"
    cfg = to_yaml(compose(["+experiment=tiny", f"run.dir={d}"]))
    before = users_dir(d, {"config.yaml": cfg.encode(), "notes.txt": b"mine\n"})
    with pytest.raises(RunDirError, match="did not write"):
        check_run_dir(d)
    other = tmp_path / "other"  # logs/ beside a config.yaml that is not hpctrain's
    users_dir(other, {"config.yaml": USERS["config.yaml"]})
    (other / "logs").mkdir()
    with pytest.raises(RunDirError, match="did not write"):
        check_run_dir(other)
    (d / "logs").mkdir()
    own_run_dir(d)
    assert json.loads((d / MARKER).read_text())["tool"] == "python -m hpctrain"
    assert (d / "notes.txt").read_bytes() == before["notes.txt"]
    (d / "config.yaml").write_text("model: [not, a, config]\n")  # now marked: its marker decides
    check_run_dir(d)
