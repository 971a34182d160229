"""`prepare --format preference` (hpctrain.data.preference) against TRL 1.16: the same records through
DPOTrainer._prepare_dataset (its tokenize_fn, its EOS for plain pairs, its filter of pairs whose prompt
fills max_length) and DataCollatorForPreference (keep_start truncation, the completion mask) give the
rows our windows hold; meta.json, held-out pairs, and the refusals."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.data import chat
from hpctrain.data.prepare import main, prepare_pairs

from test_record_shapes import QWEN, TOOLS, tokenizer_dir, write_jsonl

N = 40  # --seq-len: some pairs below fit, some are cut, one prompt fills it
N_CHAT = 480  # Qwen's tools block alone is 423 tokens of the example tokenizer
PLAIN = [
    {"prompt": "Question: what does os.path.join do? Answer:", "chosen": " It joins path parts.",
     "rejected": " It deletes files."},
    {"prompt": "The sum of 2 and 3 is ", "chosen": "5", "rejected": "six<|endoftext|>"},  # one ends in the EOS
    {"prompt": "Name a sorting function:", "chosen": " sorted", "rejected": " sort of " * 12},  # cut
    {"prompt": "Long context " * 30, "chosen": " yes", "rejected": " no"},  # the prompt fills the window
    {"prompt": "Return the", "chosen": "n", "rejected": "re"},  # merges across the boundary
    {"prompt": "Which module parses JSON?", "chosen": " json", "rejected": " pickle"},
    {"prompt": "Is 7 prime?", "chosen": " Yes.", "rejected": " No."},
    {"prompt": "Reverse a list with", "chosen": " reversed()", "rejected": " list.sort()"},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4."}], "rejected": [{"role": "assistant", "content": "5."}]},
    {"prompt": [{"role": "user", "content": "Weather in Paris?"}], "tools": json.dumps(TOOLS),
     "chosen": [{"role": "assistant", "content": "Let me check the weather."}],
     "rejected": [{"role": "assistant", "content": "It rains " * 20}]},  # cut
    {"prompt": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Again."}],
     "chosen": [{"role": "assistant", "content": "Hi again."}], "rejected": [{"role": "assistant", "content": "No."}]},
    {"prompt": [{"role": "user", "content": "Capital of Italy?"}],
     "chosen": [{"role": "assistant", "content": "Rome."}], "rejected": [{"role": "assistant", "content": "Milan."}]},
]


def trl_rows(records: list, theirs, max_length: int) -> list[tuple]:
    """((chosen ids, chosen mask), (rejected ids, rejected mask)) per pair, from TRL's own code."""
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    trainer = SimpleNamespace(_tokenizer=theirs)  # all _prepare_dataset reads of the trainer
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    columns = {k: [r.get(k) for r in records] for k in dict.fromkeys(k for r in records for k in r)}
    ds = DPOTrainer._prepare_dataset(trainer, Dataset.from_dict(columns), theirs, args, "train")  # from_list would
    # keep only the first record's keys
    collate = DataCollatorForPreference(pad_token_id=theirs.eos_token_id, max_length=max_length)
    rows = []
    for ex in ds:
        b = collate([{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        seqs = [(ids[a.bool()].tolist(), m[a.bool()].tolist()) for ids, a, m in
                zip(b["input_ids"], b["attention_mask"], b["completion_mask"])]
        rows.append(tuple(seqs))
    return rows


def our_rows(out: Path, split: str, meta: dict) -> list[tuple]:
    """The pairs of a split as the DPO side reads them (hpctrain.data.shards: item j, chosen and rejected,
    each seq_len + 1 ids and their mask), as ((ids, mask), (ids, mask)) with the padding checked and taken off."""
    from hpctrain.data.shards import ShardDataset

    n = meta["window"]
    shards = meta["splits"][split]["shards"]
    assert all(s["tokens"] % (2 * (n + 1)) == 0 for s in shards)  # whole pairs of two windows of n + 1 tokens
    assert sum(s["tokens"] for s in shards) == 2 * (n + 1) * meta["splits"][split]["documents"]
    ds = ShardDataset(out, n, split)
    assert len(ds) == meta["splits"][split]["documents"]
    rows = []
    for j in range(len(ds)):
        pair = []
        for w, m in zip(ds[j], ds.loss_mask(j)):
            k = int(np.flatnonzero(m)[-1]) + 1  # past the last trained token: padding only
            assert (w[k:] == meta["eos_id"]).all() and m[0] == 0
            pair.append((w[:k].tolist(), m[:k].tolist()))
        rows.append(tuple(pair))
    return rows


@pytest.fixture(scope="module")
def bos_tokenizer(example_corpus, tmp_path_factory) -> Path:
    """A tokenizer whose post-processor adds a BOS (as Llama 3's tokenizer.json does), with Qwen's template."""
    from tokenizers import Tokenizer, processors

    d = tokenizer_dir(example_corpus, tmp_path_factory.mktemp("pref"), QWEN, "qwen")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("kind", ["plain", "conversational"])
def test_pairs_hold_trls_ids_and_completion_mask(bos_tokenizer, tmp_path, kind):
    """Mutants: plain text tokenized without the tokenizer's added BOS (TRL's tokenizer(text) adds it), the
    EOS not appended or appended twice, the completion taken to start after the whole tokenized prompt
    rather than where the ids diverge ("Return the" + "n"), the conversational prompt without the generation
    prompt (its header trained), tools not passed, the mask on the prompt or off by one, truncation keeping
    the end, the pair whose prompt fills the window kept, a pair's two windows split apart or swapped,
    validation pairs not held out whole."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(bos_tokenizer))
    records, n = (PLAIN, N) if kind == "plain" else (CONVERSATIONAL, N_CHAT)
    out = tmp_path / "out"
    meta = prepare_pairs(write_jsonl(tmp_path / "p.jsonl", records), out, bos_tokenizer, seq_len=n, val_fraction=0.3,
                         seed=2)
    want = trl_rows(records, theirs, n + 1)  # a window: seq_len inputs and their targets
    got = {s: our_rows(out, s, meta) for s in ("train", "val")}
    # held out whole: each split's pairs are TRL's, in order, and together all of them once
    assert got["train"] and got["val"] and sorted(got["train"] + got["val"]) == sorted(want)
    for rows in got.values():
        assert [want.index(r) for r in rows] == sorted(want.index(r) for r in rows)
    assert {k: meta[k] for k in ("records", "pairs", "packed", "window", "loss_mask")} == \
        {"records": "preference", "pairs": True, "packed": False, "window": n, "loss_mask": True}
    assert meta["stride"] == n + 1
    assert meta["documents"] == len(want) == sum(meta["splits"][s]["documents"] for s in ("train", "val"))
    assert meta["splits"]["train"]["trained_tokens"] == sum(sum(m) for pair in got["train"] for _, m in pair)
    dropped = len(records) - len(want)
    assert dropped == (1 if kind == "plain" else 0)
    assert any(f"pair(s) with a sequence longer than --seq-len {n} + 1 were truncated" in w for w in meta["warnings"])
    if dropped:
        assert f"1 pair(s) left out, their prompt fills --seq-len {N} + 1: no completion token left (first: " \
               f"{tmp_path / 'p.jsonl'}:4)" in meta["warnings"]
    assert not any("same tokens" in w for w in meta["warnings"])  # said as what it is, not as a tie


def test_preference_refusals_ties_and_the_command_line(example_corpus, tmp_path, capsys):
    """Mutants: an empty prompt accepted (the first completion token would be a window's untrained first
    token), --too-long refuse truncating, a tie kept (or refusing the whole prepare), a file mixing plain and
    conversational pairs read pair by pair, the sft experiment printed for pairs, --seq-len not required."""
    tok = example_corpus / "tokenizer.json"  # no BOS: an empty prompt is no token at all

    def refused(name: str, records: list, **kw) -> str:
        with pytest.raises(Exception) as e:
            prepare_pairs(write_jsonl(tmp_path / f"{name}.jsonl", records), tmp_path / name, tok, seq_len=N, **kw)
        assert not (tmp_path / name).exists()
        return str(e.value)

    assert "the prompt is empty once tokenized" in refused("empty", [{"prompt": "", "chosen": "a", "rejected": "b"}])
    assert f"more than a window of --seq-len {N} + 1. Fix: --too-long truncate" in \
        refused("long", PLAIN[2:3], too_long="refuse")
    said = refused("mixed", [PLAIN[0], CONVERSATIONAL[0]])
    assert f"{tmp_path / 'mixed.jsonl'}:2: a conversational pair in a file of plain pairs" in said
    assert "without a prompt of their form, \"chosen\" and \"rejected\" must be two strings or two lists" in \
        refused("implicit", [{"chosen": "a b", "rejected": [{"role": "assistant", "content": "a c"}]}])
    assert "needs \"prompt\", \"chosen\" and \"rejected\"; prompt, rejected missing" in \
        refused("half", [{"chosen": "a b"}])
    with pytest.raises(chat.ChatError, match="has no chat_template"):  # conversational pairs need a template
        base = tmp_path / "base"
        base.mkdir()
        (base / "tokenizer.json").write_bytes(tok.read_bytes())
        (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
        prepare_pairs(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONAL), tmp_path / "c", base, seq_len=N)
    # a tie is left out and said; the rest is prepared; the line to train on it names the dpo experiment
    src = write_jsonl(tmp_path / "ties.jsonl", [PLAIN[0], {"prompt": "Hi", "chosen": " there", "rejected": " there"}])
    assert main([str(src), str(tmp_path / "s"), "--tokenizer", str(tok), "--format", "preference",
                 "--seq-len", str(N), "--val-fraction", "0"]) == 0
    got = capsys.readouterr()
    assert f"python -m hpctrain +experiment=dpo model.init_from=MODEL_DIR data.path={(tmp_path / 's').resolve()} " \
           f"data.seq_len={N}\n" in got.out and "  train: " in got.out and " 1 pairs, 1 shards" in got.out
    assert f"1 pair(s) left out, their chosen and rejected are the same tokens: no preference to learn (first: " \
           f"{src}:2)" in got.err
    assert main([str(src), str(tmp_path / "t"), "--tokenizer", str(tok), "--format", "preference"]) == 2
    assert "--format preference lays each sequence in a window of its own: give --seq-len N" in capsys.readouterr().err


# TRL's implicit-prompt form: Anthropic HH's strings (the prompt inside chosen and rejected), conversations that
# start with the user's turns, and UltraFeedback binarized's string prompt beside conversations that hold it.
HH = [
    {"chosen": "\n\nHuman: What does os.path.join do?\n\nAssistant: It joins path parts.",
     "rejected": "\n\nHuman: What does os.path.join do?\n\nAssistant: It deletes files."},
    {"chosen": "\n\nHuman: Is 7 prime?\n\nAssistant: Yes.", "rejected": "\n\nHuman: Is 7 prime?\n\nAssistant: No."},
]
ULTRAFEEDBACK = [
    {"prompt": "What is 2 + 2?", "prompt_id": "a1", "score_chosen": 9.0, "score_rejected": 2.0,
     "chosen": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
     "rejected": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "5."}]},
    {"chosen": [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."}],
     "rejected": [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Milan."}]},
]


@pytest.mark.parametrize("kind", ["hh", "ultrafeedback"])
def test_implicit_prompts_are_taken_apart_as_trl_does(bos_tokenizer, tmp_path, kind):
    """The pairs equal TRL's: its maybe_extract_prompt on each record, then DPOTrainer._prepare_dataset and the
    collator. Mutants: the whole common prefix taken as the prompt (TRL gives the space before the divergence
    to the completion); UltraFeedback's string prompt kept beside conversations (TRL's tokenize_fn fails on it,
    its maybe_extract_prompt takes it apart); the implicit form refused."""
    from transformers import AutoTokenizer
    from trl.data_utils import maybe_extract_prompt

    theirs = AutoTokenizer.from_pretrained(str(bos_tokenizer))
    records, n = (HH, N) if kind == "hh" else (ULTRAFEEDBACK, N_CHAT)
    out = tmp_path / "out"
    meta = prepare_pairs(write_jsonl(tmp_path / "p.jsonl", records), out, bos_tokenizer, seq_len=n, val_fraction=0)
    trl_records = [{k: v for k, v in maybe_extract_prompt(r).items() if k in ("prompt", "chosen", "rejected")}
                   for r in records]
    assert our_rows(out, "train", meta) == trl_rows(trl_records, theirs, n + 1)
