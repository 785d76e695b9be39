"""What this node has: GPUs (NVML), NVIDIA PCI devices and RDMA NICs (sysfs).

Capability gates (``Check.supported``) read this, never the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumon.errors import GpuLost, HwCondition, NvmlUnavailable
from gpumon.hw.hostfs import HostFs
from gpumon.hw.nvml import GpuInfo, Nvml

NVIDIA_VENDOR = "0x10de"


@dataclass(frozen=True)
class PciDevice:
    bus_id: str
    vendor: str
    device: str
    pci_class: str

    @property
    def is_gpu(self) -> bool:
        # 0x0300xx VGA controller, 0x0302xx 3D controller (datacenter GPUs)
        return self.vendor == NVIDIA_VENDOR and self.pci_class[:6] in ("0x0300", "0x0302")

    @property
    def is_nvswitch(self) -> bool:
        # NVSwitches enumerate as bridges (class 0x0680) with NVIDIA's vendor id
        return self.vendor == NVIDIA_VENDOR and self.pci_class.startswith("0x0680")


@dataclass(frozen=True)
class UnreadableGpu:
    """Why NVML could not describe a GPU it counts. ``lost``: NVML says the GPU is lost
    (GPU_IS_LOST, fallen off the bus), which takes a reboot, not a reset, to bring back."""

    reason: str
    lost: bool = False

    def __str__(self) -> str:
        return self.reason


@dataclass
class Inventory:
    gpus: list[GpuInfo] = field(default_factory=list)
    # GPUs NVML counts but could not describe, by index
    unreadable_gpus: dict[int, UnreadableGpu] = field(default_factory=dict)
    nvml_error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    pci_devices: list[PciDevice] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    # host files that could not be read while taking the inventory: what -> why (a hung read
    # included). The inventory is then partial; the checks read the machine again themselves.
    read_errors: dict[str, str] = field(default_factory=dict)

    @property
    def gpu_names(self) -> list[str]:
        return [g.name for g in self.gpus]

    @property
    def nvidia_pci_gpus(self) -> list[PciDevice]:
        return [d for d in self.pci_devices if d.is_gpu]

    def gpu_by_pci(self, bus_id: str) -> GpuInfo | None:
        for g in self.gpus:
            if g.pci_bus_id == bus_id:
                return g
        return None

    def no_nvml_gpus(self) -> str | None:
        """The capability gate of checks that read GPUs through NVML (lost GPUs count: they get findings)."""
        if not self.gpus and not self.unreadable_gpus:
            return "no GPUs visible to NVML"
        return None


def read_pci_devices(fs: HostFs, errors: dict[str, str] | None = None) -> list[PciDevice]:
    """Every PCI function under the host root (vendor, device, class), read now. A function
    that cannot be read is left out, and named in ``errors`` (its bus id -> why)."""
    out: list[PciDevice] = []
    try:
        listing = fs.listdir("sys/bus/pci/devices")
    except HwCondition as exc:
        if errors is not None:
            errors["sys/bus/pci/devices"] = f"{exc.call}: {exc}"
        return out
    for bus_id in listing:
        base = f"sys/bus/pci/devices/{bus_id}"
        try:
            vendor = fs.read_text(f"{base}/vendor").lower()
            device = fs.read_text(f"{base}/device").lower()
            pci_class = fs.read_text(f"{base}/class").lower()
        except HwCondition as exc:
            if errors is not None:
                errors[base] = f"{exc.call}: {exc}"
            continue
        out.append(PciDevice(bus_id.lower(), vendor, device, pci_class))
    return out


def collect(nvml: Nvml | None, fs: HostFs, nvml_error: str | None = None) -> Inventory:
    """What the node has. Host files that cannot be read (hung, unreadable) leave the inventory
    partial and are named in ``read_errors``: they never stop gpumon from starting."""
    inv = Inventory(nvml_error=nvml_error)
    inv.pci_devices = read_pci_devices(fs, inv.read_errors)
    try:
        inv.ib_devices = fs.listdir("sys/class/infiniband")
    except HwCondition as exc:
        inv.read_errors["sys/class/infiniband"] = f"{exc.call}: {exc}"
    if nvml is None:
        return inv
    try:
        inv.driver_version = nvml.driver_version()
        inv.cuda_driver_version = nvml.cuda_driver_version()
        count = nvml.device_count()
    except NvmlUnavailable as exc:
        inv.nvml_error = str(exc)
        return inv
    except HwCondition as exc:
        inv.nvml_error = f"{exc.call}: {exc}"
        return inv
    for index in range(count):
        try:
            inv.gpus.append(nvml.info(index))
        except GpuLost as exc:
            inv.unreadable_gpus[index] = UnreadableGpu(f"GPU is lost ({exc.call})", lost=True)
        except HwCondition as exc:
            inv.unreadable_gpus[index] = UnreadableGpu(f"{exc.call}: {exc}")
    return inv
