"""gpumon.hw.nvml over the real nvidia-ml-py and the injection library: readings and error mapping."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpumon.errors import GpuLost, HwTimeout, NotSupported
from gpumon.hw.calls import BoundedCaller
from gpumon.hw.nvml import Nvml
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state


def _nvml(timeout: float = 5.0) -> Nvml:
    nvml = Nvml(BoundedCaller(), timeout, complete=True)
    nvml.init()
    return nvml


def _node(**gpu1: object) -> NvmlNodeState:
    gpus = [GpuState(index=i, uuid=f"GPU-{i}", pci_bus_id=f"00000000:{0x19 + i:02X}:00.0")
            for i in range(4)]
    for key, value in gpu1.items():
        setattr(gpus[1], key, value)
    return NvmlNodeState(gpus=gpus)


def test_inventory_readings(nvml_state: Path) -> None:
    write_state(_node(nvlink_states=[1] * 18, clocks_event_reasons=0x48), nvml_state)
    nvml = _nvml()
    assert nvml.device_count() == 4
    info = nvml.info(1)
    assert (info.uuid, info.pci_bus_id, info.architecture, info.nvlink_count) == \
        ("GPU-1", "0000:1a:00.0", "hopper", 18)
    assert nvml.clocks_event_reasons(1) == 0x48


def test_gpu_lost_is_mapped(nvml_state: Path) -> None:
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetCurrentClocksEventReasons", error=15)]),
                nvml_state)
    nvml = _nvml()
    with pytest.raises(GpuLost) as info:
        nvml.clocks_event_reasons(1)
    assert info.value.component == "gpu/1"
    assert nvml.clocks_event_reasons(0) == 0  # other GPUs unaffected


def test_not_supported_switches_the_reading_off(nvml_state: Path) -> None:
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetTemperature", error=3)]), nvml_state)
    nvml = _nvml()
    with pytest.raises(NotSupported):
        nvml.temperature_c(1)
    write_state(_node(), nvml_state)  # the library would now answer...
    with pytest.raises(NotSupported, match="remembered"):  # ...but gpumon does not ask again
        nvml.temperature_c(1)
    assert nvml.temperature_c(2) == 35


def test_hung_call_is_bounded_and_the_lane_does_not_pile_up(nvml_state: Path) -> None:
    write_state(_node(calls=[InjectedCall("nvmlDeviceGetPowerUsage", hang_s=3.0)]), nvml_state)
    nvml = _nvml(timeout=0.5)
    nvml.info(1)  # handle cached before the hang
    start = time.monotonic()
    with pytest.raises(HwTimeout, match=r"nvmlDeviceGetPowerUsage\(gpu/1\) did not return"):
        nvml.power_w(1)
    assert time.monotonic() - start < 1.0
    assert nvml.power_w(2) == 72.0  # other GPUs answer meanwhile
    time.sleep(0.6)
    with pytest.raises(HwTimeout, match="has been hung"):
        nvml.sm_clock_mhz(1)  # GPU 1's lane is still stuck: answered at once, no new thread
    time.sleep(2.5)
    write_state(_node(), nvml_state)
    assert nvml.sm_clock_mhz(1) == 345  # recovered once the stuck call returned
