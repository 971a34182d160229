"""Parallelism as small functions applied to a model that knows nothing of it (torchtitan-style)."""
from hpctrain.parallel.apply import parallelize

__all__ = ["parallelize"]
