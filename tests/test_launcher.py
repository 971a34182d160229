"""The local launcher: start N ranks, report the first failure, stop the others promptly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpctrain.launch.local import launch, rank_env, signal_name

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


def ranks(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def test_all_ranks_succeed(tmp_path, capfd):
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
def test_rank_exception_is_reported_and_others_stopped(tmp_path, capfd):
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
def test_exit_code_is_passed_on(tmp_path, capfd):
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
def test_rank_killed_by_signal(tmp_path, capfd):
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
def test_rank_ignoring_sigterm_is_still_stopped(tmp_path, capfd):
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


def test_signal_to_launcher_reaches_every_rank(tmp_path):
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
                f"sys.exit(launch({str(tmp_path / 'run')!r}, 2, cmd=[sys.executable, '-c', {rank_script!r}]))")
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
