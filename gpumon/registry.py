"""Checks are found through the ``gpumon.checks`` entry-point group.

Built at startup, never at import time (no import side effects), so a site
package can add its own checks. A check that cannot be loaded (its import
raises, its object is no Check class, its name is not the entry point's, two
packages claim the name) is left out, logged, and reported like a check that
could not say: an ``unknown`` finding on the node with outcome ``not-loaded``
(:meth:`NotLoaded.run`), never a command that stops (node-problem-detector
skips a monitor that fails to load and runs the others). It is ``unknown``, not
``fail``: a broken plugin rolled out to a fleet must not cordon the fleet, yet
the node is not watched for what that check looks for, which the finding says.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from gpumon.check import Check
from gpumon.errors import GpumonError
from gpumon.model import NODE, Action, CheckRun, Finding, Severity

GROUP = "gpumon.checks"
# CheckRun.outcome of a check that was not loaded (gpumon_check_outcome{outcome="not-loaded"})
NOT_LOADED = "not-loaded"

log = logging.getLogger("gpumon.registry")


class RegistryError(GpumonError):
    pass


@dataclass(frozen=True)
class NotLoaded:
    """An entry point of the group that gave no check, and why."""

    name: str
    target: str  # the entry point's value, module:attribute
    distribution: str  # the installed distribution that declares it ("" when not known)
    error: str
    traceback: str = ""

    @property
    def message(self) -> str:
        where = f" (from {self.distribution})" if self.distribution else ""
        return (f"check {self.name} did not load: entry point {self.target}{where}: {self.error}; "
                f"this node is NOT watched for what {self.name} detects until the plugin is fixed")

    def run(self, now: float | None = None) -> CheckRun:
        evidence = {"entry_point": self.target, "distribution": self.distribution, "error": self.error}
        if self.traceback:
            evidence["traceback"] = self.traceback[-2000:]
        f = Finding(self.name, NODE, Severity.UNKNOWN, self.message, Action.NONE, evidence)
        return CheckRun(self.name, [f], time.time() if now is None else now, 0.0, NOT_LOADED)


@dataclass
class Registry:
    checks: dict[str, type[Check]]
    not_loaded: dict[str, NotLoaded] = field(default_factory=dict)


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else ""


def load_registry() -> Registry:
    """Every check of the group that loads; the others in ``not_loaded``, each logged once."""
    found: dict[str, type[Check]] = {}
    origins: dict[str, str] = {}
    failed: dict[str, NotLoaded] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in failed:
            continue
        if ep.name in origins:
            if origins[ep.name] != ep.value:
                # neither: which one runs would depend on the order of sys.path
                failed[ep.name] = NotLoaded(ep.name, ep.value, _distribution(ep),
                                            f"two checks named {ep.name}: {origins[ep.name]} and {ep.value}")
                del found[ep.name]
            continue
        error, tb = "", ""
        try:
            cls = ep.load()
        # SystemExit too: a plugin that calls sys.exit() while imported must not end gpumon
        except (Exception, SystemExit) as exc:
            # the innermost frames: where in the plugin it raised
            error, tb = f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=-6)
        else:
            if not (isinstance(cls, type) and issubclass(cls, Check)):
                error = f"{ep.value} is {type(cls).__name__} {cls!r:.60}, not a gpumon Check class"
            elif cls.name != ep.name:
                error = (f"it names its check {cls.name!r}: the entry point and the check must be "
                         "the same string")
        if error:
            failed[ep.name] = NotLoaded(ep.name, ep.value, _distribution(ep), error, tb)
            continue
        found[ep.name] = cls
        origins[ep.name] = ep.value
    for bad in failed.values():
        log.error("%s", bad.message)
    return Registry(dict(sorted(found.items())), dict(sorted(failed.items())))


def load_checks() -> dict[str, type[Check]]:
    """The checks that loaded (the others are logged; :func:`load_registry` has them)."""
    return load_registry().checks

