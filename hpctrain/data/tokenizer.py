"""Documents to token ids: any Hugging Face `tokenizer.json` (through the `tokenizers` library), or
UTF-8 bytes when none is given. Every document ends with the end-of-document id.

The files of a tokenizer directory (tokenizer.json, tokenizer_config.json, chat templates) are read with
`side_file` only: a regular file of bounded size whose real path lies inside the directory. prepare copies
them beside the shards, so a symlink to a file elsewhere (a key, a config of another program) would carry
that file into a directory that gets shared."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from hpctrain.data.shards import dtype_for

# Tried in order when neither --eos nor a tokenizer_config.json beside tokenizer.json names one.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# Published tokenizer.json files are at most ~35 MB (256k-token vocabularies with their merges).
TOKENIZER_BYTES = 256 << 20


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and the fix."""


def side_file(directory: Path, name: str, limit: int | None = None) -> bytes | None:
    """The bytes of directory/name, None when it is absent; TokenizerError when it is not a regular file of
    at most `limit` bytes (hf_format.read_small) or leads outside `directory` once symlinks are resolved
    (hf_format.inside)."""
    from hpctrain.core.hf_format import HFError, inside, read_small

    real, why = inside(directory, name)
    if real is None and why is None:
        return None
    try:  # what it is first (a FIFO, a device, too large), then where it is
        data = read_small(real if real is not None else Path(directory) / name, limit)
    except HFError as e:
        raise TokenizerError(str(e)) from None
    if real is None:
        raise TokenizerError(f"{why}: a tokenizer's files are read from its own directory only (prepare copies "
                             f"them beside the shards). Fix: copy the file into {directory} if it belongs to this "
                             f"tokenizer, or remove the link")
    return data


def tokenizer_file(path: str | os.PathLike) -> Path:
    """tokenizer.json itself, or the directory (a Hugging Face model) that holds it."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not (p.exists() or p.is_symlink()):
        raise TokenizerError(f"{p} does not exist. Fix: pass a Hugging Face tokenizer.json (or the model directory "
                             f"that holds one), or make a small one: python -m hpctrain.data.example <dir>")
    return p


def configured_eos(tokenizer_json: Path) -> str | None:
    """The eos_token of the tokenizer_config.json beside tokenizer.json, where there is one (its content
    only suggests the token: not JSON is no suggestion; a FIFO, a device or a link outside is refused)."""
    raw = side_file(tokenizer_json.parent, "tokenizer_config.json")
    try:
        doc = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # not JSON, nested past the parser's depth
        return None
    eos = doc.get("eos_token") if isinstance(doc, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


class Encoder:
    """Picklable description of a tokenizer; `encode` loads it on first use (in each worker)."""

    def __init__(self, path: str | os.PathLike | None = None, eos: str | None = None):
        self.path = str(tokenizer_file(path)) if path is not None else None
        self._tok = None
        if self.path is None:
            self.vocab_size, self.eos, self.eos_id = 256, None, 0  # bytes: NUL separates documents
            self.dtype = "uint8"
            return
        tok = self._load()
        # Ids are not always 0..count-1 (a vocabulary with gaps): the shards' dtype must hold the largest.
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True),
                              max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        self.eos = eos or configured_eos(Path(self.path)) or next(
            (name for name in EOS_NAMES if tok.token_to_id(name) is not None), None)
        if self.eos is None:
            raise TokenizerError(f"{self.path} has none of the usual end-of-document tokens {list(EOS_NAMES)}. "
                                 f"Fix: --eos <its end-of-document token>")
        self.eos_id = tok.token_to_id(self.eos)
        if self.eos_id is None:
            raise TokenizerError(f"{self.path} has no token {self.eos!r}. Fix: --eos <a token it has>")
        self.dtype = dtype_for(self.vocab_size)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tok"} | {"_tok": None}

    def raw(self) -> bytes:
        """tokenizer.json's bytes, read as the other files of its directory are (side_file)."""
        p = Path(self.path)
        data = side_file(p.parent, p.name, TOKENIZER_BYTES)
        if data is None:
            raise TokenizerError(f"{p} does not exist (any more). Fix: pass the tokenizer again")
        return data

    def _load(self):
        if self._tok is None:
            try:
                self._tok = Tokenizer.from_str(self.raw().decode("utf-8"))
            except (TokenizerError, OSError):
                raise
            except Exception as e:  # the Rust side reports a parse error as a plain Exception
                raise TokenizerError(f"{self.path} is not a tokenizers JSON file ({e})") from None
        return self._tok

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths): the documents' ids, each followed by the end-of-document id, concatenated."""
        if self.path is None:
            parts = [np.frombuffer(t.encode("utf-8").replace(b"\0", b"") + b"\0", np.uint8) for t in texts]
        else:
            tok = self._load()
            encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets
            encs = encode(texts, add_special_tokens=False)
            parts = [np.array(e.ids + [self.eos_id], dtype=self.dtype) for e in encs]
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        return (np.concatenate(parts).astype(self.dtype, copy=False) if parts else np.zeros(0, self.dtype)), lengths
