"""The documents of a corpus, in a fixed order: plain text files (one document each), JSON lines and
Parquet (one document per row, from a text field). The order is the sorted file paths, then the
order inside each file, so the same corpus always yields the same token stream.

A corpus entry with a listed ending that is not a regular file (a FIFO, a device, a link to nothing) is
refused by kind rather than read (a FIFO waits for a writer, /dev/zero never ends) or skipped. A text
file (one document) and a JSON line are read only up to DOCUMENT_CHARS: the size is known before the
text is in memory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

TEXT = (".txt", ".md", ".rst", ".py")
JSONL = (".jsonl", ".json")
PARQUET = (".parquet",)
DOCUMENT_CHARS = 1 << 28  # one document, or one JSON line: far past any (a book is a few MB)


class CorpusError(ValueError):
    """A corpus file that cannot be read as documents; the message names the file and the fix."""


def corpus_files(src: Path, exts: tuple[str, ...] = TEXT + JSONL + PARQUET) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        _refuse_kind(src, "Fix: point at a corpus file or directory")
    files = sorted(p for p in src.rglob("*") if p.suffix in exts and not p.is_dir())
    for p in files:
        if not p.is_file():
            _refuse_kind(p, f"Fix: remove it from {src}, or leave its ending out of --ext")
    return files


def _refuse_kind(path: Path, fix: str):
    from hpctrain.core.hf_format import HFError, read_small

    try:
        read_small(path, 0)  # says what it is (a FIFO, a device) without reading it
    except HFError as e:
        raise CorpusError(f"{str(e).split('. Fix:')[0]}: not a file of documents. {fix}") from None
    raise CorpusError(f"{path} is not a file of documents. {fix}")


def json_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of `path`, none longer than DOCUMENT_CHARS."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(iter(lambda: f.readline(DOCUMENT_CHARS + 1), ""), 1):
            if len(line) > DOCUMENT_CHARS:
                raise CorpusError(f"{path}:{n} is longer than {DOCUMENT_CHARS:,} characters: not a JSON line (one "
                                  f"JSON array in one line?). Fix: one JSON object per line, e.g. jq -c '.[]' {path}")
            if line.strip():
                yield n, line


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one file."""
    if path.suffix in JSONL:
        yield from _jsonl(path, text_field)
    elif path.suffix in PARQUET:
        yield from _parquet(path, text_field)
    else:
        text = _text_file(path).decode("utf-8", errors="replace")
        if text.strip():
            yield text


def _text_file(path: Path) -> bytes:
    from hpctrain.core.hf_format import HFError, read_small

    try:
        return read_small(path, DOCUMENT_CHARS)
    except HFError as e:
        raise CorpusError(f"{str(e).split('. Fix:')[0]}: a text file is one document. Fix: split it into files of "
                          f"at most {DOCUMENT_CHARS:,} bytes, or into JSON lines (one document each)") from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    for n, line in json_lines(path):
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CorpusError(f"{path}:{n} is not a JSON object ({e}). Fix: one JSON object per line") from None
        text = row.get(field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            keys = sorted(row) if isinstance(row, dict) else []
            raise CorpusError(f"{path}:{n} has no text field {field!r} (keys: {keys}). "
                              f"Fix: --text-field <the key that holds the text>")
        if text.strip():
            yield text


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        # optional dependency (pyarrow, the parquet extra)
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path} is Parquet, which needs pyarrow. Fix: pip install pyarrow") from None
    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    if field not in names:
        raise CorpusError(f"{path} has no column {field!r} (columns: {names}). "
                          f"Fix: --text-field <the column that holds the text>")
    for batch in f.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text and text.strip():
                yield text
