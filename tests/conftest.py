"""Shared fixtures. `slurm`: the single-machine Slurm of slurm/start.sh, brought up by the suite itself
where it can be (root on Debian), so `pytest` alone runs every test; elsewhere the Slurm tests skip
(under CI=true they fail instead: CI must run them)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parent.parent
# Every process a test starts (ranks, workers, tools) leaves its Python stack in its output when a fatal
# signal kills it; pytest's own faulthandler covers this process.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
NODES = 2  # emulated nodes the Slurm tests need

# Property tests give the same examples on every machine: `pytest` (what CI runs) draws them from a seed
# fixed per test and keeps no example database, so an example that fails fails everywhere and is then
# kept as an @example. Random exploration is its own run (docs/development.md):
#   pytest -m hypothesis --hypothesis-profile=explore
# (hypothesis's pytest plugin marks every @given test `hypothesis`; the profile draws fresh examples,
# more of them, and remembers the failing ones in .hypothesis/ to replay them.)
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the pure tests run without the dev extra's hypothesis
    _hypothesis_settings = None
if _hypothesis_settings is not None:
    _hypothesis_settings.register_profile("same-everywhere", derandomize=True, database=None, print_blob=True)
    _hypothesis_settings.register_profile("explore", derandomize=False, max_examples=500, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "same-everywhere"))


# What a test file costs in a full run on 2 cores (seconds, summed --durations of its tests; the Slurm
# tests are one group of their own): only the order matters, a file not listed comes after these.
COSTLY = {"test_checkpoint_resume.py": 330, "test_layouts.py": 340, "test_finetune.py": 60, "test_moe.py": 235, "test_supervise.py": 235,
          "test_readme.py": 60, "test_trackers.py": 170, "test_sp_regather.py": 160, "test_config.py": 125,
          "test_published.py": 60, "test_engine_promises.py": 115, "test_train_dist.py": 110, "test_hf.py": 105,
          "test_offload.py": 100, "test_validation.py": 90, "test_report.py": 80, "test_checkpoint_damage.py": 80,
          "test_serializers.py": 80, "test_k8s.py": 55, "test_multirun.py": 55, "test_profile.py": 45,
          "test_plan.py": 45, "test_mpi.py": 40, "test_container.py": 40, "test_bench_collectives.py": 40,
          "test_corpus.py": 35, "test_launcher.py": 25, "test_sbatch.py": 25,
          "test_rundir_owner.py": 40, "test_nonfinite.py": 20, "test_checkpoint_whole.py": 15,
          "test_fp8.py": 240, "test_fp16.py": 130, "test_ac_modules.py": 100, "test_chunked_loss.py": 30,
          "test_dpo.py": 90, "test_qlora.py": 40, "test_adapter_checkpoint.py": 40, "test_preference_data.py": 15,
          "test_record_shapes.py": 10, "test_data_exactly_once.py": 60, "test_memory_snapshot.py": 30}


# Fixtures that start ranks, train a model or build a tokenizer: a test that uses one is slow.
SLOW_FIXTURES = {"example_corpus", "example_shards", "chat_shards", "world_of_one", "probed", "measured", "pipelined"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks this adds
def pytest_collection_modifyitems(config, items):
    """`pytest -m "not slow"` is the quick loop of pure tests (under 2 minutes on 2 cores): a test that
    starts processes or trains a model carries `slow`, and so does every Slurm or GPU test and every
    test that uses one of SLOW_FIXTURES."""
    for item in items:
        if item.get_closest_marker("slurm") or item.get_closest_marker("gpu") or "slurm" in getattr(item, "fixturenames", ()) \
                or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # Two workers (pyproject: -n 2 --dist loadgroup --no-loadscope-reorder). The Slurm tests mostly wait
    # (on the scheduler, on a job's time limit, on a hang to be noticed), so they run one after another on
    # one worker, from the start, while the other worker runs the rest; one Slurm is enough for them.
    # Every other file is one unit, so its module fixtures launch their ranks once.
    # The files are then handed out costliest first (longest-processing-time first), so that no long file
    # starts last and runs alone on one worker while the others have finished.
    for item in items:
        item.add_marker(pytest.mark.xdist_group("slurm" if on_slurm(item) else item.path.name))
    items.sort(key=lambda item: (not on_slurm(item), -COSTLY.get(item.path.name, 0)))


def pytest_configure(config):
    """--dist loadgroup (pyproject's addopts) sends each group to one worker by a "@group" suffix that
    pytest-xdist 3.8 writes into a node's `_nodeid`; pytest 9.1 reads node ids from elsewhere, so the
    groups silently fell apart and every worker ran every file's launches (the suite took 36 minutes
    instead of 15, and the Slurm fault tests failed under the load). Refused instead."""
    from _pytest.nodes import Node

    if config.getoption("dist", "no") == "loadgroup" and "_nodeid" not in getattr(Node, "__slots__", ("_nodeid",)):
        raise pytest.UsageError(
            f"pytest {pytest.__version__}'s node ids ignore the group pytest-xdist's --dist loadgroup gives them, "
            "so each worker would run every file's launches. Fix: install as the README says (constraints.txt "
            "pins pytest 9.0.3), or run without workers: pytest -p no:xdist -o addopts=")


def on_slurm(item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session")
def _sinfo_that_fails(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("no-slurm")
    (d / "sinfo").write_text("#!/bin/sh\necho 'sinfo: no Slurm here (the test suite outside its Slurm tests)' >&2\n"
                             "exit 1\n")
    (d / "sinfo").chmod(0o755)
    return d


@pytest.fixture(autouse=True)
def _no_slurm_outside_the_slurm_tests(request, _sinfo_that_fails, monkeypatch):
    """Outside the Slurm tests, no Slurm answers, as on a laptop: a dry run of +experiment=70b (an H100
    cluster) is not checked against the suite's own 2-node CPU Slurm, which a submission would be."""
    if not on_slurm(request.node):
        monkeypatch.setenv("PATH", f"{_sinfo_that_fails}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves os.environ as it found it: the ranks later tests launch inherit it, and a leaked
    HPCTRAIN_FAULT, TORCH_EXTENSIONS_DIR or OMP_NUM_THREADS changes what they do (code under test may set
    variables in this process: the tokenizers' and MLflow's switches, the kernel caches)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def slurm_problem(nodes: int = NODES) -> str | None:
    """Why the local Slurm cannot run the tests, or None."""
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return "no Slurm client on PATH"
    try:
        p = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D %t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 15 s"
    usable = sum(int(line.split()[0]) for line in p.stdout.splitlines()
                 if line.split() and line.split()[1] in ("idle", "mix", "alloc", "comp"))
    if p.returncode != 0 or usable < nodes:
        return f"no local Slurm with {nodes} usable nodes in partition debug: {p.stdout.strip()} {p.stderr.strip()}"
    return None


def _can_start() -> bool:
    return os.geteuid() == 0 and Path("/etc/debian_version").exists() and shutil.which("apt-get") is not None


@pytest.fixture(scope="session")
def slurm():
    why = slurm_problem()
    if why and _can_start():
        proc = subprocess.run(["bash", str(REPO / "slurm" / "start.sh"), str(NODES)], capture_output=True,
                              text=True, timeout=900)
        why = slurm_problem() if proc.returncode == 0 else f"slurm/start.sh failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    if why:
        from helpers import skip_or_fail

        skip_or_fail(f"{why} (run `bash slurm/start.sh` as root on Debian)")


@pytest.fixture(scope="session")
def example_corpus(tmp_path_factory) -> Path:
    """A small real corpus (standard-library docstrings, corpus.jsonl) and a 512-id BPE tokenizer
    trained on it (tokenizer.json), as `python -m hpctrain.data.example` makes them."""
    from hpctrain.data.example import build

    d = tmp_path_factory.mktemp("example")
    build(d, megabytes=0.3, vocab_size=512)
    return d


@pytest.fixture(scope="session")
def example_shards(example_corpus, tmp_path_factory) -> Path:
    """The example corpus tokenized, with a 5% validation split."""
    from hpctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("example_shards")
    prepare(example_corpus / "corpus.jsonl", out, example_corpus / "tokenizer.json", val_fraction=0.05)
    return out


@pytest.fixture(scope="session")
def chat_shards(example_corpus, tmp_path_factory) -> Path:
    """The example's conversations (chat.jsonl) rendered with its ChatML template, a loss mask on the
    assistant's tokens, in windows of 64 tokens, 20% held out."""
    from hpctrain.data.prepare import prepare_records

    out = tmp_path_factory.mktemp("chat_shards")
    prepare_records(example_corpus / "chat.jsonl", out, example_corpus / "tokenizer.json", "chat", seq_len=64,
                    val_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo process group in the test process, for Trainer-level tests."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
