"""The nvswitch check: real SXid captures and fabric manager logs, NVML fabric state, simulated faults.

Real inputs: tests/data/kmsg-xid and tests/data/fabricmanager (provenance in their SOURCES.md).
NVML is the real nvidia-ml-py over the injection library (``nvml_state`` fixture); the simulated
node runs the whole stack (``sim`` fixture).
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.errors import ConfigError
from gpumon.hw import Hardware
from gpumon.hw.fabricmanager import DEFAULT_LOG_PATH
from gpumon.hw.inventory import Inventory, PciDevice, collect
from gpumon.hw.kmsg_record import KernelRecord
from gpumon.hw.nvml import GpuInfo
from gpumon.hw.nvrm import SXidEvent, parse_file
from gpumon.model import Action, Finding, Severity
from gpumon.profiles import GENERIC
from gpumon.schema import Source, build
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.nvswitch import NvswitchCheck, NvswitchConfig
from gpumon_checks.nvswitch.catalog import SXID_CATALOG, lookup

TESTS = Path(__file__).resolve().parents[1]
KMSG = TESTS / "data" / "kmsg-xid"
FM = TESTS / "data" / "fabricmanager"
DEC = FM / "fabricmanager_inband-multicast-team_dec2024.log"
FEB = FM / "fabricmanager_inband-multicast-team_feb2025.log"
SXID20034 = "dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log"
SXID12028 = "issue_gpud-338_dmesg-decode-iso_sxid12028-data.log"
HEALTHY_BOOT = "dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log"
HGX_SWITCHES = ("0000:83:00.0", "0000:84:00.0", "0000:85:00.0", "0000:86:00.0")


def _switches(buses: tuple[str, ...] = HGX_SWITCHES) -> list[PciDevice]:
    return [PciDevice(b, "0x10de", "0x22a3", "0x068000") for b in buses]


def _ctx(root: Path, *, events: list[Any] = (), inventory: Inventory | None = None,  # type: ignore[assignment]
         state: dict[str, Any] | None = None, options: NvswitchConfig | None = None, now: float = 1.8e9,
         boot_time: float | None = None, hw: Hardware | None = None, available: bool = True) -> CheckContext:
    inv = inventory if inventory is not None else Inventory(pci_devices=_switches())
    log = KernelLog(events=events, source="test", boot_time=boot_time, available=available,
                    error=None if available else "Permission denied")
    return CheckContext(hw=hw or Hardware(root), inventory=inv, profile=GENERIC,
                        options=options or NvswitchConfig(), state=state if state is not None else {},
                        kernel_log=log, clock=lambda: now)


def _run(ctx: CheckContext) -> list[Finding]:
    findings = run_on_json(NvswitchCheck(), ctx)
    json.dumps(ctx.state)  # the state must stay JSON-serializable
    return findings


def _readings(findings: list[Finding]) -> list[Finding]:
    """Each reading's own finding: the check folds them into one per component (and code on a
    switch), each reading's verdict kept under its name in the evidence."""
    out = []
    for f in findings:
        parts = [v for v in f.evidence.values() if isinstance(v, dict) and "severity" in v and "reading" in v]
        if not parts:
            out.append(f)
        for p in parts:
            ev = {k: v for k, v in p.items() if k not in ("severity", "action", "message")}
            out.append(Finding(f.check, f.component, Severity(p["severity"]), p["message"],
                               Action(p["action"]), ev))
    return out


def _by(findings: list[Finding], reading: str) -> dict[str, Finding]:
    mine = [f for f in _readings(findings) if f.evidence.get("reading") == reading]
    out = {f.component: f for f in mine}
    assert len(out) == len(mine)
    return out


def _bad(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in (Severity.WARN, Severity.FAIL, Severity.UNKNOWN)]


def _fm_root(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / DEFAULT_LOG_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return tmp_path


def _btime(root: Path, epoch: float) -> None:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/stat").write_text(f"cpu  1 0 1 100 0 0 0 0 0 0\nbtime {int(epoch)}\n")


def _boot_id(root: Path, boot: str) -> None:
    path = root / "proc/sys/kernel/random/boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot + "\n")


# --------------------------------------------------------------------------- SXid, real captures


def test_sxid20034_fatal_lines_are_grouped_per_switch(tmp_path: Path) -> None:
    events = parse_file(KMSG / SXID20034)
    inv = Inventory(pci_devices=_switches(("0000:05:00.0", "0000:06:00.0", "0000:07:00.0")))
    found = _by(_run(_ctx(tmp_path, events=events, inventory=inv, boot_time=1.7e9, now=1.7e9 + 6781800)),
                "sxid")
    assert set(found) == {"nvswitch/0", "nvswitch/1", "nvswitch/2"}  # the Xid 79 is the xid check's
    for f in found.values():
        assert (f.severity, f.action, f.evidence["code"]) == (Severity.FAIL, Action.REBOOT_NODE, 20034)
        assert f.evidence["name"] == "NVSWITCH_ERR_HW_DLPL_LTSSM_FAULT_UP"
        assert f.evidence["nvidia_action"] == "RESET_GPU"
    counts = {c: (f.evidence["events"], f.evidence["lines"], f.evidence["fatal_events"],
                  f.evidence["unsaid_events"], f.evidence["links"], f.evidence["class_from"])
              for c, f in found.items()}
    assert counts == {
        # Link 63 + its Data line, Link 62 + its Severity line (engine 62)
        "nvswitch/0": (2, 4, 2, 0, [62, 63], "line"),
        "nvswitch/1": (1, 1, 1, 0, [48], "line"),
        # a Severity line for engine 60 whose Fatal line is not in the capture, then Link 37 + Severity 37
        "nvswitch/2": (2, 3, 1, 1, [37, 60], "line+catalog"),
    }
    assert found["nvswitch/0"].evidence["pci_bus_id"] == "0000:05:00.0"
    assert "2 events (2 fatal), links 62, 63" in found["nvswitch/0"].message


def test_sxid12028_data_line_alone_takes_the_catalog_class(tmp_path: Path) -> None:
    logged = datetime(2025, 1, 25, 10, 34, 54, tzinfo=timezone.utc).timestamp()
    [f] = _by(_run(_ctx(tmp_path, events=parse_file(KMSG / SXID12028), now=logged + 60)), "sxid").values()
    assert f.component == "nvswitch/1"
    assert (f.severity, f.action) == (Severity.WARN, Action.RESTART_APP)
    assert (f.evidence["unsaid_events"], f.evidence["class_from"], f.evidence["catalog_class"]) == \
        (1, "catalog", "non-fatal")
    assert f.evidence["catalog_class_source"] == "FMG" and f.evidence["pci_bus_id"] == "0000:84:00.0"


def test_healthy_8gpu_nvswitch_boot_is_all_ok(tmp_path: Path, nvml_state: Path) -> None:
    events = parse_file(KMSG / HEALTHY_BOOT)
    hw = simulated_hardware(tmp_path)
    hw.nvml.init()
    inv = collect(hw.nvml, hw.fs)
    inv.pci_devices = _switches()
    findings = _run(_ctx(tmp_path, events=events, inventory=inv, hw=hw))
    assert _bad(findings) == []
    assert len(_by(findings, "fabric_state")) == 8
    assert _by(findings, "sxid")["node"].severity is Severity.OK
    # no fabric manager log in this host root: said so, not hidden
    assert _by(findings, "fm_log")["node"].severity is Severity.SKIPPED


def test_line_word_beats_the_catalog_both_ways(tmp_path: Path) -> None:
    def line(text: str, switch: int = 3) -> SXidEvent:
        return parse_sxid(f"nvidia-nvswitch{switch}: SXid (PCI:0000:86:00.0): {text}")

    # NVS calls 19084 FATAL, FMG lists it as non-fatal but asks for a full reset: fail either way
    # (the line is a real one, from LHRS-UM-FERI/MENTHOS-dataset-rootcause)
    heartbeat = line("19084, Non-fatal, Link 29 AN1 Heartbeat Timeout Error (First)")
    found = _by(_run(_ctx(tmp_path, events=[heartbeat])), "sxid")
    assert (found["nvswitch/3"].severity, found["nvswitch/3"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    # 20035 is non-fatal in the catalog; a line that says Fatal is fatal
    found = _by(_run(_ctx(tmp_path, events=[line("20035, Fatal, Link 07 LTSSM Fault Down")])), "sxid")
    assert found["nvswitch/3"].severity is Severity.FAIL
    # 12028 said Non-fatal: the job died, the fabric did not
    found = _by(_run(_ctx(tmp_path, events=[line("12028, Non-fatal, Link 32 egress non-posted PRIV error "
                                                  "(First)")])), "sxid")
    assert (found["nvswitch/3"].severity, found["nvswitch/3"].action) == (Severity.WARN, Action.RESTART_APP)


def test_unknown_code_without_a_word_warns_with_a_word_follows_it(tmp_path: Path) -> None:
    assert lookup(31999) is None
    ev = [parse_sxid("nvidia-nvswitch0: SXid (PCI:0000:83:00.0): 31999, Data {0x1}")]
    f = _by(_run(_ctx(tmp_path, events=ev)), "sxid")["nvswitch/0"]
    assert (f.severity, f.action, f.evidence["class_from"]) == (Severity.WARN, Action.NONE, "unknown")
    ev = [parse_sxid("nvidia-nvswitch0: SXid (PCI:0000:83:00.0): 31999, Fatal, Link 02 new thing")]
    assert _by(_run(_ctx(tmp_path, events=ev)), "sxid")["nvswitch/0"].severity is Severity.FAIL


def test_lines_of_one_event_arriving_in_separate_runs_stay_one_event(tmp_path: Path) -> None:
    events = parse_file(KMSG / SXID20034)
    state: dict[str, Any] = {}
    for e in events:  # the daemon runs the check as each line arrives
        findings = _run(_ctx(tmp_path, events=[e], state=state, boot_time=1.7e9, now=1.7e9 + 6781800))
    at_once = _by(_run(_ctx(tmp_path, events=events, boot_time=1.7e9, now=1.7e9 + 6781800)), "sxid")
    one_by_one = _by(findings, "sxid")
    assert {c: f.evidence for c, f in one_by_one.items()} == {c: f.evidence for c, f in at_once.items()}


def test_records_delivered_again_after_a_restart_are_not_counted_twice(tmp_path: Path) -> None:
    _boot_id(tmp_path, "boot-a")
    events = parse_file(KMSG / SXID20034)
    state: dict[str, Any] = {}
    t = 1.7e9 + 6781800
    first = _by(_run(_ctx(tmp_path, events=events, state=state, boot_time=1.7e9, now=t)), "sxid")
    restored = json.loads(json.dumps(state))  # the daemon saved it, restarted, re-read the whole ring
    again = _by(_run(_ctx(tmp_path, events=events, state=restored, boot_time=1.7e9, now=t + 60)), "sxid")
    assert {c: f.evidence for c, f in again.items()} == {c: f.evidence for c, f in first.items()}
    assert again["nvswitch/0"].evidence["lines"] == 4


def test_nonfatal_expires_fatal_stays_and_repeats_across_boots_escalate(tmp_path: Path) -> None:
    _boot_id(tmp_path, "boot-a")
    fatal = parse_sxid("nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 22003, Fatal, Link 05 Minion halt")
    nonfatal = parse_sxid("nvidia-nvswitch2: SXid (PCI:0000:85:00.0): 20012, Non-fatal, Link 09 CRC")
    t0 = 1.8e9
    state: dict[str, Any] = {}
    found = _by(_run(_ctx(tmp_path, events=[fatal, nonfatal], state=state, now=t0)), "sxid")
    assert (found["nvswitch/2"].severity, found["nvswitch/2"].action) == (Severity.WARN, Action.CHECK_CABLES)
    assert (found["nvswitch/1"].severity, found["nvswitch/1"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    later = _by(_run(_ctx(tmp_path, state=state, now=t0 + 7200)), "sxid")
    assert set(later) == {"nvswitch/1"}  # the non-fatal one went quiet an hour ago
    # the reboot NVIDIA asks for did not help: the same fatal SXid on the same switch again
    _boot_id(tmp_path, "boot-b")
    again = _by(_run(_ctx(tmp_path, events=[fatal], state=state, now=t0 + 86400)), "sxid")
    assert again["nvswitch/1"].action is Action.INSPECT_HARDWARE
    assert "earlier boot" in again["nvswitch/1"].message
    # a week later it is a new fault, not a repeat
    _boot_id(tmp_path, "boot-c")
    much_later = _by(_run(_ctx(tmp_path, events=[fatal], state=state, now=t0 + 86400 + 8 * 86400)), "sxid")
    assert much_later["nvswitch/1"].action is Action.REBOOT_NODE


def test_kernel_log_unreadable_is_unknown(tmp_path: Path) -> None:
    f = _by(_run(_ctx(tmp_path, available=False)), "sxid")["node"]
    assert f.severity is Severity.UNKNOWN and "Permission denied" in f.message


# --------------------------------------------------------------------------- fabric manager log


def test_dec2024_fm_log_gives_one_warning_per_switch(tmp_path: Path) -> None:
    root = _fm_root(tmp_path, DEC.read_bytes())
    found = _by(_run(_ctx(root)), "fm_log")
    expected = {
        "nvswitch/0": ("0000:83:00.0", {"34": 2}, [0]),
        "nvswitch/1": ("0000:84:00.0", {"35": 2, "42": 2}, [1]),
        "nvswitch/2": ("0000:85:00.0", {"0": 2, "1": 2, "19": 2, "33": 2}, [2]),
        "nvswitch/3": ("0000:86:00.0", {"33": 2, "36": 2}, [3]),
    }
    assert set(found) == set(expected)
    for component, (bus, ports, physical) in expected.items():
        f = found[component]
        assert (f.severity, f.action) == (Severity.WARN, Action.RESTART_APP)
        ev = f.evidence
        assert (ev["code"], ev["pci_bus_id"]) == (12028, bus)
        assert (ev["ports"], ev["physical_ids"]) == (ports, physical)
        assert (f.evidence["fatal_count"], f.evidence["nonfatal_count"]) == (0, sum(ports.values()))
        assert f.evidence["first_stamp"] == f.evidence["last_stamp"] == "Dec 19 2024 19:17:49"
    assert sum(f.evidence["count"] for f in found.values()) == 18


def test_feb2025_fm_log_has_its_one_error_and_is_clean_before_it(tmp_path: Path) -> None:
    found = _by(_run(_ctx(_fm_root(tmp_path / "a", FEB.read_bytes()))), "fm_log")
    assert set(found) == {"nvswitch/3"}
    f = found["nvswitch/3"]
    assert (f.severity, f.action, f.evidence["ports"], f.evidence["count"]) == \
        (Severity.WARN, Action.RESTART_APP, {"61": 1}, 1)
    healthy_part = FEB.read_bytes().split(b"\n[Feb 27 2025 15:10:02] [ERROR]")[0] + b"\n"
    findings = _run(_ctx(_fm_root(tmp_path / "b", healthy_part)))
    assert _bad(findings) == []
    ok = _by(findings, "fm_log")["node"]
    assert ok.severity is Severity.OK and ok.evidence["entries"] == 53


def test_fm_entries_from_before_this_boot_are_skipped(tmp_path: Path) -> None:
    root = _fm_root(tmp_path, DEC.read_bytes())
    _btime(root, datetime(2025, 1, 1, tzinfo=timezone.utc).timestamp())
    found = _by(_run(_ctx(root)), "fm_log")
    assert set(found) == {"node"} and found["node"].severity is Severity.OK
    assert found["node"].evidence["older_boot"] == 292


def test_fm_log_time_zone_decides_what_is_older_than_the_boot(tmp_path: Path) -> None:
    berlin = Path("/usr/share/zoneinfo/Europe/Berlin")
    if not berlin.exists():
        pytest.skip("no tzdata on this machine")
    root = _fm_root(tmp_path, DEC.read_bytes())
    # booted 18:30 UTC: the errors stamped 19:17:49 Berlin time (18:17:49 UTC) are from before
    _btime(root, datetime(2024, 12, 19, 18, 30, tzinfo=timezone.utc).timestamp())
    assert set(_by(_run(_ctx(root)), "fm_log")) != {"node"}  # read as UTC they are after the boot
    (root / "etc").mkdir()
    shutil.copyfile(berlin, root / "etc/localtime")
    found = _by(_run(_ctx(root, options=NvswitchConfig(fm_log_timezone="host"))), "fm_log")
    assert [f.severity for f in found.values()] == [Severity.OK]
    found = _by(_run(_ctx(root, options=NvswitchConfig(fm_log_timezone="Europe/Berlin"))), "fm_log")
    assert [f.severity for f in found.values()] == [Severity.OK]


def test_fm_log_followed_across_runs_and_learns_switch_numbers(tmp_path: Path) -> None:
    root = _fm_root(tmp_path, b"")
    state: dict[str, Any] = {}
    # the kernel numbered the switch at 0000:85:00.0 nvswitch7 (not its place on the bus)
    sx = parse_sxid("nvidia-nvswitch7: SXid (PCI:0000:85:00.0): 12028, Non-fatal, Link 03 egress PRIV")
    assert _by(_run(_ctx(root, events=[sx], state=state)), "fm_log")["node"].severity is Severity.OK
    with open(root / DEFAULT_LOG_PATH, "ab") as fh:
        fh.write(b"[Dec 19 2024 19:17:49] [ERROR] [tid 1374] detected NVSwitch fatal error 20034 on fid 0 "
                 b"on NVSwitch pci bus id 00000000:85:00.0 physical id 2 port 33\n"
                 b"[Dec 19 2024 19:17:50] [ERROR] [tid 1374] failed to find the GPU handle "
                 b"5410063385821516767 in the multicast team request setup 6130285411925746235.\n")
    found = _by(_run(_ctx(root, state=state)), "fm_log")
    assert (found["nvswitch/7"].severity, found["nvswitch/7"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert found["node"].severity is Severity.WARN and found["node"].evidence["count"] == 1
    # nothing new: the same findings, not counted twice
    again = _by(_run(_ctx(root, state=state)), "fm_log")
    assert again["nvswitch/7"].evidence["count"] == 1


def test_fm_log_missing_default_is_skipped_configured_is_unknown(tmp_path: Path) -> None:
    skipped = _by(_run(_ctx(tmp_path)), "fm_log")["node"]
    assert skipped.severity is Severity.SKIPPED and "fm_log_path" in skipped.message
    unknown = _by(_run(_ctx(tmp_path, options=NvswitchConfig(fm_log_path="var/log/fm/fabricmanager.log"))),
                  "fm_log")["node"]
    assert unknown.severity is Severity.UNKNOWN


def test_fm_log_unreadable_is_unknown(tmp_path: Path) -> None:
    (tmp_path / DEFAULT_LOG_PATH).mkdir(parents=True)  # not a file
    f = _by(_run(_ctx(tmp_path)), "fm_log")["node"]
    assert f.severity is Severity.UNKNOWN and f.evidence["call"] == f"read({DEFAULT_LOG_PATH})"


# --------------------------------------------------------------------------- NVML fabric state


def _fabric_ctx(tmp_path: Path, nvml_state: Path, node: NvmlNodeState, **kw: Any) -> CheckContext:
    write_state(node, nvml_state)
    hw = simulated_hardware(tmp_path)
    hw.nvml.init()
    inv = collect(hw.nvml, hw.fs)
    inv.pci_devices = _switches()
    return _ctx(tmp_path, inventory=inv, hw=hw, **kw)


def test_fabric_states(tmp_path: Path, nvml_state: Path) -> None:
    gpus = [GpuState(index=i) for i in range(6)]
    gpus[1].fabric_state = 1  # not started
    gpus[2].fabric_state = 2  # in progress
    gpus[3].fabric_status = 999  # completed, with an error
    gpus[4].fabric_health_mask = 1  # bandwidth degraded
    gpus[5].calls.append(InjectedCall("nvmlDeviceGetGpuFabricInfoV", error=15))
    gpus[0].fabric_clique_id = 7
    gpus[0].fabric_cluster_uuid = "6a4b1f0e-93c1-4c35-9d2f-3f6d0b5e7a11"
    _btime(tmp_path, 1.8e9 - 3600)
    found = _by(_run(_fabric_ctx(tmp_path, nvml_state, NvmlNodeState(gpus=gpus), now=1.8e9)), "fabric_state")
    assert found["gpu/0"].severity is Severity.OK
    assert (found["gpu/0"].evidence["clique_id"], found["gpu/0"].evidence["cluster_uuid"]) == \
        (7, "6a4b1f0e-93c1-4c35-9d2f-3f6d0b5e7a11")
    for i, name in ((1, "not started"), (2, "in progress")):
        f = found[f"gpu/{i}"]
        assert (f.severity, f.action, f.evidence["state_name"]) == (Severity.FAIL, Action.REBOOT_NODE, name)
    assert (found["gpu/3"].severity, found["gpu/3"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "UNKNOWN" in found["gpu/3"].message
    assert found["gpu/4"].severity is Severity.WARN
    assert found["gpu/4"].evidence["health"] == ["bandwidth degraded"]
    # GPU_IS_LOST from the fabric call: the one place conditions become findings
    lost = [f for f in _run(_fabric_ctx(tmp_path, nvml_state, NvmlNodeState(gpus=gpus), now=1.8e9))
            if f.component == "gpu/5"]
    assert [(f.severity, f.action) for f in lost] == [(Severity.FAIL, Action.REBOOT_NODE)]


def test_fabric_registration_gets_a_grace_period_after_boot(tmp_path: Path, nvml_state: Path) -> None:
    _btime(tmp_path, 1.8e9 - 120)
    node = NvmlNodeState(gpus=[GpuState(index=0, fabric_state=2)])
    f = _by(_run(_fabric_ctx(tmp_path, nvml_state, node, now=1.8e9)), "fabric_state")["gpu/0"]
    assert f.severity is Severity.UNKNOWN and f.evidence["uptime_s"] == 120.0


def test_fabric_not_supported_before_hopper(tmp_path: Path, nvml_state: Path) -> None:
    node = NvmlNodeState(gpus=[GpuState(index=i, architecture=7, name="NVIDIA A100-SXM4-80GB")
                               for i in range(8)])
    found = _by(_run(_fabric_ctx(tmp_path, nvml_state, node)), "fabric_state")
    assert set(found) == {"node"} and found["node"].severity is Severity.SKIPPED


def test_no_nvml_is_unknown_not_ok(tmp_path: Path) -> None:
    inv = Inventory(pci_devices=_switches(), nvml_error="NVML not found")
    f = _by(_run(_ctx(tmp_path, inventory=inv)), "fabric_state")["node"]
    assert f.severity is Severity.UNKNOWN and "NVML not found" in f.message


# --------------------------------------------------------------------------- gate, options


def _gpu(arch: str, links: int) -> GpuInfo:
    return GpuInfo(0, "GPU-0", None, "0000:19:00.0", "x", arch, links, 0)


def test_capability_gate() -> None:
    check = NvswitchCheck()
    assert check.supported(Inventory(pci_devices=_switches())) is None
    assert check.supported(Inventory(gpus=[_gpu("blackwell", 18)])) is None  # GB200: switches off-node
    assert check.supported(Inventory(gpus=[_gpu("hopper", 0)])) is not None  # H100 PCIe without NVLink
    reason = check.supported(Inventory(gpus=[_gpu("ampere", 12)]))  # A100 with NVLink but no switch
    assert reason is not None and "NVSwitch" in reason


def test_expected_switch_count(tmp_path: Path) -> None:
    three = Inventory(pci_devices=_switches(HGX_SWITCHES[:3]))
    four = NvswitchConfig(expected_nvswitches=4)
    f = _by(_run(_ctx(tmp_path, inventory=three, options=four)), "pci")["node"]
    assert (f.severity, f.action, f.evidence["found"]) == (Severity.FAIL, Action.INSPECT_HARDWARE, 3)
    f = _by(_run(_ctx(tmp_path, options=four)), "pci")["node"]
    assert f.severity is Severity.OK


def test_config_is_validated() -> None:
    where = ("checks", "nvswitch")
    with pytest.raises(ConfigError, match="fm_log_timezone"):
        build(NvswitchConfig, {"fm_log_timezone": "Mars/Olympus"}, Source("test.yaml"), where)
    with pytest.raises(ConfigError, match=">= 65536"):
        build(NvswitchConfig, {"fm_log_max_read_bytes": 10}, Source("test.yaml"), where)
    for name in ("event_gap_s", "recent_window_s", "repeat_window_s", "fabric_grace_s",
                 "fm_log_max_read_bytes", "fm_log_initial_tail_bytes"):
        meta = NvswitchConfig.__dataclass_fields__[name].metadata
        assert len(meta.get("source", "")) > 40, name


def _in_order(words: list[str], within: list[str]) -> bool:
    it = iter(within)
    return all(w in it for w in words)


def test_catalog_follows_the_research_note() -> None:
    """Every SXid row of tests/data/xid-catalog.md agrees with the catalog's NVS columns."""
    text = (TESTS / "data" / "xid-catalog.md").read_text(encoding="utf-8")
    section = text.split("Selected SXid codes", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| ([\d ./]+) \| ([^|]+) \| ([^|]+) \| (FATAL|NONFATAL)", section, re.M)
    assert len(rows) >= 14
    checked = 0
    for codes, names, actions, cls in rows:
        if ".." in codes:
            lo, hi = (int(x) for x in codes.split(".."))
            nums = list(range(lo, hi + 1))
        else:
            nums = [int(x) for x in codes.split("/")]
        name_parts = [n.strip().split(" ")[0] for n in names.split("/")]
        action_parts = [a.strip() for a in actions.split("/")]
        for i, code in enumerate(nums):
            info = SXID_CATALOG[code]
            assert info.nvs_fatal is (cls == "FATAL"), code
            assert info.nvidia_action == action_parts[min(i, len(action_parts) - 1)], code
            if len(name_parts) == len(nums):
                # the note shortens some names (24007 drops NVIDIA's doubled SOURCETRACK): its
                # words must appear in NVIDIA's name, in order
                assert _in_order(name_parts[i].strip("_").split("_"), info.name.split("_")), \
                    (code, info.name, name_parts[i])
            checked += 1
    assert checked >= 30
    # where NVIDIA's fabric manager guide classes a code, that class is used; else NVSentinel's
    assert not SXID_CATALOG[12028].fatal and SXID_CATALOG[12028].nvs_fatal
    assert SXID_CATALOG[20034].fatal and SXID_CATALOG[20001].fatal is False
    assert all(i.fatal == i.nvs_fatal for i in SXID_CATALOG.values() if i.fmg_table is None)


# --------------------------------------------------------------------------- simulated node

H100 = """
name: nvswitch-sim
sku: h100-sxm
faults:
{faults}
"""


def _sim_bad(findings: list[Finding]) -> list[tuple[str, str, str]]:
    return sorted((f.component, f.severity.value, f.action.value) for f in _bad(findings))


def test_sim_sxid_fabric_and_fm_log_faults(sim: Any) -> None:
    """One simulated H100 node, every fault kind this check reads (a run costs ~1.3 s: few runs)."""
    h = sim(H100.format(faults="""
  - {at_s: 5, kind: sxid, switch: 1, code: 20034, fatal: true, link: 12}
  - {at_s: 8, kind: sxid, switch: 2, code: 12028, fatal: false, link: 4}
  - {at_s: 5, kind: fabric, gpu: 3, state: 1}
  - {at_s: 5, kind: fabric, gpu: 6, state: 3, status: 999, duration_s: 10}
  - {at_s: 6, kind: fm_log, text: "detected NVSwitch fatal error 20034 on fid 0 on NVSwitch pci bus id 00000000:85:00.0 physical id 2 port 33"}
  - {at_s: 7, kind: fm_log, text: "detected NVSwitch non-fatal error 20001 on fid 0 on NVSwitch pci bus id 00000000:83:00.0 physical id 0 port 2"}
"""))  # noqa: E501
    before = h.run(NvswitchCheck, t=1)
    assert _sim_bad(before) == []
    # the h100-sxm profile expects 4 NVSwitches: the PCI count is judged too
    assert {f.evidence.get("reading") for f in _readings(before)} == {"sxid", "fabric_state", "fm_log", "pci"}
    findings = h.run(NvswitchCheck, t=10)
    assert _sim_bad(findings) == [
        ("gpu/3", "fail", "reboot_node"), ("gpu/6", "fail", "reboot_node"),  # fabric state
        ("nvswitch/0", "warn", "none"),  # fabric manager: non-fatal 20001 (NVIDIA: IGNORE)
        ("nvswitch/1", "fail", "reboot_node"),  # SXid 20034 Fatal
        ("nvswitch/2", "fail", "reboot_node"),  # fabric manager: fatal 20034
        ("nvswitch/2", "warn", "restart_app"),  # SXid 12028 Non-fatal
    ]
    sxid = _by(findings, "sxid")["nvswitch/1"]
    assert (sxid.evidence["events"], sxid.evidence["lines"], sxid.evidence["links"]) == (1, 3, [12])
    assert sxid.evidence["pci_bus_id"] == "0000:84:00.0"
    assert _by(findings, "fabric_state")["gpu/3"].evidence["state_name"] == "not started"
    assert _by(findings, "fm_log")["nvswitch/2"].evidence["ports"] == {"33": 1}
    # expiry of non-fatal findings and reading the fabric manager log once are in the unit tests
    # above: a simulated run costs ~1.3 s


def test_sim_a100_fabric_state_not_supported(sim: Any) -> None:
    h = sim("name: a100\nsku: a100-sxm-80gb\nfaults: []\n")
    findings = h.run(NvswitchCheck, t=1)
    assert _sim_bad(findings) == []
    fabric = _by(findings, "fabric_state")
    assert set(fabric) == {"node"} and fabric["node"].severity is Severity.SKIPPED


# --------------------------------------------------------------------------- one finding per component


def _healthy_run_without_fm_log(h: Any, t: float) -> list[Finding]:
    """A run at time t on a node where fabric manager logs elsewhere (syslog): no log file."""
    h.render(t)
    (h.node.host_root / DEFAULT_LOG_PATH).unlink(missing_ok=True)
    findings: list[Finding] = run_on_json(NvswitchCheck(), h.context(NvswitchCheck))
    return findings


def test_healthy_node_one_finding_per_component_the_same_every_run(sim: Any) -> None:
    """Issue 14 #3: a healthy node gave ``node`` two findings each run (the NVSwitches ok; no fabric
    manager log: skipped), so the daemon logged ok -> skipped -> ok every minute and the exported
    severity sat at 1. One finding per component, the missing optional log a note in its evidence."""
    h = sim(H100.format(faults="  []"))
    runs = [_healthy_run_without_fm_log(h, t) for t in (60, 120)]
    for findings in runs:
        components = [f.component for f in findings]
        assert len(components) == len(set(components)), sorted(components)
        assert {f.severity for f in findings} == {Severity.OK}
    assert [f.to_json() for f in runs[0]] == [f.to_json() for f in runs[1]]
    node = {f.component: f for f in runs[1]}["node"]
    assert node.evidence["reading"] == "node"
    fm_log = node.evidence["fm_log"]
    assert fm_log["severity"] == "skipped" and "not found at" in fm_log["message"]
    assert fm_log["source"].endswith(DEFAULT_LOG_PATH)
    assert (node.evidence["sxid"]["severity"], node.evidence["pci"]["severity"]) == ("ok", "ok")
    assert "not found at" in node.message  # said, not hidden


def test_healthy_node_recorded_twice_adds_no_event(sim: Any, tmp_path: Path) -> None:
    """The daemon's recording: the second run of an unchanged healthy node is no news."""
    from gpumon.health import Health
    from gpumon.model import CheckRun

    h = sim(H100.format(faults="  []"))
    health = Health.open(tmp_path / "state", boot_id="boot-1", clock=lambda: 1.8e9)
    try:
        first = health.record_run(CheckRun("nvswitch", _healthy_run_without_fm_log(h, 60), 0.0, 1.0,
                                           "completed"))
        assert first and {e.payload["severity"] for e in first if e.check == "nvswitch"} == {"ok"}
        again = health.record_run(CheckRun("nvswitch", _healthy_run_without_fm_log(h, 120), 0.0, 1.0,
                                           "completed"))
        assert again == []
        assert health.view().components["node"].level.value == "healthy"
    finally:
        health.close()


def test_node_reading_verdicts_fold_worst_first(tmp_path: Path) -> None:
    """Several readings on ``node``: one finding, the worst verdict, every reading in evidence; a
    skipped reading alone does not make a judged node skipped; a switch's SXid and fabric manager
    findings for one code are one fault."""
    # kernel log unreadable (unknown) + fabric manager log missing at its default path (a note)
    [node] = _run(_ctx(tmp_path, available=False))
    assert (node.component, node.severity) == ("node", Severity.UNKNOWN)
    assert node.message.startswith("kernel log unreadable") and "fabric manager" not in node.message
    assert node.evidence["fm_log"]["severity"] == "skipped"
    # the same fatal 20034 on the switch at 0000:85:00.0 in the kernel log and in fabric manager's
    root = _fm_root(tmp_path / "fm", b"[Dec 19 2024 19:17:49] [ERROR] [tid 1374] detected NVSwitch fatal "
                    b"error 20034 on fid 0 on NVSwitch pci bus id 00000000:85:00.0 physical id 2 port 33\n")
    sx = parse_sxid("nvidia-nvswitch2: SXid (PCI:0000:85:00.0): 20034, Fatal, Link 33 LTSSM Fault Up")
    findings = _run(_ctx(root, events=[sx]))
    switch = [f for f in findings if f.component == "nvswitch/2"]
    assert len(switch) == 1 and switch[0].evidence["reading"] == "sxid+fm_log"
    assert (switch[0].severity, switch[0].action, switch[0].evidence["code"]) == \
        (Severity.FAIL, Action.REBOOT_NODE, 20034)
    assert switch[0].evidence["fm_log"]["ports"] == {"33": 1} and switch[0].evidence["sxid"]["links"] == [33]
    assert [f.component for f in findings].count("node") == 1


def test_daemon_logs_a_node_change_once(tmp_path: Path) -> None:
    """The daemon on a simulated node whose fabric manager log has an error: before, ``node`` had an
    ok finding (the SXid lines) and a warn one (the log) every run, and the daemon logged
    ``warn -> ok`` and ``ok -> warn`` every run; now it logs the node's one change once."""
    import subprocess
    import sys

    from conftest import clean_env

    scenario = tmp_path / "fm.yaml"
    scenario.write_text(H100.format(faults='  - {at_s: 0, kind: fm_log, text: "failed to find the GPU handle '
                                           '5410063385821516767 in the multicast team request setup 1."}'))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("checks:\n  nvswitch:\n    interval_s: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate", str(scenario),
         "--sim-dir", str(tmp_path / "sim"), "--duration", "5", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, env=clean_env(), timeout=90)
    assert proc.returncode == 0, proc.stderr
    changes = [line for line in proc.stderr.splitlines() if "nvswitch node:" in line]
    assert len(changes) == 1 and "new -> warn" in changes[0], changes
    report = json.loads((tmp_path / "sim" / "state" / "report.json").read_text())
    [node] = [f for f in report["findings"] if (f["check"], f["component"]) == ("nvswitch", "node")]
    assert node["severity"] == "warn" and node["evidence"]["fm_log"]["count"] == 1
    assert node["evidence"]["sxid"]["severity"] == "ok"


# --------------------------------------------------------------------------- properties


def parse_sxid(line: str) -> SXidEvent:
    from gpumon.hw.kmsg_parse import parse_line
    from gpumon.hw.nvrm import NvrmParser

    [event] = NvrmParser().feed(parse_line(line))
    assert isinstance(event, SXidEvent)
    return event


_SXID = st.builds(
    SXidEvent, switch=st.integers(0, 70), pci=st.sampled_from([None, "0000:83:00.0", "0000:84:00.0"]),
    code=st.one_of(st.sampled_from(sorted(SXID_CATALOG)), st.integers(0, 10**9)),
    fatal=st.sampled_from([None, True, False]), link=st.one_of(st.none(), st.integers(-1, 200)),
    message=st.text(max_size=60),
    record=st.builds(lambda us: KernelRecord(text="x", raw="x", monotonic_us=us),
                     st.one_of(st.none(), st.integers(0, 10**13))))


_NO_HOST = Path("/nonexistent-gpumon-host-root")
_NO_HOST_HW = Hardware(_NO_HOST)  # one for all examples: each Hardware starts its own worker threads


@given(batches=st.lists(st.lists(_SXID, max_size=8), max_size=5))
@settings(max_examples=60)
def test_any_sxid_sequence_gives_findings_and_json_state(batches: list[list[SXidEvent]]) -> None:
    state: dict[str, Any] = {}
    for i, batch in enumerate(batches):
        ctx = _ctx(_NO_HOST, events=batch, state=state, boot_time=1.7e9, now=1.7e9 + i, hw=_NO_HOST_HW)
        findings = _run(ctx)
        assert findings
        for f in findings:
            if f.evidence.get("reading") == "sxid" and f.component != "node":
                assert f.severity in (Severity.WARN, Severity.FAIL)
                assert f.evidence["events"] >= 1 and f.evidence["lines"] >= f.evidence["events"]
