"""NVIDIA driver events from kernel records: Xid, SXid, fallen-off-the-bus, GPU identity.

Line formats are those of reference/xid-catalog.md "Kernel log line formats",
each checked against a real capture in tests/data/kmsg-xid (see SOURCES.md
there). The parser is forgiving on purpose: a line that says "Xid" but is
damaged (a redacted ``PCI:...``, a truncated paste) still yields whatever parsed
and is counted in ``unparsed_nvrm_lines``; nothing here raises on bad input.

PCI ids are always reported in one canonical form, ``dddd:bb:dd.f`` lower-case
(:func:`canonical_pci`), because the driver prints three different ones: Xid
lines drop the function (``0000:38:00``), NVSwitch and fallen-off lines keep it
(``0000:06:00.0``), and NVML uses an 8-digit domain (``00000000:18:00.0``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from gpumon.hw.kmsg_lines import records_from_bytes
from gpumon.hw.kmsg_record import KernelRecord

__all__ = [
    "FallenOffBus",
    "GpuIdentity",
    "NvrmEvent",
    "NvrmParser",
    "SXidEvent",
    "XidEvent",
    "canonical_pci",
    "parse_file",
]

_PCI_RE = re.compile(
    r"\s*(?:PCI:)?(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?\s*"
)


@functools.lru_cache(maxsize=1024)
def canonical_pci(s: str) -> str | None:
    """``0000:38:00`` / ``00000000:18:00.0`` / ``PCI:0008:01:00`` -> ``dddd:bb:dd.f``; garbage -> None.

    A missing domain means 0000 and a missing function means .0 (Xid lines name
    the device, and every NVIDIA GPU is function 0). Cached: a node has a few dozen bus
    ids, and an Xid storm names the same one thousands of times a second (the cache is
    bounded: the text comes from the kernel log).
    """
    m = _PCI_RE.fullmatch(s)
    if m is None:
        return None
    domain = int(m.group(1), 16) if m.group(1) else 0
    device = int(m.group(3), 16)
    if device > 0x1F:
        return None
    function = int(m.group(4)) if m.group(4) else 0
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{device:02x}.{function}"


@dataclass(slots=True)
class XidEvent:
    """``NVRM: Xid (PCI:...): <code>, [pid=..., ][name=..., ]<message>``.

    ``pid``/``process`` are None when the driver printed ``<unknown>`` or an
    older driver printed no such field. Detail fields are filled only for the
    codes that carry them:

    * 144..150 (NVLink5): ``nvlink_unit`` (``RLW_RXPIPE``), ``nvlink_fatal``
      (the Fatal/Nonfatal word), ``nvlink_link`` (-1 = not link-specific) and
      ``nvlink_words`` (the six error-status words; empty when redacted).
    * 74 (NVLink, pre-Blackwell): ``nvlink_link`` and ``register_words`` (seven).
    * 45: ``cause_xid`` from "caused by previous Xid N".
    * 154: ``recovery_from``/``recovery_to`` as (value, name), e.g. (0x4, "Drain and Reset").

    The events here are not frozen (as ``KernelRecord``): a frozen dataclass costs 3x to
    build, per Xid of a storm; nothing changes or hashes an event once made.
    """

    code: int
    pci: str | None
    pid: int | None
    process: str | None
    message: str
    record: KernelRecord
    nvlink_unit: str | None = None
    nvlink_fatal: bool | None = None
    nvlink_link: int | None = None
    nvlink_words: tuple[int, ...] = ()
    cause_xid: int | None = None
    recovery_from: tuple[int, str] | None = None
    recovery_to: tuple[int, str] | None = None
    register_words: tuple[int, ...] = ()
    # the same line (same text) logged this many times within a second, counted instead of
    # handed over one by one (the daemon's pump does it for a check that reads ``repeats``:
    # gpumon.check.KernelLogNeeds.repeats); ``last_record`` is the last of them. 1 and None:
    # the event is the line ``record`` alone.
    repeats: int = 1
    last_record: KernelRecord | None = None


@dataclass(slots=True)
class SXidEvent:
    """``nvidia-nvswitchN: SXid (PCI:...): <code>, <message>``, one per line.

    One NVSwitch error prints several lines with the same code ("Fatal, Link
    48 ...", "Severity 1 Engine instance ...", "Data {...}"); only the first
    says fatal/non-fatal and names the link, the others have ``fatal`` and
    ``link`` None. ``message`` is everything after the code.
    """

    switch: int
    pci: str | None
    code: int
    fatal: bool | None
    link: int | None
    message: str
    record: KernelRecord


@dataclass(slots=True)
class FallenOffBus:
    """The GPU stopped answering on PCIe, reported without (or besides) an Xid 79 line.

    Newer drivers print only the multi-line "The NVIDIA GPU ... has fallen off
    the bus" block (NVIDIA/NVSentinel#155); treat it like Xid 79. Where the
    driver also printed Xid 79 both events are produced; de-duplicate by pci.
    """

    pci: str
    record: KernelRecord


@dataclass(slots=True)
class GpuIdentity:
    """PCI id to UUID/serial, from ``GPU at PCI:...: GPU-<uuid>`` (+ ``GPU Board Serial Number``)
    or ``GPU <pci>: GPU serial number is N``. ``uuid`` is None when it was
    redacted or not printed."""

    pci: str
    uuid: str | None
    serial: str | None
    record: KernelRecord


NvrmEvent: TypeAlias = XidEvent | SXidEvent | FallenOffBus | GpuIdentity

_XID_RE = re.compile(r"Xid \(([^)]*)\):\s*(\d{1,9})\b,?\s*")
_PID_RE = re.compile(r"pid=([^,]*)(?:,\s*|$)")
_NAME_RE = re.compile(r"name=([^,]*)(?:,\s*|$)")
_NVL5_RE = re.compile(
    r"(\S+)\s+(?i:(link\s+)?(fatal)|non-?fatal)\s+(?:XC\d+\s+)?(?:i\d+\s+)?Link\s+(-?\d{1,6})\s*(?:\(([^)]*)\))?"
)
_HEX_WORD_RE = re.compile(r"0x([0-9a-fA-F]{1,16})")
_CAUSE_RE = re.compile(r"caused by previous Xid (\d{1,9})")
# Names are bounded: an unbounded [^)]* rescans the rest of the line from every "from".
_RECOVERY_RE = re.compile(
    r"from (0x[0-9a-fA-F]{1,8}) \(([^)]{0,80})\) to (0x[0-9a-fA-F]{1,8}) \(([^)]{0,80})\)"
)
_XID74_LINK_RE = re.compile(r"\blink\s+(\d{1,6})", re.IGNORECASE)
# One way to match each separator: nested optional whitespace would backtrack
# exponentially on an unterminated list.
_XID74_WORDS_RE = re.compile(r"\(\s*(0x[0-9a-fA-F]{1,16}(?:(?:\s*,\s*|\s+)0x[0-9a-fA-F]{1,16})*)\s*\)")
_SXID_RE = re.compile(r"nvidia-nvswitch(\d{1,6}): SXid \(([^)]*)\):\s*(\d{1,9})\b,?\s*")
_SXID_SEV_RE = re.compile(r"(?i:(fatal)|non-?fatal)(?:,\s*Link\s+(-?\d{1,6}))?")
_GPU_AT_RE = re.compile(r"GPU at PCI:([0-9a-fA-F:.]+?):\s+(\S+)")
_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_BOARD_SERIAL_RE = re.compile(r"GPU Board Serial Number:\s*(\S+)")
_SERIAL_IS_RE = re.compile(r"GPU ([0-9a-fA-F:.]+): GPU serial number is (\S+?)\.?$")
# The PCI domain is optional: gpud's tests carry "GPU 18:00.0: GPU has fallen off the bus." (bus and
# device only), which canonical_pci reads as domain 0000 like an Xid line's "0000:18:00".
_FOB_BDF = r"((?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?)"
_FOB_HEAD_RE = re.compile(r"The NVIDIA GPU " + _FOB_BDF)
_FOB_SINGLE_RE = re.compile(r"GPU (?:at )?(?:PCI:)?" + _FOB_BDF + r":? (?:GPU )?has fallen off the bus")
_FALLEN = "fallen off the bus"
# What an Xid line's text parses to, by that text: a storm repeats the same few lines thousands of
# times a second, and the regexes below cost ~2 us a line. Bounded (the text comes from the
# kernel log): emptied when full.
_XID_MEMO: dict[str, tuple[tuple[object, ...], bool] | None] = {}
_XID_MEMO_MAX = 4096
# A whole record's text -> its _XID_MEMO entry, for a one-line NVRM Xid record that the parser
# takes straight to _xid when no block is pending (the lines of an Xid storm): one lookup per
# record instead of the prefilter, the find and the dispatch on the line's start. Bounded as
# _XID_MEMO.
_XID_TEXT_MEMO: dict[str, tuple[tuple[object, ...], bool]] = {}


def _pid(value: str) -> int | None:
    value = value.strip().strip("'\"")
    # isdecimal, not isdigit: "²" is a digit that int() rejects
    return int(value) if value.isdecimal() and len(value) < 12 else None


def _process(value: str) -> str | None:
    value = value.strip()
    return None if not value or (value.startswith("<") and value.endswith(">")) else value


class NvrmParser:
    """Stateful only to join multi-line blocks (identity + serial, fallen-off-the-bus).

    A block cut short by an unrelated line is emitted with what it has (an
    identity without serial) or dropped (a fallen-off block that never said
    "fallen off the bus"). Call :meth:`flush` at end of input, or when the log
    goes quiet, to emit a block still waiting for its next line.
    """

    def __init__(self) -> None:
        self.unparsed_nvrm_lines = 0
        self._ident: GpuIdentity | None = None
        self._fob: tuple[str, KernelRecord] | None = None

    def feed(self, record: KernelRecord) -> list[NvrmEvent]:
        text = record.text
        out: list[NvrmEvent] = []
        idle = self._ident is None and self._fob is None
        if idle:
            memo = _XID_TEXT_MEMO.get(text)
            if memo is not None:
                self._xid_event(memo, record, out)
                return out
            if "NVRM" not in text and "nvswitch" not in text:
                return out
        if "\n" in text:  # one /dev/kmsg record holding a multi-line printk
            for line in text.split("\n"):
                self._line(line.strip(), record, out)
        else:
            self._line(text, record, out)
            if idle:
                self._remember(text)
        return out

    @staticmethod
    def _remember(text: str) -> None:
        """Keep in _XID_TEXT_MEMO what a one-line record's text parsed to, when _line took it
        straight to _xid (no block pending: what feed's lookup stands for)."""
        at = text.find("NVRM:")
        if at < 0:
            return
        body = text[at + 5 :].lstrip()
        if not body.startswith("Xid"):
            return
        memo = _XID_MEMO.get(body)
        if memo is None:
            return
        if len(_XID_TEXT_MEMO) >= _XID_MEMO_MAX:
            _XID_TEXT_MEMO.clear()
        _XID_TEXT_MEMO[text] = memo

    def flush(self) -> list[NvrmEvent]:
        out: list[NvrmEvent] = []
        if self._ident is not None:
            out.append(self._ident)
            self._ident = None
        self._fob = None
        return out

    # -- one line -------------------------------------------------------------

    def _line(self, line: str, record: KernelRecord, out: list[NvrmEvent]) -> None:
        at = line.find("NVRM:")
        if at < 0:
            self._cut(out)
            if "nvswitch" in line:
                self._sxid(line, record, out)
            return
        body = line[at + 5 :].lstrip()

        if self._ident is not None:
            serial = _BOARD_SERIAL_RE.match(body)
            ident, self._ident = self._ident, None
            if serial is not None:
                out.append(GpuIdentity(ident.pci, ident.uuid, serial.group(1), ident.record))
                return
            out.append(ident)
        if self._fob is not None:
            fob_pci, head = self._fob
            if _FALLEN in body:
                self._fob = None
                out.append(FallenOffBus(fob_pci, head))
                return
            if body.startswith("(PCI ID") or "installed in this system" in body:
                return
            self._fob = None

        if body.startswith("Xid"):
            self._xid(body, record, out)
        elif body.startswith("GPU at PCI:"):
            m = _GPU_AT_RE.match(body)
            pci = canonical_pci(m.group(1)) if m is not None else None
            if m is not None and pci is not None:
                uuid = m.group(2) if _UUID_RE.fullmatch(m.group(2)) else None
                self._ident = GpuIdentity(pci, uuid, None, record)
        elif body.startswith("The NVIDIA GPU "):
            m = _FOB_HEAD_RE.match(body)
            pci = canonical_pci(m.group(1)) if m is not None else None
            if pci is not None:
                if _FALLEN in body:  # the block joined onto one line by a log shipper
                    out.append(FallenOffBus(pci, record))
                else:
                    self._fob = (pci, record)
        elif body.startswith("GPU "):
            if _FALLEN in body:
                m = _FOB_SINGLE_RE.match(body)
                pci = canonical_pci(m.group(1)) if m is not None else None
                if pci is not None:
                    out.append(FallenOffBus(pci, record))
            elif "serial number is" in body:
                m = _SERIAL_IS_RE.match(body)
                pci = canonical_pci(m.group(1)) if m is not None else None
                if m is not None and pci is not None:
                    out.append(GpuIdentity(pci, None, m.group(2), record))
        elif "Xid (" in body:  # an NVRM line with the Xid further in: damaged, but try
            self._xid(body[body.index("Xid (") :], record, out)

    def _cut(self, out: list[NvrmEvent]) -> None:
        if self._ident is not None:
            out.append(self._ident)
            self._ident = None
        self._fob = None

    def _xid(self, body: str, record: KernelRecord, out: list[NvrmEvent]) -> None:
        try:
            memo = _XID_MEMO[body]
        except KeyError:
            memo = _xid_fields(body)
            if len(_XID_MEMO) >= _XID_MEMO_MAX:
                _XID_MEMO.clear()
            _XID_MEMO[body] = memo
        if memo is None:
            if body.startswith("Xid ("):
                self.unparsed_nvrm_lines += 1
            return
        self._xid_event(memo, record, out)

    def _xid_event(self, memo: tuple[tuple[object, ...], bool], record: KernelRecord,
                   out: list[NvrmEvent]) -> None:
        f, damaged = memo
        if damaged:
            self.unparsed_nvrm_lines += 1
        # by position, in field order (code, pci, pid, process, message, record, nvlink_unit,
        # nvlink_fatal, nvlink_link, nvlink_words, cause_xid, recovery_from, recovery_to,
        # register_words): 0.44 us against 1.17 us by keyword, once per line of an Xid storm
        out.append(XidEvent(f[0], f[1], f[2], f[3], f[4], record, f[5], f[6], f[7], f[8],  # type: ignore[arg-type]
                            f[9], f[10], f[11], f[12]))  # type: ignore[arg-type]

    def _sxid(self, line: str, record: KernelRecord, out: list[NvrmEvent]) -> None:
        at = line.find("nvidia-nvswitch")
        if at < 0 or "SXid" not in line:
            return
        m = _SXID_RE.match(line, at)
        if m is None:
            self.unparsed_nvrm_lines += 1
            return
        pci = canonical_pci(m.group(2))
        if pci is None:
            self.unparsed_nvrm_lines += 1
        message = line[m.end() :].rstrip()
        fatal: bool | None = None
        link: int | None = None
        sev = _SXID_SEV_RE.match(message)
        if sev is not None:
            fatal = sev.group(1) is not None
            link = int(sev.group(2)) if sev.group(2) is not None else None
        out.append(SXidEvent(int(m.group(1)), pci, int(m.group(3)), fatal, link, message, record))


def _xid_fields(body: str) -> tuple[tuple[object, ...], bool] | None:
    """An Xid line's fields but its record (XidEvent's order, ``record`` left out) and whether
    the line was damaged; None: not an Xid line."""
    m = _XID_RE.match(body)
    if m is None:
        return None
    damaged = False
    pci = canonical_pci(m.group(1))
    if pci is None:
        damaged = True  # e.g. a reporter's "PCI:..." redaction; the code is still worth having
    code = int(m.group(2))
    rest = body[m.end() :]
    pid: int | None = None
    process: str | None = None
    if rest.startswith("pid="):
        p = _PID_RE.match(rest)
        if p is not None:
            pid = _pid(p.group(1))
            rest = rest[p.end() :]
    if rest.startswith("name="):
        n = _NAME_RE.match(rest)
        if n is not None:
            process = _process(n.group(1))
            rest = rest[n.end() :]
    message = rest.rstrip()

    unit: str | None = None
    fatal: bool | None = None
    link: int | None = None
    words: tuple[int, ...] = ()
    cause: int | None = None
    rec_from: tuple[int, str] | None = None
    rec_to: tuple[int, str] | None = None
    registers: tuple[int, ...] = ()
    if 144 <= code <= 150:
        d = _NVL5_RE.match(message)
        if d is None:
            damaged = True
        else:
            unit = d.group(1)
            fatal = d.group(3) is not None
            link = int(d.group(4))
            if d.group(5) is not None:
                words = tuple(int(w, 16) for w in _HEX_WORD_RE.findall(d.group(5)))
    elif code == 45:
        c = _CAUSE_RE.search(message)
        if c is not None:
            cause = int(c.group(1))
    elif code == 154:
        r = _RECOVERY_RE.search(message)
        if r is None:
            damaged = True
        else:
            rec_from = (int(r.group(1), 16), r.group(2))
            rec_to = (int(r.group(3), 16), r.group(4))
    elif code == 74:
        lk = _XID74_LINK_RE.search(message)
        if lk is not None:
            link = int(lk.group(1))
        w = _XID74_WORDS_RE.search(message)
        if w is not None:
            registers = tuple(int(x, 16) for x in _HEX_WORD_RE.findall(w.group(1)))
    return (code, pci, pid, process, message, unit, fatal, link, words, cause, rec_from, rec_to,
            registers), damaged


def parse_file(path: Path | str) -> list[NvrmEvent]:
    """All NVIDIA events in a saved log (every boot in it; no boot filtering)."""
    parser = NvrmParser()
    events: list[NvrmEvent] = []
    for record in records_from_bytes(Path(path).read_bytes()):
        events.extend(parser.feed(record))
    events.extend(parser.flush())
    return events
