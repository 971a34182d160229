"""Documents to token ids: any Hugging Face `tokenizer.json` (through the `tokenizers` library), or
UTF-8 bytes when none is given. Every document ends with the end-of-document id."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from hpctrain.data.shards import dtype_for

# Tried in order when neither --eos nor a tokenizer_config.json beside tokenizer.json names one.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and the fix."""


def tokenizer_file(path: str | os.PathLike) -> Path:
    """tokenizer.json itself, or the directory (a Hugging Face model) that holds it."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"{p} does not exist. Fix: pass a Hugging Face tokenizer.json (or the model directory "
                             f"that holds one), or make a small one: python -m hpctrain.data.example <dir>")
    return p


def configured_eos(tokenizer_json: Path) -> str | None:
    """The eos_token of the tokenizer_config.json beside tokenizer.json, where there is one."""
    from hpctrain.core.hf_format import read_small

    cfg = tokenizer_json.parent / "tokenizer_config.json"
    try:
        doc = json.loads(read_small(cfg))  # a regular file of bounded size (HFError, a ValueError, otherwise)
    except (ValueError, RecursionError):  # absent, not a plain file, not JSON, nested past the parser's depth
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
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
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

    def _load(self):
        if self._tok is None:
            try:
                self._tok = Tokenizer.from_file(self.path)
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
