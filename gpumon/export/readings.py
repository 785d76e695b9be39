"""What each reading on ``/metrics`` means: the HELP text and metric type the loaded checks declare.

A check publishes readings as ``gpumon.model.reading(name, value, **labels)`` in a finding's
``evidence["readings"]``; the exporter turns each name into the family ``gpumon_<name>`` with the
labels ``check``, ``component`` and the reading's own. The check declares, next to its code, what each
of them counts or measures, in which unit, and where gpumon got it (``Check.readings``, a tuple of
``gpumon.model.ReadingSpec``); a :class:`ReadingCatalog` gathers the declarations of the loaded
checks for the exporter. tests/export/test_readings.py checks that every ``reading("...")`` in
checks/ and gpumon/ is declared by a built-in check.

A name that no loaded check declares (a site's check that declares nothing) is still exported, with
:func:`generic_help`, which names the check(s) that published it; its type follows the name (a name
ending in ``_total`` is a counter, every other name a gauge: ``gpumon.model.reading``'s rule).

Two checks may declare the same reading (a check that extends another, as the bootstrap's
``memory_headroom`` extends ``memory``); two that declare it differently are a mistake of one of
them: the catalog keeps the declaration of the check that comes first by name and logs a warning
that names both: a check never changes another's HELP silently, and which one wins does not depend
on the order the checks were installed or found in.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import TYPE_CHECKING

from gpumon.model import ReadingKind, ReadingSpec

if TYPE_CHECKING:
    from gpumon.check import Check

log = logging.getLogger("gpumon.export.readings")


class ReadingCatalog(Mapping[str, ReadingSpec]):
    """Reading name -> its declaration, from the checks handed in (:meth:`of`)."""

    def __init__(self, specs: Mapping[str, ReadingSpec] | None = None,
                 declared_by: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self._specs: Mapping[str, ReadingSpec] = MappingProxyType(dict(specs or {}))
        self._by: Mapping[str, tuple[str, ...]] = MappingProxyType(dict(declared_by or {}))

    @classmethod
    def of(cls, checks: Iterable[type[Check]]) -> ReadingCatalog:
        """The declarations of ``checks``, taken in order of check name; a reading declared again
        differently is logged (WARNING) and the first check's declaration kept."""
        specs: dict[str, ReadingSpec] = {}
        by: dict[str, list[str]] = {}
        for check in sorted(checks, key=lambda c: c.name):
            for spec in check.readings:
                first = specs.get(spec.name)
                if first is None:
                    specs[spec.name] = spec
                elif first != spec:
                    differ = [f.name for f in fields(ReadingSpec)
                              if getattr(first, f.name) != getattr(spec, f.name)]
                    log.warning("reading %s: check %s declares it differently (%s) from check %s; "
                                "/metrics uses %s's declaration", spec.name, check.name, ", ".join(differ),
                                by[spec.name][0], by[spec.name][0])
                    continue
                if check.name not in by.setdefault(spec.name, []):
                    by[spec.name].append(check.name)
        return cls(specs, {name: tuple(names) for name, names in by.items()})

    def __getitem__(self, name: str) -> ReadingSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def declared_by(self, name: str) -> tuple[str, ...]:
        """The checks whose declaration of ``name`` the catalog holds (the same declaration)."""
        return self._by.get(name, ())

    def help_for(self, name: str, checks: Iterable[str]) -> str:
        """The HELP of ``name``, published by ``checks``."""
        spec = self._specs.get(name)
        return spec.help if spec is not None else generic_help(name, checks)

    def kind_of(self, name: str) -> ReadingKind:
        spec = self._specs.get(name)
        if spec is not None:
            return spec.kind
        return "counter" if name.endswith("_total") else "gauge"


@functools.cache
def installed() -> ReadingCatalog:
    """The declarations of the checks of the ``gpumon.checks`` entry points that load: what the
    exporter renders when it is not handed the catalog of the checks its caller loaded."""
    from gpumon.registry import load_checks

    return ReadingCatalog.of(load_checks().values())


def generic_help(name: str, checks: Iterable[str]) -> str:
    """HELP for a reading no loaded check declares: say who published it."""
    who = ", ".join(sorted(set(checks))) or "an unknown check"
    return (f"Reading {name} published by check {who}: not a built-in gpumon reading, see that check's "
            "documentation for its meaning and unit")


def is_generic(help_text: str) -> bool:
    return "not a built-in gpumon reading" in help_text
