"""What tests/test_dpo.py shares with its ranks: a tiny Llama (transformers' own, fp32), preference records over
a word-level tokenizer, preference shards written as the preference-shard contract says (docs/finetune.md), and
the engine's DPO steps. As a script, the multi-rank side:

    python tests/dpo_worker.py OUT.json HF_DIR SHARDS STEPS 'layout' ...   # {layout: figures per step}
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

VOCAB, WORDS = 64, 60  # ids 0 <pad>, 1 </s>, 2.. the words
N = 12  # data.seq_len: every sequence of RECORDS fits a window of N + 1 tokens
FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def records(n: int = 20, seed: int = 0) -> list[dict]:
    """n plain-text preference records, prompts of 2-5 words, completions of 1-6."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in rng.integers(0, WORDS, k))
    return [{"prompt": words(rng.integers(2, 6)), "chosen": " " + words(rng.integers(1, 7)),
             "rejected": " " + words(rng.integers(1, 7))} for _ in range(n)]


def tokenizer():
    """A word-level tokenizer: w<i> is id i + 2, </s> (eos) 1, <pad> 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) + 2 for w in text.split()]


def hf_model(out: Path, hidden: int = 32, ffn: int = 64, kv_heads: int = 2) -> Path:
    """A tiny LlamaForCausalLM (fp32, no dropout, untied output) saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=1,
                      pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def write_shards(recs: list[dict], out: Path, seq_len: int = N) -> Path:
    """Preference shards as the contract lays them out: pair j = windows 2j (prompt + chosen) and 2j + 1
    (prompt + rejected) of seq_len + 1 tokens each, padded with eos; the mask 1 on the completion only;
    meta.json with "pairs": true. (What prepare --format preference writes, without a tokenizer: the
    ids of the words, eos appended to each completion, as TRL does to plain text.)"""
    out.mkdir(parents=True, exist_ok=True)
    w = seq_len + 1
    ids, mask = [], []
    for r in recs:
        for completion in (r["chosen"], r["rejected"]):
            p, c = ids_of(r["prompt"]), ids_of(completion) + [1]
            seq = p + c
            assert len(seq) <= w
            ids += seq + [1] * (w - len(seq))
            mask += [0] * len(p) + [1] * len(c) + [0] * (w - len(seq))
    np.asarray(ids, np.uint8).tofile(out / "train-00000.bin")
    np.asarray(mask, np.uint8).tofile(out / "train-00000.mask")
    meta = {"format": 2, "records": "preference", "pairs": True, "packed": False, "window": seq_len,
            "loss_mask": True, "vocab_size": VOCAB, "dtype": "uint8", "eos_id": 1, "max_token_id": max(ids),
            "splits": {"train": {"shards": [{"file": "train-00000.bin", "mask": "train-00000.mask",
                                             "tokens": len(ids)}], "tokens": len(ids)}}}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def overrides(hf: Path, shards: Path, steps: int) -> list[str]:
    """The engine's side of every comparison: AdamW as torch's (betas 0.9/0.999, no weight decay), a constant
    learning rate (no warmup, min_lr_ratio 1), clipping at 1, fp32, the whole logits or chunks alike."""
    return ["+experiment=dpo", f"model.init_from={hf}", f"data.path={shards}", f"data.seq_len={N}",
            f"train.steps={steps}", "train.global_batch=2", "train.micro_batch=1", "optim.lr=1e-2",
            "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "optim.weight_decay=0.0", "optim.beta2=0.999",
            "optim.grad_clip=1.0", "eval.every=0", "checkpoint.every=0", "checkpoint.final=false",
            "train.dpo.beta=0.2"]


def engine_steps(trainer, steps: int) -> dict:
    """FIGURES per step of `steps` DPO steps of a Trainer (its model from model.init_from)."""
    trainer.resume(print)
    out = {k: [] for k in FIGURES}
    for _ in range(steps):
        loss, _ = trainer.train_step()
        out["loss"].append(loss.item())
        for k, v in trainer.dpo_metrics.items():
            out[k].append(v)
    return out


def main() -> None:
    import torch

    from hpctrain.train.loop import Trainer
    from rank_worker import compose_once, over_layouts, run_rank_of_layouts

    out, hf, shards, steps, layouts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]

    def one(spec: str, d: str, de) -> dict:
        run = os.path.join(d, "run") if de.rank == 0 else os.path.join(d, "other")
        cfg = compose_once([*overrides(Path(hf), Path(shards), steps), f"launcher.nproc={de.world}",
                            *spec.split()], run)
        return engine_steps(Trainer.of(cfg, run, torch.device("cpu")), steps)

    run_rank_of_layouts(lambda: over_layouts(out, layouts, one))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
