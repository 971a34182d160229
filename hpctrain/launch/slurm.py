"""launcher=slurm: submit the run through submitit's SlurmExecutor and return; do not wait.

`executor_parameters(cfg, ...)` is pure and maps conf/cluster/*.yaml onto SlurmExecutor's
parameters: the same allocation launcher=sbatch writes (`hpctrain.launch.allocation`), USR2 to every
task `signal_lead_s` before the limit, `--requeue`, `--no-kill`, `--open-mode=append`. The job runs
`run_task` once, in its batch script: the run's supervisor (hpctrain.launch.supervise), which starts
one rank per task with srun (torch.distributed comes up from srun's variables in
hpctrain.distributed.bootstrap, not submitit's TorchDistributedEnvironment, which refuses variables that
are already set), restarts them after a failure and requeues the job after a preemption save. Nothing
here waits for or watches the job.

submitit writes its files to <run_dir>/submitit: the batch script, the pickled call, the
supervisor's log (`<jobid>_0_log.out`) and its result; each rank logs to <run_dir>/logs/rank-N.log.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hpctrain.launch import chain
from hpctrain.launch.allocation import allocation, submitit_parameters
from hpctrain.launch.sbatch import array_setup, task_block
from hpctrain.core.spec import ranks_per_node
from hpctrain.core.schema import Config
from hpctrain.launch.supervise import supervise

FOLDER = "submitit"


def executor_parameters(cfg: Config, pythonpath: Optional[str] = None,
                        array_cfgs: Optional[list[Config]] = None) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(**this) for the run; pure. The allocation is launcher=sbatch's
    (hpctrain.launch.allocation); submitit writes the USR2 signal itself from signal_delay_s. With
    `array_cfgs` (a sweep's elements, one array task each) task i gets array_cfgs[i]'s cluster.setup
    and cluster.env: submitit writes one batch script for the whole array, so where the elements differ
    its setup is a `case` on SLURM_ARRAY_TASK_ID (hpctrain.launch.sbatch.per_task)."""
    c = cfg.cluster
    options = allocation(c, cfg.run.name, more={"requeue": True, "no-kill": True, "open-mode": "append"})
    # One process in the batch script, the supervisor, which starts the ranks with srun itself.
    p = submitit_parameters(options, own_srun=True)
    p.update(signal_delay_s=c.signal_lead_s,  # submitit writes --signal=USR2@<this>, no B:
             stderr_to_stdout=True)
    # submitit's script runs without `set -u`: setup needs no `set +u` around it
    setup = (array_setup(array_cfgs, pythonpath, strict=False) if array_cfgs else None) \
        or task_block(cfg, pythonpath, strict=False)
    if setup:
        p["setup"] = setup
    return p


def run_task(run_dir: str) -> int:
    """What the job runs (submitit pickles a reference to this function): the run's supervisor."""
    rc = supervise(run_dir)
    if rc != 0:
        raise RuntimeError(f"the supervisor of {run_dir} ended with code {rc}; see the log above and "
                           f"{run_dir}/logs/rank-*.log")
    return rc


def _drop_stale(folder: Path, job_id: str, before: float) -> None:
    """Files of an older job with the same id (Slurm's ids restart at 1 when its state is wiped):
    submitit would return their results for this job, and the logs would be appended to."""
    for f in folder.glob(f"{job_id}_*"):
        try:
            if f.stat().st_mtime < before:
                f.unlink()
        except OSError:
            pass


def _submit_chain(executor, params: dict, links: int, submit_link) -> list[list]:
    """Submit `links` links, each after the previous one (afterany); `submit_link()` submits one link
    and returns its jobs. Returns the jobs of every link."""
    out, previous = [], None
    for _ in range(links):
        extra = {**params.get("additional_parameters", {}), **chain.dependency(previous)}
        executor.update_parameters(**{**params, "additional_parameters": extra})
        jobs = submit_link()
        out.append(jobs)
        previous = jobs[0].job_id.split("_")[0]  # an array link: its array job id
    return out


def _refused(e: Exception) -> int:
    # sbatch's refusal arrives as CalledProcessError or submitit's FailedJobError
    out = getattr(e, "stderr", None) or getattr(e, "output", None) or ""
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    print(f"hpctrain: error: the job was not submitted: {e}{(': ' + out.strip()) if out else ''}", file=sys.stderr)
    return 1


def submit(cfg: Config, run_dir: str | os.PathLike, python: Optional[str] = None,
           pythonpath: Optional[str] = None) -> int:
    """Submit (launcher.chain jobs, each after the previous); print the job ids, the run directory and
    how to follow the log. Returns an exit code."""
    # heavy: submitit (~0.15 s); python -m hpctrain imports this module even for dry runs
    import submitit

    run_dir = Path(run_dir)
    folder = run_dir / FOLDER
    executor = submitit.SlurmExecutor(folder=folder, python=python or sys.executable)
    started = time.time() - 1
    try:
        links = _submit_chain(executor, executor_parameters(cfg, pythonpath), cfg.launcher.chain,
                              lambda: [executor.submit(run_task, str(run_dir))])
    except Exception as e:
        return _refused(e)
    ids = [jobs[0].job_id for jobs in links]
    for job_id in ids:
        _drop_stale(folder, job_id, started)
    if len(ids) > 1:
        chain.write_chain(run_dir, ids)
    log = folder / f"{ids[0]}_0_log.out"
    what = f"job {ids[0]}" if len(ids) == 1 else f"a chain of {len(ids)} jobs ({', '.join(ids)}), each after the previous"
    print(f"submitted {what} ({cfg.cluster.nodes} node(s) x {ranks_per_node(cfg.cluster)} task(s))\n"
          f"run dir: {run_dir}\n"
          f"supervisor:    tail -f {shlex.quote(str(log))}\n"
          f"follow rank 0: tail -f {shlex.quote(str(run_dir / 'logs' / 'rank-0.log'))}\n"
          f"state:         squeue -j {','.join(ids)}; sacct -j {','.join(ids)}")
    return 0


def submit_array(base: Config, sweep_dir: str | os.PathLike, cfgs: list[Config], run_dirs: list[str],
                 python: Optional[str] = None, pythonpath: Optional[str] = None) -> int:
    """A sweep as one job array (one task per run directory; all share cfgs[0]'s allocation, which
    the caller checked), launcher.chain times, each array after the previous."""
    import submitit

    sweep_dir = Path(sweep_dir)
    executor = submitit.SlurmExecutor(folder=sweep_dir / FOLDER, python=python or sys.executable)
    params = executor_parameters(cfgs[0], pythonpath, array_cfgs=cfgs)
    params["job_name"] = str(base.run.name)
    params["array_parallelism"] = base.launcher.array_parallelism or len(run_dirs)  # submitit's default is 256

    def one_array():
        with executor.batch():
            return [executor.submit(run_task, d) for d in run_dirs]

    try:
        links = _submit_chain(executor, params, base.launcher.chain, one_array)
    except Exception as e:
        return _refused(e)
    if len(links) > 1:
        for i, d in enumerate(run_dirs):
            chain.write_chain(d, [jobs[i].job_id for jobs in links])
    arrays = [jobs[0].job_id.split("_")[0] for jobs in links]
    bound = f", at most {base.launcher.array_parallelism} at once" if base.launcher.array_parallelism > 0 else ""
    print(f"submitted job array {', '.join(arrays)}: {len(run_dirs)} task(s){bound}\n"
          f"sweep dir: {sweep_dir}\n"
          f"state:     squeue -j {','.join(arrays)}; sacct -j {','.join(arrays)}\n"
          f"compare:   python -m hpctrain.report {shlex.quote(str(sweep_dir))}")
    return 0
