"""InfiniBand / RDMA ports from sysfs: ``<host-root>/sys/class/infiniband/<dev>/ports/<n>/``.

The kernel (drivers/infiniband/core/sysfs.c) writes ``state`` as ``"4: ACTIVE"``,
``phys_state`` as ``"5: LinkUp"``, ``rate`` as ``"400 Gb/sec (4X NDR)"`` (or
``"2.5 Gb/sec (1X SDR)"``), ``link_layer`` as ``InfiniBand`` or ``Ethernet``,
and each ``counters/<name>`` as one decimal number. Anything else is garbage:
the parsers raise :class:`IbAttrError` (an ``HwFailure``), which a check turns
into ``unknown`` for that port, never into a reading.

The PortCounters error counters the kernel exposes are narrow and *saturate*
at their maximum instead of wrapping (IBTA PortCounters; the widths are those
of ``PORT_PMA_ATTR`` in drivers/infiniband/core/sysfs.c): a counter that reads
its maximum can no longer show new events.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpumon.errors import HwCondition, HwFailure, HwTimeout
from gpumon.hw.hostfs import HostFs
from gpumon.model import ib as ib_component
from gpumon.model import is_component

CLASS_DIR = "sys/class/infiniband"

# IBTA PortInfo PortState / PortPhysicalState values (ib_verbs.h enum ib_port_state,
# and the phys_state names printed by drivers/infiniband/core/sysfs.c phys_state_to_str).
STATE_ACTIVE = 4
PHYS_LINK_UP = 5
STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATE_NAMES = {0: "<unknown>", 1: "Sleep", 2: "Polling", 3: "Disabled",
                    4: "PortConfigurationTraining", 5: "LinkUp", 6: "LinkErrorRecovery",
                    7: "Phy Test"}

# Bit widths of the PortCounters fields behind the sysfs files (PORT_PMA_ATTR in
# drivers/infiniband/core/sysfs.c: symbol_error 16, link_error_recovery 8,
# link_downed 8, port_rcv_errors 16, local_link_integrity_errors 4,
# excessive_buffer_overrun_errors 4). These counters stop at 2**width - 1.
COUNTER_WIDTH_BITS = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
}
WATCHED_COUNTERS = ("link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors")
# What a state-only sample reads besides state and phys_state: link_downed must be read
# at every sample so that an outage between two samples is placed between them.
SAMPLE_COUNTERS = ("link_downed",)

# re.ASCII: \d must not accept other scripts' digits (int() would read them)
_STATE_RE = re.compile(r"(\d{1,3}): ?([A-Za-z<][A-Za-z _>]{0,40})", re.ASCII)
_RATE_RE = re.compile(r"(\d{1,5}(?:\.\d{1,3})?) Gb/sec(?: \((\d{1,2})X ([A-Za-z0-9]{2,8})\))?", re.ASCII)
_COUNTER_RE = re.compile(r"\d{1,20}", re.ASCII)
_MAX_TEXT = 80


class IbAttrError(HwFailure):
    """A port attribute whose text is not what the kernel writes (garbage, truncated)."""


@dataclass(frozen=True)
class PortState:
    code: int
    name: str

    def __str__(self) -> str:
        return f"{self.code}: {self.name}"


@dataclass(frozen=True)
class LinkRate:
    gbps: float
    lanes: int | None = None
    speed: str | None = None  # SDR, DDR, QDR, FDR10, FDR, EDR, HDR, NDR, XDR

    def __str__(self) -> str:
        if self.lanes is None:
            return f"{self.gbps:g} Gb/sec"
        return f"{self.gbps:g} Gb/sec ({self.lanes}X {self.speed})"


@dataclass(frozen=True)
class IbPort:
    """One port as read now. ``rate`` is None when it could not be read (see ``errors``)."""

    device: str
    port: int
    state: PortState
    phys_state: PortState
    link_layer: str
    rate: LinkRate | None
    counters: Mapping[str, int] = field(default_factory=dict)
    # attribute -> why it could not be read (rate, link_layer or a counter)
    errors: Mapping[str, str] = field(default_factory=dict)
    # False for a state-only sample: rate and link_layer were not read (see read_port)
    complete: bool = True

    @property
    def up(self) -> bool:
        return self.state.code == STATE_ACTIVE and self.phys_state.code == PHYS_LINK_UP

    @property
    def is_infiniband(self) -> bool:
        return self.link_layer == "InfiniBand"

    def saturated(self) -> list[str]:
        return [n for n, v in self.counters.items() if is_saturated(n, v)]


def is_saturated(counter: str, value: int) -> bool:
    width = COUNTER_WIDTH_BITS.get(counter)
    return width is not None and value >= (1 << width) - 1


def _garbage(what: str, text: str, call: str, component: str) -> IbAttrError:
    return IbAttrError(f"{what}: unexpected text {text[:_MAX_TEXT]!r}", call=call, component=component)


def parse_state(text: str, *, names: Mapping[int, str] = STATE_NAMES, call: str = "parse_state",
                component: str = "node") -> PortState:
    """``"4: ACTIVE"`` -> PortState(4, "ACTIVE"); with ``names=PHYS_STATE_NAMES`` phys_state's
    ``"5: LinkUp"``. A known code printed with another name is garbage, not a reading: the
    kernel prints the name from the code, so a mismatch means the text was mangled."""
    m = _STATE_RE.fullmatch(text.strip())
    if m is None:
        raise _garbage("port state", text, call, component)
    code, name = int(m.group(1)), m.group(2).strip()
    expected = names.get(code)
    if expected is not None and name.lower() != expected.lower():
        raise _garbage("port state", text, call, component)
    return PortState(code, name)


def parse_rate(text: str, *, call: str = "parse_rate", component: str = "node") -> LinkRate:
    """``"400 Gb/sec (4X NDR)"`` -> LinkRate(400.0, 4, "NDR")."""
    m = _RATE_RE.fullmatch(text.strip())
    if m is None:
        raise _garbage("link rate", text, call, component)
    lanes = int(m.group(2)) if m.group(2) else None
    if lanes == 0:
        raise _garbage("link rate", text, call, component)
    return LinkRate(float(m.group(1)), lanes, m.group(3))


def parse_counter(text: str, *, call: str = "parse_counter", component: str = "node") -> int:
    """A port counter: one unsigned decimal number, nothing else."""
    stripped = text.strip()
    if _COUNTER_RE.fullmatch(stripped) is None:
        raise _garbage("counter", text, call, component)
    return int(stripped)


def parse_link_layer(text: str, *, call: str = "parse_link_layer", component: str = "node") -> str:
    stripped = text.strip()
    if stripped not in ("InfiniBand", "Ethernet"):
        raise _garbage("link layer", text, call, component)
    return stripped


def list_devices(fs: HostFs) -> list[str]:
    return fs.listdir(CLASS_DIR)


def list_ports(fs: HostFs, device: str) -> list[int]:
    """Port numbers of ``device``; IbAttrError when the folder holds something else."""
    names = fs.listdir(f"{CLASS_DIR}/{device}/ports")
    ports: list[int] = []
    for name in names:
        if not (name.isascii() and name.isdigit()) or not 0 < int(name) < 256:
            raise _garbage(f"{device} port folder name", name, f"listdir({CLASS_DIR}/{device}/ports)",
                           "node")
        ports.append(int(name))
    return sorted(ports)


def component_for(device: str, port: int) -> str | None:
    """The finding component of a port, or None when the device name cannot be one."""
    name = ib_component(device, port)
    return name if is_component(name) else None


def read_port(fs: HostFs, device: str, port: int, counters: Iterable[str] = WATCHED_COUNTERS, *,
              details: bool = True) -> IbPort:
    """Read one port. State and phys_state must parse (else the HwCondition is raised);
    rate, link_layer and counters that cannot be read are listed in ``errors``.

    ``details=False`` is a state-only sample (state, phys_state and ``counters``, e.g.
    SAMPLE_COUNTERS): every file read is a bounded call handed to a worker thread,
    and a check sampling nine ports every second should not pay for a rate that only
    changes when the link retrains."""
    base = f"{CLASS_DIR}/{device}/ports/{port}"
    comp = component_for(device, port) or "node"
    counters = list(counters)
    texts = fs.read_many([f"{base}/{a}" for a in _attrs(counters, details)], comp)
    return _parse_port(device, port, base, comp, texts, counters, details)


def read_ports(fs: HostFs, ports: Iterable[tuple[str, int, bool]],
               counters: Iterable[str] = WATCHED_COUNTERS,
               sample_counters: Iterable[str] = SAMPLE_COUNTERS
               ) -> dict[tuple[str, int], IbPort | HwCondition]:
    """Several ports, each ``(device, port, details)``, in ONE bounded call (a sampler reading
    every port every second pays one hand-off to the worker thread, not one per port):
    ``details`` True reads as ``read_port(fs, device, port, counters)``, False as
    ``read_port(fs, device, port, sample_counters, details=False)``. Each port maps to its
    IbPort, or to the HwCondition ``read_port`` would raise (NotSupported: its folder or
    state file is gone); a read that hangs is ``HwTimeout`` for its port and the ports
    after it, and the ports read before it keep their readings."""
    full, sample = list(counters), list(sample_counters)
    plan: list[tuple[str, int, str, str, list[str], bool]] = []
    rels: list[str] = []
    comps: dict[str, str] = {}
    for device, port, details in ports:
        base = f"{CLASS_DIR}/{device}/ports/{port}"
        comp = component_for(device, port) or "node"
        names = full if details else sample
        plan.append((device, port, base, comp, names, details))
        for attr in _attrs(names, details):
            rel = f"{base}/{attr}"
            rels.append(rel)
            comps[rel] = comp
    if not rels:
        return {}
    texts = fs.read_batch(rels, comps, label=f"read({CLASS_DIR}: {len(plan)} ports, {len(rels)} files)")
    out: dict[tuple[str, int], IbPort | HwCondition] = {}
    for device, port, base, comp, names, details in plan:
        try:
            out[(device, port)] = _parse_port(device, port, base, comp, texts, names, details)
        except HwCondition as cond:
            out[(device, port)] = cond
    return out


def _attrs(counters: list[str], details: bool) -> list[str]:
    return ["state", "phys_state", *(["rate", "link_layer"] if details else []),
            *(f"counters/{name}" for name in counters)]


def _parse_port(device: str, port: int, base: str, comp: str, texts: Mapping[str, str | HwCondition],
                counters: list[str], details: bool) -> IbPort:
    for attr in _attrs(counters, details):
        # a hung read is the port's condition (as when read_many's bounded call raises it),
        # never one unreadable attribute among others
        value = texts[f"{base}/{attr}"]
        if isinstance(value, HwTimeout):
            raise value

    def text(attr: str) -> str:
        value = texts[f"{base}/{attr}"]
        if isinstance(value, HwCondition):
            raise value
        return value

    state = parse_state(text("state"), call=f"read({base}/state)", component=comp)
    phys = parse_state(text("phys_state"), names=PHYS_STATE_NAMES, call=f"read({base}/phys_state)",
                       component=comp)
    errors: dict[str, str] = {}
    rate: LinkRate | None = None
    link_layer = "unknown"
    if details:
        try:
            rate = parse_rate(text("rate"), call=f"read({base}/rate)", component=comp)
        except HwCondition as cond:
            errors["rate"] = str(cond)
        try:
            link_layer = parse_link_layer(text("link_layer"), call=f"read({base}/link_layer)",
                                          component=comp)
        except HwCondition as cond:
            errors["link_layer"] = str(cond)
    values: dict[str, int] = {}
    for name in counters:
        try:
            values[name] = parse_counter(text(f"counters/{name}"), call=f"read({base}/counters/{name})",
                                         component=comp)
        except HwCondition as cond:
            errors[f"counters/{name}"] = str(cond)
    return IbPort(device, port, state, phys, link_layer, rate, values, errors, complete=details)
