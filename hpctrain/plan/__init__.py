"""The planner: pure arithmetic over a config (no torch), shared by the login node and benchmarks."""
