"""The name gpumon is installed under, for every hint that tells a user what to install.

The import package and the command are ``gpumon``; the distribution on the package index is
``gpumon-node``, because ``gpumon`` there is an unrelated GPU monitor (a hint saying
``pip install gpumon`` would install someone else's project).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpumon.errors import GpumonError

DISTRIBUTION = "gpumon-node"


def install_hint(extra: str | None = None) -> str:
    """The pip command that brings in ``extra`` (e.g. ``compute``: torch and numpy)."""
    target = f"{DISTRIBUTION}[{extra}]" if extra else DISTRIBUTION
    return f"pip install '{target}'"


class ExtraMissing(GpumonError):
    """A library that only an optional backend needs is not installed (or does not import); the
    message names the extra that brings it. Where a setting asked for the backend, the caller
    turns it into a ConfigError naming that setting's file and line."""


def require(module: str, *, extra: str, library: str, needed_by: str) -> ModuleType:
    """``module``, imported; else ExtraMissing: "<needed_by> needs <library>, which is not
    installed: pip install 'gpumon-node[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # a dependency of the library missing (a broken install) is said as such, not as the library
        absent = isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == \
            module.partition(".")[0]
        state = "is not installed" if absent else f"does not import ({exc})"
        raise ExtraMissing(f"{needed_by} needs {library}, which {state}: {install_hint(extra)}") from None
