"""Kernel log records: parse any wrapper seen in the wild, and follow the live log.

Two entry points:

* :func:`parse_line` turns one line (or one ``/dev/kmsg`` record) into a
  :class:`KernelRecord`. It recognises every wrapper found in the real captures
  (tests/data/kmsg-xid): raw ``/dev/kmsg`` records, ``dmesg`` (default, ``-T``,
  ``--decode``, ``--time-format=iso``, ``-r``), ``journalctl -k`` (short,
  short-precise, short-iso), rsyslog ``kern.log``, pasted ``kernel:`` lines and
  ``talosctl dmesg``. It never raises.
* :class:`KernelLogFollower` follows ``<host-root>/dev/kmsg`` (a character
  device) or a regular file (read, then followed like ``tail -F``), returning
  only records of the current boot. It needs no thread. The same class reads a
  saved log judged on purpose (``gpumon check --kmsg-file``): with no
  ``boot_time`` it keeps the file's last boot, and with ``all_boots`` every
  record in it.

Time conventions (DESIGN.md "Host root", kernel log):

* ``monotonic_us`` is the kernel's time since boot (``[ 1843.308145]`` or the
  ``/dev/kmsg`` usec field); it is the only timestamp that cannot be skewed by
  clock steps, so prefer it within one boot.
* ``wall_time`` is always timezone-aware. Wrappers that carry no offset
  (``dmesg -T``, syslog/journal ``short``) print the *local* time of the node
  that wrote them; we cannot know that zone, so we treat it as UTC (GPU nodes
  run in UTC almost universally). The syslog ``short`` form has no year: the
  year is inferred as the latest one that does not put the record more than a
  day in the future (what rsyslog/journald readers do).
* ``priority`` is the syslog *severity level* 0 (emerg) .. 7 (debug); the
  facility is dropped because only the kernel facility reaches these logs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import TracebackType

__all__ = [
    "MAX_LINE_BYTES",
    "KernelLogFollower",
    "KernelRecord",
    "parse_line",
    "records_from_bytes",
]

#: Longer lines are cut to this many bytes and counted as malformed. Kernel
#: records are at most a few KiB (CONSOLE_EXT_LOG_MAX is 8 KiB), so anything
#: this long is a corrupt or binary file, not a log line.
MAX_LINE_BYTES = 64 * 1024

# A read() on /dev/kmsg must be given a buffer that holds a whole record or it
# fails with EINVAL; 64 KiB is far above the kernel's 8 KiB record limit.
_KMSG_READ_SIZE = 64 * 1024
# A regular file is read in slices of at most this (a read() of n bytes allocates n bytes
# whatever it returns: the slice is min(what the file holds beyond our offset, this)).
_FILE_READ_SIZE = 64 * 1024
# A follower made with ``bounded=True`` (the daemon's) returns at most about this much per
# call once the first read is done, so that a backlog (a storm, a log that grew while the
# daemon was stopped) is worked through in turns of bounded memory, not one huge list.
# A turn's buffers (the chunks, their text, the joined block, the records) raise the
# allocator's heap to their peak, which stays resident: bench/storm.py at 20,000 lines/s
# peaked at 55.2 MiB RSS with these sizes against 57.0-57.2 MiB with 1 MiB reads and turns of
# 1 MiB / 5,000 records, at the same CPU (2026-12-03, 2-core Intel Xeon VM).
_TURN_BYTES = 256 * 1024
_TURN_RECORDS = 2000

# A backwards step of the monotonic clock smaller than this is printk
# reordering between CPUs (records are stamped before they are ordered), not a
# reboot. A real reboot steps back by the previous boot's whole uptime.
_MONO_RESET_US = 1_000_000

# /proc/stat btime is whole seconds and `dmesg -T` prints whole seconds, so a
# record from the first second of this boot can compare as up to 1 s early.
_BOOT_TIME_SLACK_S = 1.0

_MAX_POLL_S = 3600.0


@dataclass(slots=True)
class KernelRecord:
    """One kernel log message with every wrapper stripped.

    ``text`` is the message (``NVRM: Xid (PCI:0000:38:00): 13, ...``); it may
    contain newlines when one ``/dev/kmsg`` record carried a multi-line printk.
    ``raw`` is the input without its trailing newline. ``continuation`` marks a
    whitespace-indented line without a timestamp: the second and later lines of
    a multi-line printk as ``dmesg``/``journalctl`` print them. The follower
    gives such lines the metadata of the line they continue.

    Not frozen: a frozen dataclass sets each field through ``object.__setattr__``, which
    made building one cost 2.4 us against 0.8 us, paid for every line of a kernel-log storm.
    Nothing changes a record once made, and nothing hashes one (``dataclasses.replace``
    makes the altered copies).
    """

    text: str
    raw: str
    seq: int | None = None
    monotonic_us: int | None = None
    wall_time: datetime | None = None
    priority: int | None = None
    host: str | None = None
    continuation: bool = False


# --------------------------------------------------------------------------- parsing

_MONTHS = {
    "Jan": 1, "Feb": 2, "Mar": 3, "Apr": 4, "May": 5, "Jun": 6,
    "Jul": 7, "Aug": 8, "Sep": 9, "Oct": 10, "Nov": 11, "Dec": 12,
}  # fmt: skip
_LEVELS = {
    "emerg": 0, "alert": 1, "crit": 2, "err": 3, "error": 3,
    "warn": 4, "warning": 4, "notice": 5, "info": 6, "debug": 7,
}  # fmt: skip
_FACILITIES = r"(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])"
_MON = r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"

# prio,seq,usec,flags[,more];message  (Documentation/ABI/testing/dev-kmsg)
_KMSG_RE = re.compile(r"(\d{1,10}),(\d{1,20}),(-?\d{1,20}),[^;\n]*;")
# _KMSG_RE over a block of lines at once, each line's message captured (_Assembler's storm path:
# one findall for a whole read instead of a match and its groups per line); the first digit is
# ASCII, as the per-line path requires of a line before it tries _KMSG_RE
_KMSG_LINES_RE = re.compile(r"^([0-9]\d{0,9}),(\d{1,20}),(-?\d{1,20}),[^;\n]*;(.*)$", re.MULTILINE)
# [ 1843.308145] with an optional CONFIG_PRINTK_CALLER field [    T123]
_MONO_RE = re.compile(r"\[\s*(\d{1,12})\.(\d{1,9})\]\s?(?:\[\s*[TC]\d{1,10}\]\s?)?")
_CTIME_RE = re.compile(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) " + _MON + r" +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\]\s?"
)
_ISO_RE = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d(?::?\d\d)?)?(?:\s|$)"
)
_DECODE_RE = re.compile(_FACILITIES + r" *:(emerg|alert|crit|err|warn|notice|info|debug) *:\s?")
_SYSLOG_RE = re.compile(_MON + r" +(\d{1,2}) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))? (\S+) kernel:\s?")
_HOST_KERNEL_RE = re.compile(r"(\S+) kernel:\s?")
_TALOS_RE = re.compile(
    r"(\S+): "
    + _FACILITIES
    + r": (emerg|alert|crit|err|error|warn|warning|notice|info|debug): \[([^\]]*)\]:\s?"
)
_PRI_RE = re.compile(r"<(\d{1,3})>")
_KMSG_ESCAPE_RE = re.compile(r"\\x([0-9a-fA-F]{2})")
_JOURNAL_MARKER_RE = re.compile(
    r"-- (?:Boot [0-9a-f]+|Reboot|Logs begin at .*|Journal begins at .*|No entries) --$"
)
_BOOT_MARKER_PREFIXES = ("-- Boot ", "-- Reboot --")
_KMSG_DICT_RE = re.compile(r" [A-Z0-9_]+=")

_TZ_CACHE: dict[str, timezone] = {"Z": timezone.utc, "": timezone.utc}


def _tz(offset: str) -> timezone | None:
    tz = _TZ_CACHE.get(offset)
    if tz is not None:
        return tz
    digits = offset[1:].replace(":", "")
    try:
        minutes = int(digits[:2]) * 60 + (int(digits[2:4]) if len(digits) >= 4 else 0)
        tz = timezone(timedelta(minutes=-minutes if offset[0] == "-" else minutes))
    except ValueError:
        return None
    if len(_TZ_CACHE) < 256:  # bounded: offsets come from untrusted text
        _TZ_CACHE[offset] = tz
    return tz


def _frac_us(frac: str | None) -> int:
    # 9-digit (talos) and 8-digit (trailing zero trimmed) fractions both occur.
    if not frac:
        return 0
    return int((frac + "00000")[:6])


def _iso_datetime(m: re.Match[str]) -> datetime | None:
    frac, offset = m.group(7), m.group(8)
    if (frac is None or len(frac) == 6) and offset is not None and len(offset) == 6 and offset[3] == ":":
        # The common dmesg/journal shape; fromisoformat parses it the same on
        # every Python >= 3.7 and is ~10x cheaper than building it by hand.
        try:
            return datetime.fromisoformat(m.string[m.start() : m.end(8)].replace(",", "."))
        except ValueError:
            return None
    tz = _tz(offset or "")
    if tz is None:
        return None
    try:
        return datetime(
            int(m.group(1)), int(m.group(2)), int(m.group(3)),
            int(m.group(4)), int(m.group(5)), int(m.group(6)),
            _frac_us(frac), tzinfo=tz,
        )  # fmt: skip
    except (ValueError, OverflowError):
        return None


def _syslog_datetime(m: re.Match[str], now: datetime | None) -> datetime | None:
    ref = now if now is not None else datetime.now(timezone.utc)
    if ref.tzinfo is None:
        ref = ref.replace(tzinfo=timezone.utc)
    limit = ref + timedelta(days=1)
    # Feb 29 needs a leap year, so look back a few years before giving up.
    for year in range(ref.year, ref.year - 5, -1):
        try:
            dt = datetime(
                year, _MONTHS[m.group(1)], int(m.group(2)),
                int(m.group(3)), int(m.group(4)), int(m.group(5)),
                _frac_us(m.group(6)), tzinfo=timezone.utc,
            )  # fmt: skip
        except (ValueError, OverflowError):
            continue
        if dt <= limit:
            return dt
    return None


def _unescape_kmsg(msg: str) -> str:
    # /dev/kmsg escapes control bytes, bytes >= 0x7f and backslash as \xNN, so a
    # multi-line printk arrives as one line with \x0a; undo it and re-decode
    # the bytes as UTF-8.
    if "\\x" not in msg:
        return msg
    unescaped = _KMSG_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), msg)
    try:
        return unescaped.encode("latin-1").decode("utf-8", "replace")
    except UnicodeEncodeError:  # the line already held non-latin-1 text
        return unescaped


class _Fields:
    """Mutable scratch for one parse; cheaper than threading a tuple through."""

    __slots__ = ("host", "mono", "prio", "seq", "wall")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.mono: int | None = None
        self.wall: datetime | None = None
        self.prio: int | None = None
        self.host: str | None = None


def _strip_inner_time(rest: str, f: _Fields) -> str:
    """A second timestamp may follow the outer wrapper (kern.log, dmesg -x)."""
    if not rest.startswith("["):
        return rest
    m = _MONO_RE.match(rest)
    if m is not None:
        f.mono = int(m.group(1)) * 1_000_000 + _frac_us(m.group(2))
        return rest[m.end() :]
    c = _CTIME_RE.match(rest)
    if c is not None:
        if f.wall is None:
            f.wall = _ctime_datetime(c)
        return rest[c.end() :]
    return rest


def _ctime_datetime(m: re.Match[str]) -> datetime | None:
    try:
        return datetime(
            int(m.group(6)), _MONTHS[m.group(1)], int(m.group(2)),
            int(m.group(3)), int(m.group(4)), int(m.group(5)), tzinfo=timezone.utc,
        )  # fmt: skip
    except (ValueError, OverflowError):
        return None


def _strip_wrapper(s: str, f: _Fields, now: datetime | None) -> str | None:
    """Return the message with the outer wrapper removed, or None if no wrapper matched."""
    c = s[0]
    if c == "[":
        m = _MONO_RE.match(s)
        if m is not None:
            f.mono = int(m.group(1)) * 1_000_000 + _frac_us(m.group(2))
            return s[m.end() :]
        ct = _CTIME_RE.match(s)
        if ct is not None:
            f.wall = _ctime_datetime(ct)
            return s[ct.end() :]
        return None
    if "0" <= c <= "9":
        k = _KMSG_RE.match(s)
        if k is not None:
            prio = int(k.group(1))
            f.prio = prio & 7
            f.seq = int(k.group(2))
            usec = int(k.group(3))
            f.mono = usec if usec >= 0 else None
            msg = s[k.end() :]
            nl = msg.find("\n")  # what follows are " KEY=value" dictionary lines
            if nl >= 0:
                msg = msg[:nl]
            return _unescape_kmsg(msg)
        iso = _ISO_RE.match(s)
        if iso is not None:
            f.wall = _iso_datetime(iso)
            rest = s[iso.end() :]
            hk = _HOST_KERNEL_RE.match(rest)
            if hk is not None:
                f.host = hk.group(1)
                rest = rest[hk.end() :]
            return _strip_inner_time(rest, f)
        return _strip_talos(s, f)
    if c == "k" and s.startswith("kernel:"):
        return _strip_inner_time(s[7:].lstrip(" "), f)
    d = _DECODE_RE.match(s)
    if d is not None:
        f.prio = _LEVELS[d.group(1)]
        rest = s[d.end() :]
        if rest[:1].isdigit():
            iso = _ISO_RE.match(rest)
            if iso is not None:
                f.wall = _iso_datetime(iso)
                return rest[iso.end() :]
        return _strip_inner_time(rest, f)
    if c in "ADFJMNOS":
        sl = _SYSLOG_RE.match(s)
        if sl is not None:
            f.wall = _syslog_datetime(sl, now)
            f.host = sl.group(7)
            return _strip_inner_time(s[sl.end() :], f)
    return _strip_talos(s, f)


def _strip_talos(s: str, f: _Fields) -> str | None:
    if ": " not in s or ": [" not in s:
        return None
    t = _TALOS_RE.match(s)
    if t is None:
        return None
    f.host = t.group(1)
    f.prio = _LEVELS[t.group(2)]
    iso = _ISO_RE.match(t.group(3))
    if iso is not None:
        f.wall = _iso_datetime(iso)
    return s[t.end() :]


# A /dev/kmsg record's message -> its text (dictionary lines cut, \xNN undone, stripped), by the
# message: a storm repeats the same few messages thousands of times a second, and their records
# then share one text. Bounded (the text comes from the kernel log): emptied when full.
_TEXT_MEMO: dict[str, str] = {}
_TEXT_MEMO_MAX = 4096
# the kernel facility's priorities, as they are printed: their levels without int()
_LEVEL_OF = {str(p): p & 7 for p in range(8)}


def _kmsg_text(msg: str) -> str:
    """A /dev/kmsg record's text from its message (dictionary lines cut, \\xNN undone,
    stripped), memoized in _TEXT_MEMO."""
    cut = msg
    nl = cut.find("\n")  # what follows are " KEY=value" dictionary lines
    if nl >= 0:
        cut = cut[:nl]
    text = _unescape_kmsg(cut).strip()
    if len(_TEXT_MEMO) >= _TEXT_MEMO_MAX:
        _TEXT_MEMO.clear()
    _TEXT_MEMO[msg] = text
    return text


def _kmsg_block(lines: list[str]) -> list[KernelRecord] | None:
    """``lines`` as the records _Assembler.add makes of them outside a first read, when every
    one is a /dev/kmsg record its per-line path takes as is (a storm's read): one findall over
    the block, no match object per line, the same records. None: some line is not (no header, a
    carriage return, a NUL, a journal marker, a blank message without kernel time), and the
    lines go through the per-line path."""
    block = "\n".join(lines)
    if "\r" in block or "\x00" in block:
        return None
    found = _KMSG_LINES_RE.findall(block)
    if len(found) != len(lines):  # at most one match a line: some line did not match
        return None
    memo, levels = _TEXT_MEMO, _LEVEL_OF
    out: list[KernelRecord] = []
    append = out.append
    for (prio, seq, usec, msg), raw in zip(found, lines, strict=True):
        text = memo.get(msg)
        if text is None:
            text = _kmsg_text(msg)
        mono = int(usec)
        if text.startswith("-- ") or (not text and mono < 0):
            return None
        level = levels.get(prio)
        append(KernelRecord(text, raw, int(seq), mono if mono >= 0 else None, None,
                            int(prio) & 7 if level is None else level))
    return out


def _device_records(chunks: list[bytes]) -> list[KernelRecord]:
    """The records of ``chunks``, each what one read() of ``/dev/kmsg`` returned: decoded in one
    call and made by _kmsg_block when each is one line ending in a newline (no dictionary lines),
    else each parsed as :func:`parse_line` parses it. The same records either way."""
    if not chunks:
        return []
    block = b"".join(chunks)
    if block.count(b"\n") == len(chunks) and all(c[-1:] == b"\n" for c in chunks):
        lines = block.decode("utf-8", "replace").split("\n")
        lines.pop()  # after the last newline
        made = _kmsg_block(lines)
        if made is not None:
            return made
    return [parse_line(c.decode("utf-8", "replace")) for c in chunks]


def _kmsg_record(raw: str) -> KernelRecord | None:
    """A ``/dev/kmsg`` record (``prio,seq,usec,flags[,more];message``): what the daemon reads, line
    after line, at up to tens of thousands a second. Exactly what ``_KMSG_RE`` accepts (one match:
    cheaper than taking the header apart with find, split and isdecimal); None for anything else
    (a NUL byte, a wrapper that only starts with a digit: ISO time, talos), which the general path
    then parses."""
    k = _KMSG_RE.match(raw)
    if k is None or "\x00" in raw:
        return None
    msg = raw[k.end() :]
    text = _TEXT_MEMO.get(msg)
    if text is None:
        text = _kmsg_text(msg)
    prio, seq, usec = k.groups()
    level = _LEVEL_OF.get(prio)
    mono = int(usec)
    # by position (text, raw, seq, monotonic_us, wall_time, priority): cheaper than by keyword
    return KernelRecord(text, raw, int(seq), mono if mono >= 0 else None, None,
                        int(prio) & 7 if level is None else level)


def parse_line(line: str, *, now: datetime | None = None) -> KernelRecord:
    """Parse one log line, or one whole ``/dev/kmsg`` record, into a :class:`KernelRecord`.

    Never raises. A line with no known wrapper yields ``text`` = the stripped
    line and all metadata None. ``now`` anchors the year of syslog ``short``
    timestamps (default: the current time).
    """
    raw = line.rstrip("\r\n")
    if "0" <= raw[:1] <= "9":
        rec = _kmsg_record(raw)
        if rec is not None:
            return rec
    return _parse_wrapped(raw, now)


def _parse_wrapped(raw: str, now: datetime | None) -> KernelRecord:
    """:func:`parse_line` for every wrapper, /dev/kmsg records included (the general path)."""
    s = raw.replace("\x00", "") if "\x00" in raw else raw
    f = _Fields()
    if s.startswith("<"):
        # `dmesg -r` and syslog-on-the-wire put the raw <prio> first; one level only.
        p = _PRI_RE.match(s)
        if p is not None:
            f.prio = int(p.group(1)) & 7
            s = s[p.end() :]
    if not s:
        return KernelRecord(text="", raw=raw, priority=f.prio)
    if s[0] in " \t":
        stripped = s.strip()
        if not stripped:
            return KernelRecord(text="", raw=raw, priority=f.prio)
        # Indented text is a continuation of a multi-line printk, unless it is
        # a whole wrapped line that someone indented (pasted logs).
        msg = _strip_wrapper(stripped, f, now)
        if msg is None:
            return KernelRecord(text=stripped, raw=raw, priority=f.prio, continuation=f.prio is None)
    else:
        msg = _strip_wrapper(s, f, now)
        if msg is None:
            msg = s
    return KernelRecord(
        text=msg.strip(),
        raw=raw,
        seq=f.seq,
        monotonic_us=f.mono,
        wall_time=f.wall,
        priority=f.prio,
        host=f.host,
    )


# --------------------------------------------------------------------------- line assembly


_NUL_RUN_RE = re.compile(rb"\x00+")


class _LineBuffer:
    """Bytes in, decoded complete lines out; keeps the unterminated tail."""

    def __init__(self) -> None:
        self._tail = b""
        self._skipping = False  # inside an over-long line whose head was already emitted
        self._after_nul = False  # the last chunk ended in a NUL run
        self.malformed = 0

    def feed(self, chunk: bytes) -> list[str]:
        if b"\x00" in chunk:
            # NUL runs appear where a crash left preallocated log blocks unwritten;
            # they carry nothing, and stripping them keeps them from counting
            # against the line-length cap. Each run counts once, whatever the reads cut it into.
            runs = len(_NUL_RUN_RE.findall(chunk))
            if self._after_nul and chunk[:1] == b"\x00":
                runs -= 1
            self.malformed += runs
            self._after_nul = chunk[-1:] == b"\x00"
            chunk = chunk.replace(b"\x00", b"")
        else:
            self._after_nul = False
        data = self._tail + chunk if self._tail else chunk
        parts = data.split(b"\n")
        tail = parts.pop()
        if parts and not self._skipping and len(tail) <= MAX_LINE_BYTES \
                and max(map(len, parts)) <= MAX_LINE_BYTES:
            # the usual chunk: whole lines of valid UTF-8, decoded in one call (b"\n" is never
            # part of another character, so the lines are those of the bytes)
            try:
                text = data[: len(data) - len(tail)].decode("utf-8")
            except UnicodeDecodeError:
                pass
            else:
                self._tail = tail
                out = text.split("\n")
                out.pop()  # the empty string after the last newline
                return out
        lines: list[str] = []
        for i, part in enumerate(parts):
            if i == 0 and self._skipping:
                self._skipping = False
                continue
            if len(part) > MAX_LINE_BYTES:
                part = part[:MAX_LINE_BYTES]
                self.malformed += 1
            lines.append(self._decode(part))
        if len(tail) > MAX_LINE_BYTES:
            if not (self._skipping and not parts):
                lines.append(self._decode(tail[:MAX_LINE_BYTES]))
                self.malformed += 1
            self._skipping = True
            tail = b""
        self._tail = tail
        return lines

    def take_partial(self) -> str | None:
        """The unterminated tail as a line (the writer will never finish it), or None."""
        tail, self._tail = self._tail, b""
        self._skipping = False
        return self._decode(tail) if tail else None

    def reset(self) -> None:
        self._tail = b""
        self._skipping = False
        self._after_nul = False

    def _decode(self, b: bytes) -> str:
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            self.malformed += 1
            return b.decode("utf-8", "replace")


class _Assembler:
    """Lines to records: kmsg dictionary lines, continuation lines, boot filter."""

    def __init__(self, boot_time: float | None) -> None:
        self._boot_time = None if boot_time is None else boot_time - _BOOT_TIME_SLACK_S
        self._last: KernelRecord | None = None
        self._last_dropped = False
        self._prev_mono: int | None = None
        self._prev_seq: int | None = None
        # a record that stepped the clock back, not yet confirmed as a new boot:
        # (index in the output where it went, the mono and seq stamps before it)
        self._step: tuple[int, int | None, int | None] | None = None

    def add(self, lines: Iterable[str], *, initial: bool) -> list[KernelRecord]:
        self._step = None
        if not initial and isinstance(lines, list) and lines:
            # a storm: every line a plain /dev/kmsg record, outside the first read's boot filter
            block = _kmsg_block(lines)
            if block is not None:
                self._last = block[-1]
                self._last_dropped = False
                return block
        out: list[KernelRecord] = []
        boot_time = self._boot_time
        for line in lines:
            if "0" <= line[:1] <= "9" and line[-1:] != "\r":
                # a /dev/kmsg record (what the daemon reads, at up to tens of thousands a second):
                # never a continuation nor dated by the wall clock, so only the boot filter applies
                kmsg = _kmsg_record(line)
                if kmsg is not None and not kmsg.text.startswith("-- ") \
                        and (kmsg.text or kmsg.monotonic_us is not None):
                    if initial:
                        cut = self._boot_change(kmsg, len(out))
                        if cut:
                            del out[:cut]
                            step = self._step
                            self._step = None if step is None else (step[0] - cut, *step[1:])
                    self._last = kmsg
                    self._last_dropped = False
                    out.append(kmsg)
                    continue
            rec = parse_line(line)
            if rec.continuation:
                last = self._last
                if last is not None and last.seq is not None and _KMSG_DICT_RE.match(line):
                    continue  # "\n KEY=value" lines belong to the kmsg record before
                if self._last_dropped:
                    continue
                if last is not None:
                    rec = replace(
                        rec,
                        seq=last.seq,
                        monotonic_us=last.monotonic_us,
                        wall_time=last.wall_time,
                        priority=last.priority,
                        host=last.host,
                    )
                out.append(rec)
                continue
            if not rec.text and rec.wall_time is None and rec.monotonic_us is None:
                continue  # blank line
            if rec.text.startswith("-- ") and rec.wall_time is None and _JOURNAL_MARKER_RE.match(rec.text):
                if initial and rec.text.startswith(_BOOT_MARKER_PREFIXES):
                    out.clear()  # journalctl separates boots with this marker
                    self._prev_mono = self._prev_seq = None
                    self._step = None
                continue
            if initial:
                cut = self._boot_change(rec, len(out))
                if cut:
                    del out[:cut]  # everything before is an older boot
                    self._step = None if self._step is None else (self._step[0] - cut, *self._step[1:])
            self._last = rec
            wall = rec.wall_time
            if boot_time is not None and wall is not None and wall.timestamp() < boot_time:
                self._last_dropped = True
                continue
            self._last_dropped = False
            out.append(rec)
        return out

    def _boot_change(self, rec: KernelRecord, index: int) -> int:
        """How many records before ``index`` belong to an older boot (0: none).

        A boot change is the kernel clock (or kmsg sequence) stepping back *and staying
        back*: the record after the step continues below where the clock was. One
        out-of-order record (a replayed or misfiled line) that the next record steps over
        again is not a reboot, and must not make every record before it vanish. A step
        that nothing follows yet is not acted on (a new boot prints hundreds of lines).
        """
        mono, seq = rec.monotonic_us, rec.seq
        if mono is None and seq is None:
            return 0
        cut = 0
        step = self._step
        if step is not None:
            at, mono0, seq0 = step
            if _stepped_back(mono0, seq0, mono, seq):
                cut = at  # still below the old clock: the step was a new boot
            self._step = None  # else: back above it, the step was one odd record
        if _stepped_back(self._prev_mono, self._prev_seq, mono, seq):
            self._step = (index, self._prev_mono, self._prev_seq)
        if mono is not None:
            self._prev_mono = mono
        if seq is not None:
            self._prev_seq = seq
        return cut


def _stepped_back(mono0: int | None, seq0: int | None, mono: int | None, seq: int | None) -> bool:
    """(mono, seq) lies before (mono0, seq0) by more than printk reordering between CPUs."""
    if mono is not None and mono0 is not None and mono < mono0 - _MONO_RESET_US:
        return True
    return seq is not None and seq0 is not None and seq < seq0


def records_from_bytes(data: bytes) -> list[KernelRecord]:
    """Parse a whole saved log (every boot in it, no filtering) as the follower would read it."""
    buf = _LineBuffer()
    lines = buf.feed(data)
    partial = buf.take_partial()
    if partial is not None:
        lines.append(partial)
    return _Assembler(None).add(lines, initial=False)


# --------------------------------------------------------------------------- following

Opener = Callable[[str, int], int]
Reader = Callable[[int, int], bytes]


class KernelLogFollower:
    """Follow the kernel log at ``path``; return only records of the current boot.

    * A character device (``/dev/kmsg``) or socket is read one record per
      ``read()``, non-blocking; ``wait()`` sleeps in ``poll()``. EPIPE (the ring
      overwrote records we had not read) is counted in ``lost_records`` from the
      sequence gap, and reading goes on. Everything in it is the current boot.
    * Anything else is read as text lines: first everything, then what is
      appended, like ``tail -F`` (truncation restarts at offset 0, a replaced
      file is reopened, a missing file is waited for); a partial last line waits
      for its newline. Records whose ``wall_time`` is before ``boot_time``
      (epoch seconds, /proc/stat btime; None = unknown) are dropped, and in the
      first read everything before the last backwards jump of the monotonic
      clock (or of the kmsg sequence) that the records after it confirm, or a
      journal ``-- Boot`` marker, is dropped as an older boot. A FIFO is read the
      same way; one with no writer is an error (nothing feeds it).
    * A directory or a block device is not a kernel log: an error, never an
      empty log.

    ``read_available()`` and ``wait()`` never raise for I/O problems: what went
    wrong in the latest ``read_available()`` (the path cannot be opened, is a
    directory, vanished, a read failed) is in ``last_error``, None when it read
    fine; the open is retried on the next call. A caller must treat a log with
    ``last_error`` set as unreadable, not as a quiet one.

    ``boot_anchor`` dates records that carry only kernel time (``monotonic_us``):
    ``boot_time`` when known (/proc/stat btime), else ``clock() - uptime_s``
    (/proc/uptime) taken when the follower was made, else ``clock()`` minus the
    newest kernel time of the first read that had one; a derived anchor is moved
    earlier if a record would otherwise be dated in the future. Records are then
    dated by their own kernel time, so intervals between them hold whatever the
    anchor's error.
    Not thread-safe: use it from one thread (``wait()`` returns within its
    timeout, so that thread can check a stop flag and call ``close()`` itself).
    If the log goes quiet, ``NvrmParser.flush()`` emits a block still waiting
    for its next line.
    ``opener``/``reader`` default to ``os.open``/``os.read``; tests substitute
    them to hand in a socket or to inject EPIPE.

    ``all_boots`` turns the boot filter off: every record of a regular file is
    returned, whatever boot it came from (a saved log judged on purpose;
    ``boot_time`` then only dates records). The live log is never read this way.

    ``bounded`` (the daemon's follower) makes each call after the first read of a
    file return at most about 256 KiB / 2,000 records; the rest comes with the next
    calls, at once (``wait()`` does not sleep while more is there). The first read of
    a file stays whole: its boot filter needs every line of it.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        boot_time: float | None = None,
        uptime_s: float | None = None,
        poll_interval: float = 0.2,
        opener: Opener = os.open,
        reader: Reader = os.read,
        clock: Callable[[], float] = time.time,
        all_boots: bool = False,
        bounded: bool = False,
    ) -> None:
        self.path = Path(path)
        self.all_boots = all_boots
        self.bounded = bounded
        self.boot_time = boot_time
        self.poll_interval = poll_interval
        self.lost_records = 0
        self.last_error: OSError | None = None
        self._clock = clock
        self._anchor: float | None = boot_time
        if boot_time is None and uptime_s is not None and uptime_s >= 0:
            self._anchor = clock() - uptime_s
        self._opener = opener
        self._reader = reader
        self._fd: int | None = None
        self._record_mode = False
        self._regular = False
        self._fifo = False
        self._ident: tuple[int, int] | None = None
        self._offset = 0
        self._opened_before = False
        self._initial = False
        self._closed = False
        self._lines = _LineBuffer()
        self._assembler = _Assembler(None if all_boots else boot_time)
        self._record_malformed = 0
        self._last_seq: int | None = None
        self._epipe = False
        self._poller: select.poll | None = None
        # how many times the log was opened: a log opened again (a replaced file, a device
        # after a read error) is read from its start, and its reader may want to skip what
        # it had already
        self.opens = 0

    # -- public --------------------------------------------------------------

    @property
    def malformed_lines(self) -> int:
        """Lines that needed repair: undecodable bytes, NUL bytes (counted per
        read chunk), over-long lines, and device records without a kmsg header."""
        return self._lines.malformed + self._record_malformed

    @property
    def boot_anchor(self) -> float | None:
        """Epoch seconds to add to a record's ``monotonic_us`` to date it (see the class doc)."""
        return self._anchor

    def read_available(self) -> list[KernelRecord]:
        """Everything new since the last call, without blocking."""
        if self._closed:
            return []
        self.last_error = None
        if self._fd is None and not self._open():
            return []
        records = self._read_records() if self._record_mode else self._read_file()
        if records and self.boot_time is None:
            self._anchor_to(records)
        return records

    def _anchor_to(self, records: list[KernelRecord]) -> None:
        newest = max((r.monotonic_us for r in records if r.monotonic_us is not None), default=None)
        if newest is None:
            return
        latest = self._clock() - newest / 1e6
        # a record cannot have been logged after now: an anchor that says so (no uptime, or an
        # uptime that is not the kernel's, e.g. a container's) is moved back to fit it
        if self._anchor is None or self._anchor > latest + _BOOT_TIME_SLACK_S:
            self._anchor = latest

    def wait(self, timeout: float) -> list[KernelRecord]:
        """Return as soon as records arrive, or ``[]`` after ``timeout`` seconds."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            records = self.read_available()
            if records:
                return records
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return []
            if self._record_mode and self._poller is not None:
                try:
                    # capped so an infinite timeout cannot overflow poll()'s milliseconds
                    events = self._poller.poll(min(remaining, _MAX_POLL_S) * 1000.0)
                except InterruptedError:
                    events = []
                if events:
                    records = self.read_available()
                    if records:
                        return records
                    # Woken without data (hang-up, error, duplicate): do not spin.
                    remaining = deadline - time.monotonic()
                    if remaining > 0:
                        time.sleep(min(self.poll_interval, remaining))
            else:
                time.sleep(min(self.poll_interval, remaining))

    def close(self) -> None:
        self._closed = True
        self._close_fd()

    def __enter__(self) -> KernelLogFollower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- opening -------------------------------------------------------------

    def _open(self) -> bool:
        try:
            fd = self._opener(str(self.path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self.last_error = e
            return False
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory, not a kernel log", str(self.path))
            if stat.S_ISBLK(st.st_mode):
                raise OSError(errno.EINVAL, "is a block device, not a kernel log", str(self.path))
            record_mode = stat.S_ISCHR(st.st_mode) or stat.S_ISSOCK(st.st_mode)
            if record_mode:
                os.set_blocking(fd, False)
        except OSError as e:
            os.close(fd)
            self.last_error = e
            return False
        self._fd = fd
        self._record_mode = record_mode
        self._regular = stat.S_ISREG(st.st_mode)
        self._fifo = stat.S_ISFIFO(st.st_mode)
        self._ident = (st.st_dev, st.st_ino)
        self._offset = 0
        if record_mode:
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN | select.POLLPRI)
        else:
            self._poller = None
            self._initial = not self._opened_before
            self._lines.reset()
        self._opened_before = True
        self.opens += 1
        return True

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._poller = None
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- character device ------------------------------------------------------

    def _read_records(self) -> list[KernelRecord]:
        # One read() is one record (the device's contract); the records of a turn are read
        # first and parsed together (_device_records), which in a storm costs less than parsing
        # each as it comes (bench/storm_device.py at 20,000 lines/s: 4.7-5.2 us a line, 5.3 before).
        chunks: list[bytes] = []
        gaps: set[int] = set()  # indices of chunks read right after an EPIPE
        limit = _TURN_RECORDS if self.bounded else None
        while self._fd is not None and (limit is None or len(chunks) < limit):
            try:
                data = self._reader(self._fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except BrokenPipeError:
                # The ring overwrote records we had not read; the next read
                # returns the oldest survivor and its seq tells how many.
                gaps.add(len(chunks))
                continue
            except OSError as e:
                self.last_error = e
                self._close_fd()  # reopen on the next call; seq dedup below skips the replay
                break
            if not data:
                break
            chunks.append(data)
        out: list[KernelRecord] = []
        for i, rec in enumerate(_device_records(chunks)):
            if gaps and i in gaps:
                self._epipe = True
            seq = rec.seq
            if seq is None:
                self._record_malformed += 1
            else:
                last = self._last_seq
                if last is not None:
                    if seq <= last:
                        continue
                    self.lost_records += seq - last - 1
                elif self._epipe:
                    self.lost_records += 1  # a lower bound: nothing read yet to measure the gap from
                self._last_seq = seq
            self._epipe = False
            out.append(rec)
        if gaps and len(chunks) in gaps:  # an EPIPE after the last record read: the next one's
            self._epipe = True
        return out

    # -- regular file ----------------------------------------------------------

    def _read_file(self) -> list[KernelRecord]:
        initial, self._initial = self._initial, False
        lines: list[str] = []
        if self._regular and self._fd is not None:
            try:
                size = os.fstat(self._fd).st_size
                if size < self._offset:  # truncated in place (copytruncate, > file)
                    os.lseek(self._fd, 0, os.SEEK_SET)
                    self._offset = 0
                    self._lines.reset()
            except OSError as e:
                self.last_error = e
        behind = self._drain(lines, bounded=self.bounded and not initial)
        records = self._assembler.add(lines, initial=initial and not self.all_boots)
        # a replaced file is left only once what was appended to the old one is all read
        if self._regular and not behind and self._replaced():
            partial = self._lines.take_partial()
            tail = [partial] if partial is not None else []
            records.extend(self._assembler.add(tail, initial=False))
            self._close_fd()
            if self._open():
                self._initial = False
                if self._record_mode:  # the path now names a device (host root remounted)
                    records.extend(self._read_records())
                else:
                    more: list[str] = []
                    self._drain(more, bounded=self.bounded)
                    records.extend(self._assembler.add(more, initial=False))
        return records

    def _drain(self, lines: list[str], *, bounded: bool = False) -> bool:
        """Read what is there into ``lines``; True when ``bounded`` stopped it (after about
        _TURN_BYTES / _TURN_RECORDS) with more to read, False at the end or on an error."""
        done = 0
        while self._fd is not None:
            size = _FILE_READ_SIZE
            if self._regular:
                # ask for no more than the file holds: read() allocates what it is asked for,
                # and a read at the end costs a call that returns nothing
                try:
                    left = os.fstat(self._fd).st_size - self._offset
                except OSError as e:
                    self.last_error = e
                    return False
                if left == 0 and self._offset > 0:
                    return False
                if left > 0:  # else truncated meanwhile, or a size of 0 that says nothing: read
                    size = min(size, left)
            try:
                chunk = self._reader(self._fd, size)
            except BlockingIOError:  # a FIFO with a writer but no data
                return False
            except InterruptedError:
                continue
            except OSError as e:
                self.last_error = e
                return False
            if not chunk:
                if self._fifo:
                    # O_NONBLOCK: EAGAIN while a writer is attached, end-of-file when none is
                    self.last_error = OSError(errno.EPIPE, "a FIFO with no writer: nothing feeds it",
                                              str(self.path))
                return False
            self._offset += len(chunk)
            lines.extend(self._lines.feed(chunk))
            done += len(chunk)
            if bounded and (done >= _TURN_BYTES or len(lines) >= _TURN_RECORDS):
                return True
        return False

    def _replaced(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError as e:
            # gone for now: keep the old descriptor until a new file appears (what was
            # appended to it is still read), but say so: nothing new will be logged there
            self.last_error = e
            return False
        return (st.st_dev, st.st_ino) != self._ident
