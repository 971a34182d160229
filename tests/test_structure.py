"""The package's layers, read from the code's own import statements (every one, also those inside
functions): no import cycles; each tier imports only itself and the tiers below it; the login-node
tier and the foundation never import torch. docs/design.md describes the tiers."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "hpctrain"
# The planner's calibration (published runs, their fit and picture): research code beside the package,
# imported as `calibration` with benchmarks/ on sys.path. The package reads only what the fit writes
# (conf/cluster/<kind>.yaml), never the code or its tables.
CALIBRATION = PKG.parent / "benchmarks" / "calibration"
OUTSIDE = ("calibration", "benchmarks")  # the top-level names code beside the package is imported by

# Module (or package prefix) -> tier. The first matching prefix wins.
TIERS = [
    # the foundation, torch-free: the schema, composing, the engine spec, FLOP counts, the run
    # directory, fault injection, the Hugging Face format's names and shapes; dataset formats
    ("hpctrain.core", "foundation"), ("hpctrain.data", "foundation"),
    # the login node: compose -> check -> plan -> launch, and the reports people read
    ("hpctrain.__main__", "login"), ("hpctrain.checks", "login"), ("hpctrain.plan", "login"),
    ("hpctrain.launch", "login"), ("hpctrain.report", "login"),
    # every rank
    ("hpctrain.run", "runtime"), ("hpctrain.train", "runtime"), ("hpctrain.distributed", "runtime"),
    ("hpctrain.parallel", "runtime"), ("hpctrain.models", "runtime"), ("hpctrain.checkpoint", "runtime"),
    ("hpctrain.offload", "runtime"),
    # tools on top of both: the collectives benchmark and its sweeps (their report is a login-node one)
    ("hpctrain.bench", "tools"),
]
ALLOWED = {"foundation": {"foundation"}, "login": {"foundation", "login"},
           "runtime": {"foundation", "runtime"}, "tools": {"foundation", "login", "runtime", "tools"}}
TORCH_FREE = ("foundation", "login")
# Within a tier: the launchers use the checks and the planner, never the other way round; the checks
# come before the planner.
FORBIDDEN = [("hpctrain.plan", "hpctrain.launch"), ("hpctrain.checks", "hpctrain.launch"),
             ("hpctrain.checks", "hpctrain.plan")]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def tier(module: str) -> str | None:
    for prefix, t in TIERS:
        if module == prefix or module.startswith(prefix + "."):
            return t
    return None


def imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names (absolute names)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from hpctrain.offload import adam_cpp` names the module hpctrain.offload.adam_cpp;
            # `from hpctrain.core.spec import Layout` names hpctrain.core.spec.
            subs = {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
            out |= subs if len(subs) == len(node.names) else subs | {base}
    return out


def _is_module(name: str) -> bool:
    path = PKG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in PKG.rglob("*.py")}
    out = {}
    for name, path in mods.items():
        out[name] = {m for m in imports(path) if m in mods and m != name}
    return out


@pytest.mark.slow
def test_every_module_has_a_tier():
    untiered = [m for m in graph() if m != "hpctrain" and tier(m) is None]
    assert not untiered, f"modules outside every tier (add them to TIERS and docs/design.md): {untiered}"


def test_no_import_cycles():
    g = graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_tiers_import_only_downwards():
    bad = []
    for mod, deps in graph().items():
        t = tier(mod)
        if t is None:
            continue
        for d in deps:
            td = tier(d)
            if td is not None and td not in ALLOWED[t]:
                bad.append(f"{mod} ({t}) imports {d} ({td})")
    assert not bad, "\n".join(sorted(bad))


def test_no_forbidden_imports_within_a_tier():
    bad = [f"{mod} imports {d}" for mod, deps in graph().items() for d in deps
           for a, b in FORBIDDEN if (mod == a or mod.startswith(a + ".")) and (d == b or d.startswith(b + "."))]
    assert not bad, bad


@pytest.mark.parametrize("t", TORCH_FREE)
def test_login_tier_and_foundation_never_import_torch(t):
    bad = []
    for path in PKG.rglob("*.py"):
        mod = module_name(path)
        if tier(mod) == t:
            bad += [f"{mod} imports {m}" for m in imports(path) if m.split(".")[0] == "torch"]
    assert not bad, bad


def test_the_package_never_imports_its_calibration():
    bad = [f"{module_name(p)} imports {m}" for p in PKG.rglob("*.py") for m in imports(p) if m.split(".")[0] in OUTSIDE]
    assert not bad, f"the package imports code from beside it: {bad}"


def test_the_calibration_lives_beside_the_package():
    moved = {p.name for p in CALIBRATION.iterdir() if not p.name.startswith(("__", "."))}
    assert {"published.py", "fit.py", "published.csv"} <= moved
    back = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*") if p.name in moved)
    assert not back, f"the calibration's files in the package: {back}"


def test_the_rules_can_fail(tmp_path, monkeypatch):
    """The checks above see a violation when there is one: a cycle, an upward import, the calibration
    imported or put back into the package."""
    fake = tmp_path / "hpctrain"
    (fake / "plan").mkdir(parents=True)
    (fake / "train").mkdir()
    for d in (fake, fake / "plan", fake / "train"):
        (d / "__init__.py").write_text("")
    (fake / "spec.py").write_text("from hpctrain.plan import a\n")
    (fake / "plan" / "a.py").write_text("import torch\nfrom hpctrain import spec\nfrom hpctrain.train import b\n")
    (fake / "train" / "b.py").write_text("def f():\n    from hpctrain.plan.a import x\n")
    (fake / "plan" / "published.py").write_text("from calibration import fit\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match=r"hpctrain.plan.a \(login\) imports hpctrain.train.b \(runtime\)"):
        test_tiers_import_only_downwards()
    with pytest.raises(AssertionError, match="hpctrain.plan.a imports torch"):
        test_login_tier_and_foundation_never_import_torch("login")
    with pytest.raises(AssertionError, match="hpctrain.plan.published imports calibration"):
        test_the_package_never_imports_its_calibration()
    with pytest.raises(AssertionError, match="hpctrain/plan/published.py"):
        test_the_calibration_lives_beside_the_package()
