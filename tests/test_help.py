"""`--help` of every command: a whole-sentence purpose, and a help text for every argument and option
that says its default where it has one. The parsers are taken from the commands themselves (each
builds its own in main()), so a new option without help fails here."""
from __future__ import annotations

import argparse
import importlib

import pytest

COMMANDS = ["hpctrain.report.__main__", "hpctrain.report.goodput", "hpctrain.checkpoint.__main__",
            "hpctrain.data.prepare", "hpctrain.data.example", "hpctrain.bench.sweep", "hpctrain.report.nccl_report"]


class Caught(Exception):
    pass


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    seen = []

    def catch(self, *a, **k):
        seen.append(self)
        raise Caught

    for method in ("parse_args", "parse_intermixed_args"):
        monkeypatch.setattr(argparse.ArgumentParser, method, catch)
    with pytest.raises(Caught):
        importlib.import_module(module).main(["--help"])
    return seen[0]


def parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


@pytest.mark.parametrize("module", COMMANDS)
def test_every_option_says_what_it_is_and_its_default(module, monkeypatch):
    """Mutants: the old prepare (--shard-mb without help, no defaults), export's help for one format only,
    a description cut at its first line ("writes report.html and")."""
    for p in parsers(parser_of(module, monkeypatch)):
        assert p.description and p.description.rstrip().endswith((".", ")")), (p.prog, p.description)
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(a.option_strings) or a.dest
            assert a.help and len(a.help) > 10, f"{p.prog} {name}: no help"
            has_default = a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
            if has_default:
                assert "default" in a.help, f"{p.prog} {name}: the default ({a.default!r}) is not said"


def test_goodput_help_is_help(capsys):
    from hpctrain.report.goodput import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "run_dir" in out and "interruption" in out  # not a bare usage line
    assert main([]) == 2 and "required: run_dir" in capsys.readouterr().err


def test_export_help_names_both_formats(capsys):
    from hpctrain.checkpoint.__main__ import main

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert "one safetensors file" in out and "Hugging Face" in out
