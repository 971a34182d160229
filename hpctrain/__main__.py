"""`python -m hpctrain [overrides...]`: compose -> check -> plan -> launch, on the login node.

Nothing here imports torch: a dry run of a 70B plan finishes in about a second. Every run writes
<run.dir>/plan.json (predicted memory per GPU, step time, tokens/s, MFU); a dry run, or a run refused on
the login node, writes nothing.
"""
from __future__ import annotations

import shlex
import sys


from hpctrain.core import words
from hpctrain.core.compose import ConfigError, to_yaml
from hpctrain.checks.cluster_checks import SLURM_LAUNCHERS, partition_facts
from hpctrain.checks.config_checks import advice, check, compose_checked
from hpctrain.plan import duration
from hpctrain.plan.login import plan_one, write_plan
from hpctrain.plan.verdict import summary as plan_summary
from hpctrain.core.rundir import RunLock, overwrite_problem, own_run_dir, prepare_run_dir, run_dir_override_problem
from hpctrain.core.flops import lora_params, param_counts
from hpctrain.core.spec import engine_spec
from hpctrain.core.schema import Config
from hpctrain.core.reference import groups_help
from hpctrain.launch.multirun import multirun
from hpctrain.launch.sbatch import SCRIPT_NAME, sbatch_script, source_root, write_script
from hpctrain.launch.k8s import launch as write_manifest, preview
from hpctrain.launch.supervise import supervise
from hpctrain.launch.slurm import submit

USAGE = """usage: python -m hpctrain [key=value ...] [group=option ...] [+experiment=NAME] [--cfg] [-h]
       python -m hpctrain -m [key=a,b ...] [group=x,y ...]

Composes conf/ with the overrides, checks the config, plans it (<run.dir>/plan.json), then starts or
submits the run.

most used overrides:
  +experiment=tiny      the embedded default: a tiny Llama on 2 local CPU processes
  +experiment=70b       Llama 3 70B on a Slurm cluster
  train.steps=N run.dir=PATH launcher=local launcher.nproc=N dry_run=true
  parallel.dp_shard=N parallel.dp_replicate=N parallel.tp=N parallel.pp=N parallel.zero=0|1|2|3
  parallel=auto         the fastest layout the planner finds that fits
  checkpoint.every=N checkpoint.keep=N
  --cfg                 print the composed config and exit

sweeps (-m, --multirun): one run per combination of the comma-separated values, each in its own
directory under run.dir; one Slurm job array under launcher=slurm
  python -m hpctrain -m +experiment=tiny optim.lr=1e-3,3e-3

config groups (conf/GROUP/PRESET.yaml; pick one with GROUP=PRESET):
{groups}

other commands:
  python -m hpctrain.report RUN_DIR              report.html and plots of a run, or comparing a sweep's runs
  python -m hpctrain.report.goodput RUN_DIR      how much of a run's wall time went into steps it kept
  python -m hpctrain.plan [overrides ...]        price the layout asked for, then list the fastest that fit
  python -m hpctrain.checkpoint export|list ...  export a checkpoint (a file, or --format hf), list a run's checkpoints
  python -m hpctrain.data.prepare SRC OUT ...    tokenize a corpus into token shards (data.path)
  python -m hpctrain.data.example OUT            a small real corpus and its tokenizer, built here, no download
  python -m hpctrain.bench.sweep ...             NCCL (or any) env settings x node counts as one Slurm job array
  python -m hpctrain.report.nccl_report SWEEP_DIR  a collective sweep's verdict: table, plots, conf/cluster snippet

every key with its type, default, allowed values and meaning: docs/config.md
"""


def whole_run(cfg: Config, the_plan) -> str:
    """How long the run takes, and a warning with the fixes when its Slurm time is too short."""
    d = duration.duration(cfg, the_plan)
    problem = duration.time_limit_problem(cfg, d)
    return duration.describe(d) + (f"\nwarning: {problem}" if problem else "")


def trainable(cfg: Config) -> tuple[int, int]:
    """(trained, frozen) parameters: with LoRA (model.lora.rank > 0) the adapters are trained and every
    weight of the model is frozen; otherwise every weight is trained."""
    total = int(param_counts(cfg.model)["total"])
    if cfg.model.lora.rank > 0:
        return int(lora_params(cfg.model)), total
    return total, 0


def summary(cfg: Config) -> str:
    spec = engine_spec(cfg)
    params, lay = spec.params, spec.layout
    tokens = cfg.train.global_batch * cfg.data.seq_len
    active = param_counts(cfg.model)["active"]
    moe = (f", {words.params(active)} active ({cfg.model.moe.top_k} of {cfg.model.moe.experts} experts a token)"
           if cfg.model.moe.experts else "")
    trained, frozen = trainable(cfg)
    what = f": LoRA rank {cfg.model.lora.rank} adapters" if cfg.model.lora.rank > 0 else ""
    c = cfg.checkpoint
    no_save = ("\nwarning: checkpoint.final=false and checkpoint.every=0: this run saves no checkpoint (but on a "
               "preemption) and ends with nothing to export" if not c.final and c.every <= 0 else "")
    return (f"model {cfg.model.name}: {words.params(params)} parameters ({params:,}){moe}\n"
            f"trainable: {trained:,} parameters ({100 * trained / (trained + frozen):.3g}%{what}), "
            f"frozen: {frozen:,}\n"
            f"layout: {lay.describe()}, zero {cfg.parallel.zero}, {cfg.train.precision}\n"
            + (f"pipeline: {spec.pipeline.describe()}\n" if spec.pipeline and spec.pipeline.blocks else "") +
            f"batch: {cfg.train.global_batch} sequences x {cfg.data.seq_len} tokens = {tokens:,} tokens/step, "
            f"{cfg.train.steps} steps\n"
            f"run dir: {cfg.run.dir}{no_save}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.replace("{groups}", groups_help()))
        return 0
    if any(a in ("-m", "--multirun") for a in argv):
        return multirun([a for a in argv if a not in ("-m", "--multirun")])
    show_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        if show_cfg:
            cfg, refused = compose_checked(overrides)
            if not refused:
                print(to_yaml(cfg), end="")
                return 0
            check(cfg, refused)
        empty = run_dir_override_problem(overrides)
        if empty:
            raise ConfigError(empty)
        cfg, the_plan = plan_one(overrides, show=lambda c: print(summary(c), flush=True))
        print(plan_summary(the_plan), flush=True)
        print(whole_run(cfg, the_plan), flush=True)
        for line in advice(cfg):  # the run can start; it probably does not do what was meant
            print(f"warning: {line}", flush=True)
        if cfg.dry_run:  # writes nothing, not even plan.json: run.dir may hold another run's
            if cfg.launcher.name == "sbatch":  # show the script; write nothing (no run dir on a dry run)
                print(f"--- {cfg.run.dir}/{SCRIPT_NAME} (not written) ---")
                print(sbatch_script(cfg, cfg.run.dir, sys.executable, source_root()), end="")
                print("---")
            if cfg.launcher.name == "k8s":  # the manifest, checked against the Kubernetes models; nothing written
                print(preview(cfg), end="")
            if cfg.launcher.name in SLURM_LAUNCHERS and partition_facts() is None:
                print("dry run: skipped the partition check a submission makes (no Slurm answers sinfo here): "
                      "cluster.partition, nodes, GPUs and CPUs per node, and the partition's time limit")
            print("dry run: nothing started, nothing written (python -m hpctrain.plan <overrides> --json PATH "
                  "writes the plan)")
            return 0
        problem = overwrite_problem(cfg.run.dir, cfg.checkpoint.resume)
        if problem:
            raise ConfigError(problem)
        # Refused here, before anything is written, while another start of the run holds its directory.
        lock = RunLock.take(own_run_dir(cfg.run.dir))
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    try:
        run_dir = prepare_run_dir(cfg)
        print(f"plan: {write_plan(the_plan, run_dir)}", flush=True)
        return launch(cfg, run_dir, lock)
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    finally:
        lock.release()


def launch(cfg: Config, run_dir, lock: RunLock) -> int:
    """Start (local: this process drives the ranks, holding `lock` to the end) or submit (Slurm: the
    job's supervisor takes the lock itself) one prepared run directory."""
    if cfg.launcher.name == "local":
        return supervise(run_dir, lock)
    if cfg.launcher.name == "sbatch":
        path = write_script(cfg, str(run_dir), sys.executable, source_root())
        how = f"bash {shlex.quote(str(path))}" if path.suffix == ".sh" else f"sbatch {shlex.quote(str(path))}"
        print(f"wrote {path}\nsubmit it with:\n  {how}\nits log: {run_dir}/logs/slurm-<jobid>.out")
        return 0
    if cfg.launcher.name == "slurm":
        lock.release()  # before the job can start and take it
        return submit(cfg, run_dir, sys.executable, source_root())
    if cfg.launcher.name == "k8s":
        return write_manifest(cfg, str(run_dir))
    raise AssertionError(f"launcher {cfg.launcher.name}: the schema admits no other")


def entry() -> int:
    try:
        return main()
    except KeyboardInterrupt:  # Ctrl-C before the ranks started (composing, planning): nothing to record
        print("hpctrain: stopped (Ctrl-C) before the run started", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(entry())
