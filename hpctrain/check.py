"""Refuse a config that cannot run, before any process starts.

Each check returns a message that names the offending keys and a fix. `check(cfg)` raises one
ConfigError listing all of them, so a user fixes everything in one go.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator

from hpctrain.compose import ConfigError
from hpctrain.config import world_size
from hpctrain.layout import layout_of

CHOICES = {
    "data.source": ("synthetic", "shards"),
    "train.precision": ("fp32", "bf16"),
    "launcher.name": ("local", "slurm", "sbatch", "print"),
    "launcher.backend": ("auto", "gloo", "nccl"),
    "offload.target": ("none", "cpu", "nvme"),
    "parallel.ac": ("none", "full", "selective"),
    "parallel.zero": (0, 3),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"),
    "cluster.device": ("cpu", "cuda"),
    "optim.name": ("adamw",),
    "optim.impl": ("auto", "fused", "foreach", "for_loop"),
}

POSITIVE = ("train.steps", "train.global_batch", "train.micro_batch", "train.log_every",
            "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
            "model.vocab_size", "data.seq_len", "launcher.nproc", "checkpoint.keep",
            "parallel.dp_replicate", "parallel.tp", "parallel.pp", "parallel.pp_virtual_stages",
            "cluster.nodes")

CHECKS: list[Callable[[Any], Iterator[str]]] = []


def _check(fn):
    CHECKS.append(fn)
    return fn


def _get(cfg: Any, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def problems(cfg: Any) -> list[str]:
    out: list[str] = []
    for fn in CHECKS:
        out.extend(fn(cfg))
    return out


def check(cfg: Any) -> None:
    found = problems(cfg)
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise ConfigError(f"this config cannot run ({len(found)} problem{'s' * (len(found) > 1)}):\n{lines}")


@_check
def _choices(cfg):
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            yield (f"{key}={value} is not one of {', '.join(map(str, allowed))}. "
                   f"Fix: {key}={allowed[0]}")


@_check
def _positive(cfg):
    for key in POSITIVE:
        value = _get(cfg, key)
        if value < 1:
            yield f"{key}={value} must be at least 1"
    if cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        yield f"parallel.dp_shard={cfg.parallel.dp_shard} must be at least 1, or -1 for 'the remaining ranks'"
    if cfg.checkpoint.every < 0:
        yield f"checkpoint.every={cfg.checkpoint.every} must be 0 (save only when preempted) or positive"
    if cfg.optim.lr <= 0:
        yield f"optim.lr={cfg.optim.lr} must be positive"
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        yield f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must lie in [0, 1]"


@_check
def _layout(cfg):
    p = cfg.parallel
    if min(p.pp, p.dp_replicate, p.tp) < 1 or p.dp_shard == 0 or p.dp_shard < -1:
        return
    world = world_size(cfg)
    where = (f"launcher.nproc={world}" if cfg.launcher.name == "local" else
             f"cluster.nodes={cfg.cluster.nodes} x {'cluster.gpus_per_node' if cfg.cluster.gpus_per_node else 'cluster.tasks_per_node'}"
             f"={cfg.cluster.gpus_per_node or cfg.cluster.tasks_per_node}")
    fixed = p.pp * p.dp_replicate * p.tp
    if p.dp_shard == -1:
        if world % fixed:
            yield (f"parallel.pp={p.pp} x parallel.dp_replicate={p.dp_replicate} x parallel.tp={p.tp} = {fixed} "
                   f"does not divide the {world} ranks the launcher provides ({where}). "
                   f"Fix: make the world size a multiple of {fixed}, or change the parallel sizes")
        return
    product = fixed * p.dp_shard
    if product != world:
        yield (f"parallel sizes pp={p.pp} x dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp} "
               f"= {product}, but the launcher provides {world} ranks ({where}). "
               f"Fix: set parallel.dp_shard=-1 to use all ranks, or make the product equal {world}")


@_check
def _model(cfg):
    m = cfg.model
    if min(m.dim, m.n_heads, m.n_kv_heads) < 1:
        return
    if m.dim % m.n_heads:
        yield (f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}. "
               f"Fix: choose model.n_heads among {_divisors(m.dim)}")
    elif (m.dim // m.n_heads) % 2:
        yield (f"head dim model.dim/model.n_heads={m.dim // m.n_heads} must be even for rotary embeddings. "
               "Fix: change model.dim or model.n_heads")
    if m.n_heads % m.n_kv_heads:
        yield (f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads} "
               "(grouped-query attention shares each KV head among a whole number of query heads). "
               f"Fix: choose model.n_kv_heads among {_divisors(m.n_heads)}")
    tp = cfg.parallel.tp
    if tp >= 1:
        for key in ("n_heads", "n_kv_heads"):
            if m[key] % tp:
                yield (f"model.{key}={m[key]} is not divisible by parallel.tp={tp}: tensor parallel splits heads. "
                       f"Fix: choose parallel.tp among {_divisors(m[key])}")
        if m.ffn_dim % tp:
            yield f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}"


@_check
def _batch(cfg):
    t = cfg.train
    if min(t.global_batch, t.micro_batch) < 1:
        return
    dp = layout_of(cfg).dp
    if dp < 1:
        return
    if t.global_batch % (dp * t.micro_batch):
        yield (f"train.global_batch={t.global_batch} is not divisible by data-parallel ranks ({dp}) x "
               f"train.micro_batch={t.micro_batch} = {dp * t.micro_batch}. "
               f"Fix: train.global_batch={max(1, t.global_batch // (dp * t.micro_batch)) * dp * t.micro_batch}")


@_check
def _data(cfg):
    if cfg.data.source != "shards":
        return
    path = cfg.data.path
    if path is None or path == "???" or not os.path.isdir(path):
        yield (f"data.path={path} is not a directory of token shards. "
               "Fix: make one with `python -m hpctrain.data.prepare <text dir> <out dir>` and pass data.path=<out dir>")
        return
    from hpctrain.data.shards import read_meta

    meta = read_meta(path)
    if meta is None:
        yield f"data.path={path} holds no meta.json: it was not made by hpctrain.data.prepare"
    elif meta["vocab_size"] > cfg.model.vocab_size:
        yield (f"the shards in data.path use {meta['vocab_size']} token ids but model.vocab_size="
               f"{cfg.model.vocab_size}. Fix: model.vocab_size={meta['vocab_size']}")


def launch_problems(cfg: Any) -> list[str]:
    """What this build cannot start yet. A dry run still plans such layouts; a launch refuses them
    here rather than deep inside torch."""
    out = []
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1:
        out.append(f"parallel.tp={p.tp} / parallel.pp={p.pp}: tensor and pipeline parallel are not available yet. "
                   "Fix: parallel.tp=1 parallel.pp=1")
    if p.dp_replicate > 1 and p.zero == 0:
        out.append("parallel.dp_replicate>1 (HSDP) needs parallel.zero=3. Fix: parallel.zero=3 or parallel.dp_replicate=1")
    if cfg.offload.target != "none":
        out.append(f"offload.target={cfg.offload.target} is not available yet. Fix: offload.target=none")
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64)
