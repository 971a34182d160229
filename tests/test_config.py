"""Composing the config and refusing the ones that cannot run, in process and through the CLI."""
from __future__ import annotations


import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hpctrain.checks.config_checks import check, compose_checked
from hpctrain.core.compose import ConfigError, compose
from hpctrain.data.prepare import prepare

from helpers import run_main

REPO = Path(__file__).resolve().parent.parent
TINY = "+experiment=tiny"


def refusal(*overrides: str) -> str:
    """The message a config is refused with (while composing or checking), as the CLI does it."""
    with pytest.raises(ConfigError) as info:
        check(*compose_checked([TINY, *overrides]))
    return str(info.value)


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m hpctrain ARGS`'s exit code and output, run in this process: these commands compose,
    check and plan on the login node and start nothing, and a subprocess would add ~1.5 s of interpreter
    and import start-up to each (tests/test_readme.py runs the real command line)."""
    return run_main("hpctrain", *args)


def assert_mentions(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} not in message:\n{msg}"


# --- the documented interface -------------------------------------------------------------------


def test_tiny_experiment_composes_with_documented_keys():
    cfg = compose([TINY])
    check(cfg)
    assert cfg.model.name == "tiny"
    assert cfg.train.steps == 60
    assert cfg.launcher.name == "local" and cfg.launcher.nproc == 2
    assert os.path.isabs(cfg.run.dir) and cfg.run.dir.endswith(os.path.join("outputs", "tiny"))
    p = cfg.parallel
    assert (p.dp_shard, p.dp_replicate, p.tp, p.pp) == (-1, 1, 1, 1)
    assert cfg.checkpoint.every == 0 and cfg.checkpoint.keep == 3
    assert cfg.checkpoint.async_save is False
    assert cfg.dry_run is False


def test_documented_keys_can_be_overridden(tmp_path):
    cfg = compose([TINY, "train.steps=7", f"run.dir={tmp_path / 'r'}", "launcher.nproc=4",
                   "parallel.dp_shard=2", "parallel.dp_replicate=2", "parallel.tp=1", "parallel.pp=1",
                   "train.micro_batch=4", "checkpoint.every=5", "checkpoint.keep=1",
                   "checkpoint.async_save=true", "dry_run=true"])
    check(cfg)
    assert cfg.train.steps == 7 and cfg.run.dir == str(tmp_path / "r")
    assert cfg.launcher.nproc == 4
    assert (cfg.parallel.dp_shard, cfg.parallel.dp_replicate) == (2, 2)
    assert cfg.checkpoint.every == 5 and cfg.checkpoint.keep == 1
    assert cfg.checkpoint.async_save is True and cfg.dry_run is True


def test_relative_run_dir_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose([TINY, "run.dir=some/where"])
    assert cfg.run.dir == str(tmp_path / "some" / "where")


def test_model_group_option():
    cfg = compose([TINY, "model=70b"])
    check(cfg)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads) == (8192, 80, 64, 8)


@pytest.mark.parametrize("group,plus,name,near", [("model", "", "7b", "70b"), ("experiment", "+", "7b", "70b"),
                                                  ("model", "", "tiny_moe", "moe_tiny"),
                                                  ("experiment", "+", "8x7b_mixtral", "mixtral_8x7b")])
def test_an_unknown_preset_lists_the_presets(group, plus, name, near):
    """Mutants: Hydra's raw "In 'config': Could not find 'model/7b'" with its search path; spelling's
    nearest alone (tiny_moe -> tiny, though moe_tiny has the same words)."""
    presets = ", ".join(sorted(p.stem for p in (Path(__file__).parent.parent / "conf" / group).glob("*.yaml")))
    with pytest.raises(ConfigError) as e:
        compose([f"{plus}{group}={name}"])
    assert str(e.value) == (f"{plus}{group}={name}: no such preset (conf/{group}/{name}.yaml). Presets of {group}: "
                            f"{presets}. Fix: {plus}{group}={near}")


def test_free_form_dicts_accept_new_keys():
    cfg = compose([TINY, "+cluster.env.NCCL_DEBUG=INFO", "+cluster.sbatch_extra.reservation=r1"])
    assert cfg.cluster.env["NCCL_DEBUG"] == "INFO"
    assert cfg.cluster.sbatch_extra["reservation"] == "r1"


# --- refused configs: each message names the key and the fix -----------------------------------

# (overrides, substrings the message must contain)
REFUSED = {
    "unknown-key": (("train.stepz=1",), ("train.stepz", "Did you mean 'train.steps'")),
    "negative-keep-every": (("checkpoint.keep_every=-1",), ("checkpoint.keep_every=-1", "Fix: checkpoint.keep_every=0")),
    "unknown-key-nested": (("checkpoint.asyncsave=true",), ("checkpoint.asyncsave", "Did you mean 'checkpoint.async_save'")),
    # renamed (a Python keyword kept the schema from being a plain dataclass): the new key is the fix
    "renamed-key": (("checkpoint.async=true",), ("checkpoint.async is now checkpoint.async_save",
                                                 "Fix: checkpoint.async_save=true")),
    "unknown-top-level-key": (("dryrun=true",), ("'dryrun'", "Did you mean 'dry_run'")),
    "unknown-key-added": (("+train.foo=1",), ("unknown key 'train.foo'", "Keys of train:", "steps")),
    "wrong-type-int": (("train.steps=abc",), ("train.steps", "'abc'", "int", "train.steps=8")),
    "wrong-type-bool": (("checkpoint.async_save=maybe",), ("checkpoint.async_save", "'maybe'", "bool", "checkpoint.async_save=true")),
    "unknown-group-option": (("model=foo",), ("model/foo", "1b", "8b", "70b", "405b", "small", "tiny")),
    "product-not-world": (("launcher.nproc=3", "parallel.dp_shard=2"),
                          ("dp_shard=2", "launcher.nproc=3", "3 ranks", "Fix: set parallel.dp_shard=-1")),
    "rest-not-divisible-pp": (("launcher.nproc=3", "parallel.pp=2"),
                              ("parallel.pp=2", "does not divide the 3 ranks", "launcher.nproc=3", "Fix:")),
    "rest-not-divisible-replicate": (("launcher.nproc=3", "parallel.dp_replicate=2"),
                                     ("parallel.dp_replicate=2", "does not divide the 3 ranks", "Fix:")),
    "heads-not-divisible-by-tp": (("parallel.tp=3", "launcher.nproc=3"),
                                  ("model.n_heads=4", "parallel.tp=3", "Fix: choose parallel.tp among 1, 2, 4")),
    "heads-not-divisible-by-kv-heads": (("model.n_kv_heads=3",),
                                        ("model.n_heads=4", "model.n_kv_heads=3", "not divisible")),
    "global-batch": (("train.global_batch=10",),
                     ("train.global_batch=10", "train.micro_batch=4", "Fix: train.global_batch=8")),
    "shards-without-path": (("data=shards",), ("data.path", "python -m hpctrain.data.prepare", "data.path=<out dir>")),
    "shards-missing-dir": (("data=shards", "data.path=/nonexistent/hpctrain-shards"),
                           ("data.path=/nonexistent/hpctrain-shards", "Fix:", "hpctrain.data.prepare")),
    "bad-choice": (("train.precision=fp4",), ("train.precision=fp4", "fp32, bf16", "Fix: train.precision=fp8")),
    "zero1-tp-offload": (("launcher.nproc=4", "parallel.tp=2", "parallel.zero=1", "offload.target=cpu"),
                         ("offload.target=cpu", "parallel.zero=1", "tp=2", "Fix: parallel.zero=2 or 3")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_message_names_key_and_fix(case):
    overrides, expected = REFUSED[case]
    assert_mentions(refusal(*overrides), *expected)


def test_all_problems_reported_at_once():
    msg = refusal("train.precision=fp4", "train.global_batch=10", "parallel.zero=5")
    assert_mentions(msg, "3 problems", "train.precision", "train.global_batch", "parallel.zero")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("parallel.zero=0", "parallel.tp=2"), ("parallel.zero=1", "parallel.tp=2"),
    ("parallel.zero=0", "parallel.pp=2"), ("parallel.zero=1", "parallel.pp=2"),
    ("parallel.zero=1", "parallel.tp=2", "parallel.pp=2", "launcher.nproc=8"),
])
def test_replicated_data_parallel_composes_with_tp_and_pp(overrides):
    """DDP / ZeRO-1 layouts (parameters replicated over data parallel) with TP or PP: accepted, and run on
    FSDP2's replicate (ZeRO-1: the optimizer sharded by parameter owner) -- Megatron's layout."""
    from hpctrain.core.spec import engine_spec

    cfg, refused = compose_checked([TINY, "launcher.nproc=4", *overrides])
    check(cfg, refused)  # raises ConfigError if refused
    spec = engine_spec(cfg)
    assert spec.layout.dp == 2
    assert spec.data_parallel == ("replicate_zero1" if "parallel.zero=1" in overrides else "replicate")
    assert spec.sharding.optimizer == ("parallel.zero=1" in overrides) and not spec.sharding.grads


@pytest.mark.parametrize("overrides, expected", [
    (("parallel.dp_shard=0",), "parallel.dp_shard=0"),
    (("train.steps=0",), "train.steps=0 must be at least 1"),
    (("optim.min_lr_ratio=2",), "optim.min_lr_ratio"),
    (("model.dim=130",), "model.dim=130 is not divisible by model.n_heads=4"),
])
def test_range_checks(overrides, expected):
    assert expected in refusal(*overrides)


def test_shards_dir_without_meta(tmp_path):
    assert_mentions(refusal("data=shards", f"data.path={tmp_path}"), f"data.path={tmp_path}", "meta.json")


@pytest.mark.slow
def test_shards_vocab_larger_than_model(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello world " * 50)
    prepare(tmp_path / "src", tmp_path / "out", val_fraction=0)
    msg = refusal("data=shards", f"data.path={tmp_path / 'out'}", "model.vocab_size=128", "data.seq_len=16")
    assert_mentions(msg, "model.vocab_size=128", "Fix: model.vocab_size=256")
    # The same shards with a large enough vocabulary pass.
    check(compose([TINY, "data=shards", f"data.path={tmp_path / 'out'}", "data.seq_len=16"]))


# --- through the CLI, as a user runs it ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown-key", "unknown-key-added", "wrong-type-int", "wrong-type-bool",
                                  "unknown-group-option", "product-not-world", "heads-not-divisible-by-tp",
                                  "global-batch", "shards-without-path", "bad-choice"])
def test_cli_refuses_with_exit_2_and_no_traceback(case, tmp_path):
    overrides, expected = REFUSED[case]
    proc = cli(TINY, *overrides, f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("hpctrain: error: ")
    assert_mentions(proc.stderr, *expected)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_dry_run_prints_summary_and_writes_nothing(tmp_path):
    """A dry run into another run's directory leaves its files as they were (it used to write plan.json
    over that run's). Mutant: writing the plan before the dry-run branch."""
    run_dir = tmp_path / "run"
    proc = cli(TINY, "dry_run=true", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    assert_mentions(proc.stdout, "model tiny", "459,392", "dp_shard 2", "= 2 ranks",
                    "16 sequences x 64 tokens", "60 steps", f"run dir: {run_dir}", "dry run", "tokens/s",
                    "memory per rank", "MFU", "nothing written")  # a CPU run: no GPU to speak of
    assert not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "plan.json").write_text('{"theirs": 1}')
    assert cli(TINY, "dry_run=true", "model.dim=128", f"run.dir={run_dir}").returncode == 0
    assert [p.name for p in run_dir.iterdir()] == ["plan.json"] and (run_dir / "plan.json").read_text() == '{"theirs": 1}'


@pytest.mark.slow
def test_cli_refused_run_writes_nothing(tmp_path):
    """A run refused because run.dir holds another run's checkpoints leaves plan.json as it was.
    Mutant: writing the plan before the overwrite check."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / ".metadata").write_bytes(b"")
    (run_dir / "checkpoints" / "step-00000002" / "hpctrain.json").write_text("{}")
    (run_dir / "plan.json").write_text('{"theirs": 1}')
    proc = cli(TINY, "checkpoint.resume=false", f"run.dir={run_dir}")
    assert proc.returncode == 2 and "checkpoint.resume" in proc.stderr, proc.stdout + proc.stderr
    assert (run_dir / "plan.json").read_text() == '{"theirs": 1}'
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "plan.json"]


@pytest.mark.slow
def test_cli_refuses_a_plan_that_cannot_fit_with_numbers(tmp_path):
    """70B on two 8 GiB CPU ranks: refused before anything starts, with the memory that shows why."""
    proc = cli(TINY, "model=70b", "dry_run=true", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stdout
    assert "70,553,706,496" in proc.stdout
    assert_mentions(proc.stderr, "the plan does not fit", "GiB per rank", "8.0 GiB (cluster.device_mem_gb)",
                    "Fix:", "no layout of this model fits")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_dry_run_70b_on_64_h100(tmp_path):
    # Seconds, because it is arithmetic: tests/test_login_node.py asserts it imports no torch.
    proc = cli("+experiment=70b", "dry_run=true", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert_mentions(proc.stdout, "70,553,706,496", "64 x h100", "tokens/s", "MFU", "GiB of 80.0 GiB")


@pytest.mark.slow
def test_parallel_auto_picks_a_feasible_layout(tmp_path):
    proc = cli("+experiment=70b", "parallel=auto", "dry_run=true", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert "parallel=auto chose: parallel.tp=" in proc.stdout
    used = re.search(r"memory per GPU \(stage \d+\): ([\d.]+) GiB of 80.0 GiB", proc.stdout)
    assert used and float(used.group(1)) <= 80, proc.stdout


@pytest.mark.slow
def test_cli_cfg_prints_yaml():
    proc = cli(TINY, "train.steps=7", "--cfg")
    assert proc.returncode == 0, proc.stderr
    doc = yaml.safe_load(proc.stdout)
    assert doc["train"]["steps"] == 7
    assert doc["launcher"]["nproc"] == 2
    assert doc["checkpoint"]["async_save"] is False
    assert {"model", "parallel", "optim", "data", "train", "checkpoint", "launcher", "run", "dry_run"} <= set(doc)


def test_cli_help():
    proc = cli("--help")
    assert proc.returncode == 0 and "usage: python -m hpctrain" in proc.stdout


@pytest.mark.parametrize("key,bad,allowed", [
    ("train.precision", "fp4", "fp32, bf16, fp16, fp8"),
    ("parallel.pp_schedule", "1F1B", "gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev"),
    ("parallel.ac", "some", "none, full, selective"),
    ("offload.target", "disk", "none, cpu, nvme"),
    ("launcher.name", "print", "local, slurm, sbatch"),
    ("cluster.device", "gpu", "cpu, cuda"),
])
def test_schema_refuses_values_outside_a_choice(key, bad, allowed):
    """Composing alone (no checks) refuses them, with the allowed values and the nearest one."""
    with pytest.raises(ConfigError) as info:
        compose([TINY, f"{key}={bad}"])
    assert_mentions(str(info.value), f"{key}={bad} is not one of {allowed}", "Fix:")
    assert str(info.value).count("\n") == 0  # one line, no Hydra or OmegaConf trace
    if bad == "1F1B":
        assert "Fix: parallel.pp_schedule=1f1b" in str(info.value)
