"""The shape of the code stays what docs/extending/architecture.md says: the simulator out of the
production path, a framework that knows no individual check, and a module map that names what the tree
holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from import_graph import Edge, edges, strongest

ROOT = Path(__file__).resolve().parents[1]
# the one place where --simulate builds the simulated node
EDGE = ROOT / "gpumon" / "cli.py"
SIM = ROOT / "gpumon" / "sim"


def _sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _imports() -> list[Edge]:
    """Every import between modules of gpumon/ and checks/ (lazy, type-only and relative ones too;
    tests/import_graph.py), one per importing pair."""
    return sorted(strongest(edges()).values(), key=lambda e: (e.source, e.target))


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_only_the_cli_knows_the_simulator() -> None:
    """Nothing that runs on a real node imports the simulator or asks whether the node is simulated
    (issue 13's grep, which also catches the words in comments and strings)."""
    pattern = re.compile(r"gpumon.sim|\.simulated")
    found = []
    for path in _sources("gpumon", "checks"):
        if path == EDGE or SIM in path.parents:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                  for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    found += [f"{e.where()}: imports {e.target}" for e in _imports()
              if _in(e.target, "gpumon.sim") and e.source != "gpumon.cli" and not _in(e.source, "gpumon.sim")]
    assert not found, "\n".join(found)


def test_the_framework_imports_no_check() -> None:
    found = [f"{e.where()}: imports {e.target}" for e in _imports()
             if _in(e.source, "gpumon") and _in(e.target, "gpumon_checks")]
    assert not found, "\n".join(found)


def test_protocol_members_are_not_looked_up_by_name() -> None:
    members = ("cost", "after_suite", "interval", "timeout", "phase", "Config", "supported", "extras",
               "kernel_log", "kernel_log_fold", "add_many", "canary_verdict", "verdict", "retry", "options")
    pattern = re.compile(r"getattr\([^)]*,\s*[\"'](" + "|".join(members) + r")[\"']")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _sources("gpumon", "checks")
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# the architecture page's module map: the first fenced block (a plain ``` fence) under its heading
ARCHITECTURE = ROOT / "docs" / "extending" / "architecture.md"
MODULE_MAP = "## Module map\n"


def _layout() -> str:
    text = ARCHITECTURE.read_text()
    assert MODULE_MAP in text, f"{ARCHITECTURE.relative_to(ROOT)} has no {MODULE_MAP.strip()!r} section"
    section = text[text.index(MODULE_MAP) + len(MODULE_MAP):]
    section = section[:m.start()] if (m := re.search(r"^## ", section, re.M)) else section
    # its first fence opens the map (a plain one: not the diagram's ```mermaid), and the next closes it
    block = re.search(r"^(```[^\n]*)\n(.*?)^```$", section, re.S | re.M)
    assert block is not None and block.group(1) == "```", \
        "the architecture page's Module map section does not open with a plain ``` block"
    return block.group(2)


def test_the_module_map_names_every_module_and_check() -> None:
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _layout()))
    missing = []
    for path in _sources("gpumon"):
        if SIM / "nvml_inject" in path.parents or path.name in ("__init__.py", "__main__.py"):
            continue
        if path.stem not in words:
            missing.append(str(path.relative_to(ROOT)))
    for entry in sorted((ROOT / "checks").iterdir()):
        name = entry.stem if entry.suffix == ".py" else entry.name
        if name.startswith("__") or not (entry.suffix == ".py" or (entry / "__init__.py").exists()):
            continue
        if name not in words:
            missing.append(str(entry.relative_to(ROOT)))
        if entry.is_dir():
            missing += [str(p.relative_to(ROOT)) for p in entry.glob("*.py")
                        if p.name != "__init__.py" and p.stem not in words]
    assert not missing, "the architecture page's module map does not name: " + ", ".join(missing)


def test_the_module_map_names_nothing_that_is_gone() -> None:
    tree = [p for top in ("gpumon", "checks", "config", "tools", "deploy") for p in (ROOT / top).rglob("*")
            if "__pycache__" not in p.parts]
    names = {p.name for p in tree} | {p.name for p in ROOT.iterdir()}
    gone = [token for token in re.findall(r"\b((?:[a-z_]+/)+|[a-z_]+\.py)(?=[\s,)]|$)", _layout())
            if token.rstrip("/").split("/")[-1] not in names]
    for pkg in re.findall(r"^  ([a-z_]+)/", _layout(), re.M):
        if not (ROOT / "checks" / pkg / "__init__.py").exists():
            gone.append(f"checks/{pkg}/")
    assert not gone, "the architecture page's module map names what the tree lacks: " + ", ".join(gone)


def test_optional_members_are_not_discovered_at_run_time() -> None:
    """Issue 22 point 3: a check's optional members (after-suite step, canary judging, kernel-log
    needs) are declared with defaults on ``Check``: no runtime-checkable protocol to test a check
    against, no class made at run time (``type(name, bases, namespace)``) to run a member of it."""
    found = []
    for path in _sources("gpumon", "checks"):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                  for n, line in enumerate(text.splitlines(), 1) if "runtime_checkable" in line]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: type() with 3 arguments"
                  for node in ast.walk(ast.parse(text, str(path)))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "type" and len(node.args) == 3]
    assert not found, "\n".join(found)
