"""Tokenize a corpus into memory-mapped token shards with a validation split.

    python -m hpctrain.data.prepare SRC OUT [--tokenizer tokenizer.json] [--workers N] [--val-fraction 0.01]
    python -m hpctrain.data.prepare SRC OUT --tokenizer DIR --format chat|prompt [--seq-len N] [--too-long refuse]
    python -m hpctrain.data.prepare SRC OUT --tokenizer DIR --format preference --seq-len N [--too-long refuse]

SRC is a file or a directory of text files (.txt .md .rst .py: one document each), JSON lines and
Parquet (one document per row, from --text-field). Each document is tokenized with the Hugging Face
tokenizer.json given (UTF-8 bytes without one) and ends with the end-of-document id. A document goes
to the validation split by a hash of its position in the corpus, so the split does not depend on the
number of workers. OUT gets `train-NNNNN.bin`, `val-NNNNN.bin`, a copy of the tokenizer, and meta.json.
OUT is new, empty, or an earlier prepare's output (hpctrain.core.outdir): the new shards are built
beside it and swapped in when complete, so a failed prepare leaves the earlier one whole, and files
prepare did not write are never touched. OUT may not be inside SRC: prepare would read its own output.

--format chat (JSON lines of {"messages": [...]}, rendered with the tokenizer's chat template) and
--format prompt ({"prompt", "completion"}) also write `<split>-NNNNN.mask` beside each shard: one byte
per token, 1 where the loss is computed (the assistant's turns, the completion; hpctrain.data.chat).
With --seq-len the records are laid out so that none is split across two samples (docs/finetune.md).
--format chat also reads ShareGPT and Alpaca records (hpctrain.data.records). --format preference reads
{"prompt", "chosen", "rejected"} pairs for DPO (hpctrain.data.preference): pair j of a split is windows 2j
(prompt + chosen) and 2j + 1 (prompt + rejected) of N + 1 tokens, unpacked, the mask on the completions.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from hpctrain.core import outdir
from hpctrain.core.outdir import OutputDirError
from hpctrain.data.documents import PARQUET, TEXT, JSONL, CorpusError, corpus_files, documents, json_lines
from hpctrain.data.shards import META, SPLITS
from hpctrain.data.tokenizer import Encoder, TokenizerError, side_file

BATCH_CHARS = 1 << 20  # text per task handed to a worker
TOOL = "hpctrain.data.prepare"  # the name in the marker of its output directories


def is_val(index: int, fraction: float, seed: int) -> bool:
    """Document `index` belongs to the validation split (a splitmix64 hash below fraction * 2**64)."""
    z = (index + seed * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) < fraction * 2.0**64


class _SplitWriter:
    """Appends documents to one split's shards, writing a shard once it reaches `shard_tokens`."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.pending: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []  # loss masks (chat and prompt data), one uint8 per token
        self.pending_tokens = self.tokens = self.documents = self.trained = 0
        self.max_id = -1  # the largest id written: meta.json's max_token_id, checked against model.vocab_size

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.pending.append(ids)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        if mask is not None:
            self.masks.append(mask)
            self.trained += int(mask.sum())
        self.pending_tokens += len(ids)
        self.tokens += len(ids)
        self.documents += 1
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.split}-{len(self.shards):05d}.bin"
        tmp = self.out / (name + ".tmp")
        np.concatenate(self.pending).astype(self.dtype, copy=False).tofile(tmp)
        os.replace(tmp, self.out / name)
        self.shards.append({"file": name, "tokens": self.pending_tokens})
        if self.masks:
            mask_name = name[:-len(".bin")] + ".mask"
            np.concatenate(self.masks).astype(np.uint8).tofile(self.out / (mask_name + ".tmp"))
            os.replace(self.out / (mask_name + ".tmp"), self.out / mask_name)
            self.shards[-1]["mask"] = mask_name
        self.pending, self.masks, self.pending_tokens = [], [], 0

    def summary(self) -> dict:
        self.flush()
        out = {"shards": self.shards, "tokens": self.tokens, "documents": self.documents}
        return out | ({"trained_tokens": self.trained} if any("mask" in s for s in self.shards) else {})


def _batches(files: list[Path], text_field: str, stats: dict) -> Iterator[list[str]]:
    batch, chars = [], 0
    for f in files:
        stats["bytes"] += f.stat().st_size
        try:
            for text in documents(f, text_field):
                batch.append(text)
                chars += len(text)
                if chars >= BATCH_CHARS:
                    yield batch
                    batch, chars = [], 0
        except RecursionError:
            if f.suffix not in JSONL:
                raise
            raise CorpusError(f"{f}:{_too_deep(f)} nests JSON deeper than Python's parser goes. "
                              f"Fix: one flat JSON object per line, with the text in a string field") from None
    if batch:
        yield batch


def _too_deep(path: Path) -> int | str:
    """The line of `path` the JSON parser cannot nest into (read again: only on the way to an error)."""
    for n, line in json_lines(path):
        try:
            json.loads(line)
        except RecursionError:
            return n
        except ValueError:
            pass
    return "?"


_ENCODER: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    # One thread per worker process: parallelism comes from the processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _ENCODER
    _ENCODER = encoder


def _encode(texts: list[str]):
    return _ENCODER.encode(texts)


def _encoded(encoder: Encoder, batches: Iterator[list[str]], workers: int):
    """(ids, lengths) per batch, in corpus order; at most 2 batches per worker in flight."""
    if workers <= 0:
        for b in batches:
            yield encoder.encode(b)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (encoder,)) as pool:
        window: collections.deque = collections.deque()
        for b in batches:
            window.append(pool.apply_async(_encode, (b,)))
            if len(window) >= 2 * workers:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


def _inside(out: Path, src: Path) -> bool:
    """`out` is `src` or below it (symlinks followed), where the corpus listing would find it."""
    out, src = Path(os.path.realpath(out)), Path(os.path.realpath(src))
    return src.is_dir() and (out == src or src in out.parents)


def prepare(src: Path, out: Path, tokenizer: str | os.PathLike | None = None, *, eos: str | None = None,
            workers: int = 0, val_fraction: float = 0.01, seed: int = 0, shard_bytes: int = 64 << 20,
            exts: tuple[str, ...] = TEXT + JSONL + PARQUET, text_field: str = "text", progress=None) -> dict:
    src, out = Path(src), Path(out)
    if not 0 <= val_fraction < 1:
        raise CorpusError(f"--val-fraction {val_fraction} is outside [0, 1)")
    files = corpus_files(src, exts)
    if not files:
        raise CorpusError(f"no files ending in {', '.join(exts)} under {src}. "
                          f"Fix: point at the corpus, or list its extensions with --ext")
    if _inside(out, src):
        raise OutputDirError(f"{out} is inside the corpus directory {src}: the next prepare would read these shards "
                             f"as text. Fix: write the shards outside {src}")
    encoder = Encoder(tokenizer, eos)
    tok_files = _tokenizer_files(encoder)
    with outdir.replacing(out, TOOL) as tmp:  # refuses a directory holding files prepare did not write
        return _write(encoder, tok_files, files, src, tmp, workers, val_fraction, seed, shard_bytes, text_field,
                      progress)


def _write(encoder: Encoder, tok_files: dict[str, bytes], files: list[Path], src: Path, out: Path, workers: int,
           val_fraction: float, seed: int, shard_bytes: int, text_field: str, progress) -> dict:
    """Tokenize `files` into the new, empty directory `out`; returns meta.json's content."""
    shard_tokens = max(1, shard_bytes // np.dtype(encoder.dtype).itemsize)
    writers = {s: _SplitWriter(out, s, encoder.dtype, shard_tokens) for s in SPLITS}
    stats, doc, t0, shown = {"bytes": 0}, 0, time.monotonic(), time.monotonic()
    for ids, lengths in _encoded(encoder, _batches(files, text_field, stats), workers):
        for piece in np.split(ids, np.cumsum(lengths)[:-1]):
            writers["val" if is_val(doc, val_fraction, seed) else "train"].add(piece)
            doc += 1
        if progress and time.monotonic() - shown > 2:
            shown = time.monotonic()
            progress(_line(stats["bytes"], doc, sum(w.tokens for w in writers.values()), shown - t0))
    if doc == 0:
        raise CorpusError(f"{src} holds no documents: its {len(files)} file(s) are empty or blank. "
                          f"Fix: point at a corpus with text (or the right --text-field)")
    splits = {s: w.summary() for s, w in writers.items() if w.documents}
    warnings = []
    if val_fraction > 0 and "val" not in splits:
        # Not an error: training needs no validation; eval.every is refused on such a directory.
        warnings.append(f"no validation split: none of the {doc} documents of {src} fell in the {val_fraction:g} "
                        f"share. For validation, prepare again with a larger --val-fraction")
    meta = {"format": 2, "vocab_size": encoder.vocab_size, "dtype": encoder.dtype, "eos_id": encoder.eos_id,
            "max_token_id": max(w.max_id for w in writers.values()),
            "tokenizer": _copy_tokenizer(encoder, tok_files, out), "val_fraction": val_fraction, "seed": seed,
            "files": len(files), "text_bytes": stats["bytes"], "documents": doc, "splits": splits, "warnings": warnings,
            "seconds": round(time.monotonic() - t0, 3)}
    (out / META).write_text(json.dumps(meta, indent=1))
    return meta


def _records(files: list[Path]) -> Iterator[tuple[dict, str]]:
    """(record, "file:line") per JSON line of `files`."""
    for f in files:
        for n, line in json_lines(f):
            try:
                yield json.loads(line), f"{f}:{n}"
            except (ValueError, RecursionError) as e:
                raise CorpusError(f"{f}:{n} is not a JSON object ({e}). Fix: one JSON object per line") from None


def prepare_records(src: Path, out: Path, tokenizer, fmt: str, *, eos: str | None = None, val_fraction: float = 0.01,
                    seed: int = 0, seq_len: int | None = None, too_long: str = "truncate", pack: bool = True,
                    shard_bytes: int = 64 << 20, budget=None, progress=None) -> dict:
    """Conversations (fmt chat) or prompt/completion pairs (fmt prompt) of JSON-lines files to shards
    with a loss mask beside each (hpctrain.data.chat). With `seq_len`, the sequences are laid out in
    windows of seq_len tokens (data.seq_len must then be the same): a record longer than a window is
    truncated (its last token the end-of-document id) or refused (`too_long`), and one that does not
    fit in what is left of a window starts the next (the rest padded with untrained end-of-document
    ids); pack=False gives every record a window of its own (padding)."""
    from hpctrain.data import chat, records

    src, out = Path(src), Path(out)
    files = corpus_files(src, JSONL)
    if not files:
        raise CorpusError(f"no .jsonl files under {src}. Fix: --format {fmt} reads JSON lines")
    shapes = records.FileShapes()
    if tokenizer is None:
        raise TokenizerError(f"--format {fmt} needs --tokenizer: the model's tokenizer.json (and, for chat, the "
                             f"tokenizer_config.json beside it with its chat template)")
    if _inside(out, src):
        raise OutputDirError(f"{out} is inside the corpus directory {src}. Fix: write the shards outside {src}")
    encoder = Encoder(tokenizer, eos)
    tok_files = _tokenizer_files(encoder)
    tok = encoder._load()
    template = chat.ChatTemplate.of(encoder.path, budget) if fmt == "chat" else None
    with outdir.replacing(out, TOOL) as tmp:
        shard_tokens = max(1, shard_bytes // np.dtype(encoder.dtype).itemsize)
        if seq_len:
            shard_tokens = max(1, shard_tokens // seq_len) * seq_len  # windows never cross a shard
        writers = {s: _SplitWriter(tmp, s, encoder.dtype, shard_tokens) for s in SPLITS}
        fill = {s: 0 for s in SPLITS}  # tokens in the current window of each split
        t0, stats = time.monotonic(), {"truncated": 0, "records": 0}
        for i, (record, where) in enumerate(_records(files)):
            if fmt == "chat":  # ShareGPT and Alpaca records as the equivalent messages
                record = shapes.messages(record, where.rsplit(":", 1)[0], where)
            chat.check_record(record, fmt, where)
            try:
                ids, mask = chat.encode(record, fmt, tok, template, encoder.eos_id)
            except chat.ChatError as e:
                raise chat.ChatError(f"{where} (record {i + 1}): {e}") from None
            if fmt == "chat" and (ids[:-1] == encoder.eos_id).any():
                raise CorpusError(f"{where}: the end-of-document token {encoder.eos!r} occurs inside the rendered "
                                  f"conversation (the template ends turns with it): documents would be cut at every "
                                  f"turn. Fix: --eos <the tokenizer's end-of-text token, e.g. <|end_of_text|> or "
                                  f"<|endoftext|>>")
            split = "val" if is_val(i, val_fraction, seed) else "train"
            w = writers[split]
            if seq_len:
                if len(ids) > seq_len:
                    if too_long == "refuse":
                        raise CorpusError(f"{where}: {len(ids):,} tokens, longer than --seq-len {seq_len}. Fix: "
                                          f"--too-long truncate, a larger --seq-len, or drop the record")
                    ids = np.append(ids[:seq_len - 1], encoder.eos_id)
                    mask = np.append(mask[:seq_len - 1], mask[-1])
                    stats["truncated"] += 1
                room = seq_len - fill[split]
                if fill[split] and (not pack or len(ids) > room):
                    w.add(np.full(room, encoder.eos_id, dtype=np.int64), np.zeros(room, np.uint8))
                    w.documents -= 1  # padding, not a record
                    fill[split] = 0
                fill[split] = (fill[split] + len(ids)) % seq_len
            w.add(ids, mask)
            stats["records"] += 1
            if progress and stats["records"] % 10000 == 0:
                progress(f"prepare: {stats['records']:,} records, {sum(x.tokens for x in writers.values()):,} tokens")
        if not stats["records"]:
            raise CorpusError(f"{src} holds no records. Fix: one JSON object per line")
        for split, w in writers.items():  # one extra token: the last window's last target
            if w.documents:
                pad = (seq_len - fill[split]) % seq_len + 1 if seq_len else 1
                w.add(np.full(pad, encoder.eos_id, dtype=np.int64), np.zeros(pad, np.uint8))
                w.documents -= 1
        splits = {s: w.summary() for s, w in writers.items() if w.documents}
        warnings = []
        if stats["truncated"]:
            warnings.append(f"{stats['truncated']} record(s) longer than --seq-len {seq_len} were truncated")
        # packed: several records share a sample, so they need data.document_mask (the login node warns)
        meta = {"format": 2, "records": fmt, "loss_mask": True, "window": seq_len or 0,
                "packed": bool(pack or not seq_len),
                "vocab_size": encoder.vocab_size, "dtype": encoder.dtype, "eos_id": encoder.eos_id,
                "max_token_id": max(w.max_id for w in writers.values()),
                "tokenizer": _copy_tokenizer(encoder, tok_files, tmp), "val_fraction": val_fraction, "seed": seed,
                "files": len(files), "text_bytes": sum(f.stat().st_size for f in files), "documents": stats["records"],
                "splits": splits, "warnings": warnings, "seconds": round(time.monotonic() - t0, 3)}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        return meta


def prepare_pairs(src: Path, out: Path, tokenizer, *, seq_len: int, eos: str | None = None,
                  val_fraction: float = 0.01, seed: int = 0, too_long: str = "truncate", shard_bytes: int = 64 << 20,
                  budget=None, progress=None) -> dict:
    """Preference pairs ({"prompt", "chosen", "rejected"} JSON lines; hpctrain.data.preference) to shards for
    DPO. Pair j of a split is windows 2j (prompt + chosen) and 2j + 1 (prompt + rejected) of seq_len + 1
    tokens each (a sample's inputs and targets: windows that do not overlap, meta.json's "stride"), padded
    with the end-of-document id; the mask is 1 on the completion's tokens only. Nothing is packed: a DPO
    sequence's log-probability must see its own prompt and nothing else. A sequence longer than a window
    keeps its start (`too_long` truncate, TRL's keep_start with max_length = seq_len + 1) or is refused; a
    pair whose prompt alone fills the window (nothing of the completion left: TRL drops it too) and one
    whose two windows are the same (a tie: the DPO loss's gradient on it is zero) are left out and counted
    in the warnings."""
    from hpctrain.data import chat, preference

    src, out = Path(src), Path(out)
    files = corpus_files(src, JSONL)
    if not files:
        raise CorpusError(f"no .jsonl files under {src}. Fix: --format preference reads JSON lines")
    if tokenizer is None:
        raise TokenizerError("--format preference needs --tokenizer: the model's tokenizer.json (and, for "
                             "conversational pairs, the tokenizer_config.json beside it with its chat template)")
    if not seq_len or seq_len < 2:
        raise CorpusError("--format preference lays each sequence in a window of its own: give --seq-len N "
                          "(data.seq_len), at least 2")
    if _inside(out, src):
        raise OutputDirError(f"{out} is inside the corpus directory {src}. Fix: write the shards outside {src}")
    encoder = Encoder(tokenizer, eos)
    tok_files = _tokenizer_files(encoder)
    tok, template, kinds = encoder._load(), None, {}
    window = seq_len + 1  # a sequence's tokens: seq_len inputs, seq_len targets
    with outdir.replacing(out, TOOL) as tmp:
        pair_tokens = 2 * window
        shard_tokens = max(1, shard_bytes // np.dtype(encoder.dtype).itemsize // pair_tokens) * pair_tokens  # whole pairs
        writers = {s: _SplitWriter(tmp, s, encoder.dtype, shard_tokens) for s in SPLITS}
        pairs = {s: 0 for s in SPLITS}
        t0, stats = time.monotonic(), {"truncated": 0, "filled": [], "ties": []}
        for i, (record, where) in enumerate(_records(files)):
            record = preference.explicit(record, where)  # TRL's implicit prompt taken apart
            kind = preference.kind_of(record, where)
            file = where.rsplit(":", 1)[0]
            first, at = kinds.setdefault(file, (kind, where))
            if kind != first:  # TRL decides from a dataset's first record whether to append the EOS
                raise preference.PairError(f"{where}: a {kind} pair in a file of {first} pairs (from its first "
                                           f"record, {at}). Fix: one form per file")
            if kind == "conversational" and template is None:
                template = chat.ChatTemplate.of(encoder.path, budget)
            try:
                prompt, chosen, rejected = preference.tokenized(record, kind, tok, template, encoder.eos, where)
            except chat.ChatError as e:
                raise chat.ChatError(f"{where} (record {i + 1}): {e}") from None
            if not prompt:
                raise preference.PairError(
                    f"{where}: the prompt is empty once tokenized: a sequence's first token is never trained (it is "
                    f"no model's prediction), so it must be the prompt's. Fix: give the pair a prompt")
            if not chosen or not rejected:
                raise preference.PairError(f"{where}: the {'chosen' if not chosen else 'rejected'} completion has no "
                                           f"token of its own after the prompt: nothing to train on. Fix: drop "
                                           f"the pair")
            (c, cm, cut_c), (r, rm, cut_r) = (preference.sequence(prompt, x, window) for x in (chosen, rejected))
            if cut_c or cut_r:
                if too_long == "refuse":
                    n = len(prompt) + max(len(chosen), len(rejected))
                    raise CorpusError(f"{where}: {n:,} tokens (prompt and the longer completion), more than a "
                                      f"window of --seq-len {seq_len} + 1. Fix: --too-long truncate, a larger "
                                      f"--seq-len, or drop the pair")
                stats["truncated"] += 1
                if len(prompt) >= window:
                    stats["filled"].append(where)
                    continue
            if len(c) == len(r) and (c == r).all():
                stats["ties"].append(where)
                continue
            split = "val" if is_val(i, val_fraction, seed) else "train"
            w = writers[split]
            for ids, mask in ((c, cm), (r, rm)):  # a shard is written when it holds shard_tokens: whole pairs
                pad = window - len(ids)
                w.add(np.append(ids, np.full(pad, encoder.eos_id, np.int64)), np.append(mask, np.zeros(pad, np.uint8)))
            pairs[split] += 1
            if progress and i and i % 10000 == 0:
                progress(f"prepare: {i:,} pairs, {sum(x.tokens for x in writers.values()):,} tokens")
        if not any(pairs.values()):
            raise CorpusError(f"{src} holds no pair to train on ({len(stats['filled'])} with a prompt that fills "
                              f"--seq-len {seq_len}, {len(stats['ties'])} ties). Fix: one JSON object per line "
                              f"with a prompt, a chosen and a rejected answer")
        splits = {s: w.summary() | {"documents": pairs[s]} for s, w in writers.items() if pairs[s]}
        warnings = []
        if stats["truncated"]:
            warnings.append(f"{stats['truncated']} pair(s) with a sequence longer than --seq-len {seq_len} + 1 were "
                            f"truncated (their start kept)")
        for what, left in ((f"prompt fills --seq-len {seq_len} + 1: no completion token left", stats["filled"]),
                           ("chosen and rejected are the same tokens: no preference to learn", stats["ties"])):
            if left:
                warnings.append(f"{len(left)} pair(s) left out, their {what} (first: {left[0]})")
        if val_fraction > 0 and "val" not in splits:
            warnings.append(f"no validation split: none of the pairs fell in the {val_fraction:g} share. For "
                            f"validation, prepare again with a larger --val-fraction")
        meta = {"format": 2, "records": "preference", "pairs": True, "loss_mask": True, "packed": False,
                "window": seq_len, "stride": window, "vocab_size": encoder.vocab_size, "dtype": encoder.dtype, "eos_id": encoder.eos_id,
                "max_token_id": max(w.max_id for w in writers.values()),
                "tokenizer": _copy_tokenizer(encoder, tok_files, tmp), "val_fraction": val_fraction, "seed": seed,
                "files": len(files), "text_bytes": sum(f.stat().st_size for f in files),
                "documents": sum(pairs.values()), "splits": splits, "warnings": warnings,
                "seconds": round(time.monotonic() - t0, 3)}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        return meta


def _tokenizer_files(encoder: Encoder) -> dict[str, bytes]:
    """tokenizer.json, its config and chat template files, to copy beside the shards: training, export and
    generation then read the very tokenizer the ids came from. Read before the corpus, as the tokenizer
    and chat.py read them (tokenizer.side_file: regular files of bounded size inside the tokenizer's
    directory), so that one refused stops prepare at once and nothing from elsewhere reaches the shards."""
    from hpctrain.data.chat import TEMPLATE_FILES

    if encoder.path is None:
        return {}
    d = Path(encoder.path).parent
    files = {"tokenizer.json": encoder.raw()}
    for name in (*TEMPLATE_FILES, "tokenizer_config.json"):  # current transformers saves chat_template.jinja
        data = side_file(d, name)
        if data is not None:
            files[name] = data
    files.setdefault("tokenizer_config.json", json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": encoder.eos}, indent=1).encode())
    return files


def _copy_tokenizer(encoder: Encoder, files: dict[str, bytes], out: Path) -> dict:
    """`files` (_tokenizer_files) written into `out`; meta.json's "tokenizer"."""
    if encoder.path is None:
        return {"kind": "bytes", "eos": None}
    for name, data in files.items():
        (out / name).write_bytes(data)
    return {"kind": "hf", "file": "tokenizer.json", "eos": encoder.eos,
            "sha256": hashlib.sha256(files["tokenizer.json"]).hexdigest()}


def _line(nbytes: int, docs: int, tokens: int, seconds: float) -> str:
    return (f"prepare: {nbytes / 1e6:,.1f} MB of text, {docs:,} documents, {tokens:,} tokens, "
            f"{nbytes / 1e6 / max(seconds, 1e-9):,.2f} MB/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a corpus file or directory")
    ap.add_argument("out", type=Path, help="the shard directory to write (data.path)")
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or model directory (default: UTF-8 bytes)")
    ap.add_argument("--eos", help="the end-of-document token (default: tokenizer_config.json's, or a usual name)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="tokenizing processes, 0: in this process (default: the cores this process may use, %(default)s here)")
    ap.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="which documents go to validation (default: %(default)s)")
    ap.add_argument("--text-field", default="text", help="the JSON key or Parquet column holding the text (default: %(default)s)")
    ap.add_argument("--shard-mb", type=int, default=64, help="megabytes of tokens per shard file (default: %(default)s)")
    ap.add_argument("--format", choices=("text", "chat", "prompt", "preference"), default="text",
                    help="text: documents; chat: JSON lines of {\"messages\": [{role, content}]}, ShareGPT "
                         "{\"conversations\"} or Alpaca {instruction, input, output} records (the shape of each file "
                         "from its first record) rendered with the tokenizer's chat template, the loss on the "
                         "assistant's turns; prompt: {prompt, completion} lines, the loss on the completion; "
                         "preference: {prompt, chosen, rejected} pairs for DPO, tokenized as TRL's DPOTrainer does, "
                         "each sequence in a window of --seq-len (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="chat/prompt: lay records out in windows of data.seq_len tokens, none split across two "
                         "(0: packed back to back) (default: %(default)s)")
    ap.add_argument("--too-long", choices=("truncate", "refuse"), default="truncate",
                    help="chat/prompt with --seq-len: a record longer than a window (default: %(default)s)")
    ap.add_argument("--render-mb", type=float,
                    help="chat: the largest value or text (millions of characters) rendering one record with the chat "
                         "template may build; a record past it is refused (default: 16)")
    ap.add_argument("--render-seconds", type=float,
                    help="chat: the time rendering one record with the chat template may take; a record past it is "
                         "refused (default: 10)")
    ap.add_argument("--no-pack", action="store_true",
                    help="chat/prompt with --seq-len: one record per window, the rest padded (no document mask needed)")
    ap.add_argument("--ext", default=",".join(TEXT + JSONL + PARQUET), help="file endings to read, comma-separated (default: %(default)s)")
    args = ap.parse_args(argv)
    if not args.src.exists():
        print(f"error: {args.src} does not exist", file=sys.stderr)
        return 2
    if args.format == "preference" and not args.seq_len:
        print("error: --format preference lays each sequence in a window of its own: give --seq-len N (data.seq_len)",
              file=sys.stderr)
        return 2
    if args.format != "text" and args.no_pack and not args.seq_len:
        print("error: --no-pack pads each record to a window: give --seq-len (data.seq_len)", file=sys.stderr)
        return 2
    for flag, value in (("--render-mb", args.render_mb), ("--render-seconds", args.render_seconds)):
        renders = args.format in ("chat", "preference")
        if value is not None and (not renders or not value > 0):
            print(f"error: {flag} {value:g}: " + ("a budget must be above 0" if renders else
                  "only --format chat and preference render a template"), file=sys.stderr)
            return 2
    try:
        if args.format != "text":
            from hpctrain.data.chat import ChatError

            common = dict(eos=args.eos, val_fraction=args.val_fraction, seed=args.seed, too_long=args.too_long,
                          shard_bytes=args.shard_mb << 20, budget=_budget(args.render_mb, args.render_seconds),
                          progress=lambda line: print(line, file=sys.stderr, flush=True))
            try:
                if args.format == "preference":
                    meta = prepare_pairs(args.src, args.out, args.tokenizer, seq_len=args.seq_len, **common)
                else:
                    meta = prepare_records(args.src, args.out, args.tokenizer, args.format,
                                           seq_len=args.seq_len or None, pack=not args.no_pack, **common)
            except ChatError as e:
                raise CorpusError(str(e)) from None
        else:
            meta = prepare(args.src, args.out, args.tokenizer, eos=args.eos, workers=args.workers,
                           val_fraction=args.val_fraction, seed=args.seed, shard_bytes=args.shard_mb << 20,
                           exts=tuple(args.ext.split(",")), text_field=args.text_field,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (CorpusError, TokenizerError, OutputDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_line(meta["text_bytes"], meta["documents"], sum(s["tokens"] for s in meta["splits"].values()),
                meta["seconds"]))
    for name, s in meta["splits"].items():
        trained = f" ({s['trained_tokens']:,} trained)" if "trained_tokens" in s else ""
        unit = "pairs" if meta.get("pairs") else "documents"
        print(f"  {name}: {s['tokens']:,} tokens{trained}, {s['documents']:,} {unit}, {len(s['shards'])} shards")
    for w in meta["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"vocabulary {meta['vocab_size']:,} ({meta['dtype']}) -> {args.out}")
    print(next_command(meta, args.out, args.tokenizer))
    return 0


def _budget(mb: float | None, seconds: float | None):
    """--render-mb and --render-seconds as a render_budget.Budget (its defaults for those not given)."""
    from hpctrain.data.render_budget import Budget

    return Budget(seconds=seconds or Budget.seconds, chars=int(mb * 1e6) if mb else Budget.chars)


def next_command(meta: dict, out: Path, tokenizer: str | None) -> str:
    """The command line that trains on `out`: text from scratch; chat and prompt records fine-tune a
    Hugging Face model (+experiment=sft: model=hf, its shape from model.init_from's config.json, document
    masking on), preference pairs preference-tune it (+experiment=dpo), the one whose tokenizer this is
    where --tokenizer named a model directory."""
    path = shlex.quote(str(out.resolve()))
    window = f" data.seq_len={meta['window']}" if meta.get("window") else ""
    if not meta.get("loss_mask"):
        return (f"train on it with: python -m hpctrain data=shards data.path={path} "
                f"model.vocab_size={meta['vocab_size']}{window}")
    tok = Path(tokenizer) if tokenizer else None
    model = (tok if tok.is_dir() else tok.parent) if tok is not None else None
    experiment = "dpo" if meta.get("pairs") else "sft"
    if model is not None and (model / "config.json").is_file():
        return (f"fine-tune on it with: python -m hpctrain +experiment={experiment} model.init_from="
                f"{shlex.quote(str(model.resolve()))} data.path={path}{window}")
    return (f"fine-tune on it with: python -m hpctrain +experiment={experiment} model.init_from=MODEL_DIR data.path={path}"
            f"{window}\n  MODEL_DIR: the Hugging Face model to fine-tune (config.json, *.safetensors) whose tokenizer "
            f"this is")


if __name__ == "__main__":
    sys.exit(main())
