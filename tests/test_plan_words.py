"""What the planner shows a person: layouts told apart in its table and plot, counts that add up, a
layout over the limit never rounded into looking like it fits, the plot's two questions on one page."""
from __future__ import annotations

import re

import pytest

from hpctrain.core.compose import compose
from hpctrain.plan.memory import GiB, job_of
from hpctrain.plan.search import knobs, search
from hpctrain.plan.verdict import explain, over, plan, save_plan_png, short


@pytest.fixture(scope="module")
def searched():
    request = job_of(compose(["+experiment=70b", "cluster=h100", "cluster.nodes=2"]))
    return request, search(request)


def test_every_ranked_layout_has_its_own_label(searched):
    """Mutant: the old plot label without dp, grad sync or virtual stages (dp 1x16 and 2x8 read the same)."""
    _, res = searched
    by_label = {}
    for c in res.ranked:
        k = {key: v for key, v in knobs(c.job).items() if key != "pp_layers"}
        assert by_label.setdefault(short(c.job), k) == k, f"two layouts labelled {short(c.job)!r}"
    assert len(by_label) == len(res.ranked) > 100


def test_refusals_add_up_and_near_misses_say_they_are_over(searched):
    """Mutants: per-reason counts only (they need not add up when a layout has several reasons); a near
    miss shown as "80.0 GiB" of 80 GiB."""
    request, res = searched
    text = explain(res, request=request)
    fit = int(re.search(r"^(\d+) of (\d+) layouts fit", text, re.M).group(1))
    refused = int(re.search(r"^refused: (\d+) layouts", text, re.M).group(1))
    assert fit + refused == res.considered
    for c in res.near_misses:
        assert f"GiB over {c.memory.device_limit / GiB:.0f} GiB" in text
    assert over(80.04 * GiB, 80 * GiB) == "80.04 GiB, 0.04 GiB over 80 GiB"


def test_the_plan_png_shows_fit_and_speed_with_the_limit_inside_the_frame(searched, monkeypatch, tmp_path):
    """Mutants: the device limit drawn on the frame (ylim = the limit); memory alone while the ranking is by
    tokens/s; labels that merge layouts or say "cpu" without "offload"."""
    import matplotlib.pyplot as plt

    request, res = searched
    plans = [("requested", plan(request))] + [(f"#{i}", plan(c.job)) for i, c in enumerate(res.ranked[:4], 1)]
    seen = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    save_plan_png(plans, str(tmp_path / "plan.png"))
    mem, speed = seen[0].axes
    limit = plans[0][1].memory.device_limit / GiB
    assert mem.get_ylim()[1] > limit * 1.05
    assert [round(p.get_height()) for p in speed.patches] == [round(p.time.tokens_per_s) for _, p in plans]
    labels = [t.get_text() for t in mem.get_xticklabels()]
    assert len(set(labels)) == len(plans)
    assert all(("offload cpu" in label) == (p.job.spec.offload == "cpu") for label, (_, p) in zip(labels, plans))
    plt.close("all")


def test_a_cpu_cluster_plans_per_rank():
    request = job_of(compose(["+experiment=tiny"]))
    text = explain(search(request), request=request)
    assert "/rank" in text.splitlines()[1] and "/GPU" not in text


def test_the_table_and_the_plot_tell_ep_and_cp_apart():
    """Two qwen3_30b_a3b layouts that differ only in expert parallel read the same in the ranked table
    (issue 42); a 128K layout's cp was not in it either. Mutants caught: the table without its ep or cp
    column; the plot's label without ep."""
    from dataclasses import replace

    from hpctrain.plan.search import Candidate
    from hpctrain.plan.memory import memory
    from hpctrain.plan.throughput import throughput
    from hpctrain.plan.verdict import table

    def candidate(job):
        return Candidate(job=job, problems=[], memory=memory(job), time=throughput(job))

    moe = job_of(compose(["model=qwen3_30b_a3b", "cluster=h100", "cluster.nodes=2", "launcher=sbatch"]))
    lay = moe.spec.layout
    long = job_of(compose(["+experiment=llama31_8b_128k"]))
    cands = [candidate(moe.with_(layout=replace(lay, ep=e))) for e in (1, 8)] + [candidate(long)]
    head, *rows = table(cands).splitlines()
    cols = head.split()
    assert [r.split()[cols.index("ep")] for r in rows] == ["1", "8", "1"]
    assert [r.split()[cols.index("cp")] for r in rows] == ["1", "1", "8"]
    assert rows[0].split()[1:] != rows[1].split()[1:]  # past the rank
    assert [short(c.job).split()[3] for c in cands[:2]] == ["zero3", "ep8"]
    assert " cp8 " in short(long)


SINFO_CPU_ONLY = "debug*|n1|4|(null)|infinite\n"


def test_a_layout_refused_by_the_partition_alone_is_labelled_so(monkeypatch, tmp_path):
    """The live Slurm has no GPU partition: the requested layout fits its GPUs, but the partition check
    refuses the job. The plot said "does not fit"; it names the partition check now, and "does not fit"
    stays for device memory. Mutant caught: every refusal labelled "does not fit"."""
    import matplotlib.pyplot as plt

    from hpctrain.checks.cluster_checks import parse_sinfo
    from hpctrain.plan.__main__ import request_of, requested
    from hpctrain.plan.verdict import refusal

    monkeypatch.setattr("hpctrain.checks.cluster_checks.partition_facts", lambda *a, **k: parse_sinfo(SINFO_CPU_ONLY))
    cfg, _ = request_of(["+experiment=70b", "cluster.nodes=2", "parallel.dp_shard=2"])
    asked, found = requested(cfg, job_of(cfg))
    assert asked.memory.fits and asked.problems == asked.partition == found
    assert "no node of the default partition (debug) has more than 0 GPUs" in found[0]
    over = plan(asked.job.with_(zero=0))  # device memory
    seen = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    save_plan_png([("requested", asked), ("zero 0", over)], str(tmp_path / "plan.png"))
    speed = seen[0].axes[1]
    labels = [t.get_text() for t in speed.texts]
    assert "refused by the partition check" in labels[0] and "does not fit" not in labels[0]
    assert "does not fit" in labels[1] and refusal(over).startswith("does not fit")
    plt.close("all")
