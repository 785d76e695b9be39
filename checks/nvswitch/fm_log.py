"""The nvswitch check's ``fm_log`` reading: fabric manager's log, followed across runs
(gpumon.hw.fabricmanager). "detected NVSwitch <fatal|non-fatal> error N" entries are judged by the
SXid catalog, per switch; other [ERROR]/[CRITICAL] entries warn; entries stamped before this boot
are skipped. The check's docstring has the rules and their sources."""

from __future__ import annotations

import dataclasses
from datetime import timezone, tzinfo
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition
from gpumon.hw.fabricmanager import (
    DEFAULT_LOG_PATH,
    FabricManagerLog,
    FmLogEntry,
    NvSwitchError,
    entry_epoch,
    host_timezone,
    nvswitch_error,
    older_than_boot,
)
from gpumon.model import NODE, Action, Finding, Severity, nvswitch, pci

from .catalog import default_verdict, lookup
from .evidence import MAX_LINKS, catalog_evidence, repeated, sample, short_name, tagged
from .options import NvswitchConfig
from .state import FmOtherGroup, FmStats, FmSwitchGroup, NvswitchState

_FM_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL", "FATAL"})


def findings(check: Check, ctx: CheckContext, state: NvswitchState, p: NvswitchConfig, now: float,
             boot_time: float | None) -> list[Finding]:
    rel = p.fm_log_path or DEFAULT_LOG_PATH
    fm = state.fm
    groups = fm.groups
    reader = FabricManagerLog(ctx.hw.fs, rel, max_read_bytes=p.fm_log_max_read_bytes,
                              initial_tail_bytes=p.fm_log_initial_tail_bytes)
    try:
        res = reader.follow(fm.cursor)
    except HwCondition as exc:
        failed = tagged(check.from_condition(exc, NODE), "fm_log")
        return [failed, *_fm_findings(check, groups, state, now, p)]
    source = str(reader.path)
    if res.missing:
        fm.cursor = None
        if p.fm_log_path is None:
            # an optional source: a note on the node's finding, not its verdict (see check._merged)
            head = check.finding(NODE, Severity.SKIPPED,
                                 f"fabric manager log not found at {source} (fabric manager may log "
                                 "to syslog or elsewhere: set fm_log_path); fabric health is judged "
                                 "from NVML and the SXid lines", reading="fm_log", source=source)
        else:
            head = check.finding(NODE, Severity.UNKNOWN, f"the configured fabric manager log {source} "
                                 "does not exist", reading="fm_log", source=source)
        return [head, *_fm_findings(check, groups, state, now, p)]
    fm.cursor = res.cursor
    tz, tz_note = _fm_timezone(ctx, p.fm_log_timezone)
    if fm.stats is None:
        fm.stats = FmStats()
    stats = fm.stats
    stats.entries += len(res.entries)
    stats.orphan_lines += res.orphan_lines
    stats.malformed += res.malformed_lines
    stats.skipped_bytes += res.skipped_bytes
    stats.rotations += int(res.replaced)
    stats.truncations += int(res.truncated)
    for entry in res.entries:
        if older_than_boot(entry_epoch(entry, tz), boot_time):
            stats.older_boot += 1
            continue
        _add_fm_entry(groups, entry, ctx, state, now, p)
    found = _fm_findings(check, groups, state, now, p)
    if not found:
        ev = dict(dataclasses.asdict(stats), reading="fm_log", source=source,
                  behind_bytes=res.behind_bytes, quiet_groups=len(groups))
        if tz_note:
            ev["timezone_note"] = tz_note
        message = ("no NVSwitch or other errors in the fabric manager log this boot" if not groups else
                   f"no recent errors in the fabric manager log ({len(groups)} non-fatal kinds went "
                   f"quiet more than {p.recent_window_s:g} s ago)")
        found.append(check.ok(NODE, message, **ev))
    return found


def _add_fm_entry(groups: dict[str, FmSwitchGroup | FmOtherGroup], entry: FmLogEntry,
                  ctx: CheckContext, state: NvswitchState, now: float, p: NvswitchConfig) -> None:
    err = nvswitch_error(entry.message)
    if err is not None:
        if err.code not in p.ignore_codes:
            _add_fm_error(groups, err, entry, _fm_component(ctx, state, err), now)
    elif entry.level in _FM_ERROR_LEVELS:
        g = groups.get("other")
        if not isinstance(g, FmOtherGroup):  # a switch's key never reads "other" (it has a "|")
            g = groups["other"] = FmOtherGroup("other", 0, [], entry.stamp, entry.stamp, now, [])
        g.count += 1
        g.last_stamp = entry.stamp
        g.seen = now
        if entry.level not in g.levels:
            g.levels.append(entry.level)
        sample(g.samples, f"[{entry.level}] {entry.message}")


def _fm_findings(check: Check, groups: dict[str, FmSwitchGroup | FmOtherGroup], state: NvswitchState,
                 now: float, p: NvswitchConfig) -> list[Finding]:
    out: list[Finding] = []
    for g in groups.values():
        f = _fm_finding(check, g, state, now, p)
        if f is not None:
            out.append(f)
    return out


def _fm_finding(check: Check, g: FmSwitchGroup | FmOtherGroup, state: NvswitchState, now: float,
                p: NvswitchConfig) -> Finding | None:
    if isinstance(g, FmOtherGroup):
        if now - g.seen > p.recent_window_s:
            return None
        entries = "entry" if g.count == 1 else "entries"
        message = f"{g.count} error {entries} in the fabric manager log"
        return check.finding(NODE, Severity.WARN, message, reading="fm_log", count=g.count,
                             levels=g.levels, first_stamp=g.first_stamp,
                             last_stamp=g.last_stamp, samples=g.samples)
    code = g.code
    info = lookup(code)
    verdicts = []
    if g.fatal:
        verdicts.append(info.verdict(True) if info else default_verdict("", True))
    if g.nonfatal:
        verdicts.append(info.verdict(False) if info else default_verdict("", False))
    severity, action = max(verdicts, key=lambda v: (v[0].rank, v[1].rank))
    if severity is Severity.WARN and now - g.seen > p.recent_window_s:
        return None
    note = ""
    if severity is Severity.FAIL and action is Action.REBOOT_NODE and g.pci and repeated(
            state, f"{g.pci}|{code}", now, p.repeat_window_s):
        action = Action.INSPECT_HARDWARE
        note = "; seen on this switch in an earlier boot too"
    words = [w for w, n in (("fatal", g.fatal), ("non-fatal", g.nonfatal)) if n]
    count = g.fatal + g.nonfatal
    ports = ", ".join(f"{k} ({v}x)" if v > 1 else k for k, v in sorted(g.ports.items(),
                                                                     key=lambda kv: int(kv[0])))
    message = (f"fabric manager: {' and '.join(words)} NVSwitch error {code} {short_name(info)} on "
               f"{g.component}: {count} entr{'y' if count == 1 else 'ies'}"
               f"{', ports ' + ports if ports else ''}{note}")
    evidence: dict[str, Any] = {
        "reading": "fm_log", "code": code, "pci_bus_id": g.pci, "count": count,
        "fatal_count": g.fatal, "nonfatal_count": g.nonfatal, "ports": g.ports,
        "physical_ids": g.physical_ids, "first_stamp": g.first_stamp, "last_stamp": g.last_stamp,
        "samples": g.samples,
    }
    evidence.update(catalog_evidence(info))
    return check.finding(g.component, severity, message, action, **evidence)


def _fm_timezone(ctx: CheckContext, name: str) -> tuple[tzinfo, str | None]:
    if name == "UTC":
        return timezone.utc, None
    if name == "host":
        tz = host_timezone(ctx.hw.fs)
        if tz is None:
            return timezone.utc, "host time zone unreadable (etc/localtime): stamps read as UTC"
        return tz, None
    from zoneinfo import ZoneInfo

    return ZoneInfo(name), None


def _fm_component(ctx: CheckContext, state: NvswitchState, err: NvSwitchError) -> str:
    """nvswitch/<N> for the switch at the error's PCI address: N as the driver numbered it in SXid
    lines this boot, else its place among the NVSwitches on the bus (the driver probes them in bus
    order, tests/data/kmsg-xid/dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log), else pci/<bus>."""
    if err.pci is None:
        return NODE
    learned = state.switch_pci.get(err.pci)
    if learned is not None:
        return nvswitch(learned)
    buses = sorted(d.bus_id for d in ctx.inventory.pci_devices if d.is_nvswitch)
    if err.pci in buses:
        return nvswitch(buses.index(err.pci))
    return pci(err.pci)


def _add_fm_error(groups: dict[str, FmSwitchGroup | FmOtherGroup], err: NvSwitchError, entry: FmLogEntry,
                  component: str, now: float) -> None:
    key = f"{component}|{err.code}"
    g = groups.get(key)
    if not isinstance(g, FmSwitchGroup):  # "other" never has a "|"
        g = groups[key] = FmSwitchGroup("nvswitch", component, err.code, err.pci, int(err.fatal),
                                        int(not err.fatal), {}, [], entry.stamp, entry.stamp, now, [])
    elif err.fatal:
        g.fatal += 1
    else:
        g.nonfatal += 1
    if err.port is not None and (str(err.port) in g.ports or len(g.ports) < MAX_LINKS):
        g.ports[str(err.port)] = g.ports.get(str(err.port), 0) + 1
    if err.physical_id is not None and err.physical_id not in g.physical_ids:
        g.physical_ids.append(err.physical_id)
    g.last_stamp = entry.stamp
    g.seen = now
    sample(g.samples, f"[{entry.stamp}] [{entry.level}] {entry.message}")
