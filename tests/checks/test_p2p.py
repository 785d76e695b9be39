"""The p2p check: NVML P2P status and topology served by the NVML injection library under the real
nvidia-ml-py (healthy HGX, a pair without NVLink, a GPU without NVLink to anyone, a PCIe SKU, an NVML
error) with the copy part switched off; copies measured on a simulated node's stand-ins (a slow
link, a GPU slow to every peer: gpumon/sim/devices.py); and the judgement of GPU-sized copies from
measured-like figures (a slow pair names both GPUs).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw.inventory import collect
from gpumon.model import NODE, Action, Finding, Severity, is_component
from gpumon.profiles import builtin_profiles
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.p2p import kernels as p2p_kernels
from gpumon_checks.p2p.check import (
    P2pCheck,
    P2pConfig,
    PairPath,
    blame,
    judge,
    matrix,
    nvml_paths,
    peer_floors,
)

PROFILES = builtin_profiles()
NOT_SUPPORTED = 5  # NVML_P2P_STATUS_NOT_SUPPORTED


def _ctx(host: Path, profile: str, options: P2pConfig | None = None, simulated: bool = True) -> CheckContext:
    (host / "sys").mkdir(parents=True, exist_ok=True)
    hw = simulated_hardware(host) if simulated else Hardware(host)
    hw.nvml.init()
    return CheckContext(hw=hw, inventory=collect(hw.nvml, hw.fs), profile=PROFILES[profile],
                        options=options or P2pConfig(), state={}, kernel_log=KernelLog())


def _run(state_path: Path, state: NvmlNodeState, host: Path, profile: str = "h100-sxm",
         simulated: bool = True, options: P2pConfig | None = None) -> list[Finding]:
    write_state(state, state_path)
    ctx = _ctx(host, profile, options or P2pConfig(copies=False), simulated=simulated)
    try:
        return P2pCheck().run(ctx)
    finally:
        ctx.hw.nvml.shutdown()


def _by(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out


def test_healthy_hgx_has_nvlink_on_every_ordered_pair(nvml_state: Path, tmp_path: Path) -> None:
    findings = _run(nvml_state, NvmlNodeState.hgx(8), tmp_path / "host")
    by = _by(findings)
    assert all(by[f"gpu/{i}"][0].severity is Severity.OK for i in range(8))
    node_ok, skipped = by[NODE]
    assert node_ok.severity is Severity.OK and "NVLink on every pair" in node_ok.message
    rows = node_ok.evidence["nvml_paths"]
    assert len(rows) == 9 and rows[1].split() == ["GPU0", "X", *["NV"] * 7]
    assert node_ok.evidence["expect_nvlink"] is True
    assert skipped.severity is Severity.SKIPPED
    assert skipped.message == "copy bandwidth not measured: switched off (checks.p2p.copies: false)"


def test_a_pair_without_nvlink_names_both_gpus(nvml_state: Path, tmp_path: Path) -> None:
    state = NvmlNodeState.hgx(8)
    state.gpus[2].p2p_status = {5: NOT_SUPPORTED}  # GPU 2 -> GPU 5 only
    by = _by(_run(nvml_state, state, tmp_path / "host"))
    fail = [f for f in by[NODE] if f.severity is Severity.FAIL]
    assert len(fail) == 1
    assert (fail[0].action, fail[0].message) == (
        Action.REBOOT_NODE,
        "1 GPU pair(s) faulty: GPU 2 -> GPU 5: no NVLink P2P (status NOT_SUPPORTED, PCIe path NODE)")
    assert list(fail[0].evidence["pairs"]) == ["2->5"]
    assert fail[0].evidence["nvml_paths"][3].split()[6] == "--"  # row GPU2, column GPU5
    # one bad pair blames neither GPU alone
    for i in (2, 5):
        (f,) = by[f"gpu/{i}"]
        assert f.severity is Severity.OK and "not attributable to this GPU alone" in f.message


def test_a_gpu_without_nvlink_to_anyone_is_the_fault(nvml_state: Path, tmp_path: Path) -> None:
    state = NvmlNodeState.hgx(8)
    for j in range(8):
        if j != 4:
            state.gpus[4].p2p_status[j] = NOT_SUPPORTED
            state.gpus[j].p2p_status[4] = NOT_SUPPORTED
    by = _by(_run(nvml_state, state, tmp_path / "host"))
    (f,) = by["gpu/4"]
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert f.message.startswith("GPU 4: P2P faults with 14 of 14 ordered pairs (GPU 0 -> GPU 4: no NVLink")
    assert all(by[f"gpu/{i}"][0].severity is Severity.OK for i in range(8) if i != 4)
    assert by[NODE][0].severity is Severity.OK  # every faulty pair is explained by GPU 4


def test_pcie_sku_expects_no_nvlink_and_shows_the_pcie_paths(nvml_state: Path, tmp_path: Path) -> None:
    gpus = [GpuState(index=i, name="NVIDIA H100 PCIe", pci_device_id=0x233110DE, nvlink_states=[],
                     numa_node=i // 2) for i in range(4)]
    by = _by(_run(nvml_state, NvmlNodeState(gpus=gpus), tmp_path / "host", profile="h100-pcie"))
    node = by[NODE][0]
    assert node.severity is Severity.OK and node.evidence["expect_nvlink"] is False
    assert "paths as NVML reports them" in node.message
    # same NUMA node -> NODE, across sockets -> SYS (nvidia-smi topo -m's words)
    assert node.evidence["nvml_paths"][1].split() == ["GPU0", "X", "NODE", "SYS", "SYS"]


def test_an_nvml_error_is_reported_not_guessed(nvml_state: Path, tmp_path: Path) -> None:
    state = NvmlNodeState.hgx(4)
    state.gpus[1].calls = [InjectedCall("nvmlDeviceGetP2PStatus", error=999)]  # NVML_ERROR_UNKNOWN
    by = _by(_run(nvml_state, state, tmp_path / "host"))
    fail = [f for f in by[NODE] if f.severity is Severity.FAIL]
    assert len(fail) == 1 and fail[0].action is Action.NONE
    assert "GPU 1 -> GPU 0: NVML: nvmlDeviceGetP2PStatus(gpu/1)" in fail[0].message
    assert fail[0].evidence["nvml_paths"][2].split() == ["GPU1", "ERR", "X", "ERR", "ERR"]


def test_gpu_node_where_torch_has_no_cuda_cannot_say_about_copies(nvml_state: Path, tmp_path: Path) -> None:
    findings = _run(nvml_state, NvmlNodeState.hgx(8), tmp_path / "host", simulated=False, options=P2pConfig())
    missing = [f for f in findings if f.severity is Severity.UNKNOWN]
    assert len(missing) == 1 and missing[0].component == NODE
    assert "NVML sees 8 GPU(s) but torch sees no CUDA device" in missing[0].message


# ------------------------------------------------------- copies measured on a simulated node's stand-ins


def test_a_slow_link_between_two_simulated_gpus_names_both(sim: Any) -> None:
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {kind: p2p_slow, gpu: 1, peer: 3, factor: 0.1}\n")
    by = _by(h.run(P2pCheck, 0))
    (node,) = by[NODE]
    assert (node.severity, node.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert node.message.startswith("2 GPU pair(s) faulty: GPU 1 -> GPU 3: copy ")
    assert "GPU 3 -> GPU 1: copy " in node.message and node.message.count("(twice)") == 2
    assert set(node.evidence["pairs"]) == {"1->3", "3->1"}
    assert node.evidence["min_gbps_source"].startswith("CPU stand-ins: 30% of the median of the pairs that "
                                                       "involve neither GPU")
    assert node.evidence["min_gbps"] is None and set(node.evidence["floor_gbps"]) == {
        f"{a}->{b}" for a, b in itertools.permutations(range(4), 2)}
    assert set(node.evidence["copy_attempts_gbps"]) >= {"1->3", "3->1"}  # measured again before failing
    assert node.evidence["copy_gbps"][0].split() == ["GPU0", "GPU1", "GPU2", "GPU3"]
    for i in (1, 3):
        (f,) = by[f"gpu/{i}"]
        assert f.severity is Severity.OK and "not attributable to this GPU alone" in f.message
        assert {r[2]["peer"] for r in f.evidence["readings"]} == {"0", "1", "2", "3"} - {str(i)}


def test_a_gpu_slow_to_every_peer_is_the_fault(sim: Any) -> None:
    # 6 of the 12 pairs are slow (why floors come from the pairs a pair does not touch:
    # test_floors_come_from_the_pairs_a_pair_does_not_touch); a tenth of the speed measures 0.1-0.15
    # of a healthy pair here, well under the 0.3 floor on a loaded machine
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {kind: p2p_slow, gpu: 2, factor: 0.1}\n")
    by = _by(h.run(P2pCheck, 0))
    (f,) = by["gpu/2"]
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert f.message.startswith("GPU 2: P2P faults with 6 of 6 ordered pairs")
    assert by[NODE][0].severity is Severity.OK  # every slow pair is explained by GPU 2
    assert all(by[f"gpu/{i}"][0].severity is Severity.OK for i in (0, 1, 3))


def test_three_simulated_gpus_copy_but_cannot_judge_each_other(sim: Any) -> None:
    h = sim("name: t\nsku: h100-sxm\ngpus: 3\nfaults:\n  - {kind: p2p_slow, gpu: 0, factor: 0.1}\n")
    (node,) = _by(h.run(P2pCheck, 0))[NODE]
    assert node.severity is Severity.OK and node.message.endswith("6 ordered pairs copied")
    assert node.evidence["copies_judged"] == "no: fewer than 4 GPUs leave no pair to compare a pair with"
    assert node.evidence["floor_gbps"] == {}


def test_floors_come_from_the_pairs_a_pair_does_not_touch() -> None:
    rates = {p: _copy(*p, 10.0) for p in itertools.permutations(range(4), 2)}
    for p in rates:
        if 2 in p:
            rates[p] = _copy(*p, 2.5)  # GPU 2 slow to everyone: half of all pairs
    floors = peer_floors(rates, 0.3)
    assert floors[(2, 0)] == pytest.approx(3.0)  # the pairs of GPUs 1 and 3: 10 GB/s
    assert floors[(0, 1)] == pytest.approx(0.75)  # the pairs of GPUs 2 and 3: 2.5 GB/s
    assert peer_floors({p: _copy(*p, 1.0) for p in itertools.permutations(range(3), 2)}, 0.3) == {}


# ------------------------------------------------------------------- copies (measured-like figures)


def _copy(src: int, dst: int, gbps: float, verified: bool = True) -> p2p_kernels.PeerCopy:
    return p2p_kernels.PeerCopy(src, dst, gbps, 512 * 2**20 * 10 / gbps / 1e9, True, verified)


def test_copies_below_the_profile_name_both_gpus_and_a_slow_gpu_is_blamed(nvml_state: Path,
                                                                         tmp_path: Path) -> None:
    write_state(NvmlNodeState.hgx(8), nvml_state)
    ctx = _ctx(tmp_path / "host", "h100-sxm")
    try:
        indices = list(range(8))
        paths = nvml_paths(ctx, indices)
    finally:
        ctx.hw.nvml.shutdown()
    copies = {}
    for i, j in itertools.permutations(indices, 2):
        gbps = 375.0
        if (i, j) == (2, 5):
            gbps = 120.0
        if 6 in (i, j):
            gbps = 150.0
        copies[(i, j)] = _copy(i, j, gbps, verified=(i, j) != (0, 1))
    options = P2pConfig(min_gbps=335.0)
    findings = judge(ctx, indices, paths, copies, "56 ordered pairs copied", options, True)
    assert all(is_component(f.component) for f in findings)
    by = _by(findings)
    (six,) = by["gpu/6"]
    assert (six.severity, six.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "14 of 14 ordered pairs" in six.message and "copy 150 GB/s below 335 (twice)" in six.message
    (node,) = by[NODE]
    assert node.severity is Severity.FAIL
    assert node.action is Action.INSPECT_HARDWARE  # the worst of its pairs: data copied wrong
    assert node.message == ("2 GPU pair(s) faulty: GPU 0 -> GPU 1: copied data differs from its source; "
                            "GPU 2 -> GPU 5: copy 120 GB/s below 335 (twice)")
    assert node.evidence["copy_gbps"][3].split()[6] == "120"
    readings = by["gpu/2"][0].evidence["readings"]
    assert ["p2p_copy_bytes_per_second", 120e9, {"peer": "5"}] in readings  # GB/s in base units


def test_blame_and_matrix() -> None:
    assert blame([(2, 5)], [0, 1, 2, 3, 4, 5, 6, 7]) == ([], [(2, 5)])
    bad = [(4, j) for j in range(8) if j != 4] + [(j, 4) for j in range(8) if j != 4] + [(0, 1)]
    assert blame(bad, list(range(8))) == ([4], [(0, 1)])
    # 7 of 14 is not more than half: named by pair, not blamed
    assert blame([(4, j) for j in range(8) if j != 4], list(range(8)))[0] == []
    # two GPUs, or every pair down (fabric): no GPU stands out, the node is named with every pair
    assert blame([(0, 1), (1, 0)], [0, 1]) == ([], [(0, 1), (1, 0)])
    every = list(itertools.permutations(range(4), 2))
    assert blame(every, list(range(4))) == ([], sorted(every))
    rows = matrix([0, 1], {(0, 1): "NV", (1, 0): "SYS"})
    assert [r.split() for r in rows] == [["GPU0", "GPU1"], ["GPU0", "X", "NV"], ["GPU1", "SYS", "X"]]
    path = PairPath(0, 1, {"read": "OK", "write": "OK", "nvlink": "NOT_SUPPORTED"}, "PXB")
    assert (path.nvlink, path.short) == (False, "PXB")


def test_supported_needs_two_gpus() -> None:
    from gpumon.hw.inventory import Inventory

    assert P2pCheck().supported(Inventory()) == "fewer than 2 GPUs: no GPU pairs"
    assert P2pCheck.name == "p2p" and P2pCheck.phase.value == "bootstrap"
