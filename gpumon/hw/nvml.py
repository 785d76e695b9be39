"""NVML through nvidia-ml-py, every call bounded, every error mapped here.

Only this module sees ``pynvml.NVMLError``. Checks get readings, or one of
the typed conditions of ``gpumon.errors``: ``GpuLost`` (the GPU is gone: a
``fail`` with reboot_node), ``NotSupported`` (the capability is off; it is
remembered so the call is not repeated), ``HwTimeout``, ``HwFailure``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from gpumon.errors import GpuLost, HwCondition, HwFailure, HwTimeout, NotSupported, NvmlUnavailable
from gpumon.hw.calls import BoundedCaller
from gpumon.model import gpu as gpu_component

T = TypeVar("T")

NVML_NOT_FOUND_MESSAGE = "NVML not found — is the NVIDIA driver installed?"

ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "ada",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "blackwell",
}

# Clock event ("throttle") reason bits, NVML nvmlClocksEventReason*.
CLOCK_EVENT_REASONS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}

PERF_POLICIES = {
    "power": pynvml.NVML_PERF_POLICY_POWER,
    "thermal": pynvml.NVML_PERF_POLICY_THERMAL,
    "sync_boost": pynvml.NVML_PERF_POLICY_SYNC_BOOST,
    "board_limit": pynvml.NVML_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
    "reliability": pynvml.NVML_PERF_POLICY_RELIABILITY,
}


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def canonical_nvml_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` -> sysfs's ``0000:18:00.0`` (lower case)."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}:{rest}"


class NvmlError(HwFailure):
    """An NVML return code with no more specific meaning for gpumon."""

    def __init__(self, message: str, *, call: str, component: str, code: int) -> None:
        self.code = code
        super().__init__(message, call=call, component=component)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    serial: str | None
    pci_bus_id: str
    name: str
    architecture: str
    nvlink_count: int | None
    minor_number: int | None


class Nvml:
    """One NVML session. ``init`` raises ``NvmlUnavailable`` when there is no NVML."""

    def __init__(self, caller: BoundedCaller, timeout: float, *, complete: bool = False) -> None:
        self._caller = caller
        self._timeout = timeout
        # the library implements every entry point gpumon calls (the NVML injection library)
        self._complete = complete
        self._handles: dict[int, Any] = {}
        # (gpu, function, arguments): one unsupported threshold type must not switch off the others
        self._unsupported: set[tuple[int, str, str]] = set()
        self._lock = threading.Lock()
        self.initialized = False

    # -- plumbing --------------------------------------------------------

    def _map_error(self, exc: pynvml.NVMLError, call: str, component: str) -> Exception:
        code = exc.value
        msg = _text(exc)
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            return GpuLost("GPU is lost", call=call, component=component)
        if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return NotSupported(msg, call=call, component=component)
        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            if self._complete:
                # a missing entry point is then gpumon's bug, not an old driver
                return HwFailure(f"the NVML injection library does not implement {call}",
                                 call=call, component=component)
            return NotSupported(f"driver's NVML lacks {call}", call=call, component=component)
        if code == pynvml.NVML_ERROR_TIMEOUT:
            return HwTimeout(f"NVML reported a timeout: {msg}", call=call, component=component,
                             seconds=self._timeout)
        if code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,):
            return NvmlUnavailable(NVML_NOT_FOUND_MESSAGE)
        if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            return NvmlUnavailable(f"NVIDIA driver not loaded ({msg}) — is the NVIDIA driver installed?")
        return NvmlError(f"NVML error {code}: {msg}", call=call, component=component, code=code)

    def _call(self, lane: str, label: str, component: str, fn: Callable[[], T]) -> T:
        def guarded() -> T:
            try:
                return fn()
            except pynvml.NVMLError as exc:
                raise self._map_error(exc, label, component) from None
        return self._caller.call(lane, label, guarded, self._timeout, component)

    def _handle(self, index: int) -> Any:
        with self._lock:
            handle = self._handles.get(index)
        if handle is None:
            handle = self._call(f"gpu{index}", f"nvmlDeviceGetHandleByIndex({index})",
                                gpu_component(index), lambda: pynvml.nvmlDeviceGetHandleByIndex(index))
            with self._lock:
                self._handles[index] = handle
        return handle

    def device(self, index: int, function: str, *args: Any) -> Any:
        """Call ``pynvml.<function>(handle, *args)`` for GPU ``index``, bounded and mapped."""
        component = gpu_component(index)
        label = f"{function}({component})"
        key = (index, function, repr(args))
        if key in self._unsupported:
            raise NotSupported(f"{function} not supported (remembered)", call=label, component=component)
        handle = self._handle(index)
        fn = getattr(pynvml, function)
        try:
            return self._call(f"gpu{index}", label, component, lambda: fn(handle, *args))
        except NotSupported:
            self._unsupported.add(key)
            raise

    def system(self, function: str, *args: Any) -> Any:
        fn = getattr(pynvml, function)
        return self._call("nvml-system", function, "node", lambda: fn(*args))

    # -- session ---------------------------------------------------------

    def init(self) -> None:
        self._call("nvml-system", "nvmlInit", "node", pynvml.nvmlInit)
        self.initialized = True

    def shutdown(self) -> None:
        if self.initialized:
            self.initialized = False
            with contextlib.suppress(HwFailure, HwTimeout):  # shutting down: no one to tell
                self._call("nvml-system", "nvmlShutdown", "node", pynvml.nvmlShutdown)

    # -- readings --------------------------------------------------------

    def driver_version(self) -> str:
        return _text(self.system("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> int:
        return int(self.system("nvmlSystemGetCudaDriverVersion"))

    def device_count(self) -> int:
        return int(self.system("nvmlDeviceGetCount"))

    def nvlink_count(self, index: int) -> int:
        """Number of NVLinks the driver reports for this GPU (active or not); 0 when none."""
        count = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                self.device(index, "nvmlDeviceGetNvLinkState", link)
            except NotSupported:
                if link == 0:
                    return 0
                # a link past the last one: not supported on this one index only
                self._unsupported.discard((index, "nvmlDeviceGetNvLinkState", repr((link,))))
                break
            except NvmlError as exc:
                if exc.code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                    break
                raise
            count += 1
        return count

    def nvlink_state(self, index: int, link: int) -> bool:
        return bool(self.device(index, "nvmlDeviceGetNvLinkState", link))

    def info(self, index: int) -> GpuInfo:
        name = _text(self.device(index, "nvmlDeviceGetName"))
        uuid = _text(self.device(index, "nvmlDeviceGetUUID"))
        pci = self.device(index, "nvmlDeviceGetPciInfo")
        bus_id = canonical_nvml_bus_id(_text(pci.busId))
        try:
            serial: str | None = _text(self.device(index, "nvmlDeviceGetSerial"))
        except NotSupported:
            serial = None
        try:
            arch = ARCHITECTURES.get(int(self.device(index, "nvmlDeviceGetArchitecture")), "unknown")
        except NotSupported:
            arch = "unknown"
        try:
            minor: int | None = int(self.device(index, "nvmlDeviceGetMinorNumber"))
        except NotSupported:
            minor = None
        return GpuInfo(index=index, uuid=uuid, serial=serial, pci_bus_id=bus_id, name=name,
                       architecture=arch, nvlink_count=self.nvlink_count(index), minor_number=minor)

    def clocks_event_reasons(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetCurrentClocksEventReasons"))

    def supported_clocks_event_reasons(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetSupportedClocksEventReasons"))

    def violation_ns(self, index: int, policy: int) -> int:
        """Cumulative time (ns) clocks were held below requested by ``policy``."""
        status = self.device(index, "nvmlDeviceGetViolationStatus", policy)
        return int(status.violationTime)

    def temperature_c(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU))

    def memory_temperature_c(self, index: int) -> int:
        values = self.device(index, "nvmlDeviceGetFieldValues", [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        value = values[0]
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            err = pynvml.NVMLError(value.nvmlReturn)
            raise self._map_error(err, f"nvmlDeviceGetFieldValues(MEMORY_TEMP, gpu/{index})",
                                  gpu_component(index))
        return int(value.value.uiVal)

    def sm_clock_mhz(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM))

    def power_w(self, index: int) -> float:
        return float(self.device(index, "nvmlDeviceGetPowerUsage")) / 1000.0


@dataclass(frozen=True)
class EccCounts:
    volatile_corrected: int
    volatile_uncorrected: int
    aggregate_corrected: int
    aggregate_uncorrected: int


@dataclass(frozen=True)
class RemappedRows:
    corrected: int
    uncorrected: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class RemapHistogram:
    """Banks by how many spare rows they have left (NVML row remapper histogram)."""

    max: int
    high: int
    partial: int
    low: int
    none: int


@dataclass(frozen=True)
class RetiredPages:
    single_bit: int
    double_bit: int
    pending: bool


@dataclass(frozen=True)
class NvlinkErrors:
    replay: int
    recovery: int
    crc_flit: int
    crc_data: int


@dataclass(frozen=True)
class FabricInfo:
    state: int  # NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress, 3 completed
    status: int  # nvmlReturn_t of the registration
    clique_id: int
    cluster_uuid: str
    health_mask: int


@dataclass(frozen=True)
class PcieLink:
    generation: int
    max_generation: int
    width: int
    max_width: int


@dataclass(frozen=True)
class Utilization:
    """nvmlDeviceGetUtilizationRates: shares of NVML's last sample period (1/6 s to 1 s by product)."""

    gpu_pct: int  # time one or more kernels was executing on the GPU
    memory_pct: int  # time device memory was being read or written


@dataclass(frozen=True)
class PcieThroughput:
    """nvmlDeviceGetPcieThroughput: bytes over the GPU's PCIe link in the driver's 20 ms window, KB/s."""

    tx_kbps: int  # NVML_PCIE_UTIL_TX_BYTES: from the GPU to the host side
    rx_kbps: int  # NVML_PCIE_UTIL_RX_BYTES: into the GPU


@dataclass(frozen=True)
class ComputeProcess:
    """A process with a compute (CUDA) context on a GPU, as NVML lists it."""

    pid: int  # in the driver's view: the host PID namespace
    used_memory_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE


TEMPERATURE_THRESHOLDS = {
    "shutdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
    "slowdown": pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
    "mem_max": pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
    "gpu_max": pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX,
}

# nvmlGpuP2PCapsIndex_t. Written out: nvidia-ml-py defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,)
# (a stray comma), which ctypes would refuse as the index argument.
P2P_CAPABILITIES = {
    "read": 0,
    "write": pynvml.NVML_P2P_CAPS_INDEX_WRITE,
    "nvlink": pynvml.NVML_P2P_CAPS_INDEX_NVLINK,
    "atomics": pynvml.NVML_P2P_CAPS_INDEX_ATOMICS,
    "pci": pynvml.NVML_P2P_CAPS_INDEX_PCI,
}


class NvmlReadings(Nvml):
    """The typed readings checks use. Every method raises only gpumon's conditions."""

    def ecc_errors(self, index: int) -> EccCounts:
        def count(kind: int, counter: int) -> int:
            return int(self.device(index, "nvmlDeviceGetTotalEccErrors", kind, counter))
        corrected, uncorrected = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                  pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        return EccCounts(count(corrected, pynvml.NVML_VOLATILE_ECC),
                         count(uncorrected, pynvml.NVML_VOLATILE_ECC),
                         count(corrected, pynvml.NVML_AGGREGATE_ECC),
                         count(uncorrected, pynvml.NVML_AGGREGATE_ECC))

    def remapped_rows(self, index: int) -> RemappedRows:
        corr, unc, pending, failure = self.device(index, "nvmlDeviceGetRemappedRows")
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    def remap_histogram(self, index: int) -> RemapHistogram:
        h = self.device(index, "nvmlDeviceGetRowRemapperHistogram")
        return RemapHistogram(int(h.max), int(h.high), int(h.partial), int(h.low), int(h.none))

    def retired_pages(self, index: int) -> RetiredPages:
        sbe = len(self.device(index, "nvmlDeviceGetRetiredPages",
                              pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))
        dbe = len(self.device(index, "nvmlDeviceGetRetiredPages",
                              pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        pending = self.device(index, "nvmlDeviceGetRetiredPagesPendingStatus")
        return RetiredPages(sbe, dbe, bool(pending))

    def nvlink_errors(self, index: int, link: int) -> NvlinkErrors:
        def count(counter: int) -> int:
            return int(self.device(index, "nvmlDeviceGetNvLinkErrorCounter", link, counter))
        return NvlinkErrors(count(pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
                            count(pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
                            count(pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
                            count(pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA))

    def fabric_info(self, index: int) -> FabricInfo:
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        # pynvml hands the struct straight to C: it must be passed by reference
        self.device(index, "nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info))
        uuid = bytes(info.clusterUuid).hex()
        return FabricInfo(int(info.state), int(info.status), int(info.cliqueId), uuid,
                          int(info.healthMask))

    def temperature_threshold_c(self, index: int, kind: str) -> int:
        return int(self.device(index, "nvmlDeviceGetTemperatureThreshold", TEMPERATURE_THRESHOLDS[kind]))

    def pcie_link(self, index: int) -> PcieLink:
        return PcieLink(int(self.device(index, "nvmlDeviceGetCurrPcieLinkGeneration")),
                        int(self.device(index, "nvmlDeviceGetMaxPcieLinkGeneration")),
                        int(self.device(index, "nvmlDeviceGetCurrPcieLinkWidth")),
                        int(self.device(index, "nvmlDeviceGetMaxPcieLinkWidth")))

    def ecc_mode(self, index: int) -> tuple[bool, bool]:
        """(current, pending) ECC mode."""
        current, pending = self.device(index, "nvmlDeviceGetEccMode")
        return bool(current), bool(pending)

    def brand(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetBrand"))

    def pci_bus_id(self, index: int) -> str:
        """The GPU's PCI address in sysfs form (``0000:18:00.0``)."""
        return canonical_nvml_bus_id(_text(self.device(index, "nvmlDeviceGetPciInfo").busId))

    def utilization_pct(self, index: int) -> int:
        return int(self.device(index, "nvmlDeviceGetUtilizationRates").gpu)

    def utilization(self, index: int) -> Utilization:
        rates = self.device(index, "nvmlDeviceGetUtilizationRates")
        return Utilization(int(rates.gpu), int(rates.memory))

    def pcie_throughput(self, index: int) -> PcieThroughput:
        """Both directions, each its own bounded call (NVML samples each for 20 ms)."""
        return PcieThroughput(
            int(self.device(index, "nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_TX_BYTES)),
            int(self.device(index, "nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_RX_BYTES)))

    def compute_processes(self, index: int) -> list[ComputeProcess]:
        """Processes holding a compute context on GPU ``index`` (graphics-only clients are not listed).

        Called by its versioned name: pynvml's unversioned wrapper turns a driver without the symbol
        into NVMLLibraryMismatchError, which is no NVMLError and would escape the mapping here.
        """
        procs = self.device(index, "nvmlDeviceGetComputeRunningProcesses_v3")
        return [ComputeProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                for p in procs]

    def _pair(self, index: int, peer: int, function: str, *args: Any) -> Any:
        """``pynvml.<function>(handle of index, handle of peer, *args)``, on GPU ``index``'s lane.

        The peer's handle is resolved (and its failure reported) on the peer's own lane first.
        """
        peer_handle = self._handle(peer)
        # the cached handle object is the same on every call, so device()'s not-supported memory,
        # keyed by the arguments' repr, tells peers apart
        return self.device(index, function, peer_handle, *args)

    def p2p_status(self, index: int, peer: int, capability: str) -> int:
        """nvmlGpuP2PStatus_t (0 = OK) of ``capability`` (a P2P_CAPABILITIES key) from GPU index to peer."""
        return int(self._pair(index, peer, "nvmlDeviceGetP2PStatus", P2P_CAPABILITIES[capability]))

    def topology_common_ancestor(self, index: int, peer: int) -> int:
        """nvmlGpuTopologyLevel_t of the closest ancestor the two GPUs share (0 internal ... 50 system)."""
        return int(self._pair(index, peer, "nvmlDeviceGetTopologyCommonAncestor"))

    def open_xid_events(self, indices: list[int]) -> XidEventSet:
        return XidEventSet(self, indices)


class XidEventSet:
    """NVML Xid critical-error events for some GPUs (a second source beside the kernel log)."""

    def __init__(self, nvml: Nvml, indices: list[int]) -> None:
        self._nvml = nvml
        self._set = nvml.system("nvmlEventSetCreate")
        self._by_handle: dict[int, int] = {}
        self.registered: list[int] = []
        for index in indices:
            try:
                handle = nvml._handle(index)
                nvml.device(index, "nvmlDeviceRegisterEvents", pynvml.nvmlEventTypeXidCriticalError,
                            self._set)
            except NotSupported:
                continue
            except HwCondition:
                # a lost or hung GPU must not cost the others their events, nor leak the set
                continue
            self._by_handle[ctypes.cast(handle, ctypes.c_void_p).value or 0] = index
            self.registered.append(index)

    def wait(self, timeout_s: float) -> list[tuple[int, int]]:
        """(gpu index, Xid code) events that arrive within ``timeout_s``."""
        out: list[tuple[int, int]] = []
        # stay inside the call bound, so a real hang is not mistaken for a quiet wait
        ms = max(0, int(min(timeout_s, self._nvml._timeout / 2) * 1000))
        while True:
            def wait_once(ms: int = ms) -> Any:
                return pynvml.nvmlEventSetWait_v2(self._set, ms)
            try:
                data = self._nvml._call("nvml-events", "nvmlEventSetWait", "node", wait_once)
            except HwTimeout:
                return out  # NVML_ERROR_TIMEOUT: nothing (more) arrived
            key = ctypes.cast(data.device, ctypes.c_void_p).value or 0
            out.append((self._by_handle.get(key, -1), int(data.eventData)))
            ms = 0

    def close(self) -> None:
        with contextlib.suppress(HwFailure, HwTimeout):
            self._nvml.system("nvmlEventSetFree", self._set)
