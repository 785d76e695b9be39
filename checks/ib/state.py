"""The ib check's declared state (``IbCheck.State``): per port its outages, counters, error buckets
and last full reading, and the ports each device showed when last listed.

The framework loads it from the saved JSON (a damaged port record is forgotten alone,
:meth:`IbState.salvage`; state of another shape is refused and the check starts afresh), saves it
after the runs (at once when an outage opens or closes: ``ctx.save_state_now``) and resets it at a
reboot, where an outage still open is closed at the last sample that saw it (:meth:`IbState.new_boot`).

A port's outages are :class:`Record` s: beyond :data:`MAX_RECORDS` per port the two oldest are merged,
so a port flapping every second cannot grow the persisted state without bound.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.bootstate import BootState, StateError, load_state

STATE_VERSION = 1
KEY_RE = re.compile(r"[^/]+/[0-9]{1,3}")
log = logging.getLogger("gpumon.checks.ib")
# How many outage records one port keeps; beyond it the two oldest are merged.
MAX_RECORDS = 128
RATE_COUNTERS = ("symbol_error", "link_error_recovery")


@dataclass
class Record:
    """Outages of one port: one measured outage, those seen only through link_downed between two
    samples (``n`` of them, each at most the gap long), or older records merged (``cap``)."""

    start: float
    end: float
    down_s: float
    max_s: float
    longest_s: float
    n: int
    kind: str


def record(start: float, end: float, down_s: float, max_s: float, kind: str, n: int = 1) -> Record:
    # clamped: a wall clock stepped back (NTP) must not make a negative outage
    down_s, max_s = max(0.0, down_s), max(0.0, max_s)
    return Record(start, max(start, end), down_s, max(down_s, max_s), down_s, n, kind)


def cap(records: list[Record]) -> None:
    while len(records) > MAX_RECORDS:
        a, b = records[0], records.pop(1)
        records[0] = Record(min(a.start, b.start), max(a.end, b.end), a.down_s + b.down_s, a.max_s + b.max_s,
                             max(a.longest_s, b.longest_s), a.n + b.n, "merged")


@dataclass
class Detail:
    """The last full reading of a port (see check._DETAIL_S): what a state-only reading is completed from."""

    t: float
    rate: tuple[float, int | None, str | None] | None
    link_layer: str
    counters: dict[str, int]
    errors: dict[str, str]

    def __post_init__(self) -> None:
        if any(v < 0 for v in self.counters.values()):
            raise ValueError("a negative counter")


@dataclass
class Port:
    seen_up: bool = False
    last_t: float | None = None
    last_up: bool | None = None
    down_since: float | None = None
    down_prev_up: float | None = None
    last_down_t: float | None = None
    missing_since: float | None = None
    outages: list[Record] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    resets: int = 0
    # per rate counter, [minute start, count] buckets of the rate window
    buckets: dict[str, list[list[float]]] = field(default_factory=lambda: {c: [] for c in RATE_COUNTERS})
    detail: Detail | None = None

    def __post_init__(self) -> None:
        if any(v < 0 for v in self.counters.values()):
            raise ValueError("a negative counter")
        if sorted(self.buckets) != sorted(RATE_COUNTERS):
            raise ValueError(f"buckets for {sorted(self.buckets)}, not {sorted(RATE_COUNTERS)}")
        if any(len(b) != 2 for c in RATE_COUNTERS for b in self.buckets[c]):
            raise ValueError("a bucket that is not [start, count]")


def close(p: Port, *, end: float, kind: str) -> None:
    start = p.down_since
    assert start is not None  # only an open outage is closed
    prev_up = p.down_prev_up
    p.outages.append(record(start, end, end - start, end - (prev_up if prev_up is not None else start),
                                kind))
    p.down_since = p.down_prev_up = p.last_down_t = None
    cap(p.outages)


@dataclass
class Layout:
    """The ports of each device as last listed, and when (None: list again at the next sample)."""

    t: float | None = None
    ports: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not all(0 < n < 256 for ports in self.ports.values() for n in ports):
            raise ValueError("a port number outside 1..255")


@dataclass
class IbState(BootState):
    """The check's declared state (``IbCheck.State``; JSON through gpumon.bootstate)."""

    version: int = STATE_VERSION
    ports: dict[str, Port] = field(default_factory=dict)  # "dev/port" -> its state
    layout: Layout = field(default_factory=Layout)

    def __post_init__(self) -> None:
        if self.version != STATE_VERSION:
            raise ValueError(f"version {self.version}, this release writes {STATE_VERSION}")
        bad = [k for k in self.ports if KEY_RE.fullmatch(k) is None]
        if bad:
            raise ValueError(f"port key(s) {', '.join(map(repr, bad))} are not device/port")

    def new_boot(self) -> bool:
        """Counters restart with the driver and an open outage cannot be followed across the
        reboot: close it at the last sample that saw it, forget ports that are gone. True when
        an outage was closed or a port forgotten."""
        ports = self.ports
        changed = False
        for key in list(ports):
            p = ports[key]
            if p.missing_since is not None:
                del ports[key]
                changed = True
                continue
            if p.down_since is not None:
                close(p, end=p.last_down_t or p.down_since, kind="state (closed by reboot)")
                changed = True
            p.last_t = p.last_up = p.detail = None
            p.counters = {}
        self.layout = Layout()
        return changed

    @classmethod
    def salvage(cls, raw: MutableMapping[str, Any], check: str) -> None:
        """Forget the saved ports that do not read back (each logged), before the state is read as
        a whole: one damaged port record must not cost every other port its outage window."""
        ports = raw.get("ports")
        if not isinstance(ports, dict):
            return  # the whole state is then refused, as it should
        ports = raw["ports"] = dict(ports)  # ``raw`` is a copy; the ports mapping in it is not
        for key in list(ports):
            try:
                if KEY_RE.fullmatch(str(key)) is None:
                    raise StateError(f"state.ports[{key!r}]: not device/port")
                load_state(Port, ports[key])
            except StateError as exc:
                log.warning("saved state of check %s: port %s forgotten: %s", check, key, exc)
                del ports[key]
