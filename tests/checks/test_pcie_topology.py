"""The pcie_topology bootstrap check on simulated HGX H100 nodes (each GPU and its ConnectX-7 on one
PCIe switch, as in the real HGX lspci of tests/data/pcie-aer) and on a hand-built flat PCI tree."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nvidia_smi_capture import run_check

from gpumon.hw import pci as pcihw
from gpumon.hw.calls import BoundedCaller
from gpumon.hw.hostfs import HostFs
from gpumon.model import Action, Finding, Severity
from gpumon.sim.nvml_state import NvmlNodeState
from gpumon_checks.pcie_topology import (
    PcieTopologyCheck,
    PcieTopologyConfig,
    gpu_nic_pairs,
    has_switch_above,
    shared_switch,
)

GPU3 = "pci/0000:5d:00.0"  # the simulator lays GPUs out on the real HGX H100's buses (19, 3b, 4c, 5d, ...)


def by(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out


def test_healthy_hgx_node(sim: Callable[..., Any]) -> None:
    h = sim("name: ok\nsku: h100-sxm\n")
    findings = h.run(PcieTopologyCheck, 0.0)
    assert {f.severity for f in findings} == {Severity.OK}
    comps = by(findings)
    [g3] = comps["gpu/3"]
    assert g3.message == "GPU 3: NIC mlx5_3 (0000:5e:00.0) on the same PCIe switch; link Gen5 x16 of Gen5 x16"
    assert (g3.evidence["nics"], g3.evidence["switch"], g3.evidence["pci_bus_id"]) == (
        ["mlx5_3"], "0000:5a:00.0", "0000:5d:00.0")
    assert g3.evidence["link"]["partner"] == "0000:5b:00.0"  # the switch downstream port
    [node] = comps["node"]
    assert node.message == "PCIe AER counters of 48 function(s) recorded before the suite's load"
    assert node.evidence["expect_nic_per_gpu"] is True
    assert node.evidence["expectation"] == "profile h100-sxm: 8 IB ports for 8 GPUs (one NIC per GPU)"
    # after the suite, nothing changed
    after = PcieTopologyCheck().after_suite(h.context(PcieTopologyCheck, 30.0))
    assert [(f.component, f.severity) for f in after] == [("node", Severity.OK)]
    assert after[0].message.startswith("PCIe AER compared on 48 function(s) over the suite (1.0 min "
                                       "counted): 0")


def test_aer_errors_during_the_suite(sim: Callable[..., Any]) -> None:
    h = sim("name: aer\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 10, kind: aer, gpu: 3, severity: nonfatal, count: 2}\n"
            "  - {at_s: 10, kind: aer, gpu: 5, severity: correctable, count: 50}\n"
            "  - {at_s: 10, kind: aer, gpu: 6, severity: correctable, count: 5}\n")
    assert {f.severity for f in h.run(PcieTopologyCheck, 0.0)} == {Severity.OK}  # before: the baseline
    after = by(PcieTopologyCheck().after_suite(h.context(PcieTopologyCheck, 20.0)))
    [g3] = after[GPU3]
    assert (g3.severity, g3.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert g3.message == "gpu/3: 0 fatal and 2 non-fatal PCIe AER error(s) during the bootstrap suite"
    assert g3.evidence["delta"] == {"correctable": 0, "nonfatal": 2, "fatal": 0}
    [g5] = after["pci/0000:bb:00.0"]
    assert (g5.severity, g5.action) == (Severity.WARN, Action.INSPECT_HARDWARE)
    assert g5.message.startswith("gpu/5: 50 correctable PCIe AER errors during the suite (more than 8")
    assert "pci/0000:cb:00.0" not in after  # 5 correctable in a minute: within DCGM's 8 replays per minute
    assert after["node"][0].message.endswith("2 with new errors or unreadable")


def test_after_suite_without_a_baseline_is_unknown(sim: Callable[..., Any]) -> None:
    h = sim("name: nobase\nsku: h100-sxm\n")
    [f] = PcieTopologyCheck().after_suite(h.context(PcieTopologyCheck, 0.0))
    assert (f.component, f.severity) == ("node", Severity.UNKNOWN)


def test_narrow_link_fails_and_idle_downshift_is_not_judged(sim: Callable[..., Any]) -> None:
    h = sim("name: links\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 0, kind: pcie_link, gpu: 2, width: 8}\n"
            "  - {at_s: 0, kind: pcie_link, gpu: 1, gen: 1}\n")
    comps = by(h.run(PcieTopologyCheck, 0.0))
    [g2] = comps["gpu/2"]
    assert (g2.severity, g2.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert g2.message == ("GPU 2: PCIe link trained at x8, both ends can do x16 (50% of the bandwidth): "
                          "reseat or inspect the card or riser")
    [g1] = comps["gpu/1"]
    assert g1.severity is Severity.OK  # an idle GPU lowers its link speed: recorded, not judged
    assert g1.evidence["link"]["idle_downshift"].startswith("link at Gen1 while it can do Gen5 at 0 % "
                                                            "utilization")


def test_slow_link_while_busy_warns(sim: Callable[..., Any]) -> None:
    h = sim("name: busy\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 0, kind: pcie_link, gpu: 1, gen: 3}\n"
            "  - {at_s: 0, kind: utilization, gpu: 1, pct: 90}\n")
    [g1] = by(h.run(PcieTopologyCheck, 0.0))["gpu/1"]
    assert (g1.severity, g1.action) == (Severity.WARN, Action.INSPECT_HARDWARE)
    assert g1.message == "GPU 1: link at Gen3 while it can do Gen5 while the GPU is busy (90 % utilization)"


def test_gpu_without_a_nic_on_its_switch(sim: Callable[..., Any]) -> None:
    h = sim("name: seven\nsku: h100-sxm\nib_devices: 7\n")
    comps = by(h.run(PcieTopologyCheck, 0.0))
    [g7] = comps["gpu/7"]
    assert (g7.severity, g7.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert g7.message.startswith("GPU 7: no RDMA NIC below the same PCIe switch 0000:d8:00.0: this GPU's "
                                 "GPUDirect RDMA traffic would cross the CPU root complex")
    assert all(comps[f"gpu/{i}"][0].severity is Severity.OK for i in range(7))
    # not required by the site: recorded, not judged
    h2 = sim("name: seven\nsku: h100-sxm\nib_devices: 7\n", "checks: {}\n")
    ctx = h2.context(PcieTopologyCheck, 0.0)
    ctx.options = PcieTopologyConfig(expect_nic_per_gpu=False)
    [g7] = by(PcieTopologyCheck().run(ctx))["gpu/7"]
    assert g7.severity is Severity.OK and g7.evidence["affinity"].startswith("no RDMA NIC below the same")


# --------------------------------------------------------------------------- a flat tree (a VM)


def _function(root: Path, path: str, vendor: str, device: str, cls: str) -> None:
    d = root / path
    d.mkdir(parents=True, exist_ok=True)
    for name, value in (("vendor", vendor), ("device", device), ("class", cls)):
        (d / name).write_text(value + "\n")
    (d / "current_link_speed").write_text("32.0 GT/s PCIe\n")
    (d / "max_link_speed").write_text("32.0 GT/s PCIe\n")
    (d / "current_link_width").write_text("16\n")
    (d / "max_link_width").write_text("16\n")
    link = root / "sys/bus/pci/devices" / os.path.basename(path)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(d, link.parent))


def flat_tree(root: Path) -> None:
    """GPU and NIC each directly below a root port, as a VM's virtual PCIe shows them."""
    base = "sys/devices/pci0000:00"
    _function(root, f"{base}/0000:00:01.0", "0x8086", "0x352a", "0x060400")
    _function(root, f"{base}/0000:00:01.0/0000:01:00.0", "0x10de", "0x2330", "0x030200")
    _function(root, f"{base}/0000:00:02.0", "0x8086", "0x352a", "0x060400")
    _function(root, f"{base}/0000:00:02.0/0000:02:00.0", "0x15b3", "0x1021", "0x020700")
    ib = root / "sys/class/infiniband/mlx5_0"
    ib.mkdir(parents=True)
    (ib / "device").symlink_to(os.path.relpath(root / f"{base}/0000:00:02.0/0000:02:00.0", ib))


def test_pairs_need_a_switch_not_just_the_root_complex(tmp_path: Path) -> None:
    flat_tree(tmp_path)
    fs = HostFs(tmp_path, BoundedCaller(), 2.0)
    nics, errors = pcihw.infiniband_devices(fs)
    assert (nics, errors) == ({"mlx5_0": "0000:02:00.0"}, {})
    tree = pcihw.scan(fs, extra=set(nics.values()))
    assert shared_switch(tree, "0000:01:00.0", "0000:02:00.0") is None
    assert not has_switch_above(tree, "0000:01:00.0")
    assert gpu_nic_pairs(tree, {"0000:01:00.0": 0}, nics) == {0: []}


def test_flat_topology_skips_affinity(nvml_state: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    flat_tree(host)
    node = NvmlNodeState.hgx(1)
    node.gpus[0].pci_bus_id = "00000000:01:00.0"
    findings = run_check(PcieTopologyCheck, node, nvml_state, host)
    comps = by(findings)
    skipped = [f for f in comps["node"] if f.severity is Severity.SKIPPED]
    assert [f.message for f in skipped] == ["no PCIe switch visible above any GPU (a VM or a flattened "
                                            "topology): GPU/NIC affinity not judged"]
    [g0] = comps["gpu/0"]
    assert g0.severity is Severity.OK and g0.evidence["nics"] == []
