"""Preference pairs to token ids: prompt, chosen and rejected, tokenized as TRL's DPOTrainer does.

A record is {"prompt", "chosen", "rejected"} (TRL's explicit-prompt preference format): plain strings, or
conversational (the prompt a list of messages, chosen and rejected lists of assistant messages; optional
"tools", a list or that list as a JSON string); or TRL's implicit-prompt form, chosen and rejected each
holding the prompt (`explicit` takes it apart as TRL does). As TRL 1.16's DPOTrainer._prepare_dataset tokenizes it:

- plain: the tokenizer's end-of-sequence token is appended to chosen and rejected where they do not end
  with it; the prompt, prompt + chosen and prompt + rejected are each tokenized with the tokenizer's added
  special tokens (its post-processor: a BOS where tokenizer.json adds one), as `tokenizer(text)` does;
- conversational: the prompt rendered with the chat template and the generation prompt, prompt + chosen and
  prompt + rejected rendered without it, each tokenized without added special tokens (apply_chat_template);
- the completion starts where the prompt's ids and the longer sequences' ids first differ (the shorter of
  the two common prefixes), so a template or a merge across the boundary never makes the prompt lose a
  token it shares with the completion.

A pair is then two sequences, prompt + chosen and prompt + rejected, trained on the completion's tokens
only (TRL's completion_mask).
"""
from __future__ import annotations

import json

import numpy as np

from hpctrain.data.chat import ChatError


class PairError(ChatError):
    """A preference record that cannot be tokenized; the message names the line and the fix."""


def _conversational(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)


def explicit(record, where: str):
    """The record with its prompt apart, as TRL 1.16's maybe_extract_prompt makes it: a record of chosen and
    rejected alone, each holding the prompt (Anthropic HH's "\n\nHuman: ... \n\nAssistant: ..." strings,
    conversations that start with the user's turns), or whose prompt is of the other form than chosen
    (UltraFeedback binarized: the prompt as a string beside conversations that hold it), gets the longest
    common prefix of chosen and rejected as its prompt (messages, or characters less a space before the
    divergence), TRL's extract_prompt, its end case included (no difference inside the shorter: the prompt
    stops one before its end). Others are returned as they are."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        return record
    if "prompt" in record and _conversational(record["prompt"]) == _conversational(record["chosen"]):
        return record
    c, r = record["chosen"], record["rejected"]
    if not (isinstance(c, str) and isinstance(r, str) or _conversational(c) and _conversational(r)):
        raise PairError(f"{where}: without a prompt of their form, \"chosen\" and \"rejected\" must be two strings or "
                        "two lists of messages that both start with the prompt. Fix: one form, or an explicit "
                        "\"prompt\"")
    idx = 0
    for idx in range(min(len(c), len(r))):
        if c[idx] != r[idx]:
            if c[idx - 1] == " ":  # (TRL's: the space before the divergence goes with the completion)
                idx -= 1
            break
    return {**record, "prompt": c[:idx], "chosen": c[idx:], "rejected": r[idx:]}


def kind_of(record, where: str) -> str:
    """"plain" (three strings) or "conversational" (three lists of messages); anything else refused."""
    if not isinstance(record, dict):
        raise PairError(f"{where}: a JSON object per line is expected, not {type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise PairError(f"{where}: --format preference needs \"prompt\", \"chosen\" and \"rejected\"; "
                        f"{', '.join(missing)} missing. Fix: give all three (or chosen and rejected each holding the "
                        f"prompt: TRL's implicit-prompt form)")
    if "chat_template_kwargs" in record:
        raise PairError(f"{where}: \"chat_template_kwargs\" is not implemented (it would be ignored). Fix: drop it")
    values = [record[k] for k in ("prompt", "chosen", "rejected")]
    if all(isinstance(v, str) for v in values):
        return "plain"
    if all(isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)
           for v in values):
        return "conversational"
    raise PairError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" must be three strings, or three non-empty lists "
                    f"of {{\"role\", \"content\"}} messages (TRL's conversational form). Fix: one form per record")


def tools_of(record: dict, where: str):
    tools = record.get("tools")
    if isinstance(tools, str):  # as TRL reads it
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise PairError(f"{where}: \"tools\" is a string but not JSON ({e}). Fix: a list of tool schemas") from None
    return tools


def tokenized(record: dict, kind: str, tok, template, eos_token: str | None, where: str) -> tuple[list, list, list]:
    """(prompt_ids, chosen_ids, rejected_ids) as TRL's tokenize_fn returns them."""
    if kind == "plain":
        if eos_token is None:
            raise PairError(f"{where}: plain pairs end with the tokenizer's end-of-sequence token, and it has none. "
                            f"Fix: --eos <its end-of-sequence token>")
        chosen, rejected = (t if t.endswith(eos_token) else t + eos_token
                            for t in (record["chosen"], record["rejected"]))
        prompt = record["prompt"]
        p, pc, pr = (tok.encode(t).ids for t in (prompt, prompt + chosen, prompt + rejected))
    else:
        tools = tools_of(record, where)
        prompt = record["prompt"]
        texts = (template.render(prompt, tools, add_generation_prompt=True),
                 template.render(prompt + record["chosen"], tools), template.render(prompt + record["rejected"], tools))
        p, pc, pr = (tok.encode(t, add_special_tokens=False).ids for t in texts)
    n = min(common_prefix(p, pc), common_prefix(p, pr))
    return p[:n], pc[n:], pr[n:]


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sequence(prompt: list, completion: list, window: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, mask, truncated): prompt + completion kept to its first `window` tokens (TRL's keep_start), the
    mask 1 on the completion's tokens."""
    ids = np.array(prompt + completion, dtype=np.int64)
    mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)])
    return ids[:window], mask[:window], len(ids) > window
