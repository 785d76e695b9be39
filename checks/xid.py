"""xid: NVIDIA driver Xid errors from the kernel log, acted on per NVIDIA's catalog.

Events arrive as parsed NVRM records (``gpumon.hw.nvrm``). They are folded
into one group per (component, root code) for the current boot, so a storm
of 629 Xid 13 lines on one GPU is one finding with a count. Catalog
workflows applied here:

- Xid 45 "caused by previous Xid N" is a sympathetic cleanup: act on N.
- Xid 154 only announces the GPU's new recovery action: act on that action.
- NVLink5 Xids 144-150 take their severity from the Fatal/Nonfatal word.
- "GPU has fallen off the bus" without an Xid line is Xid 79 (NVSentinel #155).
- Xid 13/31 repeated on the same GPU (default 3 bursts in 24 h) escalate from
  restart_app to inspect_hardware; spread over GPUs they stay app errors.

Application-level Xids (restart_app) stop being reported ``recent_window_s``
after their last line; GPU-level ones stay for the boot (a reboot or GPU reset
is what clears them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.hw.inventory import Inventory
from gpumon.hw.nvrm import FallenOffBus, GpuIdentity, XidEvent
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu, nvlink, pci

from .xid_catalog import lookup

# nvmlGpuRecoveryAction_t values as printed in Xid 154 lines
_RECOVERY = {
    0: (Severity.OK, Action.NONE),            # None
    1: (Severity.FAIL, Action.RESET_GPU),     # GPU Reset Required
    2: (Severity.FAIL, Action.REBOOT_NODE),   # Node Reboot Required
    3: (Severity.WARN, Action.RESTART_APP),   # Drain P2P: stop peer traffic, no reset
    4: (Severity.FAIL, Action.RESET_GPU),     # Drain and Reset
}
_MAX_SAMPLES = 5


@dataclass(frozen=True)
class XidConfig:
    # NVIDIA's WORKFLOW_XID_13/31: repeats on the same GPU point at hardware.
    # 3 in 24 h is the default (see issue notes); a burst is lines
    # closer than burst_gap_s, since one fault prints many lines at once.
    repeat_count: int = field(default=3, metadata={"min": 2})
    repeat_window_s: float = field(default=86400.0, metadata={"min": 60})
    burst_gap_s: float = field(default=60.0, metadata={"min": 0})
    recent_window_s: float = field(default=3600.0, metadata={"min": 0})
    ignore_codes: list[int] = field(default_factory=list)


class XidCheck(Check):
    name = "xid"
    phase = Phase.CONTINUOUS
    description = "NVIDIA Xid errors in the kernel log, with NVIDIA's catalog actions"
    interval = 60.0
    timeout = 10.0
    Config = XidConfig
    uses_kernel_log = True

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.gpus and not inventory.nvidia_pci_gpus and not inventory.unreadable_gpus:
            return "no NVIDIA GPU on this node"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        params: XidConfig = ctx.params or XidConfig()
        log = ctx.kernel_log
        if not log.available:
            return [self.finding(NODE, Severity.UNKNOWN,
                                 f"kernel log unreadable: {log.error or 'unknown reason'}",
                                 source=log.source)]
        state = ctx.state
        boot = ctx.hw.fs.boot_id()
        if state.get("boot_id") != boot:
            state.clear()
            state["boot_id"] = boot
        groups: dict[str, dict[str, Any]] = state.setdefault("groups", {})
        identities: dict[str, dict[str, str]] = state.setdefault("identities", {})
        now = ctx.clock()
        for event in log.events:
            if isinstance(event, GpuIdentity):
                ident = identities.setdefault(event.pci or "?", {})
                if event.uuid:
                    ident["uuid"] = event.uuid
                if event.serial:
                    ident["serial"] = event.serial
            elif isinstance(event, XidEvent):
                if event.code not in params.ignore_codes:
                    self._add(groups, ctx.inventory, event, event.pci, event.code,
                              _when(event.record, log.boot_time, now), params)
            elif isinstance(event, FallenOffBus):
                self._add(groups, ctx.inventory, event, event.pci, 79,
                          _when(event.record, log.boot_time, now), params)
        findings = [f for g in groups.values() if (f := self._finding(g, now, params, identities))]
        if not findings:
            findings.append(self.ok(NODE, "no Xid errors in the kernel log this boot",
                                    source=log.source, records_read=log.records_read,
                                    lost_records=log.lost_records))
        elif log.lost_records:
            findings.append(self.finding(NODE, Severity.WARN,
                                         f"{log.lost_records} kernel log records were overwritten "
                                         "before gpumon read them", source=log.source))
        return findings

    def _add(self, groups: dict[str, dict[str, Any]], inv: Inventory, event: Any, bus: str | None,
             code: int, when: float, params: XidConfig) -> None:
        gpu_index = _gpu_index(inv, bus)
        via: int | None = None
        if isinstance(event, XidEvent) and code == 45 and event.cause_xid:
            via, code = 45, event.cause_xid
        link = event.nvlink_link if isinstance(event, XidEvent) and 144 <= code <= 150 else None
        if gpu_index is not None and link is not None and link >= 0:
            component = nvlink(gpu_index, link)
        elif gpu_index is not None:
            component = gpu(gpu_index)
        elif bus is not None:
            component = pci(bus)
        else:
            component = NODE
        key = f"{component}|{code}"
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"component": component, "code": code, "pci": bus, "count": 0,
                               "first": when, "last": when, "bursts": [], "samples": [],
                               "pids": [], "processes": [], "via": [], "fatal": None,
                               "recovery_to": None, "unit": None}
        if isinstance(event, FallenOffBus) and g["count"]:
            return  # the same fall reported again in the driver's own words: one event
        g["count"] += 1
        g["first"] = min(g["first"], when)
        g["last"] = max(g["last"], when)
        bursts: list[float] = g["bursts"]
        if not bursts or when - bursts[-1] > params.burst_gap_s:
            bursts.append(when)
            del bursts[:-50]
        if via is not None and via not in g["via"]:
            g["via"].append(via)
        if isinstance(event, XidEvent):
            if len(g["samples"]) < _MAX_SAMPLES:
                g["samples"].append(event.message[:300])
            if event.pid is not None and event.pid not in g["pids"] and len(g["pids"]) < _MAX_SAMPLES:
                g["pids"].append(event.pid)
            if event.process and event.process not in g["processes"] and len(g["processes"]) < 5:
                g["processes"].append(event.process)
            if event.nvlink_fatal is not None:
                # one fatal line makes the group fatal
                g["fatal"] = bool(g["fatal"]) or event.nvlink_fatal
                g["unit"] = event.nvlink_unit
            if code == 154 and event.recovery_to is not None:
                g["recovery_to"] = list(event.recovery_to)
        elif isinstance(event, FallenOffBus) and len(g["samples"]) < _MAX_SAMPLES:
            g["samples"].append("GPU has fallen off the bus (no Xid line)")

    def _finding(self, g: dict[str, Any], now: float, params: XidConfig,
                 identities: dict[str, dict[str, str]]) -> Finding | None:
        code: int = g["code"]
        info = lookup(code)
        severity = info.severity if info else Severity.WARN
        action = info.action if info else Action.NONE
        name = info.mnemonic.split(" / ")[0] if info else "(not in NVIDIA's catalog)"
        label = f"Xid {code} {name}"
        note = ""
        if code == 154:
            to = g["recovery_to"]
            if to is None:
                return None
            severity, action = _RECOVERY.get(int(to[0]), (Severity.WARN, Action.RESET_GPU))
            note = f": GPU recovery action is now {to[1]}"
        elif 144 <= code <= 150 and g["fatal"] is not None:
            if g["fatal"]:
                severity, action = Severity.FAIL, Action.RESET_GPU
            else:
                severity = Severity.WARN
                action = Action.CHECK_CABLES if g["unit"] == "NETIR_BER_EVENT" else Action.NONE
            note = f": {g['unit']} {'Fatal' if g['fatal'] else 'Nonfatal'}"
        elif code == 45 and not g["via"]:
            # Solo Xid 45: NVIDIA says restart fabric manager; the job itself was killed.
            severity, action = Severity.WARN, Action.RESTART_APP
        bursts = [b for b in g["bursts"] if now - b <= params.repeat_window_s]
        if code in (13, 31) and g["component"].startswith("gpu/") and len(bursts) >= params.repeat_count:
            severity, action = Severity.FAIL, Action.INSPECT_HARDWARE
            note = (f": {len(bursts)} separate bursts on this GPU within "
                    f"{params.repeat_window_s / 3600:g} h (NVIDIA WORKFLOW_XID_{code}: suspect hardware)")
        elif action <= Action.RESTART_APP and now - g["last"] > params.recent_window_s:
            return None  # an application fault that has gone quiet
        if severity is Severity.OK:
            return None
        ident = identities.get(g["pci"] or "", {})
        evidence: dict[str, Any] = {
            "code": code, "count": g["count"], "first_seen": g["first"], "last_seen": g["last"],
            "pci_bus_id": g["pci"], "samples": g["samples"], "bursts": len(bursts),
        }
        if info:
            evidence["mnemonic"] = info.mnemonic
            evidence["nvidia_action"] = info.nvidia_action
        for key in ("pids", "processes"):
            if g[key]:
                evidence[key] = g[key]
        if g["via"]:
            evidence["reported_via_xid"] = g["via"]
        evidence.update({k: v for k, v in ident.items()})
        times = "" if g["count"] == 1 else f" ({g['count']} lines)"
        where = g["component"] if g["component"] != NODE else "an unidentified GPU"
        via = " via Xid 45" if g["via"] else ""
        return self.finding(g["component"], severity, f"{label} on {where}{via}{times}{note}", action,
                            **evidence)


def _when(record: Any, boot_time: float | None, now: float) -> float:
    """When a record was logged: its wall clock, else boot time + kernel uptime, else now."""
    wall = getattr(record, "wall_time", None)
    if wall is not None:
        return float(wall.timestamp())
    usec = getattr(record, "monotonic_us", None)
    if usec is not None and boot_time is not None:
        return float(boot_time + usec / 1e6)
    return now


def _gpu_index(inv: Inventory, bus: str | None) -> int | None:
    if bus is None:
        return None
    found = inv.gpu_by_pci(bus)
    if found is not None:
        return found.index
    # A GPU that fell off the bus is often missing from NVML; NVML numbers GPUs
    # in PCI bus order, so its place among the NVIDIA GPUs on the bus is its index.
    buses = sorted(d.bus_id for d in inv.nvidia_pci_gpus)
    if bus in buses and len(buses) == len(inv.gpus) + len(inv.unreadable_gpus):
        return buses.index(bus)
    return None
