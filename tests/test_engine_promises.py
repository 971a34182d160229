"""What each ZeRO stage and precision promises, seen inside a real training step (tests/engine_probe.py):
the dtype matmuls run in, the dtype gradients are reduced in, and the bytes of parameters, gradients
and optimizer state each rank holds. For ZeRO 0-3 x fp32/bf16 x (plain data parallel, tp 2, pp 2).

The promises, written here from the ZeRO paper's definitions (Rajbhandari et al. 2020) and the
precision contract of the README, not from hpctrain's code:

| stage | optimizer moments | gradients | parameters while forward runs |
|---|---|---|---|
| 0 (DDP) | whole on every rank | whole | whole (fp32) |
| 1 | 1/dp per rank | whole | whole (fp32) |
| 2 | 1/dp | 1/dp | gathered for the step, in the compute dtype |
| 3 | 1/dp | 1/dp | only the units in use gathered: the rest 1/dp (not under pp: gathered once per step) |

bf16: every matmul in bf16; gradients reduced in fp32; fp32 moments. fp32: everything fp32.
train.reduce_precision=bf16 (FSDP2): gradients reduced in bf16, kept in fp32 (torch's MixedPrecisionPolicy).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.launch.local import launch

WORKER = str(Path(__file__).with_name("engine_probe.py"))
PRECISIONS = ("fp32", "bf16")
# world -> (shape, ZeRO stages) probed at that world size: with data parallel 1 at world 2 (DDP/ZeRO-1
# then shard nothing), with data parallel 2 at world 4 (ZeRO 0/1 there: FSDP2's replicate and the
# optimizer sharded by parameter owner).
SHAPES = {
    2: [("plain", "", (0, 1, 2, 3)), ("step", "parallel.grad_sync=step", (2, 3)),
        ("reduce_bf16", "train.reduce_precision=bf16", (2, 3)),
        ("tp2", "parallel.tp=2 parallel.dp_shard=1", (0, 1)),
        ("pp2", "parallel.pp=2 parallel.dp_shard=1", (0, 1))],
    4: [("tp2", "parallel.tp=2 parallel.dp_shard=2", (0, 1, 2, 3)),
        ("pp2", "parallel.pp=2 parallel.dp_shard=2", (0, 1, 2, 3))],
}
CASES = [(world, name, f"{extra} parallel.zero={z} train.precision={prec}".strip(), z, prec)
         for world, shapes in SHAPES.items() for name, extra, zeros in shapes for z in zeros for prec in PRECISIONS]
ELEM = {"fp32": 4, "bf16": 2}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = {}
    for world in SHAPES:
        layouts = [c[2] for c in CASES if c[0] == world]
        d = tmp_path_factory.mktemp(f"probe{world}")
        rc = launch(d, world, cmd=[sys.executable, WORKER, str(d / "out.json"), *layouts])
        assert rc == 0, (d / "logs").as_posix()
        out.update({(world, k): v for k, v in json.loads((d / "out.json").read_text()).items()})
    return out


def _dp_groups(ranks: list) -> list[list]:
    """Ranks that hold the same parameters (same pipeline stage and tensor-parallel slice)."""
    groups: dict = {}
    for r in ranks:
        groups.setdefault(tuple(r["group"]), []).append(r)
    return list(groups.values())


def _sharded(values: list, full: float, dp: int, slack: float) -> None:
    """Per-rank values of one data-parallel group: together the whole, each about 1/dp of it."""
    assert sum(values) == pytest.approx(full, rel=1e-6), (values, full)
    for v in values:
        assert v <= full / dp + slack, (values, full, dp)


@pytest.mark.slow
@pytest.mark.parametrize("world,shape,layout,zero,precision", CASES,
                         ids=[f"{c[1]}-zero{c[3]}-{c[4]}" for c in CASES])
def test_stage_and_precision_promises(probed, world, shape, layout, zero, precision):
    ranks = probed[(world, layout)]
    for r in ranks:
        # Dtypes: matmuls in the compute precision, gradients reduced and kept in fp32.
        assert r["matmul"] == [{"fp32": "float32", "bf16": "bfloat16"}[precision]], r["matmul"]
        assert r["grad_dtypes"] == ["float32"]
        if r["dp"] > 1 and shape == "reduce_bf16":
            # FSDP2 reduce-scatters the gradients in bf16; the loss's and the norm's all-reduces stay fp32
            # (mutant caught: the engine ignoring spec.dtypes.reduce, its reduce-scatters then fp32)
            assert r["scatter"] == ["bfloat16"] and r["reduce"] == ["bfloat16", "float32"], r["reduce"]
        elif r["dp"] > 1:
            assert r["reduce"] == ["float32"], r["reduce"]
        if zero >= 2 and r["dp"] > 1:
            assert r["gather"] == [{"fp32": "float32", "bf16": "bfloat16"}[precision]], r["gather"]
        assert r["param_dtypes"] == ["float32"]  # at rest the parameters are the fp32 master weights

    for group in _dp_groups(ranks):
        dp, full = group[0]["dp"], group[0]["full"]
        largest = group[0]["largest"]
        moments = [r["moments"] for r in group]
        grads = [r["grads"] for r in group]
        if zero == 0:
            assert moments == [8 * full] * dp
        else:  # ZeroRedundancyOptimizer assigns whole parameters: a rank may hold one more than its share
            _sharded(moments, 8 * full, dp, slack=8 * largest)
        if zero <= 1:
            assert grads == [4 * full] * dp
            assert [r["at_rest"] for r in group] == [4 * full] * dp
        else:
            _sharded(grads, 4 * full, dp, slack=4 * largest / dp + 4 * 64)
            _sharded([r["at_rest"] for r in group], 4 * full, dp, slack=4 * largest / dp + 4 * 64)

        held = [r["after_forward"] for r in group if r["has_output"]]
        gathered = ELEM[precision] * full if zero >= 2 else 4 * full
        if zero <= 2 or shape == "pp2" or dp == 1:
            assert held == [gathered] * len(held), (held, gathered)
        else:  # ZeRO-3: blocks that ran are sharded again; the last block and the root stay for backward
            for h in held:
                assert h < 0.9 * gathered, (held, gathered)


@pytest.mark.parametrize("zero", [2, 3])
def test_gradient_sync_per_micro_batch_or_per_step(probed, zero):
    """parallel.grad_sync, seen in the collectives of one step of 2 micro-batches: ZeRO-2/3 reduce-scatter
    each FSDP unit's gradient after every micro-batch by default (auto), after the last only with
    grad_sync=step; ZeRO-2 gathers each unit once per step, ZeRO-3 in every forward and backward."""
    per_mb = probed[(2, f"parallel.zero={zero} train.precision=fp32")]
    per_step = probed[(2, f"parallel.grad_sync=step parallel.zero={zero} train.precision=fp32")]
    for a, b in zip(per_mb, per_step):
        mb, units = a["microbatches"], a["units"]
        # a unit per block, the embedding's, and the final norm's with the output (not the root's alone,
        # which would gather both vocabulary-sized matrices together)
        assert mb == 2 and units == a["blocks"] + 2, (units, a["blocks"])
        assert b["n_reduce"] == units and a["n_reduce"] == mb * units, (a["n_reduce"], b["n_reduce"], units)
        if zero == 2:
            assert a["n_gather"] == b["n_gather"] == units
        else:  # every unit gathered for forward and again for backward, in each micro-batch (the root stays)
            assert a["n_gather"] == b["n_gather"] > mb * units
