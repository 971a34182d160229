"""The output layer and the training loss in one module, so that the whole logits never need to exist.

`OutputHead` is the model's output projection (an `nn.Linear`: the same weight, name and checkpoints as
before). Called with hidden states alone it returns the logits; called with `targets` it returns the
summed token losses of the micro-batch (cross-entropy over the trained tokens, plus PaLM's z-loss where
asked), computed one of two ways:

- chunked (train.loss=chunked, the default): `chunk` tokens at a time. Each chunk's logits are made,
  reduced to the chunk's losses and, while they are at hand, turned into the chunk's gradients for the
  hidden states and the output weight (Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024); then
  they are dropped. Backward only scales the gradients made in forward by the loss's incoming gradient
  (a scalar): no logits are kept and none are recomputed, and the FLOPs are those of the full path.
  What lives at once is one chunk's logits, the hidden states' gradient (the size of the hidden states)
  and the weight's gradient accumulated in fp32.
- full (train.loss=full): the logits, then torch's cross-entropy: the reference the chunked path is
  tested against.

Preference tuning (train.objective=dpo) needs each sequence's own sum (its completion's log-probability,
negated), not the micro-batch's: with `per_row` set the head returns one summed loss per row of `targets`,
and the incoming gradient is one factor per row. Those factors are not known in forward (a pair's loss needs
both of its rows' sums and the reference's), so the chunked path then makes no gradients in forward: it keeps
the hidden states and each token's log-sum-exp, and backward makes each chunk's logits again (one GEMM more
than the scalar path, still no whole logits, and no collective: the log-sum-exp is the whole vocabulary's).

Under tensor parallel the weight is split over the vocabulary (hpctrain.parallel.tensor.LossParallel):
each rank computes its slice of every chunk's logits and the ranks agree on each token's log-sum-exp
and target logit with two all-reduces per chunk (Megatron's vocabulary-parallel cross-entropy, done per
chunk). The hidden states' gradient is then a partial sum over the ranks, which DTensor reduces.

The module knows nothing else of parallelism: context parallel gives it its own tokens, pipeline
parallel runs it on the last stage, FSDP2 gathers its weight as any other module's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpctrain.core.shape import loss_chunk_tokens

IGNORE = -100  # targets that are not trained (chat data's prompts): torch's ignore_index


class OutputHead(nn.Linear):
    """The output projection: logits, or with `targets` the micro-batch's summed token losses."""

    def __init__(self, dim: int, vocab: int):
        super().__init__(dim, vocab, bias=False)
        # How the loss is computed (set from the run's config: set_loss).
        self.impl, self.chunk, self.z_loss, self.kernel = "chunked", 0, 0.0, "torch"
        self.per_row = False  # train.objective=dpo: one summed loss per row of targets (set_loss)

    def forward(self, h: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is None:
            return F.linear(h, self.weight)
        if self.per_row:  # z-loss and Liger are refused with dpo on the login node (hpctrain.core.rules)
            if self.impl == "full":
                return full_row_losses(F.linear(h, self.weight), targets)
            return chunked_row_losses(h, self.weight, targets, self.chunk)
        if self.impl == "full":
            return full_loss(F.linear(h, self.weight), targets, self.z_loss)
        if self.kernel == "liger":
            return liger_loss(h, self.weight, targets, self.z_loss)
        return chunked_loss(h, self.weight, targets, self.chunk, self.z_loss)


def set_loss(model: nn.Module, impl: str, chunk: int = 0, z_loss: float = 0.0, kernel: str = "torch",
             per_row: bool = False) -> None:
    """How `model`'s output head computes the loss: train.loss, train.loss_chunk, train.z_loss_coef, the
    resolved train.loss_kernel (spec.loss_kernel), and per_row (train.objective=dpo: a sum per sequence)."""
    for m in model.modules():
        if isinstance(m, OutputHead):
            m.impl, m.chunk, m.z_loss, m.kernel, m.per_row = impl, chunk, z_loss, kernel, per_row


def liger_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """chunked_loss by Liger-Kernel's fused linear cross-entropy (Triton, CUDA; the whole vocabulary on the
    rank): its lse_square_scale is the same z-loss."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as e:
        raise RuntimeError("train.loss_kernel=liger: Liger-Kernel is not installed on this node (pip install "
                           "liger-kernel), or train.loss_kernel=auto") from e
    return liger_fused_linear_cross_entropy(h.flatten(0, -2), weight.to(h.dtype), targets.flatten(),
                                            ignore_index=IGNORE, lse_square_scale=z_loss, reduction="sum").float()


def full_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy of the trained tokens (fp32), plus z_loss x logsumexp^2 of each: the whole logits
    at once (under tensor parallel, in torch's loss_parallel context, split over the vocabulary)."""
    logits, targets = logits.flatten(0, 1).float(), targets.flatten()
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    if z_loss:
        lse = torch.logsumexp(logits, dim=-1)
        if hasattr(lse, "full_tensor"):  # tensor parallel: replicated DTensors, as plain tensors
            lse, loss = lse.full_tensor(), loss.full_tensor()
        loss = loss + z_loss * (lse.pow(2) * (targets != IGNORE)).sum()
    return loss


def full_row_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed cross-entropy of its trained tokens (fp32), shape (rows,): the whole logits at once
    (under tensor parallel split over the vocabulary, in loss_parallel; returned as a plain tensor)."""
    rows = targets.shape[0]
    token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    if hasattr(token, "full_tensor"):
        token = token.full_tensor()
    return token.view(rows, -1).sum(dim=1)


def chunked_row_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """full_row_losses(h @ weight.T, targets) without the whole logits, `chunk` tokens at a time; the same
    arguments as chunked_loss (tensor parallel included)."""
    group, start = None, 0
    if hasattr(weight, "to_local"):
        from torch.distributed.tensor import Partial

        mesh = weight.device_mesh
        group = mesh.get_group()
        local = weight.to_local()
        start = mesh.get_local_rank() * local.shape[0]
        h = h.to_local(grad_placements=[Partial()]) if hasattr(h, "to_local") else h
        weight = local
    rows = targets.shape[0]
    flat_h, flat_t = h.flatten(0, -2), targets.flatten()
    size = loss_chunk_tokens(flat_h.shape[0], weight.shape[0], weight.shape[1], chunk)
    return _ChunkedRowCrossEntropy.apply(flat_h, weight, flat_t, size, group, start, rows)


def chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 0,
                 z_loss: float = 0.0) -> torch.Tensor:
    """full_loss(h @ weight.T, targets, z_loss) without the whole logits: `chunk` tokens at a time (0: as
    hpctrain.core.shape.loss_chunk_tokens says). h (batch, seq, dim), or under tensor parallel a DTensor
    replicated over the TP ranks with the weight a DTensor split over the vocabulary (dim 0)."""
    group, start = None, 0
    if hasattr(weight, "to_local"):  # vocabulary-parallel: this rank's rows of the weight
        from torch.distributed.tensor import Partial

        mesh = weight.device_mesh
        group = mesh.get_group()
        local = weight.to_local()
        start = mesh.get_local_rank() * local.shape[0]  # Shard(0) splits evenly (model.vocab_size % tp == 0)
        # every rank's gradient for the (replicated) hidden states is its slice's share: a partial sum
        h = h.to_local(grad_placements=[Partial()]) if hasattr(h, "to_local") else h
        weight = local
    flat_h, flat_t = h.flatten(0, -2), targets.flatten()
    n = flat_h.shape[0]
    size = loss_chunk_tokens(n, weight.shape[0], weight.shape[1], chunk)  # this rank's vocabulary (slice)
    grads = torch.is_grad_enabled()  # evaluation (no_grad) computes the losses only
    return _ChunkedLinearCrossEntropy.apply(flat_h, weight, flat_t, size, float(z_loss), group, start, grads)


def _chunk_softmax(hc, w, tc, start: int, group, acc):
    """One chunk's logits (hc @ w.T, this rank's vocabulary slice from `start`) turned in place into its
    softmax numerators exp(logit - max) (one fp32 chunk alive), with what the losses need: the trained
    tokens (keep), the targets in this slice's ids (local_t) and those it owns, the sums over the vocabulary
    of the numerators and of the target's logit (sums: all-reduced over `group`, vocabulary parallel) and
    each token's log-sum-exp."""
    vocab = w.shape[0]
    logits = (hc @ w.t()).to(acc)
    keep = tc != IGNORE
    local_t = tc - start
    owned = keep & (local_t >= 0) & (local_t < vocab)
    picked = logits.gather(1, local_t.clamp(0, vocab - 1)[:, None]).squeeze(1) * owned
    top = logits.amax(dim=-1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    probs = logits.sub_(top[:, None]).exp_()
    sums = torch.stack((probs.sum(dim=-1), picked))
    if group is not None:
        dist.all_reduce(sums, group=group)
    return probs, keep, local_t, owned, sums, top + sums[0].log()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(h (n, dim), weight (vocab slice, dim), targets (n,)) -> the summed loss; see the module's docstring."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, z_loss: float, group, start: int, grads: bool):
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        # Explicit dtypes: under autocast (DDP, ZeRO-1) h arrives in 16 bits and the weight in fp32; the
        # matmuls run in h's dtype, as autocast would run them, the softmax in fp32.
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32 (float64 stays float64)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)
            total = torch.zeros((), dtype=acc, device=h.device)
            grad_h = torch.empty_like(h) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
            vocab = w.shape[0]
            for s in range(0, h.shape[0], chunk):
                hc, tc = h[s:s + chunk], targets[s:s + chunk]
                probs, keep, local_t, owned, sums, lse = _chunk_softmax(hc, w, tc, start, group, acc)
                token = (lse - sums[1]) * keep
                if z_loss:
                    token = token + z_loss * lse.pow(2) * keep
                total += token.sum()
                if not (want_h or want_w):
                    del probs
                    continue
                # d loss / d logit_j = softmax_j (1 + 2 z lse) - [j is the target], for trained tokens
                scale = (1.0 + 2.0 * z_loss * lse) * keep / sums[0]
                g = probs.mul_(scale[:, None])
                rows = owned.nonzero().squeeze(1)
                g[rows, local_t[rows]] -= 1.0
                g = g.to(h.dtype)
                if want_h:
                    torch.mm(g, w, out=grad_h[s:s + chunk])
                if want_w and g.dtype == acc:
                    grad_w.addmm_(g.t(), hc)  # in place: no weight-sized temporary per chunk
                elif want_w:  # a 16-bit GEMM, added to the fp32 sum a slice of the vocabulary at a time, so
                    # that its temporaries stay within half a chunk's logits
                    rows = max(1, hc.shape[0] * vocab // (2 * hc.shape[1]))
                    for r in range(0, vocab, rows):
                        grad_w[r:r + rows] += (g[:, r:r + rows].t() @ hc).to(acc)
                del probs, g  # before the next chunk's logits are made: one chunk alive at a time
        # Kept on ctx rather than saved for backward: they are gradients, not inputs to recompute from, and
        # backward scales them in place and lets them go (the graph's node may live on: a pipeline schedule
        # keeps every micro-batch's loss until the step ends).
        ctx.grad_h, ctx.grad_w, ctx.w_dtype = grad_h, grad_w, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.grad_h, ctx.grad_w
        if _graph_kept():
            # A retained graph runs this again: torch's zero-bubble schedules take a stage's input gradients
            # first, then its weights' from the same graph. Out of place, the tensors kept for that.
            gh = gh * grad_out if gh is not None else None
            gw = (gw * grad_out).to(ctx.w_dtype) if gw is not None else None
            return gh, gw, None, None, None, None, None, None
        ctx.grad_h = ctx.grad_w = None  # the last pass: scaled in place, then let go
        if gh is not None:
            gh.mul_(grad_out)  # a 0-dim fp32 factor: multiplied in fp32, rounded once to h's dtype
        if gw is not None:
            gw = gw.mul_(grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None, None


class _ChunkedRowCrossEntropy(torch.autograd.Function):
    """(h (n, dim), weight (vocab slice, dim), targets (n,)) -> each row's summed loss (rows,), the n tokens
    being `rows` rows of equal length. Forward keeps h and each token's log-sum-exp; backward scales each
    token's gradient by its row's incoming factor, making the chunk's logits again (module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, group, start: int, rows: int):
        acc = torch.promote_types(h.dtype, torch.float32)
        row_of = torch.arange(h.shape[0], device=h.device) // (h.shape[0] // rows)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)
            total = torch.zeros(rows, dtype=acc, device=h.device)
            lse_all = torch.empty(h.shape[0], dtype=acc, device=h.device)
            for s in range(0, h.shape[0], chunk):
                probs, keep, _, _, sums, lse = _chunk_softmax(h[s:s + chunk], w, targets[s:s + chunk], start,
                                                              group, acc)
                lse_all[s:s + chunk] = lse
                total.index_add_(0, row_of[s:s + chunk], (lse - sums[1]) * keep)
                del probs
        ctx.save_for_backward(h, weight, targets, lse_all, row_of)
        ctx.chunk, ctx.start = chunk, start
        return total

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, targets, lse_all, row_of = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse_all.dtype
        factor = grad_out.to(acc)[row_of]  # each token's share of its row's incoming gradient
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)
            vocab = w.shape[0]
            for s in range(0, h.shape[0], ctx.chunk):
                hc, tc = h[s:s + ctx.chunk], targets[s:s + ctx.chunk]
                keep = tc != IGNORE
                local_t = tc - ctx.start
                owned = keep & (local_t >= 0) & (local_t < vocab)
                f = factor[s:s + ctx.chunk] * keep
                # d loss / d logit_j = (softmax_j - [j is the target]) x the row's factor
                g = (hc @ w.t()).to(acc).sub_(lse_all[s:s + ctx.chunk, None]).exp_().mul_(f[:, None])
                rows = owned.nonzero().squeeze(1)
                g[rows, local_t[rows]] -= f[rows]
                g = g.to(h.dtype)
                if want_h:
                    torch.mm(g, w, out=grad_h[s:s + ctx.chunk])
                if want_w:
                    grad_w += (g.t() @ hc).to(acc)
                del g
        return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None, None, None, None


def _graph_kept() -> bool:
    """Whether the backward running now keeps the graph for another pass (retain_graph=True). torch says so
    only privately; where it does not, assume it does (out of place: right, one copy more)."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return True
