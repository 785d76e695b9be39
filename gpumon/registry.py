"""Checks are found through the ``gpumon.checks`` entry-point group.

Built at startup, never at import time (no import side effects), so a site
package can add its own checks and a duplicate name is an error rather than a
silent replacement.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from gpumon.check import Check
from gpumon.errors import GpumonError

GROUP = "gpumon.checks"


class RegistryError(GpumonError):
    pass


def load_checks() -> dict[str, type[Check]]:
    found: dict[str, type[Check]] = {}
    origins: dict[str, str] = {}
    for ep in entry_points(group=GROUP):
        try:
            cls = ep.load()
        except Exception as exc:
            raise RegistryError(f"check entry point {ep.name} ({ep.value}) failed to load: "
                                f"{type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Check)):
            raise RegistryError(f"entry point {ep.name} ({ep.value}) is not a gpumon Check class")
        if cls.name != ep.name:
            raise RegistryError(f"entry point {ep.name} points to check named {cls.name!r}; "
                                "they must be the same string")
        if ep.name in found and origins[ep.name] != ep.value:
            raise RegistryError(f"two checks named {ep.name}: {origins[ep.name]} and {ep.value}")
        found[ep.name] = cls
        origins[ep.name] = ep.value
    return dict(sorted(found.items()))
