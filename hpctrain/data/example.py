"""A small real corpus and its tokenizer, built on this machine with no download: the docstrings of
the Python standard library (English prose about programs), one JSON line per module docstring and per top-level class or function, and a byte-level
BPE tokenizer trained on them by the `tokenizers` library.

    python -m hpctrain.data.example OUT [--mb 2] [--vocab 2048]

writes OUT/corpus.jsonl, OUT/chat.jsonl (a question about each documented object, its docstring as the
answer: a fine-tuning set), OUT/preference.jsonl (the same question, its docstring chosen over an evasive
answer: a preference-tuning set), OUT/tokenizer.json and OUT/tokenizer_config.json (with a ChatML chat template);
then
`python -m hpctrain.data.prepare OUT/corpus.jsonl OUT/shards --tokenizer OUT/tokenizer.json --val-fraction 0.05`.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpctrain.core.outdir import OutputDirError, replacing

EOS = "<|endoftext|>"
TURN = ("<|im_start|>", "<|im_end|>")  # ChatML's turn markers, special tokens of the example tokenizer
# ChatML, the template of many chat models (Qwen, Hermes, ...): a turn is <|im_start|>ROLE\nTEXT<|im_end|>\n.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
SYSTEM = "You explain what the modules, classes and functions of Python's standard library are for."
KINDS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}


def stdlib_documents(limit_bytes: int) -> Iterator[dict]:
    """{"text", "module"} per documented standard-library module, class and function, in path order, until
    `limit_bytes` of text. Parsed, never imported."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        # One document per module docstring and per top-level class or function (with its methods').
        for node in [tree, *(n for n in tree.body if isinstance(n, KINDS))]:
            inner = node.body if node is not tree else []
            docs = [d for n in [node, *(m for sub in inner for m in ast.walk(sub))]
                    if isinstance(n, (ast.Module, *KINDS)) and (d := ast.get_docstring(n))]
            if not docs:
                continue
            text = "\n\n".join(docs)
            yield {"text": text, "module": module, "name": getattr(node, "name", None)}
            total += len(text.encode())
            if total >= limit_bytes:
                return


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (the GPT-2 / Llama 3 family's scheme): any text encodes, nothing is unknown."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *TURN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def conversation(doc: dict, i: int) -> dict:
    """A question about a documented object and its docstring's first paragraph as the answer; every
    third through a tool turn (the docstring looked up), every other with a system turn."""
    what = f"{doc['module']}.{doc['name']}" if doc["name"] else doc["module"]
    answer = doc["text"].split("\n\n")[0].strip()[:600]
    question = f"What is {what} for?"
    messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
    messages.append({"role": "user", "content": question})
    if i % 3 == 0:
        messages += [{"role": "assistant", "content": f"Looking up the documentation of {what}."},
                     {"role": "tool", "content": doc["text"][:800]}]
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def preference(docs: list[dict], i: int) -> dict:
    """A preference pair in TRL's conversational form: the question about object i, its docstring's first
    paragraph (the helpful answer) chosen over an evasive one (the kind of answer preference data teaches a
    model not to give)."""
    doc = docs[i]
    what = f"{doc['module']}.{doc['name']}" if doc["name"] else doc["module"]
    return {"prompt": [{"role": "user", "content": f"What is {what} for?"}],
            "chosen": [{"role": "assistant", "content": doc["text"].split("\n\n")[0].strip()[:600]}],
            "rejected": [{"role": "assistant", "content": f"I am not sure what {what} is for."}]}


def build(out: Path, megabytes: float = 2.0, vocab_size: int = 2048) -> dict:
    """Writes into an absent or empty `out`, or over its own earlier output (hpctrain.core.outdir)."""
    with replacing(out, "hpctrain.data.example") as tmp:
        docs = list(stdlib_documents(int(megabytes * 1e6)))
        with open(tmp / "corpus.jsonl", "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d["text"], "module": d["module"]}) + "\n")
        with open(tmp / "chat.jsonl", "w") as f:  # the fine-tuning example (docs/finetune.md)
            for i, d in enumerate(docs):
                f.write(json.dumps(conversation(d, i)) + "\n")
        with open(tmp / "preference.jsonl", "w") as f:  # the preference-tuning example (docs/finetune.md)
            for i in range(len(docs)):
                f.write(json.dumps(preference(docs, i)) + "\n")
        tok = train_tokenizer([d["text"] for d in docs], vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
            "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
            "additional_special_tokens": list(TURN)}, indent=1))
    return {"documents": len(docs), "bytes": sum(len(d["text"].encode()) for d in docs),
            "vocab_size": tok.get_vocab_size(with_added_tokens=True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.data.example", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("out", type=Path, help="a new or empty directory: corpus.jsonl, tokenizer.json, tokenizer_config.json")
    ap.add_argument("--mb", type=float, default=2.0, help="megabytes of text (the standard library has ~1.7) (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=2048, help="the tokenizer's vocabulary size (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        info = build(args.out, args.mb, args.vocab)
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{info['documents']} documents, {info['bytes'] / 1e6:.2f} MB -> {args.out / 'corpus.jsonl'}; "
          f"tokenizer with {info['vocab_size']} ids -> {args.out / 'tokenizer.json'}")
    print(f"next: python -m hpctrain.data.prepare {args.out / 'corpus.jsonl'} {args.out / 'shards'} "
          f"--tokenizer {args.out / 'tokenizer.json'} --val-fraction 0.05")  # the README's: 5% of ~2 MB to validate on
    return 0


if __name__ == "__main__":
    sys.exit(main())
