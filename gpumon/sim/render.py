"""Renders a scenario at time t: a host-root tree, a kernel log and the NVML state.

The tree has the shapes of the real files (sysfs IB ports with counters as in
the captured H100 tree, PCI devices with AER counters, /proc/stat btime,
boot_id); the kernel log is written in /dev/kmsg record format; the NVML
state is read by the injection library under the real nvidia-ml-py. gpumon
reads all three through its normal hardware layer: the simulator sits below
``gpumon/hw``, never beside the checks.
"""

from __future__ import annotations

import os
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path

from gpumon.errors import ConfigError
from gpumon.profiles import Profile, builtin_profiles
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.scenario import NVML_ERRORS, Fault, Scenario

# NVML device names as the driver reports them (realdata/nvidia-smi-q "Product Name"
# for H100; NVIDIA product names for the others).
GPU_NAMES = {
    "h100-sxm": "NVIDIA H100 80GB HBM3",
    "h200-sxm": "NVIDIA H200",
    "a100-sxm-80gb": "NVIDIA A100-SXM4-80GB",
    "b200": "NVIDIA B200",
}
ARCH_CODES = {"ampere": 7, "hopper": 9, "blackwell": 10}
# PCI layout of a real HGX H100 node (realdata/pcie-aer/lspci-vvv_h100-sxm5-hgx_*):
# each GPU has a ConnectX-7 right after it; NVSwitches at 83..86.
GPU_BUSES = ["19", "3b", "4c", "5d", "9b", "bb", "cb", "db"]
NIC_BUSES = ["1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc"]
NVSWITCH_BUSES = ["83", "84", "85", "86"]
MELLANOX = "0x15b3"
CX7_DEVICE = "0x1021"

_REASON_BITS = {
    "gpu_idle": 0x1, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80,
}
# Messages after "Xid (PCI:..): N, " taken from real lines in realdata/kmsg-xid.
_XID_TEXT = {
    13: "pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): "
        "Out Of Range Address",
    31: "pid=12890, name=python3, Ch 0000003b, intr 00000000. MMU Fault: ENGINE GRAPHICS "
        "GPCCLIENT_T1_1 faulted @ 0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    79: "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    109: "pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    119: "pid=2024380, name=nvidia-smi, Timeout after 6s of waiting for RPC response from GPU GSP! "
         "Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).",
}
UPTIME_AT_START_S = 3600.0


@dataclass
class _Port:
    device: str
    port: int
    bus: str


@dataclass
class SimNode:
    scenario: Scenario
    root: Path
    start_wall: float = field(default_factory=time.time)
    boot_id: str = field(default_factory=lambda: str(uuidlib.uuid4()))
    _emitted: set[int] = field(default_factory=set)
    _seq: int = 1000

    def __post_init__(self) -> None:
        profiles = builtin_profiles()
        if self.scenario.sku not in profiles:
            raise ConfigError(f"unknown sku {self.scenario.sku!r} (profiles: {', '.join(profiles)})",
                              file=self.scenario.file, key="sku")
        self.profile: Profile = profiles[self.scenario.sku]
        self.gpu_count = self.scenario.gpus or self.profile.gpu.count or 8
        if self.gpu_count > len(GPU_BUSES):
            raise ConfigError(f"the simulator lays out at most {len(GPU_BUSES)} GPUs",
                              file=self.scenario.file, key="gpus")
        nic_count = self.scenario.ib_devices
        if nic_count is None:
            nic_count = self.profile.network.ib_ports or 0
        self.ports = [_Port(f"mlx5_{i}", 1, NIC_BUSES[i % len(NIC_BUSES)]) for i in range(nic_count)]
        self.nic_count = nic_count
        for i, fault in enumerate(self.scenario.faults):
            if fault.gpu is not None and fault.gpu >= self.gpu_count:
                raise ConfigError(f"gpu {fault.gpu} does not exist (the node has {self.gpu_count})",
                                  file=self.scenario.file, key=f"faults[{i}].gpu")
            if fault.kind == "ib_down" and not any(
                    p.device == fault.device and p.port == fault.port for p in self.ports):
                raise ConfigError(f"no IB port {fault.device}/{fault.port} on this node",
                                  file=self.scenario.file, key=f"faults[{i}].device")
        self.host_root = self.root / "host"
        self.nvml_state_path = self.root / "nvml-state.txt"
        self.kmsg_path = self.host_root / "dev" / "kmsg"

    @property
    def boot_time(self) -> float:
        return self.start_wall - UPTIME_AT_START_S

    def gpu_bus(self, index: int) -> str:
        return f"0000:{GPU_BUSES[index]}:00.0"

    # -- rendering -------------------------------------------------------

    def render(self, t: float) -> None:
        """Write the node as it is ``t`` seconds into the scenario."""
        self._static_files()
        self._pci(t)
        self._infiniband(t)
        self._kernel_log(t)
        write_state(self._nvml(t), self.nvml_state_path)

    def _write(self, rel: str, text: str) -> None:
        path = self.host_root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def _static_files(self) -> None:
        self._write("proc/sys/kernel/random/boot_id", self.boot_id + "\n")
        self._write("proc/stat", f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {int(self.boot_time)}\n")
        self._write("proc/uptime", f"{UPTIME_AT_START_S:.2f} 0.00\n")

    def _faults(self, kind: str, t: float) -> list[Fault]:
        return [f for f in self.scenario.faults if f.kind == kind and f.at_s <= t]

    def _pci(self, t: float) -> None:
        pci_id = (self.profile.pci_device_ids or ["0x2330"])[0].lower()
        devices: list[tuple[str, str, str, str, int | None]] = []
        for i in range(self.gpu_count):
            devices.append((self.gpu_bus(i), "0x10de", pci_id, "0x030200", i))
        for i in range(min(self.nic_count, len(NIC_BUSES))):
            devices.append((f"0000:{NIC_BUSES[i]}:00.0", MELLANOX, CX7_DEVICE, "0x020700", None))
        if (self.profile.nvlink.links_per_gpu or 0) > 0 and self.gpu_count == 8:
            for bus in NVSWITCH_BUSES:
                devices.append((f"0000:{bus}:00.0", "0x10de", "0x22a3", "0x068000", None))
        for bus, vendor, device, cls, gpu_index in devices:
            base = f"sys/bus/pci/devices/{bus}"
            self._write(f"{base}/vendor", vendor + "\n")
            self._write(f"{base}/device", device + "\n")
            self._write(f"{base}/class", cls + "\n")
            counts = {"correctable": 0, "nonfatal": 0, "fatal": 0}
            for f in self._faults("aer", t):
                if gpu_index is not None and f.gpu == gpu_index and f.severity:
                    counts[f.severity] += f.count
            self._write(f"{base}/aer_dev_correctable",
                        f"RxErr {counts['correctable']}\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\n"
                        f"NonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {counts['correctable']}\n")
            self._write(f"{base}/aer_dev_nonfatal",
                        f"Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO {counts['nonfatal']}\n"
                        f"CmpltAbrt 0\nUnxCmplt 0\nRxOF 0\nMalfTLP 0\nECRC 0\nUnsupReq 0\nACSViol 0\n"
                        f"TOTAL_ERR_NONFATAL {counts['nonfatal']}\n")
            self._write(f"{base}/aer_dev_fatal",
                        f"Undefined 0\nDLP {counts['fatal']}\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\n"
                        f"TOTAL_ERR_FATAL {counts['fatal']}\n")
            self._write(f"{base}/current_link_speed", "32.0 GT/s PCIe\n")
            self._write(f"{base}/max_link_speed", "32.0 GT/s PCIe\n")
            self._write(f"{base}/current_link_width", "16\n")
            self._write(f"{base}/max_link_width", "16\n")

    def _infiniband(self, t: float) -> None:
        rate = self.profile.network.ib_rate_gbps or 400
        for p in self.ports:
            base = f"sys/class/infiniband/{p.device}"
            self._write(f"{base}/hca_type", "MT4129\n")
            self._write(f"{base}/fw_ver", "28.39.1002\n")
            self._write(f"{base}/board_id", "MT_0000000838\n")
            downs = [f for f in self._faults("ib_down", t) if f.device == p.device and f.port == p.port]
            down_now = any(f.active(t) for f in downs)
            port = f"{base}/ports/{p.port}"
            self._write(f"{port}/state", "1: DOWN\n" if down_now else "4: ACTIVE\n")
            self._write(f"{port}/phys_state", "2: Polling\n" if down_now else "5: LinkUp\n")
            self._write(f"{port}/rate", f"{rate:g} Gb/sec (4X NDR)\n")
            self._write(f"{port}/link_layer", "InfiniBand\n")
            for counter in ("symbol_error", "link_error_recovery", "port_rcv_errors",
                            "local_link_integrity_errors", "excessive_buffer_overrun_errors",
                            "port_xmit_discards", "port_rcv_remote_physical_errors"):
                self._write(f"{port}/counters/{counter}", "0\n")
            self._write(f"{port}/counters/link_downed", f"{len(downs)}\n")
            link = self.host_root / base / "device"
            if not link.is_symlink():
                link.symlink_to(f"../../../bus/pci/devices/0000:{p.bus}:00.0")

    def _kernel_log(self, t: float) -> None:
        self.kmsg_path.parent.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        for i, f in enumerate(self.scenario.faults):
            if i in self._emitted or f.at_s > t or f.kind not in ("xid", "kernel_line"):
                continue
            self._emitted.add(i)
            usec = int((UPTIME_AT_START_S + f.at_s) * 1e6)
            for msg in self._messages(f):
                lines.append(f"4,{self._seq},{usec},-;{msg}\n")
                self._seq += 1
        if lines or not self.kmsg_path.exists():
            with open(self.kmsg_path, "a", encoding="utf-8") as fh:
                fh.writelines(lines)

    def _messages(self, f: Fault) -> list[str]:
        if f.kind == "kernel_line":
            return [str(f.text)]
        assert f.gpu is not None and f.code is not None
        bus = self.gpu_bus(f.gpu)[:-2]  # Xid lines carry no PCI function
        text = f.message or _XID_TEXT.get(f.code, f"pid='<unknown>', name=<unknown>, simulated Xid {f.code}")
        out = []
        if f.code == 79:
            out += [f"NVRM: GPU at PCI:{bus}: {self._uuid(f.gpu)}",
                    f"NVRM: GPU Board Serial Number: {self._serial(f.gpu)}"]
        out.append(f"NVRM: Xid (PCI:{bus}): {f.code}, {text}")
        return out

    def _uuid(self, index: int) -> str:
        return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'{self.scenario.name}-{index}')}"

    def _serial(self, index: int) -> str:
        return f"16537230527{index:02d}"

    def _nvml(self, t: float) -> NvmlNodeState:
        links = self.profile.nvlink.links_per_gpu or 0
        arch = ARCH_CODES.get(self.profile.architecture or "", 9)
        pci_id = int((self.profile.pci_device_ids or ["0x2330"])[0], 16)
        gpus: list[GpuState] = []
        for i in range(self.gpu_count):
            g = GpuState(index=i, name=GPU_NAMES.get(self.scenario.sku, "NVIDIA H100 80GB HBM3"),
                         uuid=self._uuid(i), serial=self._serial(i),
                         pci_bus_id=f"0000{self.gpu_bus(i)}".upper(),  # NVML's 8-digit domain
                         pci_device_id=(pci_id << 16) | 0x10DE, minor_number=i, architecture=arch,
                         nvlink_states=[1] * links)
            mask = 0
            for f in self._faults("throttle", t):
                if f.gpu == i and f.active(t):
                    for r in f.reasons:
                        mask |= _REASON_BITS[r]
                    held_ns = int((t - f.at_s) * 1e9)
                    if {"hw_thermal_slowdown", "sw_thermal_slowdown"} & set(f.reasons):
                        g.violation_ns[1] = g.violation_ns.get(1, 0) + held_ns
                    if {"hw_power_brake_slowdown", "sw_power_cap"} & set(f.reasons):
                        g.violation_ns[0] = g.violation_ns.get(0, 0) + held_ns
            g.clocks_event_reasons = mask or 0x1  # idle when nothing else holds clocks down
            for f in self._faults("temperature", t):
                if f.gpu == i and f.active(t):
                    if f.core_c is not None:
                        g.temperature_c = int(f.core_c)
                    if f.hbm_c is not None:
                        g.memory_temperature_c = int(f.hbm_c)
            for f in self._faults("nvml_error", t):
                if f.gpu == i and f.active(t) and f.function and f.error:
                    g.calls.append(InjectedCall(f.function, error=NVML_ERRORS[f.error]))
            for f in self._faults("nvml_hang", t):
                if f.gpu == i and f.active(t) and f.function:
                    g.calls.append(InjectedCall(f.function, hang_s=float(f.seconds or 0)))
            for seq, f in enumerate(self._faults("xid", t), start=1):
                if f.gpu == i and f.code is not None:
                    g.xid_events.append((f.code, seq))
                    if f.code == 79:
                        # a GPU off the bus answers every NVML call with GPU_IS_LOST
                        g.calls.append(InjectedCall("*", error=NVML_ERRORS["gpu_is_lost"]))
            gpus.append(g)
        return NvmlNodeState(driver_version=self.scenario.driver_version,
                             cuda_driver_version=self.scenario.cuda_driver_version, gpus=gpus)
