"""Every parallel layout of the engine against the plain single-process reference (tests/reference.py):
loss and gradient norm per step and the validation loss after the last, fp32 on CPU/gloo. Many layouts share one launch per world size
(only the layouts selected, e.g. with -k, are launched)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.launch.local import launch

from reference import reference_run

pytestmark = pytest.mark.slow  # every test here starts processes or trains a model

STEPS = 3  # two optimizer updates between the three losses compared: the moments are in play
# fp32: layouts add the same numbers in other orders (shards, micro-batches, pipeline stages).
LOSS_TOL = 2e-5
NORM_TOL = 1e-4
WORKER = str(Path(__file__).with_name("layout_worker.py"))

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Uneven pipeline splits: 3 blocks over 2 stages (automatic: 2+1, the output layer outweighs the
# embedding), over 4 stages of V-shaped and interleaved schedules (automatic 1+1+1+0: the last stage
# holds only the output layer), and parallel.pp_layers given (a first stage of the embedding alone).
# A layout's model.* and data.* overrides get a reference of their own.
UNEVEN = "model.n_layers=3 parallel.pp=2 parallel.dp_shard=1"
# The blocks each rank then holds: V-shaped schedules put stages 0 and 3 on rank 0, interleaved ones 0 and 2.
UNEVEN_BLOCKS = {UNEVEN: [[0, 1], [2]],
                 f"{UNEVEN} parallel.pp_layers=[1,2]": [[0], [1, 2]],
                 f"{UNEVEN} parallel.pp_schedule=zbv": [[0], [1, 2]],
                 f"{UNEVEN} parallel.pp_schedule=interleaved_1f1b parallel.pp_layers=[0,2,1,0]": [[2], [0, 1]],
                 f"{UNEVEN} parallel.pp_schedule=dualpipev parallel.pp_layers=[0,1,1,1]": [[2], [0, 1]]}
# Mixture-of-Experts (transformers' Mixtral and Qwen3-MoE as the reference): both balancing losses on, and
# DeepSeek-V3's sigmoid routing with its balancing bias (a rate that changes the losses by ~1e-3 by step 3).
MOE = "model.moe.experts=4 model.moe.aux_loss_coef=0.01 model.moe.z_loss_coef=0.001"
QWEN3_MOE = ("model.moe.experts=4 model.moe.ffn_dim=64 model.qk_norm=true model.head_dim=16 model.moe.every=2 "
             "model.moe.aux_loss_coef=0.01")
AUX_FREE = "model.moe.experts=4 model.moe.router=sigmoid model.moe.bias_update_rate=0.01"
# Context parallel (seq 64: chunks of 16 tokens at cp 2, 8 at cp 4), on packed documents of ~12 tokens
# (transformers' Llama given the equivalent 4-D mask as the reference), positions restarting per document
# in some; all-gather and ring K/V.
DOCS = "data.document_mask=true data.eos_id=255 data.synthetic_doc_len=12"
DOCS_POS = f"{DOCS} data.document_positions=true"
RING = "parallel.cp_attention=ring"
# torch's context_parallel ring (the default on CUDA without a mask), its CPU kernel registered by hpctrain
TORCH_CP = "parallel.cp_kernel=torch"
# Fine-tuning (PEFT's LoraModel on transformers' Llama as the reference, from the same initial adapters;
# chat data: transformers' loss on labels -100 outside the assistant's turns, documents masked).
LORA = "model.lora.rank=4 model.lora.alpha=8"
SFT = ("data.source=shards data.path=@chat model.vocab_size=512 data.seq_len=64 data.document_mask=true "
       "data.document_positions=true")
LAYOUTS = {
    # (the grouped GEMM against the loop: tests/test_moe.py, one process)
    1: [MOE, QWEN3_MOE, LORA, SFT],
    2: [f"{MOE} parallel.zero=3", f"{MOE} parallel.pp=2 parallel.dp_shard=1",
        # Expert parallel: all-to-all of uneven splits, expert gradients over ep data-parallel ranks; the
        # aux-free bias under it, with a recomputed forward that must not count its routing twice.
        f"{MOE} parallel.ep=2", f"{AUX_FREE} model.moe.aux_loss_coef=0.01 parallel.ep=2 parallel.ac=full",
        f"{MOE} parallel.ep=2 offload=cpu",  # FSDP2's host parameters: the experts' 2-D DTensors too
        # TP on the dense parts: each TP rank routes its share of the sequence, the balancing losses
        # count the whole micro-batch's slots; QK-norm on each rank's heads
        f"{MOE} parallel.tp=2 parallel.dp_shard=1", f"{QWEN3_MOE} parallel.tp=2 parallel.dp_shard=1","parallel.zero=1", "parallel.zero=2", "parallel.zero=3", "parallel.zero=0",
        "parallel.tp=2 parallel.dp_shard=1", "parallel.tp=2 parallel.dp_shard=1 parallel.zero=1",
        # TP keeping its gathered sequence-parallel inputs for backward (the default re-gathers them)
        "parallel.tp=2 parallel.dp_shard=1 parallel.sp_regather=false",
        "parallel.tp=2 parallel.dp_shard=1 parallel.ac=selective",  # re-gathers in the blocks not checkpointed
        "parallel.zero=3 parallel.ac=full", "parallel.zero=2 parallel.ac=selective",
        "parallel.zero=3 parallel.grad_sync=step", "parallel.zero=2 parallel.grad_sync=step",
        "parallel.zero=0 parallel.grad_sync=microbatch",
        *(f"parallel.pp=2 parallel.dp_shard=1 parallel.pp_schedule={s}" for s in SCHEDULES), *UNEVEN_BLOCKS,
        DOCS, "parallel.cp=2", f"parallel.cp=2 {RING} {DOCS}", f"parallel.cp=2 {DOCS_POS} parallel.ac=full",
        f"parallel.cp=2 {TORCH_CP}", f"parallel.cp=2 {TORCH_CP} {RING} parallel.ac=full",
        # MoE over cp ranks: the balancing losses are the whole sequence's (counted over the cp ranks)
        f"{MOE} parallel.cp=2",
        # LoRA: frozen base weights beside trained adapters in FSDP2's groups, DDP, TP (A replicated and B
        # split for a colwise layer, A split and B replicated for a rowwise one), PP; Hugging Face's names
        LORA, f"{LORA} parallel.tp=2 parallel.dp_shard=1", f"{LORA} parallel.tp=2 parallel.dp_shard=1 parallel.zero=0",
        f"{LORA} parallel.zero=0",
        f"{LORA} parallel.pp=2 parallel.dp_shard=1", f"{LORA} model.lora.targets=[q_proj,v_proj,down_proj] parallel.zero=1",
        f"{LORA} offload=cpu",
        # a PEFT adapter to continue from, split over FSDP2's and TP's ranks
        f"{LORA} model.lora.init_from=@adapter", f"{LORA} model.lora.init_from=@adapter parallel.tp=2 parallel.dp_shard=1",
        # chat data: the trained tokens counted over the whole global batch, whatever each rank holds
        SFT, f"{SFT} parallel.tp=2 parallel.dp_shard=1", f"{SFT} parallel.pp=2 parallel.dp_shard=1",
        f"{SFT} parallel.cp=2", f"{SFT} {LORA} parallel.zero=3"],
    4: ["parallel.dp_replicate=2 parallel.dp_shard=2",
        f"{MOE} parallel.ep=2",  # ep 2 x the expert weights FSDP-sharded over the other 2 (efsdp)
        f"{MOE} parallel.ep=2 parallel.pp=2 parallel.dp_shard=2",
        f"{MOE} parallel.ep=2 parallel.tp=2 parallel.dp_shard=2",  # experts on the (ep, tp) mesh
        # (ep 4: tests/test_moe.py resumes an ep 2 run on it)
        "parallel.tp=2 parallel.pp=2 parallel.dp_shard=1",
        # Replicated parameters over data parallel (DDP, ZeRO-1) composed with TP and with PP.
        *(f"parallel.zero={z} parallel.{d}=2 parallel.dp_shard=2" for z in (0, 1) for d in ("tp", "pp")),
        # ... under the multi-stage schedules too (gradients synced on each stage's last backward)
        "parallel.zero=1 parallel.pp=2 parallel.dp_shard=2 parallel.pp_schedule=interleaved_1f1b",
        "parallel.zero=0 parallel.pp=2 parallel.dp_shard=2 parallel.pp_schedule=zbv",
        # cp 4, and cp 2 beside FSDP (the cp ranks join the parameter sharding), TP and PP
        f"parallel.cp=4 {RING}", f"parallel.cp=4 {DOCS}",
        f"parallel.cp=2 parallel.dp_shard=2 {RING}", f"parallel.cp=2 parallel.dp_shard=2 {DOCS_POS}",
        "parallel.cp=2 parallel.tp=2 parallel.dp_shard=1", f"parallel.cp=2 parallel.tp=2 parallel.dp_shard=1 {RING} {DOCS}",
        f"parallel.cp=2 parallel.pp=2 parallel.dp_shard=1 {RING}", f"parallel.cp=2 parallel.pp=2 parallel.dp_shard=1 {DOCS}",
        f"parallel.cp=4 {TORCH_CP} {RING}", f"parallel.cp=2 parallel.dp_shard=2 {TORCH_CP}",
        f"parallel.cp=2 parallel.tp=2 parallel.dp_shard=1 {TORCH_CP} {RING}",
        f"parallel.cp=2 parallel.pp=2 parallel.dp_shard=1 {TORCH_CP}",
        # context x expert parallel: experts sharded over efsdp x cp, slots counted over cp (x tp)
        f"{MOE} parallel.ep=2 parallel.cp=2", f"{AUX_FREE} parallel.ep=2 parallel.cp=2 {RING}",
        f"{QWEN3_MOE} parallel.cp=2 parallel.tp=2 parallel.dp_shard=1"],
    8: ["parallel.dp_shard=2 parallel.tp=2 parallel.pp=2",
        f"parallel.cp=4 parallel.dp_shard=2 {DOCS}", f"parallel.cp=4 parallel.tp=2 parallel.dp_shard=1 {RING} {DOCS_POS}",
        f"parallel.cp=4 parallel.pp=2 parallel.dp_shard=1 {DOCS}",
        f"{MOE} parallel.ep=2 parallel.cp=2 parallel.tp=2 parallel.dp_shard=2"],
}


def model_overrides(layout: str) -> tuple:
    """What the reference run must share with a layout: its model and data."""
    return tuple(o for o in layout.split() if o.startswith(("model.", "data.")))


PLACEHOLDERS = {"@chat": "chat_shards", "@adapter": "peft_adapter"}


def with_paths(layout: str, request) -> str:
    """The layout with @chat (the chat shards' directory) and @adapter (a PEFT adapter) replaced, each made
    only when a layout needs it."""
    for mark, fixture in PLACEHOLDERS.items():
        if mark in layout:
            layout = layout.replace(mark, str(request.getfixturevalue(fixture)))
    return layout


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """A LoRA adapter written by PEFT itself (save_pretrained) for the tiny model of LORA, A and B both
    random (init_lora_weights=False): model.lora.init_from must give every rank its slice of each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from layout_worker import COMMON
    from reference import hf_dir

    d = tmp_path_factory.mktemp("peft_adapter")
    base = AutoModelForCausalLM.from_pretrained(hf_dir(compose([*COMMON, *LORA.split()]), d / "base"))
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    model.save_pretrained(d / "adapter")
    return d / "adapter"


@pytest.fixture(scope="module")
def reference(request):
    """The reference run of the tiny model with a layout's model.* overrides, computed once each."""
    from layout_worker import COMMON

    runs = {}

    def of(layout: str) -> dict:
        key = model_overrides(with_paths(layout, request))
        if key not in runs:
            runs[key] = reference_run(compose([*COMMON, *key, f"train.steps={STEPS}"]), STEPS)
        return runs[key]

    return of


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """One launch per world size of the layouts this session runs."""
    chosen = {(i.callspec.params["world"], i.callspec.params["layout"]) for i in request.session.items
              if getattr(i, "originalname", None) == "test_layout_matches_single_process" and i.module.__name__ == __name__}
    out = {}
    for world, every in LAYOUTS.items():
        layouts = [l for l in every if (world, l) in chosen]
        if not layouts:
            continue
        d = tmp_path_factory.mktemp(f"world{world}")
        given = {with_paths(l, request): l for l in layouts}
        rc = launch(d, world, cmd=[sys.executable, WORKER, str(d / "out.json"), str(STEPS), *given])
        assert rc == 0, (d / "logs").as_posix()
        out.update({(world, given[k]): v for k, v in json.loads((d / "out.json").read_text()).items()})
    return out


@pytest.mark.parametrize("world,layout", [(w, l) for w, ls in LAYOUTS.items() for l in ls])
def test_layout_matches_single_process(results, reference, world, layout):
    got, ref = results[(world, layout)], reference(layout)
    ref_loss, ref_norm = ref["loss"], ref["grad_norm"]
    for step in range(STEPS):
        assert abs(got["loss"][step] - ref_loss[step]) <= LOSS_TOL * max(1, ref_loss[step]), \
            (step + 1, got["loss"], ref_loss)
        assert abs(got["grad_norm"][step] - ref_norm[step]) <= NORM_TOL * max(1, ref_norm[step]), \
            (step + 1, got["grad_norm"], ref_norm)
    # Validation (forward only, a sampler of its own; pipeline layouts through schedule.eval) after
    # the last step, on the same validation samples as the reference.
    assert abs(got["val"] - ref["val"]) <= LOSS_TOL * max(1, ref["val"]), (got["val"], ref["val"])
    if TORCH_CP in layout:  # torch's ring ran, not hpctrain's kernel under another name
        assert got["kernel"] == "TorchContextParallelAttention", got["kernel"]
    if layout in UNEVEN_BLOCKS:  # the split the layout asks for is the one the ranks hold
        assert got["blocks"] == UNEVEN_BLOCKS[layout], got["blocks"]
