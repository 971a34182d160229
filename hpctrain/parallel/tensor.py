"""Tensor parallel with sequence parallel (Megatron-style), as a plan over the plain Llama.

Attention and MLP: the first projections split their output features (Colwise), the last ones their
input features (Rowwise), so each block needs one all-gather in and one reduce-scatter out.
Between blocks the activations stay split along the sequence (sequence parallel), so norms and
residuals hold 1/tp of the activations. The output projection splits the vocabulary and the loss is
computed on the split logits (loss parallel), never materializing the full logits on one rank.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> nn.Module:
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = LossParallel(input_layouts=Shard(1),
                                           output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                           use_local_output=not loss_parallel)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if hasattr(block, "moe"):
            # Each TP rank routes its own share of the sequence (Megatron's MoE under sequence parallel):
            # the layer takes the sequence-parallel shard as a plain tensor and returns its own, which the
            # residual add takes as the blocks' outputs are taken (local shards). Its routing statistics are
            # summed over the TP ranks by its token dispatcher (chosen in hpctrain.parallel.apply).
            plan["moe"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        parallelize_module(block, tp_mesh, plan)
        if hasattr(block, "moe"):
            replicate_params(block.moe, tp_mesh)
        if block.attention.q_norm is not None:  # QK-norm weights, applied to each rank's own heads
            replicate_params(block.attention.q_norm, tp_mesh)
            replicate_params(block.attention.k_norm, tp_mesh)
    return model


class LossParallel(ColwiseParallel):
    """The output layer split over the vocabulary (ColwiseParallel), which also computes the loss: called
    with targets (hpctrain.models.loss.OutputHead) it returns the summed loss, a plain tensor the same on
    every TP rank, which passes through as it is; logits come out split over the vocabulary as before."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor) or outputs.ndim == 0:  # the loss (train.loss=full: a DTensor)
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def replicate_params(module: nn.Module, tp_mesh) -> None:
    """Every parameter of `module` as a DTensor replicated over TP. The module computes on each rank's
    own tokens or heads with the local weight (hpctrain.models.dispatch.local_weight), whose gradient is then
    partial and summed over TP; FSDP2 and the gradient norm see a TP parameter like any other."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                sub.register_parameter(name, nn.Parameter(distribute_tensor(p, tp_mesh, [Replicate()])))


def keep_grads_like_params(model: nn.Module) -> nn.Module:
    """Without FSDP (which reduce-scatters gradients into its own layout), a tensor-parallel gradient
    arrives in whatever placement DTensor's backward produced: the vocabulary-parallel embedding's
    comes back replicated, the whole vocab x dim tensor on every TP rank. Each gradient is laid out
    like its parameter as soon as it is accumulated (a local slice, no communication)."""
    def relayout(p):
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)

    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:  # (LoRA's frozen weights get no gradient)
            p.register_post_accumulate_grad_hook(relayout)
    return model
