"""The rule book: what keeps a layout from running at all, written once.

Each rule reads an `EngineSpec` (the run's config and what follows from it) and yields `Problem`s: a
short reason, by which the planner counts the layouts it refuses, and a message that names the keys
and the fix. Three readers, one wording: the login node's checks (hpctrain.checks.config_checks), the
planner's search (hpctrain.plan.search, over thousands of layouts) and every rank before it builds a
mesh (hpctrain.run, for a start the login node did not check: torchrun, mpiexec). Memory is not a
rule here: whether a layout fits is the planner's (hpctrain.plan.memory). No torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

from hpctrain.core.schema import Fp16Config, Fp8Config
from hpctrain.core.shape import moe_layer
from hpctrain.core.spec import EngineSpec, Layout, installed

RULES: list[Callable[[EngineSpec], Iterator["Problem"]]] = []


@dataclass(frozen=True)
class Problem:
    reason: str  # short, for counting refused layouts ("model.n_heads % tp")
    message: str  # names the keys, what is wrong and the fix


def rule(fn):
    RULES.append(fn)
    return fn


def problems(spec: EngineSpec) -> list[Problem]:
    """Every rule's problems with this spec, in the book's order."""
    return [p for r in RULES for p in r(spec)]


def divisors(n: int, most: int = 64) -> str:
    """The divisors of n up to `most` (what a fix can offer; the planner words ~10^4 refusals a search)."""
    return ", ".join(str(d) for d in range(1, min(n, most) + 1) if n % d == 0)


@rule
def world(spec: EngineSpec):
    """The mesh fills the ranks the launcher provides."""
    cfg = spec.config
    where = (f"launcher.nproc={spec.world}" if cfg.launcher.name == "local" else
             f"cluster.nodes={cfg.cluster.nodes} x "
             f"{'cluster.gpus_per_node' if cfg.cluster.gpus_per_node else 'cluster.tasks_per_node'}"
             f"={cfg.cluster.gpus_per_node or cfg.cluster.tasks_per_node}")
    yield from world_problems(spec.layout, spec.world, "the launcher provides", where,
                              rest=cfg.parallel.dp_shard == -1)


def world_problems(lay: Layout, world: int, who: str, where: str = "", rest: bool = False):
    """The degrees multiply to `world` ranks, which `who` ("the launcher provides") by `where` (the keys
    that size it); `rest`: dp_shard was -1, "the rest"."""
    fixed = lay.pp * lay.dp_replicate * lay.cp * lay.tp
    cp = f" x parallel.cp={lay.cp}" if lay.cp > 1 else ""
    where = f" ({where})" if where else ""
    if rest:
        if fixed < 1 or world % fixed:
            yield Problem("pp x dp_replicate x cp x tp % world",
                          f"parallel.pp={lay.pp} x parallel.dp_replicate={lay.dp_replicate}{cp} x parallel.tp={lay.tp} "
                          f"= {fixed} does not divide the {world} ranks {who}{where}. "
                          f"Fix: make the world size a multiple of {fixed}, or change the parallel sizes")
    elif lay.world != world:
        yield Problem("mesh != world",
                      f"parallel sizes pp={lay.pp} x dp_replicate={lay.dp_replicate} x dp_shard={lay.dp_shard}"
                      f"{cp.replace('parallel.', '')} x tp={lay.tp} = {lay.world}, but {who} {world} ranks{where}. "
                      f"Fix: set parallel.dp_shard=-1 to use all ranks, or make the product equal {world}")


@rule
def tensor_parallel(spec: EngineSpec):
    """TP splits heads and the FFN's width."""
    m, tp = spec.model, spec.layout.tp
    for key in ("n_heads", "n_kv_heads"):
        if getattr(m, key) % tp:
            yield Problem(f"model.{key} % tp",
                          f"model.{key}={getattr(m, key)} is not divisible by parallel.tp={tp}: tensor parallel "
                          f"splits heads. Fix: choose parallel.tp among {divisors(getattr(m, key))}")
    if m.ffn_dim % tp:
        yield Problem("model.ffn_dim % tp",
                      f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}: tensor parallel splits the "
                      f"FFN's width. Fix: choose parallel.tp among {divisors(m.ffn_dim)}")


EP_ZERO = "ep needs zero >= 2"  # (the login node lets parallel=auto choose the stage)


@rule
def expert_parallel(spec: EngineSpec):
    """parallel.ep: a split of dp_shard over whole experts, on FSDP2."""
    ep, e = spec.layout.ep, spec.model.moe
    if ep <= 1:
        return
    if e.experts <= 0:
        yield Problem("ep without experts",
                      f"parallel.ep={ep} splits Mixture-of-Experts layers, but the model has none "
                      "(model.moe.experts=0). Fix: parallel.ep=1, or a MoE model (e.g. model=moe_tiny)")
        return
    if e.experts % ep:
        yield Problem("ep", f"model.moe.experts={e.experts} is not divisible by parallel.ep={ep}: each ep rank holds "
                            f"whole experts. Fix: choose parallel.ep among {divisors(e.experts)}")
    yield from ep_fold_problems(spec.layout)
    if spec.zero < 2:
        yield Problem(EP_ZERO, f"parallel.ep={ep} with parallel.zero={spec.zero}: expert parallel runs on FSDP2, whose "
                            "gradient reduction knows the experts are split (DDP would average different experts' "
                            "gradients). Fix: parallel.zero=2 or 3")


def ep_fold_problems(lay: Layout, over: tuple = ("dp_shard",)):
    """Expert parallel takes its ranks from the `over` dimensions (dp_shard: built; dp_shard x tp,
    Megatron's folding: hpctrain.distributed.mesh.EP_FOLDS), so ep divides their product."""
    n = 1
    for d in over:
        n *= getattr(lay, d)
    keys = " x ".join(f"parallel.{d}" for d in over)
    if lay.ep > 1 and n >= 1 and n % lay.ep:
        yield Problem("ep", f"parallel.ep={lay.ep} does not divide {keys}={n}: expert parallel splits "
                            f"{'the data-parallel shard group' if over == ('dp_shard',) else ' x '.join(over)}. "
                            f"Fix: choose parallel.ep among {divisors(n)}")


@rule
def context_parallel(spec: EngineSpec):
    """parallel.cp: whole chunk pairs per rank, on a kernel that covers the case and that the planner prices."""
    cp, m = spec.layout.cp, spec.model
    if cp <= 1:
        return
    s = spec.seq_len
    if s % (2 * cp):
        yield Problem("cp", f"data.seq_len={s} is not divisible by 2 x parallel.cp={2 * cp}: each cp rank holds two "
                            f"equal chunks of every sequence. Fix: data.seq_len={(s // (2 * cp) + 1) * 2 * cp}, or "
                            f"parallel.cp among {[c for c in range(1, s // 2 + 1) if (s // 2) % c == 0][:8]}")
    kernel = str(spec.config.parallel.cp_kernel)
    gqa = bool(m.n_kv_heads) and m.n_kv_heads != m.n_heads
    if kernel == "torch" and spec.device == "cuda" and spec.dtypes.compute == "float32" and gqa:
        yield Problem("cp kernel", f"parallel.cp_kernel=torch with train.precision={spec.precision} and grouped-query "
                                   f"attention (model.n_kv_heads={m.n_kv_heads} < n_heads={m.n_heads}): of the CUDA "
                                   "kernels torch's ring runs, only flash takes fewer K/V heads, and it computes in 16 "
                                   "bits. Fix: train.precision=bf16, or parallel.cp_kernel=auto (hpctrain's kernel then)")
    if kernel == "torch" and spec.document_mask:
        yield Problem("cp kernel", "parallel.cp_kernel=torch with data.document_mask=true: torch's context-parallel "
                                   "ring attention is causal only and takes no mask. Fix: parallel.cp_kernel=auto "
                                   "(hpctrain's kernel where a mask is on), or data.document_mask=false")
        return
    fallback = cp_fallback_problem(spec)
    if fallback:
        yield Problem("cp on CUDA with hpctrain's kernel (unpriced)", fallback)


def cp_fallback_problem(spec: EngineSpec) -> str:
    """Context parallelism on CUDA with hpctrain's kernel (a document mask, fp32, or parallel.cp_kernel=hpctrain):
    its chunk pairs fall back there to fp32 matmuls over whole (chunk x chunk) score matrices per head
    (hpctrain.models.attention's math path; no fused CUDA kernel takes the mask with grouped K/V yet),
    which the planner prices neither in memory nor in time; "" where it does not arise."""
    cp = spec.layout.cp
    if cp <= 1 or spec.device != "cuda" or spec.cp_kernel != "hpctrain":
        return ""
    chunk = spec.seq_len // (2 * cp)
    heads = spec.model.n_heads // max(1, spec.layout.tp)
    scores = spec.micro_batch * heads * chunk * chunk * 4 / 2**30
    if spec.document_mask:
        why, fix = "data.document_mask=true", "data.document_mask=false (torch's ring, causal only), or parallel.cp=1"
    elif str(spec.config.parallel.cp_kernel) == "hpctrain":
        why, fix = "parallel.cp_kernel=hpctrain", "parallel.cp_kernel=auto with train.precision=bf16 (torch's ring)"
    elif spec.dtypes.compute != "float32":  # 16 bits, but flash attention (grouped K/V in torch's ring) needs SM80
        why = (f"cluster.compute_capability={float(spec.config.cluster.compute_capability):g} with grouped-query "
               "attention: torch's ring takes grouped K/V through flash attention only, from SM80 (A100)")
        fix = "parallel.cp=1, or GPUs of compute capability 8.0 or more"
    else:
        why, fix = f"train.precision={spec.precision}", "train.precision=bf16 (torch's ring), or parallel.cp=1"
    return (f"parallel.cp={cp} on CUDA with hpctrain's attention kernel ({why}): its chunk pairs run on CUDA as fp32 "
            f"matmuls over whole {chunk} x {chunk} score matrices ({scores:.1f} GiB a pair for a rank's {heads} heads, "
            "several at once in backward), priced neither in memory nor in time (a fused CUDA kernel is still to "
            f"be built: docs/long_context.md). Fix: {fix}")


@rule
def batch(spec: EngineSpec):
    """The global batch splits into whole micro-batches on every data-parallel rank."""
    gb, mb, dp = spec.global_batch, spec.micro_batch, spec.layout.dp
    if dp >= 1 and mb >= 1 and gb % (dp * mb):
        yield Problem("global_batch % (dp x micro_batch)",
                      f"train.global_batch={gb} is not divisible by data-parallel ranks ({dp}) x "
                      f"train.micro_batch={mb} = {dp * mb}. "
                      f"Fix: train.global_batch={max(1, gb // (dp * mb)) * dp * mb}")


@rule
def pipeline(spec: EngineSpec):
    """Stages that hold blocks, enough micro-batches to fill them, an embedding not tied across ranks."""
    pipe, lay, m = spec.pipeline, spec.layout, spec.model
    if pipe is None:
        return
    stages = pipe.stages
    if m.tie_embeddings:
        yield Problem("tied embeddings with pp",
                      "model.tie_embeddings=true cannot be split over pipeline stages (the embedding and the "
                      "output would live on different ranks). Fix: parallel.pp=1")
    # Layers need not divide into stages (hpctrain.core.spec.split_layers splits them unevenly); every
    # stage but the first and the last needs a block.
    if stages > m.n_layers + 2:
        yield Problem("stages > n_layers + 2",
                      f"parallel.pp={lay.pp} with schedule {spec.schedule} makes {stages} stages but the model has "
                      f"{m.n_layers} blocks (+ embedding and output). Fix: fewer stages or parallel.pp_schedule=1f1b")
    gb, mb = spec.global_batch, spec.micro_batch
    if lay.dp < 1 or mb < 1 or gb % (lay.dp * mb):
        return  # batch() (or the sizes' own check) says so
    n = spec.microbatches
    if spec.schedule == "dualpipev" and n < stages:
        yield Problem("micro-batches < stages",
                      f"{n} micro-batches per step for parallel.pp_schedule=dualpipev with {stages} stages: "
                      f"DualPipeV needs at least as many micro-batches as stages. "
                      f"Fix: train.micro_batch={max(1, gb // lay.dp // stages)} or a larger train.global_batch")
    elif n < lay.pp or (stages > lay.pp and n % lay.pp):
        yield Problem("micro-batches < pp" if n < lay.pp else "interleaved: micro-batches % pp",
                      f"{n} micro-batches per step (train.global_batch / data-parallel ranks / train.micro_batch) "
                      f"for parallel.pp={lay.pp}, schedule {spec.schedule}: a pipeline needs at least pp "
                      f"micro-batches, a multiple of pp for interleaved schedules. "
                      f"Fix: train.micro_batch={max(1, gb // lay.dp // (2 * lay.pp))} or a larger train.global_batch")


@rule
def engine(spec: EngineSpec):
    """What the data-parallel engine the layout picks can do."""
    lay, p = spec.layout, spec.config.parallel
    if spec.offload != "none" and spec.zero < 1:
        yield Problem("offload needs zero >= 1",
                      f"offload.target={spec.offload} with parallel.zero=0: the offloaded optimizer state is "
                      "priced and streamed per ZeRO shard. Fix: parallel.zero=1 (or 2, 3), or offload.target=none")
    if spec.data_parallel == "replicate_zero1" and spec.offload != "none":
        yield Problem("offload with replicate_zero1",
                      f"offload.target={spec.offload} with parallel.zero=1, data parallel over {lay.dp} ranks and "
                      f"tp={lay.tp}, pp={lay.pp}: the optimizer sharded by parameter owner does not offload. "
                      "Fix: parallel.zero=2 or 3, or offload.target=none")
    if lay.dp_replicate > 1 and spec.data_parallel != "fsdp":
        yield Problem("HSDP needs zero >= 2", "parallel.dp_replicate>1 (HSDP) needs a sharded data-parallel engine. "
                                              "Fix: parallel.zero=2 or 3, or parallel.dp_replicate=1")
    reduce = str(spec.config.train.reduce_precision)
    if reduce != "fp32" and spec.data_parallel != "fsdp":
        yield Problem("reduce_precision needs zero >= 2",
                      f"train.reduce_precision={reduce} with parallel.zero={spec.zero}: only FSDP2 reduces gradients "
                      "in another dtype than it keeps them (its MixedPrecisionPolicy); DDP and ZeRO-1 reduce the fp32 "
                      "gradients autocast leaves. Fix: parallel.zero=2 or 3, or train.reduce_precision=fp32")
    if str(p.grad_sync) == "microbatch" and lay.pp > 1:
        yield Problem("grad_sync with pp", "parallel.grad_sync=microbatch does not apply with pipelining: torch's "
                                           "pipeline stages reduce gradients after a step's last backward. "
                                           "Fix: parallel.grad_sync=auto")


# The CUDA compute capability each precision needs (bf16 tensor cores from Ampere, FP8 from Ada/Hopper,
# MX block scaling from Blackwell).
BF16_SM, FP8_SM, MXFP8_SM = 8.0, 8.9, 10.0


@rule
def precision(spec: EngineSpec):
    """train.precision on the cluster's GPUs (cluster.compute_capability), and what fp8's options need."""
    cfg, pr = spec.config, spec.precision
    cc, name = float(cfg.cluster.compute_capability), cfg.cluster.name
    gpu = spec.device == "cuda" and cc > 0
    if gpu and pr in ("bf16", "fp8") and cc < BF16_SM:
        yield Problem("no bf16 on the GPU", f"train.precision={pr} on cluster={name} (compute capability {cc:g}): its "
                                             "GPUs have no bf16 (it came with compute capability 8.0, A100). Fix: "
                                             "train.precision=fp16 (dynamic loss scaling), or fp32")
    elif gpu and pr == "fp8" and cc < FP8_SM:
        yield Problem("no fp8 on the GPU", f"train.precision=fp8 on cluster={name} (compute capability {cc:g}): its "
                                            "GPUs have no float8 tensor cores (they came with 8.9, L40S and H100). "
                                            "Fix: train.precision=bf16")
    elif gpu and spec.fp8_recipe == "mxfp8" and cc < MXFP8_SM:
        yield Problem("no mxfp8 on the GPU", f"train.fp8.recipe=mxfp8 on cluster={name} (compute capability {cc:g}): "
                                              "MX block scaling needs compute capability 10.0 (B200). Fix: "
                                              "train.fp8.recipe=tensorwise or rowwise")
    if pr == "fp8" and spec.lora:
        yield Problem("fp8 with lora", f"train.precision=fp8 with model.lora.rank={spec.lora.rank}: the adapters go on "
                                       "the frozen nn.Linear layers, which fp8 has replaced by torchao's float8 "
                                       "linears (a float8 frozen base is not built). Fix: train.precision=bf16")
    if pr == "fp8":
        if not installed("torchao"):
            yield Problem("fp8 without torchao", "train.precision=fp8 needs torchao, which is not installed. Fix: "
                                                 "pip install 'hpctrain[fp8]' (torchao 0.18), or train.precision=bf16")
    f8 = cfg.train.fp8
    # An option of a precision the run does not use would do nothing: refused rather than ignored.
    if pr != "fp8" and str(f8.recipe) != str(Fp8Config().recipe):
        yield Problem("fp8 recipe without fp8", f"train.fp8.recipe={f8.recipe} with train.precision={pr}: the recipe "
                                                "is fp8's. Fix: train.precision=fp8, or leave train.fp8.recipe out")
    f16, unset = cfg.train.fp16, Fp16Config()
    changed = [k for k in ("init_scale", "growth_interval") if getattr(f16, k) != getattr(unset, k)]
    if pr != "fp16" and changed:
        yield Problem("fp16 options without fp16", f"train.fp16.{changed[0]}={getattr(f16, changed[0])} with "
                                                   f"train.precision={pr}: only fp16 scales the loss. Fix: "
                                                   f"train.precision=fp16, or leave train.fp16.* out")
    if bool(f8.all_gather):
        if pr != "fp8":
            yield Problem("fp8 all-gather without fp8", f"train.fp8.all_gather=true with train.precision={pr}: there "
                                                        "are no float8 weights to gather. Fix: train.precision=fp8, or "
                                                        "train.fp8.all_gather=false")
        elif str(f8.recipe) != "tensorwise":
            yield Problem("fp8 all-gather needs tensorwise", f"train.fp8.all_gather=true with train.fp8.recipe="
                                                             f"{f8.recipe}: torchao gathers float8 weights with one "
                                                             "scale per tensor only. Fix: train.fp8.recipe=tensorwise, "
                                                             "or train.fp8.all_gather=false")
        elif not spec.sharding.params:
            yield Problem("fp8 all-gather needs zero 3", f"train.fp8.all_gather=true with parallel.zero={spec.zero}: "
                                                         "only FSDP2 with sharded parameters gathers weights. Fix: "
                                                         "parallel.zero=3, or train.fp8.all_gather=false")
        elif spec.backend != "nccl":
            yield Problem("fp8 all-gather needs nccl", f"train.fp8.all_gather=true on the {spec.backend} backend: "
                                                       "gloo has no float8 type to gather (NCCL has). Fix: "
                                                       "train.fp8.all_gather=false, or a CUDA cluster")
    if pr == "fp16" and str(cfg.train.reduce_precision) == "bf16":
        yield Problem("fp16 with bf16 reduction", "train.precision=fp16 with train.reduce_precision=bf16: the "
                                                  "gradients are fp16, scaled by the loss scale; rounding their sum "
                                                  "to bf16 loses what fp16 kept. Fix: train.reduce_precision=fp32")


@rule
def loss(spec: EngineSpec):
    """train.loss_chunk where chunks are made; train.loss_kernel=liger where Liger-Kernel's fused loss runs."""
    t = spec.config.train
    if spec.loss_chunk and spec.loss != "chunked":
        yield Problem("loss_chunk with loss=full", f"train.loss_chunk={spec.loss_chunk} with train.loss=full: the "
                                                   "whole logits are one chunk. Fix: train.loss=chunked, or "
                                                   "train.loss_chunk=0")
    if str(t.loss_kernel) != "liger":
        return
    if spec.loss_chunk:
        yield Problem("loss_chunk with liger", f"train.loss_chunk={spec.loss_chunk} with train.loss_kernel=liger: "
                                               "Liger-Kernel sizes its own chunks. Fix: train.loss_chunk=0, or "
                                               "train.loss_kernel=torch")
    if not installed("liger_kernel"):
        yield Problem("liger not installed", "train.loss_kernel=liger needs Liger-Kernel, which is not installed. "
                                             "Fix: pip install liger-kernel (CUDA), or train.loss_kernel=auto")
    if spec.loss != "chunked":
        yield Problem("liger with loss=full", "train.loss_kernel=liger with train.loss=full: Liger-Kernel's kernel is "
                                              "a chunked loss. Fix: train.loss=chunked, or train.loss_kernel=auto")
    if spec.device != "cuda":
        yield Problem("liger off CUDA", f"train.loss_kernel=liger on cluster.device={spec.device}: Liger-Kernel's "
                                        "kernels are Triton, CUDA only. Fix: train.loss_kernel=auto (hpctrain's "
                                        "chunked loss, the same numbers)")
    if spec.layout.tp > 1:
        yield Problem("liger with tp", f"train.loss_kernel=liger with parallel.tp={spec.layout.tp}: its kernel needs "
                                       "the whole vocabulary on one rank, tensor parallel splits it. Fix: "
                                       "train.loss_kernel=auto (hpctrain's vocabulary-parallel chunked loss)")


@rule
def dpo(spec: EngineSpec):
    """train.objective=dpo where it is implemented: one rank, FSDP2, DDP, TP, with or without LoRA; each pair's
    two sequences whole on one rank in one forward, the head's sums per sequence. train.dpo.* set for a run
    that is not DPO is refused, as unused precision options are (an option is used or refused)."""
    t, lay = spec.config.train, spec.layout
    if not spec.dpo:
        from hpctrain.core.schema import DpoConfig

        unused = [f"train.dpo.{k}={getattr(t.dpo, k)}" for k in DpoConfig.__dataclass_fields__
                  if str(getattr(t.dpo, k)) != str(getattr(DpoConfig(), k))]
        if unused:
            yield Problem("dpo options without dpo", f"{', '.join(unused)} with train.objective={t.objective}: "
                                                     "the preference loss is not trained, so this would be ignored. "
                                                     "Fix: train.objective=dpo, or leave train.dpo.* out")
        return
    d = spec.config.data
    if d.document_mask or d.document_positions:
        yield Problem("dpo with document_mask", "train.objective=dpo with data.document_mask or "
                                                "data.document_positions: each preference window holds one "
                                                "sequence, so there is nothing to mask, and a separator inside a "
                                                "prompt (a chat template's end of turn) would cut it into "
                                                "documents the log-probabilities of TRL's DPO never see. "
                                                "Fix: data.document_mask=false data.document_positions=false")
    if spec.lora and spec.lora.quantize == "nf4" and spec.dpo_reference == "copy":
        yield Problem("dpo reference=copy with nf4", "train.dpo.reference=copy with model.lora.quantize=nf4: the copy "
                                                     "would keep the base in full precision while the policy runs on "
                                                     "its NF4 weights (policy and reference differ before any step), "
                                                     "and a second base defeats QLoRA. Fix: train.dpo.reference=base "
                                                     "(the NF4 base with the adapters off, as PEFT's QLoRA-DPO)")
    if spec.pipeline:
        yield Problem("dpo with pp", f"train.objective=dpo with parallel.pp={lay.pp}: the reference's forward would "
                                     "need a pipeline pass of its own beside the schedule's, which is not "
                                     "implemented. Fix: parallel.pp=1 (FSDP2 parallel.dp_shard or parallel.tp)")
    if lay.cp > 1:
        yield Problem("dpo with cp", f"train.objective=dpo with parallel.cp={lay.cp}: a sequence's log-probability "
                                     "would be split over the context-parallel ranks, which is not implemented. "
                                     "Fix: parallel.cp=1 (preference sequences are short: data.seq_len per window)")
    if spec.model.moe.experts:
        yield Problem("dpo with moe", f"train.objective=dpo with model.moe.experts={spec.model.moe.experts}: the "
                                      "reference's forward would add to the routers' statistics and balancing "
                                      "losses, which is not handled. Fix: a dense model (model.moe.experts=0)")
    if t.z_loss_coef:
        yield Problem("dpo with z_loss", f"train.z_loss_coef={t.z_loss_coef} with train.objective=dpo: the z-loss "
                                         "is a term of the token loss, not of the preference loss. "
                                         "Fix: train.z_loss_coef=0")
    if str(t.loss_kernel) == "liger":
        yield Problem("dpo with liger", "train.loss_kernel=liger with train.objective=dpo: Liger's kernel sums the "
                                        "micro-batch, DPO needs each sequence's sum. Fix: train.loss_kernel=auto")
    if str(t.dpo.reference) == "base" and not spec.lora:
        yield Problem("dpo reference=base without lora",
                      "train.dpo.reference=base without LoRA (model.lora.rank=0): the base is the policy being "
                      "trained, not a fixed reference. Fix: train.dpo.reference=copy (or auto), or model.lora.rank>0")
    if str(t.dpo.loss) == "ipo" and t.dpo.label_smoothing:
        yield Problem("ipo with label_smoothing",
                      f"train.dpo.label_smoothing={t.dpo.label_smoothing} with train.dpo.loss=ipo: label smoothing "
                      "is conservative DPO's (sigmoid), IPO has none. Fix: train.dpo.label_smoothing=0, or "
                      "train.dpo.loss=sigmoid")


@rule
def recompute(spec: EngineSpec):
    """parallel.ac_modules: modules the blocks have, in blocks parallel.ac does not already recompute whole."""
    mods = spec.ac_modules
    if not mods:
        return
    shown = "[" + ",".join(mods) + "]"
    if spec.ac == "full":
        yield Problem("ac_modules with ac=full", f"parallel.ac_modules={shown} with parallel.ac=full: every block is "
                                                 "recomputed whole already. Fix: parallel.ac=none (or selective: "
                                                 "the modules then in the blocks it leaves), or parallel.ac_modules=[]")
    moe = spec.model.moe.experts > 0
    for m in ("moe", "moe_act"):
        if m in mods and not moe:
            yield Problem(f"ac_modules {m} without experts", f"parallel.ac_modules has {m} but the model has no "
                                                            "Mixture-of-Experts layers (model.moe.experts=0). Fix: "
                                                            f"drop {m} (mlp recomputes the dense feed-forward's "
                                                            "activation)")
    if "mlp" in mods and moe and all_moe(spec.model):
        yield Problem("ac_modules mlp without dense blocks", "parallel.ac_modules has mlp but every block is a "
                                                            "Mixture-of-Experts layer. Fix: moe_act (the experts' "
                                                            "activation) instead of mlp")
    if spec.compile:
        yield Problem("ac_modules with compile", f"parallel.ac_modules={shown} with train.compile: the compiled "
                                                 "blocks keep what torch.compile's partitioner decides, and the "
                                                 "modules' saved-tensor hooks are not traced. Fix: "
                                                 "parallel.ac_modules=[] (or train.compile=false)")
    if "norm" in mods and spec.layout.tp > 1:
        yield Problem("ac_modules norm with tp", f"parallel.ac_modules has norm with parallel.tp={spec.layout.tp}: "
                                                 "under tensor parallel the linears keep the norm outputs "
                                                 "all-gathered (or, with parallel.sp_regather, a copy of this "
                                                 "rank's shard), not the norm's own output, and recomputing "
                                                 "them is not built. Fix: drop norm from parallel.ac_modules")


def all_moe(model) -> bool:
    return all(moe_layer(model, i) for i in range(model.n_layers))


@rule
def checkpoint_weights(spec: EngineSpec):
    """checkpoint.weights=adapters: adapters to save, and a base to re-read on resume and export."""
    cfg = spec.config
    if str(cfg.checkpoint.weights) != "adapters":
        return
    if not spec.lora:
        yield Problem("adapter checkpoints without lora", "checkpoint.weights=adapters with model.lora.rank=0: every "
                                                          "weight is trained, there are no adapters to save apart. "
                                                          "Fix: checkpoint.weights=auto (or full), or model.lora.rank=16 "
                                                          "to train adapters")
    elif not cfg.model.init_from:
        # The base could be made again from train.seed, but nothing outside this code version would vouch for
        # it, and a LoRA of a random base is not a model anyone keeps: the base must be a directory to re-read.
        yield Problem("adapter checkpoints without a base", "checkpoint.weights=adapters without model.init_from: "
                                                            "the frozen base is this run's random initialisation, "
                                                            "which a checkpoint of the adapters alone could not be "
                                                            "resumed or exported with. Fix: model.init_from=<the "
                                                            "base's Hugging Face directory>, or checkpoint.weights=auto "
                                                            "(every weight saved)")


# torchao's to_nf4 defaults (hpctrain.parallel.quantize uses them): weights per absmax scale, scales per
# second-level (8-bit) scale block; a weight's size must be a multiple of their product.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_TENSOR = NF4_BLOCK * NF4_SCALER_BLOCK


def nf4_problem(rows: int, cols: int, shards: int = 1) -> str | None:
    """Why a rows x cols weight cut into `shards` row blocks by FSDP2 cannot be NF4 (None: it can): torchao
    quantises a multiple of 64 x 256 weights, and FSDP2 cuts NF4 only between those blocks, unpadded."""
    n = rows * cols
    if n % NF4_TENSOR:
        return f"{rows} x {cols} = {n} weights, not a multiple of {NF4_BLOCK} x {NF4_SCALER_BLOCK} = {NF4_TENSOR}"
    if shards > 1 and (rows % shards or (n // shards) % NF4_TENSOR):
        return (f"{rows} x {cols} in {shards} FSDP2 shards of rows: {n // shards} weights a shard, not a multiple "
                f"of {NF4_TENSOR}")
    return None


@rule
def qlora(spec: EngineSpec):
    """model.lora.quantize=nf4 where it is implemented: adapters on a base of torchao NF4 weights, under one rank,
    DDP, FSDP2 or TP, in bf16 or fp32, checkpoints of the adapters with the base re-read from model.init_from."""
    from hpctrain.core.flops import lora_linears

    cfg, lay = spec.config, spec.layout
    if str(cfg.model.lora.quantize) != "nf4":
        return
    if not spec.lora:
        yield Problem("nf4 without lora", "model.lora.quantize=nf4 with model.lora.rank=0: only a frozen base is "
                                          "quantised, and full training has none. Fix: model.lora.rank=16 (QLoRA), or "
                                          "model.lora.quantize=none")
        return
    if not installed("torchao"):
        yield Problem("nf4 without torchao", "model.lora.quantize=nf4 needs torchao (its NF4Tensor), which is not "
                                             "installed. Fix: pip install 'hpctrain[fp8]' (torchao 0.18), or "
                                             "model.lora.quantize=none")
    if spec.precision in ("fp16", "fp8"):
        yield Problem(f"nf4 with {spec.precision}", f"model.lora.quantize=nf4 with train.precision={spec.precision}: "
                                                    "the NF4 base is dequantised to bf16 or fp32 for its products "
                                                    f"({spec.precision} with NF4 is not implemented). Fix: "
                                                    "train.precision=bf16")
    if spec.offload != "none":
        yield Problem("nf4 with offload", f"model.lora.quantize=nf4 with offload={spec.offload}: FSDP2's host "
                                          "offload does not move torchao's NF4 weights, and the adapters' optimizer "
                                          "state is small (offload buys nothing). Fix: offload=none")
    if spec.pipeline:
        yield Problem("nf4 with pp", f"model.lora.quantize=nf4 with parallel.pp={lay.pp}: not implemented. Fix: "
                                     "parallel.pp=1 (the 4-bit base fits where pipelines were needed: FSDP2 "
                                     "parallel.dp_shard)")
    if spec.compile:
        yield Problem("nf4 with compile", "model.lora.quantize=nf4 with train.compile=true: torch.compile of the "
                                          "NF4 weights' dequantisation is not implemented. Fix: train.compile=false")
    shards = spec.sharding.group if spec.data_parallel == "fsdp" else 1
    if spec.data_parallel in ("replicate", "replicate_zero1"):
        yield Problem("nf4 with replicate", f"model.lora.quantize=nf4 with parallel.zero={spec.zero} over data "
                                            f"parallel {lay.dp} x tp {lay.tp}: FSDP2's replicate of NF4 weights is not "
                                            "implemented. Fix: parallel.zero=3 with parallel.tp=1 (FSDP2), or "
                                            "parallel.dp_shard=1 with parallel.tp")
    elif shards > 1 and lay.tp > 1:
        # torchtune's QLoRA refuses the same (NF4 under FSDP2 on a 1-D mesh only)
        yield Problem("nf4 with fsdp x tp", f"model.lora.quantize=nf4 with FSDP2 over {shards} ranks x parallel.tp="
                                            f"{lay.tp}: NF4 weights sharded on a 2-D mesh are not implemented. Fix: "
                                            "parallel.tp=1 (FSDP2 alone), or parallel.dp_shard=1 with parallel.tp")
    m = spec.model
    for t in spec.lora.targets:
        one = replace(m, lora=replace(m.lora, targets=[t]))
        why = next((w for i, o, _ in lora_linears(one, lay.tp) if (w := nf4_problem(int(o), int(i), shards))), None)
        if why:
            tp = f" (a parallel.tp={lay.tp} shard)" if lay.tp > 1 else ""
            yield Problem("nf4 block size", f"model.lora.quantize=nf4: the adapted layer {t}'s weight{tp} is {why}. "
                                            f"Fix: leave {t} out of model.lora.targets, change parallel.dp_shard or "
                                            "parallel.tp, or model.lora.quantize=none")
            break
    # QLoRA's checkpoints hold the adapters alone (torch's checkpoint cannot write torchao's NF4 weights) and
    # re-read the base from model.init_from (config_checks._qlora_base: a real run needs one; a layout does not).
    if str(cfg.checkpoint.weights) == "full":
        yield Problem("nf4 with full checkpoints",
                      "model.lora.quantize=nf4 with checkpoint.weights=full: a QLoRA run's checkpoints hold the "
                      "adapters alone and re-read the base from model.init_from (torch's checkpoint cannot write "
                      "torchao's NF4 weights). Fix: checkpoint.weights=auto (or adapters)")
