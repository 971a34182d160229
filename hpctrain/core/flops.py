"""Parameter counts and FLOPs of a Llama shape, by arithmetic (no weights, no torch)."""
from __future__ import annotations


from hpctrain.core.schema import ModelConfig


def param_counts(m: ModelConfig) -> dict:
    """Parameters by kind; `total` matches the published Llama 3 counts exactly."""
    head_dim = m.dim // m.n_heads
    attn = m.dim * head_dim * (m.n_heads * 2 + m.n_kv_heads * 2)  # wq, wo, wk, wv
    mlp = 3 * m.dim * m.ffn_dim
    norms = 2 * m.dim
    per_block = attn + mlp + norms
    embedding = m.vocab_size * m.dim
    output = 0 if m.tie_embeddings else m.vocab_size * m.dim
    total = embedding + m.n_layers * per_block + m.dim + output
    return {"total": total, "embedding": embedding, "output": output, "per_block": per_block,
            "blocks": m.n_layers * per_block, "final_norm": m.dim}


def train_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token: 6 x (non-embedding parameters) for the matmuls of forward
    and backward, plus 12 x layers x heads x head_dim x seq_len for attention scores (PaLM's rule,
    as torchtitan reports MFU). The embedding lookup is not a matmul; the output projection is."""
    c = param_counts(m)
    dense = c["total"] - c["embedding"] + (c["embedding"] if m.tie_embeddings else 0)
    head_dim = m.dim // m.n_heads
    return 6.0 * dense + 12.0 * m.n_layers * m.n_heads * head_dim * seq_len


def recompute_flops_per_token(m: ModelConfig, seq_len: int, recomputed_blocks: float, last_linear: bool = True) -> float:
    """FLOPs per token that activation checkpointing adds: the forward of every recomputed block
    again (2 x its parameters for the matmuls, 4 x heads x head_dim x seq_len for attention scores,
    the forward third of train_flops_per_token's terms). Model FLOPs plus these are the hardware FLOPs
    papers report beside MFU (Korthikanti et al. 2022, "Reducing Activation Recomputation").
    last_linear=False: the recompute stops before the block's last linear (w2), as torch's
    non-reentrant checkpoint does, and these are the FLOPs it actually runs."""
    head_dim = m.dim // m.n_heads
    w2 = 0.0 if last_linear else 2.0 * m.ffn_dim * m.dim
    return recomputed_blocks * (2.0 * param_counts(m)["per_block"] - w2 + 4.0 * m.n_heads * head_dim * seq_len)
