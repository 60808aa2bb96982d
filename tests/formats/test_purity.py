"""formats/ is functions over bytes and arrays: no module there reaches files, processes, locks or
threads (an AST check of every module, so a new one is checked too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dvidshards.formats

FORMATS = Path(dvidshards.formats.__file__).parent
MODULES = sorted(FORMATS.rglob("*.py"))
# modules whose import means I/O, a process, a lock or a thread
BANNED = {"os", "io", "threading", "_thread", "subprocess", "fcntl", "mmap", "tempfile", "shutil", "glob",
          "multiprocessing", "concurrent", "socket", "pathlib", "posixpath", "ntpath", "select", "signal",
          "asyncio", "urllib", "http", "requests"}
# in-memory names of those modules that do no I/O
ALLOWED = {("io", "BytesIO"), ("io", "BufferedIOBase"), ("pathlib", "PurePosixPath")}


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(FORMATS.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            out += [f"{where}: from {node.module} import {a.name}" for a in node.names
                    if top in BANNED and (top, a.name) not in ALLOWED]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("open", "__import__", "exec", "eval"):
                out.append(f"{where}: {f.id}(...)")
            elif isinstance(f, ast.Attribute) and f.attr in ("OSFile", "memory_map", "open_code") \
                    or isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "builtins":
                out.append(f"{where}: {ast.unparse(f)}(...)")
    return out


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os.path\nfrom threading import Lock\nfrom io import open as o\nimport pyarrow as pa\n"
                   "from io import BytesIO\nwith open('x') as f: pass\npa.OSFile('x')\n")
    global FORMATS
    keep, FORMATS = FORMATS, tmp_path
    try:
        found = _problems(bad)
    finally:
        FORMATS = keep
    assert sorted(p.split(": ", 1)[1] for p in found) == [
        "from io import open", "from threading import Lock", "import os.path", "open(...)", "pa.OSFile(...)"]


def test_there_are_modules_to_check():
    names = {p.stem for p in MODULES}
    assert {"codec", "mapping", "records", "jit", "blocks", "multilod", "labels"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(FORMATS)))
def test_a_formats_module_does_no_io(path):
    assert _problems(path) == []
