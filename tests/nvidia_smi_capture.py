"""Test-only: a real ``nvidia-smi -q`` capture -> the simulator's NVML state, and a check run over it.

Checks read NVML, not nvidia-smi text. To run a check over a GPU someone captured on a real machine,
this module parses the capture and writes the same facts into the state the NVML injection library
serves (``gpumon.sim.nvml_state``), so the check reads them through the real nvidia-ml-py.

What is converted: identity (name, brand, architecture, UUID, serial, PCI bus id and ids, minor
number), temperatures and thresholds, ECC mode and counts, retired pages, remapped rows and the bank
remap histogram, and the driver version. Every other ``GpuState`` field keeps the simulator's default:
do not use a converted state to test a check that reads those.

Rules, so that a capture can never make a check look healthier than the capture shows:

- A reading that is ``N/A`` in the capture, or absent from it, is answered by the simulated NVML with
  NOT_SUPPORTED (an injected call, or ``None`` for the memory temperature and the retired pages):
  the check then says it could not read it. Absent is not the same as unsupported on a real GPU,
  but both mean "nobody measured it here".
- An NVML call returns several values at once (remapped rows: four). When the capture shows some of
  them and not the others, the missing ones keep the simulator's healthy default and are listed in
  ``ConvertedGpu.assumed`` with the reason, so a test can see which verdicts rest on the capture.
- Drivers from r535 on print thresholds as margins ("GPU T.Limit Temp : 56 C" = 56 C below the
  T.Limit; "GPU Slowdown T.Limit Temp : -2 C" = slowdown 2 C above it). The absolute value NVML's
  ``nvmlDeviceGetTemperatureThreshold`` answers is derived as current + T.Limit margin - offset.
  The memory limit cannot be derived that way (no memory margin is printed), so it is ``assumed``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import CheckContext, KernelLog
from gpumon.hw.inventory import collect
from gpumon.model import Finding
from gpumon.profiles import Profile, builtin_profiles, select_profile
from gpumon.sim.nvml_state import MAX_GPUS, GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware

NOT_SUPPORTED = 3  # nvmlReturn_t NVML_ERROR_NOT_SUPPORTED
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7])\s*$")
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7]$")
_INT = re.compile(r"^(-?\d{1,20})(?![\d.])")
_HEX = re.compile(r"^0x([0-9A-Fa-f]{1,8})$")

# nvidia-smi "Product Architecture" / "Product Brand" -> NVML enum values (nvml.h)
ARCHITECTURES = {"Kepler": 2, "Maxwell": 3, "Pascal": 4, "Volta": 5, "Turing": 6, "Ampere": 7,
                 "Ada Lovelace": 8, "Hopper": 9, "Blackwell": 10}
BRANDS = {"Quadro": 1, "Tesla": 2, "NVS": 3, "GRID": 4, "GeForce": 5, "Titan": 6, "Quadro RTX": 12,
          "NVIDIA RTX": 13, "NVIDIA": 14, "GeForce RTX": 15, "Titan RTX": 16}
_NAMELESS = "NVIDIA GPU (no Product Name in capture)"


@dataclass
class CapturedGpu:
    """One GPU's fields, keyed by their section path: ``"Temperature/GPU Current Temp"`` -> ``"29 C"``."""

    bus_id: str | None  # from the "GPU <bus id>" header; None for a fragment without one
    fields: dict[str, str] = field(default_factory=dict)


@dataclass
class Capture:
    driver_version: str | None = None
    attached_gpus: int | None = None
    gpus: list[CapturedGpu] = field(default_factory=list)


def parse_capture(text: str) -> Capture:
    """Parse ``nvidia-smi -q`` text (whole, a ``-d`` subset, a fragment, or truncated). Never raises."""
    cap = Capture()
    current: CapturedGpu | None = None
    stack: list[tuple[int, str]] = []  # open sections: (indent, name)
    for raw in text.splitlines():
        line = raw.expandtabs(4).rstrip()
        body = line.lstrip(" ")
        if not body:
            continue
        indent = len(line) - len(body)
        header = _GPU_HEADER.match(line)
        if header:
            current = CapturedGpu(bus_id=header.group(1))
            cap.gpus.append(current)
            stack = []
            continue
        label, sep, value = body.partition(":")
        label, value = label.strip(), value.strip()
        if indent == 0:
            if sep:
                _node_field(cap, label, value)
            continue
        if current is None:  # a fragment: indented GPU fields with no "GPU <bus id>" line above
            current = CapturedGpu(bus_id=None)
            cap.gpus.append(current)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not sep:
            stack.append((indent, label))
            continue
        key = "/".join([name for _, name in stack] + [label])
        current.fields.setdefault(key, value)
    return cap


def _node_field(cap: Capture, label: str, value: str) -> None:
    if label == "Driver Version" and cap.driver_version is None:
        cap.driver_version = value
    elif label == "Attached GPUs" and cap.attached_gpus is None:
        cap.attached_gpus = _int(value)


# ------------------------------------------------------------------------------------------ values


def _int(raw: str | None, lo: int = 0, hi: int = _U32) -> int | None:
    """The leading integer of ``29 C``, ``2560 bank(s)``, ``16x``; None for N/A, garbage or out of range."""
    if raw is None:
        return None
    m = _INT.match(raw.strip())
    if not m:
        return None
    value = int(m.group(1))
    return value if lo <= value <= hi else None


def _flag(raw: str | None) -> bool | None:
    return {"yes": True, "enabled": True, "no": False, "disabled": False}.get((raw or "").strip().lower())


def _text(raw: str | None, limit: int) -> str | None:
    if raw is None:
        return None
    value = raw.strip()
    if not value or value == "N/A" or len(value) > limit or not all(" " <= c <= "~" for c in value):
        return None
    return value


def _hex(raw: str | None) -> int | None:
    m = _HEX.match((raw or "").strip())
    return int(m.group(1), 16) if m else None


# ------------------------------------------------------------------------------------------ convert


@dataclass
class ConvertedGpu:
    state: GpuState
    # GpuState field -> why its value does not come from the capture
    assumed: dict[str, str] = field(default_factory=dict)
    # NVML C functions that answer NOT_SUPPORTED because the capture has N/A or nothing for them
    unsupported: list[str] = field(default_factory=list)


@dataclass
class Converted:
    state: NvmlNodeState
    gpus: list[ConvertedGpu]
    attached_gpus: int | None
    dropped_gpus: int = 0  # GPUs past the simulator's limit


class _Builder:
    """Collects GpuState keyword arguments, assumptions and NOT_SUPPORTED functions for one GPU."""

    def __init__(self, index: int, captured: CapturedGpu) -> None:
        self.index = index
        self.f = captured.fields
        self.header_bus = captured.bus_id
        self.kw: dict[str, Any] = {"index": index}
        self.assumed: dict[str, str] = {}
        self.unsupported: list[str] = []

    def get(self, *keys: str) -> str | None:
        for key in keys:
            if key in self.f:
                return self.f[key]
        return None

    def off(self, *functions: str) -> None:
        for fn in functions:
            if fn not in self.unsupported:
                self.unsupported.append(fn)

    def assume(self, name: str, why: str) -> None:
        self.assumed[name] = why

    def build(self) -> ConvertedGpu:
        self._identity()
        self._temperatures()
        self._ecc()
        self._retired_pages()
        self._remapped_rows()
        calls = [InjectedCall(fn, error=NOT_SUPPORTED) for fn in self.unsupported]
        state = GpuState(**self.kw, calls=calls)
        return ConvertedGpu(state, self.assumed, self.unsupported)

    def _identity(self) -> None:
        name = _text(self.get("Product Name"), 95)
        if name is None:
            name = _NAMELESS
            self.assume("name", "no usable Product Name in the capture")
        self.kw["name"] = name
        uuid = _text(self.get("GPU UUID"), 95)
        if uuid is None:
            self.assume("uuid", "no GPU UUID in the capture: made up from the index")
        else:
            self.kw["uuid"] = uuid
        serial = _text(self.get("Serial Number"), 29)
        if serial is None:
            self.off("nvmlDeviceGetSerial")
        else:
            self.kw["serial"] = serial
        bus = self.get("PCI/Bus Id") or self.header_bus
        if bus is not None and _BUS_ID.match(bus.strip()):
            self.kw["pci_bus_id"] = bus.strip()
        else:
            self.assume("pci_bus_id", "no PCI bus id in the capture: made up from the index")
        for key, name in (("PCI/Device Id", "pci_device_id"), ("PCI/Sub System Id", "pci_subsystem_id")):
            value = _hex(self.get(key))
            if value is None:
                self.assume(name, f"no {key} in the capture")
            else:
                self.kw[name] = value
        minor = _int(self.get("Minor Number"))
        if minor is None:
            self.off("nvmlDeviceGetMinorNumber")
        else:
            self.kw["minor_number"] = minor
        arch = ARCHITECTURES.get((self.get("Product Architecture") or "").strip())
        if arch is None:
            self.off("nvmlDeviceGetArchitecture")
        else:
            self.kw["architecture"] = arch
        brand = BRANDS.get((self.get("Product Brand") or "").strip())
        if brand is None:
            self.off("nvmlDeviceGetBrand")
        else:
            self.kw["brand"] = brand
        self.kw["nvlink_states"] = []
        self.assume("nvlink_states", "nvidia-smi -q lists no NVLinks: none simulated")

    def _temperatures(self) -> None:
        core = _int(self.get("Temperature/GPU Current Temp"))
        if core is None:
            self.off("nvmlDeviceGetTemperature")
        else:
            self.kw["temperature_c"] = core
        self.kw["memory_temperature_c"] = _int(self.get("Temperature/Memory Current Temp"))
        limits = self._thresholds(core)
        if not limits:
            self.off("nvmlDeviceGetTemperatureThreshold")
            return
        for name, value in limits.items():
            self.kw[name] = value
        for name in ("temp_shutdown_c", "temp_slowdown_c", "temp_mem_max_c", "temp_gpu_max_c"):
            if name not in limits:
                # the library answers all four threshold types or none of them
                self.assume(name, "not stated or derivable in the capture: simulator default")

    def _thresholds(self, core: int | None) -> dict[str, int]:
        out: dict[str, int] = {}
        absolute = {"temp_shutdown_c": "GPU Shutdown Temp", "temp_slowdown_c": "GPU Slowdown Temp",
                    "temp_gpu_max_c": "GPU Max Operating Temp", "temp_mem_max_c": "Memory Max Operating Temp"}
        for name, label in absolute.items():
            value = _int(self.get(f"Temperature/{label}"))
            if value is not None:
                out[name] = value
        margin = _int(self.get("Temperature/GPU T.Limit Temp"), lo=-1000, hi=1000)
        if core is None or margin is None:
            return out
        tlimit = core + margin
        offsets = {"temp_shutdown_c": "GPU Shutdown T.Limit Temp",
                   "temp_slowdown_c": "GPU Slowdown T.Limit Temp",
                   "temp_gpu_max_c": "GPU Max Operating T.Limit Temp"}
        for name, label in offsets.items():
            offset = _int(self.get(f"Temperature/{label}"), lo=-1000, hi=1000)
            if offset is not None and name not in out and 0 <= tlimit - offset <= _U32:
                out[name] = tlimit - offset
                self.assume(name, f"derived: T.Limit {tlimit} C (current {core} + margin {margin}) "
                                  f"- offset {offset}")
        return out

    def _ecc(self) -> None:
        current = _flag(self.get("ECC Mode/Current"))
        if current is None:
            self.off("nvmlDeviceGetEccMode")
        else:
            self.kw["ecc_mode_current"] = current
            pending = _flag(self.get("ECC Mode/Pending"))
            if pending is None:
                self.assume("ecc_mode_pending", "ECC Mode Pending not in the capture: same as current")
                pending = current
            self.kw["ecc_mode_pending"] = pending
        counts = {}
        for scope in ("Volatile", "Aggregate"):
            corrected, uncorrected = self._ecc_counts(scope)
            counts[f"ecc_{scope.lower()}_corrected"] = corrected
            counts[f"ecc_{scope.lower()}_uncorrected"] = uncorrected
        if all(v is None for v in counts.values()):
            self.off("nvmlDeviceGetTotalEccErrors")
            return
        for name, value in counts.items():
            if value is None:
                self.assume(name, "not in the capture: 0")
            else:
                self.kw[name] = value

    def _ecc_counts(self, scope: str) -> tuple[int | None, int | None]:
        """(corrected, uncorrected) in the scope, SRAM + DRAM, in either nvidia-smi layout."""
        prefix = f"ECC Errors/{scope}/"
        old_sbe = _int(self.get(prefix + "Single Bit/Total"), hi=_U64)
        old_dbe = _int(self.get(prefix + "Double Bit/Total"), hi=_U64)
        if old_sbe is not None or old_dbe is not None:
            return old_sbe, old_dbe
        corrected: int | None = None
        uncorrected: int | None = None
        for key, raw in self.f.items():
            if not key.startswith(prefix) or "/" in key[len(prefix):]:
                continue
            value = _int(raw, hi=_U64)
            if value is None:
                continue
            label = key[len(prefix):]
            if "Uncorrectable" in label:
                uncorrected = min(_U64, (uncorrected or 0) + value)
            elif "Correctable" in label:
                corrected = min(_U64, (corrected or 0) + value)
        return corrected, uncorrected

    def _retired_pages(self) -> None:
        sbe = _int(self.get("Retired Pages/Single Bit ECC"))
        dbe = _int(self.get("Retired Pages/Double Bit ECC"))
        self.kw["retired_pages_sbe"], self.kw["retired_pages_dbe"] = sbe, dbe
        if sbe is None and dbe is None:
            return
        pending = _flag(self.get("Retired Pages/Pending Page Blacklist",
                                 "Retired Pages/Pending Page Retirement"))
        if pending is None:
            self.assume("retired_pages_pending", "no pending status in the capture: No")
            pending = False
        self.kw["retired_pages_pending"] = pending

    def _remapped_rows(self) -> None:
        rows = {"remapped_rows_corrected": _int(self.get("Remapped Rows/Correctable Error")),
                "remapped_rows_uncorrected": _int(self.get("Remapped Rows/Uncorrectable Error")),
                "remapped_rows_pending": _flag(self.get("Remapped Rows/Pending")),
                "remapped_rows_failure": _flag(self.get("Remapped Rows/Remapping Failure Occurred"))}
        if all(v is None for v in rows.values()):
            self.off("nvmlDeviceGetRemappedRows", "nvmlDeviceGetRowRemapperHistogram")
            return
        for name, value in rows.items():
            if value is None:
                self.assume(name, "not in the capture: simulator default (0 / No)")
            else:
                self.kw[name] = value
        hist_prefix = "Remapped Rows/Bank Remap Availability Histogram/"
        hist = {"remap_histogram_max": _int(self.get(hist_prefix + "Max", hist_prefix + "Maximum")),
                "remap_histogram_high": _int(self.get(hist_prefix + "High")),
                "remap_histogram_partial": _int(self.get(hist_prefix + "Partial")),
                "remap_histogram_low": _int(self.get(hist_prefix + "Low")),
                "remap_histogram_none": _int(self.get(hist_prefix + "None"))}
        if all(v is None for v in hist.values()):
            self.off("nvmlDeviceGetRowRemapperHistogram")
            return
        for name, value in hist.items():
            if value is None:
                self.assume(name, "not in the capture: 0 banks")
                value = 0
            self.kw[name] = value


def to_node_state(capture: Capture) -> Converted:
    """The simulated node for ``capture``; its state always renders (``render_state`` accepts it)."""
    gpus = [_Builder(i, g).build() for i, g in enumerate(capture.gpus[:MAX_GPUS])]
    _unique_ids(gpus)
    node = NvmlNodeState(gpus=[g.state for g in gpus])
    version = _text(capture.driver_version, 79)
    if version is not None:
        node.driver_version = version
    return Converted(node, gpus, capture.attached_gpus, max(0, len(capture.gpus) - MAX_GPUS))


def _unique_ids(gpus: list[ConvertedGpu]) -> None:
    """NVML never shows two GPUs with one UUID or bus id; a capture that does gets made-up ones."""
    uuids: set[str] = set()
    buses: set[str] = set()
    for g in gpus:
        s = g.state
        if s.uuid in uuids:
            s.uuid = f"GPU-duplicate-in-capture-{s.index}"
            g.assumed["uuid"] = "the capture repeats this UUID: made up"
        if s.pci_bus_id in buses:
            s.pci_bus_id = f"0000FFFF:{s.index:02X}:00.0"
            g.assumed["pci_bus_id"] = "the capture repeats this bus id: made up"
        uuids.add(s.uuid)
        buses.add(s.pci_bus_id)


def load(path: Path) -> Converted:
    return to_node_state(parse_capture(path.read_text(encoding="utf-8", errors="replace")))


# ------------------------------------------------------------------------------------------ run


def run_check(check_cls: type[Any], node: NvmlNodeState, state_path: Path, host_root: Path, *,
              options: Any = None, profile: Profile | None = None,
              state: dict[str, Any] | None = None, state_dir: Path | None = None) -> list[Finding]:
    """Serve ``node`` through the injection library and run ``check_cls`` with the framework's context.

    ``state_path`` must be the file the library reads (the ``nvml_state`` fixture). The profile is
    chosen from the NVML GPU names as the agent does, unless given.
    """
    write_state(node, state_path)
    host_root.mkdir(parents=True, exist_ok=True)
    hw = simulated_hardware(host_root)
    hw.nvml.init()
    try:
        inventory = collect(hw.nvml, hw.fs)
        chosen = profile or select_profile(builtin_profiles(), inventory.gpu_names, "auto")
        cfg = options if options is not None else check_cls.Config()
        ctx = CheckContext(hw=hw, inventory=inventory, profile=chosen, options=cfg,
                           state=state if state is not None else {}, kernel_log=KernelLog(),
                           state_dir=state_dir)
        findings: list[Finding] = check_cls().run(ctx)
        return findings
    finally:
        hw.nvml.shutdown()


def by_component(findings: list[Finding]) -> Mapping[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out
