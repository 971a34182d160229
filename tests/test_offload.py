"""Optimizer offload (offload=cpu|nvme): the same numbers as torch's AdamW, the state off the model,
checkpoints that carry it, and clear errors for bad or full offload directories.

Tolerances: the host kernel computes AdamW in fp32 with the arithmetic of torch's fused CPU AdamW; it
is compiled by Inductor, which may contract or reorder a few operations, so parameters differ from
torch.optim.AdamW(fused=True) by a few ulp per step (observed <= 5e-7 absolute after 5 steps); losses
of whole training runs agree to 2e-6 relative. Resuming from a checkpoint is bit-exact.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.core.compose import compose
from hpctrain.offload import HostAdamW, OffloadError
from hpctrain.offload import nvme as nvme_mod
from hpctrain.offload.adam_kernel import AdamKernel
from hpctrain.checkpoint.directio import aligned_empty, open_direct
from hpctrain.offload.aio import AsyncIO

PARAM_TOL = 2e-6  # |param - torch AdamW| after a few steps, fp32
LOSS_TOL = 2e-6  # relative, whole runs with and without offload
NORM_TOL = 1e-5
WORKER = str(Path(__file__).with_name("offload_worker.py"))
BASE = ("+experiment=tiny", "launcher.nproc=1", "train.global_batch=4", "train.micro_batch=2",
        "data.seq_len=16", "optim.warmup_steps=1")
SMALL = dict(chunk_bytes=64 << 10, block_bytes=16 << 10, buffer_count=3, queue_depth=4)  # many chunks


# ---------------------------------------------------------------- helpers

def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 3000), torch.nn.LayerNorm(3000),
                               torch.nn.Linear(3000, 7)).to(dtype)


def _groups(m):
    ps = list(m.parameters())
    return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]


def _train(m, opt, steps=5, dtype=torch.float32):
    torch.manual_seed(1)
    for _ in range(steps):
        loss = m(torch.randn(32, 64, dtype=dtype)).float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # clipped in place before the step
        opt.step()
        opt.zero_grad()
    return m


def _max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def reference():
    m = _model()
    opt = torch.optim.AdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95), fused=True)
    return _train(m, opt), opt


# ---------------------------------------------------------------- the kernel and the optimizer

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cpp", "compile", "fused"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_fused_adamw(kind, gdtype):
    n = 100_003
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n).to(gdtype)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    k = AdamKernel(kind)
    assert k.active == kind
    for step in (1, 2, 3):
        gs = (g.float() * step).to(gdtype)
        ref.grad = gs.float()
        opt.step()
        # an odd split: kernels must not assume alignment or whole tensors
        for a, b in ((0, 3), (3, n)):
            k.step(p[a:b], gs[a:b], m[a:b], v[a:b], out[a:b], lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, step=step)
    assert (p - ref.detach()).abs().max() <= PARAM_TOL
    assert (m - opt.state[ref]["exp_avg"]).abs().max() <= 1e-6
    assert (v - opt.state[ref]["exp_avg_sq"]).abs().max() <= 1e-6
    assert torch.equal(out, p.bfloat16())  # the low-precision copy, written in the same pass
    out16 = torch.empty(n, dtype=torch.float16)
    k.step(p, gs, m, v, out16, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=4)
    assert torch.equal(out16, p.half())


@pytest.mark.parametrize("target", ["cpu", "nvme", "nvme-buffered"])
def test_offloaded_adamw_matches_torch_adamw(reference, tmp_path, target):
    ref, ref_opt = reference
    kw = dict(target="cpu") if target == "cpu" else dict(
        target="nvme", path=str(tmp_path), direct_io=target == "nvme", **SMALL)
    m = _model()
    opt = HostAdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95), offload=kw)
    _train(m, opt)
    assert _max_diff(ref, m) <= PARAM_TOL
    if target != "cpu":
        assert len(opt._pieces) > 10  # streamed through many chunks and few buffers
        assert os.listdir(tmp_path) == []  # the files are unlinked at once: nothing to clean up
        assert opt.host_bytes() < opt.state_bytes()  # only the chunk buffers live in host memory
    st = opt.state
    for a, b in zip(ref.parameters(), m.parameters()):
        assert set(st[b]) == {"step", "exp_avg", "exp_avg_sq"}  # torch.optim.AdamW's names
        assert float(st[b]["step"]) == 5
        assert (st[b]["exp_avg_sq"] - ref_opt.state[a]["exp_avg_sq"]).abs().max() <= 1e-8
    opt.close()


@pytest.mark.parametrize("master_on_nvme", [False, True])
def test_bf16_parameters_keep_fp32_master_weights(tmp_path, master_on_nvme):
    """bf16 parameters: fp32 master weights live with the optimizer (and in its state for checkpoints);
    the kernel writes the bf16 copy in the same pass. Same trajectory as fp32 AdamW on the master."""
    m16 = _model(torch.bfloat16)
    opt = HostAdamW(_groups(m16), lr=1e-2, betas=(0.9, 0.95),
                    offload=dict(target="nvme", path=str(tmp_path), master_on_nvme=master_on_nvme, **SMALL))
    _train(m16, opt, steps=3, dtype=torch.bfloat16)
    st = opt.state
    for p in m16.parameters():
        assert st[p]["master"].dtype == torch.float32
        assert torch.equal(st[p]["master"].bfloat16(), p.detach())
    opt.close()


@pytest.mark.parametrize("target", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerator_code_path_emulated(tmp_path, target, dtype):
    """No accelerator here: run the staging path (gradients to pinned staging, fp32 master weights kept
    apart from the parameters, weights copied back per chunk) with copies that complete at once. Same
    numbers as the host path; after the state was handed out (a checkpoint load may replace the
    parameters) the master weights are re-read from the parameters."""
    kw = dict(target=target, path=str(tmp_path), **SMALL)
    runs = []
    for emulate in (False, True):
        m = _model(dtype)
        opt = HostAdamW(_groups(m), lr=1e-2, betas=(0.9, 0.95), offload=dict(kw, emulate_device=emulate))
        _train(m, opt, steps=2, dtype=dtype)
        opt.state  # handed out, as for a checkpoint load ...
        with torch.no_grad():
            for p in m.parameters():  # ... which replaces the parameters
                p.mul_(0.5)
        _train(m, opt, steps=2, dtype=dtype)
        assert (opt._stage is not None) == emulate
        assert all(s.separate_master for s in opt._slots) == (emulate or dtype != torch.float32)
        runs.append(m)
        opt.close()
    if dtype == torch.float32:
        assert _max_diff(*runs) == 0.0
    else:  # bf16: master weights are exposed and never re-read; the halving only touched bf16 copies
        assert _max_diff(*runs) == 0.0


def test_async_io_roundtrip_with_o_direct(tmp_path):
    fd, direct = open_direct(str(tmp_path / "f.bin"), True)
    io = AsyncIO(queue_depth=3, block_bytes=8192)
    src = aligned_empty(1 << 20)
    src.copy_(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8))
    io.write(fd, src, 4096).wait()
    dst = aligned_empty(1 << 20)
    io.read(fd, dst, 4096).wait()
    assert torch.equal(src, dst)
    io.close()
    os.close(fd)


def test_write_error_mid_run_stops_with_clear_message(tmp_path):
    m = _model()
    opt = HostAdamW(_groups(m), lr=1e-2, offload=dict(target="nvme", path=str(tmp_path), **SMALL))
    _train(m, opt, steps=1)
    store = opt._store
    os.close(store.fds["exp_avg"])
    store.fds["exp_avg"] = os.open("/dev/full", os.O_RDWR)  # writes fail with ENOSPC, as a full disk
    with pytest.raises(OffloadError, match=r"writing the offloaded optimizer state .* failed.*disk is full"
                                           r".*newest complete checkpoint"):
        _train(m, opt, steps=1)
    opt.close()


# ---------------------------------------------------------------- offload directories

@pytest.fixture
def tiny_disk(tmp_path):
    mounted: list[Path] = []

    def mount(size: str, ro: bool = False) -> Path:
        mnt = tmp_path / f"disk-{size}{'-ro' * ro}"
        mnt.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs to simulate a small disk: {r.stderr.decode()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)])


def _problems(*overrides):
    from hpctrain.checks.config_checks import compose_checked, problems

    cfg, refused = compose_checked(["+experiment=tiny", *overrides])
    return refused + problems(cfg)


@pytest.mark.slow
def test_check_accepts_offload_and_refuses_bad_paths(tmp_path, tiny_disk):
    assert _problems("offload=cpu") == []
    assert _problems("offload=nvme", f"offload.path={tmp_path}") == []
    assert any("needs a directory" in p and "offload.path=" in p for p in _problems("offload=nvme"))
    missing = _problems("offload=nvme", f"offload.path={tmp_path}/nope")
    assert any("does not exist" in p and "Fix:" in p for p in missing), missing
    (tmp_path / "file").write_text("x")
    assert any("is not a directory" in p for p in _problems("offload=nvme", f"offload.path={tmp_path}/file"))
    ro = tiny_disk("1m", ro=True)
    assert any("not writable" in p for p in _problems("offload=nvme", f"offload.path={ro}"))
    assert any("buffer_count" in p for p in _problems("offload=nvme", f"offload.path={tmp_path}",
                                                       "offload.buffer_count=1"))
    assert any("offload.kernel" in p for p in _problems("offload=cpu", "offload.kernel=fast"))


def test_bad_path_at_run_time_is_a_clear_error(tmp_path, tiny_disk):
    for path, what in ((tmp_path / "nope", "does not exist"), (tiny_disk("1m", ro=True), "not writable")):
        m = _model()
        with pytest.raises(OffloadError, match=what):
            HostAdamW(_groups(m), offload=dict(target="nvme", path=str(path))).step()


def test_full_disk_stops_before_any_state_is_written(tiny_disk, monkeypatch):
    disk = tiny_disk("1m")  # the model's two moments need ~1.6 MB
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(OffloadError) as e:
        _train(m, HostAdamW(_groups(m), offload=dict(target="nvme", path=str(disk))), steps=1)
    msg = str(e.value)
    assert f"offload.path={disk} has" in msg and "free but rank 0 needs" in msg and "Fix:" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # no parameter was touched
    # Space that looked free at the check and is gone by the time the files are reserved
    # (another rank, another program): fallocate's ENOSPC is reported the same way.
    monkeypatch.setattr(nvme_mod, "MARGIN_BYTES", -(1 << 40))
    with pytest.raises(OffloadError, match=r"is full: reserving rank 0's optimizer state .* nothing was written"):
        HostAdamW(_groups(m), offload=dict(target="nvme", path=str(disk))).step()
    assert os.listdir(disk) == []


# ---------------------------------------------------------------- the trainer, world of one

def _trainer(run_dir: Path, *overrides: str):
    from hpctrain.train.loop import Trainer

    cfg = compose([*BASE, f"run.dir={run_dir}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer.of(cfg, str(run_dir), torch.device("cpu"))


def _snapshot(opt) -> dict:
    opt = getattr(opt, "optim", opt)
    return {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["offload=cpu", "offload=nvme"])
def test_checkpoint_carries_offloaded_state_and_resume_is_exact(world_of_one, tmp_path, offload):
    from hpctrain.checkpoint.safe import read_metadata

    od = tmp_path / "nvme"
    od.mkdir()
    off = (offload, f"offload.path={od}")
    whole = _trainer(tmp_path / "a", "train.steps=5", *off)
    whole_losses = whole.fit().losses
    plain = _trainer(tmp_path / "plain", "train.steps=5").fit().losses
    for a, b in zip(whole_losses, plain):  # offload changes where the state lives, not the numbers
        assert abs(a - b) <= LOSS_TOL * abs(b), (whole_losses, plain)

    t = _trainer(tmp_path / "b", "train.steps=5", "checkpoint.every=2", *off)
    first = [t.train_step()[0].item() for _ in range(2)]
    t.step = 2
    t.save(blocking=False)  # async: staged from the views, written in the background
    t.ckpt.wait()
    saved = _snapshot(t.optimizer)
    keys = set(read_metadata(tmp_path / "b" / "checkpoints" / "step-00000002").state_dict_metadata)
    assert {"optim.layers.0.attention.wq.weight.exp_avg", "optim.layers.0.attention.wq.weight.exp_avg_sq",
            "optim.layers.0.attention.wq.weight.step"} <= keys
    getattr(t.optimizer, "optim", t.optimizer).close()

    again = _trainer(tmp_path / "b", "train.steps=5", "checkpoint.every=2", *off)
    again.resume(print)
    assert again.step == 2
    loaded = _snapshot(again.optimizer)
    assert [[torch.equal(x, y) for x, y in zip(a.values(), b.values())] for a, b in
            zip(saved.values(), loaded.values())] == [[True] * 3] * len(saved)
    rest = again.fit().losses
    assert first + rest == whole_losses  # bit-exact
    assert os.listdir(od) == []


@pytest.mark.slow
def test_checkpoints_move_between_offload_and_device_state(world_of_one, tmp_path):
    """Same names in the checkpoint: a run without offload resumes with offload=nvme and vice versa."""
    od = tmp_path / "nvme"
    od.mkdir()
    whole = _trainer(tmp_path / "a", "train.steps=4").fit().losses
    _trainer(tmp_path / "b", "train.steps=4", "checkpoint.every=2").fit()
    t = _trainer(tmp_path / "b", "train.steps=4", "checkpoint.every=2", "checkpoint.load_step=2",
                 "offload=nvme", f"offload.path={od}")
    rest = t.fit().losses
    assert t.resumed_from == 2
    for a, b in zip(rest, whole[2:]):
        assert abs(a - b) <= LOSS_TOL * abs(b), (rest, whole)


# ---------------------------------------------------------------- dp=2, ZeRO 1 and 3, one launch

STEPS = 4
LAYOUTS = [f"parallel.zero={z}{o}" for z in (1, 3) for o in ("", " offload=cpu", " offload=nvme")]
# beyond ZeRO 1 and 3: ZeRO-2 (FSDP2 without resharding) and tensor parallel (DTensor shards on dim 0 and 1)
EXTRA = {"parallel.zero=2": "parallel.zero=2 offload=cpu",
         "parallel.tp=2 parallel.dp_shard=1": "parallel.tp=2 parallel.dp_shard=1 offload=nvme"}
RESUME = ["resume:parallel.zero=3 offload=nvme", "resume:parallel.zero=1 offload=cpu"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from hpctrain.launch.local import launch

    d = tmp_path_factory.mktemp("offload2")
    od = d / "nvme"
    od.mkdir()
    specs = [*LAYOUTS, *(x for kv in EXTRA.items() for x in kv), *RESUME]
    rc = launch(d, 2, cmd=[sys.executable, WORKER, str(d / "out.json"), str(STEPS), str(od), *specs])
    assert rc == 0, (d / "logs").as_posix()
    return json.loads((d / "out.json").read_text())


def _same_run(base: dict, got: dict) -> None:
    for step in range(STEPS):
        assert abs(got["loss"][step] - base["loss"][step]) <= LOSS_TOL * base["loss"][step], (got, base)
        assert abs(got["grad_norm"][step] - base["grad_norm"][step]) <= NORM_TOL * base["grad_norm"][step]
    assert abs(got["param_sum"] - base["param_sum"]) <= 1e-5 * abs(base["param_sum"])
    assert got["model_clean"]  # no optimizer tensor on the model's side


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_dp2_offload_matches_no_offload(two_ranks, zero, offload):
    got = two_ranks[f"parallel.zero={zero} offload={offload}"]
    _same_run(two_ranks[f"parallel.zero={zero}"], got)
    # Under FSDP2 (ZeRO 2/3) the sharded parameters and gradients move to the host with the state.
    assert got["host_params"] is (True if zero >= 2 else None)
    if offload == "nvme":  # only streaming buffers in host memory: at most 4 sets x 2 moments x 1 MiB
        assert got["host_bytes"] <= 4 * 2 * (1 << 20) + 4096
    else:
        assert got["host_bytes"] >= got["state_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("base", list(EXTRA))
def test_zero2_and_tensor_parallel_offload_match(two_ranks, base):
    _same_run(two_ranks[base], two_ranks[EXTRA[base]])
    # FSDP2 holds the parameters on the host; with tensor parallel they stay on the device
    assert two_ranks[EXTRA[base]]["host_params"] is ("zero=2" in base)


@pytest.mark.slow
@pytest.mark.parametrize("spec", RESUME)
def test_dp2_offloaded_resume_matches_uninterrupted(two_ranks, spec):
    r = two_ranks[spec]
    assert r["resumed_from"] == 2
    assert r["resumed"] == r["uninterrupted"][2:]
    assert r["param_sum_resumed"] == r["param_sum_uninterrupted"]


@pytest.mark.slow
def test_dp2_leaves_no_files(two_ranks):
    assert two_ranks["_leftover_files"] == []


@pytest.fixture(scope="module")
def transformers_reference():
    from offload_worker import COMMON
    from reference import reference_run

    return reference_run(compose([*COMMON, f"train.steps={STEPS}"]), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [s for s in [*LAYOUTS, *EXTRA.values()] if "offload=" in s])
def test_dp2_offload_matches_transformers(two_ranks, transformers_reference, spec):
    """Offloaded runs against the independent reference too (transformers + torch.optim.AdamW), at the
    layout tests' tolerance (fp32 sums in other orders), not only against hpctrain without offload."""
    got, ref = two_ranks[spec], transformers_reference
    for step in range(STEPS):
        assert abs(got["loss"][step] - ref["loss"][step]) <= 2e-5 * max(1, ref["loss"][step]), (got["loss"], ref["loss"])
        assert abs(got["grad_norm"][step] - ref["grad_norm"][step]) <= 1e-4 * max(1, ref["grad_norm"][step])
