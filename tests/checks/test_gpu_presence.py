"""The gpu_presence check: simulated nodes (missing GPU, lost GPU, short SKU count) and a PCI tree built
from a real `lspci -nn` capture of a DGX H200 (tests/data/nvidia-smi-q, provenance in SOURCES.md there).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpumon.check import CheckContext, KernelLog
from gpumon.errors import GpuLost, HwFailure
from gpumon.hw import Hardware
from gpumon.hw.inventory import PciDevice, collect
from gpumon.hw.nvml import GpuInfo
from gpumon.model import Action, Finding, Severity, is_component
from gpumon.profiles import GENERIC, GpuSpec, Profile, builtin_profiles, select_profile
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.gpu_presence import BusView, GpuPresenceCheck, NvmlView

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-q"
LSPCI_H200 = DATA / "issue_torchruntime-24_lspci-nn_dgx-h200_8x-10de-2335.txt"
PROFILES = builtin_profiles()

# -------------------------------------------------------------- test-only: lspci -nn -> host-root PCI tree

_LSPCI_NN = re.compile(
    r"^(?:(?P<dom>[0-9a-fA-F]{4}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7]) "
    r"[^\[\]]*\[(?P<cls>[0-9a-fA-F]{4})\]: .*\[(?P<ven>[0-9a-fA-F]{4}):(?P<did>[0-9a-fA-F]{4})\]")


def parse_lspci_nn(text: str) -> list[PciDevice]:
    """Devices of `lspci -nn` lines; the class gets prog-if 00, which -nn does not print."""
    out = []
    for line in text.splitlines():
        m = _LSPCI_NN.match(line)
        if m:
            bus_id = f"{(m['dom'] or '0000')}:{m['bus']}:{m['dev']}.{m['fn']}".lower()
            out.append(PciDevice(bus_id, f"0x{m['ven'].lower()}", f"0x{m['did'].lower()}",
                                 f"0x{m['cls'].lower()}00"))
    return out


def write_pci_tree(host: Path, devices: list[PciDevice]) -> None:
    for d in devices:
        base = host / "sys/bus/pci/devices" / d.bus_id
        base.mkdir(parents=True, exist_ok=True)
        for name, value in (("vendor", d.vendor), ("device", d.device), ("class", d.pci_class)):
            (base / name).write_text(value + "\n")


def nvml_for(devices: list[PciDevice], name: str, device_id: int) -> NvmlNodeState:
    return NvmlNodeState(gpus=[GpuState(index=i, name=name, pci_bus_id=f"0000{d.bus_id}".upper(),
                                        pci_device_id=device_id)
                               for i, d in enumerate(sorted(devices, key=lambda d: d.bus_id))])


# -------------------------------------------------------------- helpers


def run_presence(host: Path, profile: Profile | None = None, nvml_timeout: float = 5.0) -> list[Finding]:
    hw = simulated_hardware(host, nvml_timeout=nvml_timeout)
    hw.nvml.init()
    try:
        inv = collect(hw.nvml, hw.fs)
        prof = profile or select_profile(PROFILES, inv.gpu_names, "auto")
        ctx = CheckContext(hw=hw, inventory=inv, profile=prof, options=None, state={},
                           kernel_log=KernelLog(), clock=lambda: 1_800_000_000.0)
        return GpuPresenceCheck().run(ctx)
    finally:
        hw.nvml.shutdown()


def _by(findings: list[Finding]) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for f in findings:
        assert f.component not in out, findings
        out[f.component] = f
    return out


def _sev(f: Finding) -> tuple[Severity, Action]:
    return f.severity, f.action


# -------------------------------------------------------------- simulated node


def test_sim_healthy_node_is_one_ok(sim: Any) -> None:
    findings = sim("name: ok\nsku: h100-sxm\n").run(GpuPresenceCheck, t=1)
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.OK)]
    assert (findings[0].evidence["nvml_gpus"], findings[0].evidence["bus_gpus"],
            findings[0].evidence["profile_gpus"]) == (8, 8, 8)


def test_sim_gpu_missing_from_nvml_fails_on_its_pci_address(sim: Any) -> None:
    h = sim("name: missing\nsku: h100-sxm\nfaults:\n  - {at_s: 10, kind: gpu_missing, gpu: 3}\n")
    assert [f.severity for f in h.run(GpuPresenceCheck, t=5)] == [Severity.OK]
    by = _by(h.run(GpuPresenceCheck, t=11))
    assert set(by) == {"pci/0000:5d:00.0", "node"}
    assert _sev(by["pci/0000:5d:00.0"]) == (Severity.FAIL, Action.REBOOT_NODE)
    assert by["pci/0000:5d:00.0"].evidence["device"] == "0x2330"
    # still on the bus, so the driver can take it again: reboot, not hardware inspection
    assert _sev(by["node"]) == (Severity.FAIL, Action.REBOOT_NODE)
    assert (by["node"].evidence["nvml_gpus"], by["node"].evidence["bus_gpus"]) == (7, 8)


def test_sim_xid79_lost_gpu_fails_reboot_on_that_gpu(sim: Any) -> None:
    h = sim("name: lost\nsku: h100-sxm\nfaults:\n  - {at_s: 30, kind: xid, gpu: 3, code: 79}\n")
    by = _by(h.run(GpuPresenceCheck, t=31))
    assert set(by) == {"gpu/3", "node"}  # the lost GPU's bus address is accounted for: no pci finding
    assert _sev(by["gpu/3"]) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "GPU_IS_LOST" in by["gpu/3"].message
    assert by["node"].evidence["lost"] == [3]


def test_sim_fewer_gpus_than_the_profile(sim: Any) -> None:
    # ib_devices: 7 because the simulator lays out one NIC per GPU and fails on an 8th NIC with 7 GPUs
    by = _by(sim("name: seven\nsku: h100-sxm\ngpus: 7\nib_devices: 7\n").run(GpuPresenceCheck, t=1))
    assert set(by) == {"node"}
    # the eighth GPU is not even on the PCI bus: no driver reload or warm reboot brings it back
    assert _sev(by["node"]) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "only 7 are on the PCI bus" in by["node"].message


# -------------------------------------------------------------- real capture: DGX H200 lspci -nn


def test_lspci_capture_parses_to_eight_h200() -> None:
    devices = parse_lspci_nn(LSPCI_H200.read_text(encoding="utf-8"))
    assert len(devices) == 8
    assert {(d.vendor, d.device, d.pci_class, d.is_gpu) for d in devices} == {("0x10de", "0x2335", "0x030200",
                                                                               True)}
    assert devices[0].bus_id == "0000:1b:00.0" and devices[-1].bus_id == "0000:df:00.0"


def _h200_node(nvml_state: Path, tmp_path: Path, extra: list[PciDevice] = (),  # type: ignore[assignment]
               drop: int | None = None) -> Path:
    devices = parse_lspci_nn(LSPCI_H200.read_text(encoding="utf-8"))
    host = tmp_path / "host"
    write_pci_tree(host, [*devices, *extra])
    in_nvml = [d for i, d in enumerate(devices) if i != drop]
    write_state(nvml_for(in_nvml, "NVIDIA H200", 0x233510DE), nvml_state)
    return host


def test_h200_capture_counts_eight_on_the_bus(nvml_state: Path, tmp_path: Path) -> None:
    findings = run_presence(_h200_node(nvml_state, tmp_path))
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.OK)]
    ev = findings[0].evidence
    assert (ev["profile"], ev["bus_gpus"], ev["nvml_gpus"], ev["profile_gpus"]) == ("h200-sxm", 8, 8, 8)


def test_display_gpu_and_bmc_vga_are_not_counted(nvml_state: Path, tmp_path: Path) -> None:
    display = PciDevice("0000:03:00.0", "0x10de", "0x1ff2", "0x030000")  # an NVIDIA T400 for the console
    bmc = PciDevice("0000:02:00.0", "0x1a03", "0x2000", "0x030000")  # ASPEED AST2600 VGA
    findings = run_presence(_h200_node(nvml_state, tmp_path, extra=[display, bmc]), PROFILES["h200-sxm"])
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.OK)]
    assert findings[0].evidence["bus_gpus"] == 8
    assert findings[0].evidence["other_nvidia_gpus"] == ["0000:03:00.0 0x1ff2"]


def test_h200_gpu_on_the_bus_but_not_in_nvml(nvml_state: Path, tmp_path: Path) -> None:
    by = _by(run_presence(_h200_node(nvml_state, tmp_path, drop=5), PROFILES["h200-sxm"]))
    assert set(by) == {"pci/0000:c3:00.0", "node"}
    assert _sev(by["pci/0000:c3:00.0"]) == (Severity.FAIL, Action.REBOOT_NODE)
    assert _sev(by["node"]) == (Severity.FAIL, Action.REBOOT_NODE)


def test_no_pci_information_is_unknown_not_ok(nvml_state: Path, tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "sys").mkdir(parents=True)  # host root without /sys/bus/pci (not mounted)
    write_state(NvmlNodeState.hgx(8), nvml_state)
    findings = run_presence(host, PROFILES["h100-sxm"])
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.UNKNOWN)]
    assert "PCI bus not compared" in findings[0].message
    assert findings[0].evidence["bus_gpus"] is None


def test_no_profile_count_compares_nvml_with_the_bus(nvml_state: Path, tmp_path: Path) -> None:
    host = _h200_node(nvml_state, tmp_path)
    findings = run_presence(host, GENERIC)
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.OK)]
    assert findings[0].evidence["profile_gpus"] is None and "profile" not in findings[0].message.split(",")[0]
    by = _by(run_presence(_h200_node(nvml_state, tmp_path / "b", drop=0), GENERIC))
    assert set(by) == {"pci/0000:1b:00.0", "node"}
    assert _sev(by["node"]) == (Severity.FAIL, Action.REBOOT_NODE)


def test_more_gpus_than_the_profile_warns(nvml_state: Path, tmp_path: Path) -> None:
    gb200 = PROFILES["gb200"]  # 4 GPUs per tray; an 8-GPU node with it forced is the wrong profile
    findings = run_presence(_h200_node(nvml_state, tmp_path), Profile(**{**gb200.__dict__,
                                                                          "pci_device_ids": ["0x2335"]}))
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.WARN)]
    assert "wrong profile" in findings[0].message


def test_nvml_device_count_failure_is_not_ok(nvml_state: Path, tmp_path: Path) -> None:
    host = _h200_node(nvml_state, tmp_path)
    state = nvml_for(parse_lspci_nn(LSPCI_H200.read_text(encoding="utf-8")), "NVIDIA H200", 0x233510DE)
    state.calls.append(InjectedCall("nvmlDeviceGetCount_v2", error=999))
    write_state(state, nvml_state)
    hw = simulated_hardware(host)
    hw.nvml.init()
    try:
        ctx = CheckContext(hw=hw, inventory=collect(None, hw.fs), profile=PROFILES["h200-sxm"], options=None,
                           state={}, kernel_log=KernelLog())
        findings = GpuPresenceCheck().run(ctx)
    finally:
        hw.nvml.shutdown()
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.UNKNOWN)]
    assert findings[0].evidence["bus_gpus"] == 8


def test_hung_gpu_is_a_finding_and_others_continue(nvml_state: Path, tmp_path: Path) -> None:
    host = _h200_node(nvml_state, tmp_path)
    state = nvml_for(parse_lspci_nn(LSPCI_H200.read_text(encoding="utf-8")), "NVIDIA H200", 0x233510DE)
    state.gpus[2].calls.append(InjectedCall("nvmlDeviceGetUUID", hang_s=0.5))
    write_state(state, nvml_state)
    by = _by(run_presence(host, PROFILES["h200-sxm"], nvml_timeout=0.2))
    time.sleep(0.4)  # let the hung call return while the state file is still there
    assert _sev(by["gpu/2"]) == (Severity.FAIL, Action.REBOOT_NODE)  # NVML hang: reboot (check.py)
    assert by["gpu/2"].message == "hung after 0.2 s in nvmlDeviceGetUUID(gpu/2)"
    assert set(by) == {"gpu/2", "node"}  # its bus address is accounted for by the unreadable GPU


# -------------------------------------------------------------- pure comparisons on random views

_bus_ids = st.integers(0, 255).map(lambda b: f"0000:{b:02x}:00.0")
_devices = st.lists(st.tuples(_bus_ids, st.sampled_from(["0x2330", "0x2335", "0x1ff2"])), max_size=10,
                    unique_by=lambda t: t[0])


@given(_devices, st.lists(_bus_ids, max_size=10, unique=True), st.integers(0, 3), st.integers(0, 2),
       st.sampled_from([None, 4, 8]), st.booleans())
def test_comparisons_on_random_views(bus: list[tuple[str, str]], nvml_buses: list[str], lost: int,
                                     unreadable: int, count: int | None, bus_error: bool) -> None:
    profile = Profile(name="x", pci_device_ids=["0x2330"], gpu=GpuSpec(count=count))
    gpus = {i: GpuInfo(i, f"GPU-{i}", None, b, "n", "hopper", 0, i) for i, b in enumerate(sorted(nvml_buses))}
    n = len(gpus)
    nv = NvmlView(count=n + lost + unreadable, gpus=gpus)
    nv.lost = {n + i: GpuLost("GPU is lost", call="x") for i in range(lost)}
    nv.unreadable = {n + lost + i: HwFailure("bad", call="x") for i in range(unreadable)}
    view = BusView(error="no /sys" if bus_error else None)
    for b, dev in bus:
        d = PciDevice(b, "0x10de", dev, "0x030200")
        (view.gpus if dev == "0x2330" or b in nv.bus_ids else view.other_nvidia).append(d)
    check = GpuPresenceCheck()
    hw = Hardware(Path("/nonexistent"))
    ctx = CheckContext(hw=hw, inventory=collect(None, hw.fs), profile=profile, options=None, state={},
                       kernel_log=KernelLog())
    findings = [*check._bus_vs_nvml(nv, view), check._counts(ctx, nv, view)]
    assert all(is_component(f.component) for f in findings)
    node = findings[-1]
    pci_fails = [f for f in findings if f.component.startswith("pci/")]
    missing = {d.bus_id for d in view.gpus} - nv.bus_ids
    if not bus_error and len(missing) > lost + unreadable:
        assert len(pci_fails) == len(missing) and all(f.severity is Severity.FAIL for f in pci_fails)
    else:
        assert pci_fails == []
    if bus_error or (count is not None and nv.count != count) or len(view.gpus) != nv.count:
        assert node.severity is not Severity.OK
    if node.severity is Severity.OK:
        assert node.evidence["nvml_gpus"] == node.evidence["bus_gpus"]


@given(st.text())
def test_lspci_parser_survives_any_text(text: str) -> None:
    for d in parse_lspci_nn(text):
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", d.bus_id)
        assert re.fullmatch(r"0x[0-9a-f]{6}", d.pci_class)
