"""Published training-throughput tables (published.csv; sources in docs/published_runs.md) as planner
jobs, so the planner can be fitted on some sources and judged on the others. Pure arithmetic.
`python benchmarks/calibration` prints the comparison (calibration/__main__.py).

Each usable row becomes a `Published`: the Job it ran (model shape, GPUs, layout, batch), the software
profile of the engine that ran it, and the published throughput in tokens/s per GPU. Sources that print
only TFLOP/s are converted back to tokens/s with that source's own FLOP formula (`Source.flops`; they
differ: recompute counted or not, causal attention halved or not, embeddings counted or not). Knobs a
source does not publish (micro-batch, interleaving depth, recompute) are chosen by the planner: the
fastest value that fits the GPU's memory, on the assumption that published runs were tuned.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from hpctrain.core.compose import conf_dir
from hpctrain.core.flops import param_counts
from hpctrain.core.schema import ClusterConfig, Fp8Config, Fp8Recipe, ModelConfig
from hpctrain.core.spec import Layout, updated
from hpctrain.plan.memory import Job, memory, spec_on
from hpctrain.plan.throughput import (DEEPSPEED_2021, HPCTRAIN, LLM_FOUNDRY, LLM_FOUNDRY_TORCH1, MEGATRON,
                                      MEGATRON_2021, TORCH_ASYNC_TP, Software, throughput)

CSV = Path(__file__).with_name("published.csv")

# ---------------------------------------------------------------------------------------------
# The FLOPs per token each source counts (l layers, h hidden, V vocabulary, s sequence, N parameters)


def _megatron_2024(m: ModelConfig, s: int, n: float) -> float:
    """Megatron-LM num_floating_point_operations (r0.8): 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token for
    a 4h GELU MLP; no recompute term, full s^2 attention, logits counted, input embedding not."""
    l, h, v = m.n_layers, m.dim, m.vocab_size
    return 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def _narayanan_eq3(m: ModelConfig, s: int, n: float) -> float:
    """Narayanan et al. 2021 eq. (3): 96 l h^2 (1 + s/(6h) + V/(16 l h)): counts the forward that full
    recomputation repeats (so these are hardware FLOPs), full s^2 attention."""
    l, h, v = m.n_layers, m.dim, m.vocab_size
    return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _palm(m: ModelConfig, s: int, n: float) -> float:
    """PaLM's MFU numerator (Llama 3 Table 4): 6 N + 12 l h s, N all parameters."""
    return 6 * n + 12 * m.n_layers * m.dim * s


def _nemo_2407(m: ModelConfig, s: int, n: float) -> float:
    """NeMo 24.07: 6 (N - input embedding) + 12 l h s (full s^2 attention)."""
    return 6 * (n - m.vocab_size * m.dim) + 12 * m.n_layers * m.dim * s


def _bridge(m: ModelConfig, s: int, n: float) -> float:
    """Megatron-Bridge 25.11+: 6 (N - input embedding) + 6 l h s (causal attention halved)."""
    return 6 * (n - m.vocab_size * m.dim) + 6 * m.n_layers * m.dim * s


def _mpt(m: ModelConfig, s: int, n: float) -> float:
    """llm-foundry collect_results.py: 6 N + 12 l d s, N the logged count with embeddings."""
    return 6 * n + 12 * m.n_layers * m.dim * s


@dataclass(frozen=True)
class Source:
    column: str  # the published figure compared: tokens_per_s_per_gpu, model_tflops_per_gpu or hw_tflops_per_gpu
    flops: Callable  # FLOPs per token by the source's convention (its TFLOP/s column)
    software: Software  # the engine's overlap profile
    engine: str  # what ran it, in words
    gpt: bool = False  # GPT block (4h GELU MLP, MHA), mapped to the same FLOPs as a SwiGLU of 8h/3
    tied: bool = False  # output layer shares the embedding
    interleaved: bool = False  # interleaved 1F1B allowed where VP is not published
    compile: bool = False  # torch.compile fuses the elementwise kernels
    unmodelled: str = ""  # why the planner's prediction is not held to the bound (shown, not counted)


_TT = "torchtitan (FSDP2, DTensor)"
SOURCES = {
    "megatron_lm_readme_h100_2024": Source("model_tflops_per_gpu", _megatron_2024, MEGATRON, "Megatron-LM r0.8",
                                           gpt=True, interleaved=True),
    "narayanan2021_table1": Source("hw_tflops_per_gpu", _narayanan_eq3, MEGATRON_2021, "Megatron-LM 2021",
                                   gpt=True, tied=True, interleaved=True),
    "narayanan2021_table2": Source("hw_tflops_per_gpu", _narayanan_eq3, DEEPSPEED_2021, "DeepSpeed ZeRO-3 2021",
                                   gpt=True, tied=True, unmodelled=(
                                       "DeepSpeed ZeRO-3 of 2021: the published step times imply ~25 GB/s per GPU "
                                       "for its parameter gathers, 1/8 of the multi-NIC NCCL bus bandwidth priced")),
    # Meta's own stack; its overlap is not published: Megatron's profile (TP and DP overlapped) assumed.
    "llama3_paper_table4": Source("model_tflops_per_gpu", _palm, MEGATRON, "Meta Llama 3 stack", interleaved=True),
    "torchtitan_h100_202412": Source("tokens_per_s_per_gpu", _palm, HPCTRAIN, _TT),
    # Every row of these two ran torch.compile (their notes).
    "torchtitan_asynctp_h100_202506": Source("tokens_per_s_per_gpu", _palm, HPCTRAIN, _TT, compile=True),
    "torchtitan_h200_trainy_202506": Source("tokens_per_s_per_gpu", _palm, HPCTRAIN, _TT, compile=True),
    "nemo_24.07_h100_fp8": Source("model_tflops_per_gpu", _nemo_2407, MEGATRON, "NeMo 24.07"),
    "megatron_bridge_perf_summary": Source("model_tflops_per_gpu", _bridge, MEGATRON, "Megatron-Bridge"),
    "llm_foundry_mpt": Source("tokens_per_s_per_gpu", _mpt, LLM_FOUNDRY, "llm-foundry (PyTorch FSDP)",
                              gpt=True, tied=True),
    # torchao's float8 README table: torchtitan (FSDP2 + compile) on 8 H100, bf16 and two float8 recipes
    "torchao_float8_readme": Source("tokens_per_s_per_gpu", _palm, HPCTRAIN, _TT, compile=True),
}

# The rows the per-GPU constants are fitted on (calibration.fit): by source, and for llm-foundry by
# table (its notes begin "table '<name>"). Only PyTorch FSDP runs without TP or PP are fitted on
# (torchtitan's 2024-12 H100 tables, llm-foundry's "H100 80GB BF16" and "A100 80GB" tables): every
# tensor-parallel, pipelined, Megatron-LM or Meta run is held out, so the held-out error measures the
# structure (TP, pipeline bubbles, interleaving, other engines' profiles), not the fit. Also held
# out: llm-foundry's A100 40GB and H100 large-scale tables, torchtitan's async-TP table.
FIT = {"torchtitan_h100_202412": (), "llm_foundry_mpt": ("table 'H100 80GB BF16'", "table 'A100 80GB")}
# The FP8 rows' split, fixed before the FP8 constants (hpctrain.plan.throughput.FP8_EFFICIENCY and
# ROWWISE_RATE) were fitted: fitted on torchao's float8 README table alone (Llama 3 8B, 8 H100, FSDP2 +
# compile: tensorwise with float8 all-gather, rowwise), every other float8 row held out: torchtitan's
# 2024-12 tables (8-512 GPUs, FSDP, TP, PP, CP), its async-TP table (tensorwise and rowwise under TP 8),
# Trainy's H200 runs, llm-foundry's H100 FP8 table (Transformer Engine), NeMo 24.07 and Megatron-Bridge
# (Transformer Engine's FP8). The 16-bit fit (FIT) never takes an FP8 row, and torchao's bf16 row is held
# out of it.
FP8_FIT = ("torchao_float8_readme",)

# The torch each llm-foundry table ran on decides what its activation checkpointing recomputes
# (Software.recompute_last_linear): setup.py at the commit that published the table pins
# torch==1.13.1 for the A100 tables (May 2023) and allows up to 2.1.0 for the H100 tables (Oct 2023,
# Jan 2024; H100s need torch >= 2.0).
LLM_FOUNDRY_TORCH1_TABLES = ("table 'A100 80GB", "table 'A100 40GB")

# GPU ids of the table -> (cluster preset, what differs from it). Meta's Grand Teton H100s are 96GB
# HBM2e parts capped at 500 W, "between SXM and NVL in peak FLOP/s" (torchtitan's footnote): the
# midpoint of 989 (SXM) and 835 (NVL) dense bf16 TFLOP/s, as a sustained-clock factor. The A100
# 40GB SXM has HBM2 at 1,555 GB/s against the 80GB part's 2,039 (NVIDIA A100 datasheet), which its
# memory-bound kernels and thin GEMMs feel.
GPUS = {"a100_80gb": ("a100", {}), "a100_40gb": ("a100", {"device_mem_gb": 40, "hbm_gbps": 1555}),
        "h100_80gb": ("h100", {}), "h100_96gb": ("h100", {"device_mem_gb": 96, "peak_tflops": (989.4 + 835) / 2}),
        "h200": ("h200", {})}


@lru_cache(maxsize=None)
def preset(kind: str) -> ClusterConfig:
    """A cluster preset of conf/cluster/ as a plain dataclass (no Hydra)."""


    return ClusterConfig(**OmegaConf.to_container(OmegaConf.load(conf_dir() / "cluster" / f"{kind}.yaml")))


def cluster_for(gpu: str, gpus: int, presets: Optional[dict] = None) -> ClusterConfig:
    """The cluster a row ran on: the GPU's preset (or `presets[kind]`, e.g. with other constants)."""
    kind, diff = GPUS[gpu]
    c = (presets or {}).get(kind) or preset(kind)
    c = replace(c, **diff)
    rpn = c.gpus_per_node
    return replace(c, name=gpu, nodes=max(1, gpus // rpn), gpus_per_node=min(rpn, gpus), tasks_per_node=min(rpn, gpus))


# ---------------------------------------------------------------------------------------------
# Rows


@dataclass
class Published:
    row: dict  # the csv row
    source: Source
    software: Software
    tokens: float = 0.0  # published tokens/s per GPU (converted with the source's formula where needed)
    params: float = 0.0  # the parameter count the source's FLOP rule uses
    candidates: list = field(default_factory=list)  # Jobs over the unpublished knobs that fit memory
    tuned: tuple = ()  # the knobs the source did not publish
    skip: str = ""  # why the row is not used

    @property
    def id(self) -> str:
        r = self.row
        lay = f"tp{r['tp'] or 1} pp{r['pp'] or 1} dp{r['dp']}" + (f" cp{r['cp']}" if _int(r["cp"], 1) > 1 else "")
        return f"{r['source']} | {r['model']} | {r['num_gpus']}x{r['gpu']} | {lay} | s{r['seq_len']}"

    @property
    def fp8(self) -> bool:
        return self.row["precision"] == "fp8"

    @property
    def fit(self) -> bool:
        """Fitted on: an FP8 row of FP8_FIT, or a 16-bit row of FIT."""
        if self.fp8:
            return self.row["source"] in FP8_FIT
        tables = FIT.get(self.row["source"])
        return tables is not None and (not tables or self.row["notes"].startswith(tables))

    @property
    def gpu(self) -> str:
        return self.row["gpu"]


def _int(x: str, default: int = 0) -> int:
    return int(float(x)) if x not in ("", None) else default


def _float(x: str) -> float:
    return float(x) if x not in ("", None) else 0.0


def model_of(r: dict, src: Source, tp: int) -> ModelConfig:
    h, heads = _int(r["hidden"]), _int(r["heads"])
    ffn = _int(r["ffn_hidden"])
    if src.gpt:  # two h x 4h matrices = three h x 8h/3 (a SwiGLU of the same parameters and FLOPs)
        ffn = max(tp, round(2 * ffn / 3 / tp) * tp)
    return ModelConfig(name=r["model"], dim=h, n_layers=_int(r["layers"]), n_heads=heads,
                       n_kv_heads=_int(r["kv_heads"]) or heads, ffn_dim=ffn, vocab_size=_int(r["vocab"]),
                       tie_embeddings=src.tied)


def unusable(r: dict) -> str:
    """Why the planner cannot price this row ('' if it can)."""
    if r["source"] not in SOURCES:
        return "unknown source"
    if not all(r[k] for k in ("layers", "hidden", "heads", "vocab", "seq_len", "num_gpus")):
        return "model shape or GPU count not published"
    if r["gpu"] not in GPUS:
        return f"no cluster preset for {r['gpu']}"
    if not r["tp"] or not r["pp"]:
        return "TP/PP split not published"
    if not r["global_batch"]:
        return "global batch not published"
    if r["zero"] == "":
        return "optimizer sharding not published"
    col = SOURCES[r["source"]].column
    if not r[col]:
        return f"{col} not published"
    return ""


def _choices(r: dict, src: Source, m: ModelConfig, dp: int, pp: int) -> tuple[list, tuple]:
    """(knob dicts to try, names of the tuned knobs) for what the row does not publish."""
    tuned = []
    per_replica = _int(r["global_batch"]) // dp
    mbs = [_int(r["micro_batch"])] if r["micro_batch"] else [b for b in (1, 2, 4, 8) if per_replica % b == 0]
    if not r["micro_batch"]:
        tuned.append("micro_batch")
    acs = [r["recompute"]] if r["recompute"] else ["none", "selective", "full"]
    if not r["recompute"]:
        tuned.append("recompute")
    scheds = [("1f1b", 1)]
    if pp > 1 and src.interleaved and not r["vp"]:
        per_rank = -(-m.n_layers // pp)
        scheds += [("interleaved_1f1b", v) for v in range(2, per_rank + 1) if m.n_layers >= pp * v]
        tuned.append("vp")
    elif pp > 1 and _int(r["vp"], 1) > 1:
        scheds = [("interleaved_1f1b", _int(r["vp"]))]
    out = []
    for mb in mbs:
        micro = per_replica // mb
        for sched, v in scheds:
            if sched == "interleaved_1f1b" and micro % pp:
                continue  # Megatron's interleaving needs micro-batches in multiples of pp
            if pp > 1 and micro < pp:
                continue  # a pipeline needs at least pp micro-batches (what the engine refuses, no run did)
            for ac in acs:
                out.append({"micro_batch": mb, "schedule": sched, "virtual_stages": v, "ac": ac})
    return out, tuple(tuned)


def load(path: Path = CSV) -> list[Published]:
    """Every row of the table; unusable ones carry `skip`."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [published(r) for r in rows]


def published(r: dict) -> Published:
    src = SOURCES.get(r["source"])
    p = Published(row=r, source=src, software=software_of(r, src) if src else HPCTRAIN)
    p.skip = unusable(r)
    if p.skip:
        return p
    tp, pp, cp, gpus = _int(r["tp"], 1), _int(r["pp"], 1), _int(r["cp"], 1), _int(r["num_gpus"])
    dp = gpus // (tp * pp * cp)
    m = model_of(r, src, tp)
    s = _int(r["seq_len"])
    # llm-foundry's rule uses its logged count (with a learned position embedding); the others the shape's.
    n = _float(r["params_b"]) * 1e9 if src is SOURCES["llm_foundry_mpt"] else param_counts(m)["total"]
    p.params = n
    value = _float(r[src.column])
    p.tokens = value if src.column == "tokens_per_s_per_gpu" else value * 1e12 / src.flops(m, s, n)
    zero = _int(r["zero"], 3)
    fp8 = fp8_of(r, zero)
    # context parallel: all-gather where the row says so (Llama 3), else a ring (Megatron-Core's p2p default)
    knobs = dict(layout=Layout(pp=pp, dp_replicate=1, dp_shard=dp, tp=tp, cp=cp), global_batch=_int(r["global_batch"]),
                  cp_attention="allgather" if "all-gather CP" in r["notes"] else "ring",
                  # every engine here materialised the whole logits (train.loss=full)
                  seq_len=s, precision="fp8" if fp8 else "bf16", zero=zero, loss="full",
                  compile=src.compile or "compile" in r["notes"],
                  # Megatron re-gathers the sequence-parallel inputs in backward; torchtitan keeps them.
                  sp_regather=p.software is MEGATRON)
    # Megatron-LM of 2021 had no sequence parallelism.
    base = Job.of(m, cluster_for(r["gpu"], gpus), **knobs, sequence_parallel=p.software.sequence_parallel,
                  engine=p.software.engine)
    if fp8:  # the recipe and the float8 all-gather are not search knobs: set on the config itself
        f8 = Fp8Config(recipe=Fp8Recipe(fp8[0]), all_gather=fp8[1])
        base = replace(base, spec=spec_on(updated(base.spec.config, {"train.fp8": f8})))
    knobs, p.tuned = _choices(r, src, m, dp, pp)
    jobs = [j for j in (base.with_(**k) for k in knobs) if j.microbatches * j.spec.micro_batch * dp == j.spec.global_batch]
    # A published layout ran, whatever the memory model says; unpublished knobs take values that fit,
    # or any value where none does (the engine then needs less memory than the model says).
    p.candidates = [j for j in jobs if not p.tuned or fits(j, src)] or jobs
    if not p.candidates:
        p.skip = "global batch does not split into micro-batches"
    return p


def fp8_of(r: dict, zero: int) -> tuple:
    """(torchao recipe, float8 all-gather) of an FP8 row, () for a 16-bit one. Rowwise where the row says
    so, else tensorwise (torchtitan's and Transformer Engine's per-tensor current/delayed scaling alike);
    the float8 all-gather where the row says so, and for torchtitan's tensorwise FSDP rows (its float8
    guide's command line turns it on with precomputed scales), never for other engines (Megatron's own
    --fp8-param-gather is not FSDP2's)."""
    if r["precision"] != "fp8":
        return ()
    notes = r["notes"]
    recipe = "rowwise" if "rowwise" in notes else "tensorwise"
    torch_native = r["source"].startswith(("torchtitan", "torchao"))
    gather = (recipe == "tensorwise" and zero >= 3 and torch_native
              and "bfloat16 all-gather" not in notes and "no float8 all-gather" not in notes)
    return recipe, gather


def fits(job: Job, src: Source) -> bool:
    """Whether the job fits the GPU's memory as its engine runs it. The memory model is hpctrain's;
    Megatron accumulates gradients straight into its fp32 main-grad buffer, where FSDP2's replicate
    (hpctrain's ZeRO-0/1 with TP or PP) keeps an accumulated copy beside the reduced one."""
    mem = memory(job)
    extra = 0.0
    if src.software.engine == "megatron":
        extra += mem.device.get("unsharded_grads", 0.0) if job.spec.zero <= 1 else 0.0
    return mem.device_total - extra <= mem.device_limit


def software_of(r: dict, src: Source) -> Software:
    """The overlap profile the row ran with: torchtitan's async TP (torch.compile + symmetric memory)
    hides TP collectives as Megatron's userbuffers do; llm-foundry's A100 tables ran on torch 1.13."""
    if src.software is HPCTRAIN and ("async TP" in r["notes"] or "AsyncTP" in r["notes"]):
        return TORCH_ASYNC_TP
    if src.software is LLM_FOUNDRY and r["notes"].startswith(LLM_FOUNDRY_TORCH1_TABLES):
        return LLM_FOUNDRY_TORCH1
    return src.software


def usable(rows: Optional[list] = None) -> list[Published]:
    return [p for p in (rows if rows is not None else load()) if not p.skip]


# ---------------------------------------------------------------------------------------------
# Predictions


@dataclass
class Prediction:
    row: Published
    job: Job  # the candidate the planner found fastest
    tokens: float  # predicted tokens/s per GPU
    time: object  # its Throughput

    @property
    def memory_gib(self) -> float:
        """Its device memory per GPU: priced when asked (fitting the constants never asks)."""
        return memory(self.job).device_total / 2**30

    @property
    def error(self) -> float:
        return self.tokens / self.row.tokens - 1


def predict(p: Published, presets: Optional[dict] = None, sw: Optional[Software] = None,
            price: Callable = throughput) -> Prediction:
    """The planner's tokens/s per GPU for a row: the fastest of its candidates (cluster constants from
    `presets` where given, else conf/cluster/)."""
    best = None
    for job in p.candidates:
        if presets:
            job = job.with_(cluster=cluster_for(p.gpu, job.world, presets))
        t = price(job, sw or p.software)
        if best is None or t.tokens_per_s > best[1].tokens_per_s:
            best = (job, t)
    job, t = best
    return Prediction(row=p, job=job, tokens=t.tokens_per_s / job.world, time=t)
