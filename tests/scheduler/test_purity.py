"""The scheduler is plain data and decisions: no torch, no files, no printing.

Every module of ``scheduler/`` is read as source (not imported) and its imports and calls
are checked. (The fusion key, which hashes torch modules, lives in ``workers/signature.py``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
FORBIDDEN_IMPORTS = {"torch", "fusion", "server", "os", "io", "pathlib", "csv", "json", "shutil", "subprocess", "sqlite3"}
FORBIDDEN_CALLS = {"open", "print", "input"}
FORBIDDEN_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "open", "unlink", "mkdir"}


def _imported(tree: ast.AST) -> set[str]:
    """Top-level names of every import in ``tree``, with fusetune.<pkg> reduced to <pkg>."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module]
        else:
            continue
        for mod in mods:
            parts = mod.split(".")
            names.add(parts[1] if parts[0] == "fusetune" and len(parts) > 1 else parts[0])
    return names


def _calls(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names of called functions and of called methods in ``tree``."""
    funcs, methods = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                funcs.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                methods.add(node.func.attr)
    return funcs, methods


MODULES = sorted(SCHEDULER.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_does_no_io_and_imports_no_torch(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not _imported(tree) & FORBIDDEN_IMPORTS, path.name
    funcs, methods = _calls(tree)
    assert not funcs & FORBIDDEN_CALLS, path.name
    assert not methods & FORBIDDEN_METHODS, path.name


def test_the_checks_see_what_they_forbid() -> None:
    tree = ast.parse("import csv\nfrom fusetune.fusion import x\nopen('f')\nPath('p').read_text()\n")
    assert _imported(tree) & FORBIDDEN_IMPORTS == {"csv", "fusion"}
    funcs, methods = _calls(tree)
    assert "open" in funcs and "read_text" in methods
