"""Published Mixture-of-Experts training runs (published_moe.csv; sources in docs/published_runs.md) as
planner jobs. Pure arithmetic, as calibration.published is for the dense rows.

Rows the planner prices: bf16 runs on GPUs with a cluster preset, without context parallelism, whose
model it can describe. Megatron-Core's TFLOP/s are converted to tokens/s with its own MoE FLOP count
(`megatron_moe_flops`). Published layouts fold expert parallel into tensor parallel (ep may exceed the
data-parallel ranks; plan.moe prices that). The split into fitted and held-out rows is fixed here, before
any fit: the planner's one MoE constant, cluster.grouped_gemm_efficiency, was to be fitted on
Megatron-Core's Mixtral 8x7B rows (FIT), every Qwen3-235B-A22B row held out. That fit saturates (the
Mixtral rows run faster than the dense constants allow even with a grouped GEMM as fast as a dense
one: docs/moe.md), so the presets' 0.85 stands and the held-out rows are priced with it.
"""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from hpctrain.core.schema import ModelConfig, MoEConfig
from hpctrain.core.spec import Layout
from hpctrain.plan.memory import Job
from hpctrain.plan.throughput import MEGATRON, Software, throughput

from .fit import BOUND
from .published import GPUS, cluster_for

CSV = Path(__file__).with_name("published_moe.csv")
# The sources the planner prices, with what ran them.
SOURCES = {"megatron_core_moe_readme": "Megatron-Core MoE (v0.8/v0.9)",
           "megatron_moe_modelzoo": "Megatron-Core MoE model zoo"}
FIT = ("megatron_core_moe_readme",)
# Megatron-Core's 1F1B all-to-all overlap (the row says so in its notes).
MEGATRON_A2A_OVERLAP = replace(MEGATRON, name="megatron-a2a-overlap", ep_overlap=1.0)


def megatron_moe_flops(m: ModelConfig, s: int) -> float:
    """Megatron-LM's num_floating_point_operations per token for a (GQA, SwiGLU) MoE model:
    12 l h^2 [ (1 + kv/heads + s/(2h)) q/h + 1.5 top_k f_e/h + V/(2 l h) ] (causal attention halved;
    every layer routed). Checked on the rows that give both TFLOP/s and a step time (their notes)."""
    l, h = m.n_layers, m.dim
    q = m.n_heads * (m.head_dim or h // m.n_heads) / h
    attention = (1 + m.n_kv_heads / m.n_heads + s / (2 * h)) * q
    mlp = 1.5 * m.moe.top_k * (m.moe.ffn_dim or m.ffn_dim) / h + 1.5 * m.moe.shared_experts * (m.moe.ffn_dim or m.ffn_dim) / h
    return 12 * l * h * h * (attention + mlp + m.vocab_size / (2 * l * h))


def _int(x: str, default: int = 0) -> int:
    return int(float(x)) if x not in ("", None) else default


@dataclass
class Row:
    row: dict
    model: Optional[ModelConfig] = None
    tokens: float = 0.0  # published tokens/s per GPU (from TFLOP/s by the source's FLOP count)
    job: Optional[Job] = None
    software: Software = MEGATRON
    skip: str = ""
    notes: list = field(default_factory=list)

    @property
    def id(self) -> str:
        r = self.row
        return (f"{r['source']} | {r['model']} | {r['num_gpus']}x{r['gpu']} | tp{r['tp']} pp{r['pp']} ep{r['ep']} "
                f"dp{r['dp']} | s{r['seq_len']} | {r['model_tflops_per_gpu']} TF")

    @property
    def fit(self) -> bool:
        return self.row["source"] in FIT


def unusable(r: dict) -> str:
    if r["source"] not in SOURCES:
        return "a source the planner does not price (GPT-OSS's sliding-window attention and biased experts, " \
               "or no TFLOP/s convention checked)"
    if r["precision"] != "bf16":
        return (f"{r['precision']} (FP8 experts: Transformer Engine's grouped GEMMs; the planner keeps experts "
                "in bf16, as torchao's float8 linears do)")
    if r["gpu"] not in GPUS:
        return f"no cluster preset for {r['gpu']}"
    if _int(r["cp"], 1) > 1:
        return ("context parallel: not in the split fixed before fitting (the planner priced CP x EP only "
                "later; those rows priced by hand in docs/moe.md)")
    if "should be around" in r["notes"] or "NOT a measurement" in r["notes"]:
        return "an expected figure in a script comment, not a measurement"
    if not r["model_tflops_per_gpu"]:
        return "no TFLOP/s"
    return ""


def model_of(r: dict) -> ModelConfig:
    h, heads = _int(r["hidden"]), _int(r["heads"])
    hd = _int(r["head_dim"])
    return ModelConfig(name=r["model"], dim=h, n_layers=_int(r["layers"]), n_heads=heads,
                       n_kv_heads=_int(r["kv_heads"]) or heads, head_dim=hd if hd and hd * heads != h else 0,
                       qk_norm="Qwen3" in r["model"], ffn_dim=_int(r["ffn_hidden"]) or _int(r["moe_ffn_hidden"]),
                       vocab_size=_int(r["vocab"]),
                       moe=MoEConfig(experts=_int(r["experts"]), top_k=_int(r["top_k"]),
                                     ffn_dim=_int(r["moe_ffn_hidden"]), shared_experts=_int(r["shared_experts"]),
                                     first_dense=_int(r["first_dense"])))


# Megatron's --recompute-modules by parallel.ac_modules's names (hpctrain.parallel.activation)
MEGATRON_MODULES = {"layernorm": "norm", "norm": "norm", "act": "moe_act", "moe_act": "moe_act", "moe": "moe",
                    "mlp": "mlp", "core_attn": "attention"}


def _recompute(r: dict) -> str:
    """Megatron's recompute as the planner's parallel.ac: full is full; selective recompute of modules is
    ac=none with those modules (_modules)."""
    return "full" if r["recompute"].strip() == "full" else "none"


def _modules(r: dict) -> list:
    """The row's `selective: <modules>` as parallel.ac_modules: `norm, act` (the norms and the experts'
    activation), `layernorm, moe` (the 16K rows: the norms and each MoE layer's whole forward, its dispatch
    and combine again; Megatron-Core's recompute_modules in transformer_config.py)."""
    text = r["recompute"].strip()
    if not text.startswith("selective:"):
        return []
    names = [MEGATRON_MODULES[m.strip()] for m in text.split(":", 1)[1].split(",") if m.strip()]
    return sorted(set(names), key=names.index)


def load(path: Path = CSV) -> list[Row]:
    with open(path, newline="") as f:
        return [priced(r) for r in csv.DictReader(f)]


def priced(r: dict) -> Row:
    out = Row(row=r, skip=unusable(r))
    if out.skip:
        return out
    m = model_of(r)
    s = _int(r["seq_len"])
    tp, pp, ep, gpus = _int(r["tp"], 1), _int(r["pp"], 1), _int(r["ep"], 1), _int(r["num_gpus"])
    dp = gpus // (tp * pp)
    vp = _int(r["vp"], 1)
    knobs = dict(layout=Layout(pp=pp, dp_replicate=1, dp_shard=dp, tp=tp, ep=ep), global_batch=_int(r["global_batch"]),
                  seq_len=s, micro_batch=_int(r["micro_batch"], 1), precision="bf16", zero=_int(r["zero"], 1), loss="full",
                  ac=_recompute(r), ac_modules=_modules(r), schedule="interleaved_1f1b" if vp > 1 else "1f1b", virtual_stages=vp,
                  sp_regather=True)
    out.model = m
    out.software = MEGATRON_A2A_OVERLAP if "A2A overlap" in r["notes"] else MEGATRON
    out.job = Job.of(m, cluster_for(r["gpu"], gpus), **knobs, engine="megatron", expert_tp=_int(r["etp"], 1))
    out.tokens = float(r["model_tflops_per_gpu"]) * 1e12 / megatron_moe_flops(m, s)
    return out


def predict(row: Row, grouped_gemm_efficiency: Optional[float] = None) -> float:
    """The planner's tokens/s per GPU for the row (the cluster's grouped-GEMM efficiency, or this one)."""
    job = row.job
    if grouped_gemm_efficiency is not None:
        job = job.with_(cluster=replace(job.cluster, grouped_gemm_efficiency=grouped_gemm_efficiency))
    return throughput(job, row.software).tokens_per_s / job.world



def error(row: Row) -> float:
    """The planner's tokens/s per GPU over the published, minus 1."""
    return predict(row) / row.tokens - 1


def summary(rows: list[Row], fitted: bool) -> dict:
    """Rows, median |error|, worst error and rows outside BOUND, of the priced fit or held-out rows."""
    errs = [error(r) for r in rows if not r.skip and r.fit == fitted]
    if not errs:
        return {"rows": 0, "median": 0.0, "worst": 0.0, "outside": 0}
    return {"rows": len(errs), "median": statistics.median(abs(e) for e in errs), "worst": max(errs, key=abs),
            "outside": sum(abs(e) > BOUND for e in errs)}


def table(rows: list[Row]) -> str:
    """Predicted against published tokens/s per GPU for the priced rows: the fit rows (the fit saturated,
    module docstring), then the held-out ones, each group with its median and worst error; then how many
    rows are not priced, by reason. TFLOP/s are Megatron-LM's MoE count (`megatron_moe_flops`)."""
    head = (f"{'source':<24} {'model':<16} {'GPUs':>13} {'seq':>6} {'layout':<36} {'tok/s/GPU':>9} {'pred':>7} {'error':>7} "
            f"{'TFLOP/s':>7} {'pred':>5}")
    out = []
    for fitted in (True, False):
        out.append("MoE FIT rows (set aside to fit grouped_gemm_efficiency; the fit saturated, nothing fitted)"
                   if fitted else "MoE HELD-OUT rows")
        out.append(head)
        for r in rows:
            if r.skip or r.fit != fitted:
                continue
            x = r.row
            flops = megatron_moe_flops(r.model, _int(x["seq_len"]))
            pred = predict(r)
            lay = (f"tp{x['tp']} pp{x['pp']} ep{x['ep']} dp{x['dp']} vp{x['vp'] or 1}"
                   f"{' ' + _recompute(x) + ' recompute' if _recompute(x) != 'none' else ''}")
            out.append(f"{x['source'][:24]:<24} {x['model'][:16]:<16} {x['num_gpus'] + 'x' + x['gpu']:>13} "
                       f"{x['seq_len']:>6} {lay:<36} {r.tokens:>9,.0f} {pred:>7,.0f} {pred / r.tokens - 1:>+7.1%} "
                       f"{r.tokens * flops / 1e12:>7.0f} {pred * flops / 1e12:>5.0f}")
        s = summary(rows, fitted)
        out.append(f"MoE {'fit' if fitted else 'held-out'}: {s['rows']} rows, median |error| {s['median']:.1%}, "
                   f"worst {s['worst']:+.1%}, {s['outside']} outside {BOUND:.0%}")
        out.append("")
    skipped: dict = {}
    for r in rows:
        if r.skip:
            skipped[r.skip] = skipped.get(r.skip, 0) + 1
    out.append("MoE rows not priced: " + "; ".join(f"{n} {why}" for why, n in
                                                 sorted(skipped.items(), key=lambda kv: -kv[1])))
    return "\n".join(out)
