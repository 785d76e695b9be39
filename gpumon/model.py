"""Plain data that flows from checks to the health state and exporters.

These types are the JSON contract of DESIGN.md: a Finding serialises to
``{check, component, severity, action, message, evidence}``.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@functools.total_ordering
class Severity(enum.Enum):
    """How bad a finding is. Ordered so that ``max()`` gives the worst.

    ``skipped`` (the check does not apply here) and ``unknown`` (it should have
    run but could not say) are never folded into ``ok``: a check that did not
    run must not look healthy (NPD #407, gpud "NVML missing -> Healthy").
    """

    OK = "ok"
    SKIPPED = "skipped"
    UNKNOWN = "unknown"
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank < other.rank


_SEVERITY_RANK = {
    Severity.OK: 0,
    Severity.SKIPPED: 1,
    Severity.UNKNOWN: 2,
    Severity.WARN: 3,
    Severity.FAIL: 4,
}


@functools.total_ordering
class Action(enum.Enum):
    """What an operator (or the remediator) should do. Fixed vocabulary; worst wins.

    The order follows how much of the node a remedy takes away and how final it
    is: inspecting hardware (RMA path) beats any reboot (gpud ranks
    HardwareInspection above RebootSystem for the same reason).
    """

    NONE = "none"
    RESTART_APP = "restart_app"
    CHECK_CABLES = "check_cables"
    # gpumon itself confirms an in-job SDC verdict on the GPU it names (its canaries, once the GPU is
    # free): the node takes no new work until then, and nothing is asked of an operator
    CONFIRM_SDC = "confirm_sdc"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    INSPECT_HARDWARE = "inspect_hardware"

    @property
    def rank(self) -> int:
        return _ACTION_ORDER.index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self.rank < other.rank


_ACTION_ORDER = [
    Action.NONE,
    Action.RESTART_APP,
    Action.CHECK_CABLES,
    Action.CONFIRM_SDC,
    Action.RESET_GPU,
    Action.REBOOT_NODE,
    Action.INSPECT_HARDWARE,
]


class Phase(enum.Enum):
    CONTINUOUS = "continuous"
    BOOTSTRAP = "bootstrap"
    CANARY = "canary"


# component = node | gpu/<index> | nvlink/<gpu>/<link> | ib/<device>/<port> | pci/<bus-id> | nvswitch/<index>
_COMPONENT_RE = re.compile(
    r"^(node"
    r"|gpu/\d+"
    r"|nvlink/\d+/\d+"
    r"|ib/[A-Za-z0-9_.\-]+/\d+"
    r"|pci/[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"
    r"|nvswitch/\d+)$"
)
# the same as a regular expression both Python and JSON Schema (ECMA-262) read: the query API's
# OpenAPI document (gpumon.export.openapi) gives it as every component's pattern
COMPONENT_PATTERN = _COMPONENT_RE.pattern

NODE = "node"


def gpu(index: int) -> str:
    return f"gpu/{index}"


def nvlink(gpu_index: int, link: int) -> str:
    return f"nvlink/{gpu_index}/{link}"


def ib(device: str, port: int) -> str:
    return f"ib/{device}/{port}"


def pci(bus_id: str) -> str:
    return f"pci/{bus_id}"


def nvswitch(index: int) -> str:
    return f"nvswitch/{index}"


def is_component(name: str) -> bool:
    return bool(_COMPONENT_RE.match(name))


@dataclass(frozen=True)
class Finding:
    check: str
    component: str
    severity: Severity
    message: str
    action: Action = Action.NONE
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_component(self.component):
            raise ValueError(f"bad component name {self.component!r} (check {self.check})")

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "component": self.component,
            "severity": self.severity.value,
            "action": self.action.value,
            "message": self.message,
            "evidence": _jsonable(self.evidence),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Finding:
        return cls(
            check=str(data["check"]),
            component=str(data["component"]),
            severity=Severity(data["severity"]),
            action=Action(data.get("action", "none")),
            message=str(data["message"]),
            evidence=dict(data.get("evidence") or {}),
        )


@dataclass
class CheckRun:
    """One run of one check: what it found, when it started, how long it took, how it ended."""

    check: str
    findings: list[Finding]
    started: float
    seconds: float
    outcome: str  # "completed" | "hung" | "error" | "skipped" | "still-hung"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def worst_severity(findings: Iterable[Finding]) -> Severity:
    return max((f.severity for f in findings), default=Severity.OK)


def worst_action(findings: Iterable[Finding]) -> Action:
    return max((f.action for f in findings), default=Action.NONE)


class Status(enum.Enum):
    """Overall status of a run, the JSON ``status`` field and the exit code (NHC / Nagios)."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    ERROR = "error"

    @property
    def exit_code(self) -> int:
        return {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 3}[self]


def overall_status(findings: Iterable[Finding]) -> Status:
    """ok/skipped -> ok; unknown or warn -> warn; fail -> fail.

    An ``unknown`` finding is a warning, not ok: a check that could not say is
    something an operator must see, but it is not proof of a fault either.
    """
    worst = worst_severity(findings)
    if worst is Severity.FAIL:
        return Status.FAIL
    if worst in (Severity.WARN, Severity.UNKNOWN):
        return Status.WARN
    return Status.OK


_READING_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_RESERVED_LABELS = {"check", "component"}


def reading(name: str, value: float | int | bool, **labels: str | int) -> list[Any]:
    """A numeric reading for ``evidence["readings"]``, exported as ``gpumon_<name>``.

    A name ending in ``_total`` is a counter (keep it monotonic in the check's
    state). Validated here so that a bad name fails in the check's own tests.
    """
    if not _READING_NAME.match(name) or name.startswith("gpumon_"):
        raise ValueError(f"bad reading name {name!r}")
    for key in labels:
        if not _READING_NAME.match(key) or key in _RESERVED_LABELS:
            raise ValueError(f"bad reading label {key!r}")
    return [name, float(value), {k: str(v) for k, v in labels.items()}]


ReadingKind = Literal["gauge", "counter"]

# The unit of a bandwidth reading on /metrics is the base unit; a check's evidence and messages keep
# GB/s (Grafana's unit "Bps" shows it).
UNIT_BYTES_PER_SECOND = ("bytes per second (the check's evidence and messages say GB/s: 1 GB/s = 1e9 "
                         "bytes per second)")


@dataclass(frozen=True)
class ReadingSpec:
    """What a check declares about a reading it publishes with :func:`reading` (``Check.readings``),
    which ``/metrics`` shows as the family's HELP and TYPE, so that an operator reading it or building
    a dashboard needs nothing else.

    ``meaning``: what the number counts or measures, and of what (its labels); ``unit``: its unit,
    None for a flag or an enumeration (``meaning`` then says "a flag" or what the values stand for);
    ``source``: where gpumon got it (NVML function, sysfs file, kernel log, an external tool, or
    gpumon's own measurement or judgement); ``note``: what the check makes of it, if worth saying.
    ``labels``: the reading's own labels (``check`` and ``component`` come with every reading).
    A counter's name ends in ``_total`` and only a counter's does (the exporter drops the suffix
    from the family name, as Prometheus does). A bad declaration raises ``ValueError`` when the
    check's module is imported, so that the check is reported as not loaded.
    """

    name: str
    kind: ReadingKind
    meaning: str
    unit: str | None
    source: str
    labels: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if not _READING_NAME.match(self.name) or self.name.startswith("gpumon_"):
            raise ValueError(f"bad reading name {self.name!r}")
        if self.kind not in ("gauge", "counter"):
            raise ValueError(f"reading {self.name}: kind {self.kind!r} is neither gauge nor counter")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"reading {self.name}: a counter's name ends in _total, and only a counter's "
                             f"(this one is declared a {self.kind})")
        for key in self.labels:
            if not _READING_NAME.match(key) or key in _RESERVED_LABELS:
                raise ValueError(f"reading {self.name}: bad label {key!r}")
        if not self.meaning.strip() or not self.source.strip() or self.unit == "":
            raise ValueError(f"reading {self.name}: a declaration says its meaning, unit and source")
        texts = (self.meaning, self.unit or "", self.source, self.note)
        if any("\n" in t for t in texts):
            raise ValueError(f"reading {self.name}: HELP is one line")

    @property
    def help(self) -> str:
        """The family's HELP text: meaning, unit, source, note."""
        parts = [self.meaning]
        if self.unit is not None:
            parts.append(f"Unit: {self.unit}.")
        parts.append(f"Source: {self.source}.")
        if self.note:
            parts.append(self.note)
        return " ".join(parts)
