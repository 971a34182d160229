"""Sequence-parallel inputs re-gathered in backward (parallel.sp_regather, hpctrain.parallel.regather):
the activation memory it frees, measured, against what the planner says it frees. The numerics are
tests/test_layouts.py's (TP layouts with and without it match the Hugging Face reference)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.compose import compose
from hpctrain.launch.local import launch
from hpctrain.plan.memory import activations, job_of

WORKER = str(Path(__file__).with_name("regather_probe.py"))
TP = "parallel.tp=2 parallel.dp_shard=1"
# (blocks, re-gathered) -> layout
LAYOUTS = {(n, again): f"{TP} model.n_layers={n}" + ("" if again else " parallel.sp_regather=false")
           for n in (2, 4) for again in (False, True)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("regather")
    rc = launch(d, 2, cmd=[sys.executable, WORKER, str(d / "out.json"), *LAYOUTS.values()])
    assert rc == 0, (d / "logs").as_posix()
    got = json.loads((d / "out.json").read_text())
    return {key: got[layout] for key, layout in LAYOUTS.items()}


def predicted(layout: str) -> float:
    from regather_probe import COMMON

    job = job_of(compose([*COMMON, "launcher.nproc=2", *layout.split()]))
    return activations(job, 0)["activations"]


def freed(measured, n: int) -> list:
    return [kept["forward"] - again["forward"] for kept, again in zip(measured[n, False], measured[n, True])]


def test_regather_frees_what_the_planner_says(measured):
    """Per rank, the bytes a forward leaves alive for backward fall by the gathered inputs of the
    column-parallel linears less this rank's half of them: 8 x 1024 tokens of dim 128 in fp32, 4 MiB
    per gathered input, 2 a block and 1 for the output layer, each kept as a 2 MiB shard (10 MiB with
    2 blocks, 18 with 4). With hooks that pack nothing, or one shard per linear instead of per input,
    the figures differ."""
    pred = {n: predicted(LAYOUTS[n, False]) - predicted(LAYOUTS[n, True]) for n in (2, 4)}
    assert pred[2] == pytest.approx(10 * 2**20) and pred[4] == pytest.approx(18 * 2**20)
    for n in (2, 4):
        for kept, again in zip(measured[n, False], measured[n, True]):
            assert kept["loss"] == pytest.approx(again["loss"], rel=1e-6)
            assert kept["forward"] - again["forward"] == pytest.approx(pred[n], rel=0.02), (n, kept, again)
