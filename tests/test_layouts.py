"""Every parallel layout of the engine against the plain single-process reference (tests/reference.py):
loss and gradient norm per step and the validation loss after the last, fp32 on CPU/gloo. Many layouts share one launch per world size."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.compose import compose
from hpctrain.launch.local import launch

from reference import reference_run

STEPS = 4
# fp32: layouts add the same numbers in other orders (shards, micro-batches, pipeline stages).
LOSS_TOL = 2e-5
NORM_TOL = 1e-4
WORKER = str(Path(__file__).with_name("layout_worker.py"))

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
LAYOUTS = {
    2: ["parallel.zero=1", "parallel.zero=2", "parallel.zero=3", "parallel.zero=0",
        "parallel.tp=2 parallel.dp_shard=1", "parallel.tp=2 parallel.dp_shard=1 parallel.zero=1",
        "parallel.zero=3 parallel.ac=full", "parallel.zero=2 parallel.ac=selective",
        "parallel.zero=3 parallel.grad_sync=step", "parallel.zero=2 parallel.grad_sync=step",
        "parallel.zero=0 parallel.grad_sync=microbatch",
        *(f"parallel.pp=2 parallel.dp_shard=1 parallel.pp_schedule={s}" for s in SCHEDULES)],
    4: ["parallel.dp_replicate=2 parallel.dp_shard=2",
        "parallel.tp=2 parallel.pp=2 parallel.dp_shard=1"],
    8: ["parallel.dp_shard=2 parallel.tp=2 parallel.pp=2"],
}


@pytest.fixture(scope="module")
def reference():
    from layout_worker import COMMON

    return reference_run(compose([*COMMON, f"train.steps={STEPS}"]), STEPS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world, layouts in LAYOUTS.items():
        d = tmp_path_factory.mktemp(f"world{world}")
        rc = launch(d, world, cmd=[sys.executable, WORKER, str(d / "out.json"), str(STEPS), *layouts])
        assert rc == 0, (d / "logs").as_posix()
        out.update({(world, k): v for k, v in json.loads((d / "out.json").read_text()).items()})
    return out


@pytest.mark.parametrize("world,layout", [(w, l) for w, ls in LAYOUTS.items() for l in ls])
def test_layout_matches_single_process(results, reference, world, layout):
    got = results[(world, layout)]
    ref_loss, ref_norm = reference["loss"], reference["grad_norm"]
    for step in range(STEPS):
        assert abs(got["loss"][step] - ref_loss[step]) <= LOSS_TOL * max(1, ref_loss[step]), \
            (step + 1, got["loss"], ref_loss)
        assert abs(got["grad_norm"][step] - ref_norm[step]) <= NORM_TOL * max(1, ref_norm[step]), \
            (step + 1, got["grad_norm"], ref_norm)
    # Validation (forward only, a sampler of its own; pipeline layouts through schedule.eval) after
    # the last step, on the same validation samples as the reference.
    assert abs(got["val"] - reference["val"]) <= LOSS_TOL * max(1, reference["val"]), (got["val"], reference["val"])
