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

Each reading is a module of its own (``sxid``, ``fabric_state``, ``fm_log``; ``evidence``: what they
share); ``options`` holds the check's options. This module runs them and folds their findings.
"""

from __future__ import annotations

from typing import Any

from gpumon.check import Check, CheckContext, KernelLogNeeds
from gpumon.hw.inventory import Inventory
from gpumon.hw.kernellog import SavedKernelLog
from gpumon.hw.nvrm import SXidEvent
from gpumon.model import NODE, Action, Finding, Phase, Severity

from . import fabric_state, fm_log, sxid
from .options import NvswitchConfig
from .state import NvswitchState


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
        if any(fabric_state.fabric_capable(g) for g in inventory.gpus):
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
            return self._one_per_component(sxid.findings(self, ctx, state, options, ctx.kernel_log.judged_at))
        now = ctx.clock()
        boot_time = ctx.hw.fs.boot_time() or ctx.kernel_log.boot_time
        findings = self._switch_count(ctx.inventory, options)
        findings += sxid.findings(self, ctx, state, options, now)
        findings += fabric_state.findings(self, ctx, options, now, boot_time)
        findings += fm_log.findings(self, ctx, state, options, now, boot_time)
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
