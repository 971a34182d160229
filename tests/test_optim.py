"""The learning-rate schedule: linear warmup to the peak, cosine decay to min_lr_ratio."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.core.schema import OptimConfig
from hpctrain.train.optim import build_optimizer, lr_factor

WARMUP, TOTAL, MIN = 10, 100, 0.1


def f(step, warmup=WARMUP, total=TOTAL, min_ratio=MIN):
    return lr_factor(step, warmup, total, min_ratio)


def test_warmup_is_linear_and_peaks_at_its_end():
    ramp = [f(s) for s in range(WARMUP)]
    diffs = [b - a for a, b in zip(ramp, ramp[1:])]
    assert all(d == pytest.approx(1 / WARMUP) for d in diffs)
    assert ramp[0] == pytest.approx(1 / WARMUP)  # step 0 already trains
    assert ramp[-1] == pytest.approx(1.0)  # peak at the last warmup step
    assert f(WARMUP) == pytest.approx(1.0)  # decay starts from the peak
    assert max(f(s) for s in range(TOTAL)) == pytest.approx(1.0)


def test_cosine_decay_is_monotone_and_bounded():
    decay = [f(s) for s in range(WARMUP, TOTAL + 5)]
    assert all(b <= a + 1e-12 for a, b in zip(decay, decay[1:]))
    assert all(MIN - 1e-12 <= x <= 1.0 for x in decay)
    # Cosine shape: halfway between the peak and the floor halfway through the decay.
    mid = WARMUP + (TOTAL - WARMUP) // 2
    assert f(mid) == pytest.approx(MIN + (1 - MIN) / 2, abs=0.02)
    assert f(TOTAL) == pytest.approx(MIN)
    assert f(TOTAL + 50) == pytest.approx(MIN)  # clamped past the end


def test_cosine_reaches_min_lr_ratio_at_the_last_step():
    # The run's optimizer steps are 0 .. total-1; the last one should use min_lr_ratio * lr.
    assert f(TOTAL - 1) == pytest.approx(MIN, abs=1e-9)


def test_no_warmup_starts_at_peak():
    assert f(0, warmup=0) == pytest.approx(1.0)
    assert f(50, warmup=0) < 1.0


@pytest.mark.parametrize("min_ratio", [0.0, 0.5, 1.0])
def test_min_ratio(min_ratio):
    assert f(TOTAL, min_ratio=min_ratio) == pytest.approx(min_ratio)
    assert f(WARMUP, min_ratio=min_ratio) == pytest.approx(1.0)


def test_scheduler_follows_lr_factor():
    o = OmegaConf.structured(OptimConfig(lr=0.01, warmup_steps=3, min_lr_ratio=0.2, impl="for_loop"))
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt, sched = build_optimizer([w, b], o, total_steps=12)
    # Norm-like (1-D) parameters are not decayed.
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for step in range(12):
        assert sched.get_last_lr()[0] == pytest.approx(0.01 * lr_factor(step, 3, 12, 0.2))
        opt.step()
        sched.step()
    assert math.isclose(lr_factor(12, 3, 12, 0.2), 0.2)
