"""What the planner tells people: a plan's summary text, its plan.json dict, the ranked layouts
table, a PNG of memory breakdowns (matplotlib imported only there), and the calibration table
against Megatron-LM's published H100 figures."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hpctrain.core import words
from hpctrain.core.schema import ClusterConfig, ModelConfig
from hpctrain.core.spec import Layout
from hpctrain.core.flops import param_counts, train_flops_per_token
from hpctrain.plan.memory import GiB, Job, Memory, gib, memory
from hpctrain.plan.search import SearchResult, knobs, layout_problems, nearest
from hpctrain.plan.snapshots import COPIES, snapshot_cost, snapshot_problems
from hpctrain.plan.context import attention_kept
from hpctrain.plan.throughput import HPCTRAIN, MEGATRON, Software, Throughput, megatron_flops_per_token, throughput

TOOL = "hpctrain.plan"  # what the files `python -m hpctrain.plan` writes say wrote them


@dataclass
class Plan:
    job: Job
    memory: Memory
    time: Throughput
    problems: list
    # of `problems`, those of the live Slurm's partition check (cluster_checks.partition_check): the
    # cluster's partition refuses the job whatever its layout
    partition: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def refusal(p: Plan) -> str:
    """Why a plan cannot run, in a few words per kind: "does not fit" (device memory), "refused by the
    partition check" (the live Slurm's partition, not the layout), "cannot run" (anything else); "" when
    it can."""
    if p.fits:
        return ""
    kinds = ["does not fit"] if p.memory.problems else []
    kinds += ["refused by the partition check"] if p.partition else []
    if set(p.problems) - set(p.memory.problems) - set(p.partition):
        kinds.append("cannot run")
    return "\n".join(kinds)


def plan(job: Job, sw: Software = HPCTRAIN) -> Plan:
    """Memory and time of one layout, with every reason it cannot run (structure and memory). The
    figures are computed even for a layout that cannot run, so the user sees by how much it misses."""
    mem = memory(job)
    return Plan(job=job, memory=mem, time=throughput(job, sw),
                problems=[msg for _, msg in layout_problems(job)] + mem.problems + snapshot_problems(job))


def plan_dict(p: Plan) -> dict:
    """plan.json: what a run directory records about its predicted cost."""
    m, t, j = p.memory, p.time, p.job
    return {"model": j.model.name, "params": param_counts(j.model)["total"], "world": j.world,
            "device": "gpu" if j.cluster.gpus_per_node else "cpu",
            "layout": knobs(j), "seq_len": j.spec.seq_len, "global_batch": j.spec.global_batch,
            "microbatches": j.microbatches, "precision": j.spec.precision, "feasible": p.fits, "problems": p.problems,
            "memory_per_gpu_bytes": m.device_total, "memory_breakdown_bytes": m.device, "memory_stage": m.stage,
            "device_memory_bytes": m.device_limit, "host_memory_bytes": m.host_per_node,
            "host_memory_per_rank_bytes": m.host_per_rank, "nvme_bytes": m.nvme_per_node,
            "step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s,
            "tokens_per_s_per_gpu": t.tokens_per_s / j.world, "tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu,
            "hw_tflops_per_gpu": t.hw_tflops_per_gpu, "flops_per_token": flops_per_token(j),
            "megatron_tflops_per_gpu": megatron_tflops(p, recompute=False),
            "megatron_eq3_tflops_per_gpu": megatron_tflops(p, recompute=True),
            "bubble_fraction": t.bubble_fraction, "time_breakdown_s": t.breakdown, "collectives": t.collectives,
            "nodes": j.cluster.nodes, "spare_nodes": max(0, j.cluster.spare_nodes),
            "memory_snapshots": snapshots_dict(j)}


def snapshots_dict(j: Job) -> Optional[dict]:
    """plan.json's memory snapshots (checkpoint.memory_every): what they take on a node against the
    budget; None where they are off."""
    cost = snapshot_cost(j)
    if cost is None:
        return None
    return {"every": cost.every, "bytes_per_rank": cost.rank_bytes, "ranks_per_node": cost.ranks_per_node,
            "copies": COPIES, "bytes_per_node": cost.node_bytes, "budget_bytes": cost.budget_bytes}


def spares_line(c: ClusterConfig) -> str:
    """"2 nodes + 1 spare (idle until a node is lost)"; "" without spares."""
    if c.spare_nodes <= 0:
        return ""
    return (f"{words.plural(c.nodes, 'node')} + {words.plural(c.spare_nodes, 'spare')} (idle until a node is lost; "
            f"the job asks Slurm for {c.nodes + c.spare_nodes})")


def describe(job: Job) -> str:
    k = knobs(job)
    ep = f" (ep {k['ep']})" if k["ep"] > 1 else ""
    cp = f" x cp {k['cp']} ({job.spec.cp_attention})" if k["cp"] > 1 else ""
    s = (f"tp {k['tp']} x pp {k['pp']} x dp {k['dp_replicate']}x{k['dp_shard']}{ep}{cp}, zero {k['zero']}, "
         f"offload {k['offload']}, ac {ac_words(k)}, micro_batch {k['micro_batch']}, {k['precision']}, loss {k['loss']}")
    if job.spec.layout.pp > 1:
        s += f", {job.spec.schedule}" + (f" v{job.spec.virtual_stages}" if job.spec.schedule == "interleaved_1f1b" else "")
    if job.spec.zero >= 2 and job.microbatches > 1:
        s += f", grad sync per {k['grad_sync'].replace('microbatch', 'micro-batch')}"
    return s


# parallel.ac_modules in a few letters (the ranked table's ac column, the plot's labels)
MODULE_ABBREV = {"attention": "attn", "mlp": "mlp", "moe_act": "mact", "norm": "norm", "moe": "moe"}


def ac_words(k: dict, sep: str = ", ") -> str:
    """parallel.ac and the modules parallel.ac_modules recomputes: "none", "none+norm,mlp"."""
    mods = k.get("ac_modules") or []
    return k["ac"] + ("+" + ",".join(MODULE_ABBREV.get(m, m) for m in mods) if mods else "")


def _seconds(x: float) -> str:
    return f"{x:.3g} s"


def _parts(d: dict, fmt, total: float = 0.0) -> str:
    """'name value (share)' for the non-zero entries of `d`, largest first."""
    items = sorted(((k, v) for k, v in d.items() if v > 0), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {fmt(v)}" + (f" ({v / total:.0%})" if total else "") for k, v in items)


def summary(p: Plan) -> str:
    j, m, t = p.job, p.memory, p.time
    c = j.cluster
    unit = words.device(c.gpus_per_node)
    counts = param_counts(j.model)
    active = f", {words.params(counts['active'])} active" if j.model.moe.experts else ""
    lines = [f"{j.model.name} ({words.params(counts['total'])} params{active}) on {j.world} x {c.name}: "
             f"{describe(j)}",
             f"memory per {unit} (stage {m.stage}): {gib(m.device_total)} of {gib(m.device_limit)}: "
             + _parts(m.device, gib),
             f"host per node {gib(m.host_per_node)} of {gib(m.host_limit)}: " + _parts(m.host_per_rank, gib)
             + f" per rank x {m.ranks_per_node}"
             + (f"; NVMe per node {gib(m.nvme_per_node)} of {gib(m.nvme_limit)}" if m.nvme_per_rank else ""),
             *([spares_line(c)] if c.spare_nodes > 0 else []),
             *([snapshots.describe()] if (snapshots := snapshot_cost(j)) else []),
             f"step {t.step_time_s:.3g} s ({words.plural(j.microbatches, 'micro-batch', 'micro-batches')} of "
             f"{j.spec.micro_batch} x {j.spec.seq_len}): "
             + _parts(t.breakdown, _seconds, t.step_time_s),
             f"{t.tokens_per_s:,.0f} tokens/s ({t.tokens_per_s / j.world:,.0f} per {unit}), "
             f"{t.tflops_per_gpu:.3g} TFLOP/s per {unit}, MFU {t.mfu:.1%}"
             + (f" ({t.hw_tflops_per_gpu:.3g} hardware TFLOP/s with recomputation)"
                if t.hw_tflops_per_gpu > t.tflops_per_gpu * 1.0001 else ""),
             flop_convention(p)]
    if p.problems:
        lines.append("cannot run:")
        lines += [f"  - {x}" for x in p.problems]
    return "\n".join(lines)


def flops_per_token(job: Job) -> float:
    """The model FLOPs per token the plan counts (MFU's numerator): the FLOPs computed."""
    return train_flops_per_token(job.model, job.spec.seq_len, attention_kept(job))


def megatron_tflops(p: Plan, recompute: bool) -> float:
    """The plan's tokens/s per GPU in Megatron-LM's FLOP count (throughput.megatron_flops_per_token)."""
    return p.time.tokens_per_s / p.job.world * megatron_flops_per_token(p.job.model, p.job.spec.seq_len,
                                                                         recompute) / 1e12


def flop_convention(p: Plan) -> str:
    """What the TFLOP/s and MFU above count, and the same tokens/s in Megatron-LM's count, for its tables."""
    j = p.job
    kept = attention_kept(j)
    mask = f" x the {kept:.1%} the document mask keeps" if kept < 1 else ""
    lora = " (4 per frozen one)" if j.spec.lora else ""
    return (f"FLOPs counted: those computed, 6 per active parameter and token{lora} + attention over the "
            f"(query, key) pairs kept (the causal half{mask}). Megatron-LM's count (Narayanan et al. 2021 eq. 3: "
            f"the whole s x s, no mask): {megatron_tflops(p, False):.3g} TFLOP/s per "
            f"{words.device(j.cluster.gpus_per_node)} without its recompute term (Megatron-LM's README tables), "
            f"{megatron_tflops(p, True):.3g} with it")


def table(cands: list, limit: Optional[float] = None) -> str:
    unit = "/" + words.device(cands[0].job.cluster.gpus_per_node if cands else 1)
    head = (f"{'#':>3} {'tp':>2} {'pp':>3} {'dp':>7} {'ep':>3} {'cp':>3} {'zero':>4} {'offload':>7} {'ac':>9} {'mb':>2} "
            f"{'schedule':>12} {'sync':>5} {'prec':>4} {'loss':>7} {'mem GiB':>7} {'step s':>7} {'tokens/s':>10} {unit:>6} {'TFLOP/s':>7} {'MFU':>5}")
    rows = [head]
    for i, c in enumerate(cands, 1):
        k, t = knobs(c.job), c.time
        sched = k["schedule"] + (f" v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
        rows.append(f"{i:>3} {k['tp']:>2} {k['pp']:>3} {str(k['dp_replicate']) + 'x' + str(k['dp_shard']):>7} "
                    f"{k['ep']:>3} {k['cp']:>3} "
                    f"{k['zero']:>4} {k['offload']:>7} {ac_words(k):>9} {k['micro_batch']:>2} {sched:>12} "
                    f"{('step' if k['grad_sync'] == 'step' else 'mb'):>5} {k['precision']:>4} {k['loss']:>7} "
                    f"{c.memory.device_total / GiB:>7.2f} {t.step_time_s:>7.3g} {t.tokens_per_s:>10,.0f} "
                    f"{t.tokens_per_s / c.job.world:>6,.0f} {t.tflops_per_gpu:>7.3g} {t.mfu:>5.1%}")
    return "\n".join(rows)


def explain(res: SearchResult, top: int = 10, why: int = 3, request: Optional[Job] = None) -> str:
    """The ranked table, why the best few win, why the others were refused, and the fitting layouts
    nearest to the one asked for."""
    if res.ranked:
        out = [f"{len(res.ranked)} of {res.considered} layouts fit; best {min(top, len(res.ranked))} by tokens/s:",
               table(res.ranked[:top])]
    else:
        out = [f"none of {res.considered} layouts fits"]
    for i, c in enumerate(res.ranked[:why], 1):
        t, m = c.time, c.memory
        out.append(f"#{i}: {describe(c.job)}\n    time: {_parts(t.breakdown, _seconds, t.step_time_s)}\n"
                   f"    memory {gib(m.device_total)} of {gib(m.device_limit)}: {_parts(m.device, gib)}")
    refused = res.considered - len(res.ranked)
    if res.failures:
        several = sum(res.failures.values()) > refused
        out.append(f"refused: {refused} layouts" + (" (some for several reasons, counted under each):" if several else ":"))
        for reason, n in res.failures.most_common():
            ex = res.examples[reason]
            out.append(f"  {n:>6} x {reason}  (e.g. {describe(ex.job)}: {ex.problems[ex.reasons.index(reason)]})")
    if res.near_misses:
        out.append("closest to fitting (each over the device memory by what it says):")
        out += [f"  {describe(c.job)}: {over(c.memory.device_total, c.memory.device_limit)}" for c in res.near_misses]
    mine = [i for i, c in enumerate(res.ranked, 1) if request is not None and knobs(c.job) == knobs(request)]
    if mine and res.ranked:
        best = res.ranked[0].time.tokens_per_s
        out.append(f"the requested layout ranks #{mine[0]} of {len(res.ranked)}, at "
                   f"{res.ranked[mine[0] - 1].time.tokens_per_s / best:.0%} of the best's tokens/s")
    elif request is not None and res.ranked:
        out.append("fitting layouts nearest to the one asked for:")
        out += [f"  {describe(c.job)}: {c.time.tokens_per_s:,.0f} tokens/s, {gib(c.memory.device_total)}"
                for c in nearest(request, res.ranked)]
    return "\n".join(out)


def over(total: float, limit: float) -> str:
    """A size above a limit, precise enough never to read as fitting (80.04 of 80.0 GiB is not "80.0")."""
    return f"{total / GiB:.2f} GiB, {(total - limit) / GiB:.2f} GiB over {limit / GiB:.0f} GiB"


def short(job: Job) -> str:
    """A layout in a few words, every knob that tells two layouts apart (the plot's tick labels)."""
    k = knobs(job)
    ep = f" ep{k['ep']}" if k["ep"] > 1 else ""
    cp = f" cp{k['cp']}" if k["cp"] > 1 else ""
    s = (f"tp{k['tp']} pp{k['pp']} dp{k['dp_replicate']}x{k['dp_shard']}{ep}{cp} zero{k['zero']} ac {ac_words(k)} "
         f"mb{k['micro_batch']} {k['precision']}" + (" loss full" if k["loss"] == "full" else ""))
    if job.spec.layout.pp > 1:
        s += f" {job.spec.schedule}" + (f" v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
    if k["grad_sync"] == "step":
        s += " sync step"
    if k["offload"] != "none":
        s += f" offload {k['offload']}"
    return s


def save_plan_png(plans: list, path: str) -> str:
    """The layouts side by side, in the order given (the ranking): device memory per rank by kind against
    the device, and predicted tokens/s, the measure they are ranked by. `plans`: (title, Plan) pairs."""
    # optional and heavy (~1 s): only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = []
    for _, p in plans:
        kinds += [k for k in p.memory.device if k not in kinds]
    unit = words.device(plans[0][1].job.cluster.gpus_per_node)
    labels = [f"{title}\n{short(p.job)}" for title, p in plans]
    x = range(len(plans))
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(max(10, 2.6 * len(plans) + 4), 5.2))
    bottom = [0.0] * len(plans)
    colours = plt.get_cmap("tab20").colors  # more kinds than the default cycle's 10 colours
    for i, kind in enumerate(kinds):
        vals = [p.memory.device.get(kind, 0.0) / GiB for _, p in plans]
        mem.bar(x, vals, bottom=bottom, label=kind, color=colours[i % len(colours)])
        bottom = [b + v for b, v in zip(bottom, vals)]
    limit = plans[0][1].memory.device_limit / GiB
    mem.axhline(limit, color="k", linestyle="--", label=f"device memory ({limit:.0f} GiB)")
    mem.set_ylim(0, max([limit, *bottom]) * 1.12)  # the limit inside the frame, not on it
    mem.set_ylabel(f"GiB per {unit}")
    mem.set_title("does it fit? device memory by kind")
    mem.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    tokens = [p.time.tokens_per_s for _, p in plans]
    speed.bar(x, tokens, color=["C0" if p.fits else "0.7" for _, p in plans])
    for i, (t, (_, p)) in enumerate(zip(tokens, plans)):
        speed.annotate(f"{t:,.0f}" + ("" if p.fits else "\n" + refusal(p)), (i, t), ha="center", va="bottom", fontsize=7)
    speed.set_ylim(0, max(tokens) * 1.2 if tokens else 1)
    speed.set_ylabel("predicted tokens/s (whole job)")
    speed.set_title("how fast? the measure layouts are ranked by")
    for ax in (mem, speed):
        ax.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": TOOL})  # the mark outdir.file_problem reads
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Calibration: Megatron-LM README (github.com/NVIDIA/Megatron-LM, "Performance Benchmarking"), H100,
# vocab 131072, seq 4096, DP 48 (docs/measurements.md).

MEGATRON_H100 = [  # model, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def megatron_job(row: tuple, cluster: ClusterConfig) -> Job:
    """One table row in our schema.

    - GPT, not Llama: no GQA (n_kv_heads = n_heads); the 4h GELU MLP (2 matrices of h x 4h) becomes
      a SwiGLU of ffn = 8h/3 rounded to a multiple of TP (3 matrices of h x ffn): the same
      parameters and FLOPs within 0.02%. Untied embeddings, as the published sizes imply.
    - DP = GPUs / (TP x PP) = 48 on every row; ZeRO-1 (Megatron's distributed optimizer), bf16,
      no activation recompute, no offload.
    - PP = 1 rows run each replica's batch / DP = 4 sequences as one micro-batch. With 4
      micro-batches of 1 the fp32 gradient reduce-scatter (16 GB per GPU for 32B, >= 0.33 s through
      one 400G NIC) could only hide under the last one's backward; the published 459.6 TFLOP/s
      is out of reach of any model that respects that bound.
    - PP > 1 rows use micro-batch 1 (batch / DP = 4 PP micro-batches) and interleaved 1F1B with one
      layer per virtual stage (layers / PP chunks; 23 and 7 layers per stage allow nothing between
      1 and all). Plain 1F1B's bubble, 11-19% here, leaves no single set of constants within 10%.
    """
    name, heads, h, layers, tp, pp, gpus, batch, _ = row
    ffn = round(8 * h / 3 / tp) * tp
    m = ModelConfig(name=name, dim=h, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=ffn,
                    vocab_size=131072, tie_embeddings=False)
    dp = gpus // (tp * pp)
    return Job.of(m, cluster, layout=Layout(pp=pp, dp_replicate=1, dp_shard=dp, tp=tp), seq_len=4096,
                  global_batch=batch, micro_batch=batch // dp if pp == 1 else 1, precision="bf16",
                  zero=1, ac="none", schedule="interleaved_1f1b" if pp > 1 else "1f1b",
                  virtual_stages=layers // pp if pp > 1 else 1)


def calibration(cluster: ClusterConfig, sw: Software = MEGATRON) -> list[dict]:
    rows = []
    for row in MEGATRON_H100:
        job = megatron_job(row, cluster)
        t = throughput(job, sw)
        # in the table's own FLOP count: Megatron-LM r0.8's (eq. 3 without the recompute term, the whole s x s)
        predicted = t.tokens_per_s / job.world * megatron_flops_per_token(job.model, job.spec.seq_len, False) / 1e12
        rows.append({"model": row[0], "tp": row[4], "pp": row[5], "gpus": row[6], "predicted": predicted,
                     "published": row[8], "error": predicted / row[8] - 1})
    return rows


def calibration_table(rows: list[dict]) -> str:
    out = [f"{'model':>6} {'TP':>2} {'PP':>2} {'GPUs':>5} {'predicted':>9} {'published':>9} {'error':>7}"]
    out += [f"{r['model']:>6} {r['tp']:>2} {r['pp']:>2} {r['gpus']:>5} {r['predicted']:>9.1f} "
            f"{r['published']:>9.1f} {r['error']:>+7.1%}" for r in rows]
    return "\n".join(out)

