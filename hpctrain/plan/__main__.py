"""`python -m hpctrain.plan [overrides...] [--top N] [--json PATH] [--png PATH] [--calibrate]`

Composes the config as `python -m hpctrain` does, prices the layout it asks for, then searches every
layout of the same model, batch and cluster and prints the fastest that fit. No torch: seconds.
Its calibration against published training runs lives beside the package, in a checkout:
`python benchmarks/calibration [--fit [--write]] [--png PATH]`.
"""
from __future__ import annotations

import json
import sys

from hpctrain.checks.cluster_checks import partition_check
from hpctrain.checks.config_checks import document_problems, problems, range_problems
from hpctrain.core import outdir
from hpctrain.core.compose import ConfigError, compose
from hpctrain.core.spec import world_size
from hpctrain.plan import verdict as report
from hpctrain.plan.login import world_rule
from hpctrain.plan.memory import cluster_of, job_of
from hpctrain.plan.search import Space, search

USAGE = __doc__ + """
  +experiment=70b cluster=h100 cluster.nodes=8    what to plan (any hpctrain override); a cluster with GPUs is
                 planned whole (nodes x gpus_per_node, as launcher=sbatch runs it) unless the command
                 line names a launcher (launcher=local launcher.nproc=N: N ranks on one machine)
  --top N        rows of the ranked table (10)
  --json PATH    write plan.json for the requested layout and the best one
  --png PATH     the requested layout and the best few: device memory by kind, and tokens/s
  --calibrate    print predicted vs published TFLOP/s for Megatron-LM's H100 table and exit
"""


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    opts, rest, it = {"top": "10"}, [], iter(argv)
    for a in it:
        if a in ("--top", "--json", "--png"):
            opts[a[2:]] = next(it, "")
        elif a.startswith(("--top=", "--json=", "--png=")):
            k, _, v = a[2:].partition("=")
            opts[k] = v
        elif a == "--calibrate":
            opts[a[2:]] = True
        else:
            rest.append(a)
    opts["top"] = int(opts["top"])
    return opts, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        opts, overrides = _options(argv)
        if opts.get("calibrate"):
            print(report.calibration_table(report.calibration(cluster_of(compose(["cluster=h100"] + overrides)))))
            return 0
        cfg, note = request_of(overrides)
        refuse_outputs(opts.get("png"), opts.get("json"))
        # the documents the mask is priced by: refused as a run and a dry run refuse them, whatever the layout
        # and the float keys the planner divides by, out of range (a zero peak_tflops)
        refused = document_problems(cfg) + range_problems(cfg)
        if refused:
            raise ConfigError("this config cannot run:\n" + "\n".join(f"  - {p}" for p in refused))
    except (ConfigError, ValueError) as e:
        print(f"hpctrain.plan: error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note + "\n")
    request, world = job_of(cfg), world_size(cfg)
    asked, found = requested(cfg, request)
    if asked:
        print("requested layout:\n" + report.summary(asked) + "\n")
    else:  # the mesh does not even cover the ranks: nothing to price
        print("requested layout cannot run:\n" + "\n".join(f"  - {p}" for p in found) + "\n")
    space = Space()
    print(f"searching {world} ranks, ZeRO stages {', '.join(map(str, space.zeros))}:")
    res = search(request, space, world=world)
    print(report.explain(res, top=opts["top"], request=request if asked else None))
    if opts.get("json"):
        doc = {"written_by": report.TOOL, "requested": report.plan_dict(asked) if asked else None,
               "best": report.plan_dict(report.plan(res.ranked[0].job)) if res.ranked else None}
        with open(opts["json"], "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {opts['json']}")
    if opts.get("png"):
        plans = [("requested", asked)] if asked else []
        plans += [(f"#{i}", report.plan(c.job)) for i, c in enumerate(res.ranked[:4], 1)]
        if plans:
            print(f"wrote {report.save_plan_png(plans, opts['png'])}")
    return 0 if res.ranked else 1


def request_of(overrides: list[str]):
    """(config, note): composed as `python -m hpctrain` composes it, its world sized by login.world_rule
    (a cluster with GPUs, the launcher left at local: the cluster's GPUs); the note says so."""
    cfg = compose(overrides)
    more, note = world_rule(cfg, overrides, planner=True)
    return (compose([*overrides, *more]) if more else cfg), note


def requested(cfg, job):
    """(the requested layout's plan, or None where its mesh does not cover the ranks; every problem the
    login-node checks find). The plan's problems are those of the checks, then its own; those of the
    live Slurm's partition check are marked (Plan.partition: no layout changes them)."""
    found = problems(cfg)
    if job.spec.layout.world != world_size(cfg):
        return None, found
    asked = report.plan(job)
    asked.problems = found + [p for p in asked.problems if p not in found]
    asked.partition = [p for p in partition_check(cfg) if p in found] if found else []
    return asked, found


def refuse_outputs(*paths) -> None:
    """Before any work: the files named for the output must be new, or this tool's own earlier ones."""
    for path in paths:
        problem = path and outdir.file_problem(path, report.TOOL)
        if problem:
            raise ValueError(problem)


if __name__ == "__main__":
    sys.exit(main())
