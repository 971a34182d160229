"""The documents of a corpus, in a fixed order: plain text files (one document each), JSON lines and
Parquet (one document per row, from a text field). The order is the sorted file paths, then the
order inside each file, so the same corpus always yields the same token stream."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

TEXT = (".txt", ".md", ".rst", ".py")
JSONL = (".jsonl", ".json")
PARQUET = (".parquet",)


class CorpusError(ValueError):
    """A corpus file that cannot be read as documents; the message names the file and the fix."""


def corpus_files(src: Path, exts: tuple[str, ...] = TEXT + JSONL + PARQUET) -> list[Path]:
    if src.is_file():
        return [src]
    return sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in exts)


def documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of one file."""
    if path.suffix in JSONL:
        yield from _jsonl(path, text_field)
    elif path.suffix in PARQUET:
        yield from _parquet(path, text_field)
    else:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield text


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
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
