"""The configuration reference (hpctrain.core.reference): docs/config.md is what the schema and conf/
make now, every schema field has a docstring (a new knob without one fails here), and
`python -m hpctrain --help` lists conf/'s groups and presets as they are on disk."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.core import reference, schema
from hpctrain.core.compose import conf_dir

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "config.md"


def schema_fields(cls=schema.Config, prefix=""):
    """Every field's dotted name, found without the reference's walker."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, tp = prefix + f.name, hints[f.name]
        yield name
        if dataclasses.is_dataclass(tp):
            yield from schema_fields(tp, name + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from schema_fields(typing.get_args(tp)[0], name + "[].")


def row(md: str, key: str) -> str:
    rows = [line for line in md.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, f"{key}: {len(rows)} rows"
    return rows[0]


def test_docs_config_md_is_current():
    want = reference.markdown()
    have = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert have == want, f"docs/config.md is out of date; regenerate it with: {reference.REGENERATE}"
    assert reference.REGENERATE in want.splitlines()[2]  # the file says how it is made


def test_every_field_is_in_the_reference_with_a_docstring():
    ks = {k.name: k for k in reference.keys()}
    names = list(schema_fields())
    assert set(names) == set(ks), set(names) ^ set(ks)
    assert reference.undocumented() == [], "schema fields without a docstring (add one under the field)"
    md = reference.markdown()
    top = {f.name for f in dataclasses.fields(schema.Config)}
    for name in names:
        assert ks[name].doc.strip(), name
        if name in top and ks[name].type == "section":  # a top-level group: its own section
            assert f"\n## {name}\n" in md and f"| [{name}](#{name}) | {reference.md_text(ks[name].doc)} |" in md
        else:
            assert reference.md_text(ks[name].doc) in row(md, name), name


@dataclass
class _Inner:
    documented: int = 1
    """Has a docstring."""
    bare: int = 2


@dataclass
class _Mutant:
    inner: _Inner = field(default_factory=_Inner)
    """A nested group."""
    flag: bool = False  # a comment is not a docstring


def test_a_field_without_docstring_is_reported(monkeypatch):
    assert reference.undocumented(_Mutant) == ["inner.bare", "flag"]
    # The schema itself with one docstring gone: the check fails, naming the key.
    docs = reference.attribute_docs

    def without_steps(cls):
        out = docs(cls)
        if cls is schema.TrainConfig:
            out.pop("steps")
        return out

    monkeypatch.setattr(reference, "attribute_docs", without_steps)
    assert reference.undocumented() == ["train.steps"]


def test_key_rows():
    md = reference.markdown()
    precision = row(md, "train.precision")
    assert "`choice`" in precision and "`fp32`, `bf16`" in precision and "| `fp32` |" in precision
    assert "| `Optional[str]` | `null` |" in row(md, "launcher.k8s.volume_claim")
    assert "| `list[int]` | `[]` |" in row(md, "parallel.pp_layers")
    assert "| `dict` | `{}` |" in row(md, "cluster.env")
    assert "| `str` | `outputs/${run.name}` |" in row(md, "run.dir")
    # Pipes in text are escaped, so every row has the five cells of the header.
    for line in md.splitlines():
        if line.startswith("| `") and "Preset" not in line:
            cells = line.replace("\\|", "").count("|")
            assert cells in (3, 6), line


def test_markdown_text_escapes():
    assert reference.md_text("none | full") == "none \\| full"
    assert reference.md_text("`a|b` <run.dir>/x *_mem_gb") == "`a\\|b` \\<run.dir>/x \\*\\_mem_gb"


def test_help_lists_groups_presets_sweeps_and_the_reference(capsys):
    from hpctrain.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hpctrain")
    assert "python -m hpctrain -m +experiment=tiny optim.lr=1e-3,3e-3" in out
    assert "docs/config.md" in out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    conf = conf_dir()
    folders = sorted(d for d in conf.iterdir() if d.is_dir() and any(d.glob("*.yaml")))
    assert folders
    for d in folders:
        presets = sorted(p.stem for p in d.glob("*.yaml"))
        assert d.name in lines, (d.name, out)
        assert lines[d.name].split(":", 1)[1].split("(")[0].split() == presets, (lines[d.name], presets)
    for cmd in ("hpctrain.report RUN_DIR", "hpctrain.report.goodput RUN_DIR", "hpctrain.plan",
                "hpctrain.checkpoint export|list", "hpctrain.data.prepare SRC OUT", "hpctrain.data.example OUT",
                "hpctrain.bench.sweep", "hpctrain.report.nccl_report SWEEP_DIR"):
        assert f"python -m {cmd}" in out, cmd
