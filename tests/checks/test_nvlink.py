"""The nvlink check: real `nvidia-smi nvlink --status` captures served through the NVML injection
library, and simulated faults (link down, error-counter ramps, resets, reboots) on a simulated node.

Captures are in tests/data/nvidia-smi-q (provenance in SOURCES.md there).
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.check import CheckContext, KernelLog
from gpumon.errors import ConfigError
from gpumon.hw.inventory import collect
from gpumon.model import Action, Finding, Severity, is_component
from gpumon.profiles import Profile, builtin_profiles
from gpumon.schema import build, load_yaml
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvLinkErrorCounters, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.nvlink import (
    COUNTERS,
    NvlinkCheck,
    NvlinkConfig,
    Sample,
    classify,
    counter_delta,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-q"
PROFILES = builtin_profiles()
T0 = 1_800_000_000.0

# -------------------------------------------------------------- test-only capture -> NVML state converter

_HEADER = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$")
_LINK = re.compile(r"^\s*Link (\d{1,2}): (.*?)\s*$")
_SPEED = re.compile(r"^\d+(?:\.\d+)? GB/s$")
# NVML device ids and architecture codes of the SKUs the captures come from
_SKU = {"NVIDIA A100-SXM4-80GB": (0x20B210DE, 7), "NVIDIA GB200": (0x294110DE, 10)}


@dataclass
class CapturedGpu:
    index: int
    name: str
    uuid: str
    links: dict[int, bool] = field(default_factory=dict)
    # nvidia-smi: "Unable to retrieve NVLink information as all links are inactive"
    all_inactive: bool = False
    truncated: bool = False  # the paste was elided ("...") inside this GPU's block

    @property
    def complete(self) -> bool:
        return not self.truncated and sorted(self.links) == list(range(len(self.links)))


def parse_nvlink_status(text: str) -> list[CapturedGpu]:
    """`nvidia-smi nvlink --status` output: per GPU, link -> active (a speed) or not (<inactive>)."""
    gpus: list[CapturedGpu] = []
    for line in text.splitlines():
        if m := _HEADER.match(line):
            gpus.append(CapturedGpu(int(m[1]), m[2], m[3]))
        elif not gpus:
            continue
        elif m := _LINK.match(line):
            value = m[2]
            if _SPEED.match(value):
                gpus[-1].links[int(m[1])] = True
            elif value.lower() == "<inactive>":
                gpus[-1].links[int(m[1])] = False
            else:
                gpus[-1].truncated = True  # a link line we cannot read: do not guess
        elif "all links are inactive" in line:
            gpus[-1].all_inactive = True
        elif line.strip() == "...":
            gpus[-1].truncated = True
    return gpus


def to_node_state(captured: list[CapturedGpu], links_per_gpu: int) -> NvmlNodeState:
    """One GpuState per captured GPU, renumbered 0.. (NVML indices are dense) with the capture's UUIDs.

    "all links are inactive" becomes the SKU's link count, every link inactive: NVML answers
    nvmlDeviceGetNvLinkState with isActive = 0, which is what nvidia-smi summarises in that line.
    """
    gpus = []
    for i, c in enumerate(captured):
        assert c.complete, f"GPU {c.index} of the capture is incomplete"
        device_id, arch = _SKU[c.name]
        states = [0] * links_per_gpu if c.all_inactive else [int(c.links[k]) for k in range(len(c.links))]
        gpus.append(GpuState(index=i, name=c.name, uuid=c.uuid, pci_device_id=device_id, architecture=arch,
                             memory_temperature_c=None, nvlink_states=states))
    return NvmlNodeState(gpus=gpus)


def _capture(name: str) -> list[CapturedGpu]:
    return parse_nvlink_status((DATA / name).read_text(encoding="utf-8"))


# -------------------------------------------------------------- running the check on an NVML state file


def _host(tmp_path: Path, boot: str | None = None) -> Path:
    host = tmp_path / "host"
    (host / "sys").mkdir(parents=True, exist_ok=True)
    if boot is not None:
        path = host / "proc/sys/kernel/random/boot_id"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(boot + "\n")
    return host


def run_nvlink(host: Path, profile: Profile, *, state: dict[str, Any] | None = None, clock: float = T0,
               options: NvlinkConfig | None = None, nvml_timeout: float = 5.0) -> list[Finding]:
    hw = simulated_hardware(host, nvml_timeout=nvml_timeout)
    hw.nvml.init()
    try:
        ctx = CheckContext(hw=hw, inventory=collect(hw.nvml, hw.fs), profile=profile,
                           options=options or NvlinkConfig(), state=state if state is not None else {},
                           kernel_log=KernelLog(), clock=lambda: clock)
        return NvlinkCheck().run(ctx)
    finally:
        hw.nvml.shutdown()


def _bad(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in (Severity.WARN, Severity.FAIL)]


def _by(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out


def _one(findings: list[Finding], component: str) -> Finding:
    found = _by(findings)[component]
    assert len(found) == 1, found
    return found[0]


# -------------------------------------------------------------- real captures


def test_converter_reads_the_captures() -> None:
    a100 = _capture("nvidia-smi-nvlink-status_a100-sxm4-80gb_x8.txt")
    assert [g.index for g in a100] == list(range(8))
    assert all(g.complete and len(g.links) == 12 and all(g.links.values()) for g in a100)
    good = _capture("nvidia-smi-nvlink-status_a100_gpu7_good.txt")  # tab-indented
    assert [(g.index, len(g.links), g.complete) for g in good] == [(7, 12, True)]
    bad = _capture("nvidia-smi-nvlink-status_a100_all-links-inactive.txt")
    assert [(g.index, g.all_inactive, g.links) for g in bad] == [(6, True, {})]
    gb200 = _capture("issue_k8s-test-infra-371_nvidia-smi-nvlink-s_gb200_18links_PARTIAL.txt")
    assert [(g.index, len(g.links), g.complete) for g in gb200] == [(0, 18, True), (1, 2, False)]


def test_healthy_a100_capture_has_no_warning(nvml_state: Path, tmp_path: Path) -> None:
    write_state(to_node_state(_capture("nvidia-smi-nvlink-status_a100-sxm4-80gb_x8.txt"), 12), nvml_state)
    host, state = _host(tmp_path, "boot-a"), dict[str, Any]()
    for t in (T0, T0 + 60):  # baseline, then a rate over one minute
        findings = run_nvlink(host, PROFILES["a100-sxm-80gb"], state=state, clock=t)
        assert _bad(findings) == []
        assert sorted(f.component for f in findings) == [f"gpu/{i}" for i in range(8)]
        assert all(f.severity is Severity.OK and f.evidence["active"] == 12 for f in findings)
    assert _one(findings, "gpu/0").evidence["uuid"] == "GPU-5269b708-678a-b1a8-60f0-c90406537486"


def test_healthy_single_gpu_capture(nvml_state: Path, tmp_path: Path) -> None:
    write_state(to_node_state(_capture("nvidia-smi-nvlink-status_a100_gpu7_good.txt"), 12), nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["a100-sxm-80gb"])
    assert [(f.component, f.severity) for f in findings] == [("gpu/0", Severity.OK)]


def test_all_links_inactive_fails_every_gpu_of_the_capture(nvml_state: Path, tmp_path: Path) -> None:
    write_state(to_node_state(_capture("nvidia-smi-nvlink-status_a100_all-links-inactive.txt"), 12),
                nvml_state)
    findings = run_nvlink(_host(tmp_path, "boot-a"), PROFILES["a100-sxm-80gb"])
    summary = _one(findings, "gpu/0")
    assert (summary.severity, summary.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert summary.evidence["active"] == 0 and summary.evidence["inactive_links"] == list(range(12))
    links = [f for f in findings if f.component.startswith("nvlink/")]
    assert sorted(f.component for f in links) == sorted(f"nvlink/0/{k}" for k in range(12))
    assert {(f.severity, f.action) for f in links} == {(Severity.FAIL, Action.REBOOT_NODE)}


def test_inactive_gpu_spliced_into_the_healthy_node(nvml_state: Path, tmp_path: Path) -> None:
    node = _capture("nvidia-smi-nvlink-status_a100-sxm4-80gb_x8.txt")
    node[6] = _capture("nvidia-smi-nvlink-status_a100_all-links-inactive.txt")[0]  # the real GPU 6
    write_state(to_node_state(node, 12), nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["a100-sxm-80gb"])
    assert {f.component.split("/")[1] for f in _bad(findings)} == {"6"}
    assert _one(findings, "gpu/6").evidence["uuid"] == "GPU-9667d95e-6d22-0c22-1f57-c481f13e7c44"
    assert all(_one(findings, f"gpu/{i}").severity is Severity.OK for i in (0, 1, 2, 3, 4, 5, 7))


def test_gpu_whose_driver_reports_no_nvlink_among_gpus_that_have_theirs(nvml_state: Path,
                                                                       tmp_path: Path) -> None:
    node = to_node_state(_capture("nvidia-smi-nvlink-status_a100-sxm4-80gb_x8.txt"), 12)
    node.gpus[6].calls.append(InjectedCall("nvmlDeviceGetNvLinkState", error=3))  # NOT_SUPPORTED
    write_state(node, nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["a100-sxm-80gb"])
    gpu6 = _one(findings, "gpu/6")
    assert (gpu6.severity, gpu6.action, gpu6.evidence["nvml_links"]) == (Severity.FAIL, Action.REBOOT_NODE, 0)
    assert len(_bad(findings)) == 1


def test_nvlink_not_supported_on_every_gpu_of_an_nvlink_sku(nvml_state: Path, tmp_path: Path) -> None:
    # The driver answers NOT_SUPPORTED for NVLink on all GPUs of an SXM node: NVLink disabled, a VM
    # without NVLink, or a wrong profile. The rule (fewer active links than expected) fails;
    # no automatic remedy, because a reset or reboot does not change configuration.
    write_state(NvmlNodeState.hgx(8, calls=[InjectedCall("nvmlDeviceGetNvLinkState", error=3)]), nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["h100-sxm"])
    assert sorted(f.component for f in findings) == [f"gpu/{i}" for i in range(8)]
    assert {(f.severity, f.action) for f in findings} == {(Severity.FAIL, Action.NONE)}
    assert "disabled in the driver" in findings[0].message


def test_gb200_capture_first_gpu(nvml_state: Path, tmp_path: Path) -> None:
    complete = [g for g in _capture("issue_k8s-test-infra-371_nvidia-smi-nvlink-s_gb200_18links_PARTIAL.txt")
                if g.complete]
    write_state(to_node_state(complete, 18), nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["gb200"])
    assert [(f.component, f.severity, f.evidence["active"]) for f in findings] == [("gpu/0", Severity.OK, 18)]


# -------------------------------------------------------------- capability gate: PCIe GPUs


def test_pcie_gpus_without_nvlink_are_skipped(nvml_state: Path, tmp_path: Path) -> None:
    write_state(NvmlNodeState.hgx(4, name="NVIDIA H100 PCIe", pci_device_id=0x233110DE, nvlink_states=[]),
                nvml_state)
    state: dict[str, Any] = {}
    findings = run_nvlink(_host(tmp_path), PROFILES["h100-pcie"], state=state)
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.SKIPPED)]
    assert "expects none and NVML reports no links" in findings[0].message
    assert state == {}  # gated before any reading


def test_pcie_gpus_with_unused_links_are_not_nvlink_down(nvml_state: Path, tmp_path: Path) -> None:
    write_state(NvmlNodeState.hgx(4, name="NVIDIA H100 PCIe", pci_device_id=0x233110DE,
                                  nvlink_states=[0] * 18), nvml_state)
    findings = run_nvlink(_host(tmp_path), PROFILES["h100-pcie"])
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.SKIPPED)]
    assert "none active" in findings[0].message


def test_bridged_pcie_pair_is_watched_without_counting_links(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState.hgx(2, name="NVIDIA H100 PCIe", pci_device_id=0x233110DE,
                             nvlink_states=[1] * 6 + [0] * 12)
    write_state(node, nvml_state)
    host, state = _host(tmp_path), dict[str, Any]()
    assert _bad(run_nvlink(host, PROFILES["h100-pcie"], state=state)) == []
    node.gpus[1].nvlink_error_counters[2] = NvLinkErrorCounters(crc_flit=6000 * 60)
    write_state(node, nvml_state)
    bad = _bad(run_nvlink(host, PROFILES["h100-pcie"], state=state, clock=T0 + 60))
    assert [(f.component, f.severity) for f in bad] == [("nvlink/1/2", Severity.FAIL)]


# -------------------------------------------------------------- error counters through the real stack


def _counters(node: NvmlNodeState, gpu: int, link: int, **values: int) -> None:
    node.gpus[gpu].nvlink_error_counters[link] = NvLinkErrorCounters(**values)


def test_counter_rates_reset_and_hang(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState.hgx(2)
    _counters(node, 1, 7, replay=500, crc_flit=500)  # history before gpumon started: not a rate
    write_state(node, nvml_state)
    host, state = _host(tmp_path, "boot-a"), dict[str, Any]()
    profile = PROFILES["h100-sxm"]
    assert _bad(run_nvlink(host, profile, state=state, clock=T0)) == []
    _counters(node, 1, 7, replay=530, crc_flit=530)  # +30 in a minute: 0.5/s
    write_state(node, nvml_state)
    warn = _one(run_nvlink(host, profile, state=state, clock=T0 + 60), "nvlink/1/7")
    assert (warn.severity, warn.action) == (Severity.WARN, Action.NONE)
    assert warn.evidence["breaches"]["replay"]["rate_per_s"] == pytest.approx(0.5)
    # GPU reset: the counters restart from 0. A reset is no negative rate, and clears the alarm.
    _counters(node, 1, 7, replay=3)
    write_state(node, nvml_state)
    assert _bad(run_nvlink(host, profile, state=state, clock=T0 + 120)) == []
    _counters(node, 1, 7, replay=3 + 60 * 150)  # 150/s: above the 100/s fail rate
    write_state(node, nvml_state)
    fail = _one(run_nvlink(host, profile, state=state, clock=T0 + 180), "nvlink/1/7")
    assert (fail.severity, fail.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert fail.evidence["breaches"]["replay"]["rate_per_s"] == pytest.approx(150.0)
    # a hung counter read is a finding for that GPU; the other GPU carries on
    node.gpus[0].calls.append(InjectedCall("nvmlDeviceGetNvLinkErrorCounter", hang_s=0.5))
    write_state(node, nvml_state)
    hung = run_nvlink(host, profile, state=state, clock=T0 + 240, nvml_timeout=0.2)
    time.sleep(0.4)  # let the hung call return while the state file is still there
    gpu0 = [f for f in hung if f.component == "gpu/0" and f.severity is Severity.FAIL]
    # a GPU whose NVML calls hang is a driver that no longer answers for it: reboot (check.py's sources)
    assert gpu0 and gpu0[0].action is Action.REBOOT_NODE and "hung" in gpu0[0].message
    assert _one(hung, "gpu/1").severity is Severity.OK


def test_repeat_across_reboots_escalates_to_inspect_hardware(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState.hgx(1)
    node.gpus[0].nvlink_states[9] = 0
    write_state(node, nvml_state)
    state: dict[str, Any] = {}
    first = run_nvlink(_host(tmp_path / "a", "boot-a"), PROFILES["h100-sxm"], state=state)
    assert _one(first, "nvlink/0/9").action is Action.REBOOT_NODE
    again = run_nvlink(_host(tmp_path / "b", "boot-b"), PROFILES["h100-sxm"], state=state, clock=T0 + 600)
    link = _one(again, "nvlink/0/9")
    assert (link.action, link.evidence["repeated_after_reboot"]) == (Action.INSPECT_HARDWARE, True)
    assert _one(again, "gpu/0").action is Action.INSPECT_HARDWARE
    # a week later the old boot is forgotten: the next fault starts at reboot again
    later = run_nvlink(_host(tmp_path / "c", "boot-c"), PROFILES["h100-sxm"], state=state,
                       clock=T0 + 600 + 8 * 86400)
    assert _one(later, "nvlink/0/9").action is Action.REBOOT_NODE


def test_error_counters_not_supported_are_skipped_not_ok(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState.hgx(2)
    node.gpus[1].calls.append(InjectedCall("nvmlDeviceGetNvLinkErrorCounter", error=3))
    write_state(node, nvml_state)
    by = _by(run_nvlink(_host(tmp_path), PROFILES["h100-sxm"]))
    assert [f.severity for f in by["gpu/1"]] == [Severity.OK, Severity.SKIPPED]
    assert "not supported" in by["gpu/1"][1].message
    assert [f.severity for f in by["gpu/0"]] == [Severity.OK]


# -------------------------------------------------------------- simulated node


def _scenario(*faults: str, name: str = "nvlink", sku: str = "h100-sxm") -> str:
    lines = "".join(f"  - {f}\n" for f in faults)
    return f"name: {name}\nsku: {sku}\nfaults:\n{lines}" if faults else f"name: {name}\nsku: {sku}\n"


def test_sim_healthy_node(sim: Any) -> None:
    h = sim(_scenario())
    for t in (1, 61):  # baseline, then rates
        findings = h.run(NvlinkCheck, t=t)
        assert _bad(findings) == [] and len(findings) == 8


def test_sim_pcie_node_is_skipped(sim: Any) -> None:
    h = sim(_scenario(sku="h100-pcie"))
    # the simulator names every GPU it has no name for "NVIDIA H100 80GB HBM3", so auto-selection
    # would pick h100-sxm: force the profile, as `--profile h100-pcie` does
    ctx = h.context(NvlinkCheck, t=1)
    ctx.profile = PROFILES["h100-pcie"]
    assert [(f.component, f.severity) for f in NvlinkCheck().run(ctx)] == [("node", Severity.SKIPPED)]


def test_sim_nvlink_down_names_the_link(sim: Any) -> None:
    h = sim(_scenario("{at_s: 10, kind: nvlink_down, gpu: 2, link: 5, duration_s: 20}"))
    assert _bad(h.run(NvlinkCheck, t=5)) == []
    during = h.run(NvlinkCheck, t=11)
    assert sorted(f.component for f in _bad(during)) == ["gpu/2", "nvlink/2/5"]
    link = _one(during, "nvlink/2/5")
    assert (link.severity, link.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "NVLink 5 of GPU 2 is inactive" in link.message
    assert _one(during, "gpu/2").evidence["active"] == 17
    assert _bad(h.run(NvlinkCheck, t=31)) == []  # the link came back


def test_sim_replay_ramp_warns(sim: Any) -> None:
    h = sim(_scenario("{at_s: 10, kind: nvlink_errors, gpu: 1, link: 4, counter: replay, per_s: 5}"))
    assert _bad(h.run(NvlinkCheck, t=5)) == []
    bad = _bad(h.run(NvlinkCheck, t=65))
    assert [(f.component, f.severity, f.action) for f in bad] == [("nvlink/1/4", Severity.WARN, Action.NONE)]
    assert bad[0].evidence["breaches"]["replay"]["increase"] == 275
    assert "replay +275 in 60.0 s" in bad[0].message


def test_sim_crc_ramps(sim: Any) -> None:
    h = sim(_scenario("{at_s: 10, kind: nvlink_errors, gpu: 3, link: 0, counter: crc_flit, per_s: 500}",
                      "{at_s: 10, kind: nvlink_errors, gpu: 5, link: 17, counter: crc_data, per_s: 2}"))
    h.run(NvlinkCheck, t=5)
    bad = {f.component: f for f in _bad(h.run(NvlinkCheck, t=65))}
    assert set(bad) == {"nvlink/3/0", "nvlink/5/17"}
    assert (bad["nvlink/3/0"].severity, bad["nvlink/3/0"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert bad["nvlink/3/0"].evidence["breaches"]["crc_flit"]["rate_per_s"] == pytest.approx(27500 / 60)
    assert (bad["nvlink/5/17"].severity, bad["nvlink/5/17"].action) == (Severity.WARN, Action.NONE)


def test_sim_one_recovery_fails_and_is_held(sim: Any) -> None:
    # A recovery is a link retrain: DCGM's health watch fails on any. It is seen in the run after it
    # happened and stays reported for hold_s (1 h), so a one-shot `gpumon check` still sees it.
    h = sim(_scenario("{at_s: 10, kind: nvlink_errors, gpu: 0, link: 3, counter: recovery, count: 1}"))
    h.run(NvlinkCheck, t=5)
    first = _one(h.run(NvlinkCheck, t=65), "nvlink/0/3")
    assert (first.severity, first.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "link lost lock and retrained" in first.message
    assert _one(h.run(NvlinkCheck, t=65 + 3600), "nvlink/0/3").severity is Severity.FAIL
    assert _bad(h.run(NvlinkCheck, t=65 + 3601)) == []


def test_sim_lost_gpu_and_the_others_continue(sim: Any) -> None:
    h = sim(_scenario("{at_s: 10, kind: nvml_error, gpu: 4, function: nvmlDeviceGetNvLinkState, "
                      "error: gpu_is_lost}"))
    findings = h.run(NvlinkCheck, t=11)
    gpu4 = _one(findings, "gpu/4")
    assert (gpu4.severity, gpu4.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert [f.component for f in _bad(findings)] == ["gpu/4"]
    assert sum(f.severity is Severity.OK for f in findings) == 7


def test_sim_reboot_with_the_link_still_down_escalates(sim: Any) -> None:
    text = _scenario("{at_s: 10, kind: nvlink_down, gpu: 6, link: 11}")
    before = sim(text)
    assert _one(before.run(NvlinkCheck, t=11), "nvlink/6/11").action is Action.REBOOT_NODE
    after = sim(text)  # same node (same GPU UUIDs), new boot id: the reboot did not fix the link
    after.states["nvlink"] = copy.deepcopy(before.states["nvlink"])
    link = _one(after.run(NvlinkCheck, t=11), "nvlink/6/11")
    assert (link.severity, link.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)


def test_sim_counters_reset_within_the_boot_give_no_negative_rate(sim: Any) -> None:
    ramp = "{at_s: %d, kind: nvlink_errors, gpu: 1, link: 0, counter: replay, per_s: 10}"
    before = sim(_scenario(ramp % 0, name="reset"))
    before.run(NvlinkCheck, t=100)
    assert _one(before.run(NvlinkCheck, t=160), "nvlink/1/0").severity is Severity.WARN
    # driver reload at ~t=150 in the same boot: the counters start again from 0
    after = sim(_scenario(ramp % 150, name="reset"))
    after.node.boot_id = before.node.boot_id
    after.states["nvlink"] = copy.deepcopy(before.states["nvlink"])
    reset = after.run(NvlinkCheck, t=220)  # replay 700 now, 1600 at the previous sample
    assert _bad(reset) == []
    assert "nvlink/1/0" not in _by(reset)
    again = _one(after.run(NvlinkCheck, t=280), "nvlink/1/0")
    assert again.severity is Severity.WARN
    assert again.evidence["breaches"]["replay"]["rate_per_s"] == pytest.approx(10.0)


# -------------------------------------------------------------- config and bad input


def test_config_rejects_warn_above_fail() -> None:
    with pytest.raises(ValueError, match="replay_warn_per_s"):
        NvlinkConfig(replay_warn_per_s=5, replay_fail_per_s=1)
    with pytest.raises(ValueError, match="numbers"):
        NvlinkConfig(crc_flit_fail_per_s=float("nan"))
    assert NvlinkConfig(crc_flit_fail_per_s=float("inf")).fail_per_s("crc_flit") == float("inf")


def test_classify_thresholds() -> None:
    p = NvlinkConfig()
    assert classify("replay", 0, 0.0, p) is None
    assert classify("replay", 1, 1 / 60, p) is Severity.WARN
    assert classify("crc_data", 6000, 100.0, p) is Severity.FAIL
    assert classify("recovery", 1, 1 / 3600, p) is Severity.FAIL
    quiet = NvlinkConfig(crc_flit_warn_per_s=1.0)
    assert classify("crc_flit", 30, 0.5, quiet) is None


_counts = st.fixed_dictionaries({c: st.integers(0, 2**64 - 1) for c in COUNTERS})


@given(st.lists(st.tuples(st.floats(-1e9, 1e10, allow_nan=False), _counts), min_size=1, max_size=20))
def test_counter_delta_is_never_negative(samples: list[tuple[float, dict[str, int]]]) -> None:
    prev: Sample | None = None
    for t, values in samples:
        cur = Sample(t, values)
        delta = counter_delta(prev, cur)
        if delta is not None:
            assert delta.dt > 0
            went_back = any(values[c] < prev.values[c] for c in COUNTERS)  # type: ignore[union-attr]
            assert delta.reset is went_back
            assert all(v >= 0 for v in delta.increase.values())
            assert all(r >= 0 for r in delta.rate_per_s.values())
        prev = cur


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4),
                     max_leaves=20)


@given(_json)
def test_sample_from_garbage(data: Any) -> None:
    sample = Sample.from_json(data)
    if sample is not None:
        assert set(sample.values) == set(COUNTERS) and all(v >= 0 for v in sample.values.values())


@given(st.text())
def test_capture_parser_survives_any_text(text: str) -> None:
    for g in parse_nvlink_status(text):
        assert g.uuid.startswith("GPU-") and all(0 <= k < 100 for k in g.links)


_state_garbage = st.dictionaries(
    st.sampled_from(["version", "boot_id", "samples", "breaches", "faults", "x"]),
    st.one_of(_json, st.dictionaries(st.sampled_from(["GPU-x", "0", "1"]), _json, max_size=3)),
    max_size=6).map(lambda d: {**d, "version": 1} if "version" in d else d)


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_state_garbage)
def test_garbage_state_never_crashes(nvml_state: Path, tmp_path: Path, garbage: dict[str, Any]) -> None:
    node = NvmlNodeState.hgx(2, nvlink_states=[1] * 4)
    node.gpus[1].nvlink_states[3] = 0
    write_state(node, nvml_state)
    state = copy.deepcopy(garbage)
    findings = run_nvlink(_host(tmp_path, "boot-a"), PROFILES["a100-sxm-80gb"], state=state)
    assert all(is_component(f.component) for f in findings)
    assert _one(findings, "gpu/1").severity is Severity.FAIL  # 3 of 12 links: fails whatever the state
    run_nvlink(_host(tmp_path, "boot-a"), PROFILES["a100-sxm-80gb"], state=state, clock=T0 + 60)


def test_config_from_yaml_through_the_schema() -> None:
    data, src = load_yaml("crc_flit_fail_per_s: .inf\nreplay_warn_per_s: 2\nhold_s: 600\n", "site.yaml")
    cfg = build(NvlinkConfig, data, src)
    assert (cfg.fail_per_s("crc_flit"), cfg.warn_per_s("replay"), cfg.hold_s) == (float("inf"), 2.0, 600.0)
    data, src = load_yaml("recovery_warn_per_s: 5\n", "site.yaml")
    with pytest.raises(ConfigError, match="recovery_warn_per_s"):
        build(NvlinkConfig, data, src)
    data, src = load_yaml("crc_data_fail_per_s: -1\n", "site.yaml")
    with pytest.raises(ConfigError, match=">= 0"):
        build(NvlinkConfig, data, src)
