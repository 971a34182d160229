"""The local launcher: start N ranks, report the first failure, stop the others promptly. Each
behaviour is checked for both ways a rank starts: a process of its own (`python -c`), and a fork of
hpctrain.launch.forkserver (`python script.py`; preloading a light module here, not torch)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpctrain.launch.local import launch, rank_env, reserved_port, signal_name

from helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
LONG_SLEEP = 60  # what a rank left running would keep the call alive for


def outlive(tmp_path: Path) -> str:
    """Code for a rank that sleeps, then leaves a mark: a mark after launch() returned means the
    launcher waited for it instead of stopping it."""
    return (f"time.sleep({LONG_SLEEP}); "
            f"open(os.path.join({str(tmp_path)!r}, 'outlived-' + os.environ['RANK']), 'w').close()")


def assert_others_stopped(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("outlived-*")), "the launcher let a rank run to the end"


@pytest.fixture(params=["process", "fork"])
def ranks(request, tmp_path, monkeypatch):
    """The command that runs `script` as every rank: `python -c` (a process of its own each), or a
    script file, which the launcher starts through its fork server."""
    monkeypatch.setenv("HPCTRAIN_FORK_PRELOAD", "decimal")

    def cmd(script: str) -> list[str]:
        if request.param == "process":
            return [sys.executable, "-c", textwrap.dedent(script)]
        path = tmp_path / "rank_script.py"
        path.write_text(textwrap.dedent(script))
        return [sys.executable, str(path)]
    return cmd


def test_all_ranks_succeed(tmp_path, capfd, ranks):
    rc = launch(tmp_path, 3, cmd=ranks("""
        import os
        print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")
    """))
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "hello from rank 0 of 3" in out  # rank 0 writes to the terminal
    for r in (1, 2):  # the others to their log files
        assert f"hello from rank {r} of 3" in (tmp_path / "logs" / f"rank-{r}.log").read_text()
    assert "failed" not in err


@pytest.mark.slow
def test_rank_exception_is_reported_and_others_stopped(tmp_path, capfd, ranks):
    rc = launch(tmp_path, 3, cmd=ranks(f"""
        import os, time
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on purpose")
        {outlive(tmp_path)}
    """))
    _, err = capfd.readouterr()
    assert rc == 1
    assert "rank 1 failed (exit code 1)" in err
    assert str(tmp_path / "logs" / "rank-1.log") in err
    assert "RuntimeError: boom on purpose" in err  # the tail of its log
    assert_others_stopped(tmp_path)


@pytest.mark.slow
def test_exit_code_is_passed_on(tmp_path, capfd, ranks):
    rc = launch(tmp_path, 2, cmd=ranks(f"""
        import os, sys, time
        if os.environ["RANK"] == "0":
            sys.exit(3)
        {outlive(tmp_path)}
    """))
    _, err = capfd.readouterr()
    assert rc == 3
    assert "rank 0 failed (exit code 3)" in err and "above" in err
    assert_others_stopped(tmp_path)


@pytest.mark.slow
def test_rank_killed_by_signal(tmp_path, capfd, ranks):
    rc = launch(tmp_path, 3, cmd=ranks(f"""
        import os, signal, time
        if os.environ["RANK"] == "1":
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        {outlive(tmp_path)}
    """))
    _, err = capfd.readouterr()
    assert rc == 128 + signal.SIGKILL
    assert "rank 1 failed (was killed by SIGKILL)" in err
    # Whoever sends a signal says so (mutant: a silent _stop; the ranks' logs only show SIGKILL).
    assert "stopping the others with SIGKILL: rank 0 (pid " in err and ", rank 2 (pid " in err, err
    assert_others_stopped(tmp_path)


@pytest.mark.slow
def test_rank_ignoring_sigterm_is_still_stopped(tmp_path, capfd, ranks):
    """A rank that ignores SIGTERM (or is busy saving) does not keep the launcher alive past the grace."""
    rc = launch(tmp_path, 2, grace_s=1.0, cmd=ranks(f"""
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            sys.exit(5)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        {outlive(tmp_path)}
    """))
    _, err = capfd.readouterr()
    assert rc == 5
    assert "rank 1 failed (exit code 5)" in err
    assert_others_stopped(tmp_path)


def test_signal_to_launcher_reaches_every_rank(tmp_path, ranks):
    """SIGUSR2 sent to the launcher (as Slurm does before the time limit) is passed on to each rank."""
    rank_script = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        d = Path({str(tmp_path)!r})
        def on_usr2(signum, frame):
            (d / f"usr2-{{os.environ['RANK']}}").touch()
            sys.exit(0)
        signal.signal(signal.SIGUSR2, on_usr2)
        (d / f"ready-{{os.environ['RANK']}}").touch()
        time.sleep({LONG_SLEEP})
        sys.exit(1)
    """)
    launcher = (f"import sys; from hpctrain.launch.local import launch; "
                f"sys.exit(launch({str(tmp_path / 'run')!r}, 2, cmd={ranks(rank_script)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)) or proc.poll() is not None,
                   "both ranks ready", timeout_s=60)
        assert proc.poll() is None, "the launcher ended before its ranks were ready"
        os.kill(proc.pid, signal.SIGUSR2)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert f"passing SIGUSR2 (sent to the launcher, pid {proc.pid}) on to rank(s) 0, 1" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all((tmp_path / f"usr2-{r}").exists() for r in range(2))


def test_a_forked_rank_starts_as_a_fresh_interpreter_would(tmp_path, monkeypatch):
    """What a rank sees of how it started, through the fork server: its own session and environment,
    stdin from /dev/null, its argv, the script's folder first on sys.path, `__main__`; its atexit
    handlers run. Mutants: no fork server (the preloaded module is not there), the server's
    environment left in place (RANK 0 everywhere), no setsid."""
    monkeypatch.setenv("HPCTRAIN_FORK_PRELOAD", "decimal")
    script = tmp_path / "bin" / "probe.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(f"""
        import atexit, json, os, sys
        seen = dict(preloaded="decimal" in sys.modules, name=__name__, argv=sys.argv, path0=sys.path[0],
                    rank=os.environ["RANK"], extra=os.environ.get("EXTRA"), own_session=os.getsid(0) == os.getpid(),
                    stdin_null=os.path.samestat(os.fstat(0), os.stat(os.devnull)), ppid=os.getppid())
        out = os.path.join({str(tmp_path)!r}, "seen-" + os.environ["RANK"])
        atexit.register(lambda: open(out + ".atexit", "w").close())
        print("to my log")
        with open(out, "w") as f:
            json.dump(seen, f)
    """))
    from hpctrain.launch.local import run_ranks

    ended = run_ranks(tmp_path / "run", 2, cmd=[sys.executable, str(script), "a", "b"], env={"EXTRA": "x"})
    assert ended.rc == 0, ended
    for r in (0, 1):
        seen = json.loads((tmp_path / f"seen-{r}").read_text())
        assert seen == {**seen, "preloaded": True, "name": "__main__", "argv": [str(script), "a", "b"],
                        "path0": str(script.parent), "rank": str(r), "extra": "x", "own_session": True,
                        "stdin_null": True}, seen
        assert seen["ppid"] != os.getpid()  # the server's child, not ours
        assert (tmp_path / f"seen-{r}.atexit").exists()
    assert "to my log" in (tmp_path / "run" / "logs" / "rank-1.log").read_text()


def test_rendezvous_port_is_held_until_the_ranks_end(tmp_path, capfd, ranks):
    """Each rank finds MASTER_PORT still taken (by the launcher), so no other job can be given it."""
    rc = launch(tmp_path, 2, cmd=ranks("""
        import errno, os, socket
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            raise SystemExit("MASTER_PORT was free: any bind to port 0 could have been handed it")
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
    """))
    assert rc == 0, capfd.readouterr().err


def test_reserved_port_is_nobody_elses_but_rank_0_can_listen_on_it():
    """Two jobs given one port cross their collectives (docs/failures.md, "Two jobs on one rendezvous port"). While
    held, the port is never handed to a bind to port 0, yet torch's TCPStore can serve on it."""
    import datetime
    import errno
    import socket

    import torch.distributed as dist
    with reserved_port() as port:
        handed = set()
        for _ in range(20000):  # about 3 times the binds in which Linux handed out a let-go port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                handed.add(s.getsockname()[1])
        assert port not in handed
        with socket.socket() as s, pytest.raises(OSError) as taken:
            s.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        timeout = datetime.timedelta(seconds=10)
        server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
        client.set("who", "rank 1")
        assert server.get("who") == b"rank 1"
        del client, server


def test_rank_env():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "3"}
    env = rank_env(1, 4, 12345, base=base)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "12345"
    assert env["HPCTRAIN_LAUNCHER"] == "local"
    assert env["PATH"] == "/usr/bin"
    assert env["OMP_NUM_THREADS"] == "3"  # a user's setting is kept
    assert base == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "3"}  # not modified
    env = rank_env(0, 2, 1, base={})
    assert int(env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 2)
    assert env["RANK"] == "0"


def test_signal_name():
    assert signal_name(-9) == "SIGKILL"
    assert signal_name(-15) == "SIGTERM"


def test_rank_0_log_gets_each_update_of_the_terminals_progress_line_as_a_line(tmp_path, capfd):
    """On a terminal the progress line updates in place (a carriage return and erase-line before each
    update); logs/rank-0.log gets the same bytes with each update on a line of its own, and the other
    stream's text on lines of their own. Mutant: the bytes copied as they are (one unreadable line)."""
    from hpctrain.launch.local import Tee

    tee = Tee(tmp_path / "rank-0.log")
    out, err = tee.pipe(1), tee.pipe(2)
    for fd, data in ((out, b"\r\x1b[K[---] step 1/3"), (out, b"\r\x1b[K[#--] step 2/3"), (err, b"a warning\n"),
                     (out, b"\r\x1b[Kresumed\n"), (out, b"\r\x1b[K[###] step 3/3\n")):
        os.write(fd, data)
        time.sleep(0.05)  # one stream at a time, in this order
    os.close(out)
    os.close(err)
    tee.close()
    assert capfd.readouterr() == ("\r\x1b[K[---] step 1/3\r\x1b[K[#--] step 2/3\r\x1b[Kresumed\n\r\x1b[K[###] step 3/3\n",
                                  "a warning\n")
    assert (tmp_path / "rank-0.log").read_text().splitlines() == [
        "[---] step 1/3", "[#--] step 2/3", "a warning", "resumed", "[###] step 3/3"]
