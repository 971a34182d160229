"""Data files from users that would take the machine or leak a file: a FIFO or /dev/zero as meta.json or
tokenizer_config.json, a tokenizer file linked to a secret outside its directory, chat templates that
build gigabytes or loop for hours, "content": null, token ids past the embedding, and meta.json values
out of range. Each is refused with a message naming the file (or record) and the fix. What could hang
or fill memory runs in a subprocess with 1 GiB of address space: a mutant then fails with MemoryError
or its timeout (a guard against hanging the suite, not a claim about speed), never takes the machine.
Each test names the mutant it catches."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import chat, shards
from hpctrain.data.render_budget import Budget
from hpctrain.data.shards import META, ShardDataset

REPO = Path(__file__).resolve().parent.parent
CAP_BYTES = 1 << 30
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def capped(code: str, *args) -> subprocess.CompletedProcess:
    """`python -c code args` within CAP_BYTES of address space."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (CAP_BYTES, CAP_BYTES))

    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, preexec_fn=limit,
                          capture_output=True, text=True, timeout=120)


def results(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer (ChatML's turn tokens, <|endoftext|>) with CHATML as its template."""
    from hpctrain.data.example import EOS, TURN, train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    texts = ["the assistant answers the user's question about files and tokens"] * 20
    train_tokenizer(texts, 300).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS, "chat_template": CHATML,
        "additional_special_tokens": list(TURN)}))
    return d


def copy_tokenizer(src: Path, dst: Path, **extra: str) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    for name, text in extra.items():
        (dst / name).write_text(text)
    return dst


def shard_dir(d: Path, ids: np.ndarray, **meta) -> Path:
    """A shard directory of one train shard holding `ids` (uint16), as from elsewhere: no max_token_id
    unless given."""
    d.mkdir()
    ids.astype(np.uint16).tofile(d / "train-00000.bin")
    (d / META).write_text(json.dumps({"format": 2, "vocab_size": 1024, "dtype": "uint16", "eos_id": 0,
                                      "tokenizer": {"sha256": "x"}, **meta,
                                      "splits": {"train": {"shards": [{"file": "train-00000.bin",
                                                                       "tokens": len(ids)}]}}}))
    return d


# --- meta.json and tokenizer_config.json that are not files -----------------------------------------

def make_not_a_file(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


KIND = {"fifo": "a FIFO", "zero": "a character device"}

META_CHECK = """
import json, sys
from hpctrain.checks import config_checks
from hpctrain.core.schema import Config
from hpctrain.data import shards
d = sys.argv[1]
cfg = Config()
cfg.data.source, cfg.data.path, cfg.data.seq_len = "shards", d, 16
try:
    shards.ShardDataset(d, 16)
    rank = "read"
except ValueError as e:
    rank = str(e)
print(json.dumps({"login": list(config_checks._data(cfg)), "meta": shards.read_meta(d), "rank": rank}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_meta_json_that_is_a_fifo_or_dev_zero_is_refused_at_once(tmp_path, kind):
    """The login node's check (config_checks._data) and a rank's ShardDataset. Mutant: meta.json read with
    Path.read_text (the FIFO blocks for a writer: the timeout; /dev/zero fills memory: MemoryError)."""
    d = shard_dir(tmp_path / "shards", np.arange(100))
    make_not_a_file(d / META, kind)
    out = results(capped(META_CHECK, d))
    (msg,) = out["login"]
    for part in (f"data.path={d}", f"{d / META} is not a regular file ({KIND[kind]})", "Fix: copy the directory again"):
        assert part in msg, msg
    assert out["meta"] is None
    assert f"{d} cannot be read as token shards" in out["rank"] and KIND[kind] in out["rank"]


PREPARE = """
import json, sys
from hpctrain.data.documents import CorpusError
from hpctrain.data.prepare import prepare
from hpctrain.data.tokenizer import TokenizerError
try:
    prepare(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None, val_fraction=0)
    print(json.dumps("prepared"))
except (TokenizerError, CorpusError) as e:
    print(json.dumps(str(e)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_tokenizer_config_that_is_a_fifo_or_dev_zero_is_refused_at_once(tok_dir, tmp_path, kind):
    """prepare --tokenizer DIR whose tokenizer_config.json is a FIFO or /dev/zero: refused by kind, before
    the corpus is read. Mutant: configured_eos taking any unreadable config as no suggestion (the old
    reader: prepare went on with an eos of its own choosing, and wrote a config of its own)."""
    d = copy_tokenizer(tok_dir, tmp_path / "tok")
    make_not_a_file(d / "tokenizer_config.json", kind)
    (tmp_path / "corpus.txt").write_text("the user asks about tokens")
    msg = results(capped(PREPARE, tmp_path / "corpus.txt", tmp_path / "out", d))
    assert msg == f"{d / 'tokenizer_config.json'} is not a regular file ({KIND[kind]}). Fix: replace it with the " \
                  f"file it should be", msg
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_corpus_entry_that_is_a_fifo_or_dev_zero_is_refused_by_kind(tmp_path, kind):
    """A corpus directory holding b.txt that is a FIFO or /dev/zero: named, not read and not skipped.
    Mutant: corpus_files listing only is_file() entries (the old listing: skipped without a word)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a document")
    make_not_a_file(tmp_path / "src" / "b.txt", kind)
    msg = results(capped(PREPARE, tmp_path / "src", tmp_path / "out"))
    assert msg == f"{tmp_path / 'src' / 'b.txt'} is not a regular file ({KIND[kind]}): not a file of documents. " \
                  f"Fix: remove it from {tmp_path / 'src'}, or leave its ending out of --ext", msg


CAPPED_DOCUMENTS = """
import json, sys
from hpctrain.data import documents
from hpctrain.data.prepare import prepare
documents.DOCUMENT_CHARS = 1000
out = {}
for src in sys.argv[1:]:
    try:
        prepare(src, src + ".out", val_fraction=0)
        out[src] = "prepared"
    except BaseException as e:
        out[src] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_document_or_json_line_past_the_cap_is_refused_before_it_is_read(tmp_path):
    """One text file is one document, one JSON line one record: each is read only up to DOCUMENT_CHARS
    (1000 here). A sparse file of 64 GiB without a newline stands for a one-line JSON array of that size.
    Mutants: Path.read_bytes for text files, line iteration without a bound (the line read whole: a
    MemoryError in this process's 1 GiB)."""
    for name in ("huge.txt", "huge.jsonl"):
        with open(tmp_path / name, "wb") as f:
            f.write(b'{"text": "')
            f.truncate(64 << 30)
    got = results(capped(CAPPED_DOCUMENTS, tmp_path / "huge.txt", tmp_path / "huge.jsonl"))
    assert got[str(tmp_path / "huge.txt")] == (
        f"CorpusError: {tmp_path / 'huge.txt'} is {64 << 30:,} bytes, more than such a file can be (1,000): a text "
        f"file is one document. Fix: split it into files of at most 1,000 bytes, or into JSON lines (one document "
        f"each)")
    assert got[str(tmp_path / "huge.jsonl")].startswith(
        f"CorpusError: {tmp_path / 'huge.jsonl'}:1 is longer than 1,000 characters: not a JSON line")


# --- tokenizer files linked outside their directory -------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer_config.json", chat.TEMPLATE_FILE, "tokenizer.json"])
def test_a_tokenizer_file_linked_outside_its_directory_is_refused_not_copied(tok_dir, tmp_path, name):
    """A file of the tokenizer directory that is a symlink to a secret elsewhere: prepare refuses it before
    writing anything, and the secret is in no file of the output. A link to a file inside the directory
    (as the Hugging Face cache's snapshots link into its blobs) is followed. Mutants: side_file without
    hf_format.inside (the secret copied into the shard directory: the old _copy_tokenizer), side_file
    refusing every symlink (the link inside refused)."""
    from hpctrain.data.prepare import prepare
    from hpctrain.data.tokenizer import TokenizerError

    d = copy_tokenizer(tok_dir, tmp_path / "tok")
    secret = tmp_path / "secret"
    secret.write_bytes({"tokenizer.json": (d / "tokenizer.json").read_bytes(),  # parses: refused for where it is
                        "tokenizer_config.json": b'{"eos_token": "<|endoftext|>", "aws_secret": "AKIA-SECRET"}',
                        chat.TEMPLATE_FILE: b"AKIA-SECRET {{ messages }}"}[name])
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(secret)
    (tmp_path / "corpus.txt").write_text("the user asks about tokens")
    with pytest.raises(TokenizerError, match=f"{d / name} leads outside {d} \\(to {secret}\\): .* Fix: copy the file"):
        prepare(tmp_path / "corpus.txt", tmp_path / "out", d, val_fraction=0)
    assert not (tmp_path / "out").exists()

    (d / "kept").write_bytes(secret.read_bytes().replace(b"AKIA-SECRET", b"fine"))
    (d / name).unlink()
    (d / name).symlink_to("kept")  # inside: followed
    prepare(tmp_path / "corpus.txt", tmp_path / "out", d, val_fraction=0)
    assert (tmp_path / "out" / name).read_bytes() == (d / "kept").read_bytes()
    assert not any(b"AKIA" in f.read_bytes() for f in (tmp_path / "out").iterdir() if f.is_file())


# --- chat templates that would take the machine -----------------------------------------------------

HOSTILE = {  # name: (template, what the refusal says)
    "printf-width": ("{{ '%999999999s' % 'x' }}", "the % operator would build 1,000,000,011 characters"),
    "format-width": ("{{ '{:>9999999999}'.format('x') }}", "a call of format would build 10,000,000,020 characters"),
    "nested-width": ("{{ '{:{}}'.format('x', 10**10) }}", "a call of format would build"),
    "string-times": ("{{ 'x' * 10**10 }}", "the * operator would build 10,000,000,000 characters"),
    "center": ("{{ 'x'|center(9999999999) }}", "the center filter would build 9,999,999,999 characters"),
    "format-filter": ("{{ '%.999999999f'|format(1.0) }}", "the format filter would build"),
    "power": ("{{ 10 ** (10 ** 10) }}", "the ** operator would build a number of 10,000,000,001 digits"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                 "{{ ns.s }}", "the + operator would build 16,777,216 characters"),
    "shared-refs": ("{% set a = ['x' * 1000] * 1000 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
                    "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{% set e = [c, c, c, c, c, c, c, c, c, c] %}{{ e }}",
                    "writing a value would build"),
    "join": ("{{ (['x' * 1000000] * 1000)|join }}", "the join filter would build 1,000,000,000 characters"),
    "text-in-a-loop": ("{% set s = 'x' * 1000000 %}{% set out %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                       "{% endset %}{{ out|length }}", "the values built in one rendering add up to more than"),
    "nested-loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                     "more than 1,000,000 loop iterations and calls"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest more than 64 deep"),
}

RENDER = """
import json, sys
from hpctrain.data import chat
out = {}
for name, source in json.loads(sys.argv[1]).items():
    try:
        text = chat.ChatTemplate(source).render([{"role": "user", "content": "hi"}])
        out[name] = "rendered %d characters" % len(text)
    except chat.ChatError as e:
        out[name] = str(e)
    except BaseException as e:
        out[name] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_hostile_templates_are_refused_before_they_allocate(tmp_path):
    """Each refused by its own rule, in a process that has 1 GiB: the refusal comes before the allocation.
    Mutants, one rule each: '%' or '*' or '+' or '**' not in intercepted_binops (MemoryError, or 10**10**10
    computed), wrap_str_format's width not priced (format-width), filters not wrapped (center, join),
    TEXT not inserted (shared-refs: str() of a list of 10^4 references to 10^6 characters), the LOOP
    filter not inserted (nested-loops: then only the clock stops it, with another message), no depth
    bound (recursion: Python's RecursionError)."""
    got = results(capped(RENDER, json.dumps({k: v[0] for k, v in HOSTILE.items()})))
    for name, (_, says) in HOSTILE.items():
        assert "went past its budget" in got[name] and says in got[name], (name, got[name])
        assert "Fix: " in got[name]


def test_the_budget_is_per_template_and_a_larger_one_renders(tmp_path):
    """A value of 20 million characters is refused with the default budget (16 million) and renders with
    a larger one; the refusal names the option that raises it. Mutant: Budget.chars ignored (a constant)."""
    source = "{{ 'x' * 20000000 }}"
    with pytest.raises(chat.ChatError, match=r"the \* operator would build 20,000,000 characters, more than the "
                                             r"16,000,000 allowed. Fix: if the record is that large, raise "
                                             r"--render-mb"):
        chat.ChatTemplate(source).render([])
    assert len(chat.ChatTemplate(source, budget=Budget(chars=30_000_000)).render([])) == 20_000_000


def test_iterations_and_time_are_budgets_of_their_own():
    """A macro calling itself twice, 30 deep (2^30 calls, none nested past 31): stopped by the count of
    calls; the clock, a record's seconds, stops a rendering that steps slowly. Mutants: calls not counted
    (Budget.step not called from call), the clock never read."""
    fan = "{% macro f(n) %}{% if n < 30 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}"
    with pytest.raises(chat.ChatError, match="more than 1,000 loop iterations and calls"):
        chat.ChatTemplate(fan, budget=Budget(iterations=1000)).render([])
    with pytest.raises(chat.ChatError, match=r"the record took more than 0 s to render. Fix: if the record is that "
                                             r"large, raise --render-seconds"):
        chat.ChatTemplate(fan, budget=Budget(seconds=0)).render([])


@pytest.mark.slow
def test_prepare_names_the_record_its_budget_and_the_fix(tok_dir, tmp_path):
    """prepare --format chat with a template that builds what a record asks for: the second record is
    refused with its file, line and number, the limit and the fix, no traceback; nothing is written.
    Mutant: prepare_records without the record in the message (chat.encode's ChatError as it comes)."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content * (m.repeat or 1) + "
                "'<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    d = copy_tokenizer(tok_dir, tmp_path / "tok", **{chat.TEMPLATE_FILE: template})
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "repeat": n}]}
               for n in (2, 10**10)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code = "import sys; from hpctrain.data.prepare import main; sys.exit(main(sys.argv[1:]))"
    proc = capped(code, tmp_path / "c.jsonl", tmp_path / "out", "--tokenizer", d, "--format", "chat")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for part in (f"{tmp_path / 'c.jsonl'}:2 (record 2): rendering it with {d / chat.TEMPLATE_FILE} went past its "
                 f"budget", "the * operator would build 50,000,000,000 characters, more than the 16,000,000 allowed",
                 "raise --render-mb"):
        assert part in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


# --- "content": null -----------------------------------------------------------------------------------

NULL_TEMPLATES = {
    "printed": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    "tested": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is defined %}{{ m.content }}"
               "{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
               "{{ c.function|tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"),
}
TOOL_CALL = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                 "name": "weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "21 C"}, {"role": "assistant", "content": "It is 21 C.", "tool_calls": None}]


@pytest.mark.parametrize("template", list(NULL_TEMPLATES))
def test_content_null_renders_as_transformers_renders_it(tok_dir, tmp_path, template):
    """A tool call's "content": null (and "tool_calls": null) as transformers' apply_chat_template renders
    them: the key dropped, so `m.content` is undefined (empty, not "None"). Mutant: chat.without_nulls not
    applied (the printed template writes "None"; `is defined` holds for null)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = copy_tokenizer(tok_dir, tmp_path / "tok", **{chat.TEMPLATE_FILE: NULL_TEMPLATES[template]})
    theirs = AutoTokenizer.from_pretrained(str(d))
    want = theirs.apply_chat_template(TOOL_CALL, tokenize=True, return_dict=True)["input_ids"]
    ids, mask = chat.encode({"messages": TOOL_CALL}, "chat", Tokenizer.from_file(str(d / "tokenizer.json")),
                            chat.ChatTemplate.of(d / "tokenizer.json"), eos_id=0)
    assert ids[:-1].tolist() == list(want)
    assert "None" not in theirs.decode(want)


def test_a_template_that_fails_on_null_is_a_message_not_a_traceback(tok_dir):
    """ChatML adds the content to text: with the content dropped, jinja2's undefined refuses it (as in
    transformers); a number where text goes is a TypeError. Both a ChatError naming the template.
    Mutant: _render catching only jinja2.TemplateError (TypeError: the old traceback)."""
    t = chat.ChatTemplate.of(tok_dir / "tokenizer.json")
    with pytest.raises(chat.ChatError, match="the chat template refused the conversation: 'dict object' has no "
                                             "attribute 'content'"):
        t.assistant_spans(TOOL_CALL)
    with pytest.raises(chat.ChatError, match=r"failed on the conversation \(TypeError: .*\). Fix: correct "):
        t.assistant_spans([{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}])


# --- token ids past the vocabulary ---------------------------------------------------------------------

def test_ids_past_model_vocab_size_are_refused_naming_the_shard(tmp_path):
    """Shards from elsewhere (no max_token_id): the first read of a shard compares its largest id (numpy's
    max of the file, the reference) with model.vocab_size, once per shard. Mutants: no check (the id
    reaches the embedding: IndexError, a device assert on a GPU), the check against meta.json's
    vocab_size only (1024 here: passes), no cache (the shard read again)."""
    ids = np.arange(3000) % 1000
    d = shard_dir(tmp_path / "s", ids)
    largest = int(np.fromfile(d / "train-00000.bin", np.uint16).max())
    with pytest.raises(ValueError, match=f"{d / 'train-00000.bin'} holds token id {largest}, but "
                                         f"model.vocab_size=512: .* Fix: model.vocab_size={largest + 1} or more"):
        ShardDataset(d, 16, vocab_size=512)[0]
    ds = ShardDataset(d, 16, vocab_size=1000)
    assert ds[0].tolist() == ids[:17].tolist()
    key = next(k for k in shards._MAX_IDS if k[0] == os.path.realpath(d / "train-00000.bin"))
    shards._MAX_IDS[key] = 10**9  # a second dataset on the same shard reads the cached maximum, not the file
    with pytest.raises(ValueError, match="token id 1,000,000,000"):
        ShardDataset(d, 16, vocab_size=1000)[0]


def test_prepare_records_the_largest_id_and_a_smaller_model_is_refused_at_once(tok_dir, tmp_path):
    """meta.json's max_token_id is the largest id in the shards (np.fromfile: the reference), and a
    ShardDataset refuses a model smaller than that at once, naming meta.json. A tokenizer whose ids have a
    gap (70000 among 4 tokens) gets a dtype that holds them. Mutants: max_token_id of the last shard only
    or not written; vocab_size as get_vocab_size() (uint8: OverflowError at the first document)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hpctrain.data.prepare import prepare

    docs = ["the assistant answers the user's question about files and tokens"] + ["zzz qqq"] * 10
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    meta = prepare(tmp_path / "c.jsonl", tmp_path / "out", tok_dir, val_fraction=0, shard_bytes=64)
    per_shard = [int(np.fromfile(tmp_path / "out" / s["file"], meta["dtype"]).max())
                 for s in meta["splits"]["train"]["shards"]]
    assert len(per_shard) > 1 and per_shard[0] > per_shard[-1]  # the largest id is not in the last shard
    assert meta["max_token_id"] == max(per_shard)
    with pytest.raises(ValueError, match=f"meta.json \\(max_token_id\\) holds token id {meta['max_token_id']}, but "
                                         f"model.vocab_size=10"):
        ShardDataset(tmp_path / "out", 4, vocab_size=10)

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 2, "far": 70000}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "gap").mkdir()
    tok.save(str(tmp_path / "gap" / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("a far b far")
    meta = prepare(tmp_path / "c.txt", tmp_path / "gap_out", tmp_path / "gap", val_fraction=0)
    assert (meta["vocab_size"], meta["dtype"], meta["max_token_id"]) == (70001, "uint32", 70000)
    assert np.fromfile(tmp_path / "gap_out" / "train-00000.bin", "uint32").tolist() == [0, 70000, 1, 70000, 2]


# --- meta.json values ------------------------------------------------------------------------------------

BAD_VALUES = {  # key: value, and what the message says
    "eos-negative": ({"eos_id": -5}, "eos_id=-5 must be a token id: a whole number from 0 below vocab_size=1024"),
    "eos-huge": ({"eos_id": 10**30}, "eos_id=1000000000000000000000000000000 must be a token id"),
    "eos-text": ({"eos_id": "0"}, 'eos_id="0" must be a token id'),
    "max-id-past-vocab": ({"max_token_id": 1024}, "max_token_id=1024 must be a token id"),
    "documents-negative": ({"documents": -7}, "documents=-7 must be a whole number from 0"),
    "window-text": ({"window": "64"}, 'window="64" must be a whole number from 0'),
    "loss-mask-text": ({"loss_mask": "yes"}, 'loss_mask="yes" must be true or false'),
    "vocab-huge": ({"vocab_size": 1 << 40}, "vocab_size=1099511627776 must be a positive whole number, at most"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_meta_json_values_are_checked_by_type_and_range(tmp_path, case):
    """Each was trusted: a negative or huge eos_id reached the document mask (an int64 overflow in torch),
    documents the planner's mean document length, window the login node's message. Mutants:
    shards._value_problems not called, or its range checks loosened to the type alone."""
    extra, says = BAD_VALUES[case]
    d = shard_dir(tmp_path / "s", np.arange(100), **extra)
    (msg,) = shards.problems(d)
    assert str(d / META) in msg and says in msg and "Fix: prepare it again" in msg, msg
    with pytest.raises(ValueError, match="cannot be read as token shards"):
        ShardDataset(d, 16)
