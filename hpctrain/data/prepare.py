"""Turn a directory of text files into byte-level token shards.

    python -m hpctrain.data.prepare <text dir> <out dir> [--shard-mb 64] [--ext .py,.txt,.md]

Token ids are the UTF-8 bytes of each file; documents are separated by byte 0, so the
vocabulary is 256. Any local corpus works, e.g. the Python standard library's sources.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


from hpctrain.data.shards import META

SEPARATOR = 0


def prepare(src: Path, out: Path, shard_bytes: int = 64 << 20, exts=(".py", ".txt", ".md", ".rst")) -> dict:
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in exts)
    if not files:
        raise SystemExit(f"no files ending in {', '.join(exts)} under {src}")
    out.mkdir(parents=True, exist_ok=True)
    shards, buf, total = [], bytearray(), 0

    def flush():
        nonlocal buf
        if buf:
            name = f"shard-{len(shards):05d}.bin"
            tmp = out / (name + ".tmp")
            tmp.write_bytes(bytes(buf))
            os.replace(tmp, out / name)
            shards.append({"file": name, "tokens": len(buf)})
            buf = bytearray()

    for f in files:
        data = f.read_bytes().replace(b"\0", b"")
        buf += data + bytes([SEPARATOR])
        total += len(data) + 1
        if len(buf) >= shard_bytes:
            flush()
    flush()
    meta = {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8", "separator": SEPARATOR,
            "total_tokens": total, "files": len(files), "shards": shards}
    (out / META).write_text(json.dumps(meta, indent=1))
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--ext", default=".py,.txt,.md,.rst")
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        print(f"error: {args.src} is not a directory", file=sys.stderr)
        return 2
    meta = prepare(args.src, args.out, args.shard_mb << 20, tuple(args.ext.split(",")))
    print(f"{meta['total_tokens']:,} tokens from {meta['files']} files in {len(meta['shards'])} shards -> {args.out}")
    print(f"train on it with: python -m hpctrain data=shards data.path={args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
