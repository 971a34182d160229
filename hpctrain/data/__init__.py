"""Token datasets without torch: synthetic, memory-mapped shards (numpy arrays per sample), the
shard format and `python -m hpctrain.data.prepare`. The login node reads shard metadata to check a
config; the ranks batch samples into tensors with hpctrain.train.sampler."""
from __future__ import annotations


def build_dataset(cfg):
    """The dataset a config names: indexable, each item `seq_len + 1` token ids (input and target)."""
    if cfg.data.source == "synthetic":
        from hpctrain.data.synthetic import SyntheticDataset

        return SyntheticDataset(cfg.model.vocab_size, cfg.data.seq_len, cfg.data.seed)
    from hpctrain.data.shards import ShardDataset

    return ShardDataset(cfg.data.path, cfg.data.seq_len)
