"""Every float key of the schema in range, on the login node (hpctrain.checks.config_checks: one rule table,
RANGES, and a walk of the Config dataclasses), and the whole numbers that must not be negative. No launch:
what a person sees is the refusal message, and that is what these tests read."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re

import pytest
import yaml

from hpctrain.checks import config_checks as cc
from hpctrain.core.compose import ConfigError, compose
from hpctrain.core.reference import keys
from helpers import REPO, run_main, set_key

# The float keys, found by the reference's own walk of the schema (docs/config.md's), not the checks'.
FLOATS = [k.name for k in keys() if k.type == "float"]


def refusals(*overrides: str) -> list[str]:
    return cc.problems(compose(["+experiment=tiny", *overrides]))


@functools.cache
def _tiny():
    return compose(["+experiment=tiny"])


def refusals_of(*pairs: str) -> list[str]:
    """The problems of the tiny config with each `key=value` of `pairs` set, as a hand-edited config.yaml
    holds it (composed once: Hydra takes a second a config on a busy machine)."""
    cfg = copy.deepcopy(_tiny())
    for pair in pairs:
        key, _, value = pair.partition("=")
        cast = float if isinstance(cc._get(cfg, key), float) else int  # as the schema types it
        set_key(cfg, key, cast(float(value)))
    return cc.problems(cfg)


def test_every_float_key_of_the_schema_has_a_rule_that_nan_and_inf_break():
    """A float key added to the schema without a row in RANGES fails here (the checks would still apply the
    default rule to it: finite, 0 or more); a row whose bounds let nan or inf through fails too, and so
    does one that refuses its own default. Mutants: the optim.eps row deleted; Range.holds without the
    isfinite test and a row with high=inf, high_open=False (inf accepted); a rule too strict for its
    default (launcher.hang_timeout_s above 0)."""
    assert len(FLOATS) >= 40 and "data.sources[].weight" in FLOATS
    assert sorted(set(FLOATS) - set(cc.RANGES)) == []
    assert sorted(set(cc.RANGES) - set(FLOATS)) == []  # no row for a key that is gone
    for key in FLOATS:
        rule = cc.range_of(key)
        for bad in (math.nan, math.inf, -math.inf):
            assert not rule.holds(bad), (key, bad)
        assert rule.holds(cc._default(key)), (key, cc._default(key))


def test_the_walk_finds_every_float_value_nested_and_in_lists():
    """float_keys walks the config itself: nested sections and each element of data.sources. Mutants: the
    walk not entering lists (the weights unchecked) or nested sections (model.lora.alpha unchecked)."""
    cfg = compose(["+experiment=tiny", "data.sources=[{path: a, weight: 3}, {path: b, weight: 1}]"])
    found = dict(cc.float_keys(cfg))
    named = {re.sub(r"\[\d+\]", "[]", k) for k in found}
    assert named == set(FLOATS)
    assert found["data.sources[0].weight"] == 3.0 and found["data.sources[1].weight"] == 1.0
    assert found["model.lora.alpha"] == 16.0 and found["launcher.health.slowdown"] == 2.0


@dataclasses.dataclass
class Later:
    """A section added to the schema later, with a float key no row of RANGES names."""
    gain: float = 1.0
    count: int = -3  # not a float: not this walk's


@dataclasses.dataclass
class Outer:
    later: Later = dataclasses.field(default_factory=Later)


def test_a_float_key_without_a_rule_is_still_checked():
    """A float field no row names (one added later) gets the default rule. Mutant: range_of returning a
    rule that accepts anything for an unknown key."""
    assert list(cc.float_keys(Outer(Later(gain=math.nan)))) == [("later.gain", pytest.approx(math.nan, nan_ok=True))]
    assert cc.range_of("later.gain") is cc.DEFAULT_RANGE
    for bad in (math.nan, math.inf, -1.0):
        assert not cc.DEFAULT_RANGE.holds(bad)
    assert cc.DEFAULT_RANGE.holds(0.0) and cc.DEFAULT_RANGE.holds(2.5)


# key, value, the range in words: each refusal names the key and value, the range and the fix (the
# default, or for the cluster's figures the hardware's). The probe's inputs first: before this table each
# of them passed the login node (nan loss and "completed", or a traceback on every rank and restarts).
REFUSED = [
    ("model.norm_eps", "nan", "positive: a finite number above 0", "Fix: model.norm_eps=1e-05 (the default)"),
    ("model.norm_eps", "-1", "positive", "Fix: model.norm_eps=1e-05"),
    ("model.norm_eps", "0", "positive", "Fix: model.norm_eps=1e-05"),
    ("model.rope_theta", "nan", "positive", "Fix: model.rope_theta=500000.0 (the default)"),
    ("model.rope_theta", "0", "positive", "Fix: model.rope_theta=500000.0"),
    ("model.rope_theta", "-10000", "positive", "Fix: model.rope_theta=500000.0"),
    ("model.init_std", "-1", "positive", "Fix: model.init_std=0.02 (the default)"),
    ("model.init_std", "0", "positive", "Fix: model.init_std=0.02"),
    ("model.lora.alpha", "nan", "positive", "Fix: model.lora.alpha=16.0 (the default)"),
    ("model.lora.alpha", "-8", "positive", "Fix: model.lora.alpha=16.0"),
    ("optim.lr", "nan", "positive", "Fix: optim.lr=0.001 (the default)"),
    ("optim.lr", "inf", "positive", "Fix: optim.lr=0.001"),
    ("optim.lr", "0", "positive", "Fix: optim.lr=0.001"),
    ("optim.eps", "0", "positive", "Fix: optim.eps=1e-08"),
    ("optim.beta2", "1", "a finite number in [0, 1)", "Fix: optim.beta2=0.95"),
    ("optim.beta1", "-0.1", "a finite number in [0, 1)", "Fix: optim.beta1=0.9"),
    ("optim.weight_decay", "-0.1", "a finite number, 0 or more", "Fix: optim.weight_decay=0.1"),
    ("optim.grad_clip", "nan", "a finite number, 0 or more (0: no clipping)", "Fix: optim.grad_clip=1.0"),
    ("optim.min_lr_ratio", "1.5", "a finite number in [0, 1]", "Fix: optim.min_lr_ratio=0.1"),
    ("model.rope_scaling", "-8", "a finite number, 0 or more", "Fix: model.rope_scaling=0.0"),
    ("model.moe.route_scale", "0", "positive", "Fix: model.moe.route_scale=1.0"),
    ("model.moe.imbalance", "0.5", "between 1 (an even split)", "Fix: model.moe.imbalance=1.0"),
    ("launcher.health.slowdown", "1", "a finite number above 1", "Fix: launcher.health.slowdown=2.0"),
    ("launcher.straggler_ratio", "0.5", "a finite number above 1", "Fix: launcher.straggler_ratio=1.5"),
    ("launcher.hang_timeout_s", "-5", "a finite number, 0 or more", "Fix: launcher.hang_timeout_s=0.0"),
    ("cluster.hbm_gbps", "0", "positive", "Fix: cluster.hbm_gbps=<your hardware's figure>"),
    ("cluster.matmul_efficiency", "1.5", "a finite number in (0, 1]", "Fix: cluster.matmul_efficiency=<your"),
]


@pytest.mark.parametrize("key,value,words,fix", REFUSED, ids=[f"{k}={v}" for k, v, _, _ in REFUSED])
def test_out_of_range_floats_are_refused_naming_key_value_range_and_fix(key, value, words, fix):
    """Mutants: any row's bounds loosened (nan, zero or a negative value passes), the fix left out."""
    mine = [p for p in refusals_of(f"{key}={value}") if p.startswith(f"{key}=")]
    assert len(mine) == 1, mine  # one place per rule: no second check saying it again
    shown = str(float(value))
    assert mine[0].startswith(f"{key}={shown} must be {words}") and fix in mine[0], mine[0]


def test_a_source_weight_is_refused_by_its_element():
    """data.sources[i].weight: the rule of data.sources[].weight, the element named. Mutant: the walk
    skipping lists."""
    found = refusals("data.source=shards", "data.sources=[{path: a, weight: 1}, {path: b, weight: nan}]")
    assert any(p.startswith("data.sources[1].weight=nan must be positive") and "drop the source" in p for p in found), found
    assert not any(p.startswith("data.sources[0].weight") for p in found)


def test_rope_scaling_needs_the_high_frequency_factor_above_the_low_one():
    """Llama 3.1 scaling divides by (high - low). Mutant: the cross-key check removed (equal factors
    reach the ranks: nan frequencies)."""
    found = refusals_of("model.rope_scaling=8", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=4")
    assert any("model.rope_high_freq_factor=4.0 must be above model.rope_low_freq_factor=4.0" in p
               and "Fix: model.rope_low_freq_factor=1.0 model.rope_high_freq_factor=4.0" in p for p in found), found
    assert not [p for p in refusals_of("model.rope_low_freq_factor=4", "model.rope_high_freq_factor=4")
                if "rope_" in p]  # scaling off: the factors are never used


@pytest.mark.parametrize("override,says", [
    ("data.eos_id=-5", "data.eos_id=-5 is no token id: an id is 0 or more, and -1 takes the shards' own. Fix: data.eos_id=-1"),
    ("optim.warmup_steps=-3", "optim.warmup_steps=-3 must be 0 or more. Fix: optim.warmup_steps=10 (the default)"),
    ("train.max_skipped_steps=-1", "train.max_skipped_steps=-1 must be 0 or more"),
    ("checkpoint.load_step=-2", "checkpoint.load_step=-2 names no step"),
    ("cluster.nics_per_node=0", "cluster.nics_per_node=0 must be at least 1"),
    ("model.rope_original_max_seq_len=0", "model.rope_original_max_seq_len=0 must be at least 1"),
])
def test_whole_numbers_out_of_range_are_refused(override, says):
    """Mutants: the row removed from POSITIVE / NOT_NEGATIVE; the eos_id or load_step check removed."""
    found = refusals_of(override)
    assert any(says in p for p in found), found


def test_the_presets_in_conf_are_in_range():
    """Every float a conf/ file sets holds its rule: a rule too strict for a real cluster or model fails
    here, not on a user's login node. Mutant: cluster.matmul_efficiency's range (0, 0.5]."""
    checked = 0
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        group = path.parent.name
        data = yaml.safe_load(path.read_text()) or {}
        prefix = "" if group in ("conf", "experiment", "sweep") else f"{group}."
        for key, value in _flat(data, prefix):
            if key in cc.RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
                assert cc.range_of(key).holds(float(value)), f"{path.relative_to(REPO)}: {key}={value}"
                checked += 1
    assert checked > 30


def _flat(d, prefix: str):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_the_command_refuses_before_planning_where_the_planner_crashed():
    """`python -m hpctrain cluster.peak_tflops=0 dry_run=true` ended in a ZeroDivisionError traceback from
    the planner; now it is refused with the key (exit 2, no traceback). Mutant: the cluster rows removed."""
    proc = run_main("hpctrain", "+experiment=tiny", "cluster.peak_tflops=0", "optim.lr=nan", "dry_run=true")
    assert proc.returncode == 2, proc.stderr
    assert "this config cannot run (2 problems)" in proc.stderr
    assert "cluster.peak_tflops=0.0 must be positive" in proc.stderr and "optim.lr=nan must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_check_raises_one_error_naming_every_bad_float():
    with pytest.raises(ConfigError) as e:
        cc.check(compose(["+experiment=tiny", "model.norm_eps=nan", "model.init_std=-1", "optim.eps=0"]))
    text = str(e.value)
    assert "(3 problems)" in text and "model.norm_eps=nan" in text and "model.init_std=-1.0" in text
