"""pcie: PCIe errors and link state of every GPU, RDMA NIC and NVSwitch, and the ports above them.

Watched functions: NVIDIA GPUs (class 0x0300/0x0302), NVSwitches (NVIDIA 0x0680),
RDMA NICs (the function behind ``sys/class/infiniband/<dev>/device``, or any
Mellanox network function), and every bridge between them and the root
complex. AER counters can rise at either end of a link (the kernel's ABI note:
errors are counted "as seen/reported by the device", often by the link
partner), so a fault on the GPU's link may only show at its switch port.

- **AER counters** (sysfs, since boot). The first reading of a boot is the
  baseline. Any rise of the fatal or non-fatal total afterwards fails. Fatal
  and non-fatal totals already non-zero at the first reading: fatal fails
  (a fatal error means "the link is unreliable" and the kernel had to reset
  it; the NVIDIA driver has no AER recovery callback, so the GPU is not
  brought back either), non-fatal warns (it cannot be dated, and firmware
  probing at boot leaves Unsupported Request errors on healthy ports: the
  real HGX H100 capture in tests/data/pcie-aer has UnsupReq latched on six
  switch ports). A correctable rate above ``correctable_per_hour`` warns.
  Counters going backwards (the function was removed and re-added) restart
  the baseline; there is never a negative rate.
- **Kernel log**: "PCIe Bus Error: severity=Uncorrected/Uncorrectable ..." on a
  watched function fails it; corrected reports are counted as evidence (the
  kernel rate-limits these messages, the counters are exact). The AER summary
  line ("AER: [Multiple] Uncorrected|Uncorrectable (Fatal|Non-Fatal) error
  [message] received[: | from] <source>") fails its source (else the port that
  printed it) when no detail line came with it (gcm's test lines have none);
  "AER: can't recover (no error_detected callback)" (a driver without AER
  recovery, such as nvidia's) and "AER: device recovery failed" fail the
  function that printed them: it stays unusable until a reset or a reboot.
- **Link**: each physical link is judged at its upstream-facing end (endpoint
  or switch upstream port) against the lower of the two ends' maxima. Width
  below that fails. Speed below it warns only while the GPU on the link is
  busy: NVIDIA documents that the current link generation "may be reduced when
  the GPU is not in use". On other links a lower speed warns. A GPU link whose
  maximum is below the SKU profile's generation or width warns (wrong slot or
  riser).

Remedy: PCIe errors and a narrow link are faults of the path — card seating,
riser, retimer, baseboard — so every problem here points at inspect_hardware,
for NICs too: AER counts errors on the NIC's PCIe link, not on its network
cable (check_cables would send someone to the wrong cable; network-side errors
are the ib check's).

Uncorrectable errors and the "before gpumon watched" counts stay reported for
the boot (the counters themselves only reset at boot).

The state is the check's declared ``State`` (``PcieState``), loaded, checked, saved and reset at a
reboot by the framework: saved state of another shape (a hand edit, another release) is refused,
with its reason logged, and the check starts afresh instead of raising on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumon.check import Check, CheckContext, KernelLogNeeds
from gpumon.errors import HwCondition
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, pci

from .aer_log import AerDelta, AerFold
from .judge import Problem, judge_counters, judge_kernel_log, judge_link, ok_summary, unknown
from .options import PcieConfig
from .state import PcieState


class PcieCheck(Check):
    name = "pcie"
    phase = Phase.CONTINUOUS
    description = ("PCIe AER errors (sysfs counters, kernel log) and link width/speed of GPUs, RDMA NICs, "
                   "NVSwitches and the ports above them")
    readings = (
        ReadingSpec(
            "pcie_aer_errors_total", "counter",
            "PCIe AER errors reported by this PCI function (a GPU, RDMA NIC, NVSwitch, or a bridge or "
            "switch port above them) since boot (label aer_severity: correctable, nonfatal, fatal).",
            unit="errors",
            source="sysfs /sys/bus/pci/devices/<bdf>/aer_dev_correctable, aer_dev_nonfatal, aer_dev_fatal "
                   "(TOTAL_ERR_*), which the kernel resets only at boot",
            labels=("aer_severity",)),
    )
    interval = 60.0
    timeout = 30.0
    Config = PcieConfig
    State = PcieState
    # AER lines are folded as they arrive (AerFold); only an uncorrectable report runs the check
    # at once, corrected ones are counted and reach it at its regular run
    kernel_log = KernelLogNeeds(events=(), fold=lambda: AerFold())

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.pci_devices:
            return "no PCI devices under the host root (sys/bus/pci/devices is empty or missing)"
        if not inventory.ib_devices and not any(
                d.is_gpu or d.is_nvswitch or (d.vendor == pcihw.MELLANOX and d.pci_class.startswith("0x02"))
                for d in inventory.pci_devices):
            return "no NVIDIA GPU, NVSwitch or RDMA NIC on the PCI bus"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(PcieConfig)
        state = ctx.state_as(PcieState)
        now = ctx.clock()
        out = self._read_kernel_log(ctx, state, now)
        try:
            nics, nic_errors = pcihw.infiniband_devices(ctx.hw.fs)
            tree = pcihw.scan(ctx.hw.fs, extra=set(nics.values()))
        except HwCondition as cond:
            return [*out, self.from_condition(cond, NODE)]
        if not tree.listed:
            return [*out, self.finding(NODE, Severity.SKIPPED,
                                       "no PCI devices under the host root (sys/bus/pci/devices is empty or "
                                       "missing): no PCIe tree to watch")]
        watched = _watched(tree, nics, ctx.inventory)
        devices = state.devices
        for bdf in sorted(watched):
            out.append(self._device(ctx, options, tree, bdf, watched[bdf],
                                    devices.setdefault(bdf, {}), state.kmsg, now))
        for bdf in sorted(tree.errors):
            out.append(self.finding(pci(bdf), Severity.UNKNOWN,
                                    f"PCI function {bdf} cannot be identified, so whether it is a GPU, NIC "
                                    f"or port to watch is unknown: {tree.errors[bdf]}"))
        for bdf in sorted(set(devices) - set(tree.functions) - set(tree.errors)):
            out.append(self.finding(pci(bdf), Severity.UNKNOWN,
                                    f"{bdf} ({devices[bdf].get('is', 'watched')}) is no longer listed in "
                                    "sys/bus/pci/devices: removed from the bus or hot-unplugged",
                                    was=devices[bdf].get("is")))
        for dev in sorted(nic_errors):
            out.append(self.finding(NODE, Severity.UNKNOWN,
                                    f"RDMA device {dev}: its PCI function cannot be found: "
                                    f"{nic_errors[dev]}"))
        if not any(f.component != NODE for f in out):
            out.append(self.finding(NODE, Severity.SKIPPED,
                                    "no NVIDIA GPU, NVSwitch or RDMA NIC on the PCI bus",
                                    pci_functions=tree.listed))
        return out

    # -- one watched function ---------------------------------------------------

    def _device(self, ctx: CheckContext, options: PcieConfig, tree: pcihw.PciScan, bdf: str,
                labels: list[str], ds: dict[str, Any], kmsg: Mapping[str, Any], now: float) -> Finding:
        fn = tree.functions[bdf]
        what = ", ".join(labels)
        ds["is"] = what
        evidence: dict[str, Any] = {"is": what, "vendor": fn.vendor, "device": fn.device,
                                    "class": fn.pci_class, "port": tree.role(bdf)}
        upstream = [a for a in fn.ancestors if a in tree.functions]
        if upstream:
            evidence["upstream"] = upstream
        problems: list[Problem] = []
        readings = 0
        try:
            aer = pcihw.read_aer(ctx.hw.fs, fn)
        except HwCondition as cond:
            problems.append(unknown(f"AER counters unreadable: {cond}"))
        else:
            if aer is None:
                evidence["aer"] = "not exposed (no AER capability, or a kernel without AER statistics)"
            else:
                readings += 1
                problems += judge_counters(options, ds, aer, now, evidence)
        try:
            link = pcihw.read_link(ctx.hw.fs, fn)
        except HwCondition as cond:
            problems.append(unknown(f"link attributes unreadable: {cond}"))
        else:
            if link is None:
                evidence["link"] = "not exposed (not a PCIe function)"
            else:
                readings += 1
                problems += judge_link(ctx, options, tree, fn, link, evidence)
        log = kmsg.get(bdf)
        if log:
            problems += judge_kernel_log(log, evidence)
        return self._verdict(pci(bdf), what, problems, readings, evidence)

    def _verdict(self, comp: str, what: str, problems: list[Problem], readings: int,
                 evidence: dict[str, Any]) -> Finding:
        if not problems and not readings:
            return self.finding(comp, Severity.SKIPPED,
                                f"{what}: no AER counters and no link attributes in sysfs", **evidence)
        if not problems:
            return self.ok(comp, f"{what}: {ok_summary(evidence)}", **evidence)
        problems.sort(key=lambda p: p.severity, reverse=True)
        severity = problems[0].severity
        action = max((p.action for p in problems), default=Action.NONE)
        return self.finding(comp, severity, f"{what}: " + "; ".join(p.text for p in problems), action,
                            **evidence)

    # -- kernel log -------------------------------------------------------------

    def _read_kernel_log(self, ctx: CheckContext, state: PcieState, now: float) -> list[Finding]:
        log = ctx.kernel_log
        if not log.available:
            return [self.finding(NODE, Severity.UNKNOWN,
                                 f"kernel log unreadable ({log.error or 'unknown reason'}): AER messages not "
                                 "checked; the sysfs AER counters still are", source=log.source)]
        if isinstance(log.folded, AerDelta):  # the daemon's pump folded the lines as they came
            log.folded.merge(state.kmsg, state.kmsg_source)
        if log.records:
            fold = AerFold(state.kmsg_source)
            for rec in log.records:
                fold.add(rec, log.time_of(rec, now))
            delta = fold.take()
            if delta is not None:
                delta.merge(state.kmsg, state.kmsg_source)
        return []


def _watched(tree: pcihw.PciScan, nics: Mapping[str, str], inventory: Inventory) -> dict[str, list[str]]:
    """Bus id -> what it is ("gpu/3", "mlx5_2", "upstream of gpu/3, mlx5_3") for every function watched."""
    gpus = {g.pci_bus_id: g.index for g in inventory.gpus}
    names: dict[str, list[str]] = {}
    for dev, bdf in nics.items():
        names.setdefault(bdf, []).append(dev)
    endpoints: dict[str, str] = {}
    for bdf, fn in tree.functions.items():
        if fn.virtual:
            continue  # SR-IOV VFs share the physical function's link and report no AER of their own
        if fn.is_nvidia_gpu:
            endpoints[bdf] = f"gpu/{gpus[bdf]}" if bdf in gpus else "NVIDIA GPU not in NVML"
        elif fn.is_nvswitch:
            endpoints[bdf] = "NVSwitch"
        elif bdf in names:
            endpoints[bdf] = ", ".join(sorted(names[bdf]))
        elif fn.is_mellanox_nic:
            endpoints[bdf] = "Mellanox NIC"
    above: dict[str, list[str]] = {}
    for bdf in sorted(endpoints):
        for anc in tree.functions[bdf].ancestors:
            if anc in tree.functions and anc not in endpoints:
                above.setdefault(anc, []).append(endpoints[bdf])
    watched = {bdf: [label] for bdf, label in endpoints.items()}
    for bdf, labels in above.items():
        watched[bdf] = ["upstream of " + ", ".join(labels)]
    return watched
