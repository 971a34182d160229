"""Long context, in one process: the chunked attention against torch's SDPA with the same mask, document
masking against each document run alone and against transformers' Llama with the equivalent 4-D mask,
the load-balanced sequence split, and the refusals of configs that cannot run. The multi-rank layouts
(cp 2 and 4 with FSDP, TP, PP, ring and all-gather, with and without documents) are in
tests/test_layouts.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from hpctrain.checks.config_checks import check
from hpctrain.core.compose import ConfigError, compose
from hpctrain.models import attention as A
from hpctrain.parallel.context import chunk_ids, sequence_index
from hpctrain.train.batch import BatchLayout, document_ids, document_positions

from reference import packed


def masked_sdpa(q, k, v, docs):
    s = q.shape[2]
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)


@pytest.mark.parametrize("math", [False, True], ids=["flash", "math"])
@pytest.mark.parametrize("seq,block,p_end", [(16, 4, 0.2), (64, 16, 0.1), (48, 8, 0.0), (32, 512, 0.3), (32, 4, 0.6)])
def test_chunked_attention_equals_sdpa_with_the_same_mask(monkeypatch, seq, block, p_end, math):
    """Output and gradients of q, k, v (grouped-query heads) of the document-masked attention, cut into
    blocks, against torch's SDPA given the whole boolean mask. Mutants caught: partial results merged by
    max instead of log-sum-exp, an empty row's log-sum-exp left at the kernel's 0 (p_end 0.6 makes
    blocks whose rows see no key), a pair wrongly skipped or its causal flag lost, a backward that uses
    a pair's own lse instead of the merged one; in the matmul path (what runs off the CPU) grouped heads'
    gradients not summed back, the rowsum(dout * out) term dropped."""
    monkeypatch.setattr(A, "LOCAL_BLOCK", block)
    pairs = A.MathPairs if math else A.FlashPairs
    gen = torch.Generator().manual_seed(seq + block)
    q = torch.randn(2, 4, seq, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 8, generator=gen, requires_grad=True) for _ in range(2))
    docs = torch.cumsum((torch.rand(2, seq, generator=gen) < p_end).long(), 1)
    got, want = A.causal_attention(q, k, v, docs, pairs=pairs), masked_sdpa(q, k, v, docs)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    g = torch.randn(got.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


def test_chunks_over_other_ranks_equal_full_attention():
    """The all-gather path's arithmetic without the collective: rank r's two chunks attending over every
    chunk in gathered order equal those rows of full causal attention. Mutant caught: the late chunk
    given the early chunk's index (its rows would miss most keys)."""
    cp, s = 3, 24
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 4, generator=gen) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gathered = torch.cat([sequence_index(s, r, cp) for r in range(cp)])
    for r in range(cp):
        mine = sequence_index(s, r, cp)
        out = A.ChunkAttention.apply(q[:, :, mine], k[:, :, gathered], v[:, :, gathered], chunk_ids(r, cp),
                                     [i for j in range(cp) for i in chunk_ids(j, cp)], None, None, None)
        torch.testing.assert_close(out, full[:, :, mine])


@given(st.integers(1, 8), st.integers(1, 6))
@settings(max_examples=40, deadline=None)
def test_the_sequence_split_is_a_balanced_partition(cp, c):
    """Every token on exactly one rank, the same number on each, and the same causal attention work
    (keys before each query) on each: the point of the early-and-late chunk pairs. Mutant caught:
    contiguous chunks (rank 0 would do a fraction of the last rank's work)."""
    s = 2 * cp * c
    parts = [sequence_index(s, r, cp) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(s))
    assert len({len(p) for p in parts}) == 1
    assert len({int((p + 1).sum()) for p in parts}) == 1


def test_document_ids_and_positions():
    eos = 9
    x = torch.tensor([[1, 2, 9, 3, 9, 9, 4, 5], [9, 1, 2, 3, 4, 5, 6, 7]])
    docs = document_ids(x, eos)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    # what transformers gets from the tests' reference, computed independently
    ref = packed(x, type("D", (), {"document_mask": True, "eos_id": eos, "document_positions": True}))
    assert ref["position_ids"].tolist() == document_positions(docs).tolist()


def test_batch_layout_gives_each_cp_rank_its_chunks_and_their_positions():
    x = torch.arange(16).view(1, 16)
    parts = [BatchLayout(None, False, False, r, 2)(x, x + 1) for r in range(2)]
    assert parts[0][0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and parts[1][0].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert parts[0][2]["positions"].tolist() == parts[0][0].tolist() and parts[1][1].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert BatchLayout(None, False, False)(x, x)[2] == {}  # the plain path passes nothing


@pytest.mark.slow
@pytest.mark.parametrize("restart", [True, False])
def test_packed_documents_equal_each_document_alone_and_transformers(tmp_path, restart):
    """Logits of a packed batch with the document mask equal transformers' LlamaForCausalLM given the
    equivalent 4-D mask (and position ids restarting per document); with restarting positions, they also
    equal each document run alone. Mutants caught: the mask ignored (tokens see earlier documents), an
    end-of-document token counted in the next document, positions not restarted."""
    from test_hf import model_and_hf

    ours, theirs, m = model_and_hf(dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64),
                                   tmp_path)
    eos = 63
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 63, (2, 40), generator=gen)
    x[0, [5, 6, 20, 39]] = eos
    x[1, [0, 17]] = eos
    data = type("D", (), {"document_mask": True, "eos_id": eos, "document_positions": restart})
    _, _, kw = BatchLayout(eos, True, restart)(x, x)
    with torch.no_grad():
        got = ours(x, **kw)
        want = theirs(input_ids=x, **packed(x, data)).logits
        plain = ours(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert ((plain - want).abs().max() / want.abs().max()).item() > 1e-2  # the mask matters here
    if restart:
        for row in range(2):
            start = 0
            for end in [int(i) + 1 for i in (x[row] == eos).nonzero()] + [x.shape[1]]:
                if end > start:
                    with torch.no_grad():
                        alone = ours(x[row:row + 1, start:end])
                    torch.testing.assert_close(got[row:row + 1, start:end], alone, atol=1e-5, rtol=1e-5)
                start = end


TINY = "+experiment=tiny"


def test_document_mask_on_shards_without_an_eos_id_is_refused(tmp_path):
    """Shards whose meta.json names no end-of-document token (an older format) cannot be masked: refused
    with the fix instead of training without the mask. Mutant caught: the check only for synthetic data."""
    import json

    from hpctrain.data.prepare import prepare

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello world " * 50)
    prepare(tmp_path / "src", tmp_path / "out", val_fraction=0)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    shards = [TINY, "data=shards", f"data.path={tmp_path / 'out'}", "data.seq_len=16", "data.document_mask=true"]
    check(compose(shards))  # the bytes tokenizer's documents end with NUL: eos_id 0
    del meta["eos_id"]
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as info:
        check(compose(shards))
    assert "names no end-of-document token" in str(info.value) and "Fix: data.eos_id=" in str(info.value)
    check(compose([*shards, "data.eos_id=0"]))


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.cp=2", "launcher.nproc=2", "data.seq_len=30"], ["data.seq_len=30 is not divisible by 2 x parallel.cp=4",
                                                                 "Fix: data.seq_len=32"]),
    (["parallel.cp=0"], ["parallel.cp=0 must be at least 1"]),
    (["parallel.cp=4", "launcher.nproc=2"], ["parallel.cp=4", "does not divide the 2 ranks"]),
    (["data.document_mask=true"], ["needs data.eos_id", "Fix: data.eos_id="]),
    (["data.document_positions=true"], ["needs data.document_mask=true"]),
    (["data.eos_id=256", "data.document_mask=true"], ["data.eos_id=256 is not a token", "model.vocab_size=256"]),
    (["parallel.cp=2", "launcher.nproc=2", "parallel.cp_kernel=torch", "data.document_mask=true", "data.eos_id=255"],
     ["parallel.cp_kernel=torch with data.document_mask=true", "takes no mask", "Fix: parallel.cp_kernel=auto"]),
    (["parallel.cp=2", "launcher.nproc=2", "parallel.cp_kernel=torch", "cluster.device=cuda", "train.precision=fp32"],
     ["parallel.cp_kernel=torch with train.precision=fp32 and grouped-query attention", "Fix: train.precision=bf16"]),
])
def test_bad_long_context_configs_are_refused_with_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        check(compose([TINY, *overrides]))
    for part in expected:
        assert part in str(info.value), (part, str(info.value))


@pytest.mark.parametrize("device,mask,precision,asked,runs", [
    ("cuda", False, "bf16", "auto", "torch"), ("cuda", True, "bf16", "auto", "hpctrain"),
    ("cuda", False, "fp32", "auto", "hpctrain"), ("cpu", False, "bf16", "auto", "hpctrain"),
    ("cpu", False, "fp32", "torch", "torch"), ("cuda", False, "bf16", "hpctrain", "hpctrain")])
def test_torch_context_parallel_runs_where_it_covers_the_case(device, mask, precision, asked, runs):
    """auto takes torch's context_parallel on CUDA without a document mask (torch's kernels have no mask in
    the ring) and in bf16 (with grouped K/V only CUDA's 16-bit flash kernel serves the ring), hpctrain's
    kernel otherwise; an explicit choice stands. Mutant caught: auto resolved without the device, the mask
    or the precision."""
    from hpctrain.core.spec import engine_spec

    cfg = compose([TINY, "parallel.cp=2", "launcher.nproc=2", f"parallel.cp_kernel={asked}", f"cluster.device={device}",
                   f"train.precision={precision}", *(["data.document_mask=true", "data.eos_id=255"] if mask else [])])
    assert engine_spec(cfg).cp_kernel == runs


# ------------------------------------------------------------------------- the planner

@pytest.mark.parametrize("experiment", ["llama31_8b_128k", "llama31_70b_128k"])
def test_128k_presets_plan_as_feasible_on_h100(experiment):
    """The presets pass every login-node check and fit an H100's 80 GB at 128K tokens per sequence with
    their cp 8; without cp the same layout does not fit. Mutant caught: activations not divided by cp in
    the memory model (the presets would need 8 times the activation memory)."""
    from dataclasses import replace

    from hpctrain.plan.memory import job_of, memory
    from hpctrain.plan.throughput import throughput

    cfg = compose([f"+experiment={experiment}"])
    check(cfg)
    job = job_of(cfg)
    assert job.spec.layout.cp == 8 and job.spec.seq_len == 131072
    mem = memory(job)
    assert mem.fits, mem.problems
    t = throughput(job)
    assert t.breakdown["cp_exposed"] > 0 and 0.2 < t.mfu < 0.6
    lay = job.spec.layout
    whole = memory(job.with_(layout=replace(lay, cp=1, dp_shard=lay.dp_shard * lay.cp)))
    assert whole.device["activations"] == pytest.approx(8 * mem.device["activations"])
    assert not whole.fits or experiment != "llama31_8b_128k"  # 8B: only cp makes 128K fit one node


def test_planner_prices_cp_traffic_and_the_masked_attention():
    """Against the same job: ring and all-gather move K/V (the ring hides its steps under attention and
    so exposes less here), cp divides the activations, and a document mask of short documents cuts the
    attention time by the share of the causal triangle it keeps, checked against counting the kept pairs
    of simulated documents. Mutants caught: the kept share as L/s (no factor 2), the ring's steps priced
    as unhidden."""
    import numpy as np
    from dataclasses import replace

    from hpctrain.plan.context import attention_kept
    from hpctrain.plan.memory import activations, job_of
    from hpctrain.plan.throughput import throughput

    job = job_of(compose(["+experiment=llama31_70b_128k"]))
    ring, gather = job.with_(cp_attention="ring"), job.with_(cp_attention="allgather")
    assert 0 < throughput(ring).breakdown["cp_exposed"] < throughput(gather).breakdown["cp_exposed"]
    lay = job.spec.layout
    cp1 = job.with_(layout=replace(lay, cp=1, dp_shard=lay.dp_shard * lay.cp))
    assert activations(cp1, 0)["activations"] == pytest.approx(8 * activations(job, 0)["activations"])

    s, L = 131072, 4096
    masked = replace(job.with_(seq_len=s, document_mask=True), doc_len=L)
    rng = np.random.default_rng(0)
    kept = []
    for _ in range(2000):  # documents with exponential lengths: the causal pairs inside one document
        ends = np.cumsum(rng.exponential(L, size=4 * s // L))
        counts = np.diff([0, *np.ceil(ends[ends < s]), s])  # tokens t < end of each document in the sequence
        kept.append((counts * (counts + 1) / 2).sum() / (s * (s + 1) / 2))
    assert attention_kept(masked) == pytest.approx(np.mean(kept), rel=0.03)
    assert attention_kept(replace(masked, doc_len=0)) == 1.0 and attention_kept(job.with_(seq_len=s)) == 1.0
    plain = throughput(job).breakdown["compute"]
    assert throughput(masked).breakdown["compute"] < 0.8 * plain


def test_auto_searches_expert_with_context_parallel_and_the_experts_shard_over_cp():
    """Mixtral 8x7B at 32K tokens: parallel=auto tries ep with cp, and in such a layout the cp ranks join the
    experts' sharding (hpctrain.distributed.mesh: FSDP2 over efsdp x cp), so ZeRO-3's expert state per rank
    falls by cp at the same ep. Mutants caught: the search keeping ep at 1 under cp; the experts' ZeRO group
    without the cp ranks."""
    from dataclasses import replace

    from hpctrain.plan.memory import job_of, memory
    from hpctrain.plan.search import Space, jobs

    def model_state_bytes(j) -> float:
        return sum(memory(j).device.get(k, 0.0) for k in ("params", "grads", "master", "moments"))

    job = job_of(compose(["+experiment=mixtral_8x7b", "data.seq_len=32768", "parallel.zero=3"]))
    assert any(j.spec.layout.ep > 1 and j.spec.layout.cp > 1 for j in jobs(job, Space(acs=("full",), micro_batches=(1,))))
    lay = job.spec.layout  # dp_shard 64, ep 8
    with_cp = job.with_(layout=replace(lay, dp_shard=lay.dp_shard // 2, cp=2))
    assert model_state_bytes(with_cp) == pytest.approx(model_state_bytes(job))
