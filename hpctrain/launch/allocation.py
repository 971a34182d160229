"""What a job asks Slurm for, from the cluster config: one mapping, as sbatch long options, shared by
the batch script (launcher=sbatch), the submitit launcher (launcher=slurm) and the collective sweeps.

`allocation(cluster, ...)` is pure: an ordered {option: value} mapping (value True = a bare flag),
the options named as `sbatch --help` names them. `sbatch_lines` writes it as `#SBATCH` lines;
`submitit_parameters` hands it to submitit's SlurmExecutor.
"""
from __future__ import annotations

import shlex
from typing import Any, Optional

from hpctrain.core.spec import ranks_per_node
from hpctrain.core.schema import ClusterConfig
from hpctrain.checks.cluster_checks import minutes

# cluster.<key> -> the sbatch option of the same name, where set.
OPTIONAL = ("mem", "time", "partition", "account", "qos", "constraint", "exclude")
# sbatch options submitit has parameters of its own for (it writes them itself); the rest go to its
# additional_parameters.
SUBMITIT_NATIVE = ("job-name", "nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "time", "mem",
                   "partition", "account", "qos", "constraint", "exclude")


def extra_options(extra: Any) -> dict[str, Any]:
    """cluster.sbatch_extra as sbatch long options: `mail_type` -> `mail-type`; True -> a bare flag,
    False/None -> left out."""
    out: dict[str, Any] = {}
    for key, value in dict(extra or {}).items():
        name = str(key).lstrip("-").replace("_", "-")
        if value is None or value is False:
            continue
        out[name] = value
    return out


def allocated_nodes(cluster: ClusterConfig) -> int:
    """Nodes the run's job asks Slurm for: those its ranks run on and the idle spares (a negative
    cluster.spare_nodes is refused by the config checks)."""
    return cluster.nodes + max(0, cluster.spare_nodes)


def allocation(cluster: ClusterConfig, job_name: str, nodes: Optional[int] = None, tasks_per_node: Optional[int] = None,
               more: Optional[dict] = None) -> dict[str, Any]:
    """The allocation for `nodes` (default the run's: cluster.nodes + cluster.spare_nodes) x
    `tasks_per_node` (default one per GPU, else cluster.tasks_per_node), with the cluster's partition,
    account and limits, then the launcher's own options `more`, then cluster.sbatch_extra (which may
    override any of them). Spares are in the allocation only: the supervisor starts ranks on the first
    cluster.nodes nodes, and the world is counted from cluster.nodes (hpctrain.core.spec.world_size)."""
    c = cluster
    d: dict[str, Any] = {"job-name": job_name, "nodes": nodes or allocated_nodes(c),
                         "ntasks-per-node": tasks_per_node or ranks_per_node(c)}
    if c.gpus_per_node > 0:
        d["gpus-per-node"] = c.gpus_per_node
    d["cpus-per-task"] = c.cpus_per_task
    for key in OPTIONAL:
        if getattr(c, key) is not None:
            d[key] = getattr(c, key)
    d.update(more or {})
    d.update(extra_options(c.sbatch_extra))
    return d


def sbatch_line(name: str, value: Any) -> str:
    """One `#SBATCH` line. sbatch's own parser reads these (not the shell): it takes shell-like
    quotes and reads a backslash as an escape even inside single quotes, so a value is written as
    shlex.quote() of it with backslashes doubled (checked against sbatch 22.05)."""
    if value is True:
        return f"#SBATCH --{name}"
    return f"#SBATCH --{name}={shlex.quote(str(value).replace(chr(92), chr(92) * 2))}"


def sbatch_lines(options: dict[str, Any]) -> list[str]:
    return [sbatch_line(k, v) for k, v in options.items()]


def submitit_value(value: Any) -> Any:
    # submitit writes `#SBATCH --key=<shlex.quote(value)>`; sbatch's parser reads a backslash as an
    # escape even inside quotes, so one must be doubled to arrive.
    return value if isinstance(value, (bool, int)) else str(value).replace("\\", "\\\\")


def submitit_parameters(options: dict[str, Any], own_srun: bool = False) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(**this) for sbatch `options`. With `own_srun` the job's one
    batch process starts its own srun steps: submitit, which counts tasks from nodes x
    ntasks_per_node and waits for a result from each, is told of one task, and the allocation's shape
    goes to sbatch as additional parameters."""
    params: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    shape = ("nodes", "ntasks-per-node") if own_srun else ()
    for name, value in options.items():
        # Keys as submitit spells them (its own parameters with underscores, the rest as sbatch
        # does), so that an additional parameter replaces, rather than repeats, one it writes itself.
        key = name.replace("-", "_") if name in SUBMITIT_NATIVE else name
        if name in SUBMITIT_NATIVE and name not in shape:
            params[key] = minutes(value) if name == "time" else submitit_value(value)
        else:
            extra[key] = value if value is True else submitit_value(value)
    if own_srun:
        params.update(nodes=1, ntasks_per_node=1, use_srun=False)
    params["additional_parameters"] = extra
    return params
