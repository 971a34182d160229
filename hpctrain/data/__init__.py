"""Token datasets without torch: synthetic, memory-mapped shards (numpy arrays per sample), weighted
mixtures of shard directories, the shard format and `python -m hpctrain.data.prepare`. The login node
reads shard metadata to check a config; the ranks batch samples into tensors with
hpctrain.train.sampler.

A dataset is indexable (each item seq_len + 1 token ids) with `len`, and says `has_loss_mask`: when
true, `loss_mask(i)` gives item i's mask (1: the token is trained as a target; chat and prompt shards)."""
from __future__ import annotations
from hpctrain.core.schema import Config
from hpctrain.data.synthetic import SyntheticDataset
from hpctrain.data.shards import ShardDataset
from hpctrain.data.mixture import Mixture


def build_dataset(cfg: Config, split: str = "train"):
    """The dataset a config names for `split` ("train" or "val"): indexable, each item `seq_len + 1`
    token ids (input and target), every id below model.vocab_size (shards refuse one that is not)."""
    d = cfg.data
    if d.source == "synthetic":
        return SyntheticDataset(cfg.model.vocab_size, d.seq_len, d.seed, split, eos_id=d.eos_id,
                                doc_len=d.synthetic_doc_len)
    vocab = cfg.model.vocab_size
    if not d.sources:
        return ShardDataset(d.path, d.seq_len, split, vocab)
    return Mixture([ShardDataset(s.path, d.seq_len, split, vocab) for s in d.sources],
                   [float(s.weight) for s in d.sources], d.seed)


def eos_id(cfg: Config) -> int | None:
    """The end-of-document token: data.eos_id, else the shards' (meta.json), else None."""
    d = cfg.data
    if d.eos_id >= 0:
        return d.eos_id
    if d.source == "synthetic":
        return None
    from hpctrain.data.shards import read_meta

    meta = read_meta(d.sources[0].path if d.sources else d.path) or {}
    eos = meta.get("eos_id")
    return int(eos) if isinstance(eos, int) and eos >= 0 else None
