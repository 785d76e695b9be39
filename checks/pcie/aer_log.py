"""The AER lines of the kernel log, folded into the pcie check's state.

A report is a header ("PCIe Bus Error: severity=...") and its detail lines (status/mask, the error
bits), printed by the function that received it; a summary line ("AER: ... error received") and a
"not recovered" line stand alone. :func:`_ingest` and :func:`_ingest_summary` count them line by
line into ``state["kmsg"]`` (bus id -> entry); :class:`AerFold` folds them as they arrive (the
daemon's kernel-log pump, or the check's own run) into an :class:`AerDelta`, which merges into the
state to what line-by-line ingest gives (tests/checks/test_pcie_fold.py). What an entry says is
judged by ``judge.judge_kernel_log``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpumon.check import KernelLogFold
from gpumon.hw import pci as pcihw

_MAX_LOG_DEVICES = 256
_MAX_SAMPLES = 5
# the AER vocabulary the judging (judge) shares: error names kept per report or counter event, the
# kinds that fail a function, and each kind in words
MAX_NAMES = 32
UNCORRECTABLE: tuple[pcihw.AerKind, ...] = ("fatal", "nonfatal")
WORDS = {"fatal": "fatal", "nonfatal": "non-fatal", "correctable": "correctable"}
# AER summary lines (drivers/pci/pcie/aer.c, err.c): 4.x "AER: Multiple Corrected error received:
# 0000:00:1c.0", 3.x "... received: id=00e0", 6.x "AER: Correctable error message received from
# 0000:07:00.0", gcm's test "AER: Uncorrectable (Fatal) error received" (no source)
_AER_BDF = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_AER_SUMMARY_RE = re.compile(
    rf"(?P<bdf>{_AER_BDF}):\s+AER:\s+(?:Multiple\s+)?(?P<kind>Correct(?:ed|able)|Uncorrect(?:ed|able))"
    r"(?:\s+\((?P<sev>Fatal|Non-Fatal)\))?\s+error(?:\s+message)?\s+received"
    rf"(?:(?::\s*|\s+from\s+)(?:(?P<src>{_AER_BDF})|id=(?P<id>[0-9a-fA-F]{{4}})))?", re.IGNORECASE)
_AER_LOST_RE = re.compile(
    rf"(?P<bdf>{_AER_BDF}):\s+AER:\s+(?P<what>can't recover \(no error_detected callback\)|"
    r"device recovery failed)", re.IGNORECASE)


class AerDelta:
    """AER lines folded since the pcie check's last run (:class:`AerFold`): what they add to the
    check's ``state["kmsg"]``, which :meth:`merge` adds. Merging deltas one after another
    gives the state that ingesting their lines one by one gives (tests/checks/test_pcie_fold.py)."""

    __slots__ = ("kmsg", "orphans", "sources")

    def __init__(self) -> None:
        # bus id -> entry, as in state["kmsg"], for the reports whose header is in this delta
        # (and the summary / not-recovered lines)
        self.kmsg: dict[str, dict[str, Any]] = {}
        # reporter -> the function its latest header named ("": a header of no known severity)
        self.sources: dict[str, str] = {}
        # detail lines (status, error bits) of reports whose header came in an earlier delta, in
        # order, a run of lines for one function as one item: (("bdf", function), what they say)
        # for that function's current report, or (("reporter", prefix), ...) for the function
        # that the state's kmsg_source names (a reporter whose header this fold never saw)
        self.orphans: list[tuple[tuple[str, str], dict[str, Any]]] = []

    def __bool__(self) -> bool:
        return bool(self.kmsg or self.sources or self.orphans)

    def merge(self, kmsg: dict[str, Any], sources: dict[str, str]) -> None:
        """Add this delta to the state's ``kmsg`` (bus id -> entry) and ``kmsg_source``."""
        for (by, key), said in self.orphans:  # they came before anything of this delta's
            entry = kmsg.get(sources.get(key, key) if by == "reporter" else key)
            if entry is not None and "current" in entry:
                _details(entry[entry["current"]], said)
        for bdf, new in self.kmsg.items():
            entry = kmsg.get(bdf)
            if entry is None:
                if len(kmsg) < _MAX_LOG_DEVICES:
                    kmsg[bdf] = new
                continue
            for key, value in new.items():
                if key in WORDS:  # a report group: count, first, last, errors, status
                    group = entry.get(key)
                    if group is None:
                        entry[key] = value
                        continue
                    group["count"] += value["count"]
                    group["first"] = min(group["first"], value["first"])
                    group["last"] = max(group["last"], value["last"])
                    _details(group, value)
                elif key in ("summary", "not_recovered"):
                    groups = entry.setdefault(key, {})
                    for kind, counted in value.items():
                        have = groups.get(kind)
                        if have is None:
                            groups[kind] = counted
                        else:
                            have["count"] += counted["count"]
                            have["first"] = min(have["first"], counted["first"])
                            have["last"] = max(have["last"], counted["last"])
                elif key == "samples":
                    samples: list[str] = entry.setdefault("samples", [])
                    samples.extend(value[: max(0, _MAX_SAMPLES - len(samples))])
                else:  # current, reported_by: the latest says
                    entry[key] = value
        sources.update(self.sources)


# AerFold's memo of parsed lines, at most (the text comes from the kernel log): emptied when full
_FOLD_MEMO_MAX = 4096


class AerFold(KernelLogFold):
    """pcie's kernel-log lines folded into an :class:`AerDelta` as they arrive (the daemon's
    kernel-log pump calls :meth:`add` per record, see gpumon.check.KernelLogFold; the check's own
    run does the same with the records it is handed). A storm of corrected-error reports then
    costs a dictionary update per line, and runs the check only at its interval: ``add`` returns
    a key, which runs it at once, only for an uncorrectable report (header or summary line) and a
    device that was not recovered.

    ``sources``: the state's kmsg_source (reporter -> the function of its latest header), so that
    a detail line whose header was folded before is attributed as the state would. The daemon's
    fold starts without it and learns it from the headers it folds; after a daemon restart, a
    detail line whose header was handed over before the restart is attributed at the merge, to
    that function's report as it stood before the delta (the same, unless another header for the
    same function came between them)."""

    def __init__(self, sources: Mapping[str, str] | None = None) -> None:
        self._delta = AerDelta()
        self._source: dict[str, str] = dict(sources) if isinstance(sources, Mapping) else {}
        # what each line's text parses to (parse_aer_message, else the summary line): a storm
        # repeats the same few report lines, and parsing them was most of what a line cost
        self._memo: dict[str, pcihw.AerLogLine | tuple[str, str, str] | None] = {}
        # a record's whole text -> what its lines parse to (those that parse), the same for the
        # records that repeat it: one lookup for a record of the storm, AER or not
        self._texts: dict[str, tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...]] = {}

    def take(self) -> AerDelta | None:
        delta, self._delta = self._delta, AerDelta()
        return delta if delta else None

    def add_many(self, records: Iterable[Any], time_of: Callable[[Any], float]) -> list[tuple[str, str]]:
        """:meth:`add` for each record, dated by ``time_of`` only when it is an AER line (the
        pump's call, once per read of the log: see gpumon.check.KernelLogFold)."""
        keys: list[tuple[str, str]] = []
        texts = self._texts
        for record in records:
            text = getattr(record, "text", "")
            if not isinstance(text, str):
                continue
            lines = texts.get(text)
            if lines is None:
                lines = self._parsed(text)
            if lines:
                keys.extend(self._fold(lines, time_of(record)))
        return keys

    def add(self, record: Any, when: float) -> list[tuple[str, str]]:
        text = getattr(record, "text", "")
        if not isinstance(text, str):
            return []
        return self._add(text, when)

    def _add(self, text: str, when: float) -> list[tuple[str, str]]:
        lines = self._texts.get(text)
        if lines is None:
            lines = self._parsed(text)
        return self._fold(lines, when) if lines else []

    def _parsed(self, text: str) -> tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...]:
        """What the lines of a record's text parse to (parse_aer_message, else the summary line),
        those that parse, in order; kept for the records that repeat the text (bounded)."""
        out: list[tuple[str, pcihw.AerLogLine | tuple[str, str, str]]] = []
        # what parse_aer_message and the summary line need (most lines of a storm have none)
        if "[" in text or "AER:" in text or "PCIe Bus Error" in text or "error status/mask=" in text:
            memo = self._memo
            for line in text.splitlines():
                try:
                    parsed = memo[line]
                except KeyError:
                    parsed = _fold_parse(line)
                    if len(memo) >= _FOLD_MEMO_MAX:
                        memo.clear()
                    memo[line] = parsed
                if parsed is not None:
                    out.append((line, parsed))
        lines = tuple(out)
        if len(self._texts) >= _FOLD_MEMO_MAX:
            self._texts.clear()
        self._texts[text] = lines
        return lines

    def _fold(self, lines: tuple[tuple[str, pcihw.AerLogLine | tuple[str, str, str]], ...],
              when: float) -> list[tuple[str, str]]:
        keys: list[tuple[str, str]] = []
        for line, parsed in lines:
            if isinstance(parsed, pcihw.AerLogLine):
                if self._line(parsed, line, when):
                    keys.append((parsed.bdf, str(parsed.severity)))
            else:
                said = _count_summary(self._delta.kmsg, parsed, line, when)
                if said[1] != "correctable":
                    keys.append(said)
        return keys

    def _line(self, msg: pcihw.AerLogLine, line: str, when: float) -> bool:
        """Fold one line of a report; True for the header of an uncorrectable one."""
        delta = self._delta
        if msg.kind == "header":
            _ingest(delta.kmsg, delta.sources, msg, line, when)
            if len(self._source) >= 4 * _MAX_LOG_DEVICES and msg.reporter not in self._source:
                del self._source[next(iter(self._source))]
            self._source[msg.reporter] = delta.sources[msg.reporter]
            return msg.severity in UNCORRECTABLE
        if msg.reporter in delta.sources:  # its header is in this delta
            _ingest(delta.kmsg, delta.sources, msg, line, when)
            return False
        target = self._source.get(msg.reporter)
        if target == "":
            return False  # its header had no severity: a report not counted
        # no header from this reporter yet: the function it prints (as _ingest does)
        entry = delta.kmsg.get(msg.reporter if target is None else target)
        if entry is not None and "current" in entry:  # a header in this delta named it
            _detail(entry[entry["current"]], msg)
            return False
        key = ("reporter", msg.reporter) if target is None else ("bdf", target)
        if delta.orphans and delta.orphans[-1][0] == key:
            said = delta.orphans[-1][1]
        elif len(delta.orphans) < _MAX_LOG_DEVICES:
            said = {"errors": []}
            delta.orphans.append((key, said))
        else:
            return False  # the tails of 256 reports split from their headers in one delta
        _detail(said, msg)
        return False


def _ingest(kmsg: dict[str, Any], last_header: dict[str, str], msg: pcihw.AerLogLine, line: str,
            when: float) -> None:
    if msg.kind == "header":
        if msg.severity is None:
            last_header[msg.reporter] = ""  # its detail lines belong to no counted report
            return
        last_header[msg.reporter] = msg.bdf
        entry = kmsg.get(msg.bdf)
        if entry is None:
            if len(kmsg) >= _MAX_LOG_DEVICES:
                return
            entry = kmsg[msg.bdf] = {"samples": []}
        group: dict[str, Any] | None = entry.get(msg.severity)
        if group is None:
            group = {"count": 0, "first": when, "last": when, "errors": []}
            entry[msg.severity] = group
        group["count"] += 1
        # min() and max() as comparisons: the same result (NaN included), per line of a storm
        if when < group["first"]:
            group["first"] = when
        if when > group["last"]:
            group["last"] = when
        entry["current"] = msg.severity
        if msg.reporter != msg.bdf:
            entry["reported_by"] = msg.reporter
        if msg.severity != "correctable" and len(entry["samples"]) < _MAX_SAMPLES:
            entry["samples"].append(line.strip()[:300])
        return
    # detail lines carry the reporter's prefix; old kernels name the source only in the header
    entry = kmsg.get(last_header.get(msg.reporter, msg.reporter))
    if entry is None or "current" not in entry:
        return
    _detail(entry[entry["current"]], msg)


def _detail(group: dict[str, Any], msg: pcihw.AerLogLine) -> None:
    """A detail line (status, error bit) of the report counted in ``group``."""
    if msg.kind == "status":
        group["device_ids"] = msg.ids
        group["status_mask"] = f"{msg.status}/{msg.mask}"
    elif msg.name and msg.name not in group["errors"] and len(group["errors"]) < MAX_NAMES:
        group["errors"].append(msg.name)


def _details(group: dict[str, Any], said: Mapping[str, Any]) -> None:
    """Detail lines folded apart (``_detail`` on another group) added to ``group``, as if they
    had come one by one: the status is the latest one, names are added in order, unseen ones
    only, up to MAX_NAMES."""
    if "device_ids" in said:
        group["device_ids"] = said["device_ids"]
        group["status_mask"] = said["status_mask"]
    names: list[str] = group["errors"]
    for name in said["errors"]:
        if len(names) >= MAX_NAMES:
            break
        if name not in names:
            names.append(name)


def _fold_parse(line: str) -> pcihw.AerLogLine | tuple[str, str, str] | None:
    """What :meth:`AerFold.add` makes of one line: an AER report's line, a summary line
    (:func:`_parse_summary`), or None."""
    msg = pcihw.parse_aer_message(line)
    if msg is not None:
        return msg
    return _parse_summary(line) if "AER:" in line else None


def _ingest_summary(kmsg: dict[str, Any], line: str, when: float) -> tuple[str, str] | None:
    """An AER summary or "not recovered" line, counted on the function it names; returns
    (that function, the kind of report), None for another line."""
    parsed = _parse_summary(line)
    return None if parsed is None else _count_summary(kmsg, parsed, line, when)


def _parse_summary(line: str) -> tuple[str, str, str] | None:
    """An AER summary or "not recovered" line: (the function it names, the kind of report,
    "summary" or "not_recovered"); None for another line."""
    m = _AER_SUMMARY_RE.search(line)
    lost = None if m is not None else _AER_LOST_RE.search(line)
    if m is not None:
        reporter = m.group("bdf").lower()
        bdf = (m.group("src") or "").lower() or reporter
        if m.group("id"):
            value = int(m.group("id"), 16)
            bdf = f"{reporter[:4]}:{value >> 8:02x}:{(value & 0xFF) >> 3:02x}.{value & 7}"
        sev = (m.group("sev") or "").lower()
        kind = "correctable" if m.group("kind").lower().startswith("correct") else (
            "fatal" if sev == "fatal" else "nonfatal")
        key = "summary"
    elif lost is not None:
        bdf = lost.group("bdf").lower()
        kind = lost.group("what").lower()
        key = "not_recovered"
    else:
        return None
    return bdf, kind, key


def _count_summary(kmsg: dict[str, Any], parsed: tuple[str, str, str], line: str,
                   when: float) -> tuple[str, str]:
    """Count a summary line (:func:`_parse_summary`) on the function it names: (it, the kind)."""
    bdf, kind, key = parsed
    entry = kmsg.get(bdf)
    if entry is None:
        if len(kmsg) >= _MAX_LOG_DEVICES:
            return bdf, kind
        entry = kmsg[bdf] = {"samples": []}
    groups: dict[str, dict[str, Any]] | None = entry.get(key)
    if groups is None:
        groups = entry[key] = {}
    group: dict[str, Any] | None = groups.get(kind)
    if group is None:
        group = groups[kind] = {"count": 0, "first": when, "last": when}
    group["count"] += 1
    if when < group["first"]:  # min() and max(), as in _ingest
        group["first"] = when
    if when > group["last"]:
        group["last"] = when
    if kind != "correctable" and len(entry["samples"]) < _MAX_SAMPLES:
        entry["samples"].append(line.strip()[:300])
    return bdf, kind
