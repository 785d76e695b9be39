"""ib: InfiniBand / RoCE port downtime, link rate and link error rates from sysfs.

What kills a multi-node NCCL job is a rail that stays down longer than the IB
transport's retry budget, not how often it flaps (DESIGN.md, "Lessons from the
field"). So each run samples every port's ``state``/``phys_state`` and keeps,
per port, the outages of a sliding window (default 24 h) in ``ctx.state``:

- an outage is measured from the first sample that saw the port down to the
  first sample that saw it up again, so at the default 1 s interval its
  duration is known to within one interval;
- ``link_downed`` deltas catch outages that began and ended between two
  samples: each one is counted, with "at most the time between the samples"
  as its duration bound;
- one outage longer than ``outage_fail_s`` (NCCL's IB timeout x retries), a
  port down right now for longer than that, or more than ``downtime_fail_s``
  of downtime in the window fails with ``check_cables``. The flap count is
  evidence only;
- a port already down at gpumon's first reading of it (down at boot, or when
  the daemon starts) is timed from that reading, like any other outage: it is
  at least that long. Ports that are down on purpose (an uncabled second port)
  belong in ``ignore_ports``.

Restarts and crashes never shorten a recorded outage: the state is saved (atomic,
fsync'd, through ``ctx.save_state_now``) at the sample where a port goes
down or comes back, not only on the daemon's 10 s timer. After a restart (same
boot) an outage left open is timed from its saved start to the first reading that
sees the port up again, so one that ended while gpumon was not running is counted
up to the restart (the safe side: gpumon cannot know it was shorter). A reboot
closes it at the last saved reading that saw the port down.
The state is the check's declared ``State`` (``state.IbState``), loaded, checked, saved and reset
at a reboot by the framework: saved state of another shape (another release, a hand edit) is
refused, with its reason logged, and the check starts afresh. The outage arithmetic is
``outages.py``.

InfiniBand ports are also compared with the profile (rate, port count);
Ethernet (RoCE) ports are checked for state and downtime only, since the
profile's numbers describe the InfiniBand compute fabric. symbol_error and
link_error_recovery are judged as counts over the last hour.

Each sample reads state, phys_state and link_downed; rate, link layer and the
error counters are read every 10 s and whenever a port was not up at the last
sample (so a link that retrains at a lower rate is seen at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition, NotSupported
from gpumon.hw.infiniband import (
    SAMPLE_COUNTERS,
    IbPort,
    LinkRate,
    component_for,
    list_devices,
    list_ports,
    read_ports,
)
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, reading

from .options import IbConfig
from .outages import per_hour, prune, sample
from .state import RATE_COUNTERS, Detail, IbState, Layout, Port

_EVIDENCE_OUTAGES = 5
# Every sample reads all ports in one bounded call, and each file still costs its open,
# read and close (~5 us of CPU, 8 ports x 3 files a second). Rate, link
# layer and the error counters only change when a link retrains, and their rates are
# judged per hour, so they are read every _DETAIL_S (and at every sample while a port
# is not up, to catch the rate it comes back at); state, phys_state and link_downed are
# read at every sample. Port folders are re-listed as often, or at once when one vanishes.
_DETAIL_S = 10.0


@dataclass
class _Issue:
    severity: Severity
    action: Action
    text: str


IB_READINGS = (
    ReadingSpec(
        "ib_downtime_seconds", "gauge",
        "Time this InfiniBand/RoCE port was down within the ib check's sliding window (window_s, default 24 "
        "h), an ongoing outage included.",
        unit="seconds",
        source="gpumon's timing of sysfs /sys/class/infiniband/<dev>/ports/<port>/state and phys_state, "
               "sampled every second by default"),
    ReadingSpec(
        "ib_outages", "gauge",
        "Outages of this InfiniBand/RoCE port within the ib check's sliding window (window_s, default 24 "
        "h), an ongoing one included; falls as outages leave the window, so a gauge, not a counter.",
        unit="outages",
        source="sysfs /sys/class/infiniband/<dev>/ports/<port>/state and phys_state samples, plus "
               "link_downed counter rises for outages shorter than the sampling interval"),
    ReadingSpec(
        "ib_longest_outage_seconds", "gauge",
        "Longest single outage of this InfiniBand/RoCE port within the ib check's sliding window (window_s, "
        "default 24 h), an ongoing one included; above outage_fail_s the port fails (check_cables).",
        unit="seconds",
        source="gpumon's timing of sysfs /sys/class/infiniband/<dev>/ports/<port>/state and phys_state "
               "samples"),
)


class IbCheck(Check):
    name = "ib"
    phase = Phase.CONTINUOUS
    description = "InfiniBand/RoCE ports: cumulative downtime, link_downed, rate, symbol/link-recovery errors"
    readings = IB_READINGS
    # Downtime is measured between samples: 1 s is the resolution the issue asks for.
    interval = 1.0
    timeout = 10.0
    Config = IbConfig
    State = IbState

    def __init__(self) -> None:
        # port component -> (what its steady finding depends on, options, profile, the finding):
        # see _verdict
        self._steady: dict[str, tuple[tuple[Any, ...], IbConfig, Any, Finding]] = {}

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.ib_devices:
            return "no InfiniBand/RDMA devices in /sys/class/infiniband"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(IbConfig)
        # an outage open at a reboot was closed when the state was reset (IbState.new_boot)
        state = ctx.state_as(IbState)
        found, changed = self._take_sample(ctx, options, state, ctx.clock())
        if changed:
            # an outage opened or closed must be on disk at once: a crash before the daemon's next
            # timed save would otherwise lose its start, and shorten it
            ctx.save_state_now()
        return found

    def _take_sample(self, ctx: CheckContext, options: IbConfig, state: IbState, now: float
                     ) -> tuple[list[Finding], bool]:
        """The sample's findings, and whether an outage opened or closed (or a port went missing)."""
        changed = False
        try:
            devices = [d for d in list_devices(ctx.hw.fs) if d not in options.ignore_devices]
        except HwCondition as cond:
            return [self.from_condition(cond, NODE)], changed
        ports = state.ports
        readings, unlisted, problems = self._read_all(ctx, devices, state, now)
        out: list[Finding] = []
        for key in options.ignore_ports:
            readings.pop(key, None)
        for key in sorted(set(ports) | set(readings)):
            dev = key.split("/", 1)[0]
            if dev in options.ignore_devices or key in options.ignore_ports:
                continue
            if key not in readings and dev in unlisted:
                readings[key] = unlisted[dev]  # not read, which is not the same as gone
            found, readings[key], moved = self._port(ctx, options, key, ports, readings.get(key), now)
            changed = changed or moved
            if found is not None:
                out.append(found)
        tracked = {k: p for k, p in ports.items()
                   if k.split("/", 1)[0] not in options.ignore_devices and k not in options.ignore_ports}
        out.append(self._node_finding(ctx, readings, tracked, problems))
        return out, changed

    # -- reading -----------------------------------------------------------

    def _read_all(self, ctx: CheckContext, devices: list[str], state: IbState, now: float
                  ) -> tuple[dict[str, IbPort | HwCondition | None], dict[str, HwCondition], list[str]]:
        """key "dev/port" -> reading, the condition that stopped it, or None when it is gone;
        devices whose ports could not be listed; what went wrong at device level (said in
        the node finding)."""
        unlisted: dict[str, HwCondition] = {}
        problems: list[str] = []
        layout = state.layout
        stale = layout.t is None or now - layout.t >= _DETAIL_S or set(layout.ports) != set(devices)
        if stale:
            layout.ports, layout.t = {}, now
        wanted, marks = self._wanted(ctx, devices, layout, stale, unlisted, problems)
        readings = _read(ctx, wanted, state.ports, now)
        gone = None if stale else next((k.split("/", 1)[0] for k, r in readings.items() if r is None), None)
        if gone is not None:
            # A port folder went away: list its device again now, so the node finding says
            # so, and every device after it before its ports count (what reading the ports
            # one device at a time did); the ports already read stay read.
            later = devices[devices.index(gone) + 1:]
            del problems[marks[gone]:]
            for key in [k for k in readings if k.split("/", 1)[0] in later]:
                del readings[key]
            self._list(ctx, gone, layout, unlisted, problems)
            again, _ = self._wanted(ctx, later, layout, True, unlisted, problems)
            readings.update(_read(ctx, again, state.ports, now))
        return readings, unlisted, problems

    def _wanted(self, ctx: CheckContext, devices: list[str], layout: Layout, relist: bool,
                unlisted: dict[str, HwCondition], problems: list[str]
                ) -> tuple[list[tuple[str, int]], dict[str, int]]:
        """The ports to read (listing each device first when ``relist``), and how many
        problems had been said once each device was done (where to take up again)."""
        wanted: list[tuple[str, int]] = []
        marks: dict[str, int] = {}
        for dev in devices:
            if not relist or self._list(ctx, dev, layout, unlisted, problems):
                for port in layout.ports[dev]:
                    if component_for(dev, port) is None:
                        problems.append(f"device name {dev!r} cannot name a component")
                        break
                    wanted.append((dev, port))
            marks[dev] = len(problems)
        return wanted, marks

    def _list(self, ctx: CheckContext, dev: str, layout: Layout, unlisted: dict[str, HwCondition],
              problems: list[str]) -> bool:
        try:
            ports = list_ports(ctx.hw.fs, dev)
        except HwCondition as cond:
            layout.ports.pop(dev, None)
            layout.t = None  # list again next time
            unlisted[dev] = cond
            problems.append(f"{dev}: cannot list ports: {cond}")
            return False
        if not ports:
            problems.append(f"{dev} is in /sys/class/infiniband but shows no ports")
        layout.ports[dev] = ports
        return True

    # -- one port ----------------------------------------------------------

    def _port(self, ctx: CheckContext, options: IbConfig, key: str, ports: dict[str, Port],
              reading: IbPort | HwCondition | None, now: float
              ) -> tuple[Finding | None, IbPort | HwCondition | None, bool]:
        """The port's finding, its reading completed from the last full one, and whether an
        outage opened or closed (or a port went missing) at this sample."""
        dev, _, num = key.partition("/")
        comp = component_for(dev, int(num))
        if comp is None:
            return None, reading, False
        pst = ports.get(key)
        if pst is None:
            if not isinstance(reading, IbPort):
                # never read successfully: nothing to track, say why
                return (self.from_condition(reading, comp) if isinstance(reading, HwCondition)
                        else self.finding(comp, Severity.UNKNOWN, "port folder vanished while read")
                        ), reading, False
            pst = ports[key] = Port()
        changed = False
        if isinstance(reading, IbPort):
            reading = _with_details(pst, reading, now)
            changed = sample(pst, reading.up, now, reading)
            pst.missing_since = None
        elif reading is None:
            if pst.missing_since is None:
                pst.missing_since = now
                changed = True
            changed = sample(pst, False, now, None) or changed
        prune(pst, now, options)
        return self._verdict(ctx, options, comp, pst, reading, now), reading, changed

    def _verdict(self, ctx: CheckContext, options: IbConfig, comp: str, pst: Port,
                 reading: IbPort | HwCondition | None, now: float) -> Finding:
        """The port's finding. A port that is up with nothing in its windows gets, sample
        after sample, the same finding but for ``details_age_s``: that one is kept (in
        memory, by this check instance) and given the new age, instead of being worded again every
        second for every port."""
        steady = _steady(pst, reading)
        if steady is None:
            return self._judge(ctx, options, comp, pst, reading, now)
        last = self._steady.get(comp)
        assert pst.detail is not None  # a steady port has been read in full
        age = round(now - pst.detail.t, 1)
        if last is not None and last[0] == steady and last[1] is options and last[2] is ctx.profile:
            return _aged(last[3], age)
        found = self._judge(ctx, options, comp, pst, reading, now)
        self._steady[comp] = (steady, options, ctx.profile, found)
        return found

    def _judge(self, ctx: CheckContext, options: IbConfig, comp: str, pst: Port,
               reading: IbPort | HwCondition | None, now: float) -> Finding:
        issues: list[_Issue] = []
        evidence = _downtime_evidence(pst, now, options)
        issues += _downtime_issues(evidence, options)
        if reading is None:
            gone = now - (pst.missing_since if pst.missing_since is not None else now)
            sev = Severity.FAIL if gone > options.outage_fail_s else Severity.WARN
            issues.append(_Issue(sev, Action.REBOOT_NODE,
                                 f"port disappeared from /sys/class/infiniband {gone:.0f} s ago "
                                 "(HCA removed by the driver or fallen off the bus)"))
        elif isinstance(reading, HwCondition):
            cond = self.from_condition(reading, comp)
            issues.append(_Issue(cond.severity, cond.action, cond.message))
            evidence.update(cond.evidence)
        else:
            evidence.update(_reading_evidence(reading))
            evidence["details_age_s"] = round(now - (pst.detail.t if pst.detail is not None else now), 1)
            issues += self._reading_issues(ctx, options, reading, pst, evidence, now)
        return _finding(self, comp, issues, evidence)

    def _reading_issues(self, ctx: CheckContext, options: IbConfig, port: IbPort, pst: Port,
                        evidence: dict[str, Any], now: float) -> list[_Issue]:
        issues: list[_Issue] = []
        if not port.up:
            since = pst.down_since if pst.down_since is not None else now
            first = "" if pst.seen_up else (", since gpumon first read it (never seen ACTIVE/LinkUp: "
                                               "down at least that long)")
            issues.append(_Issue(Severity.WARN, Action.CHECK_CABLES,
                                 f"down now ({port.state}, {port.phys_state}) for "
                                 f"{now - since:.1f} s{first}"))
        if port.is_infiniband:
            issues += _rate_issues(ctx, port, evidence)
        elif port.link_layer == "Ethernet":
            evidence["profile_comparison"] = ("Ethernet (RoCE) port: state and downtime are checked, the "
                                              "profile's InfiniBand rate and port count do not apply")
        for counter, limit in (("symbol_error", options.symbol_error_warn_per_h),
                               ("link_error_recovery", options.link_error_recovery_warn_per_h)):
            per_h = per_hour(pst, counter, now, options)
            evidence[f"{counter}_per_h"] = round(per_h, 1)
            if per_h > limit:
                issues.append(_Issue(Severity.WARN, Action.CHECK_CABLES,
                                     f"{counter} at {per_h:.0f}/h over the last "
                                     f"{options.rate_window_s / 60:g} min (warn above {limit:g}/h)"))
        for attr, why in port.errors.items():
            issues.append(_Issue(Severity.UNKNOWN, Action.NONE, f"{attr} unreadable: {why}"))
        return issues

    # -- node --------------------------------------------------------------

    def _node_finding(self, ctx: CheckContext, readings: dict[str, IbPort | HwCondition | None],
                      ports: dict[str, Port], problems: list[str]) -> Finding:
        found = self._count_finding(ctx, readings, ports)
        if not problems:
            return found
        evidence = {**found.evidence, "device_problems": problems}
        text = "; ".join(problems)
        if found.severity in (Severity.OK, Severity.SKIPPED):
            return self.finding(NODE, Severity.UNKNOWN, f"{text} ({found.message})", **evidence)
        return self.finding(NODE, found.severity, f"{found.message}; {text}", found.action, **evidence)

    def _count_finding(self, ctx: CheckContext, readings: dict[str, IbPort | HwCondition | None],
                       ports: dict[str, Port]) -> Finding:
        read = {k: r for k, r in readings.items() if isinstance(r, IbPort)}
        ib = sorted(k for k, r in read.items() if r.is_infiniband)
        active = [k for k in ib if read[k].up]
        other = sorted(k for k, r in read.items() if r.link_layer == "Ethernet")
        # a port whose state or link layer cannot be read may well be InfiniBand:
        # it is not counted as missing
        unreadable = sorted(k for k, r in readings.items()
                            if isinstance(r, HwCondition) or (isinstance(r, IbPort) and r.link_layer
                                                              not in ("InfiniBand", "Ethernet")))
        vanished = sorted(k for k, p in ports.items() if readings.get(k) is None
                          and p.missing_since is not None)
        expected = ctx.profile.network.ib_ports
        evidence: dict[str, Any] = {"infiniband_ports": ib, "active_infiniband_ports": len(active),
                                    "other_rdma_ports": other, "expected_ib_ports": expected,
                                    "profile": ctx.profile.name}
        if unreadable:
            evidence["unreadable_ports"] = unreadable
        if vanished:
            evidence["vanished_ports"] = vanished
        if other:
            evidence["note"] = "Ethernet (RoCE) ports are not counted against the profile's InfiniBand ports"
        if expected is None:
            return self.finding(NODE, Severity.SKIPPED,
                                f"{len(ib)} InfiniBand ports; profile {ctx.profile.name} gives no "
                                "InfiniBand port count to compare", **evidence)
        missing = expected - len(ib) - len(unreadable)
        if missing <= 0 and len(ib) < expected:
            # the shortfall is all ports that could not be read: they may be there, or not
            return self.finding(NODE, Severity.UNKNOWN,
                                f"{len(ib)} InfiniBand ports present, {len(unreadable)} unreadable "
                                f"({', '.join(unreadable)}), profile {ctx.profile.name} expects {expected}",
                                **evidence)
        if missing <= 0:
            return self.ok(NODE, f"{len(ib)} InfiniBand ports present ({len(active)} active), "
                                 f"profile {ctx.profile.name} expects {expected}", **evidence)
        # A missing HCA is a missing NCCL rail: in a rail-optimised fabric GPU i talks
        # through HCA i, so NCCL either refuses the job (NCCL_IB_HCA lists the device)
        # or pushes that GPU's traffic through another rail across PCIe/SMP, and every
        # collective of the job then runs at the slowest rank's speed: fail, not warn.
        # A port that vanished this boot may come back with the driver (reboot);
        # one that was never there needs hands on the hardware.
        action = Action.REBOOT_NODE if len(vanished) >= missing else Action.INSPECT_HARDWARE
        return self.finding(NODE, Severity.FAIL,
                            f"{len(ib)} InfiniBand ports, profile {ctx.profile.name} expects "
                            f"{expected}: {missing} missing (a missing HCA is a missing NCCL rail)",
                            action, **evidence)


# -- details ------------------------------------------------------------------


def _read(ctx: CheckContext, wanted: list[tuple[str, int]], ports: dict[str, Port],
          now: float) -> dict[str, IbPort | HwCondition | None]:
    """key "dev/port" -> reading, what stopped it, or None when the port folder (or its state
    file) is gone: every port in one bounded call, each in full or state-only (see _DETAIL_S)."""
    plan: list[tuple[str, int, bool]] = []
    for dev, port in wanted:
        pst = ports.get(f"{dev}/{port}")
        detail = pst.detail if pst is not None else None
        full = pst is None or detail is None or now - detail.t >= _DETAIL_S or pst.last_up is not True
        plan.append((dev, port, full))
    got = read_ports(ctx.hw.fs, plan, sample_counters=SAMPLE_COUNTERS)
    return {f"{dev}/{port}": None if isinstance(r, NotSupported) else r for (dev, port), r in got.items()}


def _steady(pst: Port, reading: IbPort | HwCondition | None) -> tuple[Any, ...] | None:
    """Everything a port's finding depends on but its details_age_s, when that is all: the
    port is up, with no outage open or in the window and no error in the rate window, so
    that neither its downtime nor its hourly error rates depend on the time. None otherwise."""
    if (not isinstance(reading, IbPort) or not reading.up or pst.down_since is not None
            or pst.missing_since is not None or pst.outages
            or any(pst.buckets[c] for c in RATE_COUNTERS)):
        return None
    return (reading.state, reading.phys_state, reading.rate, reading.link_layer,
            tuple(reading.counters.items()), tuple(reading.errors.items()), pst.resets)


def _aged(found: Finding, age: float) -> Finding:
    """``found`` with details_age_s set to ``age``; its lists copied, so that no two
    findings share one."""
    evidence = {k: [list(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v
                for k, v in found.evidence.items()}
    evidence["details_age_s"] = age
    return Finding(found.check, found.component, found.severity, found.message, found.action, evidence)


def _with_details(pst: Port, port: IbPort, now: float) -> IbPort:
    """A complete reading: a full one is remembered, a state-only one is completed from
    the last full one (rate, link layer, error counters and why any were unreadable)."""
    if port.complete:
        rate = port.rate
        pst.detail = Detail(now, (rate.gbps, rate.lanes, rate.speed) if rate else None, port.link_layer,
                             dict(port.counters), dict(port.errors))
        return port
    d = pst.detail
    assert d is not None  # a state-only reading is asked for only after a full one
    return dataclasses.replace(
        port, rate=LinkRate(float(d.rate[0]), d.rate[1], d.rate[2]) if d.rate else None,
        link_layer=d.link_layer, counters={**d.counters, **port.counters},
        errors={**{k: v for k, v in d.errors.items()
                   if k.removeprefix("counters/") not in SAMPLE_COUNTERS}, **port.errors},
        complete=True)


# -- judgement ---------------------------------------------------------------


def _downtime_evidence(p: Port, now: float, options: IbConfig) -> dict[str, Any]:
    records = p.outages
    ongoing = max(0.0, now - p.down_since) if p.down_since is not None else None
    measured = sum(r.down_s for r in records) + (ongoing or 0.0)
    bound = sum(r.max_s for r in records) + (ongoing or 0.0)
    longest = max([r.longest_s for r in records] + [ongoing or 0.0])
    counter_only = sum(r.n for r in records if r.kind == "link_downed")
    ev: dict[str, Any] = {
        "window_s": options.window_s,
        "downtime_s": round(measured, 1),
        "downtime_upper_bound_s": round(bound, 1),
        "outages": sum(r.n for r in records) + (1 if ongoing is not None else 0),
        "longest_outage_s": round(longest, 1),
        "outages_seen_only_by_link_downed": counter_only,
        "counter_resets": p.resets,
    }
    ev["readings"] = [reading("ib_downtime_seconds", measured), reading("ib_outages", ev["outages"]),
                      reading("ib_longest_outage_seconds", longest)]
    if ongoing is not None:
        ev["ongoing_outage_s"] = round(ongoing, 1)
        if not p.seen_up:
            ev["ongoing_outage_note"] = (
                "down at gpumon's first reading of this port (at boot, at daemon start, or never up): "
                "timed from that reading, so the port has been down at least this long")
    if records:
        ev["recent_outages"] = [
            {"start": r.start, "end": r.end, "down_s": round(r.down_s, 1),
             "at_most_s": round(r.max_s, 1), "n": r.n, "seen_by": r.kind}
            for r in records[-_EVIDENCE_OUTAGES:]]
    if counter_only:
        ev["outages_by_link_downed_note"] = (
            "outages seen only through link_downed began and ended between two samples: counted, with "
            "no measured duration (at most the gap between the samples, see downtime_upper_bound_s)")
    return ev


def _downtime_issues(ev: dict[str, Any], options: IbConfig) -> list[_Issue]:
    issues: list[_Issue] = []
    window = f"{options.window_s / 3600:g} h"
    ongoing = ev.get("ongoing_outage_s")
    if ongoing is not None and ongoing > options.outage_fail_s:
        issues.append(_Issue(Severity.FAIL, Action.CHECK_CABLES,
                             f"down for {ongoing:.1f} s now, longer than the {options.outage_fail_s:g} s "
                             "NCCL IB timeout: collectives on this rail fail"))
    elif ev["longest_outage_s"] > options.outage_fail_s:
        issues.append(_Issue(Severity.FAIL, Action.CHECK_CABLES,
                             f"an outage of {ev['longest_outage_s']:.1f} s in the last {window}, longer "
                             f"than the {options.outage_fail_s:g} s NCCL IB timeout"))
    if ev["downtime_s"] > options.downtime_fail_s:
        issues.append(_Issue(Severity.FAIL, Action.CHECK_CABLES,
                             f"{ev['downtime_s']:.1f} s down in the last {window} over {ev['outages']} "
                             f"outages (fail above {options.downtime_fail_s:g} s)"))
    return issues


def _rate_issues(ctx: CheckContext, port: IbPort, evidence: dict[str, Any]) -> list[_Issue]:
    want = ctx.profile.network.ib_rate_gbps
    if want is None:
        evidence["profile_comparison"] = f"profile {ctx.profile.name} gives no InfiniBand rate to compare"
        return []
    evidence["expected_rate_gbps"] = want
    if port.rate is None or not port.up:
        return []
    if port.rate.gbps < want:
        return [_Issue(Severity.WARN, Action.CHECK_CABLES,
                       f"link at {port.rate}, profile {ctx.profile.name} expects {want:g} Gb/s "
                       "(a degraded cable or transceiver trains at a lower rate or width)")]
    return []


def _reading_evidence(port: IbPort) -> dict[str, Any]:
    ev: dict[str, Any] = {"state": str(port.state), "phys_state": str(port.phys_state),
                          "rate": str(port.rate) if port.rate is not None else None,
                          "rate_gbps": port.rate.gbps if port.rate is not None else None,
                          "link_layer": port.link_layer}
    ev.update({k: v for k, v in port.counters.items()})
    saturated = port.saturated()
    if saturated:
        ev["saturated_counters"] = saturated
    if "link_downed" in saturated:
        # Not a warning: 255 is lifetime history of unknown age (it also reads 255 on
        # a healthy all-ACTIVE real H100 node), there is nothing to act on but clearing
        # it, and a permanent warn would teach operators to ignore this check. What is
        # lost is only sub-sample outages; outages of a sample or longer are still timed.
        ev["link_downed_saturated_note"] = ("link_downed reads 255, the saturated value of the 8-bit IB "
                                  "PortCounters LinkDownedCounter: outages shorter than one sample can "
                                  "no longer be seen on this port (clear the counters, e.g. "
                                  "perfquery -R, to restore that); outages of a sample or longer are "
                                  "still measured from the port state")
    return ev


def _finding(check: Check, comp: str, issues: list[_Issue], evidence: dict[str, Any]) -> Finding:
    if not issues:
        return check.ok(comp, _ok_message(evidence), **evidence)
    issues.sort(key=lambda i: (i.severity, i.action), reverse=True)
    worst = issues[0]
    action = max(i.action for i in issues if i.severity is worst.severity)
    return check.finding(comp, worst.severity, "; ".join(i.text for i in issues), action, **evidence)


def _ok_message(ev: dict[str, Any]) -> str:
    parts = [f"up at {ev.get('rate') or 'unknown rate'} ({ev.get('link_layer')})"]
    if ev.get("link_layer") == "Ethernet":
        parts.append("RoCE port: state and downtime checked, not compared with the profile's "
                     "InfiniBand rate and port count")
    if ev["outages"]:
        parts.append(f"{ev['outages']} outage(s) in the window, {ev['downtime_s']:.1f} s down, "
                     f"longest {ev['longest_outage_s']:.1f} s: below the fail thresholds")
    if "link_downed" in ev.get("saturated_counters", ()):
        parts.append("link_downed saturated at 255: sub-sample outages are invisible on this port")
    return "; ".join(parts)
