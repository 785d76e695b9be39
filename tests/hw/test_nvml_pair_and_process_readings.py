"""NvmlReadings.p2p_status, topology_common_ancestor, compute_processes, utilization and
pcie_throughput over the real nvidia-ml-py and the injection library: values, NotSupported
(remembered per peer), errors mapped to gpumon's conditions on the right GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.errors import GpuLost, HwFailure, NotSupported
from gpumon.hw.calls import BoundedCaller
from gpumon.hw.nvml import (
    P2P_CAPABILITIES,
    ComputeProcess,
    NvmlError,
    NvmlReadings,
    PcieThroughput,
    Utilization,
)
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state

NVLINK_NOT_SUPPORTED = 5  # NVML_P2P_STATUS_NOT_SUPPORTED
NODE, SYSTEM, MULTIPLE = 40, 50, 20  # NVML_TOPOLOGY_*


def _nvml() -> NvmlReadings:
    nvml = NvmlReadings(BoundedCaller(), 5.0, complete=True)
    nvml.init()
    return nvml


def _node(**gpu1: object) -> NvmlNodeState:
    gpus = [GpuState(index=i, numa_node=i // 2) for i in range(4)]
    for key, value in gpu1.items():
        setattr(gpus[1], key, value)
    return NvmlNodeState(gpus=gpus)


# -- P2P and topology -------------------------------------------------------------------------------

def test_p2p_status_and_topology_per_ordered_pair(nvml_state: Path) -> None:
    write_state(_node(p2p_status={2: NVLINK_NOT_SUPPORTED}, topology={3: MULTIPLE}), nvml_state)
    nvml = _nvml()
    assert {cap: nvml.p2p_status(0, 1, cap) for cap in P2P_CAPABILITIES} == dict.fromkeys(P2P_CAPABILITIES, 0)
    assert nvml.p2p_status(1, 2, "nvlink") == NVLINK_NOT_SUPPORTED
    assert nvml.p2p_status(2, 1, "nvlink") == 0  # the state is per ordered pair
    assert nvml.topology_common_ancestor(0, 1) == NODE  # same NUMA node
    assert nvml.topology_common_ancestor(0, 2) == SYSTEM
    assert nvml.topology_common_ancestor(1, 3) == MULTIPLE
    with pytest.raises(KeyError):
        nvml.p2p_status(0, 1, "telepathy")


def test_p2p_not_supported_is_remembered_for_that_peer_only(nvml_state: Path) -> None:
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetP2PStatus", error=3)]), nvml_state)
    nvml = _nvml()
    with pytest.raises(NotSupported) as info:
        nvml.p2p_status(1, 2, "atomics")
    assert (info.value.call, info.value.component) == ("nvmlDeviceGetP2PStatus(gpu/1)", "gpu/1")
    write_state(_node(), nvml_state)  # the library would now answer...
    with pytest.raises(NotSupported, match="remembered"):  # ...gpumon does not ask that again
        nvml.p2p_status(1, 2, "atomics")
    assert nvml.p2p_status(1, 2, "read") == 0  # another capability
    assert nvml.p2p_status(1, 3, "atomics") == 0  # another peer


def test_pair_errors_name_the_gpu_whose_call_failed(nvml_state: Path) -> None:
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetTopologyCommonAncestor", error=999)]), nvml_state)
    nvml = _nvml()
    with pytest.raises(NvmlError) as err:
        nvml.topology_common_ancestor(1, 0)
    assert (err.value.code, err.value.component) == (999, "gpu/1")
    assert nvml.topology_common_ancestor(0, 1) == NODE  # the reverse pair asks GPU 0
    with pytest.raises(HwFailure) as peer:  # a peer NVML does not have: its handle is what failed
        nvml.p2p_status(0, 9, "read")
    assert peer.value.component == "gpu/9" and "nvmlDeviceGetHandleByIndex(9)" in peer.value.call
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetP2PStatus", error=15)]), nvml_state)
    with pytest.raises(GpuLost):
        nvml.p2p_status(1, 0, "nvlink")


# -- compute processes ------------------------------------------------------------------------------

def test_compute_processes(nvml_state: Path) -> None:
    write_state(_node(compute_processes=[(4242, 12 << 30), (77, None)]), nvml_state)
    nvml = _nvml()
    assert nvml.compute_processes(1) == [ComputeProcess(4242, 12 << 30), ComputeProcess(77, None)]
    assert nvml.compute_processes(0) == []
    many = [(1000 + k, k) for k in range(64)]  # beyond pynvml's first guess: the sizing call must work
    write_state(_node(compute_processes=many), nvml_state)
    assert [(p.pid, p.used_memory_bytes) for p in nvml.compute_processes(1)] == many


def test_compute_processes_not_supported_and_errors(nvml_state: Path) -> None:
    symbol = "nvmlDeviceGetComputeRunningProcesses_v3"
    write_state(_node(calls=[InjectedCall(symbol, error=3)]), nvml_state)
    nvml = _nvml()
    with pytest.raises(NotSupported):
        nvml.compute_processes(1)
    assert nvml.compute_processes(2) == []
    write_state(_node(compute_processes=[(5, 1)]), nvml_state)
    with pytest.raises(NotSupported, match="remembered"):
        nvml.compute_processes(1)
    write_state(NvmlNodeState(gpus=[GpuState(index=i, calls=[InjectedCall(symbol, error=e)])
                                    for i, e in enumerate((4, 15))]), nvml_state)
    nvml = _nvml()  # a new session: the last one remembers GPU 1 as not supported
    with pytest.raises(NvmlError) as denied:  # NVML_ERROR_NO_PERMISSION (MIG without privileges)
        nvml.compute_processes(0)
    assert (denied.value.code, denied.value.component, denied.value.call) == (
        4, "gpu/0", f"{symbol}(gpu/0)")
    with pytest.raises(GpuLost):
        nvml.compute_processes(1)


# -- activity: utilization rates and PCIe throughput (the collective_hang check's readings) ----------

def test_utilization_and_pcie_throughput_per_direction(nvml_state: Path) -> None:
    write_state(_node(utilization_gpu=100, utilization_memory=3, pcie_tx_kbps=204_800,
                      pcie_rx_kbps=17), nvml_state)
    nvml = _nvml()
    assert nvml.utilization(1) == Utilization(gpu_pct=100, memory_pct=3)
    assert nvml.pcie_throughput(1) == PcieThroughput(tx_kbps=204_800, rx_kbps=17)
    assert nvml.utilization(0) == Utilization(0, 0)
    assert nvml.pcie_throughput(0) == PcieThroughput(0, 0)


def test_pcie_throughput_not_supported_is_remembered_and_a_lost_gpu_is_lost(nvml_state: Path) -> None:
    symbol = "nvmlDeviceGetPcieThroughput"
    write_state(NvmlNodeState(gpus=[GpuState(index=0, calls=[InjectedCall(symbol, error=3)]),
                                    GpuState(index=1, calls=[InjectedCall("*", error=15)])]), nvml_state)
    nvml = _nvml()
    with pytest.raises(NotSupported):
        nvml.pcie_throughput(0)
    write_state(NvmlNodeState(gpus=[GpuState(index=0), GpuState(index=1)]), nvml_state)
    with pytest.raises(NotSupported, match="remembered"):
        nvml.pcie_throughput(0)
    assert nvml.utilization(0) == Utilization(0, 0)
    lost = GpuState(index=1, calls=[InjectedCall("*", error=15)])
    write_state(NvmlNodeState(gpus=[GpuState(index=0), lost]), nvml_state)
    with pytest.raises(GpuLost):
        nvml.utilization(1)
