"""Collective benchmarks (nccl-tests conventions), sweeps of NCCL settings as Slurm job arrays, and
the report that turns a sweep into a verdict (a conf/cluster `env:` snippet).

    python -m hpctrain.bench.collectives --nproc 2 --max-bytes 64M    # one run, here or under srun
    python -m hpctrain.bench.sweep local_gloo --out outputs/sweeps/x   # one job array on Slurm
    python -m hpctrain.report.nccl_report outputs/sweeps/x                   # table, plots, snippet
"""
