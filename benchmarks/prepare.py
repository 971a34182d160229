"""Prepare throughput: MB of text per second per core, `python -m hpctrain.data.prepare` beside a plain
`tokenizers` batch-encode loop over the same documents, both measured in this run.

    python benchmarks/prepare.py [--mb 32] [--vocab 16384] [--reps 3] [--out DIR]

The corpus is the example corpus (standard-library docstrings, hpctrain.data.example) repeated to
--mb megabytes of text as JSON lines, with a byte-level BPE of --vocab ids trained on it. Each
measurement is a fresh process, in rotating order, median of --reps:

- baseline, 1 core: read the JSON lines and `Tokenizer.encode_batch_fast` 1 MB batches with the
  library's own parallelism off (TOKENIZERS_PARALLELISM=false); nothing is written;
- baseline, all cores: the same with the library's thread pool on every core;
- prepare with 1 worker and with one worker per core: the whole command (start-up, read, tokenize,
  split, write the shards and the index).

Every process is pinned (taskset) to the cores it is credited with: prepare's main process, which
reads and writes, shares them with its workers.

MB is 1e6 bytes of the documents' UTF-8 text. Writes results.json and prepare.png under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_corpus(out: Path, megabytes: float, vocab: int) -> tuple[Path, Path, int]:
    from hpctrain.data.example import build

    build(out / "example", megabytes=2.0, vocab_size=vocab)
    lines = (out / "example" / "corpus.jsonl").read_text().splitlines()
    docs = [json.loads(x)["text"] for x in lines]
    one = sum(len(d.encode()) for d in docs)
    copies = max(1, round(megabytes * 1e6 / one))
    with open(out / "corpus.jsonl", "w") as f:
        for _ in range(copies):
            f.write("\n".join(lines) + "\n")
    return out / "corpus.jsonl", out / "example" / "tokenizer.json", copies * one


def baseline(corpus: str, tokenizer: str) -> float:
    """Seconds for the plain loop: JSON lines in, ids out, in 1 MB batches."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    batch, chars, n = [], 0, 0
    with open(corpus) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            chars += len(batch[-1])
            if chars >= 1 << 20:
                n += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
                batch, chars = [], 0
    n += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
    return time.perf_counter() - t0


def timed(kind: str, corpus: Path, tok: Path, cores: int, scratch: Path) -> float:
    env = dict(os.environ)
    # Pinned to `cores` CPUs: prepare's reading and writing process counts against its cores too.
    pin = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:cores]))]
    if kind.startswith("baseline"):
        if cores == 1:
            env["TOKENIZERS_PARALLELISM"] = "false"
        else:
            env["RAYON_NUM_THREADS"] = str(cores)
        cmd = [*pin, sys.executable, __file__, "--baseline", str(corpus), str(tok)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        return float(out.split()[-1])
    t0 = time.perf_counter()
    subprocess.run([*pin, sys.executable, "-m", "hpctrain.data.prepare", str(corpus), str(scratch), "--tokenizer", str(tok),
                    "--workers", str(cores)], cwd=REPO, env=env, capture_output=True, check=True)
    return time.perf_counter() - t0  # the whole command, start-up included


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["per_core_mb_s"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(names, [results["per_core_mb_s"][n] for n in names], color=["#888", "#888", "#2a7", "#2a7"])
    for i, n in enumerate(names):
        ax.text(results["per_core_mb_s"][n], i, f" {results['per_core_mb_s'][n]:.2f}", va="center")
    ax.set_xlabel("MB of text per second per core")
    ax.set_title(f"prepare vs a plain tokenizers loop ({results['mb']:.0f} MB, vocab {results['vocab']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--baseline":
        print(baseline(sys.argv[2], sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("outputs/bench-prepare"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    corpus, tok, nbytes = make_corpus(a.out, a.mb, a.vocab)
    runs = [("baseline", 1), ("baseline", cores), ("prepare", 1), ("prepare", cores)]
    times: dict = {f"{k}, {c} core{'s' * (c > 1)}": [] for k, c in runs}
    for rep in range(a.reps):
        for i in range(len(runs)):
            k, c = runs[(i + rep) % len(runs)]  # rotate the order: no position is always first
            s = timed(k, corpus, tok, c, a.out / "shards")
            times[f"{k}, {c} core{'s' * (c > 1)}"].append(s)
            print(f"rep {rep + 1}/{a.reps}  {k:8s} {c} core(s): {nbytes / 1e6 / s:6.2f} MB/s", flush=True)
    mb_s = {n: nbytes / 1e6 / statistics.median(t) for n, t in times.items()}
    per_core = {n: v / (1 if n.endswith(" 1 core") else cores) for n, v in mb_s.items()}
    one, many = "1 core", f"{cores} cores"
    results = {"mb": nbytes / 1e6, "vocab": a.vocab, "cores": cores, "seconds": times, "mb_s": mb_s,
               "per_core_mb_s": per_core,
               "ratio_1_core": mb_s[f"prepare, {one}"] / mb_s[f"baseline, {one}"],
               "ratio_all_cores": mb_s[f"prepare, {many}"] / mb_s[f"baseline, {many}"]}
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, a.out / "prepare.png")
    print(f"\n{nbytes / 1e6:.1f} MB of text, vocab {a.vocab}, {cores} cores (median of {a.reps})")
    for n in mb_s:
        print(f"  {n:24s} {mb_s[n]:6.2f} MB/s  {per_core[n]:6.2f} MB/s per core")
    print(f"prepare / plain tokenizers loop: {results['ratio_1_core']:.2f} on 1 core, "
          f"{results['ratio_all_cores']:.2f} on {cores}")
    print(f"results: {a.out / 'results.json'}, plot: {a.out / 'prepare.png'}")


if __name__ == "__main__":
    main()
