"""The dataset shapes of `prepare --format chat` (hpctrain.data.records): ShareGPT and Alpaca records, and
OpenAI-style messages with tool calls, prepared into shards whose ids are transformers' apply_chat_template
ids of the equivalent messages (written out here by hand), for a Qwen2.5-style ChatML template and a
Llama 3.1-style one, both with their tool-call branches; and the refusals' messages."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import chat
from hpctrain.data.prepare import prepare_records

from test_finetune import tokenizer_dir  # the example tokenizer with another chat template

# Qwen2.5's template: tools in the system turn, tool calls as <tool_call> blocks, an assistant message's
# content only where there is one (`if message.content`), tool results grouped in a user turn.
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Llama 3.1's template (builtin tools left out): tools in the first user turn, one tool call per message
# chosen by `'tool_calls' in message` (a "tool_calls": null kept in the message would take that branch and
# fail on its length), tool results under ipython, through tojson where they are iterable.
LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

# Each record of each shape, and the messages (and tools) it stands for, written out independently.
SHAREGPT = [
    ({"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4."},
                        {"from": "user", "value": "And 3 + 3?"}, {"from": "model", "value": "6."}]},
     [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
      {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6."}], None),
    ({"system": "Answer briefly.", "tools": json.dumps(TOOLS),
      "conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "bot", "value": "Checking."},
                        {"from": "observation", "value": "{\"temp\": 21}"}, {"from": "assistant", "value": "21 C."},
                        {"from": "user", "value": "Thanks"}, {"from": "gpt", "value": "You are welcome."}]},
     [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "21 C."}, {"role": "user", "content": "Thanks"},
      {"role": "assistant", "content": "You are welcome."}], TOOLS),
    ({"conversations": [{"from": "system", "value": "Be exact."}, {"from": "human", "value": "Pi?"},
                        {"from": "gpt", "value": "3.14159"}, {"from": "function", "value": "ok"},
                        {"from": "gpt", "value": "Done."}]},
     [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Pi?"},
      {"role": "assistant", "content": "3.14159"}, {"role": "tool", "content": "ok"},
      {"role": "assistant", "content": "Done."}], None),
]
ALPACA = [
    ({"instruction": "Name the module for paths.", "input": "", "output": "os.path"},
     [{"role": "user", "content": "Name the module for paths."}, {"role": "assistant", "content": "os.path"}], None),
    ({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
     [{"role": "user", "content": "Translate to French.\n\nGood morning"},
      {"role": "assistant", "content": "Bonjour"}], None),
    ({"instruction": "Sum these.", "input": "2 and 3", "output": "5", "system": "You are a calculator."},
     [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "Sum these.\n\n2 and 3"},
      {"role": "assistant", "content": "5"}], None),
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}
# OpenAI's chat format as its API returns it: "content": null beside tool_calls, "tool_calls": null on a plain
# answer, the tool's result with its tool_call_id. The messages are the record itself.
TOOL_CALLS = [
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                  {"role": "assistant", "content": "It is 21 degrees.", "tool_calls": None}], "tools": TOOLS},
    {"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "And in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL | {"id": "call_2"}]},
                  {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 25}"},
                  {"role": "assistant", "content": "25 degrees.", "refusal": None}], "tools": TOOLS},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("template", ["qwen", "llama31"])
def test_sharegpt_alpaca_and_tool_calls_render_as_transformers_does(example_corpus, tmp_path, template):
    """One prepare over a directory of three files, one per shape; its shard is, record by record,
    transformers' apply_chat_template ids of the equivalent messages, then the separator. Mutants: a
    ShareGPT name mapped to another role (gpt, bot, model, observation, function), the top-level "system"
    or "tools" of ShareGPT dropped or "tools" passed as its JSON string, Alpaca's input joined with "\\n"
    or appended when empty, its system dropped, null keys kept (Llama 3.1 then takes "tool_calls": null
    for a tool call and fails on its length), the tools list not passed with the messages."""
    from transformers import AutoTokenizer

    d = tokenizer_dir(example_corpus, tmp_path, {"qwen": QWEN, "llama31": LLAMA31}[template], template)
    theirs = AutoTokenizer.from_pretrained(str(d))
    src = tmp_path / "data"
    write_jsonl(src / "a_sharegpt.jsonl", [r for r, _, _ in SHAREGPT])
    write_jsonl(src / "b_alpaca.jsonl", [r for r, _, _ in ALPACA])
    write_jsonl(src / "c_tools.jsonl", TOOL_CALLS)
    meta = prepare_records(src, tmp_path / "out", d, "chat", val_fraction=0)
    eos = meta["eos_id"]
    equivalent = [(m, t) for _, m, t in SHAREGPT + ALPACA] + [(r["messages"], r["tools"]) for r in TOOL_CALLS]
    want = []
    for messages, tools in equivalent:
        want += [*theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"], eos]
    shard = meta["splits"]["train"]["shards"][0]
    ids = np.fromfile(tmp_path / "out" / shard["file"], dtype=meta["dtype"])
    mask = np.fromfile(tmp_path / "out" / shard["mask"], dtype=np.uint8)
    assert ids.tolist() == want + [eos]
    assert meta["documents"] == len(equivalent)
    # the tool calls are the assistant's: trained (the call's name is in the trained text)
    trained = theirs.decode([int(i) for i, m in zip(ids, mask) if m])
    assert trained.count("weather") == 2 and "It is 21 degrees." in trained and "Bonjour" in trained


def test_shapes_refused_with_the_line_and_the_fix(example_corpus, tmp_path):
    """Mutants: an unknown "from" mapped to some role (or dropped), a file mixing shapes read record by
    record, an Alpaca record without output trained on an empty answer, "history" ignored."""
    tok = example_corpus / "tokenizer.json"

    def refused(name: str, records: list) -> str:
        with pytest.raises(chat.ChatError) as e:
            prepare_records(write_jsonl(tmp_path / f"{name}.jsonl", records), tmp_path / name, tok, "chat")
        assert not (tmp_path / name).exists()  # nothing half-written
        return str(e.value)

    ok = SHAREGPT[0][0]
    said = refused("role", [ok, {"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}]}])
    assert f"{tmp_path / 'role.jsonl'}:2: conversations[1] has \"from\": \"narrator\", not one of the names accepted: " \
           "human, user, gpt, assistant, model, bot, system, tool, function, observation. Fix: rename it" in said
    said = refused("mixed", [ok, ALPACA[0][0]])
    assert f"{tmp_path / 'mixed.jsonl'}:2: a alpaca record in a file of sharegpt records (from its first record, " \
           f"{tmp_path / 'mixed.jsonl'}:1). Fix: one shape per file" in said
    said = refused("output", [{"instruction": "Say hi.", "input": ""}])
    assert f"{tmp_path / 'output.jsonl'}:1: \"output\" is missing. Fix: give every record a string \"output\"" in said
    said = refused("history", [ALPACA[0][0] | {"history": [["q", "a"]]}])
    assert "\"history\" (earlier turns (LLaMA-Factory's \"history\")) is not implemented" in said
    said = refused("none", [{"text": "plain"}])
    assert ":1: --format chat reads {\"messages\": [...]}, ShareGPT" in said and "this one has text" in said
