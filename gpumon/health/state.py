"""The health state: a pure, deterministic fold of health events.

Nothing here does I/O or reads a clock: ``HealthState.apply(event)`` is the
only way the state changes, so the state after a restart (fold of the stored
events) is the state before it, and every rule below is tested on
hand-written event sequences.

Why a fold and not "the last sample": a peer that shows the latest reading
either sticks (an Xid gauge that never resets: "stuck unhealthy forever") or
forgets (the Xid line is gone after a reboot, so the GPU looks fine: "silently
healthy"). Here a fault is *raised* by a finding and stays until a rule clears
it:

====================  ==========================================================
fault's action        cleared by
====================  ==========================================================
none, restart_app,    the same check saying ok for that component, or no longer
check_cables          reporting it in a completed run (the condition is gone);
                      a passing retest
reset_gpu             a remediation that satisfies it (a GPU reset of that GPU,
                      or a reboot), *then* a passing retest: ``retest_passed``
                      or an ok finding from the same check for that component
reboot_node           a new boot id, *then* a passing retest (as above)
inspect_hardware      only an operator's ``set_healthy`` (see ``_set_healthy``)
====================  ==========================================================

The same fault (check + component + key) coming back after
``HealthPolicy.escalate_after`` remediations within the escalation window is
escalated to ``inspect_hardware``.

States: a component is ``unhealthy`` when one of its faults needs an action
(worst action wins), ``degraded`` when it has faults that need none (warnings,
``unknown``, a hung probe), else ``healthy``. A failure whose remedy is
``none`` is deliberately *degraded*, not unhealthy: the remediator takes a node
out on ``unhealthy``, and a finding with no action must never leave a node
cordoned (NVSentinel #911). The node is the worst of its components, and
``quarantined`` while gpumon has taken it out (``quarantine`` .. ``release``).
"""

from __future__ import annotations

import enum
import functools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpumon.model import NODE, Action, Finding, Severity

# (check, component, key): one fault. ``key`` tells apart faults that one check
# reports on one component (Xid 79 and Xid 13 on gpu/3).
FaultId = tuple[str, str, str]
# (severity, action, message) of the finding that last set or refreshed a fault. What
# is news is a change of severity or action: a finding that says the same with other
# words or numbers ("down now for 3.2 s", "... for 4.2 s") refreshes the fault's
# message, evidence and last_seen instead of adding an event (an IB outage would
# otherwise add one a second; readings change every run, and storing every change
# would be the 86,400 rows a day this store exists to avoid). The message still
# counts where a finding is compared with one that was *accepted* (set_healthy, a
# passing retest) or *remedied*: a new Xid burst after those is news.
Signature = tuple[str, str, str]

# Faults whose condition going away is the cure: the check saying ok clears them. ``confirm_sdc``
# stands while gpumon confirms an in-job verdict; the verdict judged by it is a fault of its own.
_CLEARED_BY_OK = frozenset({Action.NONE, Action.RESTART_APP, Action.CHECK_CABLES, Action.CONFIRM_SDC})
# Faults a reset/reboot may cure: cleared only by a retest after that remedy.
_NEED_REMEDY = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
# Evidence fields that name a fault within one (check, component), in order.
_KEY_FIELDS = ("fault_key", "code", "kind")
# Evidence fields that count incidents in a check's window (ib: ``outages``, each a
# port outage). An ok finding is stored when its count changes: a 3 s IB blip that
# never reached warn is history too, not only a number in the next reading. After
# the first change, at most one such event per INCIDENT_INTERVAL_S per component (its
# evidence has the count), so a port that micro-flaps all day stays a few rows an hour.
_INCIDENT_FIELDS = ("outages",)
INCIDENT_INTERVAL_S = 600.0


class EventKind(enum.Enum):
    FINDING = "finding"  # a check's finding that changes something (see HealthState.observe)
    RESOLVED = "resolved"  # a completed run of the check no longer reports this fault
    BOOT = "boot"  # a new boot id was seen
    RETEST_PASSED = "retest_passed"  # a retest (bootstrap suite, a check's own retest) passed
    REMEDIATION = "remediation"  # a remedy was carried out (GPU reset, cable reseat, ...)
    SET_HEALTHY = "set_healthy"  # operator override, with who and why
    QUARANTINE = "quarantine"  # gpumon took the node out (cordon/drain)
    RELEASE = "release"  # gpumon put it back


@functools.total_ordering
class Level(enum.Enum):
    """Health of a component or node; ordered, worst last."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    QUARANTINED = "quarantined"

    @property
    def rank(self) -> int:
        return _LEVEL_RANK[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Level):
            return NotImplemented
        return _LEVEL_RANK[self] < _LEVEL_RANK[other]


_LEVEL_RANK = {level: i for i, level in enumerate(Level)}


@dataclass(frozen=True)
class Event:
    """One health event. ``id`` is assigned by the store (None until stored).

    ``last_seen`` and ``latest`` are the mutable things about a stored finding
    event, refreshed in batches, not per repeat: the last time the check said the
    same again (same severity and action), and what it said then (``message``,
    ``evidence``, ``time``). The payload stays what was said at the transition.
    """

    time: float
    kind: EventKind
    component: str = NODE
    check: str = ""
    boot_id: str = ""
    payload: Mapping[str, Any] = field(default_factory=dict)
    id: int | None = None
    last_seen: float | None = None
    latest: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind.value,
                "component": self.component, "check": self.check, "boot_id": self.boot_id,
                "payload": dict(self.payload), "last_seen": self.last_seen,
                "latest": None if self.latest is None else dict(self.latest)}


@dataclass(frozen=True)
class HealthPolicy:
    # the same fault back after this many remediations -> inspect_hardware (gpud: 2 reboots)
    escalate_after: int = 2
    # remediations older than this are forgotten for escalation: a fault that
    # comes back once a quarter is not the same broken part as one back within
    # the hour (30 days, as the store's default retention)
    escalation_window_s: float = 30 * 86400.0
    # events kept per component for ``history()``
    history_per_component: int = 50


# -- event constructors ---------------------------------------------------------------------


def fault_key(finding: Finding) -> str:
    """The part of a fault's identity within (check, component): ``fault_key``, ``code`` or ``kind``."""
    for name in _KEY_FIELDS:
        value = finding.evidence.get(name)
        if value is not None and value != "":
            return str(value)
    return ""


def finding_event(finding: Finding, *, time: float, boot_id: str) -> Event:
    payload = {"severity": finding.severity.value, "action": finding.action.value,
               "message": finding.message, "key": fault_key(finding),
               "evidence": finding.to_json()["evidence"]}
    return Event(time, EventKind.FINDING, finding.component, finding.check, boot_id, payload)


def resolved_event(fault: FaultId, *, time: float, boot_id: str) -> Event:
    check, component, key = fault
    return Event(time, EventKind.RESOLVED, component, check, boot_id, {"key": key})


def boot_event(boot_id: str, *, time: float, previous: str = "") -> Event:
    return Event(time, EventKind.BOOT, NODE, "", boot_id, {"previous": previous})


def retest_passed_event(component: str = NODE, *, time: float, boot_id: str, check: str = "",
                        by: str = "", detail: str = "") -> Event:
    """A retest passed: ``component`` node means the whole node (the bootstrap suite);
    ``check`` empty means any check's faults."""
    return Event(time, EventKind.RETEST_PASSED, component, check, boot_id,
                 {"by": by, "detail": detail})


def remediation_event(action: Action, component: str = NODE, *, time: float, boot_id: str,
                      by: str, detail: str = "") -> Event:
    return Event(time, EventKind.REMEDIATION, component, "", boot_id,
                 {"action": action.value, "by": by, "detail": detail})


def set_healthy_event(component: str = NODE, *, time: float, boot_id: str, who: str,
                      reason: str) -> Event:
    return Event(time, EventKind.SET_HEALTHY, component, "", boot_id, {"who": who, "reason": reason})


def quarantine_event(*, time: float, boot_id: str, by: str, reason: str,
                     action: Action = Action.NONE) -> Event:
    return Event(time, EventKind.QUARANTINE, NODE, "", boot_id,
                 {"by": by, "reason": reason, "action": action.value})


def release_event(*, time: float, boot_id: str, by: str, reason: str) -> Event:
    return Event(time, EventKind.RELEASE, NODE, "", boot_id, {"by": by, "reason": reason})


# -- state records --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """An open fault: raised by a finding, closed by the rules in the module docstring."""

    check: str
    component: str
    key: str
    severity: Severity  # worst while open
    action: Action  # what is recommended now (escalation applied)
    reported_action: Action  # worst action the check itself asked for while open
    message: str
    evidence: Mapping[str, Any]
    raised: float
    last_seen: float
    signature: Signature
    boot_id: str = ""  # boot of the finding that last set it
    reported: bool = True  # False: the check no longer reports it (it awaits a remedy/retest)
    remediated: float | None = None  # when a remedy that satisfies ``action`` was carried out
    escalated: bool = False
    event_id: int | None = None  # the stored finding event behind it (for last_seen refresh)

    @property
    def id(self) -> FaultId:
        return (self.check, self.component, self.key)

    @property
    def status(self) -> str:
        """Where the fault stands, in words for ``gpumon status``."""
        if self.action is Action.INSPECT_HARDWARE:
            return "escalated: awaiting operator" if self.escalated else "awaiting operator"
        if self.action is Action.CONFIRM_SDC:
            return "confirming on the node"
        if self.remediated is not None:
            return "remediated: awaiting retest"
        if self.action in _NEED_REMEDY:
            return f"awaiting {self.action.value}" + ("" if self.reported else " (no longer reported)")
        return "open"

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "component": self.component, "key": self.key,
                "severity": self.severity.value, "action": self.action.value,
                "reported_action": self.reported_action.value, "message": self.message,
                "evidence": dict(self.evidence), "raised": self.raised, "last_seen": self.last_seen,
                "signature": list(self.signature), "boot_id": self.boot_id,
                "reported": self.reported, "remediated": self.remediated,
                "escalated": self.escalated, "event_id": self.event_id, "status": self.status}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fault:
        sig = list(data["signature"])
        return cls(check=str(data["check"]), component=str(data["component"]), key=str(data["key"]),
                   severity=Severity(data["severity"]), action=Action(data["action"]),
                   reported_action=Action(data["reported_action"]), message=str(data["message"]),
                   evidence=dict(data["evidence"]), raised=float(data["raised"]),
                   last_seen=float(data["last_seen"]),
                   signature=(str(sig[0]), str(sig[1]), str(sig[2])), boot_id=str(data["boot_id"]),
                   reported=bool(data["reported"]),
                   remediated=None if data["remediated"] is None else float(data["remediated"]),
                   escalated=bool(data["escalated"]),
                   event_id=None if data["event_id"] is None else int(data["event_id"]))


@dataclass(frozen=True)
class Quarantine:
    since: float
    by: str
    reason: str
    action: Action

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "by": self.by, "reason": self.reason, "action": self.action.value}


@dataclass(frozen=True)
class Accepted:
    """A finding a check is still repeating that an operator's ``set_healthy`` (or a passing
    retest) accepted: no fault while the check repeats it word for word; raised again as soon as
    the check says anything else about it (another severity, action or message)."""

    check: str
    component: str
    key: str
    severity: Severity
    action: Action
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "component": self.component, "key": self.key,
                "severity": self.severity.value, "action": self.action.value, "message": self.message}


@dataclass(frozen=True)
class ComponentHealth:
    component: str
    level: Level
    action: Action
    since: float  # when level or action last changed
    why: tuple[Fault, ...]  # open faults, worst first
    # findings still reported but accepted (set_healthy, a passing retest): not faults
    accepted: tuple[Accepted, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "state": self.level.value, "action": self.action.value,
                "since": self.since, "why": [f.to_json() for f in self.why],
                "accepted": [a.to_json() for a in self.accepted]}


@dataclass(frozen=True)
class NodeHealth:
    level: Level
    action: Action
    since: float
    why: tuple[Fault, ...]  # every open fault on the node, worst first
    quarantine: Quarantine | None
    boot_id: str

    def to_json(self) -> dict[str, Any]:
        return {"state": self.level.value, "action": self.action.value, "since": self.since,
                "why": [f.to_json() for f in self.why],
                "quarantine": None if self.quarantine is None else self.quarantine.to_json(),
                "boot_id": self.boot_id}


@dataclass(frozen=True)
class HealthView:
    """An immutable copy of the state for readers on other threads (the exporter, ``status``)."""

    node: NodeHealth
    components: Mapping[str, ComponentHealth]
    history: Mapping[str, tuple[Event, ...]]
    last_event_id: int | None
    last_event_time: float | None

    def to_json(self, history: int = 10) -> dict[str, Any]:
        return {"node": self.node.to_json(),
                "components": {name: {**c.to_json(),
                                      "history": [e.to_json() for e in self.history.get(name, ())[-history:]]}
                               for name, c in sorted(self.components.items())},
                "node_history": [e.to_json() for e in self.history.get(NODE, ())[-history:]],
                "last_event_id": self.last_event_id, "last_event_time": self.last_event_time}


@dataclass(frozen=True)
class Observation:
    """What a check run means for the state: events to store, and faults merely seen again
    (``words``: the finding that saw each again, for ``HealthState.touch``)."""

    events: list[Event]
    seen: list[FaultId]
    words: Mapping[FaultId, Finding] = field(default_factory=dict)


def covers(scope: str, component: str) -> bool:
    """Whether an action on ``scope`` reaches ``component``: the node reaches everything, a GPU
    its own NVLinks (a GPU reset resets its links)."""
    if scope in (NODE, component):
        return True
    if scope.startswith("gpu/"):
        return component.startswith("nvlink/" + scope[4:] + "/")
    return False


def _fault_order(f: Fault) -> tuple[int, int, str, str, str]:
    return (-f.action.rank, -f.severity.rank, f.component, f.check, f.key)


def _severity(value: Any) -> Severity:
    try:
        return Severity(value)
    except ValueError:
        # an event from a newer gpumon: not ok, so it must not pass for healthy
        return Severity.UNKNOWN


def _action(value: Any) -> Action:
    try:
        return Action(value)
    except ValueError:
        return Action.NONE


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def incidents(evidence: Mapping[str, Any]) -> int | None:
    """The incident count a finding's evidence gives (see ``_INCIDENT_FIELDS``), if any."""
    for name in _INCIDENT_FIELDS:
        value = evidence.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass
class _Mark:
    level: Level
    action: Action
    since: float


class HealthState:
    """The folded state. Mutated only by ``apply`` (and ``touch``, which refreshes ``last_seen``)."""

    def __init__(self, policy: HealthPolicy | None = None) -> None:
        self.policy = policy or HealthPolicy()
        self.boot_id = ""
        self._faults: dict[FaultId, Fault] = {}
        # signatures the operator (set_healthy) or a passing retest has accepted: the
        # same finding repeated by a check that keeps reporting for the whole boot
        # (xid) does not raise the fault again; a changed one does. Dropped when the
        # check stops reporting it, and at every boot.
        self._acked: dict[FaultId, Signature] = {}
        self._remedies: dict[FaultId, list[float]] = {}  # when each fault was remediated
        self._observed: set[tuple[str, str]] = set()  # (check, component) seen at least once
        # (check, component) -> (incident count, time) of the last finding folded that gave a
        # count (see _INCIDENT_FIELDS)
        self._incidents: dict[tuple[str, str], tuple[int, float]] = {}
        self._quarantine: Quarantine | None = None
        self._marks: dict[str, _Mark] = {}
        self._node = _Mark(Level.HEALTHY, Action.NONE, 0.0)
        self._history: dict[str, deque[Event]] = {}
        self.last_event_id: int | None = None
        self.last_event_time: float | None = None
        self._view: HealthView | None = None

    # -- folding ----------------------------------------------------------------------------

    @classmethod
    def fold(cls, events: Iterable[Event], policy: HealthPolicy | None = None) -> HealthState:
        state = cls(policy)
        for event in events:
            state.apply(event)
        return state

    def apply(self, event: Event) -> None:
        t = _finite(event.time)
        before = dict(self._faults)
        if event.kind is not EventKind.BOOT and event.boot_id and self.boot_id \
                and event.boot_id != self.boot_id:
            # an event from a boot we were not told about: the boot happened
            self._boot(event.boot_id, t)
        handler = {
            EventKind.FINDING: self._finding,
            EventKind.RESOLVED: self._resolved,
            EventKind.BOOT: self._boot_event,
            EventKind.RETEST_PASSED: self._retest_passed,
            EventKind.REMEDIATION: self._remediation,
            EventKind.SET_HEALTHY: self._set_healthy,
            EventKind.QUARANTINE: self._quarantine_event,
            EventKind.RELEASE: self._release,
        }[event.kind]
        handler(event, t)
        if event.kind is not EventKind.BOOT and event.boot_id and not self.boot_id:
            self.boot_id = event.boot_id
        changed = self._refresh(event, t, before)
        for name in changed | {event.component}:
            hist = self._history.get(name)
            if hist is None:
                hist = self._history[name] = deque(maxlen=max(1, self.policy.history_per_component))
            hist.append(event)
        if event.id is not None:
            self.last_event_id = event.id if self.last_event_id is None else max(self.last_event_id,
                                                                                event.id)
        self.last_event_time = t
        self._view = None

    def touch(self, fault: FaultId, time: float, finding: Finding | None = None) -> int | None:
        """The fault was seen again (``observe`` put it in ``seen``): refresh ``last_seen`` and,
        given the ``finding`` that saw it, its message and evidence (the store keeps them as the
        ``latest`` of the event behind the fault). Returns that event's id."""
        f = self._faults.get(fault)
        if f is None:
            return None
        changes: dict[str, Any] = {"last_seen": max(f.last_seen, _finite(time))}
        if finding is not None and (finding.severity.value, finding.action.value) == f.signature[:2] \
                and (f.remediated is None or finding.message == f.signature[2]):
            changes.update(message=finding.message, evidence=finding.to_json()["evidence"],
                           signature=(f.signature[0], f.signature[1], finding.message))
            count = incidents(finding.evidence)
            known = self._incidents.get((f.check, f.component))
            if count is not None and known is not None:
                self._incidents[(f.check, f.component)] = (count, known[1])
        self._faults[fault] = replace(f, **changes)
        self._view = None
        return f.event_id

    def fault(self, fault: FaultId) -> Fault | None:
        return self._faults.get(fault)

    def _finding(self, event: Event, t: float) -> None:
        p = event.payload
        severity = _severity(p.get("severity"))
        fid: FaultId = (event.check, event.component, str(p.get("key", "")))
        message = str(p.get("message", ""))
        evidence = p.get("evidence")
        latest = event.latest
        if isinstance(latest, Mapping) and isinstance(latest.get("message"), str):
            # what the check said last while the fault stood as this event set it
            message = latest["message"]
            if isinstance(latest.get("evidence"), Mapping):
                evidence = latest["evidence"]
        evidence = dict(evidence) if isinstance(evidence, Mapping) else {}
        count = incidents(evidence)
        if count is not None:
            self._incidents[(event.check, event.component)] = (count, t)
        if severity is Severity.OK:
            self._ok(event.check, event.component)
            return
        if severity is Severity.SKIPPED:
            # the check does not apply there: no news about faults either way
            self._observed.add((event.check, event.component))
            return
        self._observed.add((event.check, event.component))
        action = _action(p.get("action"))
        sig: Signature = (severity.value, action.value, message)
        seen = max(t, _finite(event.last_seen)) if event.last_seen is not None else t
        old = self._faults.get(fid)
        if old is None:
            if self._acked.get(fid) == sig:
                return  # a repeat of what the operator or a retest already accepted
            self._acked.pop(fid, None)
            escalate = action is not Action.NONE and self._remedy_count(fid, t) >= self.policy.escalate_after
            self._faults[fid] = Fault(event.check, event.component, fid[2], severity,
                                      Action.INSPECT_HARDWARE if escalate else action, action, message,
                                      evidence, t, seen, sig, event.boot_id, escalated=escalate,
                                      event_id=event.id)
            return
        if old.remediated is not None:
            if sig == old.signature and old.reported and event.boot_id == old.boot_id:
                # the check repeating, in the same boot, what it said before the remedy
                # (xid keeps a GPU's Xids for the whole boot and knows nothing of
                # resets): not the fault coming back
                return
            # back after a remedy: it did not cure it
            escalate = old.escalated or (
                action is not Action.NONE and self._remedy_count(fid, t) >= self.policy.escalate_after)
            reported_action = max(old.reported_action, action)
            self._faults[fid] = replace(
                old, severity=max(old.severity, severity), reported_action=reported_action,
                action=Action.INSPECT_HARDWARE if escalate else reported_action, message=message,
                evidence=evidence, last_seen=seen, signature=sig, boot_id=event.boot_id, reported=True,
                remediated=None, escalated=escalate, event_id=event.id)
            return
        reported_action = max(old.reported_action, action)
        self._faults[fid] = replace(
            old, severity=max(old.severity, severity), reported_action=reported_action,
            action=Action.INSPECT_HARDWARE if old.escalated else max(old.action, reported_action),
            message=message, evidence=evidence, last_seen=max(old.last_seen, seen), signature=sig,
            boot_id=event.boot_id, reported=True, event_id=event.id)

    def _remedy_count(self, fid: FaultId, t: float) -> int:
        window = self.policy.escalation_window_s
        return sum(1 for r in self._remedies.get(fid, ()) if t - r <= window)

    def _ok(self, check: str, component: str) -> None:
        self._observed.add((check, component))
        for fid, f in list(self._faults.items()):
            if f.check != check or f.component != component:
                continue
            if f.action in _CLEARED_BY_OK:
                del self._faults[fid]  # the condition is gone, and that was the whole fault
            elif f.action in _NEED_REMEDY and f.remediated is not None:
                del self._faults[fid]  # the check's own retest after the remedy passed
            elif f.reported:
                # no longer seen, but a reset/reboot it needs has not happened, or
                # it is the operator's to clear: it stays
                self._faults[fid] = replace(f, reported=False)
        for fid in [a for a in self._acked if a[0] == check and a[1] == component]:
            del self._acked[fid]

    def _resolved(self, event: Event, t: float) -> None:
        fid: FaultId = (event.check, event.component, str(event.payload.get("key", "")))
        self._acked.pop(fid, None)
        f = self._faults.get(fid)
        if f is None:
            return
        if f.action in _CLEARED_BY_OK:
            del self._faults[fid]
        elif f.reported:
            # Silence is not a retest: the Xid 79 line being gone after a reboot says
            # nothing about the GPU (a passive log reader has simply not seen a new
            # one). Only a passing retest clears a fault that needed a remedy.
            self._faults[fid] = replace(f, reported=False)

    def _boot_event(self, event: Event, t: float) -> None:
        if event.boot_id:
            self._boot(event.boot_id, t)

    def _boot(self, boot_id: str, t: float) -> None:
        if boot_id == self.boot_id:
            return  # the same boot told twice (by the daemon and by ``gpumon set-healthy``)
        first = not self.boot_id
        self.boot_id = boot_id
        self._acked.clear()  # acceptances hold for one boot: the same line in a new boot is news
        if first:
            # the first boot id ever known (or one that could not be read before): no
            # proof that a reboot happened in between
            return
        for fid, f in list(self._faults.items()):
            # a reboot satisfies reboot_node and reset_gpu (it resets every GPU)
            if f.action in _NEED_REMEDY and f.remediated is None:
                self._remedied(fid, f, t)

    def _remedied(self, fid: FaultId, f: Fault, t: float) -> None:
        self._faults[fid] = replace(f, remediated=t)
        times = self._remedies.setdefault(fid, [])
        times.append(t)
        window = self.policy.escalation_window_s
        times[:] = [r for r in times if t - r <= window][-max(1, self.policy.escalate_after) - 1:]

    def _remediation(self, event: Event, t: float) -> None:
        action = _action(event.payload.get("action"))
        if action is Action.REBOOT_NODE or action not in (Action.RESET_GPU, *_CLEARED_BY_OK):
            # a reboot is proven by the new boot id, not by someone saying it will
            # happen; inspect_hardware is closed by set_healthy
            return
        for fid, f in list(self._faults.items()):
            if f.action is action and f.remediated is None and covers(event.component, f.component):
                self._remedied(fid, f, t)

    def _retest_passed(self, event: Event, t: float) -> None:
        for fid, f in list(self._faults.items()):
            if not covers(event.component, f.component) or (event.check and f.check != event.check):
                continue
            if f.action in _CLEARED_BY_OK or (f.action in _NEED_REMEDY and f.remediated is not None):
                del self._faults[fid]
                self._accept(fid, f)

    def _set_healthy(self, event: Event, t: float) -> None:
        """Operator override: close every fault of the component (all, for ``node``).

        This is the only way to close ``inspect_hardware``. That action means a
        person has to look at the part (RMA path): it is raised for faults a
        retest cannot disprove (intermittent Xid 13 bursts, silent data
        corruption at 1e-6 per run, a fault that survived two reboots), so a
        passing check or another reboot proves nothing, and gpumon cannot see a
        part being reseated or swapped. Only the person who did that can say so,
        and the event records who and why. The history is kept; the escalation
        count of the closed faults starts again (a replaced part is a new part).
        The findings the checks are repeating right now are accepted for this
        boot, so that a check that keeps an Xid for the whole boot does not
        raise it again at once; a new or changed finding does.
        """
        for fid, f in list(self._faults.items()):
            if covers(event.component, f.component):
                del self._faults[fid]
                self._accept(fid, f)
                self._remedies.pop(fid, None)

    def _accept(self, fid: FaultId, f: Fault) -> None:
        # A check may go on repeating a closed fault's finding for the rest of the
        # boot (xid keeps a GPU's Xids until reboot): that repeat is not news. Only
        # a finding from this boot can be repeated; one from an earlier boot seen
        # again is the fault back, so it is not accepted.
        if f.boot_id == self.boot_id:
            self._acked[fid] = f.signature

    def _quarantine_event(self, event: Event, t: float) -> None:
        p = event.payload
        since = self._quarantine.since if self._quarantine is not None else t
        self._quarantine = Quarantine(since, str(p.get("by", "")), str(p.get("reason", "")),
                                      _action(p.get("action")))

    def _release(self, event: Event, t: float) -> None:
        self._quarantine = None

    def _refresh(self, event: Event, t: float, before: Mapping[FaultId, Fault]) -> set[str]:
        """Recompute levels; ``since`` moves only when a level or action changes.

        Returns the components whose faults or level changed (their history gets the event).
        Only components whose faults changed can change level, so only they are
        recomputed: folding a year of events stays linear.
        """
        touched = {fid[1] for fid in before.keys() ^ self._faults.keys()}
        touched |= {fid[1] for fid, f in self._faults.items() if fid in before and before[fid] != f}
        names = set(touched)
        if event.kind is EventKind.FINDING or event.component != NODE:
            names.add(event.component)
        per: dict[str, list[Fault]] = {name: [] for name in names}
        for f in self._faults.values():
            if f.component in per:
                per[f.component].append(f)
        for name in names:
            level, action = _level(per[name])
            mark = self._marks.get(name)
            if mark is None:
                self._marks[name] = _Mark(level, action, t)
            elif (mark.level, mark.action) != (level, action):
                self._marks[name] = _Mark(level, action, t)
                touched.add(name)
        worst_level = max((m.level for m in self._marks.values()), default=Level.HEALTHY,
                          key=_LEVEL_RANK.__getitem__)
        worst_action = max((m.action for m in self._marks.values()), default=Action.NONE,
                           key=lambda a: a.rank)
        if self._quarantine is not None:
            worst_level = Level.QUARANTINED
        if self.last_event_time is None or (self._node.level, self._node.action) != (worst_level,
                                                                                      worst_action):
            self._node = _Mark(worst_level, worst_action, t)
        return touched

    # -- what a check run means (pure: reads the state, changes nothing) ----------------------

    def observe(self, check: str, findings: Sequence[Finding], *, complete: bool, time: float,
                boot_id: str) -> Observation:
        """The events a check run adds, and the faults it only saw again.

        Only changes are stored: a finding with the severity and action of the one
        that last set its fault (same boot) is a repeat, whatever its message and
        evidence — its ``last_seen``, message and evidence are refreshed instead
        (``touch``), so an IB outage that says "down now for N s" every second is
        two events (warn, then fail past the NCCL timeout), not one a second. A
        fault awaiting its retest after a remedy is the exception: there any new
        words are news (a new Xid after the reset). An ok finding is stored only
        when it clears something, when its incident count changed (a blip that
        never left ok), or the first time (check, component) is seen, so the state
        knows every component that was checked. ``complete`` (the run finished normally,
        not hung, not raised): then a fault the run no longer reports is
        ``resolved``, unless the run also says ``unknown`` (a check that could not
        say does not vouch for anything) or ``skipped`` for that component.
        """
        nonok: dict[FaultId, Finding] = {}
        oks: dict[str, Finding] = {}
        skipped: set[str] = set()
        unknown = False
        for f in findings:
            if f.severity is Severity.OK:
                oks.setdefault(f.component, f)
            elif f.severity is Severity.SKIPPED:
                skipped.add(f.component)
            else:
                unknown = unknown or f.severity is Severity.UNKNOWN
                fid = (check, f.component, fault_key(f))
                kept = nonok.get(fid)
                if kept is None or (f.severity, f.action) > (kept.severity, kept.action):
                    nonok[fid] = f
        nonok_components = {fid[1] for fid in nonok}
        events: list[Event] = []
        seen: list[FaultId] = []
        words: dict[FaultId, Finding] = {}
        for fid, f in nonok.items():
            if f.check != check:
                f = replace(f, check=check)
            sig: Signature = (f.severity.value, f.action.value, f.message)
            old = self._faults.get(fid)
            if old is not None and old.reported and old.boot_id == boot_id and (
                    old.signature == sig if old.remediated is not None else old.signature[:2] == sig[:2]):
                seen.append(fid)
                words[fid] = f
            elif old is None and self._acked.get(fid) == sig:
                pass
            else:
                events.append(finding_event(f, time=time, boot_id=boot_id))
        ok_clears: set[str] = set()
        for component, f in oks.items():
            if component in nonok_components:
                continue  # its other faults are handled below, key by key
            if f.check != check:
                f = replace(f, check=check)
            if self._ok_would_change(check, component) or self._incident_news(check, component, f, time):
                events.append(finding_event(f, time=time, boot_id=boot_id))
            ok_clears.add(component)
        if complete and not unknown:
            gone = [fid for fid, f in self._faults.items() if fid[0] == check and f.reported]
            gone += [fid for fid in self._acked if fid[0] == check]
            for fid in sorted(set(gone)):
                if fid in nonok or fid[1] in ok_clears or fid[1] in skipped:
                    continue
                events.append(resolved_event(fid, time=time, boot_id=boot_id))
        return Observation(events, seen, words)

    def _incident_news(self, check: str, component: str, finding: Finding, time: float) -> bool:
        """An ok finding whose incident count changed (a blip): the first change at once, then
        at most one per INCIDENT_INTERVAL_S."""
        count = incidents(finding.evidence)
        if count is None:
            return False
        known = self._incidents.get((check, component))
        if known is None:
            return count != 0
        if count == known[0]:
            return False
        return not 0 <= _finite(time) - known[1] < INCIDENT_INTERVAL_S or known[0] == 0

    def _ok_would_change(self, check: str, component: str) -> bool:
        """Mirror of ``_ok``: whether an ok finding would change anything but ``last_seen``."""
        if (check, component) not in self._observed:
            return True
        if any(a[0] == check and a[1] == component for a in self._acked):
            return True
        for f in self._faults.values():
            if f.check == check and f.component == component and (
                    f.reported or f.action in _CLEARED_BY_OK
                    or (f.action in _NEED_REMEDY and f.remediated is not None)):
                return True
        return False

    # -- queries ----------------------------------------------------------------------------

    @property
    def faults(self) -> Mapping[FaultId, Fault]:
        return dict(self._faults)

    @property
    def quarantine(self) -> Quarantine | None:
        return self._quarantine

    def component(self, name: str) -> ComponentHealth:
        """A component's health; one never seen is healthy with ``since`` 0 (callers that must
        not call an unchecked part healthy look it up in ``components()``)."""
        why = tuple(sorted((f for f in self._faults.values() if f.component == name), key=_fault_order))
        mark = self._marks.get(name)
        level, action = _level(why)
        accepted = tuple(Accepted(fid[0], fid[1], fid[2], _severity(sig[0]), _action(sig[1]), sig[2])
                         for fid, sig in sorted(self._acked.items()) if fid[1] == name)
        return ComponentHealth(name, level, action, mark.since if mark else 0.0, why, accepted)

    def components(self) -> dict[str, ComponentHealth]:
        return {name: self.component(name) for name in sorted(self._marks)}

    def node(self) -> NodeHealth:
        why = tuple(sorted(self._faults.values(), key=_fault_order))
        return NodeHealth(self._node.level, self._node.action, self._node.since, why, self._quarantine,
                          self.boot_id)

    def history(self, component: str, limit: int | None = None) -> list[Event]:
        events = list(self._history.get(component, ()))
        return events if limit is None else events[-limit:] if limit > 0 else []

    def view(self) -> HealthView:
        """An immutable copy, rebuilt only after the state changed (scrapes read it for free)."""
        if self._view is None:
            self._view = HealthView(self.node(), self.components(),
                                    {k: tuple(v) for k, v in self._history.items()},
                                    self.last_event_id, self.last_event_time)
        return self._view

    # -- snapshots (compaction folds old events into one) -------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        """Everything but the history, as JSON-able data: ``from_snapshot`` + the later events
        gives the state that folding every event gives."""
        return {
            "version": 1,
            "boot_id": self.boot_id,
            "faults": [f.to_json() for f in self._faults.values()],
            "acked": [[*fid, *sig] for fid, sig in self._acked.items()],
            "remedies": [[*fid, times] for fid, times in self._remedies.items()],
            "observed": sorted([list(o) for o in self._observed]),
            "incidents": sorted([[*k, n, t] for k, (n, t) in self._incidents.items()]),
            "quarantine": None if self._quarantine is None else self._quarantine.to_json(),
            "marks": {k: [m.level.value, m.action.value, m.since] for k, m in self._marks.items()},
            "node": [self._node.level.value, self._node.action.value, self._node.since],
            "last_event_id": self.last_event_id,
            "last_event_time": self.last_event_time,
        }

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], policy: HealthPolicy | None = None) -> HealthState:
        if data.get("version") != 1:
            raise ValueError(f"unknown health snapshot version {data.get('version')!r}")
        s = cls(policy)
        s.boot_id = str(data["boot_id"])
        for item in data["faults"]:
            f = Fault.from_json(item)
            s._faults[f.id] = f
        for a in data["acked"]:
            s._acked[(str(a[0]), str(a[1]), str(a[2]))] = (str(a[3]), str(a[4]), str(a[5]))
        for r in data["remedies"]:
            s._remedies[(str(r[0]), str(r[1]), str(r[2]))] = [float(x) for x in r[3]]
        s._observed = {(str(o[0]), str(o[1])) for o in data["observed"]}
        # absent from snapshots written before incidents were counted
        s._incidents = {(str(i[0]), str(i[1])): (int(i[2]), float(i[3])) for i in data.get("incidents", [])}
        q = data["quarantine"]
        if q is not None:
            s._quarantine = Quarantine(float(q["since"]), str(q["by"]), str(q["reason"]), Action(q["action"]))
        s._marks = {k: _Mark(Level(v[0]), Action(v[1]), float(v[2])) for k, v in data["marks"].items()}
        n = data["node"]
        s._node = _Mark(Level(n[0]), Action(n[1]), float(n[2]))
        s.last_event_id = None if data["last_event_id"] is None else int(data["last_event_id"])
        s.last_event_time = None if data["last_event_time"] is None else float(data["last_event_time"])
        return s


def _level(faults: Iterable[Fault]) -> tuple[Level, Action]:
    level, action = Level.HEALTHY, Action.NONE
    for f in faults:
        action = max(action, f.action)
        level = max(level, Level.DEGRADED if f.action is Action.NONE else Level.UNHEALTHY)
    return level, action


def fold(events: Iterable[Event], policy: HealthPolicy | None = None) -> HealthState:
    return HealthState.fold(events, policy)
