"""The planner against published training runs (benchmarks/calibration/published.csv; sources and each source's
FLOP convention in docs/published_runs.md). Its two efficiencies per GPU kind are fitted on PyTorch FSDP
runs only; every TP, pipelined, Megatron-LM and Meta run is held out and predicted from structure.

`python benchmarks/calibration` prints the whole table; `python -m pytest -q -s
tests/test_published.py` prints the held-out summary.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

import hpctrain.plan.throughput as T
from hpctrain.core.flops import train_flops_per_token
from hpctrain.plan.memory import memory
from hpctrain.plan.throughput import throughput
from hpctrain.plan.verdict import explain

import helpers  # noqa: F401  (puts the calibration, beside the package, on the path)
from calibration import fit as F  # noqa: E402
from calibration import published as P  # noqa: E402

# What the planner achieves on the held-out rows, with a margin (tokens/s per GPU): the median
# |error| is 3.9%, the worst +40%. The rows outside 15% (2, both llm-foundry A100 40GB rows out of line
# with their own table) are listed, with why, in OUTSIDE.
HELD_MEDIAN = 0.05
HELD_WORST = 0.42
# Held-out TP x PP runs (Megatron-LM 2024, Narayanan et al. 2021, Llama 3 405B): 13 rows up to 16384
# GPUs and pp 64, all within 10.1% (median 3.5%; the worst, Megatron's 462B at pp 16, -10.1%).
PIPELINE_WORST = 0.11
PIPELINE_MEDIAN = 0.05
# Held-out rows outside 15%, by id prefix, and why (the test fails if another row leaves 15%).
OUTSIDE = {
    "llm_foundry_mpt | MPT 70b | 64xa100_40gb": "70B on 40 GB parts at micro-batch 2 (+40%): 36% slower per GPU "
        "than the same model on 128 GPUs at micro-batch 4, which the planner prices alike (both compute-bound)",
    "llm_foundry_mpt | MPT 1b | 32xa100_40gb": "+28%: 18% below the same row on 16 and 64 GPUs of its table",
}


def held(preds):
    """The held-out 16-bit rows (the FP8 rows are judged apart: test_fp8_*)."""
    return [x for x in preds if not x.row.fit and not x.row.fp8 and not x.row.source.unmodelled]


def stats(errs):
    return statistics.median(abs(e) for e in errs), max(errs, key=abs)


@pytest.fixture(scope="module")
def rows():
    return P.usable(P.load())


@pytest.fixture(scope="module")
def preds(rows):
    return F.evaluate(rows)


def _passes(errs) -> bool:
    med, worst = stats(errs)
    return med <= HELD_MEDIAN and abs(worst) <= HELD_WORST


def _pipelines_pass(preds) -> bool:
    errs = [x.error for x in held(preds) if x.job.spec.layout.pp > 1]
    med, worst = stats(errs)
    return med <= PIPELINE_MEDIAN and abs(worst) <= PIPELINE_WORST


# --- the table ------------------------------------------------------------------------------


def test_rows_load_with_their_sources_conventions(rows):
    everything = P.load()
    assert len(everything) == 308
    skipped = {p.skip for p in everything if p.skip}
    assert not any("fp8" in s or "context parallel" in s for s in skipped)
    assert len(rows) >= 270 and {F.kind(p) for p in rows} == {"a100", "h100", "h200"}
    # NeMo 24.07 and Megatron-Bridge 25.11 print TFLOP/s by different rules (docs/published_runs.md):
    # LLAMA3-8B 711e12 / 12273 and 744e12 / 14451 tokens/s per GPU.
    llama8 = P.model_of({"model": "8B", "hidden": "4096", "heads": "32", "kv_heads": "8", "ffn_hidden": "14336",
                         "vocab": "128256", "layers": "32"}, P.SOURCES["nemo_24.07_h100_fp8"], 1)
    n = P.param_counts(llama8)["total"]
    assert P._nemo_2407(llama8, 8192, n) == pytest.approx(711e12 / 12273, rel=0.01)
    assert P._bridge(llama8, 8192, n) == pytest.approx(744e12 / 14451, rel=0.01)
    # Converted sources compare on tokens/s: Megatron's 1.7B row, 408.8 TFLOP/s by its 72 l h^2 (...) rule.
    meg = next(p for p in rows if p.row["source"] == "megatron_lm_readme_h100_2024")
    assert meg.tokens * P._megatron_2024(meg.candidates[0].model, 4096, 0) == pytest.approx(408.8e12)
    # Every fit row is a PyTorch FSDP run without TP or PP; every TP or PP run is held out. The FP8 fit
    # rows are torchao's table alone, and no 16-bit fit row is an FP8 one.
    assert {p.row["source"] for p in rows if p.fit and p.fp8} == set(P.FP8_FIT) == {"torchao_float8_readme"}
    assert all(p.candidates[0].spec.layout.tp == p.candidates[0].spec.layout.pp == 1 for p in rows if p.fit)
    assert sum(1 for p in rows if not p.fit and p.candidates[0].spec.layout.pp > 1) >= 13


def test_software_profile_per_row(rows):
    """Megatron-LM rows run Megatron's profile; torchtitan's the one hpctrain's plans use (HPCTRAIN, the
    same PyTorch-native stack), or its async-TP variant where the row says so."""
    by = {p.row["source"]: set() for p in rows}
    for p in rows:
        by[p.row["source"]].add(p.software.name)
    assert by["megatron_lm_readme_h100_2024"] == {"megatron"}
    assert by["narayanan2021_table1"] == {"megatron-2021"}
    # (its FP8 tables' 2D and 3D rows ran async TP, as their notes say)
    assert by["torchtitan_h100_202412"] == {T.HPCTRAIN.name, T.TORCH_ASYNC_TP.name}
    assert by["torchtitan_asynctp_h100_202506"] == {T.HPCTRAIN.name, T.TORCH_ASYNC_TP.name}
    # llm-foundry's A100 tables ran torch 1.13 (whole-forward recompute), its H100 tables torch 2.1
    assert by["llm_foundry_mpt"] == {T.LLM_FOUNDRY.name, T.LLM_FOUNDRY_TORCH1.name}


def test_fit_rows(preds):
    med, worst = stats([x.error for x in preds if x.row.fit and not x.row.fp8])
    assert med < 0.05 and abs(worst) < 0.30, (med, worst)
    # The profile hpctrain's users get, on the PyTorch-native rows it describes (eager and compiled).
    # The worst is Llama 3 8B at TP 8 (+10.8%): thin per-rank GEMMs (hidden/8 = 512).
    titan = [x.error for x in preds if x.row.software is T.HPCTRAIN and not x.row.fp8]
    assert len(titan) >= 6 and max(abs(e) for e in titan) < 0.11, titan


def test_llama3_long_context_row_plans_as_feasible_within_15_percent(preds):
    """Llama 3 405B's 128K stage (Table 4: 16,384 H100, TP 8, CP 16, PP 16, DP 8, 380 TFLOP/s per GPU, K/V
    all-gathered): priced with its context parallel (1/16 of each sequence per rank, the all-gather of K
    and V per layer), it fits and lands within 15%. Mutants caught: cp ignored in the tokens per rank (the
    row would not fit), the cp ranks left out of the data-parallel group (the global batch would not
    split), the all-gather priced over the wrong ranks."""
    (row,) = [x for x in preds if x.row.row["source"] == "llama3_paper_table4" and x.row.row["cp"] == "16"]
    assert row.job.spec.layout.cp == 16 and row.job.spec.cp_attention == "allgather"
    assert not memory(row.job).problems
    assert abs(row.error) <= F.BOUND, row.error
    assert any(c["dim"] == "cp" and c["op"] == "all_gather" for c in throughput(row.job).collectives)


def test_held_out_rows(preds):
    rows = held(preds)
    med, worst = stats([x.error for x in rows])
    print(f"\nheld-out: {len(rows)} rows, median |error| {med:.1%}, worst {worst:+.1%}")
    assert len(rows) >= 120
    assert med <= HELD_MEDIAN and abs(worst) <= HELD_WORST, (med, worst)
    outside = [x.row.id for x in rows if abs(x.error) > F.BOUND]
    unexplained = [i for i in outside if not i.startswith(tuple(OUTSIDE))]
    assert not unexplained, unexplained
    pipe = [x for x in rows if x.job.spec.layout.pp > 1]
    assert {x.row.row["source"] for x in pipe} == {"megatron_lm_readme_h100_2024", "narayanan2021_table1",
                                                   "llama3_paper_table4"}
    assert _pipelines_pass(preds), [(x.row.id, round(x.error, 3)) for x in pipe]


@pytest.mark.slow
def test_fit_reproduces_the_cluster_presets(rows):
    fitted = F.fit(rows)
    for kind, v in fitted.items():
        for k in (kind, *F.SHARES.get(kind, ())):
            c = P.preset(k)
            fitted = (v["matmul_efficiency"], v["attention_efficiency"])
            assert (c.matmul_efficiency, c.attention_efficiency) == fitted, k


# --- what a test must catch -----------------------------------------------------------------


def test_a_constant_predictor_fails(preds):
    rows = held(preds)
    fitted = [x for x in preds if x.row.fit and not x.row.fp8]
    mean = statistics.mean(x.row.tokens for x in fitted)
    assert not _passes([mean / x.row.tokens - 1 for x in rows])
    # A constant MFU per GPU kind (what passes a 10% band on Megatron's H100 table) fails too.
    mfu = {}
    for k in ("a100", "h100"):
        mine = [x for x in fitted if F.kind(x.row) == k]
        mfu[k] = statistics.mean(x.row.tokens * train_flops_per_token(x.job.model, x.job.spec.seq_len)
                                 / (x.job.cluster.peak_tflops * 1e12) for x in mine)
    errs = [mfu[F.kind(x.row)] * x.job.cluster.peak_tflops * 1e12
            / train_flops_per_token(x.job.model, x.job.spec.seq_len) / x.row.tokens - 1 for x in rows]
    assert not _passes(errs), stats(errs)


def test_without_the_pipeline_bubble_it_fails(rows, monkeypatch):
    monkeypatch.setattr(T, "bubble_divisor", lambda job: math.inf)
    assert not _pipelines_pass(F.evaluate(rows))


def test_without_interleaving_it_fails(rows, monkeypatch):
    monkeypatch.setattr(T, "bubble_divisor", lambda job: 1.0)
    assert not _pipelines_pass(F.evaluate(rows))


def test_without_micro_batches_it_fails(rows, monkeypatch):
    """Priced as one micro-batch of the whole per-replica batch: no bubble shrinking with micro-batches,
    no ZeRO-3 re-gathers or gradient syncs per micro-batch, GEMMs of the whole batch."""
    real = T.throughput

    def one(job, sw=T.HPCTRAIN):
        return real(job.with_(micro_batch=job.spec.global_batch // job.spec.layout.dp), sw)

    preds = F.evaluate(rows, price=one)
    assert not _pipelines_pass(preds)
    assert not _passes([x.error for x in held(preds)])


@pytest.mark.slow
def test_without_gemm_shapes_it_fails_even_refitted(rows, preds, monkeypatch):
    """GEMMs priced at one rate whatever their shape (thin micro-batches, narrow TP shards), with the two
    efficiencies refitted that way: the held-out median rises from 6.4% to 8.2% and the rows outside 15%
    from 9 to 17."""
    monkeypatch.setattr(T.Hardware, "gemm", lambda self, m, k, n: 2 * m * k * n / self.flops)
    flat = F.evaluate(rows, presets=F.presets_of(F.fit(rows)))
    errs = [x.error for x in held(flat)]
    assert not _passes(errs), stats(errs)
    outside = lambda es: sum(abs(e) > F.BOUND for e in es)  # noqa: E731
    assert outside(errs) > 1.5 * outside([x.error for x in held(preds)])


def test_megatron_2021_is_priced_without_sequence_parallelism(rows, monkeypatch):
    """Megatron-LM of 2021 had no sequence parallelism (Korthikanti et al. 2022 added it): every TP rank
    ran the norms and residual adds on the whole sequence, and kept their inputs whole. Priced so,
    Narayanan et al.'s TP runs are within 6% (worst +5.6%); priced as today's Megatron, with sequence
    parallelism, the pipelined ones read up to +10%."""
    def narayanan(preds):
        return [x.error for x in held(preds) if x.row.row["source"] == "narayanan2021_table1" and x.job.spec.layout.tp > 1]

    assert max(abs(e) for e in narayanan(F.evaluate(rows))) < 0.07
    src = P.SOURCES["narayanan2021_table1"]
    monkeypatch.setitem(P.SOURCES, "narayanan2021_table1",
                        replace(src, software=replace(src.software, sequence_parallel=True)))
    assert max(abs(e) for e in narayanan(F.evaluate(P.usable(P.load())))) > 0.09


def test_async_tp_gains_what_torchtitan_measured(preds, monkeypatch):
    """torchtitan's async-TP table runs each model with vanilla and async TP on the same layout: +10%
    (8B) and +9% (70B). torch's async TP fuses the forward's all-gather-matmuls and matmul-reduce-scatters
    (its authors report ~29% faster forward, ~8% end to end); priced as hiding the backward's too, as
    Megatron's userbuffers do, the gains read +24% and +18%."""
    def gains(ps):
        by = {}
        for x in ps:
            r = x.row.row
            if r["source"] == "torchtitan_asynctp_h100_202506" and not x.row.fp8:
                by.setdefault(r["model"], {})[x.row.software.name] = (x.row.tokens, x.tokens)
        return {m: (v["torch-async-tp"][0] / v["hpctrain"][0] - 1, v["torch-async-tp"][1] / v["hpctrain"][1] - 1)
                for m, v in by.items()}

    g = gains(preds)
    assert set(g) == {"Llama 3 8B", "Llama 3 70B"}
    for model, (published, predicted) in g.items():
        assert abs(predicted - published) < 0.04, (model, published, predicted)
    monkeypatch.setattr(T, "TORCH_ASYNC_TP", replace(T.TORCH_ASYNC_TP, tp_overlap_bwd=None))
    monkeypatch.setattr(P, "TORCH_ASYNC_TP", T.TORCH_ASYNC_TP)
    rows = [p for p in P.usable(P.load()) if p.row["source"] == "torchtitan_asynctp_h100_202506"]
    both = gains(F.evaluate(rows))
    assert all(predicted - published > 0.07 for published, predicted in both.values()), both


def test_fsdp_per_gpu_throughput_falls_with_scale(preds, monkeypatch):
    """llm-foundry's H100 large-scale table runs each model at a fixed micro-batch on 128, 256 and 512
    GPUs, and per-GPU throughput falls as GPUs are added (2-10%). So does the planner's (less): FSDP issues one
    all-gather or reduce-scatter per block, and a ring across n ranks on k nodes pays n - k steps
    inside nodes and k - 1 across (NCCL's latency model). With a log-depth latency per call, as a tree
    would have, the predictions are flat."""
    def trend(ps):
        by = {}
        for x in ps:
            r = x.row.row
            if r["source"] == "llm_foundry_mpt" and r["notes"].startswith("table 'H100 80GB BF16 (Large"):
                by.setdefault(r["model"], {})[int(r["num_gpus"])] = (x.row.tokens, x.tokens)
        return by

    by = trend(preds)
    assert len(by) == 6 and all(set(v) == {128, 256, 512} for v in by.values())
    for model, v in by.items():
        assert v[512][0] < v[128][0], model  # published
        assert v[512][1] < v[128][1], model  # predicted
    # The small models, whose blocks are the shortest, lose the most: ~1% predicted, where 8-10% was
    # published; the rest of the fall (network contention at scale, stragglers) is not priced.
    fell = sorted(1 - v[512][1] / v[128][1] for v in by.values())
    assert fell[-1] > 0.008, fell

    def log_depth(self):
        n = self.group
        factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(self.op, (n - 1) / n)
        return math.ceil(math.log2(n)) * self.latency + factor * self.nbytes / self.busbw
    monkeypatch.setattr(T.Collective, "seconds", property(log_depth))
    flat = trend(F.evaluate([x.row for x in preds if x.row.row["source"] == "llm_foundry_mpt"]))
    assert max(1 - v[512][1] / v[128][1] for v in flat.values()) < 0.002


def test_gemm_efficiency_follows_micro_batch_and_tp_shapes():
    """A GEMM's rate falls as any dimension thins: tokens per micro-batch, or hidden per TP rank."""
    hw = T.Hardware(flops=500e12, attn_flops=300e12, hbm=3.35e12, elem=2)  # H100-like

    def rate(m, k, n):
        return 2 * m * k * n / hw.gemm(m, k, n)

    big = rate(16384, 8192, 8192)
    assert big > 0.95 * 500e12
    assert rate(1024, 8192, 8192) < 0.9 * big  # a micro-batch of 1 x 1024 tokens
    assert rate(16384, 8192, 512) < 0.8 * big  # 4096 / 8: one TP rank's share of an 8B's wo


# --- parallel=auto on published configurations -----------------------------------------------


@pytest.mark.slow
def test_auto_layout_is_at_least_the_published_one(rows):
    picked = F.auto_rows(rows)
    assert len(picked) == len(F.AUTO) == 3
    for p in picked:
        x, res = F.auto(p)
        best = res.ranked[0]
        assert best.job.world == x.job.world and best.job.spec.global_batch == x.job.spec.global_batch
        assert best.job.model == x.job.model and best.job.spec.seq_len == x.job.spec.seq_len
        assert best.time.tokens_per_s >= x.time.tokens_per_s * (1 - 1e-9), p.id
        why = explain(res, top=3, request=x.job)
        assert "time:" in why and ("ranks #" in why or "nearest to the one asked for" in why)


@pytest.mark.slow
def test_cli_prints_the_table(capsys, tmp_path):
    from calibration.__main__ import main

    assert main(["--png", str(tmp_path / "published.png")]) == 0
    out = capsys.readouterr().out
    assert "FIT rows" in out and "HELD-OUT rows" in out and "held-out:" in out
    assert "parallel=auto on" in out and "[not modelled]" in out
    assert "MoE HELD-OUT rows" in out and "MoE held-out: 7 rows" in out  # the MoE rows too
    assert (tmp_path / "published.png").stat().st_size > 20_000 and f"wrote {tmp_path / 'published.png'}" in out


# --- FP8 (train.precision=fp8: torchao's float8 linears) ----------------------------------------

# The FP8 held-out rows (published.FP8_FIT: everything but torchao's table), tokens/s per GPU: median
# |error| 13.1%, worst +65%. Outside 15%, by id prefix, and why (the test fails if another row leaves 15%).
FP8_HELD_MEDIAN = 0.14
FP8_OUTSIDE = {
    "torchtitan_h100_202412 | Llama 3.1 8B | 8xh100_96gb | tp1 pp1 dp1 cp8": "CP 8 at 256K: +65%, as CP 4 "
        "(+55%): torchtitan's CP of 2024-12 (its 16-bit CP rows are not published) runs far below the ring priced",
    "torchtitan_h100_202412 | Llama 3.1 8B | 8xh100_96gb | tp1 pp1 dp2 cp4": "the same",
    "torchtitan_h100_202412 | Llama 3.1 405B | 512xh100_96gb | tp8 pp8 dp": "TP 8 x PP 8 with CP 2-8, and "
        "plain 1F1B (+34%, against +4% for the interleaved row beside it): pipeline bubbles torchtitan's "
        "1F1B left larger than the schedule's",
    "torchtitan_h100_202412 | Llama 3.1 8B | 8xh100_96gb | tp1 pp1 dp8 | s32768": "+15.0% at 32K, on the edge",
    "torchtitan_asynctp_h100_202506 | Llama 3 8B | 64xh100_96gb": "rowwise under TP 8 (+36%, +45%): published "
        "slower than bf16 (0.85x), which no GEMM rate reproduces: torchao's rowwise casts under DTensor TP",
    "torchtitan_asynctp_h100_202506 | Llama 3 70B | 256xh100_96gb": "rowwise with async TP (+19%): as above",
    "torchtitan_h200_trainy_202506": "Trainy's H200s: -16%, as their bf16-free table gives no baseline to judge",
    "megatron_bridge_perf_summary | Llama 3 8B | 8xh100_80gb": "Megatron FSDP with Transformer Engine's "
        "fused FP8 kernels (-34%): faster than any torchao recipe published",
    "llm_foundry_mpt | MPT": "Transformer Engine's FP8 on small models (1B, 3B) at short sequences (-17%, -20%): "
        "TE's fused cast-and-norm kernels leave less overhead than priced",
}


def fp8_held(preds):
    return [x for x in preds if x.row.fp8 and not x.row.fit and not x.row.source.unmodelled]


def speedup(preds, source: str, model: str, gpus: str) -> tuple:
    """(published, predicted) tokens/s of the tensorwise FP8 row over its bf16 row (compiled, same layout)."""
    def one(prec):
        (x,) = [x for x in preds if x.row.row["source"] == source and x.row.row["model"] == model
                and x.row.row["num_gpus"] == gpus and x.row.row["seq_len"] == "8192" and x.row.row["precision"] == prec
                and x.job.spec.compile and x.job.spec.layout.cp == 1 and "rowwise" not in x.row.row["notes"]]
        return x
    f, b = one("fp8"), one("bf16")
    return f.row.tokens / b.row.tokens, f.tokens / b.tokens


def test_fp8_held_out_rows(preds):
    rows = fp8_held(preds)
    med, worst = stats([x.error for x in rows])
    print(f"\nFP8 held-out: {len(rows)} rows, median |error| {med:.1%}, worst {worst:+.1%}")
    assert len(rows) == 32 and med <= FP8_HELD_MEDIAN, (len(rows), med)
    outside = [x.row.id for x in rows if abs(x.error) > F.BOUND]
    assert not [i for i in outside if not i.startswith(tuple(FP8_OUTSIDE))], outside
    assert all(any(i.startswith(k) for i in outside) for k in FP8_OUTSIDE), outside


def test_fp8_speedup_of_torchtitans_llama_8b(preds, rows, monkeypatch):
    """torchtitan's Llama 3.1 8B on 8 H100 (FSDP2 + compile, tensorwise): 6,667 -> 8,532 tokens/s per GPU,
    1.28x (1.29x on 128 GPUs); held out of the fit (torchao's table). Predicted within 0.1 of both.
    Mutants: the float8 GEMMs at the bf16 rate (1.0x), at the FP8 peak without its efficiency (>1.5x),
    the casts free and the float8 all-gather at 2 bytes (the 128-GPU row, where the gathers cross nodes)."""
    for gpus in ("8", "128"):
        published, predicted = speedup(preds, "torchtitan_h100_202412", "Llama 3.1 8B", gpus)
        assert published == pytest.approx(1.28, abs=0.01)
        assert abs(predicted - published) <= 0.1, (gpus, published, predicted)
    mine = [p for p in rows if p.row["source"] == "torchtitan_h100_202412" and p.row["model"] == "Llama 3.1 8B"
            and p.row["seq_len"] == "8192" and p.row["num_gpus"] == "8"]
    for eff in (0.5 * 989.4 / 1978.9 * 0.524 * 2, 1.0):  # the bf16 rate, the FP8 peak
        with F.fp8_constants(eff, T.ROWWISE_RATE):
            published, predicted = speedup(F.evaluate(mine), "torchtitan_h100_202412", "Llama 3.1 8B", "8")
        assert abs(predicted - published) > 0.1, (eff, predicted)


def test_fp8_fit_reproduces_the_constants(rows):
    """FP8_EFFICIENCY and ROWWISE_RATE are what `fit_fp8` finds on torchao's table (its two FP8 rows'
    speedups over its bf16 row: 1.25 tensorwise with the float8 all-gather, 1.10 rowwise), and on it
    the predicted speedups are the published ones within 1%."""
    got = F.fit_fp8(rows)
    assert (got["FP8_EFFICIENCY"], got["ROWWISE_RATE"]) == (T.FP8_EFFICIENCY, T.ROWWISE_RATE)
    assert got["rows"] == 2 and got["sources"] == ["torchao_float8_readme"]
    for p, q in F.speedup_pairs(rows):
        assert P.predict(p).tokens / P.predict(q).tokens == pytest.approx(p.tokens / q.tokens, rel=0.01)


def test_fp8_casts_and_all_gather_are_priced(rows, monkeypatch):
    """A float8 linear's overheads, as plan.throughput.fp8_linear states them: a fused cast moves 3 bytes
    per element (amax fused into its producer; 5 eager), tensorwise forward casts the input and the weight,
    and with the float8 all-gather the weight's cast is on the 1/dp_shard shard and FSDP2 gathers 1 byte
    per float8 weight. Checked on torchao's tensorwise row against those byte counts by hand. Mutants:
    the casts free, the amax pass counted when fused, the all-gather at 2 bytes."""
    (p,) = [p for p in rows if p.row["source"] == "torchao_float8_readme" and "tensorwise" in p.row["notes"]]
    job = p.candidates[0]
    assert job.spec.fp8_recipe == "tensorwise" and job.spec.fp8_all_gather and job.spec.compile
    hw = T.Hardware.of(job)
    t, k, n = job.tokens, 4096, 14336  # w1: the micro-batch's 8192 tokens, 4096 in, 14336 out
    fwd, _ = T.fp8_linear(job, hw, t, k, n, fused=True)
    assert fwd - hw.gemm8(t, k, n) == pytest.approx(3 * (t * k + k * n / 8) / hw.hbm)
    fwd_eager, _ = T.fp8_linear(job, hw, t, k, n, fused=False)
    assert fwd_eager - hw.gemm8(t, k, n) == pytest.approx(5 * (t * k + k * n / 8) / hw.hbm)
    gathered = sum(c["bytes"] * c["count"] for c in T.throughput(job).collectives
                   if c["op"] == "all_gather" and c["dim"] == "dp_shard")
    bf16 = sum(c["bytes"] * c["count"] for c in T.throughput(job.with_(precision="bf16")).collectives
               if c["op"] == "all_gather" and c["dim"] == "dp_shard")
    linears = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)  # Llama 3 8B's blocks
    assert bf16 - gathered == pytest.approx(2 * linears, rel=1e-6)  # 1 byte less a weight, gathered forward and backward
