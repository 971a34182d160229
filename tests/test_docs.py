"""The docs say what the code does: every command the README, docs/, a docstring, conf/ or a script
names exists and answers --help; sentences that describe a behaviour are checked against it."""
from __future__ import annotations

import importlib.util
import os
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"python3? -m (hpctrain(?:\.[A-Za-z_][A-Za-z_0-9]*)*)")
# Started by hpctrain itself over a pipe (the local launcher's fork server speaks a protocol on stdin):
# named in docstrings, never typed by a person.
NOT_TYPED = {"hpctrain.launch.forkserver"}


def key_docs() -> dict[str, str]:
    """Each config key's doc, as docs/config.md shows it (hpctrain.core.reference)."""
    from hpctrain.core.reference import keys

    return {k.name: " ".join(k.doc.split()) for k in keys()}


def named_commands() -> dict[str, str]:
    """Every `python -m hpctrain...` module named in the repository's text, with one place naming it."""
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "hpctrain").rglob("*.py"),
             *(REPO / "conf").rglob("*.yaml"), *(REPO / "slurm").glob("*"), *(REPO / "benchmarks").glob("*"),
             *(REPO / ".ci").glob("*")]
    out = {}
    for f in files:
        if not f.is_file():
            continue
        for m in COMMAND.finditer(f.read_text(errors="replace")):
            out.setdefault(m.group(1).rstrip("."), str(f.relative_to(REPO)))
    return out


def entry_point(module: str) -> str | None:
    """Why `python -m module` would not run hpctrain code, or None."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return "no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        return None if importlib.util.find_spec(module + ".__main__") else "a package without __main__.py"
    if 'if __name__ == "__main__":' not in Path(spec.origin).read_text():
        return "a module with no `if __name__ == \"__main__\":` (python -m runs it and does nothing)"
    return None


def test_every_command_named_exists_and_runs():
    """Mutants: docs naming `python -m hpctrain.core.hf_format config DIR` while hf_format has no main
    (it printed nothing and exited 0); a renamed module left in a doc."""
    named = named_commands()
    assert {"hpctrain", "hpctrain.plan", "hpctrain.data.prepare", "hpctrain.checkpoint"} <= set(named)
    broken = {m: f"{where}: {why}" for m, where in named.items() if (why := entry_point(m))}
    assert not broken, broken


@pytest.mark.parametrize("module", sorted(set(named_commands()) - NOT_TYPED))
def test_every_command_named_answers_help(module, monkeypatch, tmp_path, capfd):
    """`python -m X --help` says how to use X and exits 0, for every X the docs name (the internal ones
    that take a run directory too: a person who finds them in a doc or a process list types --help).
    Run in this process (runpy, as `python -m` does): a process each would cost seconds of imports.
    Mutants: `hpctrain.plan --help` exiting 1; `hpctrain.run --help` reading '--help' as a run directory."""
    monkeypatch.chdir(tmp_path)  # nothing a command may write lands in the checkout
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    def exit_now(code):  # hpctrain.run ends with os._exit (no waiting on threads): not in this process
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_now)
    package = importlib.util.find_spec(module).submodule_search_locations is not None
    code = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        try:
            runpy.run_module(module + ".__main__" if package else module, run_name="__main__", alter_sys=False)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capfd.readouterr()
    text = out + err
    assert code == 0, (code, text[-2000:])
    assert "usage" in text.lower() or f"python -m {module}" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_the_dry_run_doc_says_what_a_dry_run_does():
    """A dry run writes nothing (tests/test_login_node.py runs one); its key's doc said it wrote
    <run.dir>/plan.json, and so did the README. Mutant: either sentence back."""
    doc = key_docs()["dry_run"]
    assert "nothing is written" in doc and "plan.json" not in doc.split("nothing is written")[0], doc
    readme = (REPO / "README.md").read_text()
    for sentence in re.split(r"(?<=[.;])\s", readme.replace("\n", " ")):
        if "dry_run=true" in sentence and "writes `<run.dir>/plan.json`" in sentence:
            pytest.fail(f"README says a dry run writes plan.json: {sentence}")


def test_the_world_size_rule_names_every_degree():
    """Every key doc that states the world-size rule names all five degrees the check multiplies
    (hpctrain.checks.config_checks: pp x dp_replicate x dp_shard x cp x tp). Mutant: the rule as it was
    written before context parallelism (without cp) in any of the four places."""
    rules = {k: d for k, d in key_docs().items() if "must equal the world size" in " ".join(d.split())}
    assert {"parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp", "parallel.cp"} <= set(rules)
    for key, doc in rules.items():
        product = " ".join(doc.split()).split(" must equal the world size")[0].rsplit(". ", 1)[-1]
        assert set(re.findall(r"[a-z_]+", product)) - {"x"} == {"pp", "dp_replicate", "dp_shard", "cp", "tp"}, (key, product)


def test_the_install_line_installs_the_versions_the_suite_passed_on():
    """The README's install line uses constraints.txt, which pins every dependency pyproject.toml names
    (core and the dev extra) to one version inside pyproject's range, and .ci/run runs the README's own
    lines in a fresh venv. Mutants: a new dependency in pyproject.toml without a pin (a fresh machine
    would get whatever is newest); a pin outside the allowed range; .ci/run installing its own line."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    block = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("pip install -c constraints.txt ") and block[1] == "pytest", block
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt: bash .ci/refresh-constraints"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    ci = (REPO / ".ci" / "run").read_text()
    assert "readme_line 1" in ci and "readme_line 2" in ci and "python3 -m venv" in ci and "pip install" not in \
        ci.replace("is not a pip install", "").replace('"pip install "*', "")
