"""What each plot of the run report must show, read off the matplotlib figure itself (no ranks: a
hand-made run with a Ctrl-C save and a crash). Each test names the misleading drawing it guards against."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpctrain.report import run_report as R

STOP_STEP, CRASH_STEP = 20, 33


def made_run(device: str = "cpu", async_save: bool = False) -> R.Run:
    metrics = []
    t = 1000.0
    for step in range(1, 41):
        t += 0.1 if step not in (STOP_STEP + 1, CRASH_STEP + 1) else 30.0  # a gap at each restart
        m = {"step": step, "loss": 6.0 * math.exp(-step / 5) + 0.003, "tokens_per_s": 9000.0, "mfu": 0.12,
             "time": t, "mem_bytes": 3e8, "step_time_s": 0.1, "tokens": 1024 * step}
        if step % 10 == 0:
            m["val_loss"] = m["loss"]
        metrics.append(m)
    saves = [{"step": s, "seconds": 0.08, "blocked_s": 0.02 if async_save else 0.08, "async": async_save}
             for s in (10, STOP_STEP, 30, 40)]
    stops = [{"attempt": 0, "cause": "stopped", "ranks": [], "nodes": [], "last_step": STOP_STEP, "checkpoint_step": STOP_STEP,
              "failed_at": 1002.0, "first_step_at": 1032.0, "steps_redone": 0, "detect_s": 0.0, "recover_s": 30.0},
             {"attempt": 1, "cause": "crashed", "ranks": [1], "nodes": ["n1"], "last_step": CRASH_STEP, "checkpoint_step": 30,
              "failed_at": 1033.5, "first_step_at": 1063.5, "steps_redone": 3, "detect_s": 0.4, "recover_s": 30.0}]
    return R.Run(Path("run"), metrics, {"device": device, "memory_per_gpu_bytes": 3.5e7, "step_time_s": 0.04},
                 saves, stops)


@pytest.fixture
def figure(monkeypatch):
    """The figure a plot function draws, instead of its PNG."""
    drawn = []

    def keep(fig, path):
        drawn.append(fig)
        return path.name

    monkeypatch.setattr(R, "_save", keep)
    yield lambda: drawn[-1]
    import matplotlib.pyplot as plt

    plt.close("all")


def legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_loss_is_on_a_log_scale_with_the_stop_and_the_crash_marked(figure, tmp_path):
    """Mutants: the old linear axis (the loss after step 10 is a flat line at 0); no restart on the plot."""
    R.plot_loss(made_run(), tmp_path)
    by_step = figure().axes[0]
    assert by_step.get_yscale() == "log" and "log scale" in by_step.get_ylabel()
    marks = {line.get_xdata()[0] for line in by_step.get_lines() if line.get_linestyle() == ":"}
    assert marks == {STOP_STEP, CRASH_STEP}
    assert {"stopped after this step", "crashed after this step"} <= set(legend(by_step))
    narrow = made_run()
    for m in narrow.metrics:  # a loss within a factor of 10 (4.6 to 8): a linear axis
        m["loss"] = 4.6 + 3.4 / m["step"]
        m.pop("val_loss", None)
    R.plot_loss(narrow, tmp_path)
    assert figure().axes[0].get_yscale() == "linear" and figure().axes[0].get_ylabel() == "loss"


def test_throughput_breaks_at_each_restart_and_names_the_mfu_axis(figure, tmp_path):
    """Mutants: a line drawn across the restart gap; an MFU axis that reads as a second, missing line."""
    R.plot_throughput(made_run(), tmp_path)
    ax = figure().axes[0]
    ys = ax.get_lines()[0].get_ydata()
    assert sum(1 for y in ys if math.isnan(y)) == 2
    assert {"stopped: until the next step", "crashed: until the next step"} <= set(legend(ax))
    (right,) = ax.child_axes  # the secondary axis
    assert "the same line" in right.get_ylabel()


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_memory_says_what_a_cpu_run_cannot_show(figure, tmp_path, device):
    """Mutant: the process's RSS drawn against the plan's device tensors with no word (0.43 GiB vs 0.054)."""
    R.plot_memory(made_run(device), tmp_path)
    ax = figure().axes[0]
    text = " ".join(t.get_text() for t in ax.texts)
    assert ("not comparable" in text) == (device == "cpu")
    assert any(("peak RSS" if device == "cpu" else "peak allocated") in x for x in legend(ax))


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_bars_stack_blocked_time_under_the_whole_save(figure, tmp_path, async_save):
    """Mutant: the blocked bar drawn inside the save bar (both read as one). The Ctrl-C's save is named."""
    R.plot_checkpoints(made_run(async_save=async_save), tmp_path)
    ax = figure().axes[0]
    bars = [(p.get_y(), p.get_height()) for p in ax.patches]
    blocked = 0.02 if async_save else 0.08
    assert bars[:4] == [(0, pytest.approx(blocked))] * 4
    if async_save:  # the rest of each save on top, ending at the whole save's time
        assert [(round(y, 6), round(y + h, 6)) for y, h in bars[4:]] == [(0.02, 0.08)] * 4
    else:
        assert len(bars) == 4
    assert [t.get_text() for t in ax.texts] == ["on Ctrl-C"]


def test_the_page_writes_numbers_one_way_and_no_raw_lists():
    """Mutants: "1.661e+04" beside "3,792"; ranks printed as []."""
    assert [R._num(x) for x in (16610.0, 3792.0, 0.0398, 12.5, None)] == ["16,610", "3,792", "0.0398", "12.5", "-"]
    page = R.render(made_run(), {}, None)
    assert "[]" not in page and "<td>1</td>" in page and "<td>n1</td>" in page and "resumed from step" in page


def sweep_rows(with_val: bool) -> list:
    from hpctrain.report.sweep_report import Row

    out = []
    for name, final in (("optim.lr=1e-3", 2.31), ("optim.lr=1e-2", 0.0045), ("optim.lr=3e-3", 0.61)):
        metrics = [{"step": s, "loss": final * (1 + 5 / s)} for s in range(1, 11)]
        best = final if with_val else None
        if with_val:
            metrics[-1]["val_loss"] = final
        out.append(Row(name, [name], "completed", 10, final, best, best, 10 if with_val else None, 5000.0, metrics))
    return out


@pytest.mark.parametrize("with_val", [True, False])
def test_sweep_ranks_on_what_it_shows_and_every_element_is_visible(tmp_path, with_val):
    """Mutants: the table unsorted without validation; a bar axis cut 10% below the smallest value, where
    the best element (0.0045) had no bar; a legend promising validation dots there are none of."""
    import matplotlib.pyplot as plt

    from hpctrain.report import sweep_report as S

    rows = sweep_rows(with_val)
    _, body = S.table(rows)
    assert [r[0] for r in body] == ["optim.lr=1e-2", "optim.lr=3e-3", "optim.lr=1e-3"]
    seen = []
    real = plt.Figure.savefig
    try:
        plt.Figure.savefig = lambda fig, *a, **k: seen.append(fig)
        assert S.plot(rows, tmp_path) == "sweep.png"
    finally:
        plt.Figure.savefig = real
    loss_ax, rank_ax = seen[0].axes
    assert ("dots: validation" in loss_ax.get_ylabel()) == with_val
    assert rank_ax.get_xscale() == "log" and "log scale" in rank_ax.get_xlabel()
    lo, hi = rank_ax.get_xlim()
    dots = rank_ax.collections[0].get_offsets()
    assert all(lo < x < hi for x, _ in dots)  # the best element is on the plot
    best_y = max(y for _, y in dots)
    assert [t.get_text() for t in rank_ax.get_yticklabels()][list(rank_ax.get_yticks()).index(best_y)] == "optim.lr=1e-2"
    plt.close("all")


def test_router_plot_shows_each_experts_share_and_only_for_moe_runs(figure, tmp_path):
    """Guards: a heat map whose rows are not the experts, or whose steps are shifted; a router plot
    drawn for a dense run (empty axes)."""
    run = made_run()
    assert R.plot_router(run, tmp_path) is None  # dense: no router metrics
    for m in run.metrics:
        k = m["step"]
        m.update(expert_share=[1.0 + 0.01 * k, 1.0 - 0.01 * k, 1.0, 1.0], expert_share_min=1.0 - 0.01 * k,
                 expert_share_max=1.0 + 0.01 * k, moe_aux_loss=2.0 + 0.001 * k)
    assert R.plot_router(run, tmp_path) == "router.png"
    heat = figure().axes[0]
    image = heat.get_images()[0].get_array()
    assert image.shape == (4, 40)  # experts x steps
    assert image[0, -1] == pytest.approx(1.4) and image[1, 0] == pytest.approx(0.99)
    left, right, _, _ = heat.get_images()[0].get_extent()
    assert (left, right) == (0.5, 40.5)
    assert not any("dropped" in ax.get_ylabel() for ax in figure().axes)  # nothing was dropped: no panel
    for m in run.metrics:  # a capacity factor that drops from step 20 on
        m["moe_dropped"] = 3 * max(0, m["step"] - 19)
    assert R.plot_router(run, tmp_path) == "router.png"
    dropped = next(ax for ax in figure().axes if "dropped" in ax.get_ylabel())
    x, y = dropped.get_lines()[0].get_data()
    assert list(y) == [m["moe_dropped"] for m in run.metrics] and list(x) == [m["step"] for m in run.metrics]
    assert f"{sum(m['moe_dropped'] for m in run.metrics):,} dropped" in dropped.get_title()


def _preference_run() -> R.Run:
    """A DPO run's metrics: the margin rising, the chosen reward rising and the rejected falling."""
    run = made_run()
    for m in run.metrics:
        k = m["step"]
        m.update({"rewards/chosen": 0.01 * k, "rewards/rejected": -0.02 * k, "rewards/margins": 0.03 * k,
                  "rewards/accuracies": min(1.0, 0.5 + 0.01 * k), "logps/chosen": -40.0 + 0.1 * k,
                  "logps/rejected": -42.0 - 0.2 * k})
    return run


def test_preference_plot_draws_trls_rewards_and_the_accuracy_against_chance(figure, tmp_path):
    """train.objective=dpo: the rewards of the chosen and the rejected and their margin on one plot, the
    accuracy on [0, 1] against chance (0.5). Mutants: the rejected reward drawn from the chosen key; no
    plot for a DPO run; a plot for a run without preference metrics."""
    assert R.plot_preference(made_run(), tmp_path) is None  # no rewards: not a DPO run
    R.plot_preference(_preference_run(), tmp_path)
    rewards, accuracy = figure().axes[:2]
    lines = {line.get_label(): list(line.get_ydata()) for line in rewards.get_lines()}
    assert lines["chosen"][-1] == pytest.approx(0.4) and lines["rejected"][-1] == pytest.approx(-0.8)
    assert lines["margin (chosen - rejected)"][-1] == pytest.approx(1.2)
    assert accuracy.get_ylim()[0] < 0 and accuracy.get_ylim()[1] > 1
    assert "chance" in legend(accuracy)


def test_the_page_of_a_dpo_run_shows_the_rewards_and_no_perplexity():
    """The validation loss of a DPO run is a preference loss: exp of it is no perplexity. Mutants: the
    perplexity column kept for DPO; the preference table missing or reading the wrong step."""
    page = R.render(_preference_run(), {}, None)
    assert "Preference tuning" in page and "perplexity" not in page
    assert "<td>margin</td><td>0.0300</td><td>1.2000</td>" in page
    assert "perplexity" in R.render(made_run(), {}, None)
