"""QLoRA (model.lora.quantize=nf4): the frozen base of the adapted layers stored as torchao's NF4. The
reference is transformers' Llama with PEFT's LoRA on the dequantised weights, made by torchao's own to_nf4
and get_original_weight (tests/reference.py trains it); every layout equals it; the measured bytes of the
NF4 storages equal the planner's; the planner fits Llama 3 70B QLoRA where people run it; what cannot run
is refused on the login node."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

COMMON = ["+experiment=tiny", "model.dim=256", "train.precision=fp32", "train.global_batch=4", "train.micro_batch=2",
          "optim.lr=0.01", "optim.warmup_steps=0", "optim.grad_clip=0", "checkpoint.every=0", "model.lora.rank=4", "model.lora.alpha=8",
          "model.lora.quantize=nf4"]
STEPS = 3
# hpctrain's layers split by input features under TP (each rank quantises its own columns)
ROWWISE = ("o_proj", "down_proj")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The base (hpctrain's seed weights as a Hugging Face directory), a PEFT adapter with random A and B
    (so that the first step's loss and every gradient depend on both) and, for tp 1 and 2, the base with the
    adapted weights replaced by torchao's dequantised NF4 of each tensor-parallel shard."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    from hpctrain.core.compose import compose
    from reference import hf_dir

    d = tmp_path_factory.mktemp("qlora")
    base = hf_dir(compose(COMMON), d / "base")
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM",
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]))
    model.save_pretrained(d / "adapter")
    weights = load_file(str(base / "model.safetensors"))
    dequantised = {}
    for tp in (1, 2):
        out = d / f"dequantised_tp{tp}"
        shutil.copytree(base, out)
        deq = {}
        for name, w in weights.items():
            if name.endswith("proj.weight"):
                dim = 1 if name.split(".")[-2] in ROWWISE else 0
                w = torch.cat([to_nf4(c.contiguous()).get_original_weight() for c in w.chunk(tp, dim)], dim)
            deq[name] = w
        save_file(deq, str(out / "model.safetensors"), metadata={"format": "pt"})
        dequantised[tp] = out
    return {"base": base, "adapter": d / "adapter", "dequantised": dequantised,
            "common": [*COMMON, f"model.init_from={base}", f"model.lora.init_from={d / 'adapter'}"]}


def reference(start, tp: int) -> dict:
    """transformers + PEFT (the adapter loaded by PEFT) on the dequantised base, STEPS steps of AdamW."""
    from hpctrain.core.compose import compose
    from reference import reference_run

    cfg = compose([*start["common"], f"train.steps={STEPS}"])
    return reference_run(cfg, STEPS, init_dir=start["dequantised"][tp])


def test_one_rank_equals_lora_on_the_dequantised_weights(world_of_one, start, tmp_path):
    """One rank: the first step's loss and every adapter gradient equal PEFT's on the dequantised NF4 weights
    (fp32, 1e-5), and STEPS steps' losses and gradient norms equal reference.py's. Mutants: the base left in
    full precision (the loss moves by the quantisation error, ~1e-3), dequantised with another block size or
    scale mean, the backward through the base without the dequantised weight (wrong input gradients)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpctrain.checkpoint.peft_format import peft_name
    from hpctrain.core import hf_format as hf
    from hpctrain.core.compose import compose
    from hpctrain.core.shape import is_adapter
    from hpctrain.train.loop import Trainer
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    cfg = compose([*start["common"], f"train.steps={STEPS}", f"run.dir={tmp_path}"])
    t = Trainer.of(cfg, str(tmp_path), torch.device("cpu"))
    t.resume(lambda *a: None)
    grads = {}

    def first_grads(*_):
        if not grads:
            grads.update({n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                          for n, p in t.parts[0].named_parameters() if p.grad is not None})

    t.optimizer.register_step_pre_hook(first_grads)
    batch = []
    take = t.sampler.next_step
    t.sampler.next_step = lambda: batch.append(take()) or batch[-1]
    ours = [t.train_step() for _ in range(STEPS)]
    ref = reference(start, 1)
    assert [loss.item() for loss, _ in ours] == pytest.approx(ref["loss"], rel=1e-5)
    assert [float(n) for _, n in ours] == pytest.approx(ref["grad_norm"], rel=1e-5)

    # the first step's gradients, tensor by tensor, against PEFT's on the same rows
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(start["dequantised"][1], dtype=torch.float32,
                                                                          attn_implementation="eager"),
                                      start["adapter"], is_trainable=True)
    rows = torch.cat([x for x, _ in batch[0]])
    targets = torch.cat([y for _, y in batch[0]])
    loss = torch.nn.functional.cross_entropy(model(input_ids=rows).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    assert loss.item() == pytest.approx(ours[0][0].item(), rel=1e-5)
    theirs = dict(model.named_parameters())
    arch = hf.architecture(cfg.model)
    names = [n for n in get_model_state_dict(t.parts[0]) if is_adapter(n)]
    assert len(names) == 2 * 7 * cfg.model.n_layers
    for n in names:
        mine = grads[n]
        peft = theirs[peft_name(n, arch).replace(".weight", ".default.weight")].grad
        torch.testing.assert_close(mine, peft, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")

    # export: the adapter-only checkpoint (checkpoint.weights=auto under nf4) merged into the dequantised base
    # (--format hf) computes what the run computes, as PEFT does with the exported adapter on that base
    from helpers import run_main

    assert t.spec.checkpoint_weights == "adapters"
    t.save()
    step = tmp_path / "checkpoints" / f"step-{STEPS:08d}"
    for fmt in ("hf", "peft"):
        done = run_main("hpctrain.checkpoint", "export", str(step), str(tmp_path / fmt), "--format", fmt)
        assert done.returncode == 0, done.stderr
    x = rows[:2]
    with torch.no_grad():
        ours_logits = t.parts[0](x)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(input_ids=x).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(start["dequantised"][1], dtype=torch.float32),
                                         tmp_path / "peft")(input_ids=x).logits
    torch.testing.assert_close(merged, peft, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_logits, peft, rtol=1e-4, atol=1e-5)


LAYOUTS = {"ddp": "parallel.zero=0", "fsdp": "parallel.dp_shard=2", "tp": "parallel.tp=2"}


def planned_base_bytes(common: list[str], layout: str) -> float:
    """The planner's bytes per GPU of the NF4 base of the adapted layers."""
    from hpctrain.core.compose import compose
    from hpctrain.plan.memory import job_of
    from hpctrain.plan.verdict import plan

    return plan(job_of(compose([*common, "launcher.nproc=2", *layout.split()]))).memory.device["nf4_base"]


def test_two_ranks_equal_the_reference_and_hold_half_a_byte_per_weight(start, tmp_path):
    """One launch of 2 ranks, DDP, FSDP2 (dp_shard 2) and TP 2: STEPS steps' losses and gradient norms equal
    transformers + PEFT on the dequantised weights (for TP: each rank's own shard quantised, as the export
    does), and the bytes of each rank's NF4 storages, measured, are within 10% of the planner's (FSDP2:
    half of one rank's). Mutants: FSDP2's shard kept as a view of the whole NF4 weight (each rank holds the
    whole: 2x the plan), FSDP2 shards quantised each on their own (another scale mean: not the reference's
    weights), TP's rowwise shards quantised as rows of the whole, the base never quantised."""
    from hpctrain.launch.local import launch

    worker = str(Path(__file__).with_name("qlora_worker.py"))
    rc = launch(tmp_path, 2, cmd=[sys.executable, worker, str(tmp_path / "out.json"), str(STEPS),
                                  " ".join(start["common"]), *LAYOUTS.values()])
    assert rc == 0, (tmp_path / "logs").as_posix()
    got = json.loads((tmp_path / "out.json").read_text())
    ref = {tp: reference(start, tp) for tp in (1, 2)}
    for name, layout in LAYOUTS.items():
        r = ref[2 if name == "tp" else 1]
        assert got[layout]["nf4"] == [True, True], name
        assert got[layout]["loss"] == pytest.approx(r["loss"], rel=1e-5), name
        assert got[layout]["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), name
        planned = planned_base_bytes(start["common"], layout)
        for measured in got[layout]["nf4_bytes"]:
            assert measured == pytest.approx(planned, rel=0.10), name
    # about half a byte per adapted weight: 2 layers x (2 x 256 x 256 + 2 x 128 x 256 + 3 x 384 x 256)
    weights = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 384 * 256)
    assert got[LAYOUTS["ddp"]]["nf4_bytes"][0] == pytest.approx(weights * (0.5 + 1 / 64), rel=0.01)
    assert got[LAYOUTS["fsdp"]]["nf4_bytes"][0] == pytest.approx(weights * (0.5 + 1 / 64) / 2, rel=0.01)


def test_llama3_70b_qlora_fits_2_h100_and_8_l4():
    """The preset on one node of 2 x H100 80GB and of 8 x L4 24GB: it fits, the base priced at NF4's bytes
    (0.5 + 1/64 + 2/16384 a weight, torchao's layout) sharded over the ranks, one dequantised weight at a
    time, and the dequantisation's time in the step. Mutants: the base priced in bf16 (35 GiB on each of
    2 H100 with the rest: 70 GB per GPU, no fit on L4), the scales left out, not sharded by FSDP2."""
    from hpctrain.core.compose import compose
    from hpctrain.core.flops import lora_linears
    from hpctrain.plan.memory import GiB, job_of
    from hpctrain.plan.verdict import plan

    for over, ranks in (([], 2), (["cluster=l4", "cluster.gpus_per_node=8"], 8)):
        cfg = compose(["+experiment=llama3_70b_qlora", *over])
        p = plan(job_of(cfg))
        assert p.fits, p.problems
        adapted = sum(i * o * n for i, o, n in lora_linears(cfg.model))
        assert 67e9 < adapted < 69e9  # every linear of the 80 blocks: 68.5 B of the 70.6 B
        dev = p.memory.device
        assert dev["nf4_base"] == pytest.approx(adapted * (0.5 + 1 / 64 + 2 / 16384) / ranks, rel=1e-6)
        assert dev["params"] < 2.5 * GiB  # the embedding and output layer in bf16
        assert dev["dequantised"] == pytest.approx(28672 * 8192 * (2 + 8), rel=1e-6)  # w1, the largest
    lora = plan(job_of(compose(["+experiment=llama3_70b_qlora", "model.lora.quantize=none"])))
    assert not lora.fits
    slower = plan(job_of(compose(["+experiment=llama3_70b_qlora"])))
    assert slower.time.step_time_s > plan(job_of(compose(["+experiment=llama3_70b_qlora", "model.lora.quantize=none",
                                                          "cluster.device_mem_gb=400"]))).time.step_time_s


@pytest.mark.parametrize("overrides, said", [
    (["model.lora.rank=0"], "model.lora.quantize=nf4 with model.lora.rank=0: only a frozen base is quantised"),
    (["train.precision=fp16"], "model.lora.quantize=nf4 with train.precision=fp16"),
    (["model.dim=128"], "the adapted layer wq's weight is 128 x 128 in 2 FSDP2 shards of rows: 8192 weights a "
                        "shard, not a multiple of 16384"),
    (["model.dim=128", "parallel.zero=0", "model.lora.targets=[k_proj]"], "the adapted layer wk's weight is 64 x 128 "
                                                                          "= 8192 weights, not a multiple of"),
    (["offload=cpu"], "model.lora.quantize=nf4 with offload=cpu"),
    (["checkpoint.weights=full"], "model.lora.quantize=nf4 with checkpoint.weights=full: a QLoRA run's checkpoints "
                                  "hold the adapters alone"),
    (["model.init_from=null"], "model.lora.quantize=nf4 and no model.init_from: a QLoRA run's checkpoints (its last "
                               "step's, a preemption's) hold the adapters alone"),
    (["launcher.nproc=4", "parallel.tp=2"], "NF4 weights sharded on a 2-D mesh are not implemented"),
    (["parallel.pp=2"], "model.lora.quantize=nf4 with parallel.pp=2: not implemented"),
])
def test_what_qlora_cannot_run_is_refused_on_the_login_node(start, overrides, said):
    """Each refusal's message, from the login node's checks. Mutant: a rule missing (the run would fail on the
    ranks, or save a checkpoint torch cannot write)."""
    from hpctrain.checks.config_checks import problems
    from hpctrain.core.compose import compose

    messages = problems(compose([*start["common"], *overrides]))
    assert any(said in m for m in messages), messages
