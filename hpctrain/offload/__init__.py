"""Optimizer state off the accelerator: host memory (offload=cpu) or per-rank files (offload=nvme).

    cpu.py          HostAdamW: the optimizer (flat state layout, chunked step, checkpoint views)
    store.py        HostStore: the flat state in host memory; the streaming unit; OffloadError
    nvme.py         NvmeStore: per-rank state files streamed through double-buffered host memory
    aio.py          thread-pool asynchronous preadv/pwritev, O_DIRECT-aligned buffers
    adam_kernel.py  the single-pass AdamW kernel (torch.compile; torch's fused AdamW as fallback)
"""
from hpctrain.offload.cpu import HostAdamW, settings
from hpctrain.offload.host_state import OffloadError

__all__ = ["HostAdamW", "OffloadError", "settings"]
