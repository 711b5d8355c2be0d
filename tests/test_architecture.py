"""The structure the design card asks for, read from the source: arrows point one way, and no
room is too big to live in.

Every module of ``server/``, ``scheduler/``, ``fusion/``, ``workers/`` and ``client/`` is
parsed (not imported), and its imports, those under ``if TYPE_CHECKING`` and inside
functions included, make the graph these tests walk.

* Packages: server -> scheduler, workers, fusion; workers -> fusion; client -> the shared
  code (workers' workload protocol, signature and FusionSampler; fusion); never back up, and
  no cycle between packages. The ``fusetune`` command (``server.cli``) is a client of the API
  too, and may import the client, which never imports the server.
* Modules inside ``server/``: no cycle.
* The scheduler is plain data and decisions: no torch, no files (``tests/scheduler/test_purity.py``
  holds its list of what that forbids).
* Optuna's private table models (``optuna.storages._rdb``) have one importer.
* Sizes: no module in ``server/`` over 600 lines, no function over 80, no class over 25 methods.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "scheduler", "fusion", "workers", "client")
#: Which packages each package may import (itself always). ``server.cli``, the ``fusetune``
#: command, also takes the client: most of its commands are a client of the API.
CLIENT_OF_THE_API = {"server.cli"}
ALLOWED = {
    "server": {"scheduler", "workers", "fusion"},
    "workers": {"fusion"},
    "client": {"workers", "fusion"},
    "scheduler": set(),
    "fusion": set(),
}
MAX_SERVER_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_METHODS = 25


def modules() -> dict[str, Path]:
    """Dotted name (``server.loop.dispatch``) -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ours that ``path`` (module ``name``) imports, as dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            target = target.removeprefix("fusetune.")
            # The longest known module the target names (``from x import y``: y may be a module).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(path, name, known) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for source, targets in graph().items():
        for target in targets:
            a, b = source.split(".")[0], target.split(".")[0]
            if a != b:
                edges[a].add(b)
    return edges


def test_packages_import_only_downwards() -> None:
    wrong = {
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if target.split(".")[0] != source.split(".")[0] and target.split(".")[0] not in ALLOWED[source.split(".")[0]]
        and not (source in CLIENT_OF_THE_API and target.split(".")[0] == "client")
    }
    assert not wrong, sorted(wrong)
    assert cycles(package_edges()) == []


def test_no_cycle_between_the_servers_modules() -> None:
    edges = {n: {t for t in ts if t.startswith("server")} for n, ts in graph().items() if n.startswith("server")}
    # A package's __init__ that re-exports its modules is not a cycle with them.
    edges = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in edges.items()}
    assert cycles(edges) == []


def test_optunas_private_tables_have_one_importer() -> None:
    importers = [
        name for name, path in modules().items()
        if "optuna.storages._rdb" in path.read_text()
    ]
    assert len(importers) == 1, importers


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


@pytest.mark.parametrize("package", PACKAGES)
def test_no_room_too_big(package: str) -> None:
    too_long, too_many = [], []
    for name, path in modules().items():
        if not name.startswith(package):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in _functions(tree):
            lines = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
            if lines > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{fn.name}: {lines} lines")
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            if len(methods) > MAX_CLASS_METHODS:
                too_many.append(f"{name}.{cls.name}: {len(methods)} methods")
        if package == "server":
            lines = len(path.read_text().splitlines())
            if lines > MAX_SERVER_MODULE_LINES:
                too_long.append(f"{name}: a module of {lines} lines")
    assert not too_long and not too_many, too_long + too_many


def test_the_walk_sees_what_it_forbids(tmp_path: Path) -> None:
    """The checks themselves: a relative import resolves, a cycle is found, a long function counted."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("from ..db import models\nfrom fusetune.fusion import fuse\nimport fusetune.workers.spec\n")
    assert imports_of(source, "server.loop.m", {"server.db.models", "server.db", "fusion", "workers.spec"}) == {
        "server.db.models", "server.db", "fusion", "workers.spec",
    }
