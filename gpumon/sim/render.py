"""Renders a scenario at time t: a host-root tree, a kernel log and the NVML state.

The tree has the shapes of the real files (sysfs IB ports with counters as in
the captured H100 tree, PCI devices with AER counters, /proc/stat btime,
boot_id); the kernel log is written in /dev/kmsg record format; the NVML
state is read by the injection library under the real nvidia-ml-py. gpumon
reads all three through its normal hardware layer: the simulator sits below
``gpumon/hw``, never beside the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpumon.atomic import write_atomic
from gpumon.errors import ConfigError
from gpumon.profiles import Profile, builtin_profiles
from gpumon.sim.devices import SIM_DEVICES_FILE, DeviceModel
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvLinkErrorCounters, NvmlNodeState, write_state
from gpumon.sim.scenario import IB_COUNTERS, NVML_ERRORS, Fault, Scenario

# NVML device names as the driver reports them (realdata/nvidia-smi-q "Product Name"
# for H100; NVIDIA product names for the others).
GPU_NAMES = {
    "h100-sxm": "NVIDIA H100 80GB HBM3",
    "h200-sxm": "NVIDIA H200",
    "a100-sxm-80gb": "NVIDIA A100-SXM4-80GB",
    "b200": "NVIDIA B200",
    "h100-pcie": "NVIDIA H100 PCIe",
    "gb200": "NVIDIA GB200",
}
ARCH_CODES = {"ampere": 7, "hopper": 9, "blackwell": 10}
# PCI layout of a real HGX H100 node (realdata/pcie-aer/lspci-vvv_h100-sxm5-hgx_*):
# each GPU has a ConnectX-7 right after it; NVSwitches at 83..86.
GPU_BUSES = ["19", "3b", "4c", "5d", "9b", "bb", "cb", "db"]
NIC_BUSES = ["1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc"]
NVSWITCH_BUSES = ["83", "84", "85", "86", "87", "88"]
# NVSwitches on the 8-GPU baseboard: (PCI device id, count). H100/H200: 4 x 22a3 in the real HGX
# H100 lspci (realdata/pcie-aer/lspci-vvv_h100-sxm5-hgx_*); A100: 6 x 1af1 (realdata/pcie-aer/
# lspci-nn_a100-hgx.txt; NVIDIA Fabric Manager guide: "six second generation NVSwitches").
NVSWITCHES = {"h100-sxm": ("0x22a3", 4), "h200-sxm": ("0x22a3", 4), "a100-sxm-80gb": ("0x1af1", 6)}
PCIE_SPEEDS = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
               5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}
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
IB_SPEED_NAMES = {400.0: "NDR", 200.0: "HDR", 100.0: "EDR", 56.0: "FDR"}


def default_root(scenario: Scenario) -> Path:
    """Where ``--simulate`` keeps the simulated node when no ``--sim-dir`` is given: per user and per
    scenario, ``$XDG_STATE_HOME/gpumon/sim/<scenario>`` (``~/.local/state/gpumon/sim/<scenario>``),
    so that ``gpumon status --simulate X`` finds what ``gpumon daemon --simulate X`` left there. A
    scenario file's node is told apart from another file's of the same name by the file's path."""
    base = os.environ.get("XDG_STATE_HOME", "")
    state = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    stem = Path(scenario.file).stem
    if scenario.file == f"config/scenarios/{stem}.yaml":  # shipped (load_scenario names it so)
        key = stem
    else:
        where = hashlib.sha256(str(Path(scenario.file).resolve()).encode()).hexdigest()[:8]
        key = f"{scenario.name}-{where}"
    key = re.sub(r"[^A-Za-z0-9._-]", "_", key)
    return state / "gpumon" / "sim" / (f"_{key}" if key.startswith(".") or not key else key)


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
    _written: dict[str, str] = field(default_factory=dict)
    _seq: int = 1000
    # False: a new boot of the node kept in ``root`` (new boot id, clock and kernel log; the
    # health state under root/state is kept, as a real node's is across a reboot)
    resume: bool = True
    resumed: bool = field(default=False, init=False)  # the node was already in ``root``

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
            if fault.kind == "compute_process" and any(
                    o.kind == "compute_process" and (o.gpu, o.pid) == (fault.gpu, fault.pid)
                    for o in self.scenario.faults[:i]):
                raise ConfigError(f"pid {fault.pid} is already on GPU {fault.gpu}",
                                  file=self.scenario.file, key=f"faults[{i}].pid")
            if fault.peer is not None and fault.peer >= self.gpu_count:
                raise ConfigError(f"gpu {fault.peer} does not exist (the node has {self.gpu_count})",
                                  file=self.scenario.file, key=f"faults[{i}].peer")
            if fault.kind == "ib_down" and not any(
                    p.device == fault.device and p.port == fault.port for p in self.ports):
                raise ConfigError(f"no IB port {fault.device}/{fault.port} on this node",
                                  file=self.scenario.file, key=f"faults[{i}].device")
        self.host_root = self.root / "host"
        self.nvml_state_path = self.root / "nvml-state.txt"
        self.kmsg_path = self.host_root / "dev" / "kmsg"
        if self.resume:
            self._resume()
        else:
            for log in (self.kmsg_path, self.host_root / "var/log/fabricmanager.log"):
                log.unlink(missing_ok=True)

    # A node rendered again into the same directory is the same boot of the same
    # node (a daemon restart), not a new one: keep its boot id, clock and log.
    def _resume(self) -> None:
        path = self.root / "sim.json"
        try:
            saved = json.loads(path.read_text())
            self.boot_id = str(saved["boot_id"])
            self.start_wall = float(saved["start_wall"])
            self._emitted = {int(i) for i in saved["emitted"]}
            self._seq = int(saved["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        self.resumed = True

    def _save(self) -> None:
        # atomic: another command on the same node (``gpumon status``, ``run-bootstrap`` while the
        # daemon runs) must never read half a file and take the node for a new one
        write_atomic(self.root / "sim.json", json.dumps({
            "boot_id": self.boot_id, "start_wall": self.start_wall,
            "emitted": sorted(self._emitted), "seq": self._seq}), durable=False)

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
        self._fm_log(t)
        self._compute(t)
        write_state(self._nvml(t), self.nvml_state_path)
        self._save()

    def _write(self, rel: str, text: str) -> None:
        # Only what changed is rewritten: a step of simulated time should cost
        # what the scenario changes, not a rewrite of ~640 files.
        if self._written.get(rel) == text:
            return
        self._written[rel] = text
        # two processes may render one node: each writes its own temp file
        write_atomic(self.host_root / rel, text, durable=False)

    def _static_files(self) -> None:
        self._write("proc/sys/kernel/random/boot_id", self.boot_id + "\n")
        self._write("proc/stat", f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {int(self.boot_time)}\n")
        self._write("proc/uptime", f"{UPTIME_AT_START_S:.2f} 0.00\n")

    def _faults(self, kind: str, t: float) -> list[Fault]:
        return [f for f in self.scenario.faults if f.kind == kind and f.at_s <= t]

    def _pci_layout(self) -> list[tuple[str, str, str, str, str, int | None]]:
        """(sysfs device path, bus id, vendor, device, class, gpu index) of every rendered PCI function.

        Shaped like an HGX board: each GPU and its NIC sit under one PCIe switch
        (upstream port + two downstream ports) below a root port.
        """
        gpu_id = (self.profile.pci_device_ids or ["0x2330"])[0].lower()
        out: list[tuple[str, str, str, str, str, int | None]] = []
        for i in range(max(self.gpu_count, min(self.nic_count, len(NIC_BUSES)))):
            g = int(GPU_BUSES[i], 16)
            root_bus, up, down = f"{g - 4:02x}", f"0000:{g - 3:02x}:00.0", f"0000:{g - 2:02x}"
            root = f"0000:{root_bus}:01.0"
            base = f"sys/devices/pci0000:{root_bus}/{root}"
            out.append((base, root, "0x8086", "0x352a", "0x060400", None))
            out.append((f"{base}/{up}", up, "0x1000", "0xc030", "0x060400", None))
            if i < self.gpu_count:
                out.append((f"{base}/{up}/{down}:00.0", f"{down}:00.0", "0x1000", "0xc030", "0x060400",
                            None))
                gpu_bus = self.gpu_bus(i)
                out.append((f"{base}/{up}/{down}:00.0/{gpu_bus}", gpu_bus, "0x10de", gpu_id, "0x030200", i))
            if i < self.nic_count:
                nic = f"0000:{NIC_BUSES[i]}:00.0"
                out.append((f"{base}/{up}/{down}:01.0", f"{down}:01.0", "0x1000", "0xc030", "0x060400",
                            None))
                out.append((f"{base}/{up}/{down}:01.0/{nic}", nic, MELLANOX, CX7_DEVICE, "0x020700", None))
        switch_id, switches = NVSWITCHES.get(self.scenario.sku, ("", 0))
        if self.gpu_count == 8:
            for bus in NVSWITCH_BUSES[:switches]:
                sw = f"0000:{bus}:00.0"
                out.append((f"sys/devices/pci0000:80/0000:80:01.0/{sw}", sw, "0x10de", switch_id,
                            "0x068000", None))
        return out

    def nic_path(self, index: int) -> str:
        for path, bus, *_ in self._pci_layout():
            if bus == f"0000:{NIC_BUSES[index]}:00.0":
                return path
        raise KeyError(index)

    def _pci(self, t: float) -> None:
        max_gen = self.profile.pcie.generation or 5
        max_width = self.profile.pcie.width or 16
        for path, bus, vendor, device, cls, gpu_index in self._pci_layout():
            self._write(f"{path}/vendor", vendor + "\n")
            self._write(f"{path}/device", device + "\n")
            self._write(f"{path}/class", cls + "\n")
            link = self.host_root / "sys/bus/pci/devices" / bus
            if not link.is_symlink():
                link.parent.mkdir(parents=True, exist_ok=True)
                _symlink(link, f"../../../{path.removeprefix('sys/')}")
            counts = {"correctable": 0, "nonfatal": 0, "fatal": 0}
            gen, width = max_gen, max_width
            if gpu_index is not None:
                for f in self._faults("aer", t):
                    if f.gpu == gpu_index and f.severity:
                        counts[f.severity] += f.amount(t)
                for f in self._faults("pcie_link", t):
                    if f.gpu == gpu_index and f.active(t):
                        gen, width = f.gen or gen, f.width or width
            c, n, fa = counts["correctable"], counts["nonfatal"], counts["fatal"]
            self._write(f"{path}/aer_dev_correctable",
                        f"RxErr {c}\nBadTLP 0\nBadDLLP 0\nRollover 0\nTimeout 0\nNonFatalErr 0\n"
                        f"CorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {c}\n")
            self._write(f"{path}/aer_dev_nonfatal",
                        f"Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO {n}\nCmpltAbrt 0\n"
                        f"UnxCmplt 0\nRxOF 0\nMalfTLP 0\nECRC 0\nUnsupReq 0\nACSViol 0\n"
                        f"TOTAL_ERR_NONFATAL {n}\n")
            self._write(f"{path}/aer_dev_fatal",
                        f"Undefined 0\nDLP {fa}\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nTOTAL_ERR_FATAL {fa}\n")
            self._write(f"{path}/current_link_speed", PCIE_SPEEDS[gen] + "\n")
            self._write(f"{path}/max_link_speed", PCIE_SPEEDS[max_gen] + "\n")
            self._write(f"{path}/current_link_width", f"{width}\n")
            self._write(f"{path}/max_link_width", f"{max_width}\n")

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
            port_rate = rate
            for f in self._faults("ib_rate", t):
                if f.device == p.device and f.port == p.port and f.active(t) and f.rate_gbps is not None:
                    port_rate = f.rate_gbps
            self._write(f"{port}/rate", f"{port_rate:g} Gb/sec (4X {IB_SPEED_NAMES.get(port_rate, 'NDR')})\n")
            self._write(f"{port}/link_layer", "InfiniBand\n")
            for counter in IB_COUNTERS:
                value = len(downs) if counter == "link_downed" else 0
                for f in self._faults("ib_errors", t):
                    if f.device == p.device and f.port == p.port and f.counter == counter:
                        value += f.amount(t)
                self._write(f"{port}/counters/{counter}", f"{value}\n")
            link = self.host_root / base / "device"
            if not link.is_symlink():
                index = int(p.device.removeprefix("mlx5_"))
                _symlink(link, f"../../../{self.nic_path(index).removeprefix('sys/')}")

    def _kernel_log(self, t: float) -> None:
        self.kmsg_path.parent.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        for i, f in enumerate(self.scenario.faults):
            if i in self._emitted or f.at_s > t or f.kind not in ("xid", "kernel_line", "sxid"):
                continue
            self._emitted.add(i)
            usec = int((UPTIME_AT_START_S + f.at_s) * 1e6)
            for msg in self._messages(f):
                lines.append(f"4,{self._seq},{usec},-;{msg}\n")
                self._seq += 1
        if lines or not self.kmsg_path.exists():
            with open(self.kmsg_path, "a", encoding="utf-8") as fh:
                fh.writelines(lines)

    def _fm_log(self, t: float) -> None:
        lines: list[str] = []
        for i, f in enumerate(self.scenario.faults):
            if i in self._emitted or f.at_s > t or f.kind != "fm_log":
                continue
            self._emitted.add(i)
            stamp = time.strftime("%b %d %Y %H:%M:%S", time.gmtime(self.start_wall + f.at_s))
            lines.append(f"[{stamp}] [ERROR] [tid 1374] {f.text}\n")
        path = self.host_root / "var/log/fabricmanager.log"
        if lines or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fh.writelines(lines)

    def _messages(self, f: Fault) -> list[str]:
        if f.kind == "kernel_line":
            return [str(f.text)]
        if f.kind == "sxid":
            assert f.switch is not None and f.code is not None
            bus = f"0000:{NVSWITCH_BUSES[f.switch % len(NVSWITCH_BUSES)]}:00.0"
            head = f"nvidia-nvswitch{f.switch}: SXid (PCI:{bus}): {f.code}"
            word = "Fatal" if f.fatal else "Non-fatal"
            link = f.link if f.link is not None else 0
            out = [f"{head}, {word}, Link {link:02d} {f.message or 'simulated NVSwitch error'}"]
            if f.fatal:
                out += [f"{head}, Severity 1 Engine instance {link:02d} Sub-engine instance 00",
                        f"{head}, Data {{0x10000000, 0x10000000, 0x00000000, 0x10000000, 0x00000000, "
                        "0x00000000, 0x00000000, 0x00000000, 0x00000000}"]
            return out
        assert f.gpu is not None and f.code is not None
        bus = self.gpu_bus(f.gpu)[:-2]  # Xid lines carry no PCI function
        text = f.message or _XID_TEXT.get(f.code, f"pid='<unknown>', name=<unknown>, simulated Xid {f.code}")
        out = []
        if f.code == 79:
            out += [f"NVRM: GPU at PCI:{bus}: {self._uuid(f.gpu)}",
                    f"NVRM: GPU Board Serial Number: {self._serial(f.gpu)}"]
        out.append(f"NVRM: Xid (PCI:{bus}): {f.code}, {text}")
        return out

    def _compute(self, t: float) -> None:
        """The simulated GPUs' device models (gpumon/sim/devices.py), read by ``Hardware.sim_devices``.

        Keyed by the index NVML gives the GPU at ``t`` (a missing GPU shifts the ones after it), as
        the compute checks know their GPUs by NVML index.
        """
        missing = {f.gpu for f in self._faults("gpu_missing", t) if f.active(t)}
        nvml_index = {i: k for k, i in enumerate(i for i in range(self.gpu_count) if i not in missing)}
        models: dict[int, DeviceModel] = {}
        for f in self.scenario.faults:
            if not f.active(t) or f.gpu is None or f.kind not in ("compute_slow", "allreduce_corrupt",
                                                                   "p2p_slow", "sdc"):
                continue
            if f.gpu not in nvml_index or (f.peer is not None and f.peer not in nvml_index):
                continue  # a GPU NVML does not see runs no compute
            m = models.get(nvml_index[f.gpu], DeviceModel())
            if f.kind == "compute_slow":
                m = replace(m, speed=min(m.speed, f.factor or 1.0))
            elif f.kind == "sdc":
                rate = f.rate if f.rate is not None else 1.0
                m = replace(m, sdc=f"dtype={f.dtype or 'float32'},rate={rate:g}")
            elif f.kind == "allreduce_corrupt":
                m = replace(m, allreduce_wrong=m.allreduce_wrong + (f.count if f.count is not None else 1))
            elif f.peer is None:
                m = replace(m, all_links=min(m.all_links, f.factor or 1.0))
            else:
                peer = nvml_index[f.peer]
                m = replace(m, links={**m.links, peer: min(m.links.get(peer, 1.0), f.factor or 1.0)})
            models[nvml_index[f.gpu]] = m
        self._write(SIM_DEVICES_FILE, json.dumps({str(i): m.to_json() for i, m in sorted(models.items())},
                                                 sort_keys=True) + "\n")

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
                         nvlink_states=[1] * links,
                         pcie_gen_max=self.profile.pcie.generation or 5,
                         pcie_gen_current=self.profile.pcie.generation or 5,
                         pcie_width_max=self.profile.pcie.width or 16,
                         pcie_width_current=self.profile.pcie.width or 16)
            mask = 0
            for f in self._faults("throttle", t):
                if f.gpu != i:
                    continue
                if f.active(t):
                    for r in f.reasons:
                        mask |= _REASON_BITS[r]
                # NVML's violation counters are cumulative: time held so far, over every
                # fault that has started. THERMAL counts thermal slowdowns; POWER is the
                # SW power cap (NVML header), not the HW power brake.
                end = f.end_s if f.end_s is not None else t
                held_ns = int((min(t, end) - f.at_s) * 1e9)
                if {"hw_thermal_slowdown", "sw_thermal_slowdown"} & set(f.reasons):
                    g.violation_ns[1] = g.violation_ns.get(1, 0) + held_ns
                if "sw_power_cap" in f.reasons:
                    g.violation_ns[0] = g.violation_ns.get(0, 0) + held_ns
            g.clocks_event_reasons = mask or 0x1  # idle when nothing else holds clocks down
            for f in self._faults("temperature", t):
                if f.gpu == i and f.active(t):
                    if f.core_c is not None:
                        g.temperature_c = int(f.core_c)
                    if f.hbm_c is not None:
                        g.memory_temperature_c = int(f.hbm_c)
            for f in self._faults("nvlink_down", t):
                if f.gpu == i and f.active(t) and f.link is not None and f.link < links:
                    g.nvlink_states[f.link] = 0
            counters = [NvLinkErrorCounters() for _ in range(links)]
            for f in self._faults("nvlink_errors", t):
                if f.gpu == i and f.link is not None and f.link < links and f.counter:
                    c = counters[f.link]
                    setattr(c, f.counter, getattr(c, f.counter) + f.amount(t))
            g.nvlink_error_counters = counters
            for f in self._faults("ecc", t):
                if f.gpu == i:
                    g.ecc_volatile_corrected += f.corrected or 0
                    g.ecc_aggregate_corrected += f.corrected or 0
                    g.ecc_volatile_uncorrected += f.uncorrected or 0
                    g.ecc_aggregate_uncorrected += f.uncorrected or 0
            for f in self._faults("remap", t):
                if f.gpu == i and f.active(t):
                    g.remapped_rows_pending = g.remapped_rows_pending or bool(f.pending)
                    g.remapped_rows_failure = g.remapped_rows_failure or bool(f.failure)
                    g.remapped_rows_corrected += f.corrected or 0
                    g.remapped_rows_uncorrected += f.uncorrected or 0
                    moved = (f.banks_low or 0) + (f.banks_none or 0)
                    g.remap_histogram_low += f.banks_low or 0
                    g.remap_histogram_none += f.banks_none or 0
                    g.remap_histogram_max = max(0, g.remap_histogram_max - moved)
            for f in self._faults("fabric", t):
                if f.gpu == i and f.active(t) and f.state is not None:
                    g.fabric_state = f.state
                    g.fabric_status = f.status or 0
            for f in self._faults("pcie_link", t):
                if f.gpu == i and f.active(t):
                    g.pcie_gen_current = f.gen or g.pcie_gen_current
                    g.pcie_width_current = f.width or g.pcie_width_current
            for f in self._faults("utilization", t):
                if f.gpu == i and f.active(t) and f.pct is not None:
                    g.utilization_gpu = f.pct
            for f in self._faults("activity", t):
                if f.gpu == i and f.active(t):
                    if f.pct is not None:
                        g.utilization_gpu = f.pct
                    if f.memory_pct is not None:
                        g.utilization_memory = f.memory_pct
                    if f.power_w is not None:
                        g.power_usage_mw = round(f.power_w * 1000)
                    if f.pcie_mbps is not None:
                        # NVML's KB/s; the collective_hang check divides by 1024 (sichek's MB/s)
                        g.pcie_tx_kbps = g.pcie_rx_kbps = round(f.pcie_mbps * 1024)
            for f in self._faults("compute_process", t):
                if f.gpu == i and f.active(t) and f.pid is not None:
                    used = None if f.memory_mib is None else f.memory_mib << 20
                    g.compute_processes.append((f.pid, used))
                    g.memory_used_bytes = min(g.memory_total_bytes - g.memory_reserved_bytes,
                                              g.memory_used_bytes + (used or 0))
            for f in self._faults("nvml_error", t):
                if f.gpu == i and f.active(t) and f.function and f.error:
                    g.calls.append(InjectedCall(f.function, error=NVML_ERRORS[f.error]))
            for f in self._faults("nvml_hang", t):
                if f.gpu == i and f.active(t) and f.function:
                    g.calls.append(InjectedCall(f.function, hang_s=float(f.seconds or 0)))
            for seq, f in enumerate(self.scenario.faults, start=1):
                if f.kind != "xid" or f.at_s > t:
                    continue
                if f.gpu == i and f.code is not None:
                    g.xid_events.append((f.code, seq))
                    if f.code == 79:
                        # a GPU off the bus answers every NVML call with GPU_IS_LOST
                        g.calls.append(InjectedCall("*", error=NVML_ERRORS["gpu_is_lost"]))
            if not any(f.gpu == i and f.active(t) for f in self._faults("gpu_missing", t)):
                gpus.append(g)
        for index, g in enumerate(gpus):
            g.index = index  # NVML numbers the GPUs it sees, in bus order
        return NvmlNodeState(driver_version=self.scenario.driver_version,
                             cuda_driver_version=self.scenario.cuda_driver_version, gpus=gpus)


def _symlink(link: Path, target: str) -> None:
    """``link`` -> ``target``; one made meanwhile by another process rendering the same node (the
    ranks of a one-node probe start together) is as good (a race seen in CI: "File exists")."""
    try:
        link.symlink_to(target)
    except FileExistsError:
        if not link.is_symlink():
            raise
