"""No circles, no arrows back up (issue 38): the import graph of gpumon/ and checks/ has no cycle,
and no module imports one of a higher layer. Lazy imports, ``TYPE_CHECKING`` imports, relative
imports and the package ``__init__`` an import runs all count (tests/import_graph.py says how).

The layers, lowest first, from DESIGN.md's one-way flow (sources -> checks -> findings -> health
state -> exporters / remediators) and its in-job layer. A module may import its own layer and the
ones below. A new module is placed here on purpose: the test fails for one that is in no layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import AT_IMPORT, LAZY, PACKAGE, TYPE_ONLY, Edge, chain, cycles, edges, modules, strongest

# (name, what it holds, module patterns): an exact module name, or ``package.*`` for what is in
# it. The most specific pattern places a module (gpumon.fabric.cli is a command, the rest of
# gpumon.fabric a library), so a package's own command sits with the commands.
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("base", "plain data and helpers every layer shares: they touch no machine and know no check",
     ("gpumon", "gpumon.errors", "gpumon.model", "gpumon.atomic", "gpumon.schema", "gpumon.distribution",
      "gpumon.usage", "gpumon.intake_protocol", "gpumon.schemas")),
    ("hw", "the only code that touches the machine",
     ("gpumon.hw", "gpumon.hw.*")),
    ("libraries", "built on the hw layer, knowing no check: the node as handed in, the worker pool, "
     "the idle gate, profiles, reports, the SDC canaries, the fabric probe, the simulator, and the "
     "in-job guard, which runs in users' training processes and so must not reach the daemon",
     ("gpumon.machine", "gpumon.workers", "gpumon.idle", "gpumon.profiles", "gpumon.report",
      "gpumon.sdc", "gpumon.sdc.*", "gpumon.fabric", "gpumon.fabric.*", "gpumon.sim", "gpumon.sim.*",
      "gpumon.guard", "gpumon.guard.*")),
    ("framework", "what a check is and what runs it: the Check protocol, its state, the registry, "
     "the configuration, the runner",
     ("gpumon.check", "gpumon.bootstate", "gpumon.checkstate", "gpumon.registry", "gpumon.config",
      "gpumon.runner")),
    ("checks", "the built-in checks, plugins on the framework",
     ("gpumon_checks", "gpumon_checks.*")),
    ("health", "where findings go: the event store and the reboot-aware fold",
     ("gpumon.health", "gpumon.health.*")),
    ("outputs", "what reads the health state: exporters and remediators",
     ("gpumon.export", "gpumon.export.*", "gpumon.remediate", "gpumon.remediate.*")),
    ("commands", "the processes: the command line, the agent, the daemon and its parts (the intake "
     "socket's server, the kernel-log pump, the sinks), the bootstrap suite, the commands of the "
     "libraries",
     ("gpumon.__main__", "gpumon.cli", "gpumon.agent", "gpumon.bootstrap", "gpumon.config_show",
      "gpumon.daemon", "gpumon.daemon_sinks", "gpumon.daemon_report", "gpumon.kernel_pump",
      "gpumon.intake", "gpumon.sdc.cli", "gpumon.fabric.cli", "gpumon.guard.cli", "gpumon.why",
      "gpumon.why.*")),
)

# Imports allowed to point the wrong way while they are being fixed (none now): each entry whose
# import is gone fails the test, so the list only shrinks.
NOT_YET_FIXED: frozenset[tuple[str, str]] = frozenset()


def _layer_of(name: str) -> int | None:
    # (exact name, pattern length): an exact name places a module before any package pattern, and
    # a longer package pattern before a shorter one
    fits = [((pattern == name, len(pattern)), rank) for rank, (_, _, patterns) in enumerate(LAYERS)
            for pattern in patterns
            if pattern == name or (pattern.endswith(".*") and name.startswith(pattern[:-1]))]
    return max(fits)[1] if fits else None


def _graph() -> dict[tuple[str, str], Edge]:
    return {pair: edge for pair, edge in strongest(edges()).items() if pair not in NOT_YET_FIXED}


def test_every_module_has_a_layer() -> None:
    missing = [f"{m.rel} ({m.name})" for m in modules().values() if _layer_of(m.name) is None]
    assert not missing, "place these in LAYERS: " + ", ".join(missing)


def test_no_import_cycles() -> None:
    found = [chain(ring) for ring in cycles(_graph())]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    found = []
    for (source, target), edge in sorted(_graph().items()):
        low, high = _layer_of(source), _layer_of(target)
        if low is not None and high is not None and high > low:
            found.append(f"{source} ({LAYERS[low][0]}) -> {target} ({LAYERS[high][0]}) at {edge.where()}")
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


def test_the_not_yet_fixed_imports_are_still_there() -> None:
    present = set(strongest(edges()))
    gone = sorted(NOT_YET_FIXED - present)
    assert not gone, "fixed: take these out of NOT_YET_FIXED: " + ", ".join(f"{a} -> {b}" for a, b in gone)


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """What the graph is built from, on a tree of its own: a cycle through a lazy import, one
    through a type-only one, relative imports, ``import_module``, the package ``__init__``."""
    _tree(tmp_path, {
        "gpumon/__init__.py": "",
        "gpumon/a.py": "def f():\n    from gpumon import b\n",
        "gpumon/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpumon.a import f\n",
        "gpumon/hw/__init__.py": "from .calls import call\n",
        "gpumon/hw/calls.py": "import importlib\ncall = importlib.import_module('gpumon.model')\n",
        "gpumon/model.py": "",
        "gpumon/user.py": "from gpumon.hw.calls import call\n",
        "checks/__init__.py": "",
        "checks/ib/__init__.py": "from .check import IbCheck\n",
        "checks/ib/check.py": "from ..ib import state\nIbCheck = 1\n",
        "checks/ib/state.py": "",
    })
    found = {(e.source, e.target, e.how) for e in edges(modules(tmp_path))}
    assert ("gpumon.a", "gpumon.b", LAZY) in found
    assert ("gpumon.b", "gpumon.a", TYPE_ONLY) in found
    assert ("gpumon.hw", "gpumon.hw.calls", AT_IMPORT) in found
    assert ("gpumon.hw.calls", "gpumon.model", AT_IMPORT) in found
    # importing gpumon.hw.calls runs gpumon/hw/__init__.py first
    assert ("gpumon.user", "gpumon.hw", PACKAGE) in found
    assert ("gpumon_checks.ib.check", "gpumon_checks.ib.state", AT_IMPORT) in found
    # a module's own package was started before it: no edge, so no false circle through it
    assert not any(s == "gpumon.hw.calls" and t == "gpumon.hw" for s, t, _ in found)
    assert not any(s == "gpumon_checks.ib.check" and t == "gpumon_checks.ib" for s, t, _ in found)
    rings = [chain(r) for r in cycles(strongest(edges(modules(tmp_path))))]
    assert rings == ["gpumon.a -> gpumon.b (gpumon/a.py:2, lazy) -> gpumon.a (gpumon/b.py:3, type-only)"]


@pytest.mark.parametrize("line", ["from gpumon.hw import call\n", "from . import call\n"])
def test_a_name_from_ones_own_package_is_a_cycle_when_the_package_imports_the_module(
        tmp_path: Path, line: str) -> None:
    # ``call`` is a name of gpumon/hw/__init__.py, which has not reached it when it imports calls.py
    _tree(tmp_path, {
        "gpumon/__init__.py": "",
        "gpumon/hw/__init__.py": "from .calls import read\ncall = 1\n",
        "gpumon/hw/calls.py": line + "read = 1\n",
    })
    rings = [chain(r) for r in cycles(strongest(edges(modules(tmp_path))))]
    assert rings == ["gpumon.hw -> gpumon.hw.calls (gpumon/hw/__init__.py:1) -> gpumon.hw "
                     "(gpumon/hw/calls.py:1)"]


def test_the_layers_follow_the_design() -> None:
    """The rules the issue names, so that a reordering of LAYERS that loosens them fails."""
    def rank(name: str) -> int:
        got = _layer_of(name)
        assert got is not None, name
        return got

    assert rank("gpumon.hw.nvml") < rank("gpumon.check") < rank("gpumon_checks.xid.check")
    assert rank("gpumon.hw.kernellog") < rank("gpumon.check")
    assert rank("gpumon_checks.ib.check") < rank("gpumon.health.store") < rank("gpumon.export.prometheus")
    # the guard runs in users' training processes: below the framework and the daemon
    assert rank("gpumon.guard.core") < rank("gpumon.check") < rank("gpumon.intake")
    assert rank("gpumon.daemon") == len(LAYERS) - 1
