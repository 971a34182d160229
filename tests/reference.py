"""The independent reference every layout is compared with: Hugging Face transformers' LlamaForCausalLM
(MixtralForCausalLM or Qwen3MoeForCausalLM for a Mixture-of-Experts model) trained by torch.optim.AdamW, in one process, on the whole global batch at once, with the learning-rate
schedule and the data order written here. None of hpctrain's model, optimizer, schedule or sampler
code runs in it: a RoPE, norm, attention or optimizer bug in hpctrain would show as a difference.

Mixture-of-Experts: the balancing losses (Switch's load-balancing loss per layer, the router z-loss) are
written here from the router logits transformers returns, over the same micro-batches the engine sees
(each train.micro_batch consecutive samples of the step); DeepSeek-V3's sigmoid routing with a balancing
bias replaces transformers' router by the one written here, and its bias update is written here too.

What is shared is the starting point: hpctrain's initial weights (generated per parameter name, as
every layout does) reach transformers through hpctrain's Hugging Face export (`hf_dir`), which is
itself under test.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.core import hf_format as hf
from hpctrain.models.llama import build_meta, init_param_


def hf_dir(cfg, out: Path) -> Path:
    """hpctrain's initial weights for `cfg` as a Hugging Face directory (config.json + safetensors)."""
    from safetensors.torch import save_file

    weights = {}
    # DeepSeek-V3's sigmoid routing has no format here: its weights go in Mixtral's (route_by_sigmoid
    # then swaps transformers' router).
    written = replace(cfg.model, moe=replace(cfg.model.moe, router="softmax", bias_update_rate=0.0))
    arch = hf.architecture(written)
    for name, p in build_meta(cfg.model, cfg.data.seq_len).named_parameters():
        t = torch.empty(p.shape)
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + zlib.crc32(name.encode()))
        init_param_(name, t, cfg.model, gen)
        names = hf.hf_names(name, arch, t.shape[0])
        # A stacked expert tensor is one tensor per expert in the published layouts.
        weights.update(zip(names, [e.clone() for e in t.unbind(0)] if hf.is_expert(name) else [t]))
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / hf.CONFIG).write_text(json.dumps(hf.to_config(written, cfg.data.seq_len)))
    return out


def lr_at(step: int, o, total: int) -> float:
    """Linear warmup over optim.warmup_steps, then cosine to optim.min_lr_ratio at the last step."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - 1 - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def reference_losses(cfg, steps: int | None = None, workdir: Path | None = None) -> tuple[list[float], list[float]]:
    """Per-step (loss, grad_norm) of transformers' Llama seeing the whole global batch at once."""
    run = reference_run(cfg, steps, workdir)
    return run["loss"], run["grad_norm"]


def reference_run(cfg, steps: int | None = None, workdir: Path | None = None, init_dir: Path | None = None) -> dict:
    """{"loss", "grad_norm"} per step, and "val": the mean loss after the last step on the first
    eval.batches x global_batch samples of the validation split, in order. `init_dir`: start from this
    Hugging Face directory's weights instead of hpctrain's initial ones."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from hpctrain.data import build_dataset, eos_id
    from hpctrain.train.sampler import StepSampler

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        model = AutoModelForCausalLM.from_pretrained(init_dir or hf_dir(cfg, Path(workdir or d) / "init"),
                                                     dtype=torch.float32, attn_implementation="eager")
    if cfg.model.lora.rank > 0:
        model = with_peft_adapters(model, cfg)
    moe = cfg.model.moe
    biases = route_by_sigmoid(model, moe.top_k) if moe.experts and moe.router == "sigmoid" else None
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    data = build_dataset(cfg)
    B, total = cfg.train.global_batch, cfg.train.steps
    data_cfg = replace(cfg.data, eos_id=eos_id(cfg) if eos_id(cfg) is not None else -1)
    order = StepSampler(data, B, B, 0, 1, cfg.data.seed)  # the sample order of hpctrain's sampler
    losses, norms = [], []
    for step in range(steps or total):
        # Step k takes samples k*B .. (k+1)*B - 1 of the stream (the identity for synthetic data).
        idx = [order._index(i) for i in range(step * B, (step + 1) * B)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, total)
        out, loss = batch_loss(model, data, idx, data_cfg, output_router_logits=bool(moe.experts))
        balance = 0.0
        if moe.experts:
            balance = balancing_loss(out.router_logits, biases, moe, B // cfg.train.micro_batch)
        (loss + balance).backward()
        clip = o.grad_clip if o.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        if biases is not None and moe.bias_update_rate > 0:
            with torch.no_grad():
                for logits, bias in zip(out.router_logits, biases):
                    load = torch.bincount(torch.topk(logits.float().sigmoid() + bias, moe.top_k, -1).indices.flatten(),
                                          minlength=moe.experts).float()
                    bias += moe.bias_update_rate * torch.sign(load.mean() - load)
        losses.append(loss.item())
        norms.append(norm.item())
    val_data = build_dataset(cfg, "val")
    val_order = StepSampler(val_data, B, B, 0, 1, cfg.data.seed)
    with torch.no_grad():
        if val_data.has_loss_mask:  # the mean of each global batch's per-token mean
            val = sum(batch_loss(model, val_data, [val_order._index(i) for i in range(b * B, (b + 1) * B)],
                                 data_cfg)[1].item() for b in range(cfg.eval.batches)) / cfg.eval.batches
        else:
            val = batch_loss(model, val_data, [val_order._index(i) for i in range(cfg.eval.batches * B)],
                             data_cfg)[1].item()
    return {"loss": losses, "grad_norm": norms, "val": val}


def with_peft_adapters(model, cfg):
    """transformers' model as PEFT's LoraModel for model.lora, its A matrices those hpctrain starts from
    (B is zero in both), or the adapter model.lora.init_from names, loaded by PEFT."""
    from peft import LoraConfig, get_peft_model

    from hpctrain.core.spec import lora_of
    from hpctrain.models.lora import apply_lora
    from hpctrain.checkpoint.peft_format import peft_name
    from hpctrain.core.shape import is_adapter

    lo = lora_of(cfg.model)
    if cfg.model.lora.init_from:  # PEFT's own loader: the reference for model.lora.init_from
        from peft import PeftModel

        return PeftModel.from_pretrained(model, cfg.model.lora.init_from, is_trainable=True)
    to_hf = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj",
             "w3": "up_proj"}
    model = get_peft_model(model, LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout, bias="none",
                                             target_modules=[to_hf[t] for t in lo.targets], task_type="CAUSAL_LM"))
    theirs = dict(model.named_parameters())
    ours = build_meta(cfg.model, cfg.data.seq_len)
    apply_lora(ours, lo.rank, lo.alpha, lo.dropout, lo.targets)
    arch = hf.architecture(cfg.model)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter(name):
                t = torch.empty(p.shape)
                gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + zlib.crc32(name.encode()))
                init_param_(name, t, cfg.model, gen)
                theirs[peft_name(name, arch).replace(".weight", ".default.weight")].copy_(t)
    return model


def batch_loss(model, data, idx: list, data_cfg, **kw):
    """(transformers' output, the mean loss) on samples `idx`. Chat data: transformers' own loss on
    labels that are -100 outside the loss mask (the whole sample as input, so every target counts)."""
    rows = torch.stack([torch.as_tensor(data[i]) for i in idx])
    if data.has_loss_mask:
        mask = torch.stack([torch.from_numpy(data.loss_mask(i).copy()) for i in idx]).bool()
        out = model(input_ids=rows, labels=torch.where(mask, rows, -100), **packed(rows, data_cfg), **kw)
        return out, out.loss
    x, y = rows[:, :-1], rows[:, 1:]
    out = model(input_ids=x, **packed(x, data_cfg), **kw)
    return out, F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


def packed(x: torch.Tensor, data) -> dict:
    """transformers' arguments for hpctrain's data.document_mask: a 4-D additive attention mask that keeps
    each token to the earlier tokens of its own document (the end-of-document token is its document's
    last), and with data.document_positions, position ids restarting at each document."""
    if not data.document_mask:
        return {}
    b, s = x.shape
    docs = torch.zeros_like(x)
    pos = torch.zeros_like(x)
    for i in range(b):
        d = p = 0
        for t in range(s):
            docs[i, t], pos[i, t] = d, p
            d, p = (d + 1, 0) if int(x[i, t]) == data.eos_id else (d, p + 1)
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    mask = torch.zeros(b, 1, s, s).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    return {"attention_mask": mask, **({"position_ids": pos} if data.document_positions else {})}


def route_by_sigmoid(model, top_k: int) -> list:
    """Replace each transformers router's softmax by DeepSeek-V3's routing: a sigmoid score per expert,
    the top_k picked on score + bias, their scores renormalised as the weights. Returns the biases."""
    import torch.nn.functional as F

    biases = []
    for router in (m for m in model.modules() if type(m).__name__.endswith("TopKRouter")):
        bias = torch.zeros(router.weight.shape[0])

        def forward(h, router=router, bias=bias):
            logits = F.linear(h.reshape(-1, router.weight.shape[1]), router.weight)
            scores = logits.float().sigmoid()
            idx = torch.topk(scores + bias, top_k, dim=-1).indices
            w = scores.gather(-1, idx)
            return logits, (w / (w.sum(-1, keepdim=True) + 1e-20)).to(logits.dtype), idx

        router.forward = forward
        biases.append(bias)
    return biases


def balancing_loss(router_logits, biases, moe, chunks: int) -> torch.Tensor:
    """Sum over MoE layers of aux_loss_coef x the Switch load-balancing loss + z_loss_coef x the z-loss,
    each the mean over the step's micro-batches (`chunks` of consecutive tokens) of its value on one."""
    total = torch.zeros(())
    for i, logits in enumerate(router_logits):
        for part in logits.float().chunk(chunks):
            if moe.router == "sigmoid":
                scores = part.sigmoid()
                probs = scores / scores.sum(-1, keepdim=True)
                picked = torch.topk(scores + biases[i], moe.top_k, -1).indices
            else:
                probs = part.softmax(-1)
                picked = torch.topk(probs, moe.top_k, -1).indices
            share = torch.bincount(picked.flatten(), minlength=moe.experts).float() / part.shape[0]
            aux = moe.experts * (share * probs.mean(0)).sum()
            z = torch.logsumexp(part, -1).pow(2).mean()
            total = total + (moe.aux_loss_coef * aux + moe.z_loss_coef * z) / chunks
    return total
