"""Every CUDA path, on one GPU: `pytest -m gpu` where a GPU exists (benchmarks/gpu_check.sh runs it on a
lent machine). Skipped where torch sees no CUDA device: a skip here proves nothing and is not counted
as passing.

- NCCL bootstrap with world size 1 through the normal `hpctrain.run` path (the `cpu:gloo,cuda:nccl` group);
- the small model in bf16 with FSDP2, with and without torch.compile, against fp32 on the CPU;
- optimizer offload with pinned host memory under FSDP2 (ZeRO-3) and DDP (ZeRO-1 over one rank), against
  no offload, with real CUDA streams and events; NVMe offload for a few steps;
- an async checkpoint saved from device memory, resumed bit for bit;
- the collectives benchmark's NCCL path on one GPU (proves the path; no bandwidth claim);
- Mixture-of-Experts: the grouped GEMM in bf16 against the loop, the all-to-all dispatcher over NCCL, and
  the MoE model trained in bf16;
- long context: the attention pairs context parallelism computes (matmul path) and the document mask on
  CUDA against SDPA, torch's context_parallel (the default CP kernel on CUDA) dispatching CUDA's SDPA
  through its ring on a cp group of one, and document-masked training in bf16 against fp32 on the CPU.
  (CP over two ranks needs two GPUs: NCCL refuses two ranks on one device.)
- LoRA in bf16 (frozen base stored in bf16, fp32 adapters) under FSDP2 and under DDP's autocast, against
  fp32 on the CPU;
- a memory snapshot (checkpoint.memory_every) of device tensors through the pinned buffer and its event.
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


def test_bf16_gradient_reduction_over_nccl_tracks_fp32_on_the_cpu(tmp_path, cpu_fp32):
    """train.reduce_precision=bf16: FSDP2 casts each gradient to bf16 for NCCL's reduce-scatter and back
    into its fp32 shard; the run tracks the CPU's fp32 losses as plain bf16 does."""
    run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=bf16", "train.reduce_precision=bf16",
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


# ------------------------------------------------------------------------- Mixture-of-Experts on CUDA

def test_moe_grouped_gemm_in_bf16_matches_the_loop_on_cuda():
    """torch._grouped_mm's CUDA kernel in bf16 against the per-expert loop (forward and every gradient),
    uneven rows per expert and an expert with none."""
    from hpctrain.models.moe import grouped_swiglu, looped_swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 37, 200, 19], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, generator=g) / 16,
          torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16, generator=g) / 22,
          torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, generator=g) / 16]
    dy = torch.randn(x.shape[0], 256, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = []
    for fn in (grouped_swiglu, looped_swiglu):
        xi = x.clone().requires_grad_()
        wi = [w.clone().requires_grad_() for w in ws]
        y = fn(xi, counts, *wi)
        y.backward(dy)
        outs.append([y, xi.grad, *(w.grad for w in wi)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_moe_training_with_the_nccl_all_to_all_dispatcher(tmp_path):
    """The expert-parallel dispatcher's all_to_all_single over NCCL (a group of one: the exchange runs
    through NCCL's kernels to this rank itself), bf16 MoE layer, against the same layer without it:
    output and every gradient."""
    import os

    import torch.distributed as dist

    from hpctrain.core.schema import ModelConfig, MoEConfig
    from hpctrain.models.moe import MoE
    from hpctrain.models.dispatch import LocalDispatcher
    from hpctrain.parallel.dispatch import AllToAllDispatcher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("HPCTRAIN_TEST_PORT", "29533"))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        torch.manual_seed(0)
        layer = MoE(ModelConfig(dim=256, moe=MoEConfig(experts=8, top_k=2, ffn_dim=512))).cuda().bfloat16()
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, p.shape[-1] ** -0.5)
            layer.router.bias.zero_()
        x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
        outs, grads = [], []
        for dispatcher in (LocalDispatcher(), AllToAllDispatcher(dist.group.WORLD, 8)):
            layer.dispatcher = dispatcher
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            y.float().pow(2).mean().backward()
            outs.append(y.detach())
            grads.append({n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[1], outs[0])
        assert set(grads[1]) == set(grads[0]) and "experts.w1" in grads[0]
        for name, g in grads[0].items():  # the exchange moves rows, never changes them: the same gradients
            torch.testing.assert_close(grads[1][name], g, msg=name)
    finally:
        dist.destroy_process_group()


def test_moe_tiny_trains_on_cuda_in_bf16(tmp_path):
    """The MoE model end to end on the GPU (FSDP2, bf16, grouped GEMMs, router metrics)."""
    run_cli("+experiment=tiny", "model=moe_tiny", *GPU, "train.precision=bf16", "train.steps=4",
            f"run.dir={tmp_path}", timeout=600)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"] and "expert_share_max" in rows[-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_document_attention_on_cuda_equals_sdpa(dtype):
    """Long context's attention pairs off the CPU (the matmul path context parallelism uses on CUDA) and
    the document-masked local path (SDPA with the boolean mask) against torch's SDPA with the whole mask."""
    import torch.nn.functional as F

    from hpctrain.models import attention as A

    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=dt, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=dt, generator=gen, requires_grad=True) for _ in range(2))
    docs = torch.cumsum((torch.rand(2, 256, device="cuda", generator=gen) < 0.02).long(), 1)
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    ids = list(range(4))
    got = A.ChunkAttention.apply(q, k, v, ids, ids, docs, docs, None)
    tol = dict(atol=2e-2, rtol=2e-2) if dt == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(A.causal_attention(q, k, v, docs), want, **tol)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("kind", ["allgather", "ring"])
def test_torch_context_parallel_on_cuda_equals_sdpa(kind):
    """parallel.cp_kernel=torch (the default on CUDA without a mask): torch's context_parallel dispatch of
    CUDA's SDPA kernels through its ring, on a cp group of one over NCCL (one GPU cannot hold two NCCL
    ranks; the CPU suite checks cp 2 and 4 through the same ring), bf16 with grouped-query K/V, against
    plain SDPA, forward and backward."""
    import os

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.parallel.context_torch import TorchContextParallelAttention, disable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("HPCTRAIN_TEST_PORT", "29534"))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        k, v = (torch.randn(2, 2, 512, 128, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
                for _ in range(2))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        got = TorchContextParallelAttention(init_device_mesh("cuda", (1,)), kind)(q, k, v)
        assert type(got) is torch.Tensor  # the local result, not a DTensor, goes on into wo
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    finally:
        disable()  # later tests in this process get DTensor's SDPA dispatch as it was
        dist.destroy_process_group()


def test_document_masked_training_in_bf16_tracks_fp32_on_the_cpu(tmp_path):
    """The small model on packed documents (the mask on CUDA: SDPA with the boolean mask), bf16 on the GPU
    against fp32 on the CPU."""
    docs = ("data.document_mask=true", "data.eos_id=0", "data.synthetic_doc_len=48", "data.document_positions=true")
    run_cli(*SMALL, *GPU, *docs, "train.precision=bf16", f"run.dir={tmp_path / 'gpu'}", timeout=600)
    run_cli(*SMALL, *CPU, *docs, f"run.dir={tmp_path / 'cpu'}", timeout=600)
    close(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), BF16_TOL)


@pytest.mark.parametrize("zero", [3, 1])
def test_lora_in_bf16_tracks_fp32_on_the_cpu(tmp_path, zero):
    """LoRA on CUDA in bf16: the frozen base stored in bf16 beside fp32 adapters, in FSDP2's groups (ZeRO-3)
    and under autocast (ZeRO-1 over one rank: DDP), against the same run in fp32 on the CPU; the frozen
    weights are bf16 in the checkpoint (they were never given an fp32 copy)."""
    lora = ("model.lora.rank=16", "model.lora.alpha=32", "optim.lr=1e-3", "checkpoint.every=6")
    layout = ("parallel=fsdp",) if zero == 3 else ("parallel=ddp", "parallel.zero=1")
    run_cli(*SMALL, *GPU, *lora, *layout, "train.precision=bf16", f"run.dir={tmp_path / 'gpu'}", timeout=600)
    run_cli(*SMALL, *CPU, *lora, f"run.dir={tmp_path / 'cpu'}", timeout=600)
    close(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), BF16_TOL)
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "gpu" / "checkpoints" / "step-00000006")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in md.state_dict_metadata.items() if k.startswith("model.")
              and hasattr(v, "properties")}
    assert dtypes["model.layers.0.attention.wq.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.attention.wq.lora_A"] == torch.float32


def test_the_finite_check_of_a_save_reads_cuda_tensors_exactly():
    """checkpoint.validate.first_nonfinite on device tensors (the check every save makes): one sum per
    tensor, moved in one transfer per device; a bf16 tensor whose sum overflows but whose elements are
    finite passes, a NaN in the last element of a large one is named. Mutants: the sum trusted alone
    (the overflowing tensor named); only the first slice checked."""
    from hpctrain.checkpoint.validate import FINITE_SLICE, first_nonfinite

    big = torch.full((1 << 16,), 3e38, device="cuda", dtype=torch.bfloat16)  # finite; its sum is not
    state = {"model": {"big": big, "w": torch.zeros(FINITE_SLICE + 5, device="cuda")},
             "step": torch.tensor(3, device="cuda")}
    assert first_nonfinite(state) is None
    state["model"]["w"][-1] = float("nan")
    assert first_nonfinite(state) == "model.w"


def test_cuda_generators_are_restored_for_the_devices_this_process_sees():
    """A checkpoint's per-rank RNG file names more CUDA devices than this process sees (a rank that saw
    every GPU, resumed bound to one): the state check accepts it and the devices both have are restored.
    Mutants: refusing a longer list (every checkpoint unusable); restoring none."""
    from hpctrain.checkpoint import rng

    saved = rng.capture()
    expected = torch.rand(4, device="cuda")
    saved["torch_cuda"] = saved["torch_cuda"] + saved["torch_cuda"][:1] * 8  # 8 more devices than here
    assert rng.state_problem(saved) is None
    torch.rand(100, device="cuda")
    rng.restore(saved)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


# ------------------------------------------------------------------ FP8 (torchao; SM89+, MXFP8 SM100+)

FP8_TOL = 0.10  # float8 against bf16 from the same start: the bound tests/test_fp8.py holds on CPU's emulation


def _fp8_or_skip(capability=(8, 9)):
    pytest.importorskip("torchao", reason="torchao not installed: pip install 'hpctrain[fp8]' (gpu_check.sh: its wheel)")
    cc = torch.cuda.get_device_capability()
    if cc < capability:
        pytest.skip(f"compute capability {cc[0]}.{cc[1]}: float8 needs {capability[0]}.{capability[1]}")


@pytest.mark.parametrize("recipe,compile_", [("tensorwise", False), ("tensorwise", True), ("rowwise", False),
                                             ("rowwise_with_gw_hp", False)])
def test_fp8_on_cuda_tracks_bf16(tmp_path, recipe, compile_):
    """train.precision=fp8 on torchao's real float8 kernels (FSDP2; compiled, torchtitan's setting): the header
    names the float8 linears, and every step's loss is within 10% of bf16's from the same start."""
    _fp8_or_skip()
    flag = f"train.compile={str(compile_).lower()}"
    run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=bf16", flag, f"run.dir={tmp_path / 'bf16'}", timeout=900)
    proc = run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=fp8", f"train.fp8.recipe={recipe}", flag,
                   f"run.dir={tmp_path / 'fp8'}", timeout=900)
    assert f"fp8 ({recipe}, torchao float8 kernels): 56 float8 linears" in proc.stderr, proc.stderr[-3000:]
    close(losses(tmp_path / "fp8"), losses(tmp_path / "bf16"), FP8_TOL)


def test_fp8_all_gather_over_nccl_tracks_bf16(tmp_path):
    """train.fp8.all_gather=true: FSDP2 gathers float8 weights (torchao's WeightWithDynamicFloat8CastTensor),
    their scales precomputed after each optimizer step (hpctrain.parallel.float8.after_optimizer_step);
    over NCCL it trains as fp8 without it does."""
    _fp8_or_skip()
    run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=bf16", f"run.dir={tmp_path / 'bf16'}", timeout=900)
    run_cli(*SMALL, *GPU, "parallel=fsdp", "train.precision=fp8", "train.fp8.all_gather=true",
            f"run.dir={tmp_path / 'ag'}", timeout=900)
    close(losses(tmp_path / "ag"), losses(tmp_path / "bf16"), FP8_TOL)


def test_fp8_moe_experts_on_cuda(tmp_path):
    """The MoE model in fp8 on the GPU: on SM90 torchao's fp8 rowwise grouped GEMM runs the experts (the
    header counts float8 expert groups; elsewhere it says why they stay bf16), routers and output stay
    bf16, and the loss tracks bf16's."""
    _fp8_or_skip()
    over = ("+experiment=tiny", "model=moe_tiny", *GPU, "train.steps=6", "optim.warmup_steps=2")
    run_cli(*over, "train.precision=bf16", f"run.dir={tmp_path / 'bf16'}", timeout=900)
    proc = run_cli(*over, "train.precision=fp8", f"run.dir={tmp_path / 'fp8'}", timeout=900)
    header = [l for l in proc.stderr.splitlines() if "fp8" in l]
    print("\n".join(header))
    assert any("moe.router" in l and "kept in bf16" in l for l in header), header
    if (9, 0) <= torch.cuda.get_device_capability() < (10, 0):
        assert any("2 float8 expert groups" in l for l in header), header
    close(losses(tmp_path / "fp8"), losses(tmp_path / "bf16"), FP8_TOL)


def test_mxfp8_on_sm100_tracks_bf16(tmp_path):
    """train.fp8.recipe=mxfp8 on torchao's MXFP8 kernels (B200 and later): linears and experts."""
    _fp8_or_skip((10, 0))
    over = ("+experiment=tiny", "model=moe_tiny", *GPU, "cluster.compute_capability=10.0", "train.steps=6",
            "optim.warmup_steps=2")
    run_cli(*over, "train.precision=bf16", f"run.dir={tmp_path / 'bf16'}", timeout=900)
    proc = run_cli(*over, "train.precision=fp8", "train.fp8.recipe=mxfp8", f"run.dir={tmp_path / 'fp8'}", timeout=900)
    assert "float8 expert groups" in proc.stderr, proc.stderr[-3000:]
    close(losses(tmp_path / "fp8"), losses(tmp_path / "bf16"), FP8_TOL)


def test_chunked_loss_on_cuda_equals_full_logits_and_liger():
    """The chunked loss's CUDA path in bf16 (hpctrain's torch kernel, and Liger-Kernel's Triton one where it is
    installed: train.loss_kernel=auto picks it on CUDA) against the whole logits in fp32: the loss and both
    gradients."""
    from hpctrain.models.loss import IGNORE, chunked_loss, full_loss, liger_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2, 1500, 512, device="cuda", generator=g)
    w = torch.randn(32000, 512, device="cuda", generator=g) * 0.02
    t = torch.randint(0, 32000, (2, 1500), device="cuda", generator=g)
    t[0, :100] = IGNORE

    def grads(fn, dtype):
        hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()  # leaves each time
        loss = fn(hh, ww)
        loss.backward()
        return loss.float(), hh.grad.float(), ww.grad.float()

    ref = grads(lambda a, b: full_loss(a @ b.t(), t, 1e-4), torch.float32)
    kernels = [lambda a, b: chunked_loss(a, b, t, 512, 1e-4)]
    try:
        import liger_kernel  # noqa: F401
        kernels.append(lambda a, b: liger_loss(a, b, t, 1e-4))
    except ImportError:
        pass
    for fn in kernels:
        got = grads(fn, torch.bfloat16)
        assert abs(got[0] - ref[0]) <= 1e-2 * ref[0]
        for a, b in zip(got[1:], ref[1:]):
            assert (a - b).norm() <= 2e-2 * b.norm()


def test_fp16_on_cuda_tracks_fp32_on_the_cpu(tmp_path, cpu_fp32):
    """train.precision=fp16 on CUDA (FSDP2's float16 parameters, the loss scale): the losses track fp32."""
    run_cli(*SMALL, *GPU, "train.precision=fp16", f"run.dir={tmp_path}", timeout=600)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("loss_scale" in r for r in rows if "loss" in r)
    close(losses(tmp_path), cpu_fp32, BF16_TOL)


def test_dpo_row_losses_on_cuda_equal_the_whole_logits():
    """DPO's per-sequence log-probabilities (train.objective=dpo: hpctrain's chunked head with a sum per row, its
    backward making each chunk's logits again) on CUDA in bf16 against torch's cross-entropy of the whole fp32
    logits: the sums and both gradients, each row weighted by its own incoming gradient."""
    from hpctrain.models.loss import IGNORE, chunked_row_losses, full_row_losses

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4, 700, 512, device="cuda", generator=g)
    w = torch.randn(32000, 512, device="cuda", generator=g) * 0.02
    t = torch.randint(0, 32000, (4, 700), device="cuda", generator=g)
    t[:, :300] = IGNORE  # the prompts
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0], device="cuda")

    def grads(fn, dtype):
        hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()  # leaves each time
        rows = fn(hh, ww)
        (rows.float() * weights).sum().backward()
        return rows.float(), hh.grad.float(), ww.grad.float()

    ref = grads(lambda a, b: full_row_losses(a @ b.t(), t), torch.float32)
    got = grads(lambda a, b: chunked_row_losses(a, b, t, 512), torch.bfloat16)
    assert ((got[0] - ref[0]).abs() <= 1e-2 * ref[0].abs()).all(), (got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        assert (a - b).norm() <= 2e-2 * b.norm()


def test_qlora_nf4_base_on_cuda_equals_its_dequantised_weight():
    """model.lora.quantize=nf4 on CUDA: the NF4 base's product (hpctrain.models.lora.NF4Base, dequantising in the
    forward and again in the backward) in bf16 equals x times torchao's own dequantised weight, value and input
    gradient; the weight stays 4-bit (about 0.52 byte a weight on the device)."""
    from torchao.quantization import to_nf4

    from hpctrain.models.lora import NF4Base
    from hpctrain.parallel.quantize import nf4_bytes

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 512, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q = to_nf4(w)
    x = torch.randn(8, 512, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    y = NF4Base.apply(x, q)
    y.float().square().sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = ref_x @ q.get_original_weight().to(torch.bfloat16).t()
    ref.float().square().sum().backward()
    assert torch.equal(y, ref) and torch.allclose(x.grad, ref_x.grad, rtol=1e-2, atol=1e-3)
    assert nf4_bytes(q) <= 0.53 * w.numel()


def test_memory_snapshot_of_cuda_tensors_round_trips(tmp_path):
    """checkpoint.memory_every on CUDA (issue 47): the snapshot's copy is a non_blocking device-to-host copy into
    a reused pinned buffer, and the writer thread waits for its event before filling the file. The file must hold
    the tensors as they were at the step, not as the next step changed them, and a restore puts them back on the
    device. Mutant: the event not waited for (the file holds what the pinned buffer had before the copy)."""
    from test_memory_snapshot import FakeManager

    from hpctrain.checkpoint.memory import MemorySnapshots

    m = FakeManager(tmp_path / "run")
    m.w = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    m.state["model"]["w"] = m.w
    ms = MemorySnapshots(m, tmp_path / "mem", every=2, plan=None)
    big = torch.randn(4096, 4096, device="cuda")  # keeps the stream busy while the copy is queued
    (big @ big).sum()
    m.w.fill_(2.0)
    assert "snapshot_ms" in ms.after_step(2)
    m.w.fill_(-1.0)  # the next step's update, queued after the copy on the same stream
    ms.wait()
    loaded = ms.prepare(2, "own", None, m.state)
    loaded.apply(m.objects)
    assert m.w.is_cuda and m.w.eq(2.0).all()
    ms.close()
