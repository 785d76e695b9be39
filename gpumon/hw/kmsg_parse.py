"""Parse one kernel log line, whatever wrapper it came in, into a :class:`KernelRecord`.

:func:`parse_line` recognises every wrapper found in the real captures
(tests/data/kmsg-xid): raw ``/dev/kmsg`` records (gpumon.hw.kmsg_record's fast path),
``dmesg`` (default, ``-T``, ``--decode``, ``--time-format=iso``, ``-r``), ``journalctl -k``
(short, short-precise, short-iso), rsyslog ``kern.log``, pasted ``kernel:`` lines and
``talosctl dmesg``. It never raises. The time conventions of what it returns are
gpumon.hw.kmsg_record's.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from gpumon.hw.kmsg_record import KMSG_RE, KernelRecord, parse_kmsg_record, unescape_kmsg

__all__ = ["parse_line"]

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
        k = KMSG_RE.match(s)
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
            return unescape_kmsg(msg)
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


def parse_line(line: str, *, now: datetime | None = None) -> KernelRecord:
    """Parse one log line, or one whole ``/dev/kmsg`` record, into a :class:`KernelRecord`.

    Never raises. A line with no known wrapper yields ``text`` = the stripped
    line and all metadata None. ``now`` anchors the year of syslog ``short``
    timestamps (default: the current time).
    """
    raw = line.rstrip("\r\n")
    if "0" <= raw[:1] <= "9":
        rec = parse_kmsg_record(raw)
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
