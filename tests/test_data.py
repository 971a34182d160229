"""Datasets (synthetic, byte shards), the shard format, and the resumable sampler. Tokenized corpora,
validation splits and mixtures: tests/test_corpus.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.data.prepare import prepare
from hpctrain.train.sampler import StepSampler
from hpctrain.data.shards import META, ShardDataset, read_meta
from hpctrain.data.synthetic import SyntheticDataset

REPO = Path(__file__).resolve().parent.parent


# --- synthetic ----------------------------------------------------------------------------------


def test_synthetic_deterministic_by_index():
    a, b = SyntheticDataset(256, 32, seed=5), SyntheticDataset(256, 32, seed=5)
    for i in (0, 1, 7, 10**12, 2**61):
        assert np.array_equal(a[i], b[i])
    # Order of access does not matter.
    first = [a[i].copy() for i in range(5)]
    assert all(np.array_equal(a[i], first[i]) for i in reversed(range(5)))
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], SyntheticDataset(256, 32, seed=6)[0])


def test_synthetic_follows_hidden_rule():
    ds = SyntheticDataset(64, 20, seed=3)
    assert sorted(ds.perm.tolist()) == list(range(64))
    starts = set()
    for i in range(50):
        x = ds[i]
        assert x.shape == (21,) and x.dtype == np.int64
        assert ((0 <= x) & (x < 64)).all()
        assert np.array_equal(x[1:], ds.perm[x[:-1]])
        starts.add(int(x[0]))
    assert len(starts) > 10  # random starting tokens


# --- prepare + shards ---------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {
        "a.txt": "alpha " * 40,
        "b.py": "print('beta')\n" * 30,
        "sub/c.md": "# gamma\x00 with a NUL\n" * 20,
        "sub/d.rst": "delta\n" * 50,
    }
    for name, text in texts.items():
        (src / name).write_text(text)
    (src / "ignored.bin").write_bytes(b"\x01\x02" * 100)
    return src, texts


def expected_stream(texts) -> bytes:
    # Files in sorted path order, NUL bytes removed, each followed by the separator 0.
    return b"".join(texts[k].encode().replace(b"\0", b"") + b"\0" for k in sorted(texts, key=lambda k: Path(k)))


def test_prepare_writes_meta_and_shards(corpus, tmp_path):
    src, texts = corpus
    out = tmp_path / "out"
    meta = prepare(src, out, shard_bytes=200, val_fraction=0)
    stream = expected_stream(texts)
    on_disk = json.loads((out / META).read_text())
    assert on_disk == meta == read_meta(out)
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint8" and meta["eos_id"] == 0
    assert meta["files"] == 4 and meta["documents"] == 4 and list(meta["splits"]) == ["train"]
    train = meta["splits"]["train"]
    assert train["tokens"] == len(stream) and len(train["shards"]) >= 2
    data = b"".join((out / s["file"]).read_bytes() for s in train["shards"])
    assert data == stream
    for s in train["shards"]:
        assert (out / s["file"]).stat().st_size == s["tokens"]
    assert not list(out.glob("*.tmp"))


def test_shard_windows(corpus, tmp_path):
    src, _ = corpus
    out = tmp_path / "out"
    meta = prepare(src, out, shard_bytes=150, val_fraction=0)
    shards = [np.frombuffer((out / s["file"]).read_bytes(), dtype=np.uint8) for s in meta["splits"]["train"]["shards"]]
    assert len(shards) >= 3
    L = 16
    ds = ShardDataset(out, L)
    assert ds.vocab_size == 256
    assert len(ds) == sum((len(s) - 1) // L for s in shards)
    # Windows in order: within a shard consecutive windows overlap by exactly one token;
    # none crosses into the next shard.
    i = 0
    for shard in shards:
        for j in range((len(shard) - 1) // L):
            w = ds[i]
            assert w.shape == (L + 1,) and w.dtype == np.int64
            assert np.array_equal(w, shard[j * L: j * L + L + 1])
            if j > 0:
                assert ds[i - 1][-1] == w[0]
            i += 1
    assert i == len(ds)
    for bad in (-1, len(ds)):
        with pytest.raises(IndexError):
            ds[bad]


def test_shards_too_short_for_seq_len(corpus, tmp_path):
    src, _ = corpus
    prepare(src, tmp_path / "out", val_fraction=0)
    with pytest.raises(ValueError, match="seq_len"):
        ShardDataset(tmp_path / "out", 10_000)
    with pytest.raises(ValueError, match="no val split.*--val-fraction"):
        ShardDataset(tmp_path / "out", 16, "val")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        ShardDataset(tmp_path, 16)


def test_directories_from_before_splits_read_as_train(tmp_path):
    # meta.json as prepare wrote it before validation splits: one "shards" list.
    (tmp_path / "shard-00000.bin").write_bytes(bytes(range(40)))
    (tmp_path / META).write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8",
                                             "separator": 0, "total_tokens": 40,
                                             "shards": [{"file": "shard-00000.bin", "tokens": 40}]}))
    ds = ShardDataset(tmp_path, 8)
    assert len(ds) == 4 and ds[1].tolist() == list(range(8, 17))


def _prepare_cli(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.data.prepare", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_prepare_cli_missing_dir(tmp_path):
    proc = _prepare_cli(tmp_path / "nope", tmp_path / "out")
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_prepare_cli_no_matching_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.bin").write_bytes(b"abc")
    proc = _prepare_cli(tmp_path / "src", tmp_path / "out")
    assert proc.returncode != 0
    assert "no files ending in" in proc.stderr and "--ext" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_prepare_cli_ok(corpus, tmp_path):
    src, texts = corpus
    proc = _prepare_cli(src, tmp_path / "out", "--ext", ".txt,.md", "--val-fraction", "0", "--workers", "0")
    assert proc.returncode == 0, proc.stderr
    assert "data=shards data.path=" in proc.stdout and "model.vocab_size=256" in proc.stdout
    assert read_meta(tmp_path / "out")["files"] == 2


# --- sampler ------------------------------------------------------------------------------------


class IndexDataset:
    """Sample i is seq_len + 1 copies of i: the sampler's choices can be read back from the batch."""

    has_loss_mask = False  # the dataset protocol (hpctrain.data): every token trained

    def __init__(self, n: int, seq_len: int = 3):
        self.n, self.seq_len = n, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return np.full(self.seq_len + 1, i, dtype=np.int64)


def step_indices(micro) -> list[int]:
    """The sample indices of one rank's step, in order."""
    out = []
    for x, y in micro:
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        out += x[:, 0].tolist()
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_dp2_union_equals_dp1(shuffle):
    ds = IndexDataset(40)
    one = StepSampler(ds, 8, 2, 0, 1, seed=3, shuffle=shuffle)
    two = [StepSampler(ds, 8, 2, r, 2, seed=3, shuffle=shuffle) for r in range(2)]
    for _ in range(12):  # crosses epoch boundaries (40 is not a multiple of 8 x steps)
        ref = step_indices(one.next_step())
        parts = [s.next_step() for s in two]
        assert all(len(p) == 2 and all(x.shape == (2, 3) for x, _ in p) for p in parts)  # 4 per rank, micro 2
        assert step_indices(parts[0]) + step_indices(parts[1]) == ref


def test_micro_batches_and_shapes():
    ds = SyntheticDataset(32, 8, seed=0)
    s = StepSampler(ds, 16, 4, 1, 2, seed=0)
    micro = s.next_step()
    assert len(micro) == 2
    for x, y in micro:
        assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert s.position == 16


def test_state_dict_restores_stream():
    ds = IndexDataset(30)
    a = StepSampler(ds, 6, 3, 0, 1, seed=11)
    for _ in range(4):
        a.next_step()
    state = a.state_dict()
    expected = [step_indices(a.next_step()) for _ in range(8)]
    b = StepSampler(ds, 6, 3, 0, 1, seed=11)
    b.load_state_dict(state)
    assert [step_indices(b.next_step()) for _ in range(8)] == expected
    # Resuming with another data-parallel layout reads the same global stream.
    c = [StepSampler(ds, 6, 3, r, 2, seed=11) for r in range(2)]
    for s in c:
        s.load_state_dict(state)
    assert [sum((step_indices(s.next_step()) for s in c), []) for _ in range(8)] == expected


def test_shuffle_per_epoch_covers_every_index_once():
    n = 32
    s = StepSampler(IndexDataset(n), 8, 8, 0, 1, seed=4)
    epochs = [sum((step_indices(s.next_step()) for _ in range(n // 8)), []) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]
    # The order is a function of the seed.
    other = StepSampler(IndexDataset(n), 8, 8, 0, 1, seed=5)
    assert sum((step_indices(other.next_step()) for _ in range(n // 8)), []) != epochs[0]


def test_no_shuffle_is_sequential():
    s = StepSampler(IndexDataset(10), 4, 4, 0, 1, seed=0, shuffle=False)
    assert [step_indices(s.next_step()) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_synthetic_stream_is_endless_and_unshuffled():
    ds = SyntheticDataset(16, 4, seed=0)
    s = StepSampler(ds, 4, 4, 0, 1, seed=0)
    assert not s.shuffle
    (x, _), = s.next_step()
    assert all(torch.equal(x[i], torch.from_numpy(ds[i][:-1])) for i in range(4))
