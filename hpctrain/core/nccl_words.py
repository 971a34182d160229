"""The words of the collective benchmark, its sweeps and their report: the operations by name and
message sizes as nccl-tests writes them. One place, so the benchmark (hpctrain.bench) and the report
(hpctrain.report.nccl_report) read and print them alike; no torch, so the report runs on the login node
without importing the benchmark."""
from __future__ import annotations

import re

# The operations, in the order the benchmark runs them and the report lists them.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'8', '64K', '64KiB', '1M', '1G', '1.5GB' -> bytes; K/M/G/T are powers of 1024 (nccl-tests' -b/-e)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 8, 64K, 32M, 1G")
    scale = 1024 ** ("kmgt".index(m.group(2).lower()) + 1) if m.group(2) else 1
    return int(float(m.group(1)) * scale)


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes}B"
