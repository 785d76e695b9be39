"""The nvswitch check's ``sxid`` reading: SXid lines of the NVSwitch driver in the kernel log
(gpumon.hw.nvrm.SXidEvent), the lines of one error folded into one event, events into one group per
switch and code for the boot (``NvswitchState.sxid``), each group judged by the line's own word or
the catalog (checks/nvswitch/catalog.py). The check's docstring has the rules and their sources."""

from __future__ import annotations

import re
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.hw.nvrm import SXidEvent
from gpumon.model import NODE, Action, Finding, Severity, nvswitch

from .catalog import SXidInfo, default_verdict, lookup
from .evidence import MAX_LINKS, catalog_evidence, repeated, sample, short_name
from .options import NvswitchConfig
from .state import NvswitchState, OpenEvent, SxidGroup, SxidMark

_ENGINE_RE = re.compile(r"Engine instance (\d{1,6})")


def findings(check: Check, ctx: CheckContext, state: NvswitchState, p: NvswitchConfig,
             now: float) -> list[Finding]:
    log = ctx.kernel_log
    if not log.available:
        return [check.finding(NODE, Severity.UNKNOWN,
                              f"kernel log unreadable: {log.error or 'unknown reason'}; SXid errors "
                              "cannot be ruled out", reading="sxid", source=log.source)]
    groups = state.sxid
    switch_pci = state.switch_pci
    seen = _Watermark(state)
    for event in log.events:
        if not isinstance(event, SXidEvent) or event.code in p.ignore_codes or seen.before(event.record):
            continue
        if event.pci:
            switch_pci[event.pci] = event.switch
        _add_sxid_line(groups, event, log.time_of(event.record, now), p.event_gap_s)
    seen.save()
    found = []
    for g in groups.values():
        f = _finding(check, g, state, now, p)
        if f is not None:
            found.append(f)
    if not found:
        quiet = len(groups)
        message = ("no SXid errors in the kernel log this boot" if not quiet else
                   f"no recent SXid errors in the kernel log ({quiet} non-fatal ones went quiet "
                   f"more than {p.recent_window_s:g} s ago)")
        found.append(check.ok(NODE, message, reading="sxid", source=log.source, quiet_groups=quiet,
                              records_read=log.records_read, lost_records=log.lost_records))
    return found


def _finding(check: Check, g: SxidGroup, state: NvswitchState, now: float,
             p: NvswitchConfig) -> Finding | None:
    code = g.code
    info = lookup(code)
    severity, action, said = _group_verdict(info, g)
    if severity is Severity.WARN and now - g.last > p.recent_window_s:
        return None
    note = ""
    if severity is Severity.FAIL and action is Action.REBOOT_NODE and repeated(
            state, f"{g.pci or g.switch}|{code}", now, p.repeat_window_s):
        action = Action.INSPECT_HARDWARE
        note = (f"; seen on this switch in an earlier boot within {p.repeat_window_s / 86400:g} days "
                "(NVIDIA: a fatal SXid that returns after the reset means inspect the NVSwitch)")
    counts = []
    if g.fatal_events:
        counts.append(f"{g.fatal_events} fatal")
    if g.nonfatal_events:
        counts.append(f"{g.nonfatal_events} non-fatal")
    if g.unsaid_events:
        counts.append(f"{g.unsaid_events} without a Fatal/Non-fatal line")
    links = f", links {', '.join(map(str, sorted(g.links)))}" if g.links else ""
    component = nvswitch(g.switch)
    message = (f"SXid {code} {short_name(info)} on {component}: {g.events} event"
               f"{'s' if g.events != 1 else ''} ({', '.join(counts)}){links}{note}")
    evidence: dict[str, Any] = {
        "reading": "sxid", "code": code, "pci_bus_id": g.pci, "events": g.events,
        "lines": g.lines, "fatal_events": g.fatal_events, "nonfatal_events": g.nonfatal_events,
        "unsaid_events": g.unsaid_events, "class_from": said, "links": sorted(g.links),
        "first_seen": g.first, "last_seen": g.last, "samples": g.samples,
    }
    evidence.update(catalog_evidence(info))
    return check.finding(component, severity, message, action, **evidence)


class _Watermark:
    """The last kernel record folded in this boot, so that records delivered again (the daemon
    re-reads the kernel ring after a restart, with this state restored) are not counted twice.

    /dev/kmsg sequence numbers when records have them, else kernel uptime; neither when the boot
    is unknown (both restart at a reboot).
    """

    def __init__(self, state: NvswitchState) -> None:
        self._state = state
        mark = state.sxid_mark if state.boot_id is not None else None
        self._seq: int | None = mark.seq if mark is not None else None
        self._mono: int | None = mark.mono if mark is not None else None
        self._new_seq, self._new_mono = self._seq, self._mono

    def before(self, record: Any) -> bool:
        seq = getattr(record, "seq", None)
        mono = getattr(record, "monotonic_us", None)
        if isinstance(seq, int):
            self._new_seq = max(self._new_seq or 0, seq)
            return self._seq is not None and seq <= self._seq
        if isinstance(mono, int):
            # <=: a record printed in the same microsecond as the last one but delivered in a later
            # batch is lost; the writer puts such lines in the file together, so it does not happen
            self._new_mono = max(self._new_mono or 0, mono)
            return self._mono is not None and mono <= self._mono
        return False

    def save(self) -> None:
        if self._state.boot_id is not None:
            self._state.sxid_mark = SxidMark(self._new_seq, self._new_mono)


def _add_link(links: list[int], link: int | None) -> None:
    if link is not None and link >= 0 and link not in links and len(links) < MAX_LINKS:
        links.append(link)


def _add_sxid_line(groups: dict[str, SxidGroup], ev: SXidEvent, when: float, gap: float) -> None:
    """Fold one SXid line into its switch+code group; lines close in time make one event.

    A line that says Fatal/Non-fatal starts an event, except when it completes a headless one
    just opened for the same engine (lines out of order); Severity/Data lines join the open
    event, or open a headless one (its head line was not seen: class from the catalog).
    """
    key = f"{ev.switch}|{ev.code}"
    g = groups.get(key)
    if g is None:
        g = groups[key] = SxidGroup(ev.switch, ev.pci, ev.code, 0, 0, 0, 0, 0, [], when, when, [], None)
    m = _ENGINE_RE.search(ev.message)
    engine = int(m.group(1)) if m else None
    open_ev = g.open
    within = open_ev is not None and abs(when - open_ev.t) <= gap
    if ev.fatal is not None:
        adopt = within and open_ev is not None and not open_ev.headed and open_ev.engine in (None, ev.link)
        if adopt and open_ev is not None:
            g.unsaid_events -= 1
            open_ev.t, open_ev.headed, open_ev.engine = when, True, ev.link
        else:
            g.events += 1
            g.open = OpenEvent(when, True, ev.link)
        if ev.fatal:
            g.fatal_events += 1
        else:
            g.nonfatal_events += 1
    elif within and open_ev is not None:
        open_ev.t = when
    else:
        g.events += 1
        g.unsaid_events += 1
        g.open = OpenEvent(when, False, engine)
    _add_link(g.links, ev.link if ev.link is not None else engine)
    g.lines += 1
    g.first = min(g.first, when)
    g.last = max(g.last, when)
    g.pci = g.pci or ev.pci
    sample(g.samples, ev.message)


def _group_verdict(info: SXidInfo | None, g: SxidGroup) -> tuple[Severity, Action, str]:
    """Worst verdict over the group's events, and where their class came from."""
    verdicts: list[tuple[Severity, Action]] = []
    said: list[str] = []
    if g.fatal_events:
        verdicts.append(info.verdict(True) if info else default_verdict("", True))
    if g.nonfatal_events:
        verdicts.append(info.verdict(False) if info else default_verdict("", False))
    if g.fatal_events or g.nonfatal_events:
        said.append("line")
    if g.unsaid_events:
        said.append("catalog" if info else "unknown")
        # a code neither source lists and no line saying fatal: a warning, not a guess at fatal
        verdicts.append(info.verdict(info.fatal) if info else (Severity.WARN, Action.NONE))
    severity, action = max(verdicts, key=lambda v: (v[0].rank, v[1].rank))
    return severity, action, "+".join(said)
