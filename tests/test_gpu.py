"""Every CUDA path, on one GPU: `pytest -m gpu` where a GPU exists (benchmarks/gpu_check.sh runs it on a
lent machine). Skipped where torch sees no CUDA device: a skip here proves nothing and is not counted
as passing.

- NCCL bootstrap with world size 1 through the normal `hpctrain.run` path (the `cpu:gloo,cuda:nccl` group);
- the small model in bf16 with FSDP2, with and without torch.compile, against fp32 on the CPU;
- optimizer offload with pinned host memory under FSDP2 (ZeRO-3) and DDP (ZeRO-1 over one rank), against
  no offload, with real CUDA streams and events; NVMe offload for a few steps;
- an async checkpoint saved from device memory, resumed bit for bit;
- the collectives benchmark's NCCL path on one GPU (proves the path; no bandwidth claim).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from hpctrain.core.rundir import read_jsonl  # noqa: E402

from helpers import REPO, run_cli  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: nothing to check here")]

GPU = ("cluster=h200", "launcher=local", "launcher.nproc=1", "cluster.device=cuda")
CPU = ("cluster=cpu", "launcher=local", "launcher.nproc=1")
SMALL = ("+experiment=tiny", "model=small", "data.seq_len=256", "train.global_batch=8", "train.micro_batch=4",
         "train.steps=6", "optim.warmup_steps=2")
BF16_TOL = 3e-2  # bf16 matmuls against fp32: ~8 bits of mantissa over a few steps


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def close(a: list, b: list, rel: float) -> None:
    assert len(a) == len(b), (a, b)
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rel * max(1.0, abs(y)), (step, x, y)


@pytest.fixture(scope="module")
def cpu_fp32(tmp_path_factory) -> list[float]:
    d = tmp_path_factory.mktemp("cpu_fp32")
    run_cli(*SMALL, *CPU, f"run.dir={d}", timeout=600)
    return losses(d)


def test_nccl_bootstrap_world_of_one(tmp_path):
    proc = run_cli("+experiment=tiny", *GPU, "train.steps=3", f"run.dir={tmp_path}", timeout=600)
    log = proc.stderr
    assert "backend nccl" in log and "device cuda:0" in log, log[-3000:]
    assert "completed at step 3" in log
    assert len(losses(tmp_path)) == 3


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_bf16_fsdp2_matches_fp32_on_cpu(tmp_path, cpu_fp32, compile_):
    run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=bf16", f"train.compile={str(compile_).lower()}",
            f"run.dir={tmp_path}", timeout=900)
    close(losses(tmp_path), cpu_fp32, BF16_TOL)


@pytest.mark.parametrize("zero", [3, 1])
def test_pinned_cpu_offload_matches_no_offload(tmp_path, zero):
    ref, off = tmp_path / "ref", tmp_path / "off"
    run_cli(*SMALL, *GPU, f"parallel.zero={zero}", f"run.dir={ref}", timeout=600)
    run_cli(*SMALL, *GPU, f"parallel.zero={zero}", "offload=cpu", "offload.pin_memory=true", f"run.dir={off}",
            timeout=600)
    close(losses(off), losses(ref), 1e-4)  # fp32: the host AdamW kernel against torch's fused CUDA AdamW


def test_nvme_offload_steps(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run_cli(*SMALL, *GPU, "train.steps=3", "offload=nvme", f"offload.path={nvme}", f"run.dir={tmp_path / 'run'}",
            timeout=600)
    assert len(losses(tmp_path / "run")) == 3 and list(nvme.iterdir()) == []  # state files unlinked


def test_async_checkpoint_from_device_resumes_bit_for_bit(tmp_path):
    common = ("+experiment=tiny", *GPU, "train.steps=6", "checkpoint.every=3", "checkpoint.async_save=true",
              f"run.dir={tmp_path}")
    run_cli(*common, timeout=600)
    whole = losses(tmp_path)
    again = run_cli(*common, "checkpoint.load_step=3", timeout=600)
    assert "resumed from checkpoint step 3" in again.stdout
    assert losses(tmp_path) == whole


def test_collectives_benchmark_nccl_path(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain.bench.collectives", "--nproc", "1", "--backend", "nccl",
                           "--ops", "all_reduce", "--max-bytes", "1M", "--iters", "2", "--warmup", "1",
                           "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nccl" in proc.stdout + proc.stderr


def test_forked_ranks_initialise_cuda_themselves(tmp_path):
    """The local launcher's fork server imports torch (PRELOAD) but must never touch CUDA: each forked rank
    initialises it on its own. Mutant: a CUDA call in the server before the fork ("Cannot re-initialize
    CUDA in forked subprocess" in every rank)."""
    from hpctrain.launch.local import launch

    script = tmp_path / "rank.py"
    script.write_text("import os, torch\n"
                      "x = torch.ones(1024, device='cuda') * (int(os.environ['RANK']) + 1)\n"
                      "torch.cuda.synchronize()\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'ok-' + os.environ['RANK']), 'w').write(str(float(x.sum())))\n")
    assert launch(tmp_path / "run", 2, cmd=[sys.executable, str(script)]) == 0
    assert [(tmp_path / f"ok-{r}").read_text() for r in (0, 1)] == ["1024.0", "2048.0"]
