"""Fine-tuning data and adapters: chat rendering and loss masks against transformers, prepare's
layout of records and its refusals, and a LoRA run's adapters through PEFT's format (export, load in
peft, merged export in transformers, import to continue). The per-step losses of SFT and LoRA under
every layout: tests/test_layouts.py."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hpctrain.data import chat
from hpctrain.data.prepare import prepare_records

# A Llama-3.1-style template: whitespace control (trim_blocks/lstrip_blocks matter), a system turn
# always present, tools listed through tojson, tool results under the "ipython" header.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Tools: " + tools|tojson + "\\n\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message['content'] | trim + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Zephyr's template: block tags on lines of their own, indented; only trim_blocks and lstrip_blocks keep
# their newlines and indentation out of the text.
ZEPHYR = """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
    {% else %}
{{ '<|' + message['role'] + '|>\n'  + message['content'] + eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
"""
# ChatML with transformers' {% generation %} markers around what the assistant writes: transformers'
# return_assistant_tokens_mask is then an independent account of the assistant's tokens.
CHATML_MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
                 "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "  Answer briefly.  "}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Let me check."},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "It is 21 degrees."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome!"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def tokenizer_dir(example_corpus: Path, tmp: Path, template: str, name: str) -> Path:
    """The example tokenizer with another chat template (and Llama 3's header tokens added)."""
    from tokenizers import AddedToken, Tokenizer

    d = tmp / name
    d.mkdir()
    tok = Tokenizer.from_file(str(example_corpus / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>")])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((example_corpus / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|begin_of_text|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("template", ["example", "llama3", "zephyr"])
def test_rendered_ids_equal_transformers_apply_chat_template(example_corpus, tmp_path, template):
    """Mutants: a Jinja environment without trim_blocks/lstrip_blocks (Llama 3's template then renders
    other whitespace), tokenizing with added special tokens, tools not passed to the template."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = example_corpus if template == "example" else \
        tokenizer_dir(example_corpus, tmp_path, {"llama3": LLAMA3, "zephyr": ZEPHYR}[template], template)
    theirs = AutoTokenizer.from_pretrained(str(d))
    tok, ours = Tokenizer.from_file(str(d / "tokenizer.json")), chat.ChatTemplate.of(d / "tokenizer.json")
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            want = theirs.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
            ids, mask = chat.encode({"messages": messages, "tools": tools}, "chat", tok, ours, eos_id=0)
            assert ids[:-1].tolist() == list(want)
            assert ids[-1] == 0 and mask[-1] == 0  # the document separator, not trained
            assert mask.sum() > 0


def test_a_tokenizer_saved_by_current_transformers_renders_as_transformers_does(example_corpus, tmp_path):
    """transformers' save_pretrained writes the template to chat_template.jinja, not tokenizer_config.json;
    where both hold one, the file wins. prepare's shards equal transformers' apply_chat_template ids, and
    carry the template. Mutants: chat_template.jinja not read (refused as a base tokenizer),
    tokenizer_config.json's template preferred over the file, the file not copied beside the shards."""
    from transformers import AutoTokenizer

    saved = tmp_path / "saved"
    AutoTokenizer.from_pretrained(str(tokenizer_dir(example_corpus, tmp_path, LLAMA3, "llama3"))).save_pretrained(saved)
    cfg = json.loads((saved / "tokenizer_config.json").read_text())
    assert (saved / chat.TEMPLATE_FILE).read_text() == LLAMA3 and "chat_template" not in cfg  # as transformers saves
    cfg["chat_template"] = CHATML_MARKED  # a stale copy in the config: transformers reads the file
    (saved / "tokenizer_config.json").write_text(json.dumps(cfg))
    theirs = AutoTokenizer.from_pretrained(str(saved))
    assert theirs.chat_template == LLAMA3
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m, "tools": TOOLS} for m in CONVERSATIONS])
    out = tmp_path / "shards"
    meta = prepare_records(src, out, saved, "chat", val_fraction=0)
    eos = meta["eos_id"]
    want = [i for m in CONVERSATIONS for i in [*theirs.apply_chat_template(m, tools=TOOLS, tokenize=True,
                                                                           return_dict=True)["input_ids"], eos]]
    ids, _, _ = windows(out, 0)
    assert ids.tolist() == want + [eos]  # and the last target
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == LLAMA3  # the shards carry their template


def test_template_files_are_read_only_as_small_regular_files(example_corpus, tmp_path, monkeypatch):
    """A chat_template.jinja that is a FIFO is refused at once (reading it would wait for a writer), one
    larger than hf_format.SMALL_FILE_BYTES before it is read. Mutants: no regular-file check, no size cap."""
    import os

    from hpctrain.core import hf_format

    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((example_corpus / name).read_bytes())
    os.mkfifo(d / chat.TEMPLATE_FILE)
    with pytest.raises(chat.ChatError, match=r"chat_template.jinja is not a regular file \(a FIFO\)"):
        chat.ChatTemplate.of(d / "tokenizer.json")
    (d / chat.TEMPLATE_FILE).unlink()
    (d / chat.TEMPLATE_FILE).write_text(CHATML_MARKED)
    assert chat.ChatTemplate.of(d / "tokenizer.json").origin == str(d / chat.TEMPLATE_FILE)
    limit = (d / "tokenizer_config.json").stat().st_size + 10
    monkeypatch.setattr(hf_format, "SMALL_FILE_BYTES", limit)
    (d / chat.TEMPLATE_FILE).write_text(CHATML_MARKED + "{#" + "x" * (limit - len(CHATML_MARKED)) + "#}")
    with pytest.raises(chat.ChatError, match=f"chat_template.jinja is {limit + 4:,} bytes, more than such a file"):
        chat.ChatTemplate.of(d / "tokenizer.json")


def test_loss_mask_is_the_assistants_tokens(example_corpus, tmp_path):
    """transformers' return_assistant_tokens_mask on the same conversations (a template marking the
    assistant's text with {% generation %}). Mutants: spans from the full render instead of the
    generation prompt (the role header trained), the last assistant turn only, a mask off by one token."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = tokenizer_dir(example_corpus, tmp_path, CHATML_MARKED, "marked")
    theirs = AutoTokenizer.from_pretrained(str(d))
    tok, ours = Tokenizer.from_file(str(d / "tokenizer.json")), chat.ChatTemplate.of(d / "tokenizer.json")
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)["assistant_masks"]
        ids, mask = chat.encode({"messages": messages}, "chat", tok, ours, eos_id=0)
        assert mask[:-1].tolist() == list(want)
        text = theirs.decode([i for i, m in zip(ids, mask) if m])
        assert text == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")


def test_prompt_format_trains_the_completion_and_the_end(example_corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(example_corpus / "tokenizer.json"))
    ids, mask = chat.encode({"prompt": "Question: what is os.path? Answer:", "completion": " Path helpers."},
                            "prompt", tok, None, eos_id=7)
    assert ids[-1] == 7 and mask[-1] == 1  # the model learns to stop
    assert tok.decode([int(i) for i, m in zip(ids[:-1], mask[:-1]) if m]) == " Path helpers."


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def windows(out: Path, seq: int) -> tuple[np.ndarray, np.ndarray, dict]:
    meta = json.loads((out / "meta.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    ids = np.fromfile(out / shard["file"], dtype=meta["dtype"])
    mask = np.fromfile(out / shard["mask"], dtype=np.uint8)
    return ids, mask, meta


@pytest.mark.parametrize("pack", [True, False])
def test_records_never_straddle_a_window(example_corpus, tmp_path, pack):
    """Every record starts a window or follows another inside it; a longer one is cut to a window ending
    in the end-of-document id. Mutants: a record split across windows, padding trained, --no-pack packing."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q" * (3 * k)},
                                                          {"role": "assistant", "content": "a " * (5 * k)}]}
                                             for k in range(1, 30)])
    seq, out = 48, tmp_path / "out"
    meta = prepare_records(src, out, example_corpus / "tokenizer.json", "chat", seq_len=seq, val_fraction=0, pack=pack)
    ids, mask, meta = windows(out, seq)
    eos = meta["eos_id"]
    assert len(ids) % seq == 1 and meta["window"] == seq and meta["warnings"]  # some were truncated
    starts = [0] + [i + 1 for i in np.flatnonzero(ids == eos)]
    im_start = 1  # the example tokenizer's <|im_start|>
    for w in range(len(ids) // seq):
        window, wmask = ids[w * seq:(w + 1) * seq], mask[w * seq:(w + 1) * seq]
        assert window[0] == im_start, w  # a record (never padding, never a record's middle) begins each window
        assert window[-1] == eos, w  # and the window ends with a record's end or padding
        assert not wmask[window == eos].any()  # separators and padding are never trained
        if not pack:
            assert (window[:-1] == eos).sum() == 0 or (window[np.argmax(window == eos):] == eos).all()
    assert all(s % seq == 0 or ids[s - 1] == eos for s in starts)


def test_prepare_refuses_what_it_cannot_train_on(example_corpus, tmp_path):
    tok = example_corpus / "tokenizer.json"
    long = write_jsonl(tmp_path / "long.jsonl", [{"messages": [{"role": "user", "content": "x " * 200},
                                                               {"role": "assistant", "content": "ok"}]}])
    with pytest.raises(Exception, match=r"longer than --seq-len 32\. Fix: --too-long truncate"):
        prepare_records(long, tmp_path / "a", tok, "chat", seq_len=32, too_long="refuse")
    silent = write_jsonl(tmp_path / "silent.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(chat.ChatError, match="no assistant turn: nothing to train on"):
        prepare_records(silent, tmp_path / "b", tok, "chat")
    with pytest.raises(chat.ChatError, match="string fields \"prompt\" and \"completion\""):
        prepare_records(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}]), tmp_path / "c", tok, "prompt")
    # the template's end of turn as the document separator would cut every conversation at each turn
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(Exception, match=r"occurs inside the rendered conversation.*Fix: --eos"):
        prepare_records(ok, tmp_path / "d", tok, "chat", eos="<|im_end|>")
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_bytes(tok.read_bytes())
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(chat.ChatError, match="has no chat_template, and .* has no chat_template.jinja: a base model's"):
        prepare_records(ok, tmp_path / "e", base / "tokenizer.json", "chat")
    assert not any((tmp_path / n).exists() for n in "abcde")  # nothing half-written
    # a processor's chat_template.json is the last place looked in (mutant: not read)
    (base / chat.PROCESSOR_TEMPLATE_FILE).write_text(json.dumps({"chat_template": CHATML_MARKED}))
    assert chat.ChatTemplate.of(base / "tokenizer.json").origin == f"{base / chat.PROCESSOR_TEMPLATE_FILE}'s chat_template"


def test_prepare_cli_prints_what_to_train_with(example_corpus, tmp_path, capsys):
    from hpctrain.data.prepare import main

    assert main([str(example_corpus / "chat.jsonl"), str(tmp_path / "s"), "--tokenizer",
                 str(example_corpus / "tokenizer.json"), "--format", "chat", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    # +experiment=sft: model=hf (the shape from model.init_from), document masking; the windows' length
    assert "trained)" in out and (f"python -m hpctrain +experiment=sft model.init_from=MODEL_DIR "
                                  f"data.path={(tmp_path / 's').resolve()} data.seq_len=64\n") in out
    assert "MODEL_DIR: the Hugging Face model to fine-tune" in out
    # --tokenizer naming a model directory: that model is the one to fine-tune
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((example_corpus / name).read_bytes())
    (model / "config.json").write_text("{}")
    assert main([str(example_corpus / "chat.jsonl"), str(tmp_path / "u"), "--tokenizer", str(model),
                 "--format", "chat"]) == 0
    out = capsys.readouterr().out
    assert f"+experiment=sft model.init_from={model.resolve()} data.path={(tmp_path / 'u').resolve()}\n" in out
    assert main([str(example_corpus / "chat.jsonl"), str(tmp_path / "t"), "--format", "chat"]) == 2
    assert "--format chat needs --tokenizer" in capsys.readouterr().err


def test_packed_chat_without_document_mask_is_warned_on_the_login_node(chat_shards, example_corpus, tmp_path):
    """Packed conversations (meta.json's "packed") trained without data.document_mask attend to each
    other: the login node warns, and says so in `python -m hpctrain`'s output. Mutants: the warning not
    printed, prepare not recording --no-pack (its windows hold one record: nothing to warn about), the
    warning given with data.document_mask=true."""
    from hpctrain.checks.config_checks import advice
    from hpctrain.core.compose import compose

    from helpers import run_main

    common = ["+experiment=tiny", "data.source=shards", "model.vocab_size=512", "data.seq_len=64"]
    assert json.loads((chat_shards / "meta.json").read_text())["packed"] is True
    said = advice(compose([*common, f"data.path={chat_shards}"]))
    assert len(said) == 1 and "packed several to a sample, but data.document_mask=false" in said[0]
    assert "Fix: data.document_mask=true data.document_positions=true" in said[0]
    assert advice(compose([*common, f"data.path={chat_shards}", "data.document_mask=true"])) == []
    alone = tmp_path / "alone"
    meta = prepare_records(example_corpus / "chat.jsonl", alone, example_corpus / "tokenizer.json", "chat", seq_len=64,
                           pack=False, val_fraction=0)
    assert meta["packed"] is False and advice(compose([*common, f"data.path={alone}"])) == []
    done = run_main("hpctrain", *common, f"data.path={chat_shards}", "dry_run=true")
    assert done.returncode == 0, done.stderr
    assert f"warning: {said[0]}" in done.stdout


# --- adapters through PEFT's format ---------------------------------------------------------------


def as_published(base: Path, example_corpus: Path, tmp: Path) -> None:
    """Give a base model directory what a published one holds beside its weights, written by transformers:
    config.json's max_position_embeddings (512, longer than the tiny run's 64) and bos/eos ids, a
    generation config (reached through a symlink inside the directory, as in a download cache's snapshot),
    a tokenizer saved with its template in chat_template.jinja; and a chat_template.json that is a symlink
    out of the directory, which the export must not copy."""
    from transformers import AutoTokenizer, GenerationConfig

    cfg = json.loads((base / "config.json").read_text())
    cfg.update(max_position_embeddings=512, bos_token_id=1, eos_token_id=[2, 3])
    (base / "config.json").write_text(json.dumps(cfg))
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], do_sample=True, temperature=0.6,
                     top_p=0.9).save_pretrained(base / "blobs")
    (base / "generation_config.json").symlink_to(Path("blobs") / "generation_config.json")
    AutoTokenizer.from_pretrained(str(tokenizer_dir(example_corpus, tmp, LLAMA3, "base_tokenizer"))).save_pretrained(base)
    (tmp / "elsewhere.json").write_text(json.dumps({"chat_template": "{{ 'not the base model\'s' }}"}))
    (base / "chat_template.json").symlink_to(tmp / "elsewhere.json")


@pytest.fixture(scope="module")
def lora_run(world_of_one, example_corpus, tmp_path_factory):
    """A one-rank LoRA run from a Hugging Face base (hpctrain's initial weights written by
    tests/reference.py, with the files of a published model: as_published), trained 3 steps at a high
    learning rate so that B moves off zero, saved."""
    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    from reference import hf_dir

    d = tmp_path_factory.mktemp("lora")
    common = ["+experiment=tiny", "train.global_batch=4", "train.micro_batch=2", "optim.lr=0.01", "optim.warmup_steps=0",
              "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,o_proj,down_proj]"]
    base = hf_dir(compose(common), d / "base")
    as_published(base, example_corpus, d)
    cfg = compose([*common, f"model.init_from={base}", "train.steps=3", "checkpoint.every=3", f"run.dir={d / 'run'}"])
    t = Trainer.of(cfg, str(d / "run"), torch.device("cpu"))
    t.fit()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = t.parts[0](x)
    step = d / "run" / "checkpoints" / "step-00000003"
    return {"dir": d, "base": base, "step": step, "x": x, "logits": logits, "common": common, "trainer": t}


def test_exported_adapter_loads_in_peft_with_the_same_logits(lora_run, tmp_path):
    """Mutants: A and B swapped or transposed in the export, alpha / rank not written as PEFT reads it,
    a layer's Hugging Face name wrong (PEFT would leave that adapter at its initial value)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import run_main

    out = tmp_path / "adapter"
    done = run_main("hpctrain.checkpoint", "export", str(lora_run["step"]), str(out), "--format", "peft")
    assert done.returncode == 0, done.stderr
    assert "PEFT LoRA adapter (rank 4, alpha 8" in done.stdout
    base = AutoModelForCausalLM.from_pretrained(str(lora_run["base"]), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out))
    b = dict(model.named_parameters())
    assert any(n.endswith("lora_B.default.weight") and p.abs().max() > 0 for n, p in b.items())  # trained
    with torch.no_grad():
        theirs = model(input_ids=lora_run["x"]).logits
    torch.testing.assert_close(theirs, lora_run["logits"], rtol=1e-4, atol=1e-4)

    merged = tmp_path / "merged"
    done = run_main("hpctrain.checkpoint", "export", str(lora_run["step"]), str(merged), "--format", "hf")
    assert done.returncode == 0, done.stderr
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=lora_run["x"]).logits, theirs, rtol=1e-4, atol=1e-4)


def test_the_hf_export_of_a_fine_tuned_model_keeps_its_bases_settings(lora_run, tmp_path):
    """The merged export of a run trained at data.seq_len 64 from a base with max_position_embeddings 512,
    as transformers loads it: the base's 512, bos/eos ids, generation config and chat template (the
    tokenizer's, rendering as the base's does); the symlink out of the base is not followed. Mutants:
    max_position_embeddings from data.seq_len, bos/eos ids left null, generation_config.json or
    chat_template.jinja not copied, copying what a symlink leads to outside the base."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from hpctrain.core.rundir import read_info
    from helpers import run_main

    base, out = lora_run["base"], tmp_path / "hf"
    assert read_info(lora_run["step"])["config"]["data"]["seq_len"] == 64
    done = run_main("hpctrain.checkpoint", "export", str(lora_run["step"]), str(out), "--format", "hf")
    assert done.returncode == 0, done.stderr
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_id) == (512, 1, [2, 3])
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(base).to_dict()
    assert GenerationConfig.from_pretrained(out).temperature == 0.6
    assert not (out / "generation_config.json").is_symlink()
    ours, theirs = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(base))
    assert ours.chat_template == LLAMA3
    assert ours.apply_chat_template(CONVERSATIONS[1], tools=TOOLS, tokenize=True, return_dict=True)["input_ids"] == \
        theirs.apply_chat_template(CONVERSATIONS[1], tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
    assert not (out / "chat_template.json").exists()
    assert f"note: {base / 'chat_template.json'} leads outside {base}" in done.stderr


def tiny_checkpoint(step: Path, run_config: dict) -> Path:
    """A checkpoint as the export reads it, without training: a 1-layer Llama's weights saved by DCP,
    and hpctrain.json with `run_config` (its model keys filled in)."""
    import dataclasses
    import warnings

    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint.raw import RawWriter
    from hpctrain.core.rundir import INFO
    from hpctrain.core.schema import ModelConfig
    from hpctrain.models.llama import Llama

    m = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=512)
    torch.manual_seed(0)
    weights = {n: p.detach() for n, p in Llama(m, 16).named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": weights}, storage_writer=RawWriter(str(step), thread_count=1), no_dist=True)
    (step / INFO).write_text(json.dumps({"config": {**run_config, "model": dataclasses.asdict(m)}}))
    return step


def test_the_hf_export_without_a_base_takes_the_tokenizers_ids(example_corpus, tmp_path):
    """A model trained from scratch on shards prepared with a tokenizer saved by current transformers
    (its template in chat_template.jinja): config.json's bos and eos ids are the copied tokenizer's (eos:
    the shards' end-of-document id), generation_config.json says the same, as transformers'
    GenerationConfig.from_model_config would; max_position_embeddings is data.seq_len; the template
    travels from the shards into the export. Mutants: bos_token_id left null, no generation_config.json,
    chat_template.jinja not copied with the tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from hpctrain.checkpoint.hf_weights import export_hf
    from hpctrain.data.example import CHAT_TEMPLATE

    AutoTokenizer.from_pretrained(str(example_corpus)).save_pretrained(tmp_path / "tok")
    assert "chat_template" not in json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    meta = prepare_records(src, tmp_path / "shards", tmp_path / "tok", "chat", seq_len=64, val_fraction=0)
    step = tiny_checkpoint(tmp_path / "step-00000001", {"data": {"seq_len": 64, "path": str(tmp_path / "shards")}})
    notes: list = []
    export_hf(step, tmp_path / "hf", notes=notes)
    assert notes == []
    cfg, tok = AutoConfig.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert cfg.max_position_embeddings == 64
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, meta["eos_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert cfg.bos_token_id is not None
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    want, have = GenerationConfig.from_model_config(cfg), GenerationConfig.from_pretrained(tmp_path / "hf")
    assert [getattr(have, k) for k in ids] == [getattr(want, k) for k in ids] == [cfg.bos_token_id, meta["eos_id"], None]
    assert tok.chat_template == CHAT_TEMPLATE


def test_a_peft_adapter_is_imported_to_continue(lora_run, tmp_path):
    """model.lora.init_from: a new run starts from the exported adapter (the same logits as the run that
    wrote it); a mismatched rank is refused with the fix. Mutant: the adapters left at their init."""
    from hpctrain.core.compose import compose
    from hpctrain.checkpoint.peft_format import AdapterError, export_peft
    from hpctrain.train.loop import Trainer

    adapter = tmp_path / "adapter"
    export_peft(lora_run["step"], adapter)
    cfg = compose([*lora_run["common"], f"model.init_from={lora_run['base']}", f"model.lora.init_from={adapter}",
                   "train.steps=1", f"run.dir={tmp_path / 'run'}"])
    t = Trainer.of(cfg, str(tmp_path / "run"), torch.device("cpu"))
    t.resume(lambda *a: None)
    with torch.no_grad():
        torch.testing.assert_close(t.parts[0](lora_run["x"]), lora_run["logits"], rtol=1e-5, atol=1e-5)
    bad = compose([*lora_run["common"], "model.lora.rank=8", f"model.lora.init_from={adapter}",
                   f"run.dir={tmp_path / 'run2'}"])
    with pytest.raises(AdapterError, match="has rank 4 and alpha 8.0, the run asks for model.lora.rank=8"):
        Trainer.of(bad, str(tmp_path / "run2"), torch.device("cpu")).resume(lambda *a: None)


def test_frozen_weights_have_no_gradients_or_optimizer_state(lora_run):
    """Mutant: apply_lora not freezing the base (every weight in the optimizer, moments for all)."""
    t = lora_run["trainer"]
    named = dict(t.parts[0].named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    assert {"layers.0.attention.wq.lora_A", "layers.1.feed_forward.w2.lora_B"} <= trained
    assert "layers.0.attention.wk.lora_A" not in named  # not a target
    assert all(p.grad is None for n, p in named.items() if n not in trained)
    state = t.optimizer.state
    assert len(state) == len(trained) and all(p.requires_grad for p in state)


def test_bad_fine_tuning_keys_are_refused_on_the_login_node(chat_shards, tmp_path):
    """Each refusal names the key and the fix. Mutants: any of the checks in _lora / _chat_windows removed."""
    from hpctrain.checks.config_checks import problems
    from hpctrain.core.compose import compose

    def said(*overrides: str) -> str:
        return "\n".join(problems(compose(["+experiment=tiny", *overrides])))

    assert "qkv is not a linear layer of a block. Fix: choose from wq" in said("model.lora.rank=4",
                                                                               "model.lora.targets=[wq,qkv]")
    assert "model.lora.alpha=0.0 must be positive" in said("model.lora.rank=4", "model.lora.alpha=0")
    assert "but data.seq_len=32: records would be cut across samples. Fix: data.seq_len=64" in said(
        "data.source=shards", f"data.path={chat_shards}", "model.vocab_size=512", "data.seq_len=32")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    from safetensors.torch import save_file

    from hpctrain.core.adapters import adapter_shapes

    # A file with every tensor the model's adapters have (the login node reads its header).
    model = compose(["+experiment=tiny", "model.lora.rank=4", "model.lora.alpha=8",
                     "model.lora.targets=[q_proj,v_proj]"]).model
    save_file({k: torch.zeros(s) for k, s in adapter_shapes(model).items()}, adapter / "adapter_model.safetensors")
    assert "has rank 4 and alpha 8, the run asks for model.lora.rank=8" in said(
        "model.lora.rank=8", "model.lora.alpha=8", f"model.lora.init_from={adapter}")
    assert "but model.lora.rank=0. Fix: model.lora.rank=<the adapter's r>" in said(f"model.lora.init_from={adapter}")
    good = ("model.lora.rank=4", "model.lora.alpha=8", f"model.lora.init_from={adapter}",
            "model.lora.targets=[q_proj,v_proj]")
    assert said(*good) == ""
    # A tensor the model has no adapter for is refused there too, not dropped on the ranks (mutant: the
    # login node's read_adapter_config called without the model).
    save_file({**{k: torch.zeros(s) for k, s in adapter_shapes(model).items()},
               "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8)}, adapter / "adapter_model.safetensors")
    assert "holds 1 tensor this run's model has no adapter for" in said(*good)


# --- the planner under LoRA ----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def TINY_MODEL():
    """The tiny preset's model config, composed once (Hydra takes ~0.5 s a call)."""
    from hpctrain.core.compose import compose

    return compose(["+experiment=tiny"]).model


@settings(max_examples=25, deadline=None)
@given(dim=st.sampled_from([32, 64]), heads=st.sampled_from([2, 4]), kv=st.sampled_from([1, 2]),
       ffn=st.integers(8, 96), layers=st.integers(1, 3), rank=st.integers(1, 8), experts=st.sampled_from([0, 4]),
       shared=st.integers(0, 1), targets=st.sets(st.sampled_from(["wq", "wk", "wv", "wo", "w1", "w2", "w3",
                                                                "q_proj", "down_proj"]), min_size=1))
def test_planned_adapter_count_is_the_models(dim, heads, kv, ffn, layers, rank, experts, shared, targets):
    """lora_params (the planner's arithmetic) against the parameters apply_lora adds to the real module
    tree, dense and MoE (shared experts adapted, routed ones not). Mutants: the MoE blocks' SwiGLU counted,
    the shared experts forgotten, Hugging Face names not mapped, in + out taken as in x out."""
    from dataclasses import replace

    from hpctrain.core.flops import lora_params
    from hpctrain.core.spec import lora_of
    from hpctrain.models.llama import build_meta
    from hpctrain.models.lora import apply_lora

    base = TINY_MODEL()
    model_cfg = replace(base, dim=dim, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, n_layers=layers,
                        lora=replace(base.lora, rank=rank, targets=sorted(targets)),
                        moe=replace(base.moe, experts=experts, top_k=2, shared_experts=shared, ffn_dim=24))
    model = build_meta(model_cfg, 16)
    lo = lora_of(model_cfg)
    apply_lora(model, lo.rank, lo.alpha, lo.dropout, lo.targets)
    real = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B")))
    assert lora_params(model_cfg) == real


def test_70b_lora_fits_8_h100_because_frozen_weights_hold_no_state():
    """The preset's plan: frozen weights priced as bf16 parameters alone. Mutants: frozen weights given
    gradients and Adam state (16 bytes per parameter: ~140 GB per GPU), the base kept in fp32, the
    adapters' gradients priced for the whole model."""
    from hpctrain.core.compose import compose
    from hpctrain.plan.memory import GiB, job_of
    from hpctrain.plan.verdict import plan

    cfg = compose(["+experiment=llama3_70b_lora"])
    p = plan(job_of(cfg))
    dev = p.memory.device
    assert p.fits, p.problems
    # 70.6e9 frozen bf16 parameters over FSDP 4 x TP 2 = 8 ranks
    assert dev["params"] / GiB == pytest.approx(70.6e9 * 2 / 8 / GiB, rel=0.02)
    assert dev.get("moments", 0) < 0.5 * GiB and dev.get("grads", 0) + dev.get("unsharded_grads", 0) < 0.5 * GiB
    full = plan(job_of(compose(["+experiment=llama3_70b_lora", "model.lora.rank=0"])))
    assert not full.fits and full.memory.device_total > 2 * p.memory.device_total
    # backward without weight gradients: a LoRA step is faster than full training's on the same layout
    assert p.time.step_time_s < 0.85 * full.time.step_time_s


def test_a_lora_run_resumes_as_if_never_stopped(world_of_one, tmp_path):
    """Stopped after 2 of 4 steps (saved), then resumed by a new Trainer: the last 2 losses equal an
    uninterrupted run's, bit for bit. Mutants: adapters or their Adam moments missing from the
    checkpoint, frozen weights re-initialized on resume."""
    from hpctrain.core.compose import compose
    from hpctrain.train.loop import Trainer

    common = ["+experiment=tiny", "train.global_batch=4", "train.micro_batch=2", "optim.lr=0.01", "train.steps=4",
              "optim.warmup_steps=0", "model.lora.rank=4", "model.lora.alpha=8", "checkpoint.every=0"]

    def trainer(d):
        return Trainer.of(compose([*common, f"run.dir={d}"]), str(d), torch.device("cpu"))

    full = trainer(tmp_path / "full").fit().losses
    first = trainer(tmp_path / "stopped")
    first.resume(lambda *a: None)
    losses = [first.train_step()[0].item() for _ in range(2)]
    first.save()
    again = trainer(tmp_path / "stopped")
    rest = again.fit().losses
    assert again.resumed_from == 2
    assert losses + rest == full
