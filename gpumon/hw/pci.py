"""PCI functions of the host: identity, place in the tree, AER counters, link state.

Everything is read from ``<host-root>/sys/bus/pci/devices/<bdf>`` through
``HostFs`` (bounded reads). Each entry there is a symlink into
``sys/devices/pci<domain>:<bus>/.../<bdf>``; every path component that looks
like a bus/device/function id is an ancestor (root port, switch ports). The
links are resolved here, and a link that leads outside the host root is
refused: the host root may be a container mount, and nothing under it may
send gpumon to read the container's own files.

AER counters (Documentation/ABI/testing/sysfs-bus-pci-devices-aer, kernel
>= 4.19; printed by drivers/pci/pcie/aer.c ``aer_stats_dev_attr``) are files
of ``NAME COUNT`` lines closed by ``TOTAL_ERR_COR N`` / ``TOTAL_ERR_NONFATAL N``
/ ``TOTAL_ERR_FATAL N``. Names are the kernel's bit names ("RxErr", "BadTLP";
4.19-era kernels printed "Receiver Error", "RELAY_NUM Rollover", so a name
may contain spaces: the count is the last field), or ``<array>_bit[N]`` for a
bit without a name. The files exist only on AER-capable devices.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpumon.errors import HwCondition, HwFailure, NotSupported
from gpumon.hw.hostfs import HostFs
from gpumon.model import pci as pci_component

PCI_DEVICES = "sys/bus/pci/devices"
INFINIBAND = "sys/class/infiniband"

NVIDIA = "0x10de"
MELLANOX = "0x15b3"

_BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_VENDOR_RE = re.compile(r"^0x[0-9a-f]{4}$")
_CLASS_RE = re.compile(r"^0x[0-9a-f]{6}$")

AerKind = Literal["correctable", "nonfatal", "fatal"]
# file name and closing total line of each AER counter file
AER_FILES: dict[AerKind, tuple[str, str]] = {
    "correctable": ("aer_dev_correctable", "TOTAL_ERR_COR"),
    "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
    "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL"),
}

# GT/s per lane -> PCIe generation (PCI-SIG base specifications 1.0 .. 7.0)
GENERATIONS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}

Role = Literal["root_port", "switch_upstream", "switch_downstream", "bridge", "endpoint", "integrated"]


def is_bdf(name: str) -> bool:
    return bool(_BDF_RE.match(name))


# --------------------------------------------------------------------------- identity and tree


@dataclass(frozen=True)
class PciFunction:
    bdf: str
    path: str  # the resolved device directory, relative to the host root
    vendor: str
    device: str
    pci_class: str
    # bus/device/function ids on the way from the root port down to the parent
    ancestors: tuple[str, ...] = ()
    # an SR-IOV virtual function (it has a ``physfn`` link): no link or AER of its own
    virtual: bool = False

    @property
    def parent(self) -> str | None:
        return self.ancestors[-1] if self.ancestors else None

    @property
    def is_bridge(self) -> bool:
        return self.pci_class.startswith("0x0604")

    @property
    def is_nvidia_gpu(self) -> bool:
        # 0x0300xx VGA controller, 0x0302xx 3D controller (datacenter GPUs)
        return self.vendor == NVIDIA and self.pci_class[:6] in ("0x0300", "0x0302")

    @property
    def is_nvswitch(self) -> bool:
        # NVSwitches enumerate as "other bridge" (0x0680) with NVIDIA's vendor id
        return self.vendor == NVIDIA and self.pci_class.startswith("0x0680")

    @property
    def is_mellanox_nic(self) -> bool:
        # network controller (0x02xxxx: Ethernet 0x0200, InfiniBand 0x0207) or the
        # InfiniBand serial-bus class 0x0c06 older HCAs use
        return self.vendor == MELLANOX and (self.pci_class.startswith("0x02")
                                             or self.pci_class.startswith("0x0c06"))


@dataclass
class PciScan:
    """The functions a health check cares about, and those that could not be read.

    ``functions`` holds NVIDIA and Mellanox functions, any others asked for, and every
    listed port above them; ``listed`` counts every entry of sys/bus/pci/devices.
    """

    functions: dict[str, PciFunction] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    listed: int = 0

    def role(self, bdf: str) -> Role:
        """Which way the function's own link faces, from its place in the tree.

        sysfs does not say which kind of port a bridge is, but PCIe alternates
        them: a bridge with no bridge above it is a root port; below a root
        port or a switch downstream port sits an upstream port (or an
        endpoint); below an upstream port sit downstream ports.
        """
        fn = self.functions[bdf]
        if not fn.is_bridge:
            return "endpoint" if fn.ancestors else "integrated"
        if fn.parent is None:
            return "root_port"
        parent = self.functions.get(fn.parent)
        if parent is None or not parent.is_bridge:
            return "bridge"
        above = self.role(parent.bdf)
        if above in ("root_port", "switch_downstream"):
            return "switch_upstream"
        if above == "switch_upstream":
            return "switch_downstream"
        return "bridge"

    def link_partner(self, bdf: str) -> str | None:
        """The downstream-facing port at the other end of this function's upstream link.

        None when the function's own link faces down (root port, switch
        downstream port), when it has none, or when the port above is not listed.
        """
        role = self.role(bdf)
        parent = self.functions[bdf].parent
        if role not in ("endpoint", "switch_upstream") or parent not in self.functions:
            return None
        return parent if self.role(parent) in ("root_port", "switch_downstream") else None

    def below(self, bdf: str) -> Iterator[PciFunction]:
        for fn in self.functions.values():
            if bdf in fn.ancestors:
                yield fn


def _inside(root: str, target: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def resolve(fs: HostFs, rel: str, component: str = "node") -> str:
    """``rel`` with every symlink resolved, relative to the host root; refused if it leaves it."""
    root = os.path.realpath(fs.root)
    target = os.path.realpath(fs.path(rel))
    call = f"resolve({rel})"
    if not _inside(root, target):
        raise HwFailure(f"{rel} leads to {target}, outside the host root {root}: refused",
                        call=call, component=component)
    if not os.path.exists(target):
        raise NotSupported(f"{rel} leads to {target}, which does not exist", call=call, component=component)
    return os.path.relpath(target, root)


def _attr(fs: HostFs, path: str, name: str, component: str) -> str:
    rel = f"{path}/{name}"
    if os.path.islink(fs.path(rel)):
        rel = resolve(fs, rel, component)
    return fs.read_text(rel, component)


def _attrs(fs: HostFs, path: str, names: list[str], component: str) -> dict[str, str | HwCondition]:
    """Several attributes of one function in one bounded call (symlinked ones resolved one by one)."""
    out: dict[str, str | HwCondition] = {}
    plain = [n for n in names if not os.path.islink(fs.path(f"{path}/{n}"))]
    for name in names:
        if name not in plain:
            try:
                out[name] = _attr(fs, path, name, component)
            except HwCondition as cond:
                out[name] = cond
    if plain:
        texts = fs.read_many([f"{path}/{n}" for n in plain], component)
        out.update({n: texts[f"{path}/{n}"] for n in plain})
    return out


def _id(fs: HostFs, path: str, name: str, pattern: re.Pattern[str], component: str) -> str:
    text = _attr(fs, path, name, component).lower()
    if not pattern.match(text):
        raise HwFailure(f"{path}/{name}: expected a hex id, read {text[:40]!r}", call=f"read({path}/{name})",
                        component=component)
    return text


def _device_path(fs: HostFs, bdf: str) -> str:
    comp = pci_component(bdf)
    path = resolve(fs, f"{PCI_DEVICES}/{bdf}", comp)
    if os.path.basename(path) != bdf:
        raise HwFailure(f"{PCI_DEVICES}/{bdf} leads to {path}, not to a directory named {bdf}",
                        call=f"resolve({PCI_DEVICES}/{bdf})", component=comp)
    return path


def _function(fs: HostFs, bdf: str, path: str, vendor: str) -> PciFunction:
    comp = pci_component(bdf)
    return PciFunction(
        bdf=bdf, path=path, vendor=vendor,
        device=_id(fs, path, "device", _VENDOR_RE, comp),
        pci_class=_id(fs, path, "class", _CLASS_RE, comp),
        ancestors=tuple(p for p in path.split(os.sep)[:-1] if is_bdf(p)),
        virtual=os.path.lexists(fs.path(f"{path}/physfn")),
    )


def read_function(fs: HostFs, bdf: str) -> PciFunction:
    path = _device_path(fs, bdf)
    return _function(fs, bdf, path, _id(fs, path, "vendor", _VENDOR_RE, pci_component(bdf)))


def scan(fs: HostFs, extra: Collection[str] = ()) -> PciScan:
    """NVIDIA and Mellanox functions, those in ``extra``, and the ports above them.

    Only the vendor of every other function is read: an HGX node lists some 500
    functions, most of them CPU uncore devices. One that cannot be read at all is
    named in ``errors``, never dropped.
    """
    out = PciScan()
    found: dict[str, tuple[str, str]] = {}
    for name in fs.listdir(PCI_DEVICES):
        bdf = name.lower()
        if not is_bdf(bdf):
            continue
        out.listed += 1
        try:
            path = _device_path(fs, name)
            found[bdf] = (path, _id(fs, path, "vendor", _VENDOR_RE, pci_component(bdf)))
        except HwCondition as cond:
            out.errors[bdf] = f"{cond.call}: {cond}"
    wanted = {b for b, (_, vendor) in found.items() if vendor in (NVIDIA, MELLANOX)}
    wanted |= set(extra) & set(found)
    for bdf in list(wanted):
        wanted.update(p for p in found[bdf][0].split(os.sep)[:-1] if p in found)
    for bdf in sorted(wanted):
        path, vendor = found[bdf]
        try:
            out.functions[bdf] = _function(fs, bdf, path, vendor)
        except HwCondition as cond:
            out.errors[bdf] = f"{cond.call}: {cond}"
    return out


def infiniband_devices(fs: HostFs) -> tuple[dict[str, str], dict[str, str]]:
    """RDMA device name -> bus id of its PCI function, and the devices whose link could not be followed."""
    found: dict[str, str] = {}
    errors: dict[str, str] = {}
    for dev in fs.listdir(INFINIBAND):
        try:
            path = resolve(fs, f"{INFINIBAND}/{dev}/device", f"ib/{dev}/1")
        except HwCondition as cond:
            errors[dev] = str(cond)
            continue
        last = os.path.basename(path).lower()
        if is_bdf(last):
            found[dev] = last
        else:
            errors[dev] = f"{INFINIBAND}/{dev}/device leads to {path}, not to a PCI function"
    return found, errors


# --------------------------------------------------------------------------- AER counters


class AerParseError(ValueError):
    """An AER counter file that does not have the kernel's shape (garbage, truncated)."""


@dataclass(frozen=True)
class AerCounts:
    total: int
    errors: Mapping[str, int]


@dataclass(frozen=True)
class AerStats:
    correctable: AerCounts
    nonfatal: AerCounts
    fatal: AerCounts

    def of(self, kind: AerKind) -> AerCounts:
        counts: AerCounts = getattr(self, kind)
        return counts


_AER_LINE_RE = re.compile(r"^(?P<name>\S(?:.*\S)?)[ \t]+(?P<count>[0-9]{1,20})$")
_U64 = 1 << 64


def parse_aer(text: str, total_key: str) -> AerCounts:
    """One AER counter file; AerParseError unless it is whole and well formed."""
    errors: dict[str, int] = {}
    total: int | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        m = _AER_LINE_RE.match(line)
        if m is None or not line.isprintable():
            raise AerParseError(f"line {lineno}: expected 'NAME COUNT', read {line[:60]!r}")
        name, count = m.group("name"), int(m.group("count"))
        if count >= _U64:
            raise AerParseError(f"line {lineno}: {count} does not fit the kernel's 64-bit counter")
        if total is not None:
            raise AerParseError(f"line {lineno}: {line[:60]!r} after the {total_key} line")
        if name == total_key:
            total = count
        elif name.startswith("TOTAL_"):
            raise AerParseError(f"line {lineno}: {name} where {total_key} belongs")
        elif name in errors:
            raise AerParseError(f"line {lineno}: {name} twice")
        else:
            errors[name] = count
    if total is None:
        raise AerParseError(f"no {total_key} line (file empty or truncated)")
    return AerCounts(total, errors)


def read_aer(fs: HostFs, fn: PciFunction) -> AerStats | None:
    """The function's AER counters; None when it exposes none (not AER-capable, or no AER in the kernel).

    HwFailure when they are partly missing or malformed.
    """
    comp = pci_component(fn.bdf)
    texts: dict[AerKind, str] = {}
    missing: list[str] = []
    read = _attrs(fs, fn.path, [name for name, _ in AER_FILES.values()], comp)
    for kind, (name, _) in AER_FILES.items():
        value = read[name]
        if isinstance(value, NotSupported):
            missing.append(name)
        elif isinstance(value, HwCondition):
            raise value
        else:
            texts[kind] = value
    if len(missing) == len(AER_FILES):
        return None
    if missing:
        raise HwFailure(f"{fn.path}: {', '.join(missing)} missing while the other AER counter files exist",
                        call=f"read({fn.path}/aer_dev_*)", component=comp)
    parsed: dict[AerKind, AerCounts] = {}
    for kind, text in texts.items():
        name, total_key = AER_FILES[kind]
        try:
            parsed[kind] = parse_aer(text, total_key)
        except AerParseError as exc:
            raise HwFailure(f"{fn.path}/{name}: {exc}", call=f"read({fn.path}/{name})",
                            component=comp) from None
    return AerStats(parsed["correctable"], parsed["nonfatal"], parsed["fatal"])


# --------------------------------------------------------------------------- link state

_SPEED_RE = re.compile(r"^(?P<gts>[0-9]{1,3}(?:\.[0-9]{1,2})?) GT/s(?: PCIe)?$")


def parse_speed(text: str) -> float | None:
    """``32.0 GT/s PCIe`` (or the older ``8 GT/s``) -> 32.0; None for the kernel's ``Unknown``."""
    text = text.strip()
    if text.startswith("Unknown"):
        return None
    m = _SPEED_RE.match(text)
    if m is None or float(m.group("gts")) not in GENERATIONS:
        raise ValueError(f"expected a PCIe link speed like '32.0 GT/s PCIe', read {text[:40]!r}")
    return float(m.group("gts"))


def parse_width(text: str) -> int:
    text = text.strip()
    # the Link Status width field has 6 bits
    if not text.isascii() or not text.isdigit() or int(text) > 63:
        raise ValueError(f"expected a link width (0..63), read {text[:40]!r}")
    return int(text)


def generation(gts: float | None) -> int | None:
    return None if gts is None else GENERATIONS.get(gts)


@dataclass(frozen=True)
class LinkState:
    current_gts: float | None
    max_gts: float | None
    current_width: int | None
    max_width: int | None

    @property
    def current_gen(self) -> int | None:
        return generation(self.current_gts)

    @property
    def max_gen(self) -> int | None:
        return generation(self.max_gts)

    def describe(self, current: bool = True) -> str:
        gts, width = (self.current_gts, self.current_width) if current else (self.max_gts, self.max_width)
        gen = generation(gts)
        return f"{'Gen' + str(gen) if gen else 'speed unknown'} x{width if width is not None else '?'}"


def read_link(fs: HostFs, fn: PciFunction) -> LinkState | None:
    """The function's link attributes; None when it has none (not a PCIe function)."""
    comp = pci_component(fn.bdf)
    values: dict[str, float | int | None] = {}
    present = 0
    parsers = (("current_link_speed", parse_speed), ("max_link_speed", parse_speed),
               ("current_link_width", parse_width), ("max_link_width", parse_width))
    read = _attrs(fs, fn.path, [name for name, _ in parsers], comp)
    for name, parse in parsers:
        text = read[name]
        if isinstance(text, NotSupported):
            values[name] = None
            continue
        if isinstance(text, HwCondition):
            raise text
        present += 1
        try:
            values[name] = parse(text)
        except ValueError as exc:
            raise HwFailure(f"{fn.path}/{name}: {exc}", call=f"read({fn.path}/{name})",
                            component=comp) from None
    if not present:
        return None

    def speed(key: str) -> float | None:
        v = values[key]
        return None if v is None else float(v)

    def width(key: str) -> int | None:
        v = values[key]
        return None if v is None else int(v)

    return LinkState(speed("current_link_speed"), speed("max_link_speed"),
                     width("current_link_width"), width("max_link_width"))


# --------------------------------------------------------------------------- kernel AER messages

_BDF = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
# drivers/pci/pcie/aer.c aer_print_error(): "PCIe Bus Error: severity=%s, type=%s, (%s)", printed
# with the error source's dev_printk prefix ("<driver> <bdf>: "), since 5.x with "AER: " after it.
# Kernels before 4.16 printed it with the root port's prefix and "id=XXXX(Receiver ID)" naming the
# source by bus/devfn. Severity words: "Corrected", "Uncorrected (Non-Fatal)", "Uncorrected (Fatal)";
# 6.x says "Correctable" and "Uncorrectable (...)".
_HEADER_RE = re.compile(
    rf"(?P<bdf>{_BDF}):\s+(?:AER:\s+)?PCIe Bus Error: severity=(?P<severity>[A-Za-z]+(?: \([A-Za-z-]+\))?)"
    r"(?:, type=(?P<type>[^,]*))?(?:,\s*(?:id=(?P<id>[0-9a-fA-F]{4}))?\((?P<agent>[^)]*)\))?")
_STATUS_RE = re.compile(
    rf"(?P<bdf>{_BDF}):\s+(?:AER:\s+)?device \[(?P<ids>[0-9a-fA-F]{{4}}:[0-9a-fA-F]{{4}})\] "
    r"error status/mask=(?P<status>[0-9a-fA-F]{8})/(?P<mask>[0-9a-fA-F]{8})")
_BIT_RE = re.compile(rf"(?P<bdf>{_BDF}):\s+(?:AER:\s+)?\[\s*(?P<bit>[0-9]{{1,2}})\s*\]\s+(?P<name>.*?)\s*$")
# _BIT_RE from its "[" on, and its bus id alone: see _bit_line
_BIT_TAIL_RE = re.compile(r"\[\s*(?P<bit>[0-9]{1,2})\s*\]\s+(?P<name>.*?)\s*$")
_BDF_RE = re.compile(_BDF)
_SEVERITIES: dict[str, AerKind] = {
    "corrected": "correctable", "correctable": "correctable",
    "uncorrected (non-fatal)": "nonfatal", "uncorrectable (non-fatal)": "nonfatal",
    "uncorrected (fatal)": "fatal", "uncorrectable (fatal)": "fatal",
}


@dataclass(frozen=True)
class AerLogLine:
    """One kernel line of an AER report, attributed to the function whose error it is."""

    kind: Literal["header", "status", "bit"]
    bdf: str  # the error source
    reporter: str  # the device whose prefix the line carries
    severity: AerKind | None = None
    error_type: str | None = None
    ids: str | None = None  # "vendor:device" from the status line
    status: str | None = None
    mask: str | None = None
    bit: int | None = None
    name: str | None = None


def _source(reporter: str, source_id: str | None) -> str:
    """The source function named by an old-style ``id=BBDF`` (bus << 8 | devfn) in the reporter's domain."""
    if not source_id:
        return reporter
    value = int(source_id, 16)
    bus, devfn = value >> 8, value & 0xFF
    return f"{reporter[:4]}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


def parse_aer_message(text: str) -> AerLogLine | None:
    """An AER line of the kernel log (any wrapper before it), or None if the line is not one."""
    if "PCIe Bus Error" in text:
        m = _HEADER_RE.search(text)
        if m is None:
            return None
        reporter = m.group("bdf").lower()
        severity = _SEVERITIES.get(m.group("severity").lower())
        return AerLogLine("header", _source(reporter, m.group("id")), reporter, severity=severity,
                          error_type=(m.group("type") or "").strip() or None)
    if "error status/mask=" in text:
        s = _STATUS_RE.search(text)
        if s is None:
            return None
        reporter = s.group("bdf").lower()
        return AerLogLine("status", reporter, reporter, ids=s.group("ids").lower(),
                          status=s.group("status").lower(), mask=s.group("mask").lower())
    b = _bit_line(text)
    if b is None:
        return None
    reporter, bit, name = b
    first = name.endswith("(First)")
    name = name.removesuffix("(First)").strip()
    return AerLogLine("bit", reporter, reporter, bit=bit, name=f"{name} (First)" if first else name)


def _bit_line(text: str) -> tuple[str, int, str] | None:
    """What ``_BIT_RE.search(text)`` finds, as (bus id lower-case, bit, name), found from each "["
    instead: the search tried its bus-id pattern at every offset of every line that holds a "["
    (most of a kernel-log storm's cost in this module). The "[" of a match is preceded by
    exactly ``<bdf>:\\s+`` or ``<bdf>:\\s+AER:\\s+`` (no "[" in either), so the first "[" that
    has both that before it and ``_BIT_TAIL_RE`` from it gives the leftmost match. (``\\s`` and
    ``str.rstrip()`` agree on what whitespace is.)"""
    at = text.find("[")
    while at >= 0:
        tail = _BIT_TAIL_RE.match(text, at)
        if tail is not None:
            head = text[:at]
            end = len(head.rstrip())
            if 0 < end < at and head.endswith("AER:", 0, end):
                head = head[: end - 4]
                end = len(head.rstrip()) if head[-1:].isspace() else -1
            if end >= 13 and head[end - 1] == ":" and end < at:
                bdf = head[end - 13 : end - 1]
                if _BDF_RE.fullmatch(bdf) is not None:
                    return bdf.lower(), int(tail.group("bit")), tail.group("name")
        at = text.find("[", at + 1)
    return None
