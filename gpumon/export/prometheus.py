"""Prometheus exposition of gpumon's cached state.

A scrape never touches hardware (dcgm-exporter scrapes took >10 s): the
collector turns the daemon's latest snapshot into metric families, fresh on
every scrape, from its own registry (no global REGISTRY, no import side
effects).

Metrics (all prefixed ``gpumon_``; :data:`FAMILIES` holds the HELP text of each, which says
what it means, its unit and where the number comes from):

- ``build_info{version,profile,node}`` 1
- ``check_last_run_timestamp_seconds{check}``, ``check_duration_seconds{check}``
- ``check_outcome{check,outcome}`` 1 for the last outcome, 0 for the others
- ``finding_severity{check,component}``: 0 ok, 1 skipped, 2 unknown, 3 warn, 4 fail
- ``health_state{component,state}``: 1 for the current state (healthy, degraded,
  unhealthy, quarantined); ``component="node"`` is the node, which also gets a 0 for
  every other state (a component's other states are not sent: they would be most of
  the exposition)
- ``recommended_action{component,action}``: likewise for the recommended action
- ``finding_accepted{check,component}`` 1 while the check repeats a finding that an operator's
  ``gpumon set-healthy`` (or a passing retest) accepted: ``finding_severity`` still says what
  the check found, the health series leave it out (as ``gpumon status`` does)
- ``remediation_*`` when remediation is configured
- ``sink_errors_total{sink}`` in the daemon: failures of each of its sinks (gpumon.daemon_sinks)
- readings that checks publish in a finding's ``evidence["readings"]`` as
  ``[name, value, {labels}]``: ``gpumon_<name>{check,component,labels...}``, with the HELP
  text and type that the loaded checks declare (``Check.readings``, gathered in a
  ``gpumon.export.readings.ReadingCatalog``; a name no check declares gets a HELP that
  names the check); a name ending in ``_total`` is a counter (the check keeps it monotonic
  in its persisted state, so it neither resets on scrape nor on restart).

A fault's series returns to healthy/ok when the state does: every family is
rebuilt from the current snapshot, nothing is latched in the exporter.
"""

from __future__ import annotations

import gzip
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from gpumon.export.readings import ReadingCatalog, installed
from gpumon.model import Action, CheckRun, Severity

OUTCOMES = ("completed", "skipped", "error", "hung", "still-hung", "not-loaded")
HEALTH_STATES = ("healthy", "degraded", "unhealthy", "quarantined")
SEVERITY_VALUE = {Severity.OK: 0, Severity.SKIPPED: 1, Severity.UNKNOWN: 2, Severity.WARN: 3,
                  Severity.FAIL: 4}
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

_STATES = ", ".join(HEALTH_STATES)
_ACTIONS = ", ".join(a.value for a in Action)
# HELP of every family that is not a reading (readings: Check.readings): meaning, unit, source.
FAMILIES: Mapping[str, str] = {
    "gpumon_build_info":
        "Always 1: the gpumon build serving these metrics (label version), the SKU profile its checks "
        "judge against (label profile: chosen from the GPUs' NVML name, or the configured one) and the "
        "node name it reports (label node: node_name, default the host name). Source: gpumon.",
    "gpumon_check_last_run_timestamp_seconds":
        "When each check's last run finished (label check). Unit: Unix time in seconds. Source: "
        "gpumon's check runner; a value that stops advancing means the check no longer runs.",
    "gpumon_check_duration_seconds":
        "Wall-clock duration of each check's last run (label check). Unit: seconds. Source: "
        "gpumon's check runner (0 for a run that was not started: skipped, still-hung).",
    "gpumon_check_outcome":
        "Outcome of each check's last run: 1 for the outcome it had, 0 for the others (label outcome: "
        "completed; skipped = not applicable on this node; error = the check raised; hung = past its "
        "deadline; still-hung = its previous run has not returned, so it was not started; not-loaded = "
        "its plugin failed to load, so the node is not watched for what it detects). Source: "
        "gpumon's check runner.",
    "gpumon_finding_severity":
        "Worst severity of a check's findings on a component at the check's last run (labels check, "
        "component: node, gpu/<i>, nvlink/<gpu>/<link>, ib/<dev>/<port>, pci/<bdf>, ...): 0 ok, "
        "1 skipped, 2 unknown, 3 warn, 4 fail (an enumeration, no unit). Source: gpumon's judgement "
        "of the check's readings; the reasons are in gpumon status.",
    "gpumon_health_state":
        f"Health state of each component: 1 for its current state (label state: {_STATES}); only "
        "component=\"node\", the node's roll-up, also gets 0 for the others, so a state that ends "
        "goes stale. Source: gpumon's health store (health.db), which folds every check's findings "
        "over time: a fault that needs a GPU reset or a reboot clears only after it and a passing "
        "retest.",
    "gpumon_recommended_action":
        f"What should be done about each component: 1 for the current action (label action: "
        f"{_ACTIONS}; the worst open fault's wins); only component=\"node\" also gets 0 for the "
        "others. Source: gpumon's health store, from the checks' findings and NVIDIA's Xid catalog.",
    "gpumon_finding_accepted":
        "1 while a check repeats, word for word, a finding on a component that an operator's gpumon "
        "set-healthy (or a passing retest) accepted (labels check, component): gpumon_finding_severity "
        "still says what the check found, and gpumon_health_state leaves it out, as gpumon status "
        "does (listed there as accepted). The fault is raised again, and this series goes, as soon "
        "as the check says anything else about it. Source: gpumon's health store.",
    "gpumon_remediation_info":
        "Always 1: the remediation backend (label backend: kubernetes, slurm) and mode (label mode: "
        "observe = only report, enforce = act) of the daemon's remediation loop. Source: gpumon "
        "configuration (remediation.*).",
    "gpumon_remediation_breaker_open":
        "1 while the remediation circuit breaker stops gpumon from taking this node out (too large "
        "a share of the fleet is already out), else 0. Source: gpumon's remediation loop, from the "
        "scheduler's view of the fleet.",
    "gpumon_remediation_decision":
        "The remediation loop's last decision, 1 (label decision: wait, none, take_out, keep_out, "
        "blocked, bring_back, left_alone); in observe mode what it would have done. Source: "
        "gpumon's remediation loop.",
    "gpumon_remediation_error":
        "1 when the remediation loop's last step failed (scheduler backend or health store; the "
        "next step retries), else 0. Source: gpumon's remediation loop.",
    "gpumon_kernel_log_lines_read":
        "Kernel-log records the daemon's kernel-log reader has read since it started (resets when it "
        "restarts). Unit: records. Source: <host-root>/dev/kmsg (or kmsg_path), gpumon.kernel_pump.",
    "gpumon_kernel_log_lines_dropped":
        "Kernel-log lines a check reads that never reached it, since the daemon started (labels "
        "check; reason: queue_full = pushed out of the check's bounded queue before its next run, "
        "so its counts are short by this many; ring_overrun = overwritten in the kernel's ring "
        "buffer before gpumon read them, what they said is lost). Lines no check reads are not "
        "kept and not counted here. Unit: lines. Source: gpumon.kernel_pump. Anything above 0 "
        "means a verdict may have been made on part of the log.",
    "gpumon_kernel_log_lines_merged":
        "Kernel-log lines counted on an earlier identical line instead of being handed to the "
        "check one by one, since the daemon started (label check): the same Xid line logged again "
        "within a second is one event with a repeat count; none is lost. Unit: lines. Source: "
        "gpumon.kernel_pump.",
    "gpumon_remediation_errors":
        "Remediation steps that failed since the daemon started (resets when it restarts). Unit: "
        "steps. Source: gpumon's remediation loop.",
    "gpumon_sink_errors":
        "Times one of the daemon's consumers of check runs raised since the daemon started (resets "
        "when it restarts; label sink: health = folding runs into the health state, remediation = "
        "waking the remediation loop, log = logging severity changes, exporter = this exposition's "
        "snapshot, report = report.json, any other = a site's own sink). The other sinks still got "
        "the run, and the daemon goes on; the error and its traceback are in the daemon's log. Unit: "
        "failures. Source: gpumon daemon (gpumon.daemon_sinks). Anything above 0 is a bug to report.",
}


@dataclass(frozen=True)
class Snapshot:
    node: str
    profile: str
    version: str
    runs: Mapping[str, CheckRun] = field(default_factory=dict)
    # component -> (state, recommended action); "node" for the node itself
    health: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # gpumon.remediate.runner.RemediationLoop.snapshot(), when remediation is configured
    remediation: Mapping[str, Any] | None = None
    # (check, component) of each finding the health state accepted (set-healthy, a passing
    # retest) that the check still repeats
    accepted: frozenset[tuple[str, str]] = frozenset()
    # gpumon.kernel_pump.KernelLogPump.stats(), in the daemon
    kernel_log: Mapping[str, Any] | None = None
    # failures per sink of the daemon (gpumon.daemon_sinks.Sinks.errors), in the daemon
    sinks: Mapping[str, int] | None = None


class GpumonCollector(Collector):
    """``part``: "all"; "content" (what changes only when a finding, reading or state does) or
    "fast" (per-run timestamps and durations, which change on every run of a 1 s check).
    ``readings``: the declarations of the checks that were loaded (None: those of the installed
    checks, :func:`gpumon.export.readings.installed`)."""

    def __init__(self, snapshot: Callable[[], Snapshot], part: str = "all",
                 readings: ReadingCatalog | None = None) -> None:
        self._snapshot = snapshot
        self._part = part
        self._catalog = readings
        self.skipped_readings = 0

    def describe(self) -> Iterable[Metric]:
        # Fixed families only: readings depend on the checks installed, so they
        # are not described (client_python then does not call collect() at
        # registration: cloudwatch_exporter PR #259).
        return [
            GaugeMetricFamily("gpumon_build_info", FAMILIES["gpumon_build_info"],
                              labels=["version", "profile", "node"]),
        ]

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        fast, content = self._part in ("all", "fast"), self._part in ("all", "content")
        if content:
            info = GaugeMetricFamily("gpumon_build_info", FAMILIES["gpumon_build_info"],
                                     labels=["version", "profile", "node"])
            info.add_metric([snap.version, snap.profile, snap.node], 1)
            yield info
        last = _gauge("gpumon_check_last_run_timestamp_seconds", ["check"])
        duration = _gauge("gpumon_check_duration_seconds", ["check"])
        outcome = _gauge("gpumon_check_outcome", ["check", "outcome"])
        severity = _gauge("gpumon_finding_severity", ["check", "component"])
        readings: dict[str, list[tuple[list[str], dict[str, str], float]]] = {}
        for name in sorted(snap.runs):
            run = snap.runs[name]
            last.add_metric([name], run.started + run.seconds)
            duration.add_metric([name], run.seconds)
            for o in OUTCOMES:
                outcome.add_metric([name, o], 1.0 if run.outcome == o else 0.0)
            worst: dict[str, Severity] = {}
            for f in run.findings:
                worst[f.component] = max(worst.get(f.component, Severity.OK), f.severity)
                self._readings(f.check, f.component, f.evidence.get("readings"), readings)
            for comp in sorted(worst):
                severity.add_metric([name, comp], SEVERITY_VALUE[worst[comp]])
        accepted = _gauge("gpumon_finding_accepted", ["check", "component"])
        for check, comp in sorted(snap.accepted):
            accepted.add_metric([check, comp], 1.0)
        if fast:
            yield from (last, duration, outcome)
            yield from self._remediation(snap)
            yield from self._kernel_log(snap)
            yield from self._sinks(snap)
        if content:
            yield severity
            if snap.accepted:  # none on most nodes: no family at all
                yield accepted
            yield from self._health(snap)
            yield from self._reading_families(readings)

    def _readings(self, check: str, component: str, items: Any,
                  out: dict[str, list[tuple[list[str], dict[str, str], float]]]) -> None:
        if not isinstance(items, list):
            return
        for item in items:
            try:
                name, value, labels = item
                if not _NAME.match(name) or not isinstance(labels, dict):
                    raise ValueError(name)
                value = float(value)
            except (TypeError, ValueError):
                self.skipped_readings += 1
                continue
            out.setdefault(name, []).append(([check, component], dict(labels), value))

    def _reading_families(self, readings: Mapping[str, list[tuple[list[str], dict[str, str], float]]]
                          ) -> Iterable[Metric]:
        if not readings:
            return
        if self._catalog is None:
            self._catalog = installed()
        catalog = self._catalog
        for name in sorted(readings):
            samples = readings[name]
            extra = sorted({k for _, labels, _ in samples for k in labels})
            label_names = ["check", "component", *extra]
            text = catalog.help_for(name, (base[0] for base, _, _ in samples))
            family: GaugeMetricFamily | CounterMetricFamily
            if catalog.kind_of(name) == "counter":
                family = CounterMetricFamily(f"gpumon_{name.removesuffix('_total')}", text,
                                             labels=label_names)
            else:
                family = GaugeMetricFamily(f"gpumon_{name}", text, labels=label_names)
            seen: set[tuple[str, ...]] = set()
            for base, labels, value in samples:
                key = (*base, *(labels.get(k, "") for k in extra))
                if key in seen:
                    continue  # two findings with the same series: keep the first
                seen.add(key)
                family.add_metric(list(key), value)
            yield family

    def _remediation(self, snap: Snapshot) -> Iterable[Metric]:
        r = snap.remediation
        if r is None:
            return
        info = _gauge("gpumon_remediation_info", ["backend", "mode"])
        info.add_metric([str(r.get("backend")), str(r.get("mode"))], 1)
        yield info
        yield GaugeMetricFamily("gpumon_remediation_breaker_open",
                                FAMILIES["gpumon_remediation_breaker_open"],
                                value=1.0 if r.get("breaker_open") else 0.0)
        decision = _gauge("gpumon_remediation_decision", ["decision"])
        if r.get("decision"):
            decision.add_metric([str(r["decision"])], 1)
        yield decision
        yield GaugeMetricFamily("gpumon_remediation_error", FAMILIES["gpumon_remediation_error"],
                                value=1.0 if r.get("error") else 0.0)
        yield CounterMetricFamily("gpumon_remediation_errors", FAMILIES["gpumon_remediation_errors"],
                                  value=float(r.get("errors_total") or 0))

    def _kernel_log(self, snap: Snapshot) -> Iterable[Metric]:
        k = snap.kernel_log
        if k is None:
            return
        yield CounterMetricFamily("gpumon_kernel_log_lines_read", FAMILIES["gpumon_kernel_log_lines_read"],
                                  value=float(k.get("read") or 0))
        dropped = CounterMetricFamily("gpumon_kernel_log_lines_dropped",
                                      FAMILIES["gpumon_kernel_log_lines_dropped"], labels=["check", "reason"])
        for (check, reason), n in sorted((k.get("dropped") or {}).items()):
            dropped.add_metric([check, reason], float(n))
        yield dropped
        merged = CounterMetricFamily("gpumon_kernel_log_lines_merged",
                                     FAMILIES["gpumon_kernel_log_lines_merged"], labels=["check"])
        for check, n in sorted((k.get("merged") or {}).items()):
            merged.add_metric([check], float(n))
        yield merged

    def _sinks(self, snap: Snapshot) -> Iterable[Metric]:
        if snap.sinks is None:
            return
        errors = CounterMetricFamily("gpumon_sink_errors", FAMILIES["gpumon_sink_errors"], labels=["sink"])
        for sink, n in sorted(snap.sinks.items()):
            errors.add_metric([sink], float(n))
        yield errors

    def _health(self, snap: Snapshot) -> Iterable[Metric]:
        state = _gauge("gpumon_health_state", ["component", "state"])
        action = _gauge("gpumon_recommended_action", ["component", "action"])
        for comp in sorted(snap.health):
            current, act = snap.health[comp]
            if comp == "node":
                # the node gets every state, 0 or 1, so a graph of it never has gaps
                for s in HEALTH_STATES:
                    state.add_metric([comp, s], 1.0 if s == current else 0.0)
                for a in Action:
                    action.add_metric([comp, a.value], 1.0 if a.value == act else 0.0)
            else:
                # ~70 components x 10 enum values of zeros were 60 % of an 8-GPU node's
                # exposition; only the current value is sent (alerts match == 1), and a
                # state that ends disappears from the scrape, which Prometheus marks stale
                state.add_metric([comp, current], 1.0)
                action.add_metric([comp, act], 1.0)
        yield state
        yield action


def _gauge(name: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, FAMILIES[name], labels=labels)


def _run_signature(run: CheckRun) -> tuple[Any, ...]:
    """What the "content" part of the exposition takes from one check's run (not its times)."""
    items = []
    for f in run.findings:
        readings = f.evidence.get("readings")
        flat: tuple[Any, ...] = ()
        if isinstance(readings, list):
            flat = tuple((r[0], r[1], tuple(sorted(r[2].items()))) if isinstance(r, list) and len(r) == 3
                         and isinstance(r[2], dict) else repr(r) for r in readings)
        items.append((f.component, f.severity.value, flat))
    return tuple(items)


# For each part of the signature, the object it was computed from and the part: the run of
# each check (key: its name) and the health map (key: None).
_Parts = dict[str | None, tuple[object, tuple[Any, ...]]]


def _signature(snap: Snapshot, known: _Parts | None = None) -> tuple[tuple[Any, ...], _Parts]:
    """What the "content" part of the exposition depends on (not run times), and its parts.
    A part computed from the same object as in ``known`` is kept: the daemon makes a new
    CheckRun per run (and a new health map per change of the health state) and never changes
    one it has handed over, so only what is new since the last snapshot is hashed. Hashing
    all ~100 findings after every run of the 1 s ``ib`` check cost the daemon as much as the
    check itself."""
    known = known or {}
    parts: _Parts = {}
    for name, run in snap.runs.items():
        seen = known.get(name)
        parts[name] = seen if seen is not None and seen[0] is run else (run, _run_signature(run))
    seen = known.get(None)
    parts[None] = (seen if seen is not None and seen[0] is snap.health
                   else (snap.health, tuple(sorted(snap.health.items()))))
    runs = tuple((name, parts[name][1]) for name in sorted(snap.runs))
    return (snap.node, snap.profile, snap.version, runs, parts[None][1], tuple(sorted(snap.accepted))), parts


class SnapshotHolder:
    """Where the daemon puts a new snapshot after each check run; the collector reads it.

    ``version`` changes only when the content part of the exposition would, so
    the rendered text can be cached between scrapes.
    """

    def __init__(self, initial: Snapshot) -> None:
        self._lock = threading.Lock()
        self._snap = initial
        self._sig, self._parts = _signature(initial)
        self.version = 0

    def set(self, snap: Snapshot) -> None:
        """``snap``, its runs and its health map must not be changed afterwards: an object
        seen in the last snapshot is not hashed again (see :func:`_signature`)."""
        sig, parts = _signature(snap, self._parts)
        with self._lock:
            self._snap = snap
            self._parts = parts
            if sig != self._sig:
                self._sig = sig
                self.version += 1

    def get(self) -> Snapshot:
        with self._lock:
            return self._snap


def make_registry(holder: SnapshotHolder, readings: ReadingCatalog | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpumonCollector(holder.get, readings=readings))
    return registry


class CachedExposition:
    """A WSGI app serving /metrics from cached text: a scrape costs a copy, not a render.

    The content part (findings, health, readings: ~90 % of the samples on an
    8-GPU node) is rendered once per change of the snapshot's content and per
    format; the small fast part (run times) is rendered on each scrape. Gzip
    members may be concatenated (RFC 1952 section 2.2), so each part is
    compressed on its own. ``readings``: as :class:`GpumonCollector`'s.
    """

    def __init__(self, holder: SnapshotHolder, readings: ReadingCatalog | None = None) -> None:
        self.holder = holder
        self._fast = CollectorRegistry(auto_describe=False)
        self._fast.register(GpumonCollector(holder.get, part="fast"))
        self._content = CollectorRegistry(auto_describe=False)
        self._content.register(GpumonCollector(holder.get, part="content", readings=readings))
        self._cache: dict[tuple[int, str, bool], bytes] = {}
        self._lock = threading.Lock()

    def render(self, accept: str, gzip_ok: bool) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        openmetrics = content_type.startswith("application/openmetrics-text")
        key = (self.holder.version, content_type, gzip_ok)
        with self._lock:
            head = self._cache.get(key)
            if head is None:
                text = encoder(self._content)
                if openmetrics and text.endswith(b"# EOF\n"):
                    text = text[: -len(b"# EOF\n")]  # the fast part closes the exposition
                head = gzip.compress(text, compresslevel=6) if gzip_ok else text
                self._cache = {k: v for k, v in self._cache.items() if k[0] == key[0]}
                self._cache[key] = head
        tail = encoder(self._fast)
        if gzip_ok:
            tail = gzip.compress(tail, compresslevel=1)
        return head + tail, content_type

    # What Prometheus 2.x sends, and a plain client: the two renders worth keeping warm.
    WARM = (("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
             "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True), ("text/plain", False))

    def prerender(self) -> None:
        """Render the content part now (off the scrape path) for the usual formats."""
        for accept, gzip_ok in self.WARM:
            self.render(accept, gzip_ok)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        gzip_ok = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
        body, content_type = self.render(environ.get("HTTP_ACCEPT", ""), gzip_ok)
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        if gzip_ok:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]
