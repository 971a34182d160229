"""Stragglers: at every logged step all ranks share their step time (one all-gather of a float), the
spread goes into metrics.jsonl, and a rank that is the slowest, `ratio` x slower than the median
rank, for `steps` logged steps in a row is named in a warning with its host: one slow GPU, NIC or
node slows every rank down at each collective.

A rank's step time runs from the end of the previous step's closing collective (where all ranks
leave together) until its own step is done, so what it does after the step's last collective
(clipping, the optimizer step) or between steps shows in it; time spent inside the step waiting for
a slower peer shows in every rank's time alike and cannot single one out."""
from __future__ import annotations

import socket
import statistics
from typing import Optional

import torch
import torch.distributed as dist


class Stragglers:
    def __init__(self, ratio: float, steps: int):
        self.ratio, self.steps = ratio, max(1, steps)
        self.hosts: Optional[list] = None
        self.streak: dict[int, int] = {}
        self.warned: set[int] = set()
        self.last: Optional[tuple] = None  # (rank, its time / median) of the latest observation

    def observe(self, step_time: float) -> dict:
        """Every rank calls this at the same steps; returns the spread (on every rank)."""
        world = dist.get_world_size()
        if self.hosts is None:
            self.hosts = [None] * world
            dist.all_gather_object(self.hosts, socket.gethostname())
        mine = torch.tensor([step_time], dtype=torch.float64)
        every = torch.empty(world, dtype=torch.float64)
        # all_gather_single is torch 2.13's name; the GPU image may carry an older torch.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine)
        times = every.tolist()
        return self.judge(times)

    def judge(self, times: list) -> dict:
        # The lower median: with two ranks the median would be their mean, which the straggler itself
        # drags up.
        med = statistics.median_low(times)
        slowest = max(range(len(times)), key=times.__getitem__)
        ratio = times[slowest] / med if med > 0 else 1.0
        if ratio > self.ratio:
            self.streak = {slowest: self.streak.get(slowest, 0) + 1}
        else:
            self.streak = {}
        self.last = (slowest, ratio)
        return {"step_time_min": min(times), "step_time_median": med, "step_time_max": times[slowest],
                "slowest_rank": slowest}

    def warning(self) -> Optional[str]:
        """A message the first time a rank has been the straggler for `steps` logged steps in a row."""
        for rank, n in self.streak.items():
            if n >= self.steps and rank not in self.warned:
                self.warned.add(rank)
                host = self.hosts[rank] if self.hosts else "?"
                return (f"rank {rank} on {host} is a straggler: its steps took {self.last[1]:.1f}x the median "
                        f"rank's for {n} logged steps in a row (launcher.straggler_ratio={self.ratio}); "
                        f"every rank waits for it at each collective. Check that node")
        return None
