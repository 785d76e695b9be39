"""nvswitch: the NVSwitch fabric: SXid errors, GPU fabric registration, the fabric manager log.

Three readings (four with the profile's NVSwitch count, ``pci``), each judged on its own and named
in ``evidence.reading``. What leaves the check is one finding per component per run, the worst
reading winning: all ``node`` readings fold into one ``node`` finding (``evidence.reading`` "node",
each reading's verdict under its name: ``evidence.sxid``, ``evidence.fm_log``, ...), and a switch's
SXid and fabric-manager findings for the same code fold into one (``sxid+fm_log``); different codes
on one switch stay separate findings, as different faults. A ``skipped`` reading does not decide
the folded severity (see ``_merged``), so a healthy node is ``ok`` every run, not ``ok`` and
``skipped`` in turn.

- ``sxid``: SXid lines of the NVSwitch driver in the kernel log (gpumon.hw.nvrm.SXidEvent). One
  error prints several lines with the same switch and code within milliseconds ("Fatal, Link 48
  LTSSM Fault Up", "Severity 1 Engine instance 48 ...", "Data {...}"); they are folded into one
  *event*, and events into one finding per switch (``nvswitch/<N>`` from ``nvidia-nvswitchN``) and
  code for the boot, with counts. Fatal or not comes from the line's own word, else from the
  catalog (checks/nvswitch/catalog.py, which also gives severity and action and argues them).
- ``fabric_state``: NVML's GPU fabric info per GPU. A GPU joins the NVLink fabric when fabric
  manager registers it (state 3 "completed" with status 0; NVML API reference, nvmlGpuFabricInfo_t:
  status "must be checked only if state returns complete"); a GPU that did not register "will
  lose its NVLink peer-to-peer capability" (NVIDIA Fabric Manager user guide, as quoted in
  https://ai-infrastructure.net/runbook-fabric-manager-failure/; fabricmanager.cfg's
  ACCESS_LINK_FAILURE_MODE=0 likewise removes a GPU with a failed access link "from NVLink P2P
  capability", and with FM_STAY_RESIDENT_ON_FAILURES "the system will be uninitialized and CUDA
  application launch will fail"). Not started, in progress past
  ``fabric_grace_s`` after boot, or a non-zero status -> fail / reboot_node: registration happens
  when fabric manager brings the fabric up, and on an NVSwitch baseboard bringing it up again means
  stopping fabric manager and resetting the GPUs and switches together, which is what a reboot
  does (and all gpumon's vocabulary can say). NOT_SUPPORTED (before Hopper, PCIe boards) turns the
  reading off for that GPU (``skipped``).
- ``fm_log``: ``<host-root>/var/log/fabricmanager.log`` (``fm_log_path``), followed across runs
  through gpumon.hw.fabricmanager. "detected NVSwitch <fatal|non-fatal> error N ..." entries are
  judged by the same catalog, per switch; other [ERROR]/[CRITICAL] entries warn (fabric manager's
  levels, fabricmanager.cfg LOG_LEVEL: CRITICAL, ERROR, WARNING, INFO). A missing log at the
  default path (fabricmanager.cfg LOG_FILE_NAME=/var/log/fabricmanager.log) is a note in the node
  finding's evidence (``fm_log``: "fabric manager log not found at ..."), not a verdict and not
  ``unknown``: fabric manager may log to syslog (LOG_USE_SYSLOG=1) or to another file, and on
  GB200 compute trays the NVSwitches are in the rack's switch trays, not on the node; the fabric's
  health is judged from NVML and the SXid lines either way. A path the site configured that does
  not exist is ``unknown``. Entries stamped before this boot are skipped: the log is appended
  across restarts (LOG_APPEND_TO_LOG=1), and a fault the reboot cleared must not fail the node
  again.

Non-fatal findings stop being reported ``recent_window_s`` after they were last seen; fatal ones
stay for the boot. A fatal SXid whose remedy is a reboot, seen again on the same switch in a later
boot within ``repeat_window_s`` (the repeat-after-reboot rule of ``gpumon.bootstate``), becomes
inspect_hardware: "If the same SXid is returned, the
NVSwitch should be inspected and repaired" (Fabric Manager user guide, fatal SXid table, as
transcribed in leptonai/gpud components/accelerator/nvidia/sxid/sxid.go @ 09b59a5b).

The state (SXid groups, the fabric manager log's cursor and groups, the history across boots) is
the check's declared ``State`` (checks/nvswitch/state.py), loaded, checked, saved and reset at a
reboot by the framework: saved state of another shape is refused, with its reason logged, and the
check starts afresh.
"""

from __future__ import annotations

import dataclasses
import re
import uuid as uuidlib
from dataclasses import dataclass, field
from datetime import timezone, tzinfo
from typing import Any

from gpumon.bootstate import REPEAT_WINDOW_S, REPEAT_WINDOW_SOURCE, RepeatHistory
from gpumon.check import Check, CheckContext, KernelLogNeeds
from gpumon.errors import HwCondition, NotSupported
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
from gpumon.hw.inventory import Inventory
from gpumon.hw.kernellog import SavedKernelLog
from gpumon.hw.nvml import FabricInfo, GpuInfo
from gpumon.hw.nvrm import SXidEvent
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu, nvswitch, pci

from .catalog import NAME_PREFIX, SXidInfo, default_verdict, lookup
from .state import (
    FmOtherGroup,
    FmStats,
    FmSwitchGroup,
    NvswitchState,
    OpenEvent,
    SxidGroup,
    SxidMark,
)

_MAX_SAMPLES = 5
_MAX_LINKS = 64
_MAX_HISTORY_KEYS = 64
_PRE_HOPPER = frozenset({"kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada"})
_ENGINE_RE = re.compile(r"Engine instance (\d{1,6})")
_FM_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL", "FATAL"})

# nvmlGpuFabricState_t
_FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
# nvmlReturn_t names for the registration status (NVML API reference, nvmlReturn_t)
_NVML_RETURN = {
    1: "UNINITIALIZED", 2: "INVALID_ARGUMENT", 3: "NOT_SUPPORTED", 4: "NO_PERMISSION",
    6: "NOT_FOUND", 9: "DRIVER_NOT_LOADED", 10: "TIMEOUT", 15: "GPU_IS_LOST", 16: "RESET_REQUIRED",
    17: "OPERATING_SYSTEM", 19: "IN_USE", 20: "MEMORY", 21: "NO_DATA", 23: "INSUFFICIENT_RESOURCES",
    27: "NOT_READY", 28: "GPU_NOT_FOUND", 29: "INVALID_STATE", 999: "UNKNOWN",
}
# NVML fabric health mask fields (NVML API reference, "Fabric definitions":
# NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW = 0, _SHIFT_ROUTE_UNHEALTHY = 4, width 2 bits, _TRUE = 1)
_HEALTH_FLAGS = {"bandwidth degraded": 0, "route unhealthy": 4}


def _timezone_ok(name: str) -> bool:
    if name in ("UTC", "host"):
        return True
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo(name)
    except (KeyError, ValueError, OSError):  # ZoneInfoNotFoundError is a KeyError
        return False
    return True


@dataclass(frozen=True)
class NvswitchConfig:
    event_gap_s: float = field(default=1.0, metadata={
        "min": 0, "source": "real capture tests/data/kmsg-xid/dmesg_xid79-fallen-off-bus_plus_sxid20034-"
        "ltssm-fault-up.log: the lines of one SXid event (Fatal, Severity, Data) span 9 ms; 1 s keeps "
        "them together with a wide margin and still separates events seconds apart"})
    recent_window_s: float = field(default=3600.0, metadata={
        "min": 0, "source": "gpumon's expiry of application-level faults, the same as xid.recent_window_s"})
    repeat_window_s: float = field(default=REPEAT_WINDOW_S, metadata={
        "min": 0, "source": REPEAT_WINDOW_SOURCE})
    fabric_grace_s: float = field(default=600.0, metadata={
        "min": 0, "source": "real captures: fabric manager opens the NVSwitches 197 s after the "
        "kernel starts (tests/data/kmsg-xid/dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log: first "
        "line 15:36:15, 'nvidia-nvswitch0: open' 15:39:32) and at uptime 206.8 s (dev-kmsg-raw_"
        "nvswitch-open.log); 600 s is about three times that"})
    # under the host root (a leading / is dropped); None: var/log/fabricmanager.log, and missing = skipped
    fm_log_path: str | None = None
    # Zone of the log's stamps, which fabric manager prints in local time without a zone: "UTC"
    # (the kernel-log convention, see gpumon/hw/kmsg.py), "host" (<host-root>/etc/localtime) or a
    # zone name. Used only to skip entries from before this boot.
    fm_log_timezone: str = "UTC"
    fm_log_max_read_bytes: int = field(default=4 << 20, metadata={
        "min": 65536, "source": "gpumon's bound on one run's read, so that a long log is read over "
        "several runs: 4 MiB is about 23,000 entries at the real captures' 183 bytes per entry "
        "(tests/data/fabricmanager Dec 2024: 292 entries in 53,381 bytes)"})
    fm_log_initial_tail_bytes: int = field(default=1 << 20, metadata={
        "min": 0, "source": "gpumon's choice for the first look at an existing log: its last MiB, "
        "about 5,700 entries at the real captures' 183 bytes per entry; the log is appended across "
        "boots, so what lies before is mostly earlier boots, which are skipped anyway"})
    expected_nvswitches: int | None = field(default=None, metadata={"min": 0})  # from the SKU profile
    ignore_codes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _timezone_ok(self.fm_log_timezone):
            raise ValueError(f"fm_log_timezone: unknown time zone {self.fm_log_timezone!r} "
                             "(UTC, host, or a zone name such as Europe/Berlin)")


class NvswitchCheck(Check):
    name = "nvswitch"
    phase = Phase.CONTINUOUS
    description = "NVSwitch SXid errors, GPU NVLink fabric registration, fabric manager log"
    interval = 60.0
    timeout = 20.0
    Config = NvswitchConfig
    State = NvswitchState
    # SXid lines only: other kernel noise must not re-read NVML and the FM log
    kernel_log = KernelLogNeeds(events=(SXidEvent,))

    def supported(self, inventory: Inventory) -> str | None:
        if any(d.is_nvswitch for d in inventory.pci_devices):
            return None
        if any(_fabric_capable(g) for g in inventory.gpus):
            return None
        if inventory.nvml_error and not inventory.gpus:
            return (f"no NVSwitch on the PCI bus, and NVML cannot say whether a GPU joins an NVLink "
                    f"fabric ({inventory.nvml_error})")
        return ("no NVSwitch on the PCI bus and no GPU that joins an NVLink fabric "
                "(Hopper or newer with NVLink)")

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(NvswitchConfig)
        state = ctx.state_as(NvswitchState)
        if isinstance(ctx.kernel_log, SavedKernelLog):
            # a saved log judged on purpose (gpumon check --kmsg-file), maybe on a laptop: this
            # host's switches, NVML fabric state and fabric manager log say nothing about it
            return self._one_per_component(self._sxid(ctx, state, options, ctx.kernel_log.judged_at))
        now = ctx.clock()
        boot_time = ctx.hw.fs.boot_time() or ctx.kernel_log.boot_time
        findings = self._switch_count(ctx.inventory, options)
        findings += self._sxid(ctx, state, options, now)
        findings += self._fabric(ctx, options, now, boot_time)
        findings += self._fm_log(ctx, state, options, now, boot_time)
        return self._one_per_component(findings)

    # -- one finding per component (and fault) -----------------------------------------

    def _one_per_component(self, findings: list[Finding]) -> list[Finding]:
        """Fold the readings' findings: one for ``node``, one per (component, code) elsewhere.

        Each reading judges on its own; what leaves the check is one finding per component per
        run, the worst reading winning, so that the component's severity is the same every run
        while nothing changes (two findings on one component made the daemon log a change, and
        the exported severity took the worse of the two, every run). On a switch, different
        codes stay apart: they are different faults (as the xid check keeps Xid 79 and Xid 13
        on one GPU), while the same code seen in the kernel log and in the fabric manager log is
        one fault, seen twice.
        """
        groups: dict[tuple[str, Any], list[Finding]] = {}
        for f in findings:
            code = None if f.component == NODE else f.evidence.get("code")
            groups.setdefault((f.component, code), []).append(f)
        out: list[Finding] = []
        for (component, code), parts in groups.items():
            if component != NODE and len(parts) == 1:
                out.append(parts[0])
            else:
                out.append(self._merged(component, code, parts))
        return out

    def _merged(self, component: str, code: Any, parts: list[Finding]) -> Finding:
        """One finding from several readings' ones: the worst wins; every reading is in evidence.

        A ``skipped`` reading (an optional source that is not there, such as fabric manager's log
        at its default path, or fabric state on GPUs before Hopper) is a note, not a verdict:
        the finding is ``skipped`` only when every reading was.
        """
        judged = [f for f in parts if f.severity is not Severity.SKIPPED]
        worst = max((f.severity for f in judged), default=Severity.SKIPPED)
        shown = [f for f in parts if f.severity is worst]
        if worst is Severity.OK:
            shown += [f for f in parts if f.severity is Severity.SKIPPED]
        action = max(f.action for f in shown)
        readings = [str(f.evidence.get("reading", "other")) for f in parts]
        joined = "+".join(dict.fromkeys(readings))
        evidence: dict[str, Any] = {"reading": "node" if component == NODE else joined}
        if code is not None:
            evidence["code"] = code
        for f, reading in zip(parts, readings, strict=True):
            key, n = reading, 1
            while key in evidence:
                n += 1
                key = f"{reading}_{n}"
            evidence[key] = {"severity": f.severity.value, "action": f.action.value, "message": f.message,
                             **f.evidence}
        message = "; ".join(dict.fromkeys(f.message for f in shown))
        return self.finding(component, worst, message, action, **evidence)

    # -- NVSwitches on the bus ------------------------------------------------------

    def _switch_count(self, inv: Inventory, p: NvswitchConfig) -> list[Finding]:
        if p.expected_nvswitches is None:
            return []
        found = sorted(d.bus_id for d in inv.pci_devices if d.is_nvswitch)
        ev: dict[str, Any] = {"reading": "pci", "expected": p.expected_nvswitches, "found": len(found),
                              "pci_bus_ids": found}
        if len(found) < p.expected_nvswitches:
            # Enumeration happens at boot: a switch absent from the bus is not brought back by software.
            return [self.finding(NODE, Severity.FAIL, f"{len(found)} of {p.expected_nvswitches} NVSwitches "
                                 "on the PCI bus", Action.INSPECT_HARDWARE, **ev)]
        if len(found) > p.expected_nvswitches:
            return [self.finding(NODE, Severity.WARN, f"{len(found)} NVSwitches on the PCI bus, the profile "
                                 f"expects {p.expected_nvswitches}", **ev)]
        return [self.ok(NODE, f"{len(found)} NVSwitches on the PCI bus, as expected", **ev)]

    # -- SXid lines -------------------------------------------------------------------

    def _sxid(self, ctx: CheckContext, state: NvswitchState, p: NvswitchConfig, now: float) -> list[Finding]:
        log = ctx.kernel_log
        if not log.available:
            return [self.finding(NODE, Severity.UNKNOWN,
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
        findings = []
        for g in groups.values():
            f = self._sxid_finding(g, state, now, p)
            if f is not None:
                findings.append(f)
        if not findings:
            quiet = len(groups)
            message = ("no SXid errors in the kernel log this boot" if not quiet else
                       f"no recent SXid errors in the kernel log ({quiet} non-fatal ones went quiet "
                       f"more than {p.recent_window_s:g} s ago)")
            findings.append(self.ok(NODE, message, reading="sxid", source=log.source, quiet_groups=quiet,
                                    records_read=log.records_read, lost_records=log.lost_records))
        return findings

    def _sxid_finding(self, g: SxidGroup, state: NvswitchState, now: float,
                      p: NvswitchConfig) -> Finding | None:
        code = g.code
        info = lookup(code)
        severity, action, said = _group_verdict(info, g)
        if severity is Severity.WARN and now - g.last > p.recent_window_s:
            return None
        note = ""
        if severity is Severity.FAIL and action is Action.REBOOT_NODE and _repeated(
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
        message = (f"SXid {code} {_short_name(info)} on {component}: {g.events} event"
                   f"{'s' if g.events != 1 else ''} ({', '.join(counts)}){links}{note}")
        evidence: dict[str, Any] = {
            "reading": "sxid", "code": code, "pci_bus_id": g.pci, "events": g.events,
            "lines": g.lines, "fatal_events": g.fatal_events, "nonfatal_events": g.nonfatal_events,
            "unsaid_events": g.unsaid_events, "class_from": said, "links": sorted(g.links),
            "first_seen": g.first, "last_seen": g.last, "samples": g.samples,
        }
        evidence.update(_catalog_evidence(info))
        return self.finding(component, severity, message, action, **evidence)

    # -- NVML fabric state ------------------------------------------------------------

    def _fabric(self, ctx: CheckContext, p: NvswitchConfig, now: float,
                boot_time: float | None) -> list[Finding]:
        inv = ctx.inventory
        out: list[Finding] = []
        if not inv.gpus and not inv.unreadable_gpus:
            if inv.nvml_error:
                return [self.finding(NODE, Severity.UNKNOWN, f"GPU fabric state not read: {inv.nvml_error}",
                                     reading="fabric_state")]
            return [self.finding(NODE, Severity.SKIPPED, "GPU fabric state not read: no GPU in NVML",
                                 reading="fabric_state")]
        uptime = now - boot_time if boot_time is not None else None
        unsupported: list[Finding] = []
        for g in inv.gpus:
            component = gpu(g.index)
            try:
                info = ctx.hw.nvml.fabric_info(g.index)
            except NotSupported as exc:
                unsupported.append(self.finding(component, Severity.SKIPPED,
                                                f"GPU fabric state not supported here: {exc}",
                                                reading="fabric_state", call=exc.call))
                continue
            except HwCondition as exc:
                out.append(_tagged(self.from_condition(exc, component), "fabric_state"))
                continue
            out.append(self._fabric_finding(component, g, info, uptime, p))
        for index, reason in sorted(inv.unreadable_gpus.items()):
            out.append(self.finding(gpu(index), Severity.UNKNOWN, f"GPU fabric state not read: {reason}",
                                    reading="fabric_state"))
        if unsupported and len(unsupported) == len(inv.gpus):
            # pre-Hopper and PCIe boards have no fabric state at all: say so once
            out.append(self.finding(NODE, Severity.SKIPPED,
                                    "GPU fabric state not supported on these GPUs (before Hopper, or "
                                    "PCIe boards)", reading="fabric_state", gpus=len(unsupported)))
        else:
            out.extend(unsupported)
        return out

    def _fabric_finding(self, component: str, g: GpuInfo, info: FabricInfo, uptime: float | None,
                        p: NvswitchConfig) -> Finding:
        name = _FABRIC_STATES.get(info.state, f"unknown state {info.state}")
        ev: dict[str, Any] = {"reading": "fabric_state", "state": info.state, "state_name": name,
                              "status": info.status, "clique_id": info.clique_id,
                              "cluster_uuid": _cluster_uuid(info.cluster_uuid),
                              "health_mask": info.health_mask, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id}
        if info.state == 0:
            return self.finding(component, Severity.SKIPPED, "GPU fabric state not supported on this GPU",
                                **ev)
        if info.state == 3 and info.status == 0:
            flags = [flag for flag, shift in _HEALTH_FLAGS.items() if (info.health_mask >> shift) & 0x3 == 1]
            if flags:
                return self.finding(component, Severity.WARN, "registered with the NVLink fabric, but its "
                                    f"health mask says: {', '.join(flags)}", health=flags, **ev)
            return self.ok(component, f"registered with the NVLink fabric (clique {info.clique_id})", **ev)
        if info.state == 3:
            status = _NVML_RETURN.get(info.status, str(info.status))
            return self.finding(component, Severity.FAIL, "GPU fabric registration failed (NVML status "
                                f"{status}): the GPU cannot use the NVSwitch fabric", Action.REBOOT_NODE,
                                **ev)
        if info.state in (1, 2):
            if uptime is not None and uptime < p.fabric_grace_s:
                return self.finding(component, Severity.UNKNOWN,
                                    f"GPU fabric registration {name} {uptime:.0f} s after boot (fabric "
                                    f"manager gets {p.fabric_grace_s:g} s)", uptime_s=round(uptime, 1), **ev)
            after = f" {uptime:.0f} s after boot" if uptime is not None else ""
            return self.finding(component, Severity.FAIL,
                                f"GPU not registered with the NVLink fabric (registration {name}{after}): "
                                "it cannot use the NVSwitch fabric", Action.REBOOT_NODE, **ev)
        return self.finding(component, Severity.UNKNOWN, f"GPU fabric state {info.state} is not one NVML "
                            "documents", **ev)

    # -- fabric manager log -------------------------------------------------------------

    def _fm_log(self, ctx: CheckContext, state: NvswitchState, p: NvswitchConfig, now: float,
                boot_time: float | None) -> list[Finding]:
        rel = p.fm_log_path or DEFAULT_LOG_PATH
        fm = state.fm
        groups = fm.groups
        reader = FabricManagerLog(ctx.hw.fs, rel, max_read_bytes=p.fm_log_max_read_bytes,
                                  initial_tail_bytes=p.fm_log_initial_tail_bytes)
        try:
            res = reader.follow(fm.cursor)
        except HwCondition as exc:
            failed = _tagged(self.from_condition(exc, NODE), "fm_log")
            return [failed, *self._fm_findings(groups, state, now, p)]
        source = str(reader.path)
        if res.missing:
            fm.cursor = None
            if p.fm_log_path is None:
                # an optional source: a note on the node's finding, not its verdict (see _merged)
                head = self.finding(NODE, Severity.SKIPPED,
                                    f"fabric manager log not found at {source} (fabric manager may log "
                                    "to syslog or elsewhere: set fm_log_path); fabric health is judged "
                                    "from NVML and the SXid lines", reading="fm_log", source=source)
            else:
                head = self.finding(NODE, Severity.UNKNOWN, f"the configured fabric manager log {source} "
                                    "does not exist", reading="fm_log", source=source)
            return [head, *self._fm_findings(groups, state, now, p)]
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
            self._add_fm_entry(groups, entry, ctx, state, now, p)
        findings = self._fm_findings(groups, state, now, p)
        if not findings:
            ev = dict(dataclasses.asdict(stats), reading="fm_log", source=source,
                      behind_bytes=res.behind_bytes, quiet_groups=len(groups))
            if tz_note:
                ev["timezone_note"] = tz_note
            message = ("no NVSwitch or other errors in the fabric manager log this boot" if not groups else
                       f"no recent errors in the fabric manager log ({len(groups)} non-fatal kinds went "
                       f"quiet more than {p.recent_window_s:g} s ago)")
            findings.append(self.ok(NODE, message, **ev))
        return findings

    def _add_fm_entry(self, groups: dict[str, FmSwitchGroup | FmOtherGroup], entry: FmLogEntry,
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
            _sample(g.samples, f"[{entry.level}] {entry.message}")

    def _fm_findings(self, groups: dict[str, FmSwitchGroup | FmOtherGroup], state: NvswitchState, now: float,
                     p: NvswitchConfig) -> list[Finding]:
        out: list[Finding] = []
        for g in groups.values():
            f = self._fm_finding(g, state, now, p)
            if f is not None:
                out.append(f)
        return out

    def _fm_finding(self, g: FmSwitchGroup | FmOtherGroup, state: NvswitchState, now: float,
                    p: NvswitchConfig) -> Finding | None:
        if isinstance(g, FmOtherGroup):
            if now - g.seen > p.recent_window_s:
                return None
            entries = "entry" if g.count == 1 else "entries"
            message = f"{g.count} error {entries} in the fabric manager log"
            return self.finding(NODE, Severity.WARN, message, reading="fm_log", count=g.count,
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
        if severity is Severity.FAIL and action is Action.REBOOT_NODE and g.pci and _repeated(
                state, f"{g.pci}|{code}", now, p.repeat_window_s):
            action = Action.INSPECT_HARDWARE
            note = "; seen on this switch in an earlier boot too"
        words = [w for w, n in (("fatal", g.fatal), ("non-fatal", g.nonfatal)) if n]
        count = g.fatal + g.nonfatal
        ports = ", ".join(f"{k} ({v}x)" if v > 1 else k for k, v in sorted(g.ports.items(),
                                                                         key=lambda kv: int(kv[0])))
        message = (f"fabric manager: {' and '.join(words)} NVSwitch error {code} {_short_name(info)} on "
                   f"{g.component}: {count} entr{'y' if count == 1 else 'ies'}"
                   f"{', ports ' + ports if ports else ''}{note}")
        evidence: dict[str, Any] = {
            "reading": "fm_log", "code": code, "pci_bus_id": g.pci, "count": count,
            "fatal_count": g.fatal, "nonfatal_count": g.nonfatal, "ports": g.ports,
            "physical_ids": g.physical_ids, "first_stamp": g.first_stamp, "last_stamp": g.last_stamp,
            "samples": g.samples,
        }
        evidence.update(_catalog_evidence(info))
        return self.finding(g.component, severity, message, action, **evidence)


# ------------------------------------------------------------------------------- helpers


def _fabric_capable(g: GpuInfo) -> bool:
    return g.architecture not in _PRE_HOPPER and (g.nvlink_count or 0) > 0




def _tagged(finding: Finding, reading: str) -> Finding:
    """A hardware-condition finding, marked with the reading it interrupted."""
    return dataclasses.replace(finding, evidence={**finding.evidence, "reading": reading})


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


def _sample(samples: list[str], text: str) -> None:
    if len(samples) < _MAX_SAMPLES:
        samples.append(text[:200])


def _add_link(links: list[int], link: int | None) -> None:
    if link is not None and link >= 0 and link not in links and len(links) < _MAX_LINKS:
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
    _sample(g.samples, ev.message)


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


def _repeated(state: NvswitchState, key: str, now: float, window: float) -> bool:
    """Record a fatal (switch, code) for this boot; True if an earlier boot had it within ``window``."""
    return RepeatHistory(state.history, max_keys=_MAX_HISTORY_KEYS).record(key, state.boot_id, now, window)


def _catalog_evidence(info: SXidInfo | None) -> dict[str, Any]:
    if info is None:
        return {"catalog": "not in NVIDIA's SXid tables"}
    return {"name": info.name, "nvidia_action": info.nvidia_action,
            "catalog_class": "fatal" if info.fatal else "non-fatal",
            "catalog_class_source": info.class_source, "fm_guide_table": info.fmg_table}


def _short_name(info: SXidInfo | None) -> str:
    if info is None:
        return "(not in NVIDIA's SXid tables)"
    return info.name.removeprefix(NAME_PREFIX) or "(unnamed)"


def _cluster_uuid(hex32: str) -> str:
    try:
        return str(uuidlib.UUID(hex=hex32))
    except ValueError:
        return hex32


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
    if err.port is not None and (str(err.port) in g.ports or len(g.ports) < _MAX_LINKS):
        g.ports[str(err.port)] = g.ports.get(str(err.port), 0) + 1
    if err.physical_id is not None and err.physical_id not in g.physical_ids:
        g.physical_ids.append(err.physical_id)
    g.last_stamp = entry.stamp
    g.seen = now
    _sample(g.samples, f"[{entry.stamp}] [{entry.level}] {entry.message}")
