"""The planner's calibration against published training runs: the tables (published.csv,
published_moe.csv; sources in docs/published_runs.md), the fit of each GPU kind's two efficiencies
(fit.py) and the picture (published_plot.py). Research code beside the product: hpctrain imports none of
it (tests/test_structure.py), and the shipped planner reads only what the fit writes, the
matmul_efficiency and attention_efficiency of conf/cluster/<kind>.yaml.

    python benchmarks/calibration [--fit [--write]] [--png PATH]
"""
