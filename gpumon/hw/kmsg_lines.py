"""Kernel log text to records: bytes to lines, lines to records, and a whole saved log.

* :class:`LineBuffer`: bytes in (whatever a read returned), decoded complete lines out; NUL runs,
  undecodable bytes and over-long lines are repaired and counted as malformed.
* :class:`Assembler`: lines to records (``/dev/kmsg`` dictionary lines, continuation lines of a
  multi-line printk) and, in a first read, the boot filter: only the last boot's records.
* :func:`records_from_bytes`: a whole saved log parsed as the follower would read it (every
  boot in it, no filtering).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord, parse_kmsg_block, parse_kmsg_record

__all__ = ["BOOT_TIME_SLACK_S", "MAX_LINE_BYTES", "Assembler", "LineBuffer", "records_from_bytes"]

#: Longer lines are cut to this many bytes and counted as malformed. Kernel
#: records are at most a few KiB (CONSOLE_EXT_LOG_MAX is 8 KiB), so anything
#: this long is a corrupt or binary file, not a log line.
MAX_LINE_BYTES = 64 * 1024

# A backwards step of the monotonic clock smaller than this is printk
# reordering between CPUs (records are stamped before they are ordered), not a
# reboot. A real reboot steps back by the previous boot's whole uptime.
_MONO_RESET_US = 1_000_000

# /proc/stat btime is whole seconds and `dmesg -T` prints whole seconds, so a
# record from the first second of this boot can compare as up to 1 s early.
BOOT_TIME_SLACK_S = 1.0

_JOURNAL_MARKER_RE = re.compile(
    r"-- (?:Boot [0-9a-f]+|Reboot|Logs begin at .*|Journal begins at .*|No entries) --$"
)
_BOOT_MARKER_PREFIXES = ("-- Boot ", "-- Reboot --")
_KMSG_DICT_RE = re.compile(r" [A-Z0-9_]+=")

_NUL_RUN_RE = re.compile(rb"\x00+")


class LineBuffer:
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


class Assembler:
    """Lines to records: kmsg dictionary lines, continuation lines, boot filter."""

    def __init__(self, boot_time: float | None) -> None:
        self._boot_time = None if boot_time is None else boot_time - BOOT_TIME_SLACK_S
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
            block = parse_kmsg_block(lines)
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
                kmsg = parse_kmsg_record(line)
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
    buf = LineBuffer()
    lines = buf.feed(data)
    partial = buf.take_partial()
    if partial is not None:
        lines.append(partial)
    return Assembler(None).add(lines, initial=False)
