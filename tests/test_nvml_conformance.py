"""Conformance: every NVML C entry point gpumon can reach is implemented by the injection library.

gpumon reaches NVML only through ``pynvml.<function>`` references in gpumon/hw.
For each one, the C symbols pynvml resolves are read from pynvml's own source
(``_nvmlGetFunctionPointer("...")``), following calls between pynvml wrappers
(``nvmlInit`` -> ``nvmlInitWithFlags``). If gpumon starts calling a function
the library lacks, this test names it.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pynvml

from gpumon.sim import nvml_inject

HW = Path(__file__).resolve().parents[1] / "gpumon" / "hw"
_SYMBOL = re.compile(r'_nvmlGetFunctionPointer\("(\w+)"\)')
_WRAPPER_CALL = re.compile(r"\b(nvml\w+)\s*\(")


def _referenced_wrappers() -> set[str]:
    """pynvml.nvmlXxx names used in gpumon/hw, directly or as strings passed to Nvml.device/system."""
    names: set[str] = set()
    for path in HW.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "pynvml" and node.attr.startswith("nvml")
                    and callable(getattr(pynvml, node.attr, None))):
                names.add(node.attr)
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"nvml[A-Z]\w+", node.value)
                    and callable(getattr(pynvml, node.value, None))):
                names.add(node.value)
    return names


def _c_symbols(wrapper: str, seen: set[str]) -> set[str]:
    if wrapper in seen:
        return set()
    seen.add(wrapper)
    fn = getattr(pynvml, wrapper)
    source = inspect.getsource(fn)
    symbols = set(_SYMBOL.findall(source))
    body = source.split(":", 1)[1]
    for callee in _WRAPPER_CALL.findall(body):
        if callee != wrapper and callable(getattr(pynvml, callee, None)):
            symbols |= _c_symbols(callee, seen)
    return symbols


def test_gpumon_uses_nvml_at_all() -> None:
    wrappers = _referenced_wrappers()
    assert {"nvmlInit", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetHandleByIndex"} <= wrappers


def test_injection_library_implements_every_reachable_entry_point(inject_lib_dir: Path) -> None:
    exported = nvml_inject.exported_symbols(inject_lib_dir)
    needed: dict[str, set[str]] = {}
    seen: set[str] = set()
    for wrapper in sorted(_referenced_wrappers()):
        for symbol in _c_symbols(wrapper, seen):
            needed.setdefault(symbol, set()).add(wrapper)
    missing = {s: sorted(w) for s, w in needed.items() if s not in exported}
    assert not missing, f"injection library lacks NVML entry points used by gpumon: {missing}"
    assert len(needed) >= 15
