"""The package's architecture holds: layered imports (import-linter) and no private names imported."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dvidshards"


def test_layers_contract():
    r = subprocess.run([str(_tool("lint-imports"))], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "broken" not in r.stdout.lower() or "0 broken" in r.stdout.lower(), r.stdout[-3000:]


def _tool(name: str) -> Path:
    exe = Path(sys.executable).with_name(name)
    if not exe.exists():
        msg = f"{name} is not installed (pip install -e '.[test]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + "; under CI the gates must run", pytrace=False)
        pytest.skip(msg)
    return exe


def test_mypy_passes():
    """mypy over the package, with pyproject's settings (check_untyped_defs: function bodies are checked)."""
    r = subprocess.run([str(_tool("mypy")), "dvidshards"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_passes():
    """ruff over the package, the tests and the benchmarks, with the rule set chosen in pyproject.toml."""
    r = subprocess.run([str(_tool("ruff")), "check", "dvidshards", "tests", "benchmarks"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_module_imports_private_names_of_another():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dvidshards")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} "
                                         f"from {'.' * node.level}{node.module or ''}")
    assert not offenders, "\n".join(offenders)


def _imports() -> dict[str, set[str]]:
    """{module: dvidshards modules it imports anywhere in its file (function level too)}."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        pkg = parts if is_pkg else parts[:-1]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[:len(pkg) - node.level + 1]) if node.level else ""
                target = ".".join(p for p in (base, node.module or "") if p)
                for alias in node.names:
                    out.add(f"{target}.{alias.name}")
                out.add(target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        mods[name] = out
    known = set(mods)
    return {m: {t for t in ts if t in known and t != m} for m, ts in mods.items()}


def test_no_import_cycles():
    """Tarjan over the module graph (function-level imports included): every component one module."""
    graph = {m: ts for m, ts in _imports().items() if m != "dvidshards"}  # the root re-exports
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w == "dvidshards":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_contract_has_no_ignored_imports():
    text = (ROOT / "pyproject.toml").read_text()
    assert "ignore_imports" not in text


def test_architecture_md_lists_every_module():
    """ARCHITECTURE.md's file table names every module of the package, and no module that is gone."""
    import re

    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("## The files"):]
    named, layer = set(), ""
    for line in table.splitlines():
        if not line.startswith("|"):
            continue
        layer = line.split("|")[1].strip() or layer  # an empty cell continues the row above
        for name in re.findall(r"`([\w/]+\.py)`", line):
            if "/" not in name and layer == "formats" and name != "formats/__init__.py":
                name = f"formats/{name}"
            named.add(name.removeprefix("dvidshards/"))
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert files - named == set(), f"modules missing from ARCHITECTURE.md: {sorted(files - named)}"
    assert named - files == set(), f"ARCHITECTURE.md names modules that do not exist: {sorted(named - files)}"


def test_no_module_path_shims_and_no_test_helpers_in_the_package():
    """0.1 was never released: its old module paths are gone (no import finder), and the test helpers live in
    tests/support, not in the installed package."""
    code = """if True:
        import importlib, sys
        import dvidshards
        assert not any(type(f).__module__.startswith("dvidshards") for f in sys.meta_path), sys.meta_path
        assert not hasattr(dvidshards.Dataset, "viewer")
        for old in ("dvidshards.flight", "dvidshards.stats", "dvidshards.convert", "dvidshards.testing"):
            try:
                importlib.import_module(old)
            except ModuleNotFoundError:
                continue
            raise AssertionError(old + " still imports")
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
