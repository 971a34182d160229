"""Running hpctrain as a user does: the CLI in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The planner's calibration (published runs, their fit) lives beside the package: importable as `calibration`.
CALIBRATION_ROOT = str(REPO / "benchmarks")
if CALIBRATION_ROOT not in sys.path:
    sys.path.append(CALIBRATION_ROOT)


def run_cli(*overrides: str, timeout: float = 300, check: bool = True, env: dict | None = None,
            module: str = "hpctrain") -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"`python -m {module} {' '.join(overrides)}` exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def run_main(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS`'s exit code and output, run in this process through MODULE.__main__.main:
    for commands that start no ranks, where a subprocess would only add interpreter and import start-up."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(f"{module}.__main__").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return subprocess.CompletedProcess(["python", "-m", module, *args], rc, out.getvalue(), err.getvalue())


def skip_or_fail(why: str, what: str = "the Slurm tests") -> None:
    """Without the local Slurm (or root) a developer may skip the tests that need it; CI (CI=true) runs
    as root and starts Slurm first, so there a missing one is a failure, never a silent skip."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"CI must run {what}: {why}")
    pytest.skip(why)


def wait_until(predicate, what: str, timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll until `predicate()` is true. The bound only keeps a broken run from hanging the suite:
    it fails with "never happened", never as a claim about speed (speed is measured in benchmarks/)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: never happened (gave up after {timeout_s:.0f} s)")
        time.sleep(poll_s)


SNAPSHOTS = REPO / "tests" / "snapshots"


def check_snapshot(name: str, text: str) -> None:
    """`text` equals tests/snapshots/<name>; HPCTRAIN_UPDATE_SNAPSHOTS=1 rewrites it (review the diff),
    and a missing one is written and fails once, to be reviewed."""
    import pytest

    path = SNAPSHOTS / name
    if os.environ.get("HPCTRAIN_UPDATE_SNAPSHOTS") == "1" or not path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
        if os.environ.get("HPCTRAIN_UPDATE_SNAPSHOTS") != "1":
            pytest.fail(f"wrote the missing snapshot {path}: review it and rerun")
    assert text == path.read_text(), f"{name} changed; if intended: HPCTRAIN_UPDATE_SNAPSHOTS=1 pytest tests/"


def set_key(cfg, key: str, value) -> None:
    """Set a dotted key on a composed (typed) config, as a hand-edited config.yaml would hold it;
    free-form sections (cluster.env, cluster.sbatch_extra) are plain dicts. The value is copied, so a
    test that then changes the config leaves the constant it came from alone."""
    import copy

    value = copy.deepcopy(value)
    parent, _, leaf = key.rpartition(".")
    node = cfg
    for part in parent.split(".") if parent else ():
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    if isinstance(node, dict):
        node[leaf] = value
    else:
        setattr(node, leaf, value)
