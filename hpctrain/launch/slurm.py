"""launcher=slurm: submit the run through submitit's SlurmExecutor and return; do not wait.

`executor_parameters(cfg, ...)` is pure and maps conf/cluster/*.yaml onto SlurmExecutor's
parameters: the same allocation launcher=sbatch writes (`hpctrain.launch.allocation`), USR2 to every
task `signal_lead_s` before the limit, `--requeue`, `--no-kill`, `--open-mode=append`. The job runs
`run_task` once, in its batch script: the run's supervisor (hpctrain.launch.supervise), which starts
one rank per task with srun (torch.distributed comes up from srun's variables in
hpctrain.dist.bootstrap, not submitit's TorchDistributedEnvironment, which refuses variables that
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

from hpctrain.launch.allocation import allocation, submitit_parameters
from hpctrain.launch.sbatch import exports
from hpctrain.spec import ranks_per_node

FOLDER = "submitit"


def executor_parameters(cfg: Any, pythonpath: Optional[str] = None) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(**this) for the run; pure. The allocation is launcher=sbatch's
    (hpctrain.launch.allocation); submitit writes the USR2 signal itself from signal_delay_s."""
    c = cfg.cluster
    options = allocation(c, cfg.run.name, more={"requeue": True, "no-kill": True, "open-mode": "append"})
    # One process in the batch script, the supervisor, which starts the ranks with srun itself.
    p = submitit_parameters(options, own_srun=True)
    p.update(signal_delay_s=c.signal_lead_s,  # submitit writes --signal=USR2@<this>, no B:
             stderr_to_stdout=True)
    setup = [str(s) for s in (c.setup or [])] + exports(cfg, pythonpath)
    if setup:
        p["setup"] = setup
    return p


def run_task(run_dir: str) -> int:
    """What the job runs (submitit pickles a reference to this function): the run's supervisor."""
    from hpctrain.launch.supervise import supervise

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


def submit(cfg: Any, run_dir: str | os.PathLike, python: Optional[str] = None,
           pythonpath: Optional[str] = None) -> int:
    """Submit; print the job id, the run directory and how to follow the log. Returns an exit code."""
    import submitit

    run_dir = Path(run_dir)
    folder = run_dir / FOLDER
    executor = submitit.SlurmExecutor(folder=folder, python=python or sys.executable)
    executor.update_parameters(**executor_parameters(cfg, pythonpath))
    started = time.time() - 1
    try:
        job = executor.submit(run_task, str(run_dir))
    except Exception as e:  # sbatch's refusal arrives as CalledProcessError or submitit's FailedJobError
        out = getattr(e, "stderr", None) or getattr(e, "output", None) or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        print(f"hpctrain: error: the job was not submitted: {e}{(': ' + out.strip()) if out else ''}",
              file=sys.stderr)
        return 1
    _drop_stale(folder, job.job_id, started)
    log = folder / f"{job.job_id}_0_log.out"
    print(f"submitted job {job.job_id} ({cfg.cluster.nodes} node(s) x {ranks_per_node(cfg.cluster)} task(s))\n"
          f"run dir: {run_dir}\n"
          f"supervisor:    tail -f {shlex.quote(str(log))}\n"
          f"follow rank 0: tail -f {shlex.quote(str(run_dir / 'logs' / 'rank-0.log'))}\n"
          f"state:         squeue -j {job.job_id}; sacct -j {job.job_id}")
    return 0
