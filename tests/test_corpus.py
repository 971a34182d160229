"""Tokenized corpora: `python -m hpctrain.data.prepare` against the `tokenizers` library itself (the
ids of every document, then its end-of-document id), text / JSON lines / Parquet, worker processes,
the validation split, the id width, and bad input refused with the file and the fix."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import prepare as prep
from hpctrain.data.prepare import prepare
from hpctrain.data.shards import META, ShardDataset, dtype_for, read_meta

from helpers import run_cli

REPO = Path(__file__).resolve().parent.parent


def corpus_texts(example_corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in (example_corpus / "corpus.jsonl").read_text().splitlines()]


def reference_ids(example_corpus: Path, texts: list[str]) -> list[list[int]]:
    """What the tokenizers library itself makes of each document, plus its end-of-document id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(example_corpus / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]


def split_stream(out: Path, split: str) -> np.ndarray:
    meta = read_meta(out)
    shards = meta["splits"].get(split, {"shards": []})["shards"]
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in shards] or [np.zeros(0)])


def documents_of(stream: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[a: b + 1].tolist() for a, b in zip(starts, ends)]


@pytest.mark.slow
def test_ids_are_the_tokenizers_encoding_with_eos_after_every_document(example_corpus, tmp_path):
    texts = corpus_texts(example_corpus)
    meta = prepare(example_corpus / "corpus.jsonl", tmp_path, example_corpus / "tokenizer.json",
                   val_fraction=0, shard_bytes=100_000)
    expected = np.concatenate([np.array(ids) for ids in reference_ids(example_corpus, texts)])
    assert meta["vocab_size"] == 512 and meta["dtype"] == "uint16" and meta["documents"] == len(texts)
    assert len(meta["splits"]["train"]["shards"]) > 1  # documents run across shard boundaries
    assert np.array_equal(split_stream(tmp_path, "train"), expected)
    # The tokenizer travels with the shards (export and generation read it from there).
    assert (tmp_path / "tokenizer.json").read_bytes() == (example_corpus / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


@pytest.mark.slow
def test_text_files_json_lines_and_parquet_give_the_same_stream(example_corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus_texts(example_corpus)[:60]
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):  # sorted names keep the documents' order
        (tmp_path / "txt" / f"doc-{i:04d}.txt").write_text(t)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), tmp_path / "c.parquet", row_group_size=7)
    tok = example_corpus / "tokenizer.json"
    streams = []
    for src in ("txt", "c.jsonl", "c.parquet"):
        out = tmp_path / f"out-{src}"
        prepare(tmp_path / src, out, tok, val_fraction=0, text_field="body")
        streams.append(split_stream(out, "train"))
    expected = np.concatenate([np.array(ids) for ids in reference_ids(example_corpus, texts)])
    for s in streams:
        assert np.array_equal(s, expected)


def test_worker_processes_write_the_same_shards(example_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_CHARS", 20_000)  # many tasks, so that their order matters
    tok = example_corpus / "tokenizer.json"
    a = prepare(example_corpus / "corpus.jsonl", tmp_path / "a", tok, workers=0, val_fraction=0.1, shard_bytes=50_000)
    b = prepare(example_corpus / "corpus.jsonl", tmp_path / "b", tok, workers=2, val_fraction=0.1, shard_bytes=50_000)
    assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}
    for split in a["splits"].values():
        for s in split["shards"]:
            assert (tmp_path / "a" / s["file"]).read_bytes() == (tmp_path / "b" / s["file"]).read_bytes()


def test_validation_split_holds_the_hashed_share_of_whole_documents(example_corpus, tmp_path):
    texts = corpus_texts(example_corpus)
    tok = example_corpus / "tokenizer.json"
    meta = prepare(example_corpus / "corpus.jsonl", tmp_path / "a", tok, val_fraction=0.2)
    n, k = len(texts), meta["splits"]["val"]["documents"]
    assert abs(k - 0.2 * n) < 4 * (0.2 * 0.8 * n) ** 0.5, (k, n)  # a binomial share, not a fixed count
    eos = meta["eos_id"]
    train, val = (documents_of(split_stream(tmp_path / "a", s), eos) for s in ("train", "val"))
    ref = reference_ids(example_corpus, texts)
    # Whole documents, each in exactly one split, in corpus order within each.
    assert Counter(map(tuple, train + val)) == Counter(map(tuple, ref))
    in_val = [prep.is_val(i, 0.2, 0) for i in range(n)]
    assert val == [r for r, v in zip(ref, in_val) if v] and train == [r for r, v in zip(ref, in_val) if not v]
    other = prepare(example_corpus / "corpus.jsonl", tmp_path / "b", tok, val_fraction=0.2, seed=1)
    assert other["splits"]["val"]["documents"] != k or documents_of(split_stream(tmp_path / "b", "val"), eos) != val
    # Windows of the validation split read like the training split's.
    ds = ShardDataset(tmp_path / "a", 32, "val")
    assert len(ds) > 0 and ds[0].shape == (33,) and ds[0].max() < 512


def test_id_width_follows_the_vocabulary(tmp_path):
    assert [dtype_for(v) for v in (256, 257, 65536, 65537)] == ["uint8", "uint16", "uint16", "uint32"]
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("w69999 w123 w65536 w65535")
    meta = prepare(tmp_path / "c.txt", tmp_path / "out", tmp_path / "tokenizer.json", val_fraction=0)
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"]) == ("uint32", 70_001, 70_000)
    assert split_stream(tmp_path / "out", "train").tolist() == [69999, 123, 65536, 65535, 70000]


def test_an_interrupted_prepare_leaves_the_earlier_output_whole(example_corpus, tmp_path):
    """A corpus that fails part way (a bad line at the end) leaves the earlier prepare's directory byte
    for byte (the new shards are built beside it), and no half-written directory anywhere: nothing
    trains on half a corpus."""
    tok = example_corpus / "tokenizer.json"
    out = tmp_path / "out"
    prepare(example_corpus / "corpus.jsonl", out, tok, val_fraction=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text((example_corpus / "corpus.jsonl").read_text() + '{"title": "no text"}\n')
    with pytest.raises(prep.CorpusError, match=r"bad.jsonl:\d+ has no text field 'text'.*--text-field"):
        prepare(bad, out, tok, val_fraction=0)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and (out / META).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out"]
    assert len(ShardDataset(out, 16)) > 0  # the earlier shards still train


# ------------------------------------------------------------------ bad input, as a user meets it

def _prepare_cli(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain.data.prepare", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _refused(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def test_a_corpus_with_no_documents_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("  \n\n")
    (tmp_path / "src" / "b.jsonl").write_text('{"text": ""}\n{"text": "   "}\n')
    _refused(_prepare_cli(tmp_path / "src", tmp_path / "out", "--workers", "0"),
             str(tmp_path / "src"), "holds no documents", "Fix:")
    assert not (tmp_path / "out" / META).exists()


@pytest.mark.slow
def test_bad_corpus_files_and_tokenizers_are_named_with_the_fix(example_corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["some text"]}), tmp_path / "c.parquet")
    _refused(_prepare_cli(tmp_path / "c.parquet", tmp_path / "o1", "--workers", "0"),
             "c.parquet has no column 'text'", "['content']", "--text-field")
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\nnot json\n')
    _refused(_prepare_cli(tmp_path / "c.jsonl", tmp_path / "o2", "--workers", "0"), "c.jsonl:2 is not a JSON object")
    _refused(_prepare_cli(example_corpus / "corpus.jsonl", tmp_path / "o3", "--tokenizer", tmp_path / "none.json"),
             str(tmp_path / "none.json"), "does not exist", "tokenizer.json")
    (tmp_path / "broken.json").write_text('{"model": ')
    _refused(_prepare_cli(example_corpus / "corpus.jsonl", tmp_path / "o4", "--tokenizer", tmp_path / "broken.json"),
             "broken.json is not a tokenizers JSON file")
    # A tokenizer without an end-of-document token: it must be named.
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "noeos.json"))
    _refused(_prepare_cli(example_corpus / "corpus.jsonl", tmp_path / "o5", "--tokenizer", tmp_path / "noeos.json"),
             "noeos.json has none of the usual end-of-document tokens", "--eos")
    _refused(_prepare_cli(example_corpus / "corpus.jsonl", tmp_path / "o6", "--tokenizer", tmp_path / "noeos.json",
                          "--eos", "</s>"), "has no token '</s>'")
    # Too few documents for the validation share asked for: shards without a val split, and a warning
    # (eval.every is refused on them at the login node, see below).
    (tmp_path / "one.txt").write_text("a single document")
    proc = _prepare_cli(tmp_path / "one.txt", tmp_path / "o7", "--workers", "0")
    assert proc.returncode == 0 and "warning: no validation split" in proc.stderr and "--val-fraction" in proc.stderr
    assert list(read_meta(tmp_path / "o7")["splits"]) == ["train"]


@pytest.mark.slow
def test_login_node_refuses_a_tokenizer_larger_than_the_model(example_shards, tmp_path):
    proc = run_cli("+experiment=tiny", "data=shards", f"data.path={example_shards}", f"run.dir={tmp_path / 'run'}",
                   check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    msg = proc.stderr
    assert f"data.path={example_shards}" in msg and "512 token ids but model.vocab_size=256" in msg, msg
    assert "Fix: model.vocab_size=512" in msg
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


@pytest.mark.slow
def test_login_node_refuses_validation_without_a_split_and_mixed_tokenizers(example_corpus, example_shards, tmp_path):
    prepare(example_corpus / "corpus.jsonl", tmp_path / "noval", example_corpus / "tokenizer.json", val_fraction=0)
    bytes_dir = tmp_path / "bytes"
    prepare(example_corpus / "corpus.jsonl", bytes_dir, val_fraction=0)
    from hpctrain.core.compose import ConfigError, compose
    from hpctrain.checks.config_checks import check

    def refusal(*overrides) -> str:
        with pytest.raises(ConfigError) as e:
            check(compose(["+experiment=tiny", "data=shards", "model.vocab_size=512", *overrides]))
        return str(e.value)

    msg = refusal(f"data.path={tmp_path / 'noval'}", "eval.every=10")
    assert "eval.every=10" in msg and "no validation split" in msg and "--val-fraction" in msg
    msg = refusal(f"data.sources=[{{path: {example_shards}, weight: 3}}, {{path: {bytes_dir}, weight: 1}}]")
    assert "data.sources were tokenized differently" in msg and "same --tokenizer" in msg
    msg = refusal(f"data.sources=[{{path: {example_shards}, weight: 0}}]")
    assert "data.sources[0].weight=0.0" in msg and "positive" in msg
    msg = refusal(f"data.path={example_shards}", f"data.sources=[{{path: {example_shards}}}]")
    assert "data.path and data.sources are both set" in msg
    # The same sources from one tokenizer, with validation, pass.
    check(compose(["+experiment=tiny", "data=shards", "model.vocab_size=512", "eval.every=5",
                   f"data.sources=[{{path: {example_shards}, weight: 3}}, {{path: {example_shards}, weight: 1}}]"]))
