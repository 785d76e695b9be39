"""The nvswitch check's ``fabric_state`` reading: NVML's GPU fabric info per GPU. A GPU joins the
NVLink fabric when fabric manager registers it; one that did not is fail / reboot_node after
``fabric_grace_s``, and NOT_SUPPORTED (before Hopper, PCIe boards) turns the reading off for that
GPU. The check's docstring has the rules and their sources."""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition, NotSupported
from gpumon.hw.nvml import FabricInfo, GpuInfo
from gpumon.model import NODE, Action, Finding, Severity, gpu

from .evidence import tagged
from .options import NvswitchConfig

_PRE_HOPPER = frozenset({"kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada"})

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


def findings(check: Check, ctx: CheckContext, p: NvswitchConfig, now: float,
             boot_time: float | None) -> list[Finding]:
    inv = ctx.inventory
    out: list[Finding] = []
    if not inv.gpus and not inv.unreadable_gpus:
        if inv.nvml_error:
            return [check.finding(NODE, Severity.UNKNOWN, f"GPU fabric state not read: {inv.nvml_error}",
                                  reading="fabric_state")]
        return [check.finding(NODE, Severity.SKIPPED, "GPU fabric state not read: no GPU in NVML",
                              reading="fabric_state")]
    uptime = now - boot_time if boot_time is not None else None
    unsupported: list[Finding] = []
    for g in inv.gpus:
        component = gpu(g.index)
        try:
            info = ctx.hw.nvml.fabric_info(g.index)
        except NotSupported as exc:
            unsupported.append(check.finding(component, Severity.SKIPPED,
                                             f"GPU fabric state not supported here: {exc}",
                                             reading="fabric_state", call=exc.call))
            continue
        except HwCondition as exc:
            out.append(tagged(check.from_condition(exc, component), "fabric_state"))
            continue
        out.append(_finding(check, component, g, info, uptime, p))
    for index, reason in sorted(inv.unreadable_gpus.items()):
        out.append(check.finding(gpu(index), Severity.UNKNOWN, f"GPU fabric state not read: {reason}",
                                 reading="fabric_state"))
    if unsupported and len(unsupported) == len(inv.gpus):
        # pre-Hopper and PCIe boards have no fabric state at all: say so once
        out.append(check.finding(NODE, Severity.SKIPPED,
                                 "GPU fabric state not supported on these GPUs (before Hopper, or "
                                 "PCIe boards)", reading="fabric_state", gpus=len(unsupported)))
    else:
        out.extend(unsupported)
    return out


def _finding(check: Check, component: str, g: GpuInfo, info: FabricInfo, uptime: float | None,
             p: NvswitchConfig) -> Finding:
    name = _FABRIC_STATES.get(info.state, f"unknown state {info.state}")
    ev: dict[str, Any] = {"reading": "fabric_state", "state": info.state, "state_name": name,
                          "status": info.status, "clique_id": info.clique_id,
                          "cluster_uuid": _cluster_uuid(info.cluster_uuid),
                          "health_mask": info.health_mask, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id}
    if info.state == 0:
        return check.finding(component, Severity.SKIPPED, "GPU fabric state not supported on this GPU",
                             **ev)
    if info.state == 3 and info.status == 0:
        flags = [flag for flag, shift in _HEALTH_FLAGS.items() if (info.health_mask >> shift) & 0x3 == 1]
        if flags:
            return check.finding(component, Severity.WARN, "registered with the NVLink fabric, but its "
                                 f"health mask says: {', '.join(flags)}", health=flags, **ev)
        return check.ok(component, f"registered with the NVLink fabric (clique {info.clique_id})", **ev)
    if info.state == 3:
        status = _NVML_RETURN.get(info.status, str(info.status))
        return check.finding(component, Severity.FAIL, "GPU fabric registration failed (NVML status "
                             f"{status}): the GPU cannot use the NVSwitch fabric", Action.REBOOT_NODE,
                             **ev)
    if info.state in (1, 2):
        if uptime is not None and uptime < p.fabric_grace_s:
            return check.finding(component, Severity.UNKNOWN,
                                 f"GPU fabric registration {name} {uptime:.0f} s after boot (fabric "
                                 f"manager gets {p.fabric_grace_s:g} s)", uptime_s=round(uptime, 1), **ev)
        after = f" {uptime:.0f} s after boot" if uptime is not None else ""
        return check.finding(component, Severity.FAIL,
                             f"GPU not registered with the NVLink fabric (registration {name}{after}): "
                             "it cannot use the NVSwitch fabric", Action.REBOOT_NODE, **ev)
    return check.finding(component, Severity.UNKNOWN, f"GPU fabric state {info.state} is not one NVML "
                         "documents", **ev)


def fabric_capable(g: GpuInfo) -> bool:
    return g.architecture not in _PRE_HOPPER and (g.nvlink_count or 0) > 0


def _cluster_uuid(hex32: str) -> str:
    try:
        return str(uuidlib.UUID(hex=hex32))
    except ValueError:
        return hex32
