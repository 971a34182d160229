"""The dataset shapes `prepare --format chat` reads, each mapped to the equivalent {"messages": [...]}.

- messages (OpenAI, transformers' chat format): {"messages": [{"role", "content"}, ...], "tools"?}; an
  assistant message may have "content": null and "tool_calls", a tool message "tool_call_id": they go to
  the template as they are (chat.without_nulls drops the null keys, as transformers does).
- ShareGPT (Axolotl's and LLaMA-Factory's `sharegpt`): {"conversations": [{"from", "value"}, ...],
  "system"?, "tools"?}; `from` maps through ROLES; "tools" may be a JSON string (LLaMA-Factory's).
- Alpaca: {"instruction", "input"?, "output", "system"?}: the user says the instruction, then "\\n\\n" and
  the input where it is not empty (LLaMA-Factory's and Axolotl's prompt), the assistant the output.

The shape of a file is the shape of its first record; a record of another shape in the same file is
refused (a file mixing shapes is usually a concatenation mistake). Each mapping is a pure function of
one record; the chat template, the loss mask and the windows then apply to the messages.
"""
from __future__ import annotations

import json

from hpctrain.data.chat import ChatError

# ShareGPT's `from` names -> roles, the names Axolotl's and LLaMA-Factory's sharegpt loaders map
# (LLaMA-Factory's "observation" is a tool's result; OpenAI's legacy "function" role too).
ROLES = {"human": "user", "user": "user",
         "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant",
         "system": "system",
         "tool": "tool", "function": "tool", "observation": "tool"}
SHAPES = {"messages": "messages", "conversations": "sharegpt", "instruction": "alpaca", "output": "alpaca"}
# Known fields that change what is trained and are not implemented: refused rather than dropped.
UNSUPPORTED = {"sharegpt": {"weight": "per-turn training weights (Axolotl's \"weight\")"},
               "alpaca": {"history": "earlier turns (LLaMA-Factory's \"history\")"}}


class ShapeError(ChatError):
    """A record that is none of the shapes, or a malformed one; the message names the line and the fix."""


def shape_of(record, where: str) -> str:
    """"messages", "sharegpt" or "alpaca": the first of SHAPES' keys the record has."""
    if isinstance(record, dict):
        for key, shape in SHAPES.items():
            if key in record:
                return shape
    have = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
    raise ShapeError(f"{where}: --format chat reads {{\"messages\": [...]}}, ShareGPT {{\"conversations\": "
                     f"[{{\"from\", \"value\"}}]}} or Alpaca {{\"instruction\", \"input\", \"output\"}} records; this "
                     f"one has {have or 'no keys'}. Fix: convert it to one of them")


def to_messages(record: dict, shape: str, where: str) -> dict:
    """The record as {"messages": [...]} (with "tools" where it has some)."""
    if shape == "messages":
        return record
    return (from_sharegpt if shape == "sharegpt" else from_alpaca)(record, where)


def from_sharegpt(record: dict, where: str) -> dict:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ShapeError(f"{where}: \"conversations\" must be a non-empty list of {{\"from\", \"value\"}} objects")
    messages = [] if record.get("system") in (None, "") else [{"role": "system", "content": _text(record, "system",
                                                                                                   where)}]
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ShapeError(f"{where}: conversations[{k}] must be an object with a string \"value\"; it is "
                             f"{json.dumps(turn)[:60]}")
        _refuse_unsupported(turn, "sharegpt", f"{where}: conversations[{k}]")
        role = ROLES.get(turn.get("from"))
        if role is None:
            raise ShapeError(f"{where}: conversations[{k}] has \"from\": {json.dumps(turn.get('from'))[:40]}, not one "
                             f"of the names accepted: {', '.join(ROLES)}. Fix: rename it to one of them")
        messages.append({"role": role, "content": turn["value"]})
    out = {"messages": messages}
    tools = record.get("tools")
    if isinstance(tools, str) and tools.strip():  # LLaMA-Factory keeps the tools list as a JSON string
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise ShapeError(f"{where}: \"tools\" is a string but not JSON ({e}). Fix: a list of tool "
                             f"schemas") from None
    if tools not in (None, "", []):
        if not isinstance(tools, list):
            raise ShapeError(f"{where}: \"tools\" must be a list of tool schemas (or that list as a JSON string)")
        out["tools"] = tools
    return out


def from_alpaca(record: dict, where: str) -> dict:
    _refuse_unsupported(record, "alpaca", where)
    instruction, output = _text(record, "instruction", where), _text(record, "output", where)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ShapeError(f"{where}: Alpaca's \"input\" must be a string (or absent); it is {json.dumps(extra)[:40]}")
    user = instruction + "\n\n" + extra if extra else instruction
    system = record.get("system")
    messages = [] if system in (None, "") else [{"role": "system", "content": _text(record, "system", where)}]
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}


def _text(record: dict, key: str, where: str) -> str:
    v = record.get(key)
    if not isinstance(v, str):
        what = "is missing" if key not in record else f"is {json.dumps(v)[:40]}, not a string"
        raise ShapeError(f"{where}: \"{key}\" {what}. Fix: give every record a string \"{key}\", or drop the record")
    return v


def _refuse_unsupported(obj: dict, shape: str, where: str) -> None:
    for key, what in UNSUPPORTED[shape].items():
        if key in obj:
            raise ShapeError(f"{where}: \"{key}\" ({what}) is not implemented: it would be ignored. Fix: drop the key, "
                             f"or convert the record to {{\"messages\": [...]}}")


class FileShapes:
    """The shape of each file, from its first record; records of another shape in that file are refused."""

    def __init__(self):
        self.first: dict[str, tuple[str, str]] = {}  # file -> (shape, where its first record is)

    def messages(self, record, file: str, where: str) -> dict:
        shape = shape_of(record, where)
        first, at = self.first.setdefault(file, (shape, where))
        if shape != first:
            raise ShapeError(f"{where}: a {shape} record in a file of {first} records (from its first record, {at}). "
                             f"Fix: one shape per file (split the file, or convert the records)")
        return to_messages(record, shape, where)
