"""The host_bandwidth check: GPU only, so here it is ``skipped`` on a simulated node and ``unknown`` on
a GPU node whose torch has no CUDA; the judgement of measured-like figures (both directions against the
profile, best of two measurements, untested GPUs) and the NUMA-local CPUs read under the host root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from gpumon import workers
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware, placement
from gpumon.hw.inventory import Inventory, collect
from gpumon.model import NODE, Action, Severity
from gpumon.profiles import builtin_profiles
from gpumon.sim.nvml_state import NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.host_bandwidth import kernels as host_kernels
from gpumon_checks.host_bandwidth.check import (
    HostBandwidthCheck,
    HostBandwidthConfig,
    Measured,
    below,
    judge,
    local_cpus,
)

HEALTHY = "name: t\nsku: h100-sxm\ngpus: 8\nfaults: []\n"


def _ctx(state_path: Path, host: Path, simulated: bool) -> CheckContext:
    write_state(NvmlNodeState.hgx(8), state_path)
    (host / "sys").mkdir(parents=True, exist_ok=True)
    hw = simulated_hardware(host) if simulated else Hardware(host)
    hw.nvml.init()
    return CheckContext(hw=hw, inventory=collect(hw.nvml, hw.fs), profile=builtin_profiles()["h100-sxm"],
                        options=HostBandwidthConfig(min_gbps=48.0), state={}, kernel_log=KernelLog())


def test_skipped_with_the_reason_on_a_simulated_node(sim: Any) -> None:
    h = sim(HEALTHY)
    ctx = h.context(HostBandwidthCheck, 0)
    (f,) = HostBandwidthCheck().run(ctx)
    assert (f.severity, f.component) == (Severity.SKIPPED, NODE)
    assert f.message == "host-device bandwidth needs CUDA devices; torch sees none (simulated node)"


def test_unknown_on_a_gpu_node_whose_torch_has_no_cuda(nvml_state: Path, tmp_path: Path) -> None:
    ctx = _ctx(nvml_state, tmp_path / "host", simulated=False)
    try:
        (f,) = HostBandwidthCheck().run(ctx)
    finally:
        ctx.hw.nvml.shutdown()
    assert f.severity is Severity.UNKNOWN
    assert "NVML sees 8 GPU(s) but torch sees no CUDA device" in f.message


def test_supported_needs_gpus_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    check = HostBandwidthCheck()
    assert check.supported(Inventory()) == "no GPUs visible to NVML"
    inv = Inventory(unreadable_gpus={0: "GPU is lost"})
    assert check.supported(inv) is None
    monkeypatch.setitem(sys.modules, "torch", None)  # how Python marks a module as not importable
    assert check.supported(inv) == workers.TORCH_MISSING


def _m(index: int, h2d: float, d2h: float, attempts: int = 1) -> Measured:
    return Measured(index, index, h2d, d2h, {"h2d": [h2d] * attempts, "d2h": [d2h] * attempts}, (0, 1, 2, 3),
                    True)


def test_judged_per_gpu_in_both_directions(nvml_state: Path, tmp_path: Path) -> None:
    ctx = _ctx(nvml_state, tmp_path / "host", simulated=True)
    try:
        results = {0: _m(0, 53.1, 55.2), 1: _m(1, 20.4, 54.0, attempts=2), 2: _m(2, 52.0, 31.0, attempts=2)}
        unmapped = [host_kernels.HostCopy(9, "feed", 50.0, 50.0, True, ())]
        place = placement.Placement("cuda", 4, "4 CUDA devices")
        findings = judge(ctx, results, unmapped, ctx.options, place)
    finally:
        ctx.hw.nvml.shutdown()
    by = {f.component: f for f in findings}
    assert by["gpu/0"].severity is Severity.OK
    assert by["gpu/0"].message == "GPU 0: h2d 53.1 GB/s, d2h 55.2 GB/s (profile minimum 48)"
    assert by["gpu/0"].evidence["cpus"] == "0-3" and by["gpu/0"].evidence["retryable"] is True
    assert (by["gpu/1"].severity, by["gpu/1"].action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert by["gpu/1"].message == ("GPU 1: host-to-device below the profile's 48 GB/s (h2d 20.4, d2h 54; "
                                   "best of 2 measurements)")
    assert "device-to-host below" in by["gpu/2"].message
    for i in range(3, 8):
        assert by[f"gpu/{i}"].severity is Severity.UNKNOWN and "not tested" in by[f"gpu/{i}"].message
    assert by[NODE].severity is Severity.UNKNOWN and "cuda:9" in by[NODE].evidence["measured"]
    # base units on /metrics: bytes per second (the evidence and the message say GB/s)
    [h2d] = [r for r in by["gpu/1"].evidence["readings"] if r[2] == {"direction": "h2d"}]
    assert h2d[0] == "host_bandwidth_bytes_per_second" and h2d[1] == pytest.approx(20.4e9)


def test_below_and_no_profile_minimum() -> None:
    results = {0: _m(0, 47.9, 60.0), 1: _m(1, 50.0, 50.0)}
    assert below(results, 48.0) == {0: ["host-to-device"]}
    assert below(results, None) == {}


def test_local_cpus_come_from_sysfs_under_the_host_root(nvml_state: Path, tmp_path: Path) -> None:
    ctx = _ctx(nvml_state, tmp_path / "host", simulated=True)
    try:
        gpu0 = ctx.inventory.gpus[0]
        node = tmp_path / "host" / "sys" / "bus" / "pci" / "devices" / gpu0.pci_bus_id
        node.mkdir(parents=True)
        (node / "local_cpulist").write_text("0-3,8\n")
        found = local_cpus(ctx)
    finally:
        ctx.hw.nvml.shutdown()
    assert found == {placement.normalize_uuid(gpu0.uuid): (0, 1, 2, 3, 8)}
