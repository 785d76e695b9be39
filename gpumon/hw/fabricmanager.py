"""nvidia-fabricmanager's log: parse its lines and follow the file across runs.

Line format (real captures in tests/data/fabricmanager, provenance in SOURCES.md there)::

    [Dec 19 2024 19:17:49] [ERROR] [tid 1374] detected NVSwitch non-fatal error 12028 on fid 0 on
    NVSwitch pci bus id 00000000:83:00.0 physical id 0 port 34        (one line in the file)

Some messages carry a payload on the lines after the header (``Message payload
details:...``), which have no header of their own; they belong to the entry
above. The stamp is the host's local time, without a zone (see
:func:`entry_epoch`).

Why not :class:`gpumon.hw.kmsg_follow.KernelLogFollower`: it keeps an open descriptor
between reads and turns lines into kernel records (wrappers, boot filtering by
kernel clocks), while a check is re-created on every run and may keep only
JSON in its state. :class:`FabricManagerLog` therefore keeps its position in a
small JSON *cursor* (device, inode, offset, a fingerprint of the first bytes)
that the check stores in ``ctx.state`` and hands back next time. Reading is
bounded in bytes per call and in time (the hardware layer's bounded caller);
truncation, rotation and replacement of the file are detected from the cursor.
Nothing here raises on bad input: odd bytes are replaced, over-long lines cut,
lines before the first header counted as orphans.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import Any

from gpumon.errors import HwFailure
from gpumon.hw.calls import BoundedCaller
from gpumon.hw.hostfs import HostFs
from gpumon.hw.kmsg_lines import MAX_LINE_BYTES
from gpumon.hw.nvrm import canonical_pci

__all__ = [
    "DEFAULT_LOG_PATH",
    "FabricManagerLog",
    "FmLogEntry",
    "FmLogParser",
    "FollowResult",
    "NvSwitchError",
    "entry_epoch",
    "host_timezone",
    "nvswitch_error",
    "older_than_boot",
    "parse_header",
]

#: Where nvidia-fabricmanager writes its log by default (LOG_FILE_NAME in
#: /usr/share/nvidia/nvswitch/fabricmanager.cfg), relative to the host root.
DEFAULT_LOG_PATH = "var/log/fabricmanager.log"

# Payload lines kept per entry: the inband messages carry one or two; more is
# a runaway dump that nobody acts on.
_MAX_CONTINUATION_LINES = 16
_MAX_CONTINUATION_CHARS = 4096
# The fingerprint covers the file's first bytes: enough to tell two log files
# apart (their first entries carry a time stamp), little enough to re-read.
_HEAD_BYTES = 256

_MONTHS = {m: i for i, m in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)}
# Bounded everywhere: an unbounded [^\]]* would rescan long garbage lines.
_HEADER_RE = re.compile(
    r"\[([^\]\n]{1,40})\]\s{0,4}\[([A-Za-z]{1,12})\]\s{0,4}(?:\[tid\s{0,4}(\d{1,12})\]\s?)?"
)
_STAMP_RE = re.compile(r"([A-Za-z]{3})\s{1,2}(\d{1,2})\s(\d{4})\s(\d{1,2}):(\d{2}):(\d{2})")
_NVSWITCH_ERROR_RE = re.compile(
    r"detected NVSwitch (non-fatal|fatal) error (\d{1,9})"
    r"(?: on fid (\d{1,9}))?"
    r"(?: on NVSwitch pci bus id ([0-9A-Fa-f:.]{1,24}))?"
    r"(?: physical id (\d{1,9}))?"
    r"(?: port (\d{1,9}))?",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class FmLogEntry:
    """One log entry: the header line plus any payload lines after it.

    ``stamp`` is the time as printed, ``when`` the same parsed (naive: the
    host's local time); both None when the header's stamp is not a time.
    ``level`` is upper-case (``INFO``, ``WARNING``, ``ERROR``, ...).
    """

    stamp: str
    when: datetime | None
    level: str
    tid: int | None
    message: str
    payload: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NvSwitchError:
    """``detected NVSwitch <non-fatal|fatal> error <SXid> on fid F on NVSwitch pci bus id P
    physical id I port Q`` (the parts after the code are optional)."""

    code: int
    fatal: bool
    fid: int | None
    pci: str | None
    physical_id: int | None
    port: int | None


def _stamp(text: str) -> datetime | None:
    m = _STAMP_RE.fullmatch(text.strip())
    if m is None:
        return None
    month = _MONTHS.get(m.group(1).lower())
    if month is None:
        return None
    try:
        return datetime(int(m.group(3)), month, int(m.group(2)), int(m.group(4)), int(m.group(5)),
                        int(m.group(6)))
    except ValueError:  # Feb 30, hour 25
        return None


def parse_header(line: str) -> FmLogEntry | None:
    """The entry a header line starts, or None when the line is not a header (a payload line)."""
    m = _HEADER_RE.match(line)
    if m is None:
        return None
    tid = int(m.group(3)) if m.group(3) is not None else None
    return FmLogEntry(stamp=m.group(1), when=_stamp(m.group(1)), level=m.group(2).upper(), tid=tid,
                      message=line[m.end():].rstrip())


def nvswitch_error(message: str) -> NvSwitchError | None:
    """The NVSwitch error an entry reports, or None."""
    m = _NVSWITCH_ERROR_RE.search(message)
    if m is None:
        return None

    def num(i: int) -> int | None:
        return int(m.group(i)) if m.group(i) is not None else None

    pci = canonical_pci(m.group(4)) if m.group(4) is not None else None
    return NvSwitchError(code=int(m.group(2)), fatal=m.group(1).lower() == "fatal", fid=num(3), pci=pci,
                         physical_id=num(5), port=num(6))


class FmLogParser:
    """Lines to entries. Payload lines join the entry above; the last entry waits
    for :meth:`flush` (its payload may still be coming in the same read)."""

    def __init__(self) -> None:
        self.orphan_lines = 0  # payload lines with no header before them (a read began mid-entry)
        self._pending: FmLogEntry | None = None
        self._payload: list[str] = []
        self._payload_chars = 0

    def feed(self, lines: Iterable[str]) -> list[FmLogEntry]:
        out: list[FmLogEntry] = []
        for raw in lines:
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            entry = parse_header(line)
            if entry is not None:
                self._emit(out)
                self._pending = entry
            elif self._pending is None:
                self.orphan_lines += 1
            elif (len(self._payload) < _MAX_CONTINUATION_LINES
                  and self._payload_chars + len(line) <= _MAX_CONTINUATION_CHARS):
                self._payload.append(line)
                self._payload_chars += len(line)
        return out

    def flush(self) -> list[FmLogEntry]:
        out: list[FmLogEntry] = []
        self._emit(out)
        return out

    def _emit(self, out: list[FmLogEntry]) -> None:
        if self._pending is not None:
            e = self._pending
            out.append(FmLogEntry(e.stamp, e.when, e.level, e.tid, e.message, tuple(self._payload)))
        self._pending = None
        self._payload = []
        self._payload_chars = 0


def entry_epoch(entry: FmLogEntry, tz: tzinfo) -> float | None:
    """Epoch seconds of an entry whose stamp is local time in ``tz``; None if it has no time."""
    if entry.when is None:
        return None
    try:
        return entry.when.replace(tzinfo=tz).timestamp()
    except (OverflowError, ValueError, OSError):
        return None


def _bounds(fs: HostFs) -> tuple[BoundedCaller, float]:
    """The bounded caller and timeout HostFs reads use (HostFs offers no byte-range read of its own)."""
    return fs._caller, fs._timeout


def host_timezone(fs: HostFs) -> tzinfo | None:
    """The host's zone from ``<host-root>/etc/localtime`` (a TZif file); None when absent or unreadable.

    Raises only the bounded caller's HwTimeout.
    """
    from zoneinfo import ZoneInfo  # stdlib; imported late so that importing this module stays cheap

    path = fs.path("etc/localtime")
    caller, timeout = _bounds(fs)

    def read() -> bytes:
        with open(path, "rb") as fh:
            return fh.read(1 << 20)

    try:
        data = caller.call("hostfs", "read(etc/localtime)", read, timeout)
    except OSError:
        return None
    try:
        return ZoneInfo.from_file(io.BytesIO(data), key="host")
    except (ValueError, OSError):
        return None


# --------------------------------------------------------------------------- following


@dataclass
class FollowResult:
    """What one :meth:`FabricManagerLog.follow` call found.

    ``cursor`` is JSON-serializable; store it and pass it to the next call.
    ``missing`` means the file does not exist (nothing else is set then).
    """

    path: str
    missing: bool = False
    entries: list[FmLogEntry] = field(default_factory=list)
    cursor: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    skipped_bytes: int = 0  # not read on the first look at a long file (older than the tail kept)
    behind_bytes: int = 0  # still unread after this call (more than max_read_bytes were new)
    truncated: bool = False  # the file shrank: read again from its start
    replaced: bool = False  # another file now has the name (rotation): old tail read if found
    rotated_from: str | None = None  # name the old file was found under
    orphan_lines: int = 0
    malformed_lines: int = 0


@dataclass
class _Raw:
    lines: list[str] = field(default_factory=list)
    malformed: int = 0


class FabricManagerLog:
    """Follow ``<host-root>/<rel_path>`` with a JSON cursor (see module docstring).

    Reads run on the host-file lane of ``fs``'s bounded caller, under its
    timeout. ``max_read_bytes`` bounds one call; ``initial_tail_bytes`` is how much of an
    existing file is read the first time (no cursor): older content is skipped
    and counted. Raises HwTimeout (the read did not return in ``timeout``) or
    HwFailure (the file exists but cannot be read).
    """

    def __init__(self, fs: HostFs, rel_path: str = DEFAULT_LOG_PATH, *, max_read_bytes: int = 4 << 20,
                 initial_tail_bytes: int = 1 << 20) -> None:
        self.fs = fs
        self.rel_path = rel_path.lstrip("/")
        self.path = fs.path(self.rel_path)
        self._caller, self._timeout = _bounds(fs)
        self.max_read_bytes = max(1, max_read_bytes)
        self.initial_tail_bytes = max(0, initial_tail_bytes)

    def follow(self, cursor: Mapping[str, Any] | None) -> FollowResult:
        label = f"read({self.rel_path})"
        try:
            result, raw = self._caller.call("hostfs", label, lambda: self._read(_Cursor.load(cursor)),
                                            self._timeout)
        except OSError as exc:
            raise HwFailure(f"cannot read {self.path}: {exc.strerror or exc}", call=label) from None
        if result.missing:
            return result
        parser = FmLogParser()
        result.entries = parser.feed(raw.lines) + parser.flush()
        result.orphan_lines = parser.orphan_lines
        result.malformed_lines = raw.malformed
        return result

    # -- runs on the bounded caller's worker thread -----------------------------------

    def _read(self, prev: _Cursor | None) -> tuple[FollowResult, _Raw]:
        result = FollowResult(path=str(self.path))
        raw = _Raw()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            result.missing = True
            return result, raw
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{self.path} is not a regular file")
            size = st.st_size
            offset: int
            if prev is not None and (prev.dev, prev.ino) != (st.st_dev, st.st_ino):
                result.replaced = True
                self._finish_old(prev, result, raw)
                offset = 0
            elif prev is not None and size < prev.offset:
                result.truncated = True
                offset = 0
            elif prev is not None and prev.head_len and _head(fd, prev.head_len) != prev.head:
                result.replaced = True  # rewritten in place (copytruncate, then regrown past our offset)
                offset = 0
            elif prev is not None:
                offset = prev.offset
            else:
                offset = max(0, size - self.initial_tail_bytes)
            first_look = prev is None and offset > 0
            consumed = _read_lines(fd, offset, size, self.max_read_bytes, raw, skip_partial=first_look)
            if first_look:
                # the partial line before the first newline was skipped too
                result.skipped_bytes = offset + consumed.skipped
            new_offset = offset + consumed.advanced
            result.bytes_read += consumed.advanced
            result.behind_bytes = max(0, size - new_offset)
            head_len = min(size, _HEAD_BYTES)
            result.cursor = {"dev": st.st_dev, "ino": st.st_ino, "offset": new_offset,
                             "head_len": head_len, "head": _head(fd, head_len)}
        finally:
            os.close(fd)
        return result, raw

    def _finish_old(self, prev: _Cursor, result: FollowResult, raw: _Raw) -> None:
        """Read what the previous file got after our last read, if it still exists under a rotated name."""
        directory = self.path.parent
        base = self.path.name
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith(base) and n != base)
        except OSError:
            return
        for name in names[:32]:
            candidate = directory / name
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != (prev.dev, prev.ino) or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fd = os.open(candidate, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return
            try:
                start = prev.offset if st.st_size >= prev.offset else 0
                consumed = _read_lines(fd, start, st.st_size, self.max_read_bytes, raw, skip_partial=False,
                                       final=True)
                result.bytes_read += consumed.advanced
                result.rotated_from = name
            finally:
                os.close(fd)
            return


@dataclass(frozen=True)
class _Cursor:
    dev: int
    ino: int
    offset: int
    head_len: int
    head: str

    @classmethod
    def load(cls, data: Mapping[str, Any] | None) -> _Cursor | None:
        """A cursor from stored state; None (start afresh) when absent or not what we wrote."""
        if not isinstance(data, Mapping):
            return None
        try:
            values = (data["dev"], data["ino"], data["offset"], data["head_len"])
            head = data["head"]
        except KeyError:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        if not isinstance(head, str):
            return None
        return cls(values[0], values[1], values[2], min(values[3], _HEAD_BYTES), head)


@dataclass
class _Consumed:
    advanced: int = 0  # bytes the cursor moves past (complete lines, skipped partial line)
    skipped: int = 0  # of those, the partial first line dropped on a first look


def _head(fd: int, length: int) -> str:
    if length <= 0:
        return ""
    data = os.pread(fd, length, 0)
    return hashlib.sha256(data).hexdigest()[:32]


def _read_lines(fd: int, offset: int, size: int, limit: int, raw: _Raw, *, skip_partial: bool,
                final: bool = False) -> _Consumed:
    """Read complete lines from ``offset`` (at most ``limit`` bytes) into ``raw``.

    A last line without its newline is left for the next call (the writer is
    still writing it), unless ``final`` (a rotated file will not grow) or the
    window is full of one line (longer than a window: cut and counted, so that
    reading always moves on).
    """
    out = _Consumed()
    want = min(limit, max(0, size - offset))
    data = os.pread(fd, want, offset) if want else b""
    if not data:
        return out
    start = 0
    if skip_partial:
        first = data.find(b"\n")
        if first < 0:
            out.advanced = out.skipped = len(data)
            return out
        start = out.skipped = first + 1
    last = data.rfind(b"\n")
    if final:
        stop = len(data)
    elif last >= start:
        stop = last + 1
    elif len(data) >= limit:
        stop = len(data)
        raw.malformed += 1
    else:
        out.advanced = start
        return out
    for part in data[start:stop].split(b"\n"):
        _add_line(part, raw)
    out.advanced = stop
    return out


def _add_line(part: bytes, raw: _Raw) -> None:
    if b"\x00" in part:
        # preallocated-but-unwritten blocks after a crash: nothing in them to read
        part = part.replace(b"\x00", b"")
        raw.malformed += 1
    if not part.strip():
        return
    if len(part) > MAX_LINE_BYTES:
        part = part[:MAX_LINE_BYTES]
        raw.malformed += 1
    try:
        raw.lines.append(part.decode("utf-8"))
    except UnicodeDecodeError:
        raw.malformed += 1
        raw.lines.append(part.decode("utf-8", "replace"))


def older_than_boot(epoch: float | None, boot_time: float | None, slack_s: float = 2.0) -> bool:
    """True when an entry stamped ``epoch`` was written before this boot.

    ``slack_s`` because both the stamps and /proc/stat btime are whole seconds.
    """
    return epoch is not None and boot_time is not None and epoch < boot_time - slack_s
