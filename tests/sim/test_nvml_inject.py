"""The NVML injection library under the real nvidia-ml-py.

Nothing here patches pynvml: in-process tests preload the library (pynvml's CDLL("libnvidia-ml.so.1")
then binds to it by soname), subprocess tests find it through LD_LIBRARY_PATH. Every value is read back
through pynvml's own wrappers and ctypes structs, so a layout mismatch between the C structs and
pynvml's definitions shows up as a wrong value.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.sim import nvml_inject
from gpumon.sim.nvml_state import (
    FORMAT_MAGIC,
    GpuState,
    InjectedCall,
    NvLinkErrorCounters,
    NvmlNodeState,
    StateFormatError,
    read_state,
    render_state,
    write_state,
)

NVML_FI_DEV_MEMORY_TEMP = pynvml.NVML_FI_DEV_MEMORY_TEMP
CLUSTER_UUID = "5f0a3a52-8d55-4c57-9d0e-3c5e4f3d2a11"

# The entry points the brief asks for (C symbol names).
REQUIRED_SYMBOLS = {
    "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetName",
    "nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetBrand", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetPciInfoExt", "nvmlDeviceGetArchitecture", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetSupportedClocksThrottleReasons",
    "nvmlDeviceGetViolationStatus", "nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetFieldValues", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetGpuFabricInfo",
    "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlEventSetCreate", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2", "nvmlEventSetFree",
}

# pynvml wrappers whose C routing must land on an exported symbol (resolved from pynvml's source).
PYNVML_WRAPPERS = [
    "nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetName",
    "nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetBrand", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfoExt", "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetNvLinkVersion",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetSupportedClocksThrottleReasons",
    "nvmlDeviceGetViolationStatus", "nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetFieldValues", "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPages_v2", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV",
    "nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor", "nvmlEventSetCreate",
    "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents", "nvmlEventSetWait",
    "nvmlEventSetWait_v2", "nvmlEventSetFree",
]


def rich_state() -> NvmlNodeState:
    """GPU 0 healthy, GPU 1 with faults everywhere, GPU 2 a PCIe part without NVLink, GPU 3 Ampere."""
    s = NvmlNodeState.hgx(4)
    s.driver_version = "550.90.07"
    g1 = s.gpus[1]
    g1.name = "NVIDIA H100 80GB HBM3 (sim #1)"
    g1.nvlink_states = [1, 1, 1, 0] + [1] * 14
    g1.nvlink_error_counters = [NvLinkErrorCounters() for _ in range(18)]
    g1.nvlink_error_counters[3] = NvLinkErrorCounters(replay=7, recovery=2, crc_flit=1234, crc_data=5)
    g1.nvlink_remote_pci_bus_ids = ["00000000:83:00.0"] * 17 + [s.gpus[0].pci_bus_id]
    g1.clocks_event_reasons = 0x40 | 0x8
    g1.violation_ns = {1: 5_000_000_000, 0: 12}
    g1.temperature_c = 81
    g1.memory_temperature_c = 93
    g1.ecc_volatile_corrected, g1.ecc_volatile_uncorrected = 17, 2
    g1.ecc_aggregate_corrected, g1.ecc_aggregate_uncorrected = 1017, 3
    g1.remapped_rows_corrected, g1.remapped_rows_uncorrected = 1, 4
    g1.remapped_rows_pending, g1.remapped_rows_failure = True, False
    g1.remap_histogram_max, g1.remap_histogram_high, g1.remap_histogram_low = 2550, 8, 2
    g1.retired_pages_sbe, g1.retired_pages_dbe, g1.retired_pages_pending = 3, 1, True
    g1.fabric_state, g1.fabric_status, g1.fabric_clique_id = 2, 0, 7
    g1.fabric_cluster_uuid = CLUSTER_UUID
    g1.fabric_health_mask, g1.fabric_health_summary = 0x2, 1
    g1.xid_events = [(79, 5), (48, 2)]
    g1.p2p_status = {2: 4}
    g1.topology = {3: 20}
    g1.sm_clock_mhz, g1.power_usage_mw, g1.pcie_width_current = 1410, 512345, 8
    g1.utilization_gpu, g1.utilization_memory = 97, 41
    g1.pcie_tx_kbps, g1.pcie_rx_kbps = 123456, 789
    g2 = s.gpus[2]
    g2.name = "NVIDIA H100 PCIe"
    g2.nvlink_states = []
    g2.nvlink_error_counters = []
    g2.nvlink_remote_pci_bus_ids = []
    g2.memory_temperature_c = None
    g2.ecc_mode_current = False
    g2.numa_node = 1
    g3 = s.gpus[3]
    g3.name, g3.architecture, g3.cuda_compute_capability = "NVIDIA A100-SXM4-80GB", 7, (8, 0)
    g3.numa_node = 1
    return s


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def lib_dir() -> Path:
    """Built into the default cache (like tests/conftest.py does), so the process loads one copy."""
    d = nvml_inject.build_library()
    nvml_inject.preload(d)
    return d


@dataclass
class Node:
    path: Path
    state: NvmlNodeState

    def write(self) -> None:
        write_state(self.state, self.path)


@pytest.fixture
def state_file(lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Node:
    node = Node(tmp_path / "nvml-state.txt", rich_state())
    node.write()
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(node.path))
    return node


@pytest.fixture
def node(state_file: Node) -> Iterator[Node]:
    pynvml.nvmlInit()
    yield state_file
    pynvml.nvmlShutdown()


def h(i: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(i)


def text(value: object) -> str:
    """A char[] field of a pynvml struct (this pynvml decodes them to str; older ones give bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def call_status(fn_name: str, *args: object) -> int:
    """Call a C entry point of the loaded library directly and return its nvmlReturn_t."""
    return int(getattr(pynvml.nvmlLib, fn_name)(*args))


# ------------------------------------------------------------------------------------------- build


def test_build_caches_and_reuses(tmp_path: Path) -> None:
    d = nvml_inject.build_library(tmp_path)
    lib = d / "libnvidia-ml.so.1"
    assert re.fullmatch(r"nvml-inject-[0-9a-f]{16}", d.name)
    assert d.parent == tmp_path and lib.is_file()
    mtime = lib.stat().st_mtime_ns
    assert nvml_inject.build_library(tmp_path) == d
    assert lib.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in d.iterdir()] == ["libnvidia-ml.so.1"]  # no temp files left
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=False)
    if out.returncode == 0:
        assert "Library soname: [libnvidia-ml.so.1]" in out.stdout


def test_parallel_builds_never_expose_a_partial_library(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        dirs = set(pool.map(lambda _: nvml_inject.build_library(tmp_path), range(4)))
    (d,) = dirs
    assert [p.name for p in d.iterdir()] == ["libnvidia-ml.so.1"]
    assert "nvmlInit_v2" in nvml_inject.exported_symbols(d)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUMON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvml_inject.default_cache_dir() == tmp_path / "xdg" / "gpumon"
    monkeypatch.setenv("GPUMON_CACHE_DIR", str(tmp_path / "own"))
    assert nvml_inject.default_cache_dir() == tmp_path / "own"


def test_build_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(nvml_inject.InjectionBuildError, match="not found"):
        nvml_inject.build_library(tmp_path)
    # A "compiler" that fails: its stderr must reach the exception.
    monkeypatch.setenv("CC", "sh -c 'echo nvml-inject-boom >&2; exit 1' sh")
    with pytest.raises(nvml_inject.InjectionBuildError, match="nvml-inject-boom") as exc:
        nvml_inject.build_library(tmp_path)
    assert isinstance(exc.value, RuntimeError)
    assert not list(tmp_path.glob("*/.*.tmp"))


def test_exports_every_required_symbol_and_nothing_else(lib_dir: Path) -> None:
    symbols = nvml_inject.exported_symbols(lib_dir)
    assert sorted(REQUIRED_SYMBOLS - symbols) == []
    assert all(s.startswith("nvml") for s in symbols), symbols


def _c_symbols_of(wrapper: str, depth: int = 0) -> set[str]:
    """The C symbols a pynvml wrapper resolves, following wrappers that delegate to other wrappers."""
    src = inspect.getsource(getattr(pynvml, wrapper))
    found = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', src))
    if not found and depth < 3:
        for callee in re.findall(r"\b(nvml\w+)\(", src.split(":", 1)[1]):
            if callee != wrapper and callable(getattr(pynvml, callee, None)):
                found |= _c_symbols_of(callee, depth + 1)
    return found


def test_pynvml_routes_to_exported_symbols(lib_dir: Path) -> None:
    symbols = nvml_inject.exported_symbols(lib_dir)
    missing = {w: sorted(_c_symbols_of(w) - symbols) for w in PYNVML_WRAPPERS}
    assert {w: m for w, m in missing.items() if m} == {}
    assert all(_c_symbols_of(w) for w in PYNVML_WRAPPERS)


# ------------------------------------------------------------------------------------------- state model


def test_state_round_trip(tmp_path: Path) -> None:
    s = rich_state()
    s.calls = [InjectedCall("nvmlSystemGetDriverVersion", 15, 0.25)]
    s.gpus[0].calls = [InjectedCall("*", 3), InjectedCall("nvmlDeviceGetName", 0, 1.5)]
    path = tmp_path / "s.txt"
    write_state(s, path)
    assert read_state(path) == s
    text = path.read_text()
    assert text.startswith(FORMAT_MAGIC + "\n") and text.endswith("\nend\n")
    assert "name NVIDIA H100 80GB HBM3 (sim #1)\n" in text
    assert "call nvmlDeviceGetName 0 1500000\n" in text
    assert [p.name for p in tmp_path.iterdir()] == ["s.txt"]


def test_gpu_defaults_are_filled_from_index() -> None:
    g = GpuState(index=1)
    assert g.pci_bus_id == "00000000:3B:00.0" and g.minor_number == 1
    assert g.uuid.startswith("GPU-") and g.uuid != GpuState(index=2).uuid
    assert len(g.nvlink_error_counters) == len(g.nvlink_remote_pci_bus_ids) == len(g.nvlink_states) == 18
    assert GpuState(index=0, pci_bus_id="0000:19:00.0").pci_bus_id == "00000000:19:00.0"


@pytest.mark.parametrize("mutate", [
    lambda s: setattr(s.gpus[0], "name", "two\nlines"),
    lambda s: setattr(s.gpus[0], "serial", "x" * 30),
    lambda s: setattr(s.gpus[0], "name", "NVIDIA H100 \u00e9"),
    lambda s: setattr(s.gpus[0], "pci_bus_id", "19:00"),
    lambda s: setattr(s.gpus[1], "index", 5),
    lambda s: setattr(s.gpus[0], "nvlink_states", [1] * 40),
    lambda s: setattr(s.gpus[0], "temperature_c", -3),
    lambda s: setattr(s.gpus[0], "violation_ns", {12: 1}),
    lambda s: setattr(s.gpus[1], "uuid", s.gpus[0].uuid),
    lambda s: s.gpus[0].calls.append(InjectedCall("not an nvml symbol", 3)),
    lambda s: s.gpus[0].calls.append(InjectedCall("nvmlDeviceGetName", 3, -1.0)),
    lambda s: s.gpus[0].nvlink_remote_pci_bus_ids.append("00000000:01:00.0"),
    lambda s: setattr(s.gpus[1], "xid_events", [(79, 1), (48, 1)]),
])
def test_invalid_states_are_refused(mutate: object, tmp_path: Path) -> None:
    s = rich_state()
    assert callable(mutate)
    mutate(s)
    with pytest.raises(StateFormatError):
        write_state(s, tmp_path / "s.txt")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------- readings


def test_identity_and_system(node: Node) -> None:
    s = node.state
    assert pynvml.nvmlDeviceGetCount() == 4
    assert pynvml.nvmlSystemGetDriverVersion() == "550.90.07"
    assert pynvml.nvmlSystemGetNVMLVersion() == "12.550.90.07"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12040
    for i, g in enumerate(s.gpus):
        dev = h(i)
        assert pynvml.nvmlDeviceGetName(dev) == g.name
        assert pynvml.nvmlDeviceGetUUID(dev) == g.uuid
        assert pynvml.nvmlDeviceGetSerial(dev) == g.serial
        assert pynvml.nvmlDeviceGetIndex(dev) == i
        assert pynvml.nvmlDeviceGetMinorNumber(dev) == i
        pci = pynvml.nvmlDeviceGetPciInfo(dev)
        assert text(pci.busId) == g.pci_bus_id
        assert text(pci.busIdLegacy) == g.pci_bus_id[4:]
        assert (pci.domain, pci.bus, pci.device) == (0, int(g.pci_bus_id[9:11], 16), 0)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x233010DE, 0x16C110DE)
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(g.uuid)) == i
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(g.pci_bus_id)) == i
        short = g.pci_bus_id[4:].lower()  # "0000:3b:00.0" form is accepted too
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(short)) == i
    assert pynvml.nvmlDeviceGetArchitecture(h(0)) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert pynvml.nvmlDeviceGetArchitecture(h(3)) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert pynvml.nvmlDeviceGetCudaComputeCapability(h(3)) == (8, 0)
    assert pynvml.nvmlDeviceGetBrand(h(0)) == pynvml.NVML_BRAND_NVIDIA
    ext = pynvml.nvmlPciInfoExt_v1_t(version=pynvml.nvmlPciInfoExt_v1)
    pynvml.nvmlDeviceGetPciInfoExt(h(1), ctypes.byref(ext))
    assert (text(ext.busId), ext.baseClass, ext.subClass) == (s.gpus[1].pci_bus_id, 3, 2)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h(0))
    g0 = s.gpus[0]
    assert mem.total == g0.memory_total_bytes and mem.used == g0.memory_reserved_bytes
    mem2 = pynvml.nvmlDeviceGetMemoryInfo(h(0), version=pynvml.nvmlMemory_v2)
    assert (mem2.reserved, mem2.used, mem2.free) == (
        g0.memory_reserved_bytes, 0, g0.memory_total_bytes - g0.memory_reserved_bytes)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId("00000000:01:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByPciBusId("not-a-bus-id")


def test_nvlink(node: Node) -> None:
    g1 = node.state.gpus[1]
    assert [pynvml.nvmlDeviceGetNvLinkState(h(1), link) for link in range(18)] == g1.nvlink_states
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetNvLinkState(h(1), 18)
    counters = [pynvml.nvmlDeviceGetNvLinkErrorCounter(h(1), 3, c) for c in range(4)]
    assert counters == [7, 2, 1234, 5]  # DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA
    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h(1), 0)
    assert (text(remote.busId), remote.bus) == ("00000000:83:00.0", 0x83)
    assert pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h(1), 0) == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    peer = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h(1), 17)  # wired straight to GPU 0
    assert (text(peer.busId), peer.pciDeviceId) == (node.state.gpus[0].pci_bus_id, 0x233010DE)
    assert pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h(1), 17) == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    assert pynvml.nvmlDeviceGetNvLinkVersion(h(0), 0) == pynvml.NVML_NVLINK_VERSION_4_0
    (count,) = pynvml.nvmlDeviceGetFieldValues(h(1), [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    assert (count.nvmlReturn, count.value.uiVal) == (0, 18)
    (flit,) = pynvml.nvmlDeviceGetFieldValues(h(1), [pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL])
    assert flit.value.ullVal == 1234
    # A GPU without NVLink: every NvLink call is NOT_SUPPORTED, whatever the link.
    for call in (lambda: pynvml.nvmlDeviceGetNvLinkState(h(2), 0),
                 lambda: pynvml.nvmlDeviceGetNvLinkState(h(2), 99),
                 lambda: pynvml.nvmlDeviceGetNvLinkErrorCounter(h(2), 0, 0),
                 lambda: pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h(2), 0)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()


def test_clocks_thermals_power(node: Node) -> None:
    g1 = node.state.gpus[1]
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h(1)) == (
        pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonHwSlowdown)
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h(1)) == 0x48
    assert pynvml.nvmlDeviceGetSupportedClocksEventReasons(h(1)) == 0x1FF
    assert pynvml.nvmlDeviceGetSupportedClocksThrottleReasons(h(1)) == 0x1FF
    before_us = time.time() * 1e6
    v = pynvml.nvmlDeviceGetViolationStatus(h(1), pynvml.NVML_PERF_POLICY_THERMAL)
    assert v.violationTime == 5_000_000_000
    assert abs(v.referenceTime - before_us) < 5e6
    assert pynvml.nvmlDeviceGetViolationStatus(h(1), pynvml.NVML_PERF_POLICY_POWER).violationTime == 12
    assert pynvml.nvmlDeviceGetViolationStatus(h(1), pynvml.NVML_PERF_POLICY_SYNC_BOOST).violationTime == 0
    assert pynvml.nvmlDeviceGetTemperature(h(1), pynvml.NVML_TEMPERATURE_GPU) == 81
    assert pynvml.nvmlDeviceGetTemperatureV(h(1), pynvml.NVML_TEMPERATURE_GPU) == 81
    thresholds = [pynvml.nvmlDeviceGetTemperatureThreshold(h(1), t) for t in range(4)]
    assert thresholds == [g1.temp_shutdown_c, g1.temp_slowdown_c, g1.temp_mem_max_c, g1.temp_gpu_max_c]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperatureThreshold(h(1), pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN)
    mem_t, unknown = pynvml.nvmlDeviceGetFieldValues(h(1), [NVML_FI_DEV_MEMORY_TEMP, 9999])
    assert (mem_t.fieldId, mem_t.nvmlReturn, mem_t.value.uiVal) == (NVML_FI_DEV_MEMORY_TEMP, 0, 93)
    assert mem_t.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert unknown.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    (no_hbm,) = pynvml.nvmlDeviceGetFieldValues(h(2), [NVML_FI_DEV_MEMORY_TEMP])
    assert no_hbm.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert pynvml.nvmlDeviceGetClockInfo(h(1), pynvml.NVML_CLOCK_SM) == 1410
    assert pynvml.nvmlDeviceGetClockInfo(h(1), pynvml.NVML_CLOCK_MEM) == g1.mem_clock_mhz
    assert pynvml.nvmlDeviceGetMaxClockInfo(h(1), pynvml.NVML_CLOCK_SM) == g1.max_sm_clock_mhz
    assert pynvml.nvmlDeviceGetPowerUsage(h(1)) == 512345
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h(1)) == 700000
    pcie = [f(h(1)) for f in (pynvml.nvmlDeviceGetCurrPcieLinkGeneration,
                              pynvml.nvmlDeviceGetMaxPcieLinkGeneration,
                              pynvml.nvmlDeviceGetCurrPcieLinkWidth, pynvml.nvmlDeviceGetMaxPcieLinkWidth)]
    assert pcie == [5, 5, 8, 16]
    util = pynvml.nvmlDeviceGetUtilizationRates(h(1))
    assert (util.gpu, util.memory) == (97, 41)
    assert pynvml.nvmlDeviceGetPcieThroughput(h(1), pynvml.NVML_PCIE_UTIL_TX_BYTES) == 123456
    assert pynvml.nvmlDeviceGetPcieThroughput(h(1), pynvml.NVML_PCIE_UTIL_RX_BYTES) == 789
    assert pynvml.nvmlDeviceGetPcieThroughput(h(0), pynvml.NVML_PCIE_UTIL_RX_BYTES) == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetPcieThroughput(h(1), pynvml.NVML_PCIE_UTIL_COUNT)


def test_memory_errors(node: Node) -> None:
    assert pynvml.nvmlDeviceGetEccMode(h(1)) == [1, 1]
    ecc = {(e, c): pynvml.nvmlDeviceGetTotalEccErrors(h(1), e, c) for e in (0, 1) for c in (0, 1)}
    assert ecc == {(0, 0): 17, (1, 0): 2, (0, 1): 1017, (1, 1): 3}
    with pytest.raises(pynvml.NVMLError_NotSupported):  # ECC disabled
        pynvml.nvmlDeviceGetTotalEccErrors(h(2), 0, 0)
    assert pynvml.nvmlDeviceGetRemappedRows(h(1)) == (1, 4, 1, 0)
    hist = pynvml.nvmlDeviceGetRowRemapperHistogram(h(1))
    assert (hist.max, hist.high, hist.partial, hist.low, hist.none) == (2550, 8, 0, 2, 0)
    sbe = pynvml.nvmlDeviceGetRetiredPages(h(1), 0)  # multiple SBE
    dbe = pynvml.nvmlDeviceGetRetiredPages_v2(h(1), pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert (len(sbe), len(dbe), len(set(sbe) | {d["address"] for d in dbe})) == (3, 1, 4)
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h(1)) == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):  # Hopper default: page retirement is N/A
        pynvml.nvmlDeviceGetRetiredPages(h(0), 0)
    values = pynvml.nvmlDeviceGetFieldValues(h(1), [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
                                                   pynvml.NVML_FI_DEV_REMAPPED_UNC,
                                                   pynvml.NVML_FI_DEV_REMAPPED_PENDING])
    assert [v.value.ullVal for v in values] == [2, 4, 1]


def test_fabric_info(node: Node) -> None:
    legacy = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(h(1), ctypes.byref(legacy))
    assert (legacy.state, legacy.status, legacy.cliqueId) == (2, 0, 7)
    assert bytes(legacy.clusterUuid).hex() == CLUSTER_UUID.replace("-", "")
    v2 = pynvml.c_nvmlGpuFabricInfoV_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(h(1), ctypes.byref(v2))
    assert (v2.state, v2.cliqueId, v2.healthMask) == (2, 7, 0x2)
    v3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(h(0), ctypes.byref(v3))
    assert (v3.state, v3.status, v3.healthSummary) == (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0, 0)
    bad = pynvml.c_nvmlGpuFabricInfo_v3_t()
    bad.version = 0x1000024
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetGpuFabricInfoV(h(0), ctypes.byref(bad))
    with pytest.raises(pynvml.NVMLError_NotSupported):  # Ampere has no fabric info
        pynvml.nvmlDeviceGetGpuFabricInfoV(h(3), ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))


def test_topology_and_p2p(node: Node) -> None:
    nvlink = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    assert pynvml.nvmlDeviceGetP2PStatus(h(0), h(1), nvlink) == pynvml.NVML_P2P_STATUS_OK
    assert pynvml.nvmlDeviceGetP2PStatus(h(0), h(2), nvlink) == pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
    assert pynvml.nvmlDeviceGetP2PStatus(h(1), h(2), 1) == pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY
    assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h(0), h(0)) == pynvml.NVML_TOPOLOGY_INTERNAL
    assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h(0), h(1)) == pynvml.NVML_TOPOLOGY_NODE
    assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h(0), h(2)) == pynvml.NVML_TOPOLOGY_SYSTEM
    assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h(1), h(3)) == pynvml.NVML_TOPOLOGY_MULTIPLE


def test_buffers_and_arguments_like_nvml(node: Node) -> None:
    dev = h(0)
    small = ctypes.create_string_buffer(8)
    assert call_status("nvmlDeviceGetName", dev, small, ctypes.c_uint(8)) == 7  # INSUFFICIENT_SIZE
    assert call_status("nvmlSystemGetDriverVersion", small, ctypes.c_uint(4)) == 7
    assert call_status("nvmlDeviceGetName", ctypes.c_void_p(12345), small, 8) == 2  # not a handle
    count = ctypes.c_uint(0)
    assert call_status("nvmlDeviceGetRetiredPages", h(1), 0, ctypes.byref(count), None) == 7
    assert count.value == 3
    assert call_status("nvmlDeviceGetTemperature", dev, 0, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert call_status("nvmlDeviceGetClockInfo", dev, 7, ctypes.byref(count)) == 2
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_NOT_SUPPORTED) == "Not Supported"
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_TIMEOUT) == "Timeout"
    assert pynvml.nvmlErrorString(12345) == "Unknown Error"


# ------------------------------------------------------------------------------------------- events


def test_xid_events_are_delivered_once_per_event_set(node: Node) -> None:
    xid = pynvml.nvmlEventTypeXidCriticalError
    assert pynvml.nvmlDeviceGetSupportedEventTypes(h(1)) & xid
    first = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h(1), xid, first)
    # Like the real driver, a set reports only what happens after it registered:
    # GPU 1's Xids 79 and 48 in the state are history.
    start = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(first, 150)
    assert 0.14 <= time.monotonic() - start < 2
    node.state.gpus[1].xid_events += [(31, 7), (63, 6)]
    node.write()
    got = [pynvml.nvmlEventSetWait_v2(first, 100) for _ in range(2)]
    assert [(e.eventType, e.eventData) for e in got] == [(xid, 63), (xid, 31)]  # lowest seq first
    assert {pynvml.nvmlDeviceGetIndex(e.device) for e in got} == {1}
    # A second set registered now has seen none of them; GPU 0 was never registered.
    second = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h(1), xid, second)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(second, 0)
    # A new Xid written while a waiter blocks is picked up by that waiter, and by the other set.
    node.state.gpus[1].xid_events.append((119, 9))
    node.state.gpus[0].xid_events.append((13, 1))
    timer = threading.Timer(0.2, node.write)
    timer.start()
    try:
        assert pynvml.nvmlEventSetWait(first, 3000).eventData == 119
    finally:
        timer.join()
    assert pynvml.nvmlEventSetWait(second, 0).eventData == 119
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(h(1), 1 << 40, first)
    pynvml.nvmlEventSetFree(first)
    pynvml.nvmlEventSetFree(second)


# ------------------------------------------------------------------------------------------- injection


def test_error_injection_hits_one_function_of_one_gpu(node: Node) -> None:
    lost, unsupported = pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NOT_SUPPORTED
    node.state.gpus[1].calls = [InjectedCall("nvmlDeviceGetTemperature", lost),
                                InjectedCall("nvmlDeviceGetRemappedRows", unsupported)]
    node.write()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetTemperature(h(1), pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRemappedRows(h(1))
    assert pynvml.nvmlDeviceGetName(h(1)) == node.state.gpus[1].name  # other functions unaffected
    assert pynvml.nvmlDeviceGetTemperature(h(0), pynvml.NVML_TEMPERATURE_GPU) == 35  # other GPUs too
    # '*' covers every function of the GPU (a GPU that fell off the bus), handle lookup included.
    node.state.gpus[3].calls = [InjectedCall("*", lost), InjectedCall("nvmlDeviceGetIndex", 0)]
    node.state.calls = [InjectedCall("nvmlSystemGetDriverVersion", pynvml.NVML_ERROR_UNKNOWN)]
    node.write()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByUUID(node.state.gpus[3].uuid)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlSystemGetDriverVersion()
    assert pynvml.nvmlDeviceGetCount() == 4
    node.state.gpus[1].calls = []
    node.state.gpus[3].calls = []
    node.write()
    assert pynvml.nvmlDeviceGetTemperature(h(1), pynvml.NVML_TEMPERATURE_GPU) == 81


def test_handle_of_a_vanished_gpu_reports_gpu_lost(node: Node) -> None:
    dev3 = h(3)
    node.state.gpus = node.state.gpus[:3]
    node.write()
    assert pynvml.nvmlDeviceGetCount() == 3
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetName(dev3)


def test_hang_blocks_only_the_hung_call(node: Node) -> None:
    node.state.gpus[0].calls = [InjectedCall("nvmlDeviceGetTemperature", hang_s=2.0)]
    node.write()
    dev0, dev1 = h(0), h(1)
    result: dict[str, float] = {}

    def hung() -> None:
        t0 = time.monotonic()
        result["temp"] = pynvml.nvmlDeviceGetTemperature(dev0, pynvml.NVML_TEMPERATURE_GPU)
        result["elapsed"] = time.monotonic() - t0

    worker = threading.Thread(target=hung)
    worker.start()
    time.sleep(0.2)  # the worker is now sleeping inside the library
    t0 = time.monotonic()
    assert pynvml.nvmlDeviceGetTemperature(dev1, pynvml.NVML_TEMPERATURE_GPU) == 81
    assert pynvml.nvmlDeviceGetName(dev0) == node.state.gpus[0].name  # same GPU, other function
    assert time.monotonic() - t0 < 0.5
    assert worker.is_alive()
    worker.join(10)
    assert result["temp"] == 35 and result["elapsed"] >= 2.0


def test_state_reload(node: Node) -> None:
    assert pynvml.nvmlDeviceGetTemperature(h(0), 0) == 35
    node.state.gpus[0].temperature_c = 77
    node.state.gpus[0].nvlink_states[5] = 0
    node.write()
    assert pynvml.nvmlDeviceGetTemperature(h(0), 0) == 77
    assert pynvml.nvmlDeviceGetNvLinkState(h(0), 5) == 0


def test_init_error_from_state(state_file: Node) -> None:
    state_file.state.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    state_file.write()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    state_file.state.init_error = 0
    state_file.state.calls = [InjectedCall("nvmlInitWithFlags", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)]
    state_file.write()
    with pytest.raises(pynvml.NVMLError_LibRmVersionMismatch):
        pynvml.nvmlInit()


MALFORMED = {
    "empty": "",
    "bad-magic": "gpumon-nvml-inject-state 2\nend\n",
    "no-end": FORMAT_MAGIC + "\ngpu 0\nname X\n",
    "unterminated": FORMAT_MAGIC + "\nend",
    "unknown-key": FORMAT_MAGIC + "\ngpu 0\nfrobnicate 1\nend\n",
    "overflow": FORMAT_MAGIC + "\ngpu 0\nminor_number 99999999999999999999999\nend\n",
    "negative": FORMAT_MAGIC + "\ngpu 0\ntemperature -5 40\nend\n",
    "gpu-gap": FORMAT_MAGIC + "\ngpu 1\nend\n",
    "link-gap": FORMAT_MAGIC + "\ngpu 0\nnvlink 1 1 0 0 0 0 -\nend\n",
    "bad-bus": FORMAT_MAGIC + "\ngpu 0\npci 0000:zz:00.0 1 1\nend\n",
    "long-name": FORMAT_MAGIC + "\ngpu 0\nname " + "N" * 200 + "\nend\n",
    "nul": FORMAT_MAGIC + "\ngpu 0\nname a\0b\nend\n",
    "crlf": FORMAT_MAGIC + "\r\nend\r\n",
    "non-ascii": FORMAT_MAGIC + "\ngpu 0\nname \x80\nend\n",
    "too-many-gpus": FORMAT_MAGIC + "\n" + "".join(f"gpu {i}\n" for i in range(65)) + "end\n",
    "double-space": FORMAT_MAGIC + "\ngpu 0\ncuda_cc 9  0\nend\n",
    "text-after-end": FORMAT_MAGIC + "\nend\ngpu 0\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_state_fails_init_cleanly(name: str, lib_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"{name}.txt"
    path.write_bytes(MALFORMED[name].encode("latin-1"))
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(path))
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
    err = capfd.readouterr().err
    assert err.count("gpumon-nvml-inject: rejected state file") == 1, err  # reported once


def test_missing_state_fails_init_cleanly(lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(nvml_inject.STATE_ENV, raising=False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(tmp_path / "absent.txt"))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    err = capfd.readouterr().err
    assert "GPUMON_NVML_INJECT_STATE is not set" in err and "absent.txt" in err


def test_state_broken_while_initialized(node: Node) -> None:
    node.path.write_text(FORMAT_MAGIC + "\ngpu 0\n")  # truncated rewrite
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()
    node.write()
    assert pynvml.nvmlDeviceGetCount() == 4


_VALID_TEXT = render_state(rich_state())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, len(_VALID_TEXT)), pos=st.integers(0, len(_VALID_TEXT) - 1),
       junk=st.binary(min_size=0, max_size=12))
def test_fuzzed_state_never_crashes(lib_dir: Path, cut: int, pos: int, junk: bytes) -> None:
    raw = _VALID_TEXT.encode()
    variants = [raw[:cut], raw[:pos] + junk + raw[pos + len(junk):], raw[:pos] + junk + raw[pos:]]
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get(nvml_inject.STATE_ENV)
        try:
            for i, data in enumerate(variants):
                path = Path(tmp) / f"s{i}.txt"
                path.write_bytes(data)
                os.environ[nvml_inject.STATE_ENV] = str(path)
                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError_DriverNotLoaded:
                    continue
                try:
                    for k in range(pynvml.nvmlDeviceGetCount()):
                        dev = pynvml.nvmlDeviceGetHandleByIndex(k)
                        pynvml.nvmlDeviceGetName(dev)
                        pynvml.nvmlDeviceGetFieldValues(dev, [NVML_FI_DEV_MEMORY_TEMP])
                except pynvml.NVMLError:
                    pass  # injected errors in the mutated text are fine; crashing is not
                finally:
                    pynvml.nvmlShutdown()
        finally:
            if old is None:
                os.environ.pop(nvml_inject.STATE_ENV, None)
            else:
                os.environ[nvml_inject.STATE_ENV] = old


# ------------------------------------------------------------------------------------------- subprocess

CHILD = textwrap.dedent("""
    import json, pynvml
    out = {}
    pynvml.nvmlInit()
    out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    out["count"] = pynvml.nvmlDeviceGetCount()
    gpus = []
    for i in range(out["count"]):
        d = pynvml.nvmlDeviceGetHandleByIndex(i)
        (mt,) = pynvml.nvmlDeviceGetFieldValues(d, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        try:
            link3 = pynvml.nvmlDeviceGetNvLinkState(d, 3)
        except pynvml.NVMLError as e:
            link3 = type(e).__name__
        bus = pynvml.nvmlDeviceGetPciInfo(d).busId
        gpus.append({"name": pynvml.nvmlDeviceGetName(d), "uuid": pynvml.nvmlDeviceGetUUID(d),
                     "bus": bus.decode() if isinstance(bus, bytes) else bus, "link3": link3,
                     "mem_temp": mt.value.uiVal if mt.nvmlReturn == 0 else None,
                     "reasons": pynvml.nvmlDeviceGetCurrentClocksEventReasons(d)})
    out["gpus"] = gpus
    es = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1),
                                    pynvml.nvmlEventTypeXidCriticalError, es)
    try:
        pynvml.nvmlEventSetWait(es, 0)
        out["xid"] = "history delivered"
    except pynvml.NVMLError_Timeout:
        out["xid"] = "only new events"
    pynvml.nvmlShutdown()
    try:
        pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError_Uninitialized:
        out["after_shutdown"] = "Uninitialized"
    print(json.dumps(out))
""")


def test_subprocess_finds_library_through_ld_library_path(lib_dir: Path, tmp_path: Path) -> None:
    state = rich_state()
    state.driver_version = "999.88.77-inject"  # proves which libnvidia-ml.so.1 answered
    path = tmp_path / "state.txt"
    write_state(state, path)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", nvml_inject.STATE_ENV)}
    env = nvml_inject.subprocess_env(lib_dir, path, base=base)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["driver"] == "999.88.77-inject" and out["count"] == 4
    assert [g["name"] for g in out["gpus"]] == [g.name for g in state.gpus]
    assert [g["uuid"] for g in out["gpus"]] == [g.uuid for g in state.gpus]
    assert [g["bus"] for g in out["gpus"]] == [g.pci_bus_id for g in state.gpus]
    assert [g["link3"] for g in out["gpus"]] == [1, 0, "NVMLError_NotSupported", 1]
    assert [g["mem_temp"] for g in out["gpus"]] == [42, 93, None, 42]
    assert out["gpus"][1]["reasons"] == 0x48
    assert out["xid"] == "only new events" and out["after_shutdown"] == "Uninitialized"


@pytest.mark.skipif(bool(ctypes.util.find_library("nvidia-ml")), reason="a real NVML is installed")
def test_subprocess_without_ld_library_path_has_no_nvml(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    code = ("import pynvml\ntry:\n    pynvml.nvmlInit()\n"
            "except pynvml.NVMLError_LibraryNotFound:\n    print('none')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.stdout.strip() == "none", proc.stderr


def test_preload_binds_pynvml_in_process(lib_dir: Path, node: Node) -> None:
    # This process started without LD_LIBRARY_PATH pointing at lib_dir, yet pynvml's
    # CDLL("libnvidia-ml.so.1") got the preloaded injection library (glibc matched the soname).
    assert str(lib_dir) not in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    assert pynvml.nvmlLib is not None
    assert pynvml.nvmlDeviceGetName(h(1)) == "NVIDIA H100 80GB HBM3 (sim #1)"
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith("libnvidia-ml.so.1")}
    assert mapped == {str(lib_dir / "libnvidia-ml.so.1")}
