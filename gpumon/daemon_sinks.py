"""Where the daemon's check runs go: a list of sinks, each owning one concern.

The daemon's middle only hands each run to :class:`Sinks` (node-problem-detector's shape: the
problem daemon passes statuses to its exporters); what a run means to the health state, to the
remediation loop, to the log, to ``/metrics`` and to ``report.json`` is decided in the sink that
owns it. The daemon's order, where it matters:

    health -> remediation -> log -> (a site's own sinks) -> exporter -> report

- the health state has the run before remediation reads the node's state from it, and before the
  exporter publishes a snapshot with that state (``after = ("health",)``);
- the report follows the exporter: report.json is what ``/metrics`` exports, due when the
  exporter's content changed (``after = ("exporter",)``);
- the exporter comes last but one, so that its snapshot counts a failure of every sink before it
  in the same run.

A sink declares the sinks it must follow in ``after``; :class:`Sinks` refuses an order that breaks
a declaration (a sink not in the list is no constraint). A sink that raises is logged and counted
(``gpumon_sink_errors_total{sink}``), and every other sink, and the daemon, go on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from gpumon import __version__
from gpumon.check import GPU_LOST
from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder
from gpumon.health import Health, HealthView
from gpumon.model import CheckRun, Finding, Severity
from gpumon.remediate.runner import RemediationLoop

log = logging.getLogger("gpumon.daemon")
# /metrics: the content part is re-rendered off the scrape path at once (after a second) when the
# health state or a finding's severity changed, and at most every PRERENDER_COUNTS_S when only
# counts and readings did (a storm changes an Xid count at every run). A scrape of content that
# changed since the last render renders it itself: it never sees stale figures.
PRERENDER_COUNTS_S = 10.0
# A check that says the same every run (ib, every second) is folded into the health state again
# at least this often, so that the store's last_seen stays fresh.
FOLD_REFRESH_S = 60.0
# A sink that keeps failing is logged (with its traceback) at its first failure, then at most
# this often: a 1 s check would otherwise log a traceback a second.
SINK_LOG_S = 60.0

Said = tuple[tuple[str, Severity, Any, str], ...]


def said_of(run: CheckRun) -> Said:
    """What a run says, finding by finding (no readings): the health state's and the report's
    test of "the check said something new"."""
    return tuple((f.component, f.severity, f.action, f.message) for f in run.findings)


class Sink(ABC):
    """One consumer of the daemon's check runs. ``record`` gets every run (under the daemon's
    lock: one at a time, in the order the runs ended); ``health_changed`` is called when another
    process changed the health state (``gpumon set-healthy``)."""

    name: ClassVar[str] = "sink"
    # the sinks that must have had each run before this one (see Sinks)
    after: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def record(self, run: CheckRun) -> None:
        raise NotImplementedError

    def health_changed(self) -> None:
        """Nothing, unless the sink shows the health state."""
        return None  # a default, not an abstract step: most sinks do not show it


class Sinks:
    """The fan-out: each run to each sink, in order; a sink that raises is logged and counted in
    ``errors`` and the next sink still gets the run."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        where: dict[str, int] = {}
        for i, sink in enumerate(sinks):
            if sink.name in where:
                raise ValueError(f"two sinks named {sink.name!r}")
            where[sink.name] = i
        for i, sink in enumerate(sinks):
            late = [name for name in sink.after if where.get(name, -1) > i]
            if late:
                raise ValueError(f"sink {sink.name!r} must come after {', '.join(late)}")
        self.sinks = tuple(sinks)
        # failures per sink since the daemon started (every sink listed, 0 until it fails)
        self.errors: dict[str, int] = {s.name: 0 for s in sinks}
        self._logged: dict[str, float] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sinks]

    def record(self, run: CheckRun) -> None:
        for sink in self.sinks:
            try:
                sink.record(run)
            except Exception as exc:  # one sink's bug must not cost the others the run
                self._failed(sink, f"the run of {run.check}", exc)

    def health_changed(self) -> None:
        for sink in self.sinks:
            try:
                sink.health_changed()
            except Exception as exc:
                self._failed(sink, "a change of the health state", exc)

    def _failed(self, sink: Sink, what: str, exc: Exception) -> None:
        self.errors[sink.name] += 1
        now = time.monotonic()
        if now - self._logged.get(sink.name, -math.inf) < SINK_LOG_S:
            return
        self._logged[sink.name] = now
        log.error("sink %s failed on %s (%d failures since the daemon started; logged at most every "
                  "%.0f s): %s: %s; the other sinks still got it", sink.name, what, self.errors[sink.name],
                  SINK_LOG_S, type(exc).__name__, exc, exc_info=exc)


class HealthSink(Sink):
    """Folds each run into the health state, once per change of what the check says (and at
    least every FOLD_REFRESH_S, and every run that did not complete)."""

    name = "health"

    def __init__(self, health: Health) -> None:
        self.health = health
        self._folded: dict[str, tuple[Said, float]] = {}

    def record(self, run: CheckRun) -> None:
        # A 1 s check (ib) repeats itself every second: fold it only when what it says
        # changed, or once a minute so the store's last_seen stays fresh.
        said = said_of(run)
        now = time.monotonic()
        last_said, last_at = self._folded.get(run.check, ((), 0.0))
        if said != last_said or run.outcome != "completed" or now - last_at >= FOLD_REFRESH_S:
            self.health.record_run(run)
            self._folded[run.check] = (said, now)


class RemediationSink(Sink):
    """Tells the remediation loop it may decide (once every continuous check has reported) and
    wakes it when the node's state or action changed: the loop itself acts on its own thread."""

    name = "remediation"
    after = ("health",)  # reads the node's state the health sink just folded

    def __init__(self, loop: RemediationLoop, health: Health, checks: Collection[str]) -> None:
        self.loop = loop
        self.health = health
        self._checks = frozenset(checks)
        self._seen: set[str] = set()
        self._node_said: tuple[str, str] | None = None

    def record(self, run: CheckRun) -> None:
        self._seen.add(run.check)
        if not self.loop.ready.is_set() and self._checks <= self._seen:
            self.loop.ready.set()
            # a change that came before this (a fatal Xid read at start-up) woke a loop that was
            # not ready yet: it would otherwise wait a whole interval to act on it
            self.loop.wake.set()
        self._wake_on_change()

    def health_changed(self) -> None:
        self._wake_on_change()

    def _wake_on_change(self) -> None:
        node = self.health.view().node
        said = (node.level.value, node.action.value)
        if said != self._node_said:
            self._node_said = said
            self.loop.wake.set()


class ChangeLog(Sink):
    """Logs each change of a finding's severity, a GPU's loss once (see :meth:`_say`)."""

    name = "log"

    def __init__(self) -> None:
        self._last_severity: dict[tuple[str, str], Severity] = {}
        # component -> the checks whose latest finding says the GPU is lost, first first
        self._lost: dict[str, dict[str, None]] = {}

    def record(self, run: CheckRun) -> None:
        for f in run.findings:
            key = (f.check, f.component)
            before = self._last_severity.get(key)
            if before != f.severity:
                self._last_severity[key] = f.severity
                if before is not None or f.severity is not Severity.OK:
                    self._say(f, before)
            self._lost_by(f)

    def _say(self, f: Finding, before: Severity | None) -> None:
        """Log a change of a finding's severity: at WARNING, but a GPU's loss once (its first
        finding that says the GPU is lost, gpumon.check.GPU_LOST); the other checks' findings of
        the same loss at INFO, naming the check that reported it."""
        level, note = logging.WARNING, ""
        if f.severity is Severity.SKIPPED and before in (None, Severity.OK):
            # a check that does not apply here (no fabric probe yet, no IB) is no problem: said
            # once at INFO, its reason stays in the finding
            level = logging.INFO
        elif f.severity is Severity.FAIL and f.evidence.get(GPU_LOST) is True:
            others = [c for c in self._lost.get(f.component, {}) if c != f.check]
            if others:
                level, note = logging.INFO, f"; the loss of {f.component} was reported by {others[0]}"
        log.log(level, "%s %s: %s -> %s: %s (action %s%s)", f.check, f.component,
                before.value if before else "new", f.severity.value, f.message, f.action.value, note)

    def _lost_by(self, f: Finding) -> None:
        """Keep, per component, the checks whose latest finding says the GPU is lost, in the order
        they first said it."""
        if f.severity is Severity.FAIL and f.evidence.get(GPU_LOST) is True:
            self._lost.setdefault(f.component, {}).setdefault(f.check, None)
        elif f.component in self._lost:
            self._lost[f.component].pop(f.check, None)


def _health_map(view: HealthView) -> dict[str, tuple[str, str]]:
    """component -> (state, recommended action), for the exporter's snapshot."""
    health = {name: (comp.level.value, comp.action.value) for name, comp in view.components.items()}
    # last: the components map has a "node" entry for findings filed on the node
    # itself, which is not the node's overall state
    health["node"] = (view.node.level.value, view.node.action.value)
    return health


def _accepted(view: HealthView) -> frozenset[tuple[str, str]]:
    """(check, component) of the findings the health state accepted that checks still repeat."""
    return frozenset((a.check, a.component) for comp in view.components.values() for a in comp.accepted)


class ExporterSink(Sink):
    """Publishes a new :class:`Snapshot` for ``/metrics`` (and the query API) after each run, and
    says when its content must be re-rendered off the scrape path (:meth:`prerender`).

    ``node``/``profile`` name the node; ``latest`` is the daemon's newest run per check (read
    under the daemon's lock, as ``record`` is called); ``kernel_log`` the pump's counters. The
    health state, the remediation loop and the sinks' failure counts are set when the daemon has
    them (``health``, ``remediation``, ``sink_errors``)."""

    name = "exporter"
    after = ("health",)  # a snapshot shows the health state with this run in it

    def __init__(self, node: Callable[[], tuple[str, str]], latest: Mapping[str, CheckRun],
                 kernel_log: Callable[[], Mapping[str, Any] | None]) -> None:
        self.node = node
        self.latest = latest
        self.kernel_log = kernel_log
        self.health: Health | None = None
        self.remediation: RemediationLoop | None = None
        self.sink_errors: Mapping[str, int] | None = None
        self.holder: SnapshotHolder | None = None
        self.exposition: CachedExposition | None = None
        self.render_now = threading.Event()
        self.content_changed = threading.Event()
        # per check, the severities of its findings (what makes /metrics re-render at once)
        self._severities: dict[str, tuple[tuple[str, Severity], ...]] = {}
        self._health_of: tuple[HealthView, Mapping[str, tuple[str, str]],
                               frozenset[tuple[str, str]]] | None = None

    def snapshot(self) -> Snapshot:
        health: Mapping[str, tuple[str, str]] = {}
        accepted: frozenset[tuple[str, str]] = frozenset()
        if self.health is not None:
            view = self.health.view()
            # the view is a new object only when the health state changed (most runs leave
            # it as it was): the same view, the same map, which the snapshot holder then
            # need not compare item by item
            if self._health_of is None or self._health_of[0] is not view:
                self._health_of = (view, _health_map(view), _accepted(view))
            health, accepted = self._health_of[1], self._health_of[2]
        runs = dict(self.latest)
        if self.health is not None:
            # a store that cannot write is a finding like any other (read-only or full state dir)
            store = self.health.store_finding()
            runs[store.check] = CheckRun(store.check, [store], time.time(), 0.0, "completed")
        node, profile = self.node()
        return Snapshot(node=node, profile=profile, version=__version__,
                        runs=runs, health=health, accepted=accepted,
                        remediation=self.remediation.snapshot() if self.remediation else None,
                        kernel_log=self.kernel_log(),
                        sinks=dict(self.sink_errors) if self.sink_errors is not None else None)

    def record(self, run: CheckRun) -> None:
        if self.holder is None:
            return
        version = self.holder.version
        health = self._health_of[1] if self._health_of is not None else None
        self.holder.set(self.snapshot())
        if self.holder.version != version:
            severities = tuple((f.component, f.severity) for f in run.findings)
            # (a new health view need not be a new health state: a standing fault's
            # newest words are refreshed in place, a new view each time)
            if (severities != self._severities.get(run.check)
                    or (self._health_of[1] if self._health_of is not None else None) != health):
                self.render_now.set()  # not only counts: render at once
            self._severities[run.check] = severities
            self.content_changed.set()

    def health_changed(self) -> None:
        if self.holder is not None:
            self.holder.set(self.snapshot())
            self.render_now.set()
            self.content_changed.set()

    def prerender(self, stop: threading.Event) -> None:
        """The render thread, until ``stop``."""
        # Scrapes must stay fast even right after the node's state changed: render the new
        # content here instead of in the scrape that first sees it: at most once a second, and
        # at most every PRERENDER_COUNTS_S while only counts change (an Xid storm changes a count
        # at every run of xid; rendering each was a fifth of the daemon's CPU in bench/storm.py).
        # A scrape in between renders what changed itself (CachedExposition renders on a new
        # snapshot version).
        rendered, at = -1, -math.inf
        while not stop.is_set():
            self.content_changed.wait(5.0)
            if stop.wait(1.0) or self.exposition is None or self.holder is None:
                continue
            self.content_changed.clear()
            if self.holder.version == rendered:
                continue
            wait = at + PRERENDER_COUNTS_S - time.monotonic()
            if wait > 0 and not self.render_now.wait(wait) and stop.is_set():
                return
            self.render_now.clear()
            rendered, at = self.holder.version, time.monotonic()
            self.exposition.prerender()
