"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow (`logger=...`).

Rank 0 feeds them the records it writes to metrics.jsonl (hpctrain.train.metrics.MetricsLogger), under
the same names in all three: `train/<key>`, and `val/<key>` for the `val_<key>` ones. At start each gets
the resolved config and plan.json (W&B config, MLflow params, TensorBoard text) and the run's
interruptions (interruptions.jsonl); at the end the interruptions again, with what the supervisor has
added since.

A run keeps one tracker run over every restart and requeue: the ids live in <run.dir>/trackers.json and
a restarted rank 0 reopens them. Steps after the resumed checkpoint were logged before the failure and
are logged again: TensorBoard purges them (purge_step); W&B charts against a `step` metric, not its own
monotonic step, so a repeated step is accepted; MLflow keeps both values (the later is the run's).

Nothing here imports wandb, mlflow, tensorboard or torch until a tracker starts (on rank 0); the login
node never imports them. A tracker that raises is dropped by MetricsLogger with a warning; training
goes on.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.core.compose import to_dict
from hpctrain.core.rundir import INTERRUPTIONS, read_jsonl, write_atomic
from hpctrain.core.schema import Config

IDS = "trackers.json"  # {"wandb": {"id": ...}, "mlflow": {"tracking_uri": ..., "run_id": ...}}


def tag(key: str) -> str:
    """The tracker name of a metrics.jsonl key: val_loss -> val/loss, loss -> train/loss."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def scalars(metrics: dict) -> dict[str, float]:
    """The numeric entries of a record (no bools, no strings), by tracker name."""
    return {tag(k): v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (`train.steps`); lists and other values stay as they are."""
    if not isinstance(d, dict):
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


_BAD_KEY = re.compile(r"[^/\w.\- :]")


def params(config: dict, plan: dict | None, max_len: int = 6000, max_key: int = 250) -> dict[str, str]:
    """MLflow params: the flattened config, plan.json under `plan.`; values as text (JSON for lists,
    dicts and None), cut to `max_len` characters with a marker; keys with characters MLflow refuses
    replaced by `_`."""
    flat = flatten(config)
    if plan:
        flat.update(flatten(plan, "plan"))
    out = {}
    for k, v in flat.items():
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        if len(text) > max_len:
            cut = "...[truncated]"
            text = text[:max_len - len(cut)] + cut
        out[_BAD_KEY.sub("_", k)[:max_key]] = text
    return out


def new_id(n: int = 8) -> str:
    """A W&B run id: lowercase letters and digits, as W&B makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def load_ids(run_dir: str | os.PathLike) -> dict:
    try:
        return json.loads((Path(run_dir) / IDS).read_text())
    except (OSError, ValueError):
        return {}


def save_id(run_dir: str | os.PathLike, name: str, value: dict) -> None:
    ids = load_ids(run_dir)
    ids[name] = value
    write_atomic(Path(run_dir) / IDS, json.dumps(ids, indent=1) + "\n")


@dataclass
class RunInfo:
    """What every tracker gets about the run (gathered without importing any tracker)."""
    run_dir: Path
    name: str
    config: dict  # the resolved config
    plan: dict | None = None  # plan.json, where the login node wrote it
    step: int = 0  # the step the run (re)starts from: later steps may have been logged already

    def interruptions(self) -> list[dict]:
        return read_jsonl(self.run_dir / INTERRUPTIONS)


class Tracker:
    """One tracker: start() opens (or reopens) its run and says where it writes; log() gets every
    logged step's record; close() ends it. Any of them may raise: MetricsLogger drops the tracker."""
    name = "tracker"

    def __init__(self, run: RunInfo):
        self.run = run

    def start(self) -> str:
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float], when: float) -> None:
        raise NotImplementedError

    def close(self, finished: bool) -> None:
        pass


# ---------------------------------------------------------------------------------------- TensorBoard

def _markdown_table(records: list[dict]) -> str:
    keys = ["attempt", "cause", "ranks", "nodes", "checkpoint_step", "last_step", "steps_redone", "recover_s",
            "detail"]
    rows = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in records:
        rows.append("| " + " | ".join(str(r.get(k, "")).replace("|", "/").replace("\n", " ") for k in keys) + " |")
    return "\n".join(rows)


def _code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())  # markdown: a code block


class TensorBoard(Tracker):
    """Events in <run.dir>/tensorboard; a restart appends to the same directory, purging the steps
    after the resumed checkpoint."""
    name = "tensorboard"

    def start(self) -> str:
        # optional dependency (tensorboard), imported by rank 0 only when enabled
        from torch.utils.tensorboard import SummaryWriter

        logdir = self.run.run_dir / "tensorboard"
        before = logdir.is_dir() and any(logdir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(logdir), purge_step=self.run.step + 1 if before else None)
        at = self.run.step
        self.writer.add_text("config", _code(json.dumps(self.run.config, indent=1, default=str)), at)
        if self.run.plan:
            self.writer.add_text("plan", _code(json.dumps(self.run.plan, indent=1, default=str)), at)
        records = self.run.interruptions()
        if records:
            self.writer.add_text("interruptions", _markdown_table(records), at)
        self.writer.flush()
        return f"events in {logdir} (tensorboard --logdir {logdir})"

    def log(self, step: int, metrics: dict[str, float], when: float) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step, walltime=when)
        self.writer.flush()  # a killed rank 0 loses nothing it logged

    def close(self, finished: bool) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------------------------- W&B

class Wandb(Tracker):
    """Weights & Biases; offline by default, into <run.dir>/wandb (one offline-run-* directory per
    start of the run, all with the run's one id: `wandb sync` uploads them in order, as one run)."""
    name = "wandb"

    def __init__(self, run: RunInfo, project: str, entity: str | None, mode: str, tags: list):
        super().__init__(run)
        self.project, self.entity, self.mode, self.tags = project, entity, mode, list(tags)

    def start(self) -> str:
        # optional dependency (wandb), imported by rank 0 only when enabled
        import wandb

        saved = load_ids(self.run.run_dir).get(self.name, {})
        run_id = saved.get("id")
        if not run_id:
            run_id = new_id()
            save_id(self.run.run_dir, self.name, {"id": run_id})  # before init: a crash in it reuses the id
        config = dict(self.run.config)
        if self.run.plan:
            config["plan"] = self.run.plan
        self.wb = wandb.init(
            project=self.project, entity=self.entity, mode=self.mode, id=run_id, resume="allow",
            name=self.run.name, dir=str(self.run.run_dir), tags=self.tags or None, config=config,
            settings=wandb.Settings(silent=True, console="off"))
        # The x-axis is the `step` we log, not W&B's own step: that one must grow, and the steps after
        # the resumed checkpoint come again after a restart.
        self.wb.define_metric("step")
        self.wb.define_metric("*", step_metric="step")
        self._interruptions()
        where = Path(self.wb.dir).parent
        if self.mode == "offline":  # every start of the run wrote one such directory
            return f"offline run {run_id} in {where} (upload: wandb sync {where.parent}/offline-run-*-{run_id})"
        return f"run {run_id} ({self.mode}) in {where}" + (f": {self.wb.url}" if self.wb.url else "")

    def _interruptions(self) -> None:
        records = self.run.interruptions()
        if records:
            self.wb.summary["interruptions"] = len(records)
            self.wb.summary["interruption_records"] = records

    def log(self, step: int, metrics: dict[str, float], when: float) -> None:
        self.wb.log({"step": step, **metrics})

    def close(self, finished: bool) -> None:
        self._interruptions()
        self.wb.finish(exit_code=0 if finished else 1)


# -------------------------------------------------------------------------------------------- MLflow

class MLflow(Tracker):
    """MLflow through its client (no global active run). tracking_uri None: a file store in
    <run.dir>/mlruns, MLflow's serverless store (MLflow 3 keeps it behind MLFLOW_ALLOW_FILE_STORE, which
    is set here for it; the SQLite store would need SQLAlchemy, which mlflow-skinny lacks)."""
    name = "mlflow"

    def __init__(self, run: RunInfo, tracking_uri: str | None, experiment: str):
        super().__init__(run)
        self.tracking_uri, self.experiment = tracking_uri, experiment

    def _uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        return (self.run.run_dir / "mlruns").resolve().as_uri()

    def start(self) -> str:
        uri = self._uri()
        if uri.startswith(("http://", "https://")):
            # A server: fail in seconds (and be dropped), not after minutes of retries holding up steps.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        elif uri.startswith("file:") or ":" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # optional dependency (mlflow), imported by rank 0 only when enabled
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(uri)
        saved = load_ids(self.run.run_dir).get(self.name, {})
        self.run_id, logged = None, {}
        if saved.get("run_id") and saved.get("tracking_uri") == uri:
            try:
                old = c.get_run(saved["run_id"])
            except Exception:  # noqa: BLE001 - gone from the store: start a new one
                old = None
            if old is not None and old.info.lifecycle_stage == "active":
                self.run_id, logged = old.info.run_id, dict(old.data.params)
                c.update_run(self.run_id, status="RUNNING")
        if self.run_id is None:
            exp = c.get_experiment_by_name(self.experiment)
            if exp is None:
                try:
                    exp_id = c.create_experiment(self.experiment)
                except Exception:  # noqa: BLE001 - another run created it meanwhile
                    exp_id = c.get_experiment_by_name(self.experiment).experiment_id
            else:
                exp_id = exp.experiment_id
            self.run_id = c.create_run(exp_id, run_name=self.run.name,
                                       tags={"hpctrain.run_dir": str(self.run.run_dir)}).info.run_id
            save_id(self.run.run_dir, self.name, {"tracking_uri": uri, "run_id": self.run_id})
        # Params cannot change once logged: a restart adds only new keys, a changed value becomes a tag.
        new = params(self.run.config, self.run.plan)
        fresh = [Param(k, v) for k, v in new.items() if k not in logged]
        changed = [RunTag(f"changed_on_restart.{k}"[:250], v) for k, v in new.items() if k in logged and logged[k] != v]
        for i in range(0, len(fresh), 100):  # MLflow takes at most 100 params per batch
            c.log_batch(self.run_id, params=fresh[i:i + 100])
        for i in range(0, len(changed), 100):
            c.log_batch(self.run_id, tags=changed[i:i + 100])
        self._interruptions()
        return f"run {self.run_id} in {uri}" + (
            f" (MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri})" if uri.startswith("file:") else "")

    def _interruptions(self) -> None:
        records = self.run.interruptions()
        if records:
            self.client.set_tag(self.run_id, "interruptions", str(len(records)))
            self.client.log_dict(self.run_id, records, "interruptions.json")

    def log(self, step: int, metrics: dict[str, float], when: float) -> None:
        # optional dependency (mlflow)
        from mlflow.entities import Metric

        ms = int(when * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ms, step) for k, v in metrics.items()])

    def close(self, finished: bool) -> None:
        self._interruptions()
        # KILLED: stopped before train.steps (preempted, failed); a restart sets it RUNNING again.
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


# -------------------------------------------------------------------------------------------- config

def run_info(cfg: Config, run_dir: str | os.PathLike, step: int) -> RunInfo:
    """The run as the trackers see it: never raises (a tracker must not stop training)."""
    run_dir = Path(run_dir)
    try:
        config = to_dict(cfg)
    except Exception:  # noqa: BLE001
        config = {}
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError):
        plan = None
    return RunInfo(run_dir=run_dir, name=str(cfg.run.name), config=config, plan=plan, step=step)


def from_config(cfg: Config, run_dir: str | os.PathLike, step: int = 0) -> list[Tracker]:
    """The trackers cfg.logger enables, not started (MetricsLogger starts them). `step`: the step
    the run starts from (the resumed checkpoint's, 0 for a new run)."""
    lg = cfg.logger
    run = run_info(cfg, run_dir, step)
    out: list[Tracker] = []
    if lg.tensorboard.enabled:
        out.append(TensorBoard(run))
    if lg.wandb.enabled and str(lg.wandb.mode) != "disabled":
        out.append(Wandb(run, lg.wandb.project, lg.wandb.entity, str(lg.wandb.mode), list(lg.wandb.tags)))
    if lg.mlflow.enabled:
        out.append(MLflow(run, lg.mlflow.tracking_uri, lg.mlflow.experiment))
    return out
