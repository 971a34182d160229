"""QLoRA's frozen base (model.lora.quantize=nf4): the weights of the adapted linear layers stored as torchao's
NF4Tensor (Dettmers et al. 2023, arXiv:2305.14314: 4-bit NormalFloat in blocks of 64 weights, each block's
absmax scale quantised again to 8 bits in blocks of 256 scales), applied over a parallelized model once its
full-precision weights are loaded (the seed's initialization, model.init_from, or a checkpoint's base).

What is quantised is each layer's tensor-parallel shard (the whole weight without TP): torchao's NF4 blocks
run over the row-major flattened tensor, so a weight split by input features (TP's rowwise wo, w2) has no
NF4 slice per rank; each rank quantises its own shard instead, rows or columns alike, and the export
(hpctrain.checkpoint.hf_weights) does the same with the checkpoint's tp. Over data-parallel shards
(FSDP2) the TP shard is gathered, quantised whole and cut into rows, as torchtune's QLoRA shards it: every
dp_shard degree holds the same NF4 weights, and FSDP2 all-gathers the 4-bit data through NF4Tensor's
fsdp_pre/post_all_gather.

The output layer, the embeddings and the norms stay in the compute precision, as in the QLoRA paper and
torchtune (only the adapted linears are quantised): the output layer's logits are the most sensitive to
rounding, and a tied output is the embedding itself, which NF4 cannot index.
"""
from __future__ import annotations

import torch
from torch import nn

from hpctrain.models.lora import LoRALinear

from hpctrain.core.rules import NF4_BLOCK as BLOCK, NF4_SCALER_BLOCK as SCALER_BLOCK  # (the rule that checks shapes)


def _fsdp_params(part: nn.Module) -> dict:
    """{(module, parameter name): (FSDP2's FSDPParam, its param group)} of every fully_shard-ed module of `part`."""
    out = {}
    for m in part.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        for fp in getattr(group, "fsdp_params", []):
            out[(fp._module_info.module, fp._module_info.param_name)] = (fp, group)
    return out


# The private parts of FSDP2 (torch 2.13) a replaced NF4 parameter goes through, as torchtune's QLoRA does.
FSDP_INTERNALS = ("_module_info", "_sharded_param_data", "reset_sharded_param", "_init_extensions")


def _check_internals(fsdp: dict) -> None:
    """A torch whose FSDP2 lacks what quantize_base uses is said in words, before any weight is replaced (every
    FSDPParam is of one class: the first tells)."""
    if not fsdp:
        return
    fp, _ = next(iter(fsdp.values()))
    missing = [a for a in FSDP_INTERNALS if not hasattr(fp, a)]
    if missing:
        raise RuntimeError(f"model.lora.quantize=nf4 under FSDP2 uses private parts of torch 2.13's FSDP2 that "
                           f"torch {torch.__version__} lacks ({', '.join(missing)}). Fix: torch 2.13, or "
                           f"parallel.zero=0 (DDP) or parallel.tp for QLoRA")


@torch.no_grad()
def _to_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The NF4 parameter of `w` (a plain tensor or a DTensor over data-parallel and tp dimensions), the same
    not sharded over data parallel (a plain tensor, or a DTensor over tp alone), and the number of
    data-parallel shards."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchao.quantization import to_nf4  # torchao 0.18 (torchao.dtypes.nf4tensor before 0.15)

    if not isinstance(w, DTensor):
        q = to_nf4(w.contiguous(), BLOCK, SCALER_BLOCK)
        return q, q, 1
    mesh, names = w.device_mesh, w.device_mesh.mesh_dim_names or ()
    tp = [i for i, n in enumerate(names) if n == "tp"]
    # this rank's TP shard, whole over the data-parallel dimensions
    whole = w.redistribute(mesh, [p if i in tp else Replicate() for i, p in enumerate(w.placements)]).to_local()
    q = to_nf4(whole.contiguous(), BLOCK, SCALER_BLOCK)
    unsharded = (DTensor.from_local(q, mesh["tp"], [w.placements[tp[0]]], run_check=False,
                                    shape=w.shape, stride=w.stride()) if tp else q)
    shards = 1
    for i, p in enumerate(w.placements):
        if i not in tp and isinstance(p, Shard):  # FSDP2's Shard(0): rows, cut on NF4's own blocks
            q = torch.chunk(q, mesh.size(i), dim=0)[mesh.get_local_rank(i)]
            shards *= mesh.size(i)
    if shards > 1:  # the chunk is a view of the whole weight's NF4 storages: a copy of its own frees them
        own = torch.empty_like(q)  # (torchao's clone would quantise again, about another scale mean)
        own.copy_(q)
        q = own
    return DTensor.from_local(q, mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()), unsharded, shards


def quantize_base(parts: list) -> int:
    """Store the frozen weight of every LoRALinear of `parts` as NF4, in place; all ranks call it together.
    Returns the bytes of this rank's NF4 storages (hpctrain.plan.memory prices them)."""
    total = 0
    for part in parts:
        fsdp = _fsdp_params(part)
        _check_internals(fsdp)
        for m in part.modules():
            if not isinstance(m, LoRALinear) or m.nf4:
                continue
            q, unsharded, shards = _to_nf4(m.weight)
            fp, group = fsdp.get((m, "weight"), (None, None))
            if fp is not None and shards == 1:
                # FSDP2 over one shard (one rank, or tp alone) gathers nothing, and its one-rank path copies a
                # single all-gather input where NF4 has three: the weight leaves FSDP2, kept whole here.
                group.fsdp_params.remove(fp)
                q, fp = unsharded, None
            m._parameters["weight"] = nn.Parameter(q, requires_grad=False)
            m.nf4 = True
            if fp is not None:
                # FSDP2 reads a replaced parameter at its lazy init (torchtune's load_state_dict(assign=True)
                # path); done here, its old flat storage dropped first (reset compares data pointers, which an
                # NF4Tensor has none of). The all-gather extension is chosen at construction: chosen again.
                fp._sharded_param_data = None
                fp.reset_sharded_param()
                fp._init_extensions()
            total += nf4_bytes(m.weight)
    return total


def nf4_bytes(w: torch.Tensor) -> int:
    """Bytes of the storages this rank holds for an NF4 weight (whole storages: a view of a larger one
    counts all of it): the 4-bit data, the 8-bit scales, the per-256-block factors, the scales' mean and
    the 16-entry lookup table."""
    local = w.to_local() if hasattr(w, "to_local") else w
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (local.quantized_data, local.quantized_scalers, local.quantization_factor,
                          local.scaler_mean, local.nf4)}
    return sum(storages.values())


@torch.no_grad()
def dequantised(w: torch.Tensor, name: str, tp: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight `name` as a QLoRA run of tensor parallel `tp` computed with it: each TP shard (rows, or
    columns for the rowwise wo and w2) in `dtype` (the run's frozen dtype) quantised by torchao's to_nf4 and
    dequantised, put together again. What the export merges the adapters into."""
    from torchao.quantization import to_nf4

    dim = 1 if name.rsplit(".", 2)[-2] in ("wo", "w2") else 0
    return torch.cat([to_nf4(c.to(dtype).contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()
                      for c in w.chunk(tp, dim)], dim)
