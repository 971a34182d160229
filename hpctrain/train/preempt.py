"""Collective preemption: a signal only sets a flag; the ranks agree at a step boundary.

Slurm delivers USR2 (time limit or preemption, `--signal=USR2@<lead>`) and SIGTERM; people press
Ctrl-C. Saving inside a signal handler would race the collectives of the step in flight, so every
rank just notes the request, and at the next step boundary one all-reduce (MAX) tells all ranks
whether any was asked: then they save together and stop. A second Ctrl-C aborts at once.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


class Preemption:
    def __init__(self):
        self.requested_by: str | None = None
        self._previous = {}

    def install(self) -> "Preemption":
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.requested_by == "SIGINT":
            raise KeyboardInterrupt
        self.requested_by = self.requested_by or signal.Signals(signum).name

    def agreed(self, device=None, group=None) -> bool:
        """True on every rank if any rank was signalled. A collective: all ranks must call it."""
        # torch: hpctrain.run imports this module before torch, to catch signals during that import
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.requested_by else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
