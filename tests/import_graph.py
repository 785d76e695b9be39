"""The import graph of gpumon/ and checks/, read from the source with ``ast`` (nothing is imported,
so a module that would fail or pull in torch at import costs nothing here).

Every form that makes one module depend on another is an edge, because each can close a circle
or carry a lower layer's code up into a higher one:

- ``import a.b`` and ``from a import b``, absolute or relative (checks/ imports itself relatively);
- at module level, inside a function (a lazy import, which runs later but still needs the target),
  and under ``if TYPE_CHECKING:`` (only the type checker runs it, yet the types bind the two modules
  as tightly: the shared type wants a home both can import);
- ``importlib.import_module("literal")``;
- the package ``__init__`` that importing ``a.b.c`` runs first (``a/__init__.py``, ``a/b/__init__.py``).
  That one is left out where the package is the importer's own: Python has started the importer's
  packages before the importer itself, so such an import runs nothing and needs nothing. A name
  taken from one's own package (``from gpumon.hw import Hardware`` inside gpumon/hw/) is kept: it
  needs that ``__init__`` to have run past the name, which is a real cycle when the ``__init__``
  imports the importer.

checks/ is named as it is installed, ``gpumon_checks``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the name it is installed as (pyproject's package-dir)
TOPS = {"gpumon": "gpumon", "checks": "gpumon_checks"}

# how an import is made, in the order the report prefers when one pair is imported several ways
AT_IMPORT = ""
LAZY = "lazy"
TYPE_ONLY = "type-only"
PACKAGE = "package __init__"
_RANK = {AT_IMPORT: 0, LAZY: 1, TYPE_ONLY: 2, PACKAGE: 3}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    rel: str  # the path from the repository's root, for the report
    package: bool  # an __init__.py


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # the importer's file, relative to the repository
    line: int
    how: str

    def where(self) -> str:
        return f"{self.path}:{self.line}" + (f", {self.how}" if self.how else "")


def modules(root: Path = ROOT) -> dict[str, Module]:
    found: dict[str, Module] = {}
    for folder, installed in TOPS.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [installed, *path.relative_to(root / folder).with_suffix("").parts]
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            name = ".".join(parts)
            found[name] = Module(name, path, str(path.relative_to(root)), package)
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt | ast.expr, str]]:
    """Each import statement or ``import_module`` call, with how it is made."""

    def visit(node: ast.AST, how: str) -> Iterator[tuple[ast.stmt | ast.expr, str]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Call) and _is_import_module(node)):
            yield node, how
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and how == AT_IMPORT:
            how = LAZY
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                yield from visit(stmt, TYPE_ONLY)
            for stmt in node.orelse:
                yield from visit(stmt, how)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, how)

    yield from visit(tree, AT_IMPORT)


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    named = (isinstance(func, ast.Name) and func.id == "import_module") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module")
    return named and bool(call.args) and isinstance(call.args[0], ast.Constant) \
        and isinstance(call.args[0].value, str)


def _targets(node: ast.stmt | ast.expr, module: Module, known: dict[str, Module]) -> list[str]:
    """The modules of ours that ``node`` names (not yet their packages)."""

    def longest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := longest(a.name)) is not None]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.name.split(".") if module.package else module.name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        out = []
        for alias in node.names:
            # ``from a import b``: the submodule a.b when there is one, else the name b of a's __init__
            target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else longest(base)
            if target is not None:
                out.append(target)
        return out
    assert isinstance(node, ast.Call) and isinstance(node.args[0], ast.Constant)
    target = longest(str(node.args[0].value))
    return [target] if target is not None else []


def edges(known: dict[str, Module] | None = None) -> list[Edge]:
    """Every import between two modules of ours, each pair once per way it is made."""
    known = modules() if known is None else known
    out: dict[tuple[str, str, str], Edge] = {}
    for module in known.values():
        own = set(_ancestors(module.name))
        for node, how in _imports(ast.parse(module.path.read_text(), str(module.path))):
            for target in _targets(node, module, known):
                packages = [(p, PACKAGE) for p in _ancestors(target) if p in known and p not in own]
                for name, kind in [(target, how), *packages]:
                    if name != module.name:
                        out.setdefault((module.name, name, kind),
                                       Edge(module.name, name, module.rel, node.lineno, kind))
    return sorted(out.values(), key=lambda e: (e.source, e.target, _RANK[e.how], e.line))


def strongest(found: list[Edge]) -> dict[tuple[str, str], Edge]:
    """Per importing pair, the edge the report names: at import time before lazy before type-only."""
    best: dict[tuple[str, str], Edge] = {}
    for edge in found:
        key = (edge.source, edge.target)
        if key not in best or _RANK[edge.how] < _RANK[best[key].how]:
            best[key] = edge
    return best


def cycles(pairs: dict[tuple[str, str], Edge]) -> list[list[Edge]]:
    """The circles of the graph: within each strongly connected part, for every edge u -> v the
    shortest way back from v to u, each circle once. Every edge of a circle is in one reported."""
    graph: dict[str, list[str]] = {}
    for source, target in sorted(pairs):
        graph.setdefault(source, []).append(target)
    found: dict[tuple[str, ...], list[Edge]] = {}
    for part in _strong_parts(graph):
        if len(part) < 2:
            continue
        for u in sorted(part):
            for v in graph.get(u, []):
                if v not in part:
                    continue
                back = _shortest(graph, v, u, part)
                assert back is not None  # u and v are in one strongly connected part
                ring = [u, *back]
                start = ring.index(min(ring[:-1]))
                key = tuple(ring[start:-1] + ring[:start])
                found.setdefault(key, [pairs[(a, b)] for a, b in zip(key, (*key[1:], key[0]), strict=True)])
    return [found[k] for k in sorted(found)]


def _strong_parts(graph: dict[str, list[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, without recursion (the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph.get(root, [])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.add(member)
                    if member == node:
                        break
                parts.append(part)
    return parts


def _shortest(graph: dict[str, list[str]], start: str, goal: str, within: set[str]) -> list[str] | None:
    came: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == goal:
            path = [node]
            while (prev := came[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for nxt in graph.get(node, []):
            if nxt in within and nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    return None


def chain(ring: list[Edge]) -> str:
    """``a -> b (a.py:3) -> a (b.py:9, lazy)``: each arrow with the line that makes it."""
    return " -> ".join([ring[0].source] + [f"{e.target} ({e.where()})" for e in ring])
