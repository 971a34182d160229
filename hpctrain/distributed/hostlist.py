"""Slurm hostlists (`n[001-004,010],gpu-a[1-2]`) expanded as `scontrol show hostnames` does.

Our own small parser: python-hostlist is GPL-2.0, and scontrol needs a readable slurm.conf.
"""
from __future__ import annotations

import re


def expand(hostlist: str) -> list[str]:
    """Every host name of a hostlist, in order, duplicates kept (as scontrol prints them)."""
    hosts: list[str] = []
    for item in _split_top(hostlist.strip()):
        hosts.extend(_expand_item(item))
    return hosts


def first(hostlist: str) -> str:
    hosts = expand(hostlist)
    if not hosts:
        raise ValueError(f"empty hostlist {hostlist!r}")
    return hosts[0]


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {s!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {s!r}")
    out.append("".join(cur))
    return [x for x in (o.strip() for o in out) if x]


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _expand_item(item: str) -> list[str]:
    m = _BRACKET.search(item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            if not part.isdigit():
                raise ValueError(f"bad number {part!r} in hostlist item {item!r}")
            values = [part]
        for v in values:
            # A suffix may hold further brackets: expand them recursively (n[1-2]-ib[0-1]).
            out.extend(_expand_item(prefix + v + suffix))
    return out
