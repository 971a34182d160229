"""The baseline of benchmarks/throughput.py: a hand-written torch DDP training step, nothing of
hpctrain's machinery (no config, mesh, sampler, metrics, preemption or checkpoint manager), on the
same model and the same synthetic data."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.core.schema import ModelConfig
from hpctrain.models.llama import Llama


class PlainDDP:
    def __init__(self, dim, layers, heads, kv_heads, ffn, vocab, seq, batch, micro):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.model = DDP(Llama(ModelConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                                           ffn_dim=ffn, vocab_size=vocab), seq))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        self.perm = np.random.default_rng(0).permutation(vocab)
        self.vocab, self.seq, self.batch, self.micro = vocab, seq, batch, micro

    def sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([1234, i])
        out = np.empty(self.seq + 1, dtype=np.int64)
        out[0] = rng.integers(self.vocab)
        for j in range(self.seq):
            out[j + 1] = self.perm[out[j]]
        return out

    def step(self, step: int) -> float:
        per_rank = self.batch // self.world
        first = step * self.batch + self.rank * per_rank
        rows = torch.from_numpy(np.stack([self.sample(first + i) for i in range(per_rank)]))
        micro = rows.split(self.micro)
        total = torch.zeros(())
        for i, mb in enumerate(micro):
            ctx = self.model.no_sync() if i < len(micro) - 1 else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(self.model(mb[:, :-1]).flatten(0, 1).float(), mb[:, 1:].flatten()) / len(micro)
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total.item()
