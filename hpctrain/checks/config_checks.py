"""Refuse a config that cannot run, before any process starts.

The schema (hpctrain.core.schema) already refused unknown keys, wrong types and values outside a choice's
list while composing. What is left spans several fields: sizes that must divide, ranges, files that
must exist, the cluster. Each check yields messages that name the offending keys and a fix;
`check(cfg)` raises one ConfigError listing all of them, so a user fixes everything in one go.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from typing import Callable, Iterator, Sequence

from hpctrain.core.compose import ConfigError, bad_choices, compose
from hpctrain.core.disk import writable_dir_problem
from hpctrain.core import rules
from hpctrain.core.spec import ZERO_STAGES, engine_spec, pp_layers_problems, updated
from hpctrain.core.schema import Config
from hpctrain.checks import cluster_checks
from hpctrain.checks.k8s_checks import k8s_problems
from hpctrain.core.hf_format import problems as hf_problems

POSITIVE = ("train.steps", "train.global_batch", "train.micro_batch", "train.log_every",
            "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
            "model.vocab_size", "data.seq_len", "launcher.nproc", "checkpoint.keep",
            "parallel.dp_replicate", "parallel.tp", "parallel.pp", "parallel.pp_virtual_stages", "parallel.ep",
            "cluster.nodes", "eval.batches", "model.rope_original_max_seq_len", "parallel.ac_every",
            "checkpoint.threads", "launcher.timeout_s", "launcher.min_nodes", "launcher.straggler_steps",
            "cluster.tasks_per_node", "cluster.cpus_per_task", "cluster.nics_per_node",
            "train.fp16.growth_interval")
# Whole numbers where 0 means "none" or "off" and a negative one means nothing.
NOT_NEGATIVE = ("optim.warmup_steps", "train.threads", "train.max_skipped_steps", "cluster.gpus_per_node",
                "cluster.max_requeues", "train.loss_chunk")

CHECKS: list[Callable[[Config], Iterator[str]]] = []


def _check(fn):
    CHECKS.append(fn)
    return fn


def _get(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def compose_checked(overrides: Sequence[str]) -> tuple[Config, list[str]]:
    """(config, refusals): the config composed from every override whose value its choice allows, and
    a message for each that it does not, to report with check()'s other problems (composing alone
    stops at the first such value)."""
    refused = dict(bad_choices(overrides))
    return compose([o for o in overrides if o not in refused]), list(refused.values())


def problems(cfg: Config) -> list[str]:
    out: list[str] = []
    for fn in CHECKS:
        out.extend(fn(cfg))
    return out


def check(cfg: Config, refused: Sequence[str] = ()) -> None:
    """Raise one ConfigError naming every problem: `refused` (what composing already refused) first."""
    found = [*refused, *problems(cfg)]
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise ConfigError(f"this config cannot run ({len(found)} problem{'s' * (len(found) > 1)}):\n{lines}")


@_check
def _zero(cfg: Config):
    if cfg.parallel.zero not in ZERO_STAGES:
        yield (f"parallel.zero={cfg.parallel.zero} is not one of {', '.join(map(str, ZERO_STAGES))}. "
               "Fix: parallel.zero=3")


@_check
def _positive(cfg: Config):
    for key in POSITIVE:
        value = _get(cfg, key)
        if value < 1:
            yield f"{key}={value} must be at least 1"
    if cfg.parallel.dp_shard == 0 or cfg.parallel.dp_shard < -1:
        yield f"parallel.dp_shard={cfg.parallel.dp_shard} must be at least 1, or -1 for 'the remaining ranks'"
    if cfg.eval.every < 0:
        yield f"eval.every={cfg.eval.every} must be 0 (no validation) or positive"
    if cfg.checkpoint.every < 0:
        yield f"checkpoint.every={cfg.checkpoint.every} must be 0 (save only when preempted) or positive"
    if cfg.checkpoint.keep_every < 0:
        yield (f"checkpoint.keep_every={cfg.checkpoint.keep_every} must be 0 (no milestones) or positive. "
               "Fix: checkpoint.keep_every=0")
    for key in NOT_NEGATIVE:
        value = _get(cfg, key)
        if value < 0:
            yield f"{key}={value} must be 0 or more. Fix: {key}={_default(key)} (the default)"
    if cfg.data.eos_id < -1:
        yield (f"data.eos_id={cfg.data.eos_id} is no token id: an id is 0 or more, and -1 takes the shards' own. "
               "Fix: data.eos_id=-1, or the id that ends each document")
    if cfg.checkpoint.load_step is not None and cfg.checkpoint.load_step < 0:
        yield (f"checkpoint.load_step={cfg.checkpoint.load_step} names no step (steps count from 0). Fix: the step "
               "of a complete checkpoint (python -m hpctrain.checkpoint list <run.dir>), or null for the newest")


# ------------------------------------------------------------------------- ranges of the float keys

@dataclasses.dataclass(frozen=True)
class Range:
    """Where a float key may lie: always a finite number (nan passes no comparison and inf is no
    setting), above or from `low`, below or up to `high`."""

    low: float = 0.0
    low_open: bool = False  # true: above low; false: low or more
    high: float = math.inf
    high_open: bool = True  # true: below high; false: high or less
    why: str = ""  # what goes wrong outside it
    fix: str = ""  # the fix ({key}: the key's name); "" names the key's default
    text: str = ""  # the range in words where the bounds alone would mislead

    def holds(self, value: float) -> bool:
        return (math.isfinite(value) and (value > self.low if self.low_open else value >= self.low)
                and (value < self.high if self.high_open else value <= self.high))

    def words(self) -> str:
        if self.text:
            return self.text
        if self.high == math.inf:
            if self.low == 0 and self.low_open:
                return "positive: a finite number above 0"
            return f"a finite number above {self.low:g}" if self.low_open else f"a finite number, {self.low:g} or more"
        return (f"a finite number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


ABOVE_0 = dict(low_open=True)
UNIT_OPEN = dict(high=1.0)  # [0, 1)
SHARE = dict(low_open=True, high=1.0, high_open=False)  # (0, 1]
HARDWARE = "{key}=<your hardware's figure> (conf/cluster/h100.yaml holds an H100 node's)"
PLANNER = "the planner divides by it"

# One rule per float key of the schema (hpctrain.core.schema), by its dotted name; the elements of a
# list as name[].key. tests/test_config_ranges.py refuses a float key without one.
RANGES: dict[str, Range] = {
    "model.norm_eps": Range(**ABOVE_0, why="RMSNorm divides by sqrt(mean(x^2) + eps): 0 or less gives inf or nan"),
    "model.rope_theta": Range(**ABOVE_0, why="RoPE's frequencies are powers of it"),
    "model.init_std": Range(**ABOVE_0, why="the standard deviation of the initial weights: 0 trains nothing"),
    "model.rope_scaling": Range(why="0 turns Llama 3.1 RoPE scaling off, else the factor the low frequencies are "
                                    "divided by"),
    "model.rope_low_freq_factor": Range(**ABOVE_0, why="Llama 3.1 RoPE scaling divides by it"),
    "model.rope_high_freq_factor": Range(**ABOVE_0, why="Llama 3.1 RoPE scaling divides by it"),
    "model.moe.route_scale": Range(**ABOVE_0, why="it multiplies the routed experts' weights"),
    "model.moe.aux_loss_coef": Range(why="0: off"),
    "model.moe.z_loss_coef": Range(why="0: off"),
    "model.moe.bias_update_rate": Range(why="0: off"),
    "model.moe.capacity_factor": Range(why="0: dropless"),
    "model.moe.imbalance": Range(low=1.0, text="between 1 (an even split) and model.moe.experts / model.moe.top_k "
                                               "(one expert takes every token)"),
    "model.lora.alpha": Range(**ABOVE_0, why="the update is scaled by alpha / rank"),
    "model.lora.dropout": Range(**UNIT_OPEN, why="a probability; 1 would drop every input"),
    "checkpoint.memory_budget": Range(**SHARE, why="the share of cluster.host_mem_gb memory snapshots may take "
                                                   "on a node"),
    "optim.lr": Range(**ABOVE_0, why="the peak learning rate"),
    "optim.min_lr_ratio": Range(high=1.0, high_open=False, why="the floor of the decay, a share of optim.lr"),
    "optim.weight_decay": Range(why="0: no decay; a negative one grows the weights"),
    "optim.beta1": Range(**UNIT_OPEN, why="Adam's moment decay: at 1 it never forgets, above it diverges"),
    "optim.beta2": Range(**UNIT_OPEN, why="Adam's moment decay: at 1 it never forgets, above it diverges"),
    "optim.eps": Range(**ABOVE_0, why="Adam divides by sqrt(v) + eps, and v is 0 for a weight without gradient"),
    "optim.grad_clip": Range(why="0: no clipping"),
    "train.z_loss_coef": Range(why="0: off; a negative one rewards a large softmax normaliser"),
    "train.fp16.init_scale": Range(**ABOVE_0, why="the loss is multiplied by it before backward"),
    "train.dpo.beta": Range(**ABOVE_0, why="the rewards are beta x log(policy / reference); IPO divides by it"),
    "train.dpo.label_smoothing": Range(high=0.5, why="the share of pairs taken as mislabelled: at 0.5 the loss "
                                                     "no longer tells chosen from rejected"),
    "data.sources[].weight": Range(**ABOVE_0, why="a source's share of the stream", fix="a weight above 0, or drop "
                                                                                          "the source"),
    "launcher.hang_timeout_s": Range(why="0: max(60 s, 10x the median step)"),
    "launcher.health.slowdown": Range(low=1.0, low_open=True, why="a node this many times slower than the median "
                                                                  "is left out: at 1 or less, the median one too"),
    "launcher.straggler_ratio": Range(low=1.0, low_open=True, why="at 1 or less the slowest rank of every step is "
                                                                  "named, however close"),
    "launcher.k8s.shm_gb": Range(**ABOVE_0, why="the size of /dev/shm in GiB"),
    "cluster.peak_tflops": Range(**ABOVE_0, why="the denominator of MFU", fix=HARDWARE),
    "cluster.compute_capability": Range(why="0: not known; else the GPUs' CUDA compute capability (9.0 for H100)",
                                        fix=HARDWARE),
    "cluster.fp8_tflops": Range(why="0: no FP8", fix=HARDWARE),
    "cluster.device_mem_gb": Range(**ABOVE_0, why="the planner's memory limit per rank", fix=HARDWARE),
    "cluster.host_mem_gb": Range(**ABOVE_0, why="the planner's limit for offloaded state", fix=HARDWARE),
    "cluster.hbm_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.matmul_efficiency": Range(**SHARE, why="a share of cluster.peak_tflops", fix=HARDWARE),
    "cluster.attention_efficiency": Range(**SHARE, why="a share of cluster.peak_tflops", fix=HARDWARE),
    "cluster.grouped_gemm_efficiency": Range(**SHARE, why="a share of the dense GEMMs' rate", fix=HARDWARE),
    "cluster.intra_node_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.intra_node_latency_us": Range(why="a time", fix=HARDWARE),
    "cluster.inter_node_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.inter_node_latency_us": Range(why="a time", fix=HARDWARE),
    "cluster.pcie_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.nvme_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.nvme_gb": Range(why="0: no NVMe", fix=HARDWARE),
    "cluster.checkpoint_gbps": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.host_adam_gparams": Range(**ABOVE_0, why=PLANNER, fix=HARDWARE),
    "cluster.runtime_reserve_gb": Range(why="memory set aside per rank", fix=HARDWARE),
}
# A float key added to the schema without a rule of its own is still checked: finite, 0 or more.
DEFAULT_RANGE = Range()


def range_of(key: str) -> Range:
    """The rule of a float key, by its dotted name (`data.sources[2].weight` is `data.sources[].weight`'s)."""
    return RANGES.get(re.sub(r"\[\d+\]", "[]", key), DEFAULT_RANGE)


def float_keys(node, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every float field under the dataclass `node`: nested sections and the
    elements of lists of them (`data.sources[0].weight`) too, however the schema grows."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if f.type in (float, "float"):  # the annotation, or its text under `from __future__ import annotations`
            yield key, value
        elif dataclasses.is_dataclass(value):
            yield from float_keys(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    yield from float_keys(item, f"{key}[{i}].")


def _default(key: str):
    """The schema's default of a dotted key (a list element's key: its dataclass's field default)."""
    from hpctrain.core.schema import Config

    node, parts = Config, re.sub(r"\[\d*\]", "[]", key).split(".")
    for part in parts[:-1]:
        hint = typing.get_type_hints(node)[part.removesuffix("[]")]
        node = typing.get_args(hint)[0] if part.endswith("[]") else hint
    return {f.name: f for f in dataclasses.fields(node)}[parts[-1]].default


def range_problem(key: str, value: float) -> str | None:
    """The refusal of `key`=`value`, naming the key, the value, the range and the fix; None if it holds."""
    rule = range_of(key)
    if rule.holds(value):
        return None
    fix = rule.fix.format(key=key) if rule.fix else f"{key}={_default(key)!r} (the default)"
    why = f" ({rule.why})" if rule.why else ""
    return f"{key}={value} must be {rule.words()}{why}. Fix: {fix}"


@_check
def _ranges(cfg: Config):
    yield from range_problems(cfg)


def range_problems(cfg: Config) -> list[str]:
    """Every float key out of its range: what the planner must not be given (it divides by them)."""
    return [p for key, value in float_keys(cfg) if (p := range_problem(key, value))] + list(_rope_problem(cfg))


def _rope_problem(cfg: Config):
    m = cfg.model
    if (m.rope_scaling > 0 and range_of("model.rope_low_freq_factor").holds(m.rope_low_freq_factor)
            and range_of("model.rope_high_freq_factor").holds(m.rope_high_freq_factor)
            and not m.rope_high_freq_factor > m.rope_low_freq_factor):
        yield (f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be above model.rope_low_freq_factor="
               f"{m.rope_low_freq_factor} with RoPE scaling on (model.rope_scaling={m.rope_scaling}): the scaling "
               "blends between them, dividing by their difference. Fix: model.rope_low_freq_factor=1.0 "
               "model.rope_high_freq_factor=4.0 (Llama 3.1's)")


@_check
def _cluster_k8s(cfg: Config):
    """launcher=k8s: a pullable image, a shared volume for more than one node, valid names."""
    if cfg.launcher.name != "k8s":
        return
    yield from k8s_problems(cfg)


@_check
def _launcher(cfg: Config):
    la = cfg.launcher
    if la.chain < 1:
        yield f"launcher.chain={la.chain} must be at least 1 (the number of jobs in the chain)"
    elif la.chain > 1 and la.name not in ("slurm", "sbatch"):
        yield (f"launcher.chain={la.chain} chains Slurm jobs; launcher={la.name} has no time limit to chain "
               "around. Fix: launcher=slurm (or sbatch), or launcher.chain=1")
    if la.array_parallelism < 0:
        yield (f"launcher.array_parallelism={la.array_parallelism} must be 0 (no bound) or the number of "
               "sweep elements to run at once")


@_check
def _model(cfg: Config):
    m = cfg.model
    if min(m.dim, m.n_heads, m.n_kv_heads) < 1:
        return
    if m.head_dim < 0:
        yield f"model.head_dim={m.head_dim} must be 0 (dim / n_heads) or a positive even width"
    elif m.head_dim:
        if m.head_dim % 2:
            yield f"model.head_dim={m.head_dim} must be even for rotary embeddings. Fix: model.head_dim={m.head_dim + 1}"
    elif m.dim % m.n_heads:
        yield (f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}. "
               f"Fix: choose model.n_heads among {rules.divisors(m.dim)}, or set model.head_dim")
    elif (m.dim // m.n_heads) % 2:
        yield (f"head dim model.dim/model.n_heads={m.dim // m.n_heads} must be even for rotary embeddings. "
               "Fix: change model.dim or model.n_heads")
    if m.n_heads % m.n_kv_heads:
        yield (f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads} "
               "(grouped-query attention shares each KV head among a whole number of query heads). "
               f"Fix: choose model.n_kv_heads among {rules.divisors(m.n_heads)}")


@_check
def _rule_book(cfg: Config):
    """The layout's rules (hpctrain.core.rules: the planner's search and every rank read the same book),
    once the sizes they divide by are positive (_positive says when they are not)."""
    p, m = cfg.parallel, cfg.model
    if p.cp < 1:
        yield f"parallel.cp={p.cp} must be at least 1 (1 = no context parallelism)"
    # what the spec divides by (the model's sizes only where a pipeline split weighs them); each rule
    # minds its own other sizes
    sizes = (p.pp, p.dp_replicate, p.tp, p.cp, p.ep, p.pp_virtual_stages, m.n_layers,
             *((m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) if p.pp > 1 else ()))
    if min(sizes) < 1 or p.dp_shard == 0 or p.dp_shard < -1:
        return
    # parallel.pp_layers: one entry per stage, summing to the blocks, a block on every middle stage; the
    # other rules then read the automatic split
    split = pp_layers_problems(m, p.pp, p.pp_schedule, p.pp_virtual_stages, list(p.pp_layers))
    yield from split
    spec = engine_spec(updated(cfg, {"parallel.pp_layers": []}) if split else cfg)
    yield from (problem.message for problem in rules.problems(spec)
                if not (p.auto and problem.reason == rules.EP_ZERO))


@_check
def _documents(cfg: Config):
    yield from document_problems(cfg)


def document_problems(cfg: Config) -> list[str]:
    """data.document_mask: an end-of-document id to find the documents by (the planner refuses on these
    too: it prices the mask from the documents)."""
    return list(_document_problems(cfg))


def _document_problems(cfg: Config):
    from hpctrain.data import eos_id  # reads the shards' meta.json

    d = cfg.data
    if d.document_positions and not d.document_mask:
        yield "data.document_positions=true restarts positions per document, which needs data.document_mask=true"
    if d.synthetic_doc_len < 0:
        yield f"data.synthetic_doc_len={d.synthetic_doc_len} must be 0 (one document per sequence) or a mean length"
    if d.eos_id >= cfg.model.vocab_size:
        yield (f"data.eos_id={d.eos_id} is not a token of the model's vocabulary (model.vocab_size="
               f"{cfg.model.vocab_size}). Fix: an id below {cfg.model.vocab_size}, or -1 for the shards' own")
    if not d.document_mask:
        if d.synthetic_doc_len and d.source == "synthetic" and d.eos_id < 0:
            yield "data.synthetic_doc_len needs data.eos_id: the token that ends each synthetic document"
        return
    if d.source == "synthetic" and d.eos_id < 0:
        yield ("data.document_mask=true on synthetic data needs data.eos_id (and data.synthetic_doc_len for "
               "documents shorter than a sequence). Fix: data.eos_id=<an id below model.vocab_size>")
    elif d.source == "shards" and d.eos_id < 0 and (d.path or d.sources) and eos_id(cfg) is None:
        yield ("data.document_mask=true, but the shards' meta.json names no end-of-document token (eos_id) to "
               "find the documents by. Fix: data.eos_id=<the id that ends each document>, or prepare the shards "
               "again with python -m hpctrain.data.prepare")


@_check
def _chat_windows(cfg: Config):
    """Chat shards laid out in windows (prepare --seq-len) are read in windows of the same length."""
    from hpctrain.data.shards import read_meta

    d = cfg.data
    if d.source != "shards":
        return
    for path in [s.path for s in d.sources] or [d.path]:
        meta = (read_meta(path) if path and path != "???" else None) or {}
        window = meta.get("window") or 0
        if window and window != d.seq_len:
            yield (f"{path} holds {meta.get('records', 'chat')} records in windows of {window} tokens (prepare "
                   f"--seq-len {window}), but data.seq_len={d.seq_len}: records would be cut across samples. "
                   f"Fix: data.seq_len={window}, or prepare again with --seq-len {d.seq_len}")


@_check
def _preference_data(cfg: Config):
    """train.objective=dpo reads preference pairs (prepare --format preference), and only it does."""
    from hpctrain.data.shards import read_meta

    d, dpo = cfg.data, str(cfg.train.objective) == "dpo"
    prepare = "python -m hpctrain.data.prepare <pairs.jsonl> <out dir> --tokenizer <tokenizer.json> " \
              f"--format preference --seq-len {d.seq_len}"
    if d.source != "shards":
        if dpo:
            yield (f"train.objective=dpo with data.source={d.source}: DPO trains on prompt / chosen / rejected "
                   f"pairs, which synthetic data has none of. Fix: data=shards data.path=<{prepare}>")
        return
    if dpo and d.sources:
        yield ("train.objective=dpo with data.sources (a mixture): mixtures draw single samples, not pairs. Fix: "
               "one directory of preference shards in data.path")
        return
    for path in [s.path for s in d.sources] or [d.path]:
        meta = (read_meta(path) if path and path != "???" else None)
        if meta is None:
            continue  # _data says what is wrong with the directory
        pairs = bool(meta.get("pairs"))
        if dpo and not pairs:
            yield (f"train.objective=dpo but data.path={path} holds {meta.get('records', 'text')} records, not "
                   f"preference pairs. Fix: prepare pairs: {prepare}")
        elif pairs and not dpo:
            yield (f"data.path={path} holds preference pairs (chosen and rejected), which train.objective="
                   f"{cfg.train.objective} would train on alike. Fix: train.objective=dpo")


def advice(cfg: Config) -> list[str]:
    """What the login node warns about without refusing: the run can start, but probably not as meant."""
    from hpctrain.data.shards import read_meta

    d, out = cfg.data, recovery_advice(cfg)
    if d.source != "shards" or d.document_mask:
        return out
    for path in [s.path for s in d.sources] or [d.path]:
        meta = (read_meta(path) if path and path != "???" else None) or {}
        # prepare's "packed" (several records in a sample); absent in shards from before it, packed then too
        if meta.get("loss_mask") and meta.get("packed", True):
            out.append(f"{path} holds {meta.get('records', 'chat')} records packed several to a sample, but "
                       f"data.document_mask=false: every token attends to the other conversations before it in its "
                       f"sample, which it never sees at inference. Fix: data.document_mask=true "
                       f"data.document_positions=true (+experiment=sft sets both), or prepare with --no-pack")
    return out


@_check
def _qlora_base(cfg: Config):
    """QLoRA's checkpoints (every run's: its last step, a preemption) hold the adapters alone and re-read the base
    from model.init_from: a run needs one. Not a layout's problem (the planner's rules): a dry run prices a
    preset before its base is downloaded."""
    if str(cfg.model.lora.quantize) == "nf4" and cfg.model.lora.rank > 0 and not cfg.model.init_from \
            and not cfg.dry_run:
        yield ("model.lora.quantize=nf4 and no model.init_from: a QLoRA run's checkpoints (its last step's, a "
               "preemption's) hold the adapters alone and re-read the base from model.init_from, and a random base "
               "cannot be re-read (torch's checkpoint cannot write torchao's NF4 weights). Fix: model.init_from=<the "
               "base's Hugging Face directory>, or dry_run=true to price the run before the base is downloaded")


@_check
def _lora(cfg: Config):
    """model.lora.*: a rank, scale and dropout in range, layers that exist, an adapter that fits."""
    from hpctrain.core.shape import HF_LINEAR, LORA_TARGETS as TARGETS

    lo = cfg.model.lora
    if lo.rank < 0:
        yield f"model.lora.rank={lo.rank} must be 0 (no adapters) or more"
    if lo.rank <= 0:
        if lo.init_from:
            yield "model.lora.init_from names an adapter, but model.lora.rank=0. Fix: model.lora.rank=<the adapter's r>"
        return
    unknown = [t for t in lo.targets if t not in TARGETS and t not in HF_LINEAR]
    if unknown or not lo.targets:
        yield (f"model.lora.targets={list(lo.targets)}: {', '.join(unknown) or 'none given'} "
               f"{'is not a' if len(unknown) == 1 else 'are not'} linear layer{'s' if len(unknown) != 1 else ''} "
               f"of a block. Fix: choose from {', '.join(TARGETS)} (or Hugging Face's {', '.join(HF_LINEAR)})")
    if lo.init_from:
        from hpctrain.core.adapters import AdapterError, read_adapter_config

        try:
            read_adapter_config(lo.init_from, lo, cfg.model)  # its tensors too, from the header
        except AdapterError as e:
            yield str(e)


@_check
def _moe(cfg: Config):
    """model.moe.*: sizes and coefficients in range, and at least one block that routes."""
    e, m = cfg.model.moe, cfg.model
    if e.experts < 0:
        yield f"model.moe.experts={e.experts} must be 0 (a dense model) or more"
    if e.experts <= 0:
        return
    if not 1 <= e.top_k <= e.experts:
        yield (f"model.moe.top_k={e.top_k} must be between 1 and model.moe.experts={e.experts}. "
               f"Fix: model.moe.top_k={min(max(1, e.top_k), e.experts)}")
    for key in ("ffn_dim", "shared_experts", "first_dense"):
        if getattr(e, key) < 0:
            yield f"model.moe.{key}={getattr(e, key)} must be 0 or more"
    if e.every < 1:
        yield f"model.moe.every={e.every} must be 1 or more (1: every block past moe.first_dense routes)"
    elif e.first_dense >= 0 and not any((i + 1) % e.every == 0 for i in range(e.first_dense, m.n_layers)):
        yield (f"model.moe.experts={e.experts} but no block routes: with model.n_layers={m.n_layers}, "
               f"moe.first_dense={e.first_dense} and moe.every={e.every} every block stays dense. "
               "Fix: lower moe.first_dense or moe.every, or model.moe.experts=0")
    # the busiest rank's (or expert's) routed tokens over an even share: at most experts / top_k (one
    # expert taking every token); at least 1 and finite is _ranges'
    most = e.experts / max(1, e.top_k)
    if e.imbalance > most and math.isfinite(e.imbalance):
        yield (f"model.moe.imbalance={e.imbalance} must be between 1 (an even split) and experts / top_k = "
               f"{most:g} (one expert takes every token). Fix: a run's expert_share_max, or 1.0")


@_check
def _data(cfg: Config):
    """data.path or data.sources: shard directories whose vocabulary fits the model, from one
    tokenizer, long enough for data.seq_len, with a validation split where eval.every asks for one."""
    d = cfg.data
    if d.source != "shards":
        if d.sources:
            yield "data.sources is set but data.source=synthetic. Fix: data=shards"
        return
    if d.sources and d.path not in (None, "???"):
        yield "data.path and data.sources are both set. Fix: keep one (a single directory is data.path)"
        return
    named = ([(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
             if d.sources else [("data.path", d.path)])
    # heavy: numpy (~0.2 s), only when the config reads token shards
    from hpctrain.data.shards import longest_shard, problems as shard_problems, read_meta

    metas = []
    for key, path in named:
        if path is None or path == "???" or not os.path.isdir(path):
            yield (f"{key}={path} is not a directory of token shards. "
                   "Fix: make one with `python -m hpctrain.data.prepare <corpus> <out dir>` and pass " f"{key}=<out dir>")
            continue
        # meta.json present and well formed, every shard file there with the length it says: a file
        # missing or cut short would otherwise pass here and fail on the ranks.
        found = shard_problems(path, ["train", "val"] if cfg.eval.every > 0 else ["train"])
        if found:
            yield from (f"{key}={path}: {p}" for p in found)
            continue
        meta = read_meta(path)
        metas.append((key, path, meta))
        if meta["vocab_size"] > cfg.model.vocab_size:
            yield (f"the tokenizer of {key}={path} has {meta['vocab_size']} token ids but model.vocab_size="
                   f"{cfg.model.vocab_size}: ids past the embedding would crash the first step. "
                   f"Fix: model.vocab_size={meta['vocab_size']} (or more)")
        if longest_shard(meta, "train") < d.seq_len + 1:
            yield (f"the train split of {key}={path} has no shard of data.seq_len + 1 = {d.seq_len + 1} tokens. "
                   f"Fix: a smaller data.seq_len, or a larger corpus")
        if cfg.eval.every > 0 and longest_shard(meta, "val") < d.seq_len + 1:
            have = "no validation split" if "val" not in meta["splits"] else "a validation split shorter than that"
            yield (f"eval.every={cfg.eval.every} needs data.seq_len + 1 = {d.seq_len + 1} validation tokens in one "
                   f"shard of {key}={path}, which has {have}. Fix: prepare it with a larger --val-fraction, "
                   f"or eval.every=0")
    tokenizers = {_tokenizer_id(m) for _, _, m in metas}
    if len(metas) > 1 and (len(tokenizers) > 1 or len({m["vocab_size"] for _, _, m in metas}) > 1):
        listing = ", ".join(f"{k} ({m['vocab_size']} ids)" for k, _, m in metas)
        yield (f"data.sources were tokenized differently: {listing}, with {len(tokenizers)} different tokenizers. "
               f"Fix: prepare every source with the same --tokenizer")


def _tokenizer_id(meta: dict) -> str:
    """The tokenizer a shard directory was made with: its sha256, "bytes" for none (directories from
    before tokenizers say "tokenizer": "bytes")."""
    t = meta.get("tokenizer")
    return str(t.get("sha256", "bytes")) if isinstance(t, dict) else str(t or "bytes")


@_check
def _init_from(cfg: Config):
    """model.init_from: a Hugging Face Llama directory whose config.json and tensor shapes fit the
    model keys (read from headers only)."""
    if cfg.model.init_from:
        yield from hf_problems(cfg.model, cfg.model.init_from)


@_check
def _cluster_time(cfg: Config):
    """Slurm launchers: a time limit sbatch takes, comfortably longer than the signal lead."""
    if cfg.launcher.name not in ("slurm", "sbatch"):
        return
    yield from cluster_checks.time_problems(cfg)


@_check
def _cluster_script(cfg: Config):
    """Slurm launchers: values that cannot be written into #SBATCH lines (line breaks, bad keys)."""
    if cfg.launcher.name not in ("slurm", "sbatch"):
        return
    yield from cluster_checks.script_problems(cfg)


@_check
def _container(cfg: Config):
    """cluster.container_* (pyxis): mounts pyxis can read, an image, no container with launcher=local.
    (The checkout mounted for hpctrain's code is checked where the batch script is written.)"""
    yield from cluster_checks.container_problems(cfg)


@_check
def _cluster_partition(cfg: Config):
    """Slurm launchers (a dry run too: it makes every check a submission makes): the partition exists and
    holds the nodes and tasks asked for. Asks the live cluster (sinfo, with a timeout); skipped where there
    is no sinfo or it fails (the dry run says so). Never for launcher=local or k8s: their jobs do not go
    through this Slurm."""
    yield from cluster_checks.partition_check(cfg)


@_check
def _profile(cfg: Config):
    """profile.steps: [] or [first, last], optimizer steps of this run (1-based, inclusive)."""
    steps = list(cfg.profile.steps)
    if not steps:
        return
    total = cfg.train.steps
    if total < 1:
        return  # _positive says so
    fix = f"Fix: profile.steps=[first,last] with 1 <= first <= last <= train.steps={total}, e.g. " \
          f"profile.steps=[{min(2, total)},{min(3, total)}], or profile.steps=[] for none"
    shown = "[" + ",".join(map(str, steps)) + "]"
    if len(steps) != 2:
        yield f"profile.steps={shown} must name two steps, the first and the last to trace. {fix}"
    elif not 1 <= steps[0] <= steps[1]:
        yield (f"profile.steps={shown}: the first step must be at least 1 and at most the last "
               f"(steps count from 1). {fix}")
    elif steps[1] > total:
        yield f"profile.steps={shown} goes past the run's last step, train.steps={total}. {fix}"


@_check
def _offload(cfg: Config):
    """Offload knobs; with offload.target=nvme, offload.path must name a writable directory. Its free
    space is checked by every rank at start (the ranks know their share of the state)."""
    o = cfg.offload
    if o.target == "none":
        return
    for key in ("chunk_mb", "queue_depth", "block_mb"):
        if getattr(o, key) < 1:
            yield f"offload.{key}={getattr(o, key)} must be at least 1"
    if o.buffer_count < 2:
        yield (f"offload.buffer_count={o.buffer_count}: streaming needs at least 2 buffers (one is read while "
               "the other is updated). Fix: offload.buffer_count=4")
    if o.target != "nvme":
        return
    if not o.path:
        yield ("offload.target=nvme needs a directory for the optimizer state files. "
               "Fix: offload.path=<directory on a fast local disk>")
    elif cfg.launcher.name == "local":  # elsewhere the path is node-local: each rank checks it at start
        problem = writable_dir_problem("offload.path", o.path)
        if problem:
            yield problem


# Launchers that start hpctrain's node agents (hpctrain.launch.supervise), which memory snapshots need
AGENT_LAUNCHERS = ("local", "slurm", "sbatch")
# Launchers whose allocation can hold idle spare nodes
SPARE_LAUNCHERS = ("slurm", "sbatch")


def recovery_problems(cfg: Config) -> list[str]:
    """Why checkpoint.memory_* and cluster.spare_nodes cannot run as set, each with a fix. Elsewhere:
    checkpoint.memory_budget's range (RANGES); the snapshots' size against it, which needs the layout's
    shards (the planner's: hpctrain.plan.snapshots.snapshot_problems, a plan's problem); memory_dir being
    a tmpfs (the node agent's: only the node sees it)."""
    ck, c, launcher = cfg.checkpoint, cfg.cluster, str(cfg.launcher.name)
    out: list[str] = []
    if ck.memory_every < 0:
        out.append(f"checkpoint.memory_every={ck.memory_every} must be 0 (no memory snapshots) or the steps between "
                   "two. Fix: checkpoint.memory_every=0, or 1 (every step)")
    if c.spare_nodes < 0:
        out.append(f"cluster.spare_nodes={c.spare_nodes} must be 0 or more (idle nodes that replace a lost one). "
                   "Fix: cluster.spare_nodes=0 (the default)")
    elif c.spare_nodes > 0:
        if launcher not in SPARE_LAUNCHERS:
            out.append(f"cluster.spare_nodes={c.spare_nodes} asks Slurm for idle nodes to replace a lost one, and "
                       f"launcher={launcher} runs without a Slurm allocation. Fix: launcher=sbatch (or slurm), or "
                       "cluster.spare_nodes=0")
        if ck.memory_every <= 0:
            out.append(f"cluster.spare_nodes={c.spare_nodes}: a spare takes a lost node's ranks from the replicas "
                       "of their memory snapshots, and checkpoint.memory_every=0 takes none. Fix: "
                       "checkpoint.memory_every=1, or cluster.spare_nodes=0")
    if ck.memory_every > 0:
        out += _memory_snapshot_problems(cfg)
    return out


def _memory_snapshot_problems(cfg: Config) -> list[str]:
    ck, launcher = cfg.checkpoint, str(cfg.launcher.name)
    off = "or checkpoint.memory_every=0 (disk checkpoints alone, checkpoint.every)"
    out = []
    if launcher not in AGENT_LAUNCHERS:
        out.append(f"checkpoint.memory_every={ck.memory_every} needs hpctrain's node agents, which "
                   f"launcher={launcher} does not start. Fix: launcher=sbatch (or slurm, local), {off}")
    if not os.path.isabs(ck.memory_dir):
        out.append(f"checkpoint.memory_dir={ck.memory_dir} must be an absolute path (a tmpfs on every node; the "
                   f"ranks start in other directories). Fix: checkpoint.memory_dir=/dev/shm")
    elif launcher == "local":  # this machine is the node: its file system is known here (else each agent checks)
        from hpctrain.core.replica import memory_root_problem

        problem = memory_root_problem(ck.memory_dir)
        if problem:
            out.append(problem)
    if cfg.cluster.container_image:
        out.append("checkpoint.memory_every with cluster.container_image: the node agents that hold the snapshots "
                   "and fork the ranks are not started in the image. Fix: run without the container (the ranks "
                   f"then use this checkout's environment), {off}")
    if str(cfg.offload.target) == "nvme":
        out.append("checkpoint.memory_every with offload.target=nvme: the optimizer state lives in files on the "
                   f"node's NVMe, which a memory snapshot does not hold. Fix: offload.target=cpu (or none), {off}")
    if str(cfg.model.lora.quantize) == "nf4" and cfg.model.lora.rank > 0:
        out.append("checkpoint.memory_every with model.lora.quantize=nf4 (QLoRA): its snapshots could hold the "
                   "adapters alone, and every restore would re-read the base from model.init_from. Fix: "
                   f"model.lora.quantize=none (LoRA on a base kept in the compute dtype), {off}")
    elif _checkpoint_weights(cfg) == "adapters":
        asked = str(ck.weights)
        out.append(f"checkpoint.memory_every with checkpoint.weights={asked}"
                   + (" (adapters here: LoRA with model.init_from)" if asked == "auto" else "")
                   + ": snapshots would hold the adapters alone, and every restore would re-read the base from "
                   f"model.init_from. Fix: checkpoint.weights=full, {off}")
    return out


def _checkpoint_weights(cfg: Config) -> str:
    """checkpoint.weights as the engine resolves `auto` (EngineSpec.checkpoint_weights): its one rule, which
    reads the config and the LoRA settings alone, applied without a layout (one that does not divide
    yet still gets this refusal in the same go)."""
    from types import SimpleNamespace

    from hpctrain.core.spec import EngineSpec, lora_of

    return EngineSpec.checkpoint_weights.fget(SimpleNamespace(config=cfg, lora=lora_of(cfg.model)))


def recovery_advice(cfg: Config) -> list[str]:
    """What the login node warns about memory snapshots without refusing (for advice())."""
    c = cfg.cluster
    if cfg.checkpoint.memory_every > 0 and str(cfg.launcher.name) in SPARE_LAUNCHERS and c.nodes == 1:
        return ["cluster.nodes=1 with checkpoint.memory_every: a snapshot's replica goes to another node, and "
                "there is none: a crash or hang restores from this node's memory, but a lost node falls back "
                "to the newest disk checkpoint (checkpoint.every)"]
    return []


@_check
def _recovery(cfg: Config):
    """Memory snapshots, hot spares and in-process restart (issue 47)."""
    yield from recovery_problems(cfg)
