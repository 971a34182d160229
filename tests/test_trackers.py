"""Experiment trackers (hpctrain.train.trackers), offline: TensorBoard, W&B and MLflow get the series
metrics.jsonl gets, keep ONE run over a crash and restart (ids in <run.dir>/trackers.json), and a
tracker that fails is dropped with a warning while training goes on. Each tracker is read back with
its own reader: TensorBoard's EventAccumulator, MLflow's MlflowClient, and W&B's offline transaction
log (run-<id>.wandb: W&B's LevelDB-style record log of wandb.proto Records, parsed below)."""
from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.core.compose import compose
from hpctrain.core.rundir import read_jsonl
from hpctrain.train import trackers as T
from hpctrain.train.metrics import MetricsLogger

from helpers import REPO, run_cli

STEPS = 6


# ------------------------------------------------------------------------------------------- readers

def wandb_records(path: Path):
    """The wandb.proto Records of one offline run file: a 7-byte header (":W&B", magic, version),
    then 32 KiB blocks of records, each with a 7-byte header (CRC, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            continue
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(parts)
            yield r


def wandb_runs(run_dir: Path) -> list[dict]:
    """One dict per offline run directory (one per start of the run), oldest first: its run id,
    config, define_metric records and history rows."""
    out = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = d.glob("run-*.wandb")
        run = {"dir": d.name, "id": None, "config": {}, "metrics": [], "history": []}
        for r in wandb_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
                run["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            elif kind == "metric":
                run["metrics"].append((r.metric.name or r.metric.glob_name, r.metric.step_metric))
            elif kind == "history":
                run["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                       for i in r.history.item})
        out.append(run)
    return out


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # TensorBoard keeps scalars as float32


def mlflow_client(run_dir: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
    from mlflow.tracking import MlflowClient

    return MlflowClient((run_dir / "mlruns").resolve().as_uri())


def mlflow_runs(client) -> list:
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps])


def mlflow_series(client, run_id: str, tag: str) -> list[tuple[int, float]]:
    hist = sorted(client.get_metric_history(run_id, tag), key=lambda m: m.timestamp)  # stable: logged order
    return [(m.step, m.value) for m in hist]


# ------------------------------------------------------------------------------------- pure parts

def test_names_and_scalars():
    assert T.tag("loss") == "train/loss" and T.tag("val_loss") == "val/loss" and T.tag("val_ppl") == "val/ppl"
    assert T.scalars({"loss": 1.5, "tokens": 7, "val_loss": 2.0, "ok": True, "note": "x"}) == \
        {"train/loss": 1.5, "train/tokens": 7, "val/loss": 2.0}


@pytest.mark.slow
def test_params_flatten_encode_and_truncate():
    cfg = {"train": {"steps": 6, "precision": "fp32"}, "model": {"init_from": None},
           "cluster": {"setup": ["module load x"], "env": {}, "sbatch_extra": {"gres": "gpu:8"}},
           "data": {"path": "p" * 7000}, "weird": {"a,b": 1}}
    p = T.params(cfg, {"world": 2, "memory_breakdown_bytes": {"params": 10}})
    assert p["train.steps"] == "6" and p["train.precision"] == "fp32"
    assert p["model.init_from"] == "null" and p["cluster.setup"] == '["module load x"]'
    assert p["cluster.env"] == "{}" and p["cluster.sbatch_extra.gres"] == "gpu:8"
    assert p["plan.world"] == "2" and p["plan.memory_breakdown_bytes.params"] == "10"
    assert len(p["data.path"]) == 6000 and p["data.path"].startswith("ppp") and p["data.path"].endswith("[truncated]")
    assert p["weird.a_b"] == "1"  # MLflow refuses ',' in keys
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    assert all(len(v) <= MAX_PARAM_VAL_LENGTH for v in p.values())


def test_ids_file_keeps_every_tracker(tmp_path):
    assert T.load_ids(tmp_path) == {}
    T.save_id(tmp_path, "wandb", {"id": "abc"})
    T.save_id(tmp_path, "mlflow", {"run_id": "r1", "tracking_uri": "file:x"})
    assert T.load_ids(tmp_path) == {"wandb": {"id": "abc"}, "mlflow": {"run_id": "r1", "tracking_uri": "file:x"}}
    assert all(len(i) == 8 and set(i) <= set("abcdefghijklmnopqrstuvwxyz0123456789")
               for i in (T.new_id() for _ in range(20)))


@pytest.mark.slow
def test_from_config_picks_the_enabled_trackers_and_imports_none_of_them(tmp_path):
    script = (
        "import sys\n"
        "from hpctrain.core.compose import compose\n"
        "from hpctrain.train.trackers import from_config\n"
        "names = lambda o: [t.name for t in from_config(compose(['+experiment=tiny', *o]), sys.argv[1])]\n"
        "assert names([]) == [], names([])\n"
        "assert names(['logger=wandb']) == ['wandb']\n"
        "assert names(['logger=[tensorboard,wandb,mlflow]']) == ['tensorboard', 'wandb', 'mlflow']\n"
        "assert names(['logger=[wandb,mlflow]', 'logger.wandb.mode=disabled']) == ['mlflow']\n"
        "bad = [m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('OK')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


class Fake(T.Tracker):
    def __init__(self, name, fail_in=None, fail_at=None):
        super().__init__(None)
        self.name, self.fail_in, self.fail_at, self.got, self.closed = name, fail_in, fail_at, [], None

    def start(self):
        if self.fail_in == "start":
            raise OSError("cannot write")
        return "somewhere"

    def log(self, step, metrics, when):
        if self.fail_in == "log" and step >= self.fail_at:
            raise RuntimeError("server gone")
        self.got.append((step, metrics))

    def close(self, finished):
        if self.fail_in == "close":
            raise RuntimeError("close failed")
        self.closed = finished


def test_a_failing_tracker_is_dropped_with_one_warning(tmp_path, caplog, capsys):
    good, at_start, mid_run, at_close = Fake("good"), Fake("s", "start"), Fake("m", "log", 2), Fake("c", "close")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        m = MetricsLogger(tmp_path, 3, trackers=[good, at_start, mid_run, at_close], live=False)
        for step in (1, 2, 3):
            m.log(step, loss=1.0 / step, lr=1e-3, tokens_per_s=1.0, mfu=0.1, mem_bytes=1, val_loss=2.0, val_ppl=7.5)
        m.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert [s for s, _ in good.got] == [1, 2, 3] and good.closed is True
    assert good.got[0][1] == {"train/loss": 1.0, "train/lr": 1e-3, "train/tokens_per_s": 1.0, "train/mfu": 0.1,
                              "train/mem_bytes": 1, "val/loss": 2.0, "val/ppl": 7.5}
    assert at_start.got == [] and [s for s, _ in mid_run.got] == [1] and mid_run.closed is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # one each: start, log (once, not at every later step), close
    assert any("tracker m failed in log (step 2): RuntimeError: server gone" in w for w in warnings)
    out = capsys.readouterr().out
    assert out.count("warning: tracker") == 3 and "good: somewhere" in out


def test_close_marks_an_unfinished_run(tmp_path):
    t = Fake("t")
    m = MetricsLogger(tmp_path, 5, trackers=[t], live=False)
    m.log(1, loss=1.0, lr=1e-3, tokens_per_s=1.0, mfu=0.1, mem_bytes=1)
    m.close()
    assert t.closed is False  # preempted at step 1 of 5: MLflow KILLED, W&B exit code 1


# ------------------------------------------------------------------------ the trackers, in process

@pytest.mark.slow
def test_trackers_reopen_their_runs_after_a_restart(tmp_path):
    """Two starts of one run directory, as a crash at step 3 and a resume from step 2 make them,
    without training: one W&B id, one MLflow run, TensorBoard without the steps logged twice."""
    cfg_args = ["+experiment=tiny", "logger=[tensorboard,wandb,mlflow]", f"run.dir={tmp_path}", f"train.steps={STEPS}"]
    cfg = compose(cfg_args)
    (tmp_path / "plan.json").write_text(json.dumps({"world": 2, "mfu": 0.5}))
    first = {s: 10.0 + s for s in (1, 2, 3)}
    second = {s: 20.0 + s for s in range(3, STEPS + 1)}

    def attempt(start: int, values: dict, finished: bool, cfg=cfg):
        ts = T.from_config(cfg, tmp_path, start)
        for t in ts:
            t.start()
        for s, v in values.items():
            for t in ts:
                t.log(s, {"train/loss": v}, 1e9 + s + 100 * start)
        for t in ts:
            t.close(finished)

    attempt(0, first, False)
    ids = T.load_ids(tmp_path)
    (tmp_path / "interruptions.jsonl").write_text(json.dumps({"attempt": 0, "cause": "crashed",
                                                              "checkpoint_step": 2, "last_step": 3}) + "\n")
    attempt(2, second, True, compose([*cfg_args, "optim.lr=0.5"]))  # a changed knob: MLflow params are immutable
    assert T.load_ids(tmp_path) == ids

    final = {**first, **second}
    assert tb_scalars(tmp_path, "train/loss") == [(s, f32(v)) for s, v in sorted(final.items())]

    runs = wandb_runs(tmp_path)
    assert [r["id"] for r in runs] == [ids["wandb"]["id"]] * 2
    assert [[(h["step"], h["train/loss"]) for h in r["history"]] for r in runs] == \
        [list(first.items()), list(second.items())]
    assert ("*", "step") in runs[1]["metrics"]
    assert json.loads(json.dumps(runs[0]["config"]["train"]))["steps"] == STEPS
    assert runs[0]["config"]["plan"] == {"world": 2, "mfu": 0.5}

    c = mlflow_client(tmp_path)
    (run,) = mlflow_runs(c)
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert mlflow_series(c, run.info.run_id, "train/loss") == list(first.items()) + list(second.items())
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["plan.world"] == "2"
    assert run.data.tags["interruptions"] == "1"
    assert run.data.params["optim.lr"] == "0.003" and run.data.tags["changed_on_restart.optim.lr"] == "0.5"


# ------------------------------------------------------------------- through the CLI, 2 ranks

@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """One run with all three trackers whose rank 1 is killed after step 4 (steps 1-3 logged,
    checkpoint 2): the local supervisor restarts it from step 2, which logs steps 3-6."""
    d = tmp_path_factory.mktemp("trackers")
    proc = run_cli("+experiment=tiny", f"train.steps={STEPS}", "eval.every=2", "checkpoint.every=2",
                   "logger=[tensorboard,wandb,mlflow]", f"run.dir={d}", env={"HPCTRAIN_FAULT": "crash:step=4,rank=1"})
    return d, proc


def as_logged(d: Path, key: str) -> tuple[list, list]:
    """(step, value) of `key` as each start of the run logged it: the first up to the step it had
    reached, the second from the checkpoint on. Resume is exact, so metrics.jsonl's final value of a
    step logged twice is also the first value."""
    (rec,) = read_jsonl(d / "interruptions.jsonl")
    rows = [(r["step"], r[key]) for r in read_jsonl(d / "metrics.jsonl") if key in r]
    return ([(s, v) for s, v in rows if s <= rec["last_step"]],
            [(s, v) for s, v in rows if s > rec["checkpoint_step"]])


@pytest.mark.slow
def test_each_tracker_gets_the_series_of_metrics_jsonl(crashed):
    d, proc = crashed
    assert "completed at step 6" in proc.stderr
    (rec,) = read_jsonl(d / "interruptions.jsonl")
    assert rec["last_step"] > rec["checkpoint_step"]  # some steps were logged twice
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    c = mlflow_client(d)
    (run,) = mlflow_runs(c)
    wb = wandb_runs(d)
    for key in ("loss", "val_loss", "grad_norm", "lr", "mfu", "tokens_per_s", "mem_bytes"):
        tag = T.tag(key)
        before, after = as_logged(d, key)
        final = [(r["step"], r[key]) for r in rows if key in r]
        assert tb_scalars(d, tag) == [(s, f32(v)) for s, v in final], key  # purged, then logged again
        wb_series = [[(h["step"], h[tag]) for h in r["history"] if tag in h] for r in wb]
        ml_series = mlflow_series(c, run.info.run_id, tag)
        assert dict(ml_series) == dict(final), key  # the later value of a step logged twice wins
        if key in ("loss", "val_loss", "grad_norm", "lr"):  # exact on resume: every value as logged
            assert wb_series == [before, after], key
            assert ml_series == before + after, key
        else:  # timings: the first start's value of a repeated step is its own
            assert [[s for s, _ in part] for part in wb_series] == [[s for s, _ in before], [s for s, _ in after]]
            assert wb_series[1] == after and [s for s, _ in ml_series] == [s for s, _ in before + after], key
    assert [s for s, _ in as_logged(d, "val_loss")[1]] == [4, 6]


@pytest.mark.slow
def test_a_restarted_run_continues_the_same_tracker_runs(crashed):
    d, proc = crashed
    ids = json.loads((d / "trackers.json").read_text())
    wb = wandb_runs(d)
    assert len(wb) == 2 and {r["id"] for r in wb} == {ids["wandb"]["id"]}  # one offline dir per start
    c = mlflow_client(d)
    (run,) = mlflow_runs(c)  # not a second run for the restart
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["plan.world"] == "2"
    assert run.data.tags["interruptions"] == "1"
    assert wb[0]["config"]["eval"]["every"] == 2 and wb[0]["config"]["plan"]["world"] == 2
    assert f"offline run {ids['wandb']['id']}" in proc.stdout and f"mlflow: run {run.info.run_id}" in proc.stdout


@pytest.mark.slow
def test_a_tracker_that_cannot_start_does_not_stop_training(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where MLflow wants a directory")
    d = tmp_path / "run"
    proc = run_cli("+experiment=tiny", "launcher.nproc=1", "train.steps=2", "logger=[mlflow,tensorboard]",
                   f"logger.mlflow.tracking_uri={(blocker / 'mlruns').as_uri()}", f"run.dir={d}")
    assert "completed at step 2" in proc.stderr
    out = proc.stdout + proc.stderr
    assert "tracker mlflow failed in start" in out and "training goes on" in out
    assert [s for s, _ in tb_scalars(d, "train/loss")] == [1, 2]
