"""A Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) that knows nothing of parallelism.

Parallelism is applied from outside by small functions in `hpctrain.parallel`, torchtitan-style.
Blocks live in an `nn.ModuleDict` keyed by index so that a pipeline stage can drop the blocks it
does not own and keep the same parameter names as the full model (checkpoints stay portable).
Build on the meta device, shard, then materialize this rank's part with `init_param_` for each
parameter (hpctrain.parallel.init.materialize does so for any layout).
"""
from __future__ import annotations

import math
import torch
from torch import nn

from hpctrain.models.lora import init_lora_

from hpctrain.core.schema import ModelConfig
from hpctrain.core.shape import head_dim, moe_layer
from hpctrain.models.attention import causal_attention
from hpctrain.models.ffn import FeedForward
from hpctrain.models.loss import OutputHead
from hpctrain.models.dispatch import local_weight
from hpctrain.models.moe import MoE, moe_modules


def rope_frequencies(a: ModelConfig, device=None) -> torch.Tensor:
    """The rotation frequency of each channel pair, Llama 3.1's scaling applied where configured."""
    hd = head_dim(a)
    freqs = 1.0 / (a.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    if a.rope_scaling <= 0:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_wavelen = a.rope_original_max_seq_len / a.rope_low_freq_factor
    high_wavelen = a.rope_original_max_seq_len / a.rope_high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, freqs / a.rope_scaling, freqs)
    smooth = (a.rope_original_max_seq_len / wavelen - a.rope_low_freq_factor) / \
        (a.rope_high_freq_factor - a.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / a.rope_scaling + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(a: ModelConfig, max_seq_len: int, device=None) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair, stacked: shape (2, max_seq_len, head_dim // 2)."""
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), rope_frequencies(a, device))
    return torch.stack((angles.cos(), angles.sin()))


def apply_rope(x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) by each position's angles, channel i paired with channel
    i + head_dim/2 (the "rotate half" layout of Hugging Face's Llama, so that its checkpoints load
    as they are; Meta's original pairs 2i with 2i+1, which conversions permute). `positions`
    (batch, seq): each token's position, where it is not its index (context-parallel chunks, positions
    restarting per document)."""
    b, seq = x.shape[:2]
    if positions is None:
        cos = rope[0, :seq].view(1, seq, 1, -1)
        sin = rope[1, :seq].view(1, seq, 1, -1)
    else:
        cos = rope[0][positions].view(b, seq, 1, -1)
        sin = rope[1][positions].view(b, seq, 1, -1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm (computed in fp32, as Hugging Face's LlamaRMSNorm) keeping only its input and the
    per-token 1/rms for backward. Autograd of the same ops keeps the fp32 copy of the input and the
    normalized tensor as well: in bf16, four times the input's bytes more per norm."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        n = xf * rstd
        d_weight = (grad * n.type_as(x)).sum(tuple(range(grad.ndim - 1))).to(weight.dtype)
        dn = (grad * weight).type_as(x).float()
        dx = dn * rstd - xf * (rstd.pow(3) * (dn * xf).mean(-1, keepdim=True))
        return dx.type_as(x), d_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiled graph's partitioner decides what to keep
            xf = x.float()
            out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight
        else:
            w = self.weight
            if hasattr(w, "to_local") and not hasattr(x, "to_local"):
                # QK-norm under tensor parallel: a weight replicated over TP on this rank's local heads
                w = local_weight(w)
            out = _RMSNorm.apply(x, w, self.eps)
        # Under autocast (fp32 parameters) the output is fp32 and feeds only matmuls, each of which would
        # cast it to bf16 and keep its own copy for backward (three for wq, wk, wv): cast it once here,
        # the same values autocast would make, so that they share one copy and tensor parallel gathers
        # it in bf16, as with bf16 parameters.
        if torch.is_autocast_enabled(out.device.type):
            out = out.to(torch.get_autocast_dtype(out.device.type))
        return out

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, a: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, head_dim(a)
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)
        # Qwen3: each query and key head normalized before RoPE.
        self.q_norm = RMSNorm(self.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, a.norm_eps) if a.qk_norm else None
        # (q, k, v, documents) -> out; context parallelism puts its own in place (hpctrain.parallel.context)
        self.kernel = causal_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of the head counts: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope, positions), apply_rope(k, rope, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.kernel(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Attention, then a SwiGLU (`feed_forward`) or, in a Mixture-of-Experts layer, experts (`moe`)."""

    def __init__(self, a: ModelConfig, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        if moe:
            self.moe = MoE(a)
        else:
            self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions, documents)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a: ModelConfig, max_seq_len: int):
        super().__init__()
        self.config, self.max_seq_len = a, max_seq_len
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a, moe_layer(a, i)) for i in range(a.n_layers)})
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = OutputHead(a.dim, a.vocab_size)  # with targets, the loss (hpctrain.models.loss)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints never carry it.
        self.register_buffer("rope", rope_tables(a, max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq), or the hidden states on a later pipeline stage. positions (batch, seq):
        each token's position where it is not its index; documents (batch, seq): a document id per token,
        no token attending to another document's (data.document_mask). Returns the logits, or with
        `targets` (batch, seq) the summed loss of the trained tokens (the output layer and the loss in one,
        hpctrain.models.loss); a stage without the output layer returns its hidden states either way."""
        # Any of these may be None on a pipeline stage that does not own it.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope, positions, documents)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if targets is None else self.output(h, targets=targets)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """The buffers a meta-device model materialized empty: RoPE's tables, the routers' biases
        (a checkpoint, when resumed from, then loads the biases it saved)."""
        self.rope = rope_tables(self.config, self.max_seq_len, device=device)
        for moe in moe_modules(self):
            moe.reset_parameters()


@torch.no_grad()
def init_param_(name: str, t: torch.Tensor, a: ModelConfig, generator: torch.Generator | None = None) -> None:
    """Initialize the full (unsharded) parameter `name` in place.

    A function of the name alone, so every layout can reproduce the same initial model by
    generating each full parameter with a generator seeded from its name and keeping its shard.
    """
    leaf = name.rsplit(".", 2)
    if init_lora_(name, t, generator):
        return
    if name.endswith("norm.weight"):
        nn.init.ones_(t)
    elif name == "tok_embeddings.weight":
        nn.init.normal_(t, std=1.0 if not a.tie_embeddings else a.init_std, generator=generator)
    elif name == "output.weight":
        std = a.dim ** -0.5
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)
    elif leaf[-2] in ("wo", "w2") or (leaf[-2] == "experts" and leaf[-1] == "w2"):
        # Residual-branch outputs scaled down with depth (GPT-2 / torchtitan).
        std = a.init_std / math.sqrt(2 * a.n_layers)
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)
    else:
        std = a.init_std
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)


def build_meta(a: ModelConfig, max_seq_len: int) -> Llama:
    with torch.device("meta"):
        return Llama(a, max_seq_len)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
