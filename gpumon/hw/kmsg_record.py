"""The kernel log record, and the ``/dev/kmsg`` record format it is read from fastest.

* :class:`KernelRecord`: one kernel log message with every wrapper stripped, whatever it came
  from (gpumon.hw.kmsg_parse parses every wrapper; gpumon.hw.kmsg_follow follows the live log).
* :func:`parse_kmsg_record` and :func:`parse_kmsg_block`: a ``/dev/kmsg`` record
  (``prio,seq,usec,flags[,more];message``), what the daemon reads at up to tens of thousands a
  second, one line or a whole read of them at a time.

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

import re
from dataclasses import dataclass
from datetime import datetime

__all__ = ["KMSG_RE", "KernelRecord", "parse_kmsg_block", "parse_kmsg_record", "unescape_kmsg"]


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


# prio,seq,usec,flags[,more];message  (Documentation/ABI/testing/dev-kmsg)
KMSG_RE = re.compile(r"(\d{1,10}),(\d{1,20}),(-?\d{1,20}),[^;\n]*;")
# KMSG_RE over a block of lines at once, each line's message captured (the storm path of
# gpumon.hw.kmsg_lines.Assembler and of the follower's device reads:
# one findall for a whole read instead of a match and its groups per line); the first digit is
# ASCII, as the per-line path requires of a line before it tries KMSG_RE
_KMSG_LINES_RE = re.compile(r"^([0-9]\d{0,9}),(\d{1,20}),(-?\d{1,20}),[^;\n]*;(.*)$", re.MULTILINE)
_KMSG_ESCAPE_RE = re.compile(r"\\x([0-9a-fA-F]{2})")


def unescape_kmsg(msg: str) -> str:
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
    text = unescape_kmsg(cut).strip()
    if len(_TEXT_MEMO) >= _TEXT_MEMO_MAX:
        _TEXT_MEMO.clear()
    _TEXT_MEMO[msg] = text
    return text


def parse_kmsg_block(lines: list[str]) -> list[KernelRecord] | None:
    """``lines`` as the records kmsg_lines.Assembler.add makes of them outside a first read, when every
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


def parse_kmsg_record(raw: str) -> KernelRecord | None:
    """A ``/dev/kmsg`` record (``prio,seq,usec,flags[,more];message``): what the daemon reads, line
    after line, at up to tens of thousands a second. Exactly what ``KMSG_RE`` accepts (one match:
    cheaper than taking the header apart with find, split and isdecimal); None for anything else
    (a NUL byte, a wrapper that only starts with a digit: ISO time, talos), which the general path
    then parses."""
    k = KMSG_RE.match(raw)
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
