"""Parameter counts and FLOPs of a Llama shape, dense or Mixture-of-Experts, by arithmetic (no
weights, no torch)."""
from __future__ import annotations


from hpctrain.core.schema import ModelConfig
from hpctrain.core.shape import HF_LINEAR, expert_ffn, head_dim as _head_dim, moe_layer_count


def param_counts(m: ModelConfig) -> dict:
    """Parameters by kind; `total` matches the published Llama 3, Mixtral and Qwen3-MoE counts exactly.

    `active`: the parameters one token's forward uses (the router, top_k routed and the shared experts
    of each MoE layer; everything else), the count MoE papers publish beside the total. `per_block` is
    the mean over blocks (dense and MoE blocks differ); `experts`: the routed experts' parameters, the
    part expert parallelism splits; `moe_layers`: how many blocks route."""
    hd = _head_dim(m)
    attn = m.dim * hd * (m.n_heads * 2 + m.n_kv_heads * 2)  # wq, wo, wk, wv
    attn += 2 * hd if m.qk_norm else 0
    norms = 2 * m.dim
    dense_block = attn + 3 * m.dim * m.ffn_dim + norms
    n_moe = moe_layer_count(m)
    e, f = m.moe, expert_ffn(m)
    expert = 3 * m.dim * f
    shared = e.shared_experts * expert
    router = e.experts * m.dim
    moe_block = attn + norms + router + shared + e.experts * expert
    blocks = (m.n_layers - n_moe) * dense_block + n_moe * moe_block
    embedding = m.vocab_size * m.dim
    output = 0 if m.tie_embeddings else m.vocab_size * m.dim
    total = embedding + blocks + m.dim + output
    active = total - n_moe * (e.experts - e.top_k) * expert
    return {"total": total, "active": active, "embedding": embedding, "output": output,
            "per_block": blocks / m.n_layers if n_moe else dense_block, "blocks": blocks, "final_norm": m.dim,
            "experts": n_moe * e.experts * expert, "moe_layers": n_moe, "expert": expert,
            "dense_block": dense_block, "moe_block": moe_block - e.experts * expert}


def lora_linears(m: ModelConfig, tp: int = 1) -> list[tuple[float, float, int]]:
    """(in_features, out_features, layers) of each adapted linear kind (model.lora.targets): the
    attention projections of every block, the SwiGLU of dense blocks and of MoE blocks' shared experts
    (routed experts get no adapters). `tp` splits them as tensor parallel does."""
    lo = getattr(m, "lora", None)
    if lo is None or lo.rank <= 0:
        return []
    hd, n_moe = _head_dim(m), moe_layer_count(m)
    shared = m.moe.shared_experts * expert_ffn(m) if m.moe.experts else 0
    ffn_layers = [(m.ffn_dim, m.n_layers - n_moe)] + ([(shared, n_moe)] if shared and n_moe else [])
    shapes = {"wq": [(m.dim, m.n_heads * hd, m.n_layers)], "wk": [(m.dim, m.n_kv_heads * hd, m.n_layers)],
              "wv": [(m.dim, m.n_kv_heads * hd, m.n_layers)], "wo": [(m.n_heads * hd, m.dim, m.n_layers)],
              "w1": [(m.dim, f, n) for f, n in ffn_layers], "w3": [(m.dim, f, n) for f, n in ffn_layers],
              "w2": [(f, m.dim, n) for f, n in ffn_layers]}
    out = []
    for t in dict.fromkeys(HF_LINEAR.get(t, t) for t in lo.targets):
        for i, o, n in shapes.get(t, []):
            rowwise = t in ("wo", "w2")
            out.append((i / tp if rowwise else i, o if rowwise else o / tp, n))
    return out


def lora_params(m: ModelConfig, tp: int = 1) -> float:
    """Adapter parameters (rank x (in + out) per adapted linear), on one TP rank: a colwise layer's A
    is replicated and its B split, a rowwise layer's A split and its B replicated (hpctrain.models.lora)."""
    r = m.lora.rank if getattr(m, "lora", None) is not None else 0
    return sum(r * (i + o) * n for i, o, n in lora_linears(m, tp))


def attention_flops_per_token(m: ModelConfig, seq_len: int, kept: float = 1.0) -> float:
    """FLOPs per trained token of the attention scores, forward and backward: QK^T and the product with V,
    2 x 2 x heads x head_dim FLOPs per (query, key) pair forward and twice that backward, over the pairs
    computed: under the causal mask a token attends to half the sequence on average, and a document mask
    keeps `kept` of those (hpctrain.plan.context.attention_kept). So 6 x layers x heads x head_dim x
    seq_len x kept: half of PaLM's 12 l h s, which counts the whole s x s square."""
    return 12.0 * m.n_layers * m.n_heads * _head_dim(m) * seq_len * 0.5 * kept


def train_flops_per_token(m: ModelConfig, seq_len: int, kept: float = 1.0) -> float:
    """Model FLOPs per trained token, the FLOPs a step computes (MFU's numerator, in logs and plans):
    6 x (non-embedding parameters) for the matmuls of forward and backward, plus the attention scores of
    the (query, key) pairs computed (attention_flops_per_token: the causal half, times the share `kept`
    a document mask keeps). The embedding lookup is not a matmul; the output projection is. With LoRA
    (model.lora) the frozen weights need no weight gradient: 4 x theirs (forward and the input
    gradient), 6 x the adapters'."""
    c = param_counts(m)
    # A token's matmuls use the active parameters only: MoE FLOPs come from the routed top_k experts.
    dense = c["active"] - c["embedding"] + (c["embedding"] if m.tie_embeddings else 0)
    adapters = lora_params(m)
    per_param = 4.0 if adapters else 6.0
    return per_param * dense + 6.0 * adapters + attention_flops_per_token(m, seq_len, kept)


def recompute_flops_per_token(m: ModelConfig, seq_len: int, recomputed_blocks: float, last_linear: bool = True,
                              kept: float = 1.0) -> float:
    """FLOPs per token that activation checkpointing adds: the forward of every recomputed block
    again (2 x its parameters for the matmuls, the forward third of its attention_flops_per_token), the
    forward third of train_flops_per_token's terms. Model FLOPs plus these are the hardware FLOPs
    papers report beside MFU (Korthikanti et al. 2022, "Reducing Activation Recomputation").
    last_linear=False: the recompute stops before the block's last linear (w2), as torch's
    non-reentrant checkpoint does, and these are the FLOPs it actually runs."""
    c = param_counts(m)
    w2 = 0.0 if last_linear else 2.0 * m.ffn_dim * m.dim
    active_block = c["per_block"] - (c["experts"] - c["moe_layers"] * m.moe.top_k * c["expert"]) / m.n_layers
    attention = attention_flops_per_token(m, seq_len, kept) / m.n_layers / 3
    return recomputed_blocks * (2.0 * active_block - w2 + attention)
