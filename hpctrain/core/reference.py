"""The configuration reference, generated from the schema (hpctrain.core.schema) and the presets in conf/.

    python -m hpctrain.core.reference > docs/config.md

A key's text is the attribute docstring under its field in the schema (the string literal on the
lines right after `steps: int = 100`), read from the source with `ast`; its type, default and
allowed values come from the dataclass itself. `keys()` walks the dataclasses recursively (a list
of dataclasses, such as data.sources, as `data.sources[].path`); `undocumented()` names the fields
without a docstring, which tests/test_reference.py refuses, as it refuses a docs/config.md that is
not what `markdown()` makes now. `groups()` lists conf/'s groups and their presets, for the
reference and for `python -m hpctrain --help`. No torch, no Hydra: reading files only.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import yaml

from hpctrain.core import schema
from hpctrain.core.compose import conf_dir
from hpctrain.core.schema import Choice

REGENERATE = "python -m hpctrain.core.reference > docs/config.md"

# Folders of conf/ that `python -m hpctrain` does not compose: how they are used instead.
OTHER_USE = {"sweep": "python -m hpctrain.bench.sweep NAME"}


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the reference."""

    name: str  # full dotted name: launcher.k8s.namespace; data.sources[].path for a list's elements
    type: str  # int, Optional[str], list[int], dict, choice; section: a nested dataclass, keys follow
    default: str  # as written on the command line: null, true, [], ???
    allowed: tuple[str, ...]  # a Choice's values, else ()
    doc: str  # the attribute docstring, '' where the field has none


# ---------------------------------------------------------------------------------------- the schema

def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in `cls`'s source (and its bases'); fields without one are
    missing. A class whose source cannot be read (made by make_dataclass) has none."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = _class_node(klass) if dataclasses.is_dataclass(klass) else None
        if node is None:
            continue
        for stmt, after in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _class_node(cls: type) -> Optional[ast.ClassDef]:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None
    if not path or not Path(path).is_file():
        return None
    return _classes(path, Path(path).stat().st_mtime_ns).get(cls.__qualname__)


@functools.lru_cache(maxsize=16)
def _classes(path: str, mtime_ns: int) -> dict[str, ast.ClassDef]:
    """Qualified name -> class statement, for every class in the file at `path`: each file is parsed
    once (inspect.getsource parses the whole module again for every class)."""
    out: dict[str, ast.ClassDef] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                out.setdefault(prefix + child.name, child)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(ast.parse(Path(path).read_text(encoding="utf-8")), "")
    return out


def class_doc(cls: type) -> str:
    """The docstring written in `cls` ('' for none: not the signature dataclass puts there)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclass's generated stand-in
        return ""
    return inspect.cleandoc(doc)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - names local to a function: keep the annotations as written
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _dataclass(tp: Any) -> Optional[type]:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _list_of_dataclass(tp: Any) -> Optional[type]:
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        return _dataclass(args[0]) if args else None
    return None


def type_name(tp: Any) -> str:
    """A type as the reference writes it: int, Optional[int], list[int], dict, choice."""
    if isinstance(tp, str):  # an annotation that could not be resolved
        return re.sub(r"\b(List|Dict|Tuple)\[", lambda m: m.group(1).lower() + "[", tp)
    if isinstance(tp, type) and issubclass(tp, Choice):
        return "choice"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        inner = ", ".join(type_name(a) for a in rest)
        return f"Optional[{inner}]" if len(rest) == 1 and len(rest) < len(args) else f"Union[{inner}]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def value_text(v: Any) -> str:
    """A default as it is written on the command line or in a yaml file."""
    if isinstance(v, Enum):
        return str(v.value)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else "''"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {value_text(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def keys(cls: type = schema.Config, prefix: str = "") -> list[Key]:
    """Every key under `cls`, depth first in field order: a nested dataclass gives a `section` row and
    then its keys; a list of dataclasses gives its own row and then its elements' keys (`name[].key`)."""
    hints, docs = _hints(cls), attribute_docs(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        name, tp, doc = prefix + f.name, hints.get(f.name, f.type), docs.get(f.name, "")
        nested = _dataclass(tp)
        if nested is not None:
            out.append(Key(name, "section", "", (), doc))
            out += keys(nested, name + ".")
            continue
        default = _default(f)
        choice = tp if isinstance(tp, type) and issubclass(tp, Choice) else type(default)
        allowed = choice.values() if issubclass(choice, Choice) else ()
        out.append(Key(name, type_name(tp), value_text(default), allowed, doc))
        element = _list_of_dataclass(tp)
        if element is not None:
            out += keys(element, name + "[].")
    return out


def undocumented(cls: type = schema.Config) -> list[str]:
    """The keys under `cls` whose field has no docstring (or an empty one)."""
    return [k.name for k in keys(cls) if not k.doc.strip()]


# -------------------------------------------------------------------------------------------- conf/

@dataclasses.dataclass(frozen=True)
class Group:
    name: str  # the folder of conf/
    presets: tuple[tuple[str, str], ...]  # (name, first sentence of its leading comment or '')
    default: Optional[str]  # the preset conf/config.yaml picks, if it picks one
    how: str  # how a preset is picked: `model=NAME`, `+experiment=NAME`, or the command that reads it


def preset_summary(path: Path) -> str:
    """The first sentence of a yaml file's leading `#` comment ('' without one); Hydra's
    `# @package` directive is not a comment."""
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s.startswith("#"):
            break
        text = s.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        if not text:
            if lines:
                break
            continue
        lines.append(text)
    return first_sentence(" ".join(lines))


def first_sentence(text: str) -> str:
    # A period ends a sentence when a space follows it, unless it ends an abbreviation (e.g., i.e.).
    for m in re.finditer(r"[.!?](?=\s)", text):
        if not re.search(r"\b(e\.g|i\.e|etc|vs|cf)$", text[: m.start()]):
            return text[: m.end()]
    return text


def _root_defaults(root: Path) -> dict[str, str]:
    doc = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8")) or {}
    out = {}
    for entry in doc.get("defaults", []):
        if isinstance(entry, dict):
            for k, v in entry.items():
                if isinstance(v, str):
                    out[str(k).split("@")[0].lstrip("+")] = v
    return out


def groups(root: Optional[Path] = None) -> list[Group]:
    """conf/'s folders, sorted, with their presets (the yaml files, sorted)."""
    root = conf_dir() if root is None else root
    picked = _root_defaults(root)
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        files = sorted(d.glob("*.yaml"))
        if not files:
            continue
        if d.name in OTHER_USE:
            how = OTHER_USE[d.name]
        elif d.name in picked:
            how = f"{d.name}=NAME"
        else:  # not in the root's defaults: appended (an experiment: `# @package _global_`)
            how = f"+{d.name}=NAME"
        out.append(Group(d.name, tuple((f.stem, preset_summary(f)) for f in files), picked.get(d.name), how))
    return out


def groups_help(root: Optional[Path] = None) -> str:
    """The groups and their presets in a few lines, for `python -m hpctrain --help`."""
    gs = groups(root)
    rows = [(f"{g.name}:", " ".join(name for name, _ in g.presets),
             f"(default: {g.default})" if g.default else
             f"(read by {g.how})" if g.name in OTHER_USE else f"(add one: {g.how})") for g in gs]
    w1, w2 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"  {a:<{w1}} {b:<{w2}}  {c}" for a, b, c in rows)


# ----------------------------------------------------------------------------------------- Markdown

def md_text(text: str) -> str:
    """One table cell of prose: whitespace folded to single spaces, `|` escaped everywhere (GFM splits
    cells before it reads code spans), and outside code spans the characters Markdown would read as
    HTML or emphasis (`<run.dir>` is text, `*_mem_gb` is not italics)."""
    text = " ".join(text.split())
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unmatched backtick is a character, not the start of a span
        parts[-2:] = [parts[-2] + "\\`" + parts[-1]]
    for i in range(0, len(parts), 2):
        p = re.sub(r"([\\*<])", r"\\\1", parts[i])
        parts[i] = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", p)
    return "`".join(parts).replace("|", "\\|")


def code(text: str) -> str:
    """`text` as a code span in a table cell."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", name.lower()).replace(" ", "-")


def _rows(ks: list[Key]) -> list[str]:
    out = ["| Key | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
    for k in ks:
        kind = "section" if k.type == "section" else code(k.type)
        default = code(k.default) if k.type != "section" else ""
        allowed = ", ".join(code(v) for v in k.allowed)
        doc = md_text(k.doc) + (" Its keys follow." if k.type == "section" else "")
        out.append(f"| {code(k.name)} | {kind} | {default} | {allowed} | {doc} |")
    return out


def markdown() -> str:
    """docs/config.md: every key of the schema, then conf/'s groups and presets."""
    cfg_docs = attribute_docs(schema.Config)
    hints = _hints(schema.Config)
    out = ["# Configuration reference", "",
           f"Generated from hpctrain/core/schema.py and conf/ by `{REGENERATE}`: edit those, not this file.", "",
           "Every key is set on the command line with its dotted name, `python -m hpctrain train.steps=10`, "
           "or in a preset of its group (below); `python -m hpctrain --cfg` prints the composed config. "
           "The defaults here are the schema's: the presets conf/config.yaml picks (see "
           "[Config groups](#config-groups)) set several of them. A key of a `choice` type takes one of "
           "its allowed values only; `???` must be given.", "",
           "| Top-level key | What |", "|---|---|"]
    fields = dataclasses.fields(schema.Config)
    for f in fields:
        out.append(f"| [{f.name}](#{_anchor(f.name)}) | {md_text(cfg_docs.get(f.name, ''))} |")
    out.append("| [Config groups](#config-groups) | conf/'s groups and their presets |")
    for f in fields:
        out += ["", f"## {f.name}", ""]
        nested = _dataclass(hints.get(f.name))
        intro = class_doc(nested) or cfg_docs.get(f.name, "") if nested is not None else ""
        if intro:  # a plain top-level key (dry_run) has its text in its row only
            out += [md_text(intro), ""]
        ks = keys(nested, f.name + ".") if nested is not None else [
            k for k in keys(schema.Config) if k.name == f.name]
        out += _rows(ks)
    out += ["", "## Config groups", "",
            "Presets are the yaml files of conf/'s folders, `conf/<group>/<preset>.yaml`; "
            "`python -m hpctrain --help` lists them too.", ""]
    for g in groups():
        out += [f"### {g.name}", ""]
        if g.name in OTHER_USE:
            out.append(f"Not a training config: read by `{g.how}`.")
        elif g.default:
            out.append(f"Picked with `{g.how}`; conf/config.yaml picks `{g.default}`.")
        else:
            out.append(f"Added with `{g.how}` (conf/config.yaml picks none).")
        out += ["", "| Preset | Description |", "|---|---|"]
        out += [f"| {code(name)} | {md_text(summary)} |" for name, summary in g.presets]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.buffer.write(markdown().encode("utf-8"))
