"""gpu_presence: GPUs NVML sees vs NVIDIA GPUs on the PCI bus vs the profile's GPU count.

Three counts, read live each run (the startup inventory is only a cache of PCI
classes): NVML's device count and what each index answers, the SKU's GPUs
under ``<host-root>/sys/bus/pci/devices`` (matched by the profile's PCI
device ids, so a display GPU or a BMC VGA of another model does not count),
and ``gpu.count`` of the profile.

- On the bus but not in NVML: the driver failed to attach the GPU or dropped
  it -> fail, reboot_node, on ``pci/<bus-id>``.
- NVML says the GPU is lost (GPU_IS_LOST; Xid 79 territory) -> fail, reboot_node.
- NVML sees fewer GPUs than the profile: reboot_node when the missing ones are
  on the bus (the driver can take them again after a reboot); inspect_hardware
  when they are not even on the bus, because PCIe enumeration at this boot
  already failed to find them and a warm reboot rarely brings back a GPU the
  firmware could not train: it needs a power cycle, a reseat or an RMA.
- More GPUs than the profile: warn (wrong profile?).
- No PCI information under the host root: the bus comparison is ``unknown``.
- A PCI function whose vendor/device/class cannot be read (a read that hangs, an I/O error)
  is its own finding on ``pci/<bus-id>`` (a hang: fail, naming the file), is not counted
  as a GPU, and makes the bus count a lower bound: a shortfall it may explain is ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import GPU_LOST, Check, CheckContext
from gpumon.errors import GpuLost, HwCondition, NotSupported
from gpumon.hw.inventory import NVIDIA_VENDOR, Inventory, PciDevice
from gpumon.hw.nvml import GpuInfo
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu, pci

_PCI_DIR = "sys/bus/pci/devices"


@dataclass
class NvmlView:
    count: int | None = None
    error: HwCondition | None = None
    gpus: dict[int, GpuInfo] = field(default_factory=dict)
    lost: dict[int, HwCondition] = field(default_factory=dict)
    unreadable: dict[int, HwCondition] = field(default_factory=dict)

    @property
    def bus_ids(self) -> set[str]:
        return {g.pci_bus_id for g in self.gpus.values()}


@dataclass
class BusView:
    gpus: list[PciDevice] = field(default_factory=list)  # the SKU's GPUs (plus any NVML knows)
    other_nvidia: list[PciDevice] = field(default_factory=list)  # NVIDIA GPUs of other models
    error: str | None = None  # no PCI information: why
    # functions listed on the bus whose identity cannot be read (hung, I/O error): bus id -> why
    unreadable: dict[str, HwCondition] = field(default_factory=dict)


def _is_nvidia_gpu(vendor: str, pci_class: str) -> bool:
    return PciDevice("", vendor, "", pci_class).is_gpu


class GpuPresenceCheck(Check):
    name = "gpu_presence"
    phase = Phase.CONTINUOUS
    description = "GPU count: NVML vs NVIDIA GPUs on the PCI bus vs the SKU profile"
    interval = 60.0
    timeout = 30.0

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.gpus and not inventory.unreadable_gpus and not inventory.nvidia_pci_gpus:
            return "no NVIDIA GPU on this node"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        nv = self._nvml(ctx)
        bus = self._bus(ctx, nv)
        out: list[Finding] = []
        for index, cond in sorted(nv.lost.items()):
            out.append(self.finding(gpu(index), Severity.FAIL, f"GPU {index} lost ({cond.call}): NVML "
                                    "answers GPU_IS_LOST", Action.REBOOT_NODE, call=cond.call,
                                    **{GPU_LOST: True}))
        for index, cond in sorted(nv.unreadable.items()):
            out.append(self.from_condition(cond, gpu(index)))
        for bus_id, cond in sorted(bus.unreadable.items()):
            out.append(self.from_condition(cond, pci(bus_id)))
        out.extend(self._bus_vs_nvml(nv, bus))
        out.append(self._counts(ctx, nv, bus))
        return out

    # -- readings --------------------------------------------------------

    def _nvml(self, ctx: CheckContext) -> NvmlView:
        view = NvmlView()
        try:
            view.count = ctx.hw.nvml.device_count()
        except HwCondition as cond:
            view.error = cond
            return view
        for index in range(view.count):
            try:
                view.gpus[index] = ctx.hw.nvml.info(index)
            except GpuLost as cond:
                view.lost[index] = cond
            except HwCondition as cond:
                view.unreadable[index] = cond
        return view

    def _bus(self, ctx: CheckContext, nv: NvmlView) -> BusView:
        """NVIDIA GPUs on the bus now. Classes come from the inventory when it knows the address."""
        view = BusView()
        try:
            listing = ctx.hw.fs.listdir(_PCI_DIR)
        except HwCondition as cond:
            view.error = str(cond)
            return view
        if not listing:
            view.error = (f"no PCI devices under {ctx.hw.fs.path(_PCI_DIR)}: is the host's /sys "
                          "mounted there?")
            return view
        known = {d.bus_id: d for d in ctx.inventory.pci_devices}
        sku_ids = {i.lower() for i in ctx.profile.pci_device_ids}
        for entry in listing:
            bus_id = entry.lower()
            dev = known.get(bus_id) or self._read_device(ctx, entry)
            if isinstance(dev, HwCondition):
                view.unreadable[bus_id] = dev
                continue
            if dev is None or not _is_nvidia_gpu(dev.vendor, dev.pci_class):
                continue
            if not sku_ids or dev.device in sku_ids or bus_id in nv.bus_ids:
                view.gpus.append(dev)
            else:
                view.other_nvidia.append(dev)
        return view

    @staticmethod
    def _read_device(ctx: CheckContext, entry: str) -> PciDevice | HwCondition | None:
        """The function's identity; None when it is not an NVIDIA one or vanished meanwhile; the
        condition when it cannot be read (it may be a GPU: not counted, but not forgotten)."""
        base = f"{_PCI_DIR}/{entry}"
        try:
            vendor = ctx.hw.fs.read_text(f"{base}/vendor").lower()
            if vendor != NVIDIA_VENDOR:
                return None
            device = ctx.hw.fs.read_text(f"{base}/device").lower()
            pci_class = ctx.hw.fs.read_text(f"{base}/class").lower()
        except NotSupported:
            return None  # removed while listed
        except HwCondition as cond:
            return cond
        return PciDevice(entry.lower(), vendor, device, pci_class)

    # -- comparisons -----------------------------------------------------

    def _bus_vs_nvml(self, nv: NvmlView, bus: BusView) -> list[Finding]:
        if bus.error is not None or nv.count is None:
            return []
        on_bus = {d.bus_id: d for d in bus.gpus}
        missing = sorted(set(on_bus) - nv.bus_ids)
        # A lost or unreadable GPU is counted by NVML but cannot tell its bus id: as many missing
        # bus GPUs as NVML has such GPUs are accounted for (they get their own gpu/<i> finding).
        unexplained = len(nv.lost) + len(nv.unreadable)
        out: list[Finding] = []
        if len(missing) > unexplained:
            note = (f" (NVML counts {unexplained} GPU(s) it cannot describe, so {len(missing) - unexplained} "
                    f"of these {len(missing)} are not in NVML at all)") if unexplained else ""
            for bus_id in missing:
                dev = on_bus[bus_id]
                out.append(self.finding(pci(bus_id), Severity.FAIL,
                                        f"NVIDIA GPU {dev.device} at {bus_id} is on the PCI bus but not in "
                                        f"NVML{note}", Action.REBOOT_NODE, vendor=dev.vendor,
                                        device=dev.device, pci_class=dev.pci_class))
        for g in sorted(nv.gpus.values(), key=lambda g: g.index):
            if g.pci_bus_id not in on_bus and g.pci_bus_id not in bus.unreadable:
                out.append(self.finding(gpu(g.index), Severity.UNKNOWN,
                                        f"NVML reports GPU {g.index} at {g.pci_bus_id}, which is not under "
                                        f"{_PCI_DIR} of the host root: is the host's /sys mounted?",
                                        pci_bus_id=g.pci_bus_id, uuid=g.uuid))
        return out

    def _counts(self, ctx: CheckContext, nv: NvmlView, bus: BusView) -> Finding:
        expected = ctx.profile.gpu.count
        evidence: dict[str, Any] = {
            "nvml_gpus": nv.count, "bus_gpus": None if bus.error else len(bus.gpus),
            "profile_gpus": expected, "profile": ctx.profile.name,
            "pci_device_ids": list(ctx.profile.pci_device_ids),
            "lost": sorted(nv.lost), "unreadable": sorted(nv.unreadable),
        }
        if bus.other_nvidia:
            evidence["other_nvidia_gpus"] = [f"{d.bus_id} {d.device}" for d in bus.other_nvidia]
        if bus.error:
            evidence["bus_error"] = bus.error
        if bus.unreadable:
            evidence["unreadable_pci_functions"] = {b: f"{c.call}: {c}"
                                                    for b, c in sorted(bus.unreadable.items())}
        if nv.count is None:
            assert nv.error is not None
            found = self.from_condition(nv.error, NODE)
            return self.finding(NODE, max(found.severity, Severity.UNKNOWN),
                                f"NVML device count unreadable: {found.message}", found.action, **evidence)
        bus_n = None if bus.error else len(bus.gpus)
        # functions that could not be identified may be GPUs: the bus count is then a lower bound
        maybe = len(bus.unreadable)
        if expected is not None and nv.count < expected:
            on_bus_enough = bus_n is None or bus_n + maybe >= expected
            where = ("they are on the PCI bus" if bus_n is not None and bus_n >= expected else
                     "the PCI bus cannot be read" if bus_n is None else
                     f"{bus_n} are on the PCI bus and {maybe} PCI function(s) cannot be identified"
                     if bus_n + maybe >= expected else
                     f"only {bus_n} are on the PCI bus: not enumerated by PCIe at this boot")
            return self.finding(NODE, Severity.FAIL,
                                f"NVML sees {nv.count} of the {expected} GPUs of {ctx.profile.name}; {where}",
                                Action.REBOOT_NODE if on_bus_enough else Action.INSPECT_HARDWARE,
                                **evidence)
        if expected is not None and max(nv.count, bus_n or 0) > expected:
            return self.finding(NODE, Severity.WARN,
                                f"{max(nv.count, bus_n or 0)} GPUs but profile {ctx.profile.name} says "
                                f"{expected}: wrong profile?", **evidence)
        if bus_n is None:
            return self.finding(NODE, Severity.UNKNOWN,
                                f"NVML sees {nv.count} GPUs"
                                + (f" (profile: {expected})" if expected is not None else "")
                                + f"; PCI bus not compared: {bus.error}", **evidence)
        if bus_n < nv.count <= bus_n + maybe:
            return self.finding(NODE, Severity.UNKNOWN,
                                f"NVML sees {nv.count} GPUs, the PCI bus has {bus_n} and {maybe} PCI "
                                f"function(s) that cannot be identified: "
                                f"{', '.join(sorted(bus.unreadable))}", **evidence)
        if bus_n != nv.count:
            # per-device findings above say which; this one carries the counts
            return self.finding(NODE, Severity.FAIL if bus_n > nv.count else Severity.UNKNOWN,
                                f"NVML sees {nv.count} GPUs, the PCI bus has {bus_n}",
                                Action.REBOOT_NODE if bus_n > nv.count else Action.NONE, **evidence)
        what = f"{nv.count} GPUs in NVML and on the PCI bus"
        if expected is not None:
            what += f", as profile {ctx.profile.name} expects"
        return self.ok(NODE, what, **evidence)
