"""Bad input is refused early with a message naming the file or key and the fix, never a traceback from
deep inside: a Hugging Face config.json or safetensors file (model.init_from, checked on the login node
from headers only), a token-shard directory (data.path, checked at the login check and dry run), and the
JSON-lines files of a run directory (read by the report and goodput commands). Each case says, in its
comment or id, the mutation of the checking code it catches. Everything here is pure: files in tmp_path,
the check functions called directly."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from hpctrain.checks import config_checks
from hpctrain.core import hf_format as hf
from hpctrain.core.rundir import append_jsonl, read_jsonl, read_jsonl_checked, read_outcome
from hpctrain.core.schema import Config, ModelConfig
from hpctrain.data import shards
from hpctrain.data.shards import META, ShardDataset
from hpctrain.report import goodput, run_report, sweep_report

# A Llama small enough that its whole safetensors file is a few KiB.
M = ModelConfig(name="t", dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=16)


def assert_mentions(msg: str, *parts: str) -> None:
    for part in parts:
        assert part in msg, f"{part!r} not in message:\n{msg}"


# --- config.json ----------------------------------------------------------------------------------

def write_config(d: Path, cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / hf.CONFIG).write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


GOOD = hf.to_config(M, 32)


def without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


# id -> (config.json as written, what the message must say). The mutant each catches is in the comment.
BAD_CONFIGS = {
    # the positive check of the required whole numbers removed: hidden_size // 0 raises ZeroDivisionError
    "heads-zero": (without({**GOOD, "num_attention_heads": 0}, "head_dim"),
                   ["num_attention_heads=0", "positive whole"]),
    # the number check of rope_theta removed: float("abc") raises ValueError
    "rope-theta-string": ({**GOOD, "rope_theta": "abc"}, ['rope_theta="abc"', "finite number above 0"]),
    # math.isfinite dropped from the check: NaN and Infinity pass (json reads both)
    "rope-theta-nan": (json.dumps({**GOOD, "rope_theta": float("nan")}), ["rope_theta=NaN", "finite"]),
    "rope-theta-inf": (json.dumps({**GOOD, "rope_theta": float("inf")}), ["rope_theta=Infinity", "finite"]),
    # the isinstance(dict) check of read_config removed: list.get raises AttributeError
    "a-list": ([GOOD], ["holds a JSON array, not an object"]),
    "not-json": ("{\"hidden_size\": 8,", ["is not valid JSON"]),
    # the missing-key check removed: KeyError, a traceback through compose's model=hf
    "no-hidden-size": (without(GOOD, "hidden_size"), ["hidden_size is missing"]),
    # the whole-number check loosened to "a number": 8.5 slips into model.dim
    "dim-float": ({**GOOD, "hidden_size": 8.5}, ["hidden_size=8.5", "positive whole"]),
    # the bool check removed: bool("false") is True, a silent tie
    "tie-string": ({**GOOD, "tie_word_embeddings": "false"}, ['tie_word_embeddings="false"', "true or false"]),
    # the object check of rope_scaling removed: list.get raises AttributeError
    "rope-scaling-list": ({**GOOD, "rope_scaling": [8.0]}, ["rope_scaling=[8.0] must be an object"]),
    # the llama3 keys check removed: KeyError 'factor'
    "llama3-no-factor": ({**GOOD, "rope_scaling": {"rope_type": "llama3"}}, ["rope_scaling.factor is missing"]),
    # the optional whole numbers unchecked: num_key_value_heads=0 silently becomes n_heads
    "kv-heads-zero": ({**GOOD, "num_key_value_heads": 0}, ["num_key_value_heads=0"]),
    "eps-negative": ({**GOOD, "rms_norm_eps": -1}, ["rms_norm_eps=-1"]),
    # the divisibility check removed: without head_dim, hidden 10 over the heads gives no whole head width
    "dim-not-heads-x-head-dim": (without({**GOOD, "hidden_size": 9}, "head_dim"),
                                 ["hidden_size 9 is not a multiple of", "no head_dim"]),
    # the evenness check removed: RoPE pairs channels, an odd head width leaves one unpaired
    "odd-head-dim": ({**GOOD, "head_dim": 5}, ["head_dim 5 must be even"]),
    # a Mixtral whose experts are not listed as the first layers: mlp_only_layers [1] cannot be first_dense
    "mlp-only-not-first": ({**GOOD, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 8, "mlp_only_layers": [1]}, ["mlp_only_layers=[1]", "first_dense"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_json_is_refused_naming_the_file_key_and_fix(tmp_path, case):
    cfg, parts = BAD_CONFIGS[case]
    d = write_config(tmp_path / "m", cfg)
    with pytest.raises(hf.HFError) as info:
        hf.model_keys(hf.read_config(d))  # what composing model=hf does
    assert_mentions(str(info.value), str(d / hf.CONFIG), "Fix:", *parts)
    # The login check (model.init_from with the model keys) says the same, as a problem, not a raise.
    (msg,) = hf.problems(M, d)
    assert_mentions(msg, str(d / hf.CONFIG), *parts)


def test_model_keys_of_a_bad_dict_raise_hferror_not_keyerror():
    # model_keys on a dict that did not come through read_config (the missing-key check removed: KeyError)
    with pytest.raises(hf.HFError, match="config.json: vocab_size is missing"):
        hf.model_keys(without(GOOD, "vocab_size"))
    with pytest.raises(hf.HFError, match="holds a JSON array"):
        hf.model_keys([GOOD])


def test_a_valid_config_json_still_reads(tmp_path):
    # Catches a check too strict for what to_config (and transformers) write: null ids, the llama3 block,
    # head_dim given, rope_theta inside rope_parameters (transformers 5) instead of at the top.
    m = ModelConfig(name="t", dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=16,
                    rope_scaling=8.0, rope_original_max_seq_len=16)
    d = write_config(tmp_path / "m", hf.to_config(m, 32))
    assert hf.mismatches(m, hf.model_keys(hf.read_config(d))) == []
    v5 = {**without(GOOD, "rope_theta"), "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    assert hf.model_keys(hf.read_config(write_config(tmp_path / "v5", v5)))["rope_theta"] == 1234.0


# --- safetensors ----------------------------------------------------------------------------------

def st_header(specs: dict) -> dict:
    """{name: (dtype, shape)} -> a header with the tensors' bytes one after another."""
    header, at = {}, 0
    for name, (dtype, shape) in specs.items():
        n = math.prod(shape) * hf.DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    return header


def write_st(path: Path, header, data_bytes: int | None = None) -> Path:
    """A safetensors file: 8-byte length, the JSON header, then `data_bytes` bytes (default: what the
    header's offsets reach)."""
    if data_bytes is None:
        data_bytes = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
    return path


def model_dir(tmp_path: Path, edit=None, data_bytes: int | None = None) -> Path:
    """A Hugging Face directory of M whose header `edit` damages."""
    d = write_config(tmp_path / "m", GOOD)
    header = st_header({k: ("F32", v) for k, v in hf.expected_shapes(M).items()})
    if edit:
        edit(header)
    write_st(d / "model.safetensors", header, data_bytes)
    return d


def two(a, b, dtype="F32", shape=(2,)):
    return {"a": {"dtype": dtype, "shape": list(shape), "data_offsets": a},
            "b": {"dtype": dtype, "shape": list(shape), "data_offsets": b}}


# id -> (header, data bytes, what the message must say)
BAD_HEADERS = {
    # the overlap branch removed (begin < at): b reads a's bytes, passes here, the library refuses it on the ranks
    "overlap": (two([0, 8], [4, 12]), 12, ["tensor b: data_offsets [4, 12] overlap those of a"]),
    # the gap branch removed (begin > at): the library refuses holes too
    "gap": (two([0, 8], [12, 20]), 20, ["tensor b: data_offsets [12, 20] leave bytes 8..12", "to no tensor"]),
    # the truncation check of the offsets removed: offsets past the end of the file
    "past-the-end": (two([0, 8], [8, 16]), 8, ["is truncated: its tensors need", "download it again"]),
    "far-past-the-end": (two([0, 8], [1000, 1008]), 8, ["reach past the end of the file"]),
    # the dtype check removed: DTYPE_BYTES["F7"] raises KeyError
    "unknown-dtype": ({"a": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}}, 8, ['dtype "F7" is not one']),
    "dtype-a-list": ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, 8, ['dtype ["F32"] is not']),
    # "d >= 0" dropped from the shape check: [-2, -1] has 2 elements, 8 bytes, and would pass the byte count
    "negative-shape": ({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, 8,
                       ["shape [-2, -1] is not a list of whole numbers, 0 or more"]),
    # the byte-length check removed: a shape the bytes do not hold
    "shape-vs-bytes": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8,
                       ["shape [3] of F32 is 12 bytes, but data_offsets [0, 8] hold 8"]),
    "begin-after-end": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, 8, ["data_offsets [8, 0]"]),
    # the trailing-bytes check removed: the library refuses a file longer than its tensors
    "trailing-bytes": (two([0, 8], [8, 16]), 24, ["8 bytes after the last tensor's data"]),
    # the entry check removed: "x"["dtype"] raises TypeError
    "entry-a-string": ({"a": "x"}, 0, ['tensor a: "x" is not an object']),
    "no-offsets": ({"a": {"dtype": "F32", "shape": [2]}}, 8, ["data_offsets null"]),
    # the metadata check removed: the library wants strings there
    "metadata-not-strings": ({"__metadata__": {"format": 1}, **two([0, 8], [8, 16])}, 16, ["__metadata__"]),
    # the header object check removed: list.items raises AttributeError
    "header-a-list": ([1, 2], 0, ["its header is a JSON array"]),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_damaged_safetensors_header_is_refused(tmp_path, case):
    header, data_bytes, parts = BAD_HEADERS[case]
    p = write_st(tmp_path / "x.safetensors", header, data_bytes)
    with pytest.raises(hf.HFError) as info:
        hf.read_header(p)
    assert_mentions(str(info.value), str(p), "Fix:", *parts)


def test_header_that_is_not_json_or_too_long(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"hello")
    with pytest.raises(hf.HFError, match="is not a safetensors file .*Fix:"):
        hf.read_header(p)
    p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")  # not UTF-8
    with pytest.raises(hf.HFError, match="is not a safetensors file"):
        hf.read_header(p)
    # A header length above the library's 100 MB limit in a (sparse) file that long: refused before reading
    # it (the limit removed: 150 MB read into memory, then a JSON error instead of this message).
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(200_000_000)
    with pytest.raises(hf.HFError, match="more than safetensors allows"):
        hf.read_header(p)
    # 2**64 - 1 in a tiny file: truncated, not a huge read; said once (HFError is a ValueError: caught by the
    # JSON handler, it came back wrapped in "not a safetensors file (unreadable header: ... truncated ...)")
    p.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    with pytest.raises(hf.HFError) as info:
        hf.read_header(p)
    assert str(info.value).startswith(f"{p} is truncated: its header says") and "unreadable" not in str(info.value)


def test_valid_safetensors_from_the_library_pass(tmp_path):
    # The library pads its header with spaces and writes __metadata__; a check stricter than the library
    # (e.g. counting the padding as data, or refusing metadata) fails here.
    from safetensors.numpy import save_file

    arrays = {"a": np.ones((3, 5), np.float32), "b": np.zeros((7,), np.float16), "c": np.zeros((0, 4), np.float32)}
    save_file(arrays, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    header = hf.read_header(tmp_path / "x.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {"a": ("F32", [3, 5]), "b": ("F16", [7]),
                                                                       "c": ("F32", [0, 4])}
    assert hf.problems(M, model_dir(tmp_path)) == []


def test_the_login_check_refuses_a_damaged_model_dir(tmp_path):
    """config_checks._init_from, what `python -m hpctrain ... model.init_from=DIR` (and its dry run) runs."""
    def overlap(h):
        h["model.norm.weight"]["data_offsets"] = [0, 32]  # over the embedding
    d = model_dir(tmp_path, overlap)
    cfg = Config(model=ModelConfig(**{**vars(M), "init_from": str(d)}))
    (msg,) = config_checks._init_from(cfg)
    assert_mentions(msg, str(d / "model.safetensors"), "model.norm.weight", "overlap", "Fix: download it again")


def test_weights_not_in_floating_point_are_refused(tmp_path):
    # the floating-point check of problems() removed: I32 weights pass the shape check and load as garbage
    def ints(h):
        h["model.norm.weight"]["dtype"] = "I32"
    d = model_dir(tmp_path, ints)
    (msg,) = hf.problems(M, d)
    assert_mentions(msg, str(d / "model.safetensors"), "model.norm.weight is I32, not floating point", "Fix:")


def test_every_safetensors_file_of_the_directory_is_checked(tmp_path):
    # The ranks' loader reads every *.safetensors file of the directory, index or not (tensors() back to
    # "the index's files only": a damaged stray file passes here and fails on every rank).
    d = model_dir(tmp_path)
    (d / hf.INDEX).write_text(json.dumps({"weight_map": {"model.norm.weight": "model.safetensors"}}))
    (d / "consolidated.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0hello")
    (msg,) = hf.problems(M, d)
    assert_mentions(msg, str(d / "consolidated.safetensors"), "not a safetensors file", "Fix:")


@pytest.mark.parametrize("index, part", [
    ([1], "is not a safetensors index"),                       # a list: list["weight_map"] raised TypeError
    ({"weight_map": {"a": ["x"]}}, "must map each tensor"),    # set() of lists raised TypeError
    ({"weight_map": {"a": "../m/model.safetensors"}}, "must map each tensor"),  # a file the ranks never read
    ({"weight_map": {"a": "model-00002.safetensors"}}, "model-00002.safetensors is listed"),
])
def test_bad_index_is_refused(tmp_path, index, part):
    d = model_dir(tmp_path)
    (d / hf.INDEX).write_text(json.dumps(index))
    (msg,) = hf.problems(M, d)
    assert_mentions(msg, "model.safetensors", part, "Fix:")


# --- token shards ---------------------------------------------------------------------------------

def shard_dir(tmp_path: Path, meta=None, train=300, val=100) -> Path:
    """A shard directory as hpctrain.data.prepare writes it (uint8 ids, a train and a val shard)."""
    d = tmp_path / "shards"
    d.mkdir()
    (np.arange(train) % 200).astype(np.uint8).tofile(d / "train-00000.bin")
    (np.arange(val) % 200).astype(np.uint8).tofile(d / "val-00000.bin")
    meta = meta if meta is not None else {
        "format": 2, "vocab_size": 256, "dtype": "uint8", "eos_id": 0, "tokenizer": {"sha256": "x"},
        "splits": {"train": {"shards": [{"file": "train-00000.bin", "tokens": train}], "tokens": train},
                   "val": {"shards": [{"file": "val-00000.bin", "tokens": val}], "tokens": val}}}
    (d / META).write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return d


def data_problems(path, eval_every: int = 0) -> list[str]:
    """config_checks._data for data.path=path: what the login check and the dry run say."""
    cfg = Config()
    cfg.data.source, cfg.data.path, cfg.data.seq_len, cfg.eval.every = "shards", str(path), 16, eval_every
    return list(config_checks._data(cfg))


def test_valid_shards_pass_and_read(tmp_path):
    d = shard_dir(tmp_path)
    assert data_problems(d, eval_every=5) == [] and shards.problems(d) == []
    assert ShardDataset(d, 16)[0].tolist() == list(range(17))


def test_missing_meta_json(tmp_path):
    # problems() returning [] for a missing meta.json: read_meta's None reaches meta["vocab_size"] (TypeError)
    d = shard_dir(tmp_path)
    (d / META).unlink()
    (msg,) = data_problems(d)
    assert_mentions(msg, f"data.path={d}", str(d / META), "is missing", "Fix: prepare it again",
                    "python -m hpctrain.data.prepare")


def test_missing_shard_file(tmp_path):
    # the missing-file branch removed: passes the dry run, FileNotFoundError from np.memmap on every rank
    d = shard_dir(tmp_path)
    (d / "train-00000.bin").unlink()
    (msg,) = data_problems(d)
    assert_mentions(msg, f"data.path={d}", str(d / "train-00000.bin"), "is missing", "300 tokens", "Fix:")


def test_shard_shorter_or_longer_than_meta_says(tmp_path):
    # the size check removed: "mmap length is greater than file size" on every rank
    d = shard_dir(tmp_path)
    (d / "train-00000.bin").write_bytes(bytes(50))
    (msg,) = data_problems(d)
    assert_mentions(msg, str(d / "train-00000.bin"), "holds 50 bytes", "says 300 tokens", "cut short",
                    "Fix: copy the directory again")
    # ... and on the rank, the same words rather than numpy's (the check dropped from ShardDataset)
    with pytest.raises(ValueError, match="cut short"):
        ShardDataset(d, 16)
    # longer than meta.json says: from another prepare (the check loosened to "size < expected")
    (d / "train-00000.bin").write_bytes(bytes(400))
    (msg,) = data_problems(d)
    assert_mentions(msg, "holds 400 bytes", "not the file this meta.json describes")


def test_val_shards_are_checked_when_validation_reads_them(tmp_path):
    # A damaged val shard matters only with eval.every > 0 (checking every split always would refuse a run
    # that never reads it; checking only train would let validation crash the run at its first eval).
    d = shard_dir(tmp_path)
    (d / "val-00000.bin").write_bytes(bytes(10))
    assert data_problems(d, eval_every=0) == []
    (msg,) = data_problems(d, eval_every=5)
    assert_mentions(msg, str(d / "val-00000.bin"), "holds 10 bytes", "says 100 tokens")


SPLITS = {"train": {"shards": [{"file": "train-00000.bin", "tokens": 300}]}}
BAD_METAS = {
    # each was a TypeError/AttributeError in the login check or on the ranks (or passed) before
    "a-list": ("[1]", "holds an array, not the JSON object"),
    "not-json": ("{oops", "is not valid JSON"),
    "vocab-string": ({"vocab_size": "256", "dtype": "uint8", "splits": SPLITS}, 'vocab_size="256" must be a positive'),
    "dtype-unknown": ({"vocab_size": 256, "dtype": "float77", "splits": SPLITS}, 'dtype="float77" is not one of'),
    "splits-list": ({"vocab_size": 256, "dtype": "uint8", "splits": []}, '"splits" must map each split'),
    "file-outside": ({"vocab_size": 256, "dtype": "uint8",
                      "splits": {"train": {"shards": [{"file": "../x.bin", "tokens": 3}]}}}, 'file="../x.bin"'),
    "shard-a-string": ({"vocab_size": 256, "dtype": "uint8", "splits": {"train": {"shards": ["train-00000.bin"]}}},
                       'splits.train.shards[0]="train-00000.bin" is not an object'),
    "tokens-negative": ({"vocab_size": 256, "dtype": "uint8",
                         "splits": {"train": {"shards": [{"file": "train-00000.bin", "tokens": -5}]}}},
                        "tokens=-5 must be a whole number"),
}


@pytest.mark.parametrize("case", list(BAD_METAS))
def test_malformed_meta_json(tmp_path, case):
    meta, part = BAD_METAS[case]
    d = shard_dir(tmp_path, meta)
    (msg,) = data_problems(d)
    assert_mentions(msg, f"data.path={d}", str(d / META), part, "Fix:")
    with pytest.raises(ValueError, match="cannot be read as token shards"):
        ShardDataset(d, 16)


def test_directories_from_before_splits_still_pass(tmp_path):
    # the old single "shards" list and "tokenizer": "bytes" (a string: .get on it raised AttributeError with
    # two data.sources)
    meta = {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8", "separator": 0, "total_tokens": 300,
            "shards": [{"file": "train-00000.bin", "tokens": 300}]}
    d = shard_dir(tmp_path, meta)
    assert data_problems(d) == []
    assert config_checks._tokenizer_id(meta) == "bytes"


# --- JSON-lines files of a run ----------------------------------------------------------------------

def lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


METRICS = [{"step": s, "loss": 2.0, "step_time_s": 0.5, "time": 100.0 + s, "tokens_per_s": 10.0} for s in range(1, 11)]
ATTEMPT = {"attempt": 0, "start": 100.0, "end": 120.0, "rc": 0}
CRASH = {"cause": "crashed", "ranks": [1], "nodes": ["n1"], "detail": "killed", "steps_redone": 2, "recover_s": 3.0}


def run_dir(tmp_path: Path, metrics=(), attempts=(), interruptions=()) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(lines(*METRICS, *metrics))
    (d / "attempts.jsonl").write_text(lines(*(attempts or [ATTEMPT])))
    (d / "interruptions.jsonl").write_text(lines(CRASH, *interruptions))
    return d


def test_read_jsonl_skips_and_names_malformed_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(lines({"step": 1}, "[1, 2]", '"{\\"step\\": 2}"', "3", "null", {"step": "4"}, {"loss": 1.0},
                       "{torn", {"step": 5, "step_time_s": float("nan")}, {"step": 6, "loss": float("nan")})
                 + '{"step": 7, "lo')  # the last line cut mid-write: left out silently
    records, skipped = read_jsonl_checked(p)
    # the object check removed: the list, string, number and null lines come back as records
    # the field kinds unchecked: step "4", a missing step, a NaN step time come back and crash the readers
    assert records == [{"step": 1}, {"step": 6, "loss": records[-1]["loss"]}] and math.isnan(records[-1]["loss"])
    assert skipped == [f"{p}:2: a JSON array, not an object", f"{p}:3: a JSON string, not an object",
                       f"{p}:4: a JSON number, not an object", f"{p}:5: a JSON null, not an object",
                       f'{p}:6: step="4" is not a whole number', f"{p}:7: no 'step'",
                       f"{p}:8: not JSON ('{{torn')", f"{p}:9: step_time_s=NaN is not a finite number"]
    assert read_jsonl(p) == records  # the plain reader, quiet, for the supervisor's polling
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_append_after_a_torn_line_keeps_the_new_record(tmp_path):
    # append_jsonl without ending the torn line first: the new record joins it and is lost
    p = tmp_path / "interruptions.jsonl"
    p.write_text(lines(CRASH) + '{"cause": "hu')
    append_jsonl(p, {**CRASH, "cause": "hung"})
    assert [r["cause"] for r in read_jsonl(p)] == ["crashed", "hung"]


@pytest.mark.parametrize("file, bad", [
    ("metrics.jsonl", "[1, 2]"), ("metrics.jsonl", '"step 11"'), ("metrics.jsonl", {"step": "11", "step_time_s": 1}),
    ("attempts.jsonl", '"x"'), ("interruptions.jsonl", "[]"), ("interruptions.jsonl", '"crashed"'),
    ("interruptions.jsonl", {"cause": "crashed", "nodes": 5}), ("interruptions.jsonl", {"recover_s": 1.0}),
])
def test_goodput_skips_malformed_lines_and_names_them(tmp_path, capsys, file, bad):
    # goodput back on read_jsonl without the warnings: no file:line in its output; the object check removed:
    # TypeError/AttributeError/KeyError as before
    d = run_dir(tmp_path, **{file.split(".")[0]: [bad]})
    if file == "attempts.jsonl":
        (d / file).write_text(lines(ATTEMPT, bad))
    assert goodput.main([str(d)]) == 0
    out = capsys.readouterr().out
    line = 2 if file != "metrics.jsonl" else len(METRICS) + 1
    assert_mentions(out, "goodput 25.0%", f"{d / file}:{line}: ", "line left out")


def test_goodput_of_a_run_whose_attempts_are_all_malformed(tmp_path, capsys):
    d = run_dir(tmp_path, attempts=['"x"', {"start": "100"}])
    assert goodput.main([str(d)]) == 2
    err = capsys.readouterr().err
    assert_mentions(err, f"{d / 'attempts.jsonl'} holds no usable record", "attempts.jsonl:1: a JSON string",
                    'start="100" is not a finite number', "Fix:")


def test_a_negative_wall_time_is_a_problem_not_a_figure(tmp_path, capsys):
    # the wall-time check removed: "goodput 0.0% ... of -100.0 s wall time", exit 0
    d = run_dir(tmp_path, attempts=[{"start": 200.0, "end": 100.0}])
    assert goodput.main([str(d)]) == 1
    out = capsys.readouterr().out
    assert_mentions(out, "goodput cannot be measured", str(d / "attempts.jsonl"), "100.0 s before it starts", "Fix:")
    assert "-100.0" not in out and "wall time" not in out
    assert "crashed" in out  # the interruptions are still listed


def test_goodput_of_valid_files_is_unchanged(tmp_path):
    g = goodput.measure(run_dir(tmp_path))
    assert (g.wall_s, g.productive_s, g.steps, g.lost_s, g.redone_s, g.skipped, g.problems) == \
        (20.0, 5.0, 10, 3.0, 1.0, [], [])
    # an even number of gaps: the steps stay whole ("11.0 productive steps" before)
    (tmp_path / "run" / "metrics.jsonl").write_text(lines(*METRICS, {**METRICS[-1], "step": 11}))
    assert "in 11 productive steps" in goodput.report(goodput.measure(tmp_path / "run"))


def test_run_report_reads_malformed_lines_without_a_traceback(tmp_path, capsys):
    # run_report.load back on the quiet reader: nothing on stderr; the object check removed: AttributeError
    d = run_dir(tmp_path, metrics=["[1]", {"step": 11, "loss": "low"}], interruptions=['"crashed"'])
    (d / "checkpoints.jsonl").write_text(lines({"step": 5, "seconds": 1.0, "blocked_s": 0.5}, {"step": None}))
    run = run_report.load(d)
    assert len(run.metrics) == 10 and len(run.interruptions) == 1 and [c["step"] for c in run.checkpoints] == [5]
    err = capsys.readouterr().err
    assert_mentions(err, f"{d / 'metrics.jsonl'}:11: a JSON array", f'{d / "metrics.jsonl"}:12: loss="low"',
                    f"{d / 'interruptions.jsonl'}:2: a JSON string", f"{d / 'checkpoints.jsonl'}:2: step=null")
    page = run_report.render(run, {}, run_report._goodput(run))
    assert "last logged step 10" in page and "line left out" in page  # goodput's warnings in the page too


def test_sweep_report_rows_survive_malformed_lines_and_a_damaged_sweep_json(tmp_path, capsys):
    d = run_dir(tmp_path, metrics=['"x"', {"step": 11, "val_loss": "x"}])
    (d / "outcome.json").write_text("[]")  # not an object: .get raised AttributeError
    r = sweep_report.row(d, "run", [])
    assert (r.steps, r.final_loss, r.status) == (10, 2.0, "?")
    assert f"{d / 'metrics.jsonl'}:11: a JSON string" in capsys.readouterr().err
    (tmp_path / "sweep.json").write_text(json.dumps({"elements": [{"name": "../etc"}]}))
    with pytest.raises(ValueError, match=r"sweep.json is damaged: .* Fix:"):
        sweep_report.rows(tmp_path)


def test_read_outcome_of_a_damaged_file(tmp_path):
    # a list in outcome.json: the supervisor's outcome.get(...) raised AttributeError
    (tmp_path / "outcome.json").write_text("[1]")
    assert read_outcome(tmp_path) is None
    (tmp_path / "outcome.json").write_text('{"status": "completed"}')
    assert read_outcome(tmp_path) == {"status": "completed"}


def test_metrics_after_a_torn_line_keep_the_restarted_runs_first_record(tmp_path):
    """A rank killed mid-write leaves metrics.jsonl's last line without its newline; the restarted run's
    logger ends it first. Mutant: MetricsLogger opening the file without end_torn_line (its first record
    joins the torn line and is lost to every reader)."""
    import io

    from hpctrain.train.metrics import MetricsLogger, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    m = MetricsLogger(tmp_path, total_steps=3, stream=io.StringIO(), live=False)
    m.file.write('{"step": 2, "loss": 1.5}\n')
    m.file.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '["eos_token"]', '{"eos_token": 5}'])
def test_a_damaged_tokenizer_config_is_no_eos_not_a_traceback(tmp_path, text):
    """tokenizer_config.json beside tokenizer.json only suggests the end-of-document token. Mutant: the
    old reader (RecursionError on deep nesting, AttributeError on an array, 5 taken for a token)."""
    from hpctrain.data.tokenizer import configured_eos

    (tmp_path / "tokenizer_config.json").write_text(text)
    assert configured_eos(tmp_path / "tokenizer.json") is None
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "</s>"}}')
    assert configured_eos(tmp_path / "tokenizer.json") == "</s>"


def test_a_run_report_of_non_object_plan_and_outcome_and_a_val_record_without_ppl(tmp_path):
    """plan.json and outcome.json that are not objects were a traceback in status()/plan_rows, and a
    validation record without val_ppl a KeyError in render. Mutant: the old _json (returns a list) or
    render reading m["val_ppl"]."""
    import math

    from hpctrain.report.run_report import load, render

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": 2.0}\n'
                                            '{"step": 1, "time": 1.5, "val_loss": 1.5}\n')
    (tmp_path / "plan.json").write_text('["not", "an", "object"]')
    (tmp_path / "outcome.json").write_text('"completed"')
    page = render(load(tmp_path), {}, None)
    assert f"{math.exp(1.5):,.2f}" in page and "Validation" in page
