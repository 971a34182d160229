"""What follows from the model keys alone (no torch): the head width, which blocks are
Mixture-of-Experts layers, the width of an expert. The model, the parameter counts, the Hugging Face
format and the planner all read these, so each rule lives here once."""
from __future__ import annotations

from hpctrain.core.schema import ModelConfig


def head_dim(m: ModelConfig) -> int:
    """model.head_dim where set (Qwen3), else dim / n_heads."""
    return m.head_dim or m.dim // max(1, m.n_heads)


def is_moe(m: ModelConfig) -> bool:
    return m.moe.experts > 0


def moe_layer(m: ModelConfig, i: int) -> bool:
    """Block i (0-based) routes its tokens to experts: past moe.first_dense, every moe.every-th."""
    e = m.moe
    return e.experts > 0 and i >= e.first_dense and (i + 1) % max(1, e.every) == 0


def moe_layers(m: ModelConfig) -> list[int]:
    return [i for i in range(m.n_layers) if moe_layer(m, i)]


def moe_layer_count(m: ModelConfig) -> int:
    """len(moe_layers(m)) by arithmetic: the planner asks for it for every layout it weighs."""
    if m.moe.experts <= 0:
        return 0
    every = max(1, m.moe.every)  # blocks i in [first_dense, n_layers) with i + 1 a multiple of every
    return max(0, m.n_layers // every - min(m.moe.first_dense, m.n_layers) // every)


def expert_ffn(m: ModelConfig) -> int:
    """Hidden width of one routed expert: moe.ffn_dim, or model.ffn_dim when unset."""
    return m.moe.ffn_dim or m.ffn_dim


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # hpctrain's linear layers of a block
# Hugging Face's names of the block's linear layers (Llama, Qwen, Mixtral), as model.lora.targets may give them.
HF_LINEAR = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1", "down_proj": "w2",
             "up_proj": "w3"}


def is_adapter(name: str) -> bool:
    """A LoRA adapter's parameter (hpctrain.models.lora), by its name."""
    return name.endswith(("lora_A", "lora_B"))


def loss_chunk_tokens(tokens: int, vocab: int, dim: int, asked: int = 0) -> int:
    """Tokens per chunk of the chunked loss (train.loss=chunked) for a micro-batch of `tokens` on one rank
    whose output layer holds `vocab` rows (its slice of the vocabulary under tensor parallel):
    train.loss_chunk where set, else enough chunks that one chunk's logits (chunk x vocab) hold about as
    many elements as the micro-batch's hidden states (tokens x dim), Liger's rule: tokens / ceil(vocab /
    dim), rounded up to a power of two, but at least MIN_LOSS_CHUNK tokens. The engine
    (hpctrain.models.loss) and the planner read it here."""
    if asked > 0:
        return max(1, min(asked, tokens))
    chunks = max(1, -(-vocab // max(1, dim)))
    per = max(1, -(-tokens // chunks))
    return min(tokens, max(MIN_LOSS_CHUNK, 1 << (per - 1).bit_length()))


# Liger's rule alone makes chunks of 16 tokens at vocabulary 32768 and dim 256: each chunk's three GEMMs are
# then 16 rows thin and the weight's fp32 gradient (vocab x dim) is read and written once per chunk, so the
# loss took 6.4x the whole logits' time on CPU (32 tokens 3x, 256 1.2x, 1024 0.92x: benchmarks/chunked_loss.py).
# 1024 tokens keep the GEMMs as efficient as the whole one; a chunk's logits are still tokens / 1024 times
# smaller than the whole logits (Liger-Kernel's own Triton kernel, train.loss_kernel=liger, chunks as it likes).
MIN_LOSS_CHUNK = 1024
