"""Conversations to token ids and a loss mask, rendered with the model's own chat template.

A record is a JSON object: {"messages": [{"role", "content"}, ...]} (format chat; optional "tools"; ShareGPT
and Alpaca records are mapped to it first, hpctrain.data.records), or {"prompt", "completion"} (format prompt). The chat template is found where transformers' tokenizer
finds it beside tokenizer.json: `chat_template.jinja` (where current transformers' save_pretrained
writes it), else tokenizer_config.json's `chat_template` (a string, or named templates: the "default"),
else the `chat_template` of `chat_template.json` (a processor's older file). It is a Jinja template
rendered the way transformers' `apply_chat_template` renders it (a sandboxed environment with
trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`, and the
special tokens of tokenizer_config.json as variables), then tokenized without added special tokens.
As transformers does, a message's keys whose value is null are dropped first ("content": null in a
tool call renders as a missing content). These files are read as regular files of bounded size inside
the tokenizer's directory (hpctrain.data.tokenizer.side_file).

A template is code that came with the tokenizer: it renders within a Budget (hpctrain.data.render_budget:
characters, seconds per record, loop iterations, call depth), and a record that goes past it is refused
with the limit and the fix, not by the machine running out of memory or time.

The loss mask marks the tokens of the assistant's turns: for each assistant message, the text the
template adds when that message is appended to the conversation rendered up to it with the generation
prompt (its content and end-of-turn marker, not the role header the prompt already holds). A template
that renders earlier turns differently as the conversation grows has no such spans and is refused.
Format prompt: prompt + completion as plain text, the loss on the completion and the end-of-document id.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# Where a tokenizer directory keeps its chat template, besides tokenizer_config.json's "chat_template"
# (transformers.utils.hub: CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR).
TEMPLATE_FILE, PROCESSOR_TEMPLATE_FILE = "chat_template.jinja", "chat_template.json"
NAMED_TEMPLATES = "additional_chat_templates"  # named alternatives only: not read
TEMPLATE_FILES = (TEMPLATE_FILE, PROCESSOR_TEMPLATE_FILE)
TEMPLATE_CHARS = 1 << 20  # published chat templates are under 100 KB; compiling one costs time per character


class ChatError(ValueError):
    """A record or template that cannot be rendered; the message says which and how to fix it."""


def token_text(v) -> str | None:
    """A special token as tokenizer_config.json holds it (its text, or {"content": text, ...}): the text."""
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) else None


class ChatTemplate:
    """A tokenizer's chat template, compiled once (`origin`: the file it came from, for messages)."""

    def __init__(self, source: str, special: dict[str, str] | None = None, origin: str = "the chat template",
                 budget=None):
        import jinja2
        from jinja2.ext import Extension, loopcontrols

        from hpctrain.data.render_budget import Budget, BudgetedEnvironment, compile_budgeted

        class Generation(Extension):  # {% generation %}: transformers' assistant marker; renders its body
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.now().strftime(fmt)

        if len(source) > TEMPLATE_CHARS:
            raise ChatError(f"{origin} is {len(source):,} characters long, more than a chat template can be "
                            f"({TEMPLATE_CHARS:,}). Fix: use the model's own template")
        self.budget = budget or Budget()
        env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols],
                                  budget=self.budget)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self.template = compile_budgeted(env, source)
        except (jinja2.TemplateError, RecursionError) as e:
            why = e if isinstance(e, jinja2.TemplateError) else "it nests deeper than the parser goes"
            raise ChatError(f"the chat template does not compile ({why}). Fix: correct {origin}") from None
        self.special, self.origin = dict(special or {}), origin

    @classmethod
    def of(cls, tokenizer_json: str | Path, budget=None) -> "ChatTemplate":
        """The template of the tokenizer directory that holds `tokenizer_json`, found where transformers
        finds it (chat_template.jinja first), with tokenizer_config.json's special tokens; `budget`: a
        render_budget.Budget (its defaults where None)."""
        d = Path(tokenizer_json).parent
        cfg_path = d / "tokenizer_config.json"
        cfg = _json_file(cfg_path, "--format chat renders with its special tokens and chat template. Fix: use "
                                   "the model's tokenizer directory, which has one")
        special = {k: t for k in SPECIAL if isinstance(cfg, dict) and (t := token_text(cfg.get(k))) is not None}
        if (d / TEMPLATE_FILE).exists() or (d / TEMPLATE_FILE).is_symlink():  # transformers: it wins over the config
            return cls(_text_file(d / TEMPLATE_FILE), special, str(d / TEMPLATE_FILE), budget)
        source = cfg.get("chat_template") if isinstance(cfg, dict) else None
        origin = f"{cfg_path}'s chat_template"
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
        legacy = d / PROCESSOR_TEMPLATE_FILE
        if not isinstance(source, str) and (legacy.exists() or legacy.is_symlink()):
            doc = _json_file(legacy, "Fix: remove it, or download it again")
            source, origin = (doc.get("chat_template") if isinstance(doc, dict) else None), f"{legacy}'s chat_template"
        if not isinstance(source, str):
            extra = d / NAMED_TEMPLATES
            named = sorted(p.stem for p in extra.glob("*.jinja")) if extra.is_dir() else []
            also = (f"; {d / NAMED_TEMPLATES} holds only named templates ({', '.join(named)}), none of them the "
                    f"default" if named else "")
            raise ChatError(f"{cfg_path} has no chat_template, and {d} has no {TEMPLATE_FILE}{also}: a base model's "
                            f"tokenizer. Fix: use the chat (instruct) model's tokenizer, or --format prompt for "
                            f"prompt/completion pairs")
        return cls(source, special, origin, budget)

    def render(self, messages: list, tools=None, add_generation_prompt: bool = False) -> str:
        """The conversation as the template renders it, within the budget of one record."""
        self.budget.start_record()
        return self._render(messages, tools, add_generation_prompt)

    def _render(self, messages: list, tools=None, add_generation_prompt: bool = False) -> str:
        import jinja2

        from hpctrain.data.render_budget import BudgetError, render

        try:
            return render(self.template, self.budget, messages=without_nulls(messages), tools=tools, documents=None,
                          add_generation_prompt=add_generation_prompt, **self.special)
        except BudgetError as e:
            raise ChatError(f"rendering it with {self.origin} went past its budget: {e}. Fix: "
                            + (f"if the record is that large, raise {e.flag}; else " if e.flag else "")
                            + f"correct the template, or drop the record") from None
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template refused the conversation: {e}") from None
        except RecursionError:
            why = "a macro that calls itself, or a record nested that deep"
            raise ChatError(f"rendering it with {self.origin} nests deeper than Python's stack ({why}). Fix: correct "
                            f"the template, or drop the record") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, MemoryError) as e:
            raise ChatError(f"the chat template failed on the conversation ({type(e).__name__}: {e}). Fix: correct "
                            f"{self.origin}, or drop the record") from None

    def assistant_spans(self, messages: list, tools=None) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans of the assistant's turns); its renderings share
        the budget of one record."""
        self.budget.start_record()
        text = self._render(messages, tools)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self._render(messages[:i], tools, add_generation_prompt=True)
            upto = self._render(messages[:i + 1], tools)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ChatError(f"the chat template renders turn {i} differently once later turns follow (it edits "
                                f"earlier turns, as reasoning templates drop old thinking): the assistant's tokens "
                                f"cannot be told apart. Fix: split the conversation at its last assistant turn")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return text, spans


def without_nulls(messages: list) -> list:
    """The messages as transformers hands them to the template: keys whose value is null dropped (a tool
    call's "content": null is then a missing content, which templates handle)."""
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


def _read(path: Path, why: str = "") -> bytes:
    from hpctrain.data.tokenizer import TokenizerError, side_file

    try:
        data = side_file(path.parent, path.name)
    except TokenizerError as e:
        raise ChatError(str(e) if "Fix:" in str(e) or not why else f"{e}: {why}") from None
    if data is None:
        raise ChatError(f"{path} is missing{': ' + why if why else ''}")
    return data


def _json_file(path: Path, fix: str):
    raw = _read(path, fix)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ChatError(f"{path} is not valid JSON ({e}): {fix}") from None


def _text_file(path: Path) -> str:
    try:
        return _read(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChatError(f"{path} is not UTF-8 text ({e}). Fix: download it again") from None


def check_record(record, fmt: str, where: str) -> None:
    if not isinstance(record, dict):
        raise ChatError(f"{where}: a JSON object per line is expected, not {type(record).__name__}")
    if fmt == "prompt":
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise ChatError(f"{where}: --format prompt needs string fields \"prompt\" and \"completion\"; "
                                f"{key!r} is {json.dumps(record.get(key))[:40]}")
        return
    msgs = record.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                        for m in msgs):
        raise ChatError(f"{where}: --format chat needs \"messages\": a list of {{\"role\", \"content\"}} objects")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ChatError(f"{where}: the conversation has no assistant turn: nothing to train on. Fix: drop it, "
                        f"or add the assistant's answer")


def encode(record: dict, fmt: str, tok, template: ChatTemplate | None, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one record, the end-of-document id appended (trained in format prompt: the model
    learns to stop; in format chat the template's end-of-turn marker does that)."""
    if fmt == "prompt":
        text, spans = record["prompt"] + record["completion"], [(len(record["prompt"]), None)]
    else:
        text, spans = template.assistant_spans(record["messages"], record.get("tools"))
    enc = tok.encode(text, add_special_tokens=False)
    starts = np.array([s for s, _ in enc.offsets], dtype=np.int64) if enc.offsets else np.zeros(0, np.int64)
    mask = np.zeros(len(enc.ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < (len(text) if b is None else b))
    ids = np.array(enc.ids + [eos_id], dtype=np.int64)
    return ids, np.append(mask, fmt == "prompt").astype(np.uint8)
