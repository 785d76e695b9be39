"""The xid check on real kernel-log captures (tests/data/kmsg-xid, provenance in SOURCES.md)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, run_gpumon, run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory, PciDevice, UnreadableGpu
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.nvml import GpuInfo
from gpumon.hw.nvrm import NvrmParser, parse_file
from gpumon.model import Finding, Severity
from gpumon.profiles import GENERIC
from gpumon.sim import nvml_inject
from gpumon_checks.xid import XidCheck, XidConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "kmsg-xid"


def _inventory(pcis: list[str], lost: list[str] = ()) -> Inventory:  # type: ignore[assignment]
    """GPUs in NVML at ``pcis``; ``lost`` ones are on the bus and counted by NVML but unreadable."""
    everything = sorted([*pcis, *lost])
    gpus = [GpuInfo(i, f"GPU-{i}", None, bus, "NVIDIA H100 80GB HBM3", "hopper", 18, i)
            for i, bus in enumerate(everything) if bus in pcis]
    unreadable = {i: UnreadableGpu("GPU is lost (nvmlDeviceGetHandleByIndex)", lost=True)
                  for i, bus in enumerate(everything) if bus in lost}
    pci = [PciDevice(b, "0x10de", "0x2330", "0x030200") for b in everything]
    return Inventory(gpus=gpus, unreadable_gpus=unreadable, pci_devices=pci)


def _run(name: str, pcis: list[str], *, lost: list[str] = (), state: dict[str, Any] | None = None,  # type: ignore[assignment]
         options: XidConfig | None = None, tmp_path: Path) -> list[Finding]:
    events = parse_file(DATA / name)
    times = [r.wall_time.timestamp() for e in events if (r := getattr(e, "record", None)) and r.wall_time]
    now = (max(times) if times else 1_700_000_000.0) + 60
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=_inventory(pcis, lost), profile=GENERIC,
                       options=options or XidConfig(), state=state if state is not None else {},
                       kernel_log=KernelLog(events=events, source=name, boot_time=1_700_000_000.0),
                       clock=lambda: now)
    return run_on_json(XidCheck(), ctx)


def _lines(tmp_path: Path, pcis: list[str], *lines: str, options: XidConfig | None = None,
           now: float = 1_700_000_600.0) -> list[Finding]:
    """The xid check on kernel-log lines given here (each named where it is quoted from)."""
    parser = NvrmParser()
    events: list[Any] = []
    for line in lines:
        events.extend(parser.feed(parse_line(line)))
    events.extend(parser.flush())
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=_inventory(pcis), profile=GENERIC,
                       options=options or XidConfig(), state={},
                       kernel_log=KernelLog(events=events, source="test", boot_time=1_700_000_000.0),
                       clock=lambda: now)
    return run_on_json(XidCheck(), ctx)


def _by(findings: list[Finding]) -> dict[tuple[str, int], Finding]:
    return {(f.component, f.evidence.get("code", 0)): f for f in findings}


def _expect(f: Finding, severity: Severity, action: str, count: int) -> None:
    assert (f.severity, f.action.value, f.evidence["count"]) == (severity, action, count), f


def test_xid13_storm_is_one_finding_with_a_count_and_escalates_on_repeats(tmp_path: Path) -> None:
    found = _by(_run("dmesg-decode-iso_xid13-storm_then_xid43.log", ["0000:38:00.0"], tmp_path=tmp_path))
    assert set(found) == {("gpu/0", 13)}  # Xid 43 is NVIDIA's IGNORE: no finding of its own
    storm = found[("gpu/0", 13)]
    # nine separate bursts on one GPU in 2.5 h: NVIDIA's WORKFLOW_XID_13 says suspect hardware
    _expect(storm, Severity.FAIL, "inspect_hardware", 629)
    assert storm.evidence["bursts"] == 9 and storm.evidence["pci_bus_id"] == "0000:38:00.0"
    assert "pids" not in storm.evidence  # pid='<unknown>'


def test_xid13_single_burst_stays_an_application_error(tmp_path: Path) -> None:
    found = _by(_run("issue_gpud-46_dmesg-ctime_xid13-then-xid109-ctxsw-timeout.log", ["0000:cb:00.0"],
                     tmp_path=tmp_path))
    _expect(found[("gpu/0", 13)], Severity.WARN, "restart_app", 3)
    ctxsw = found[("gpu/0", 109)]
    _expect(ctxsw, Severity.FAIL, "reset_gpu", 1)
    assert ctxsw.evidence["pids"] == [1797828] and ctxsw.evidence["processes"] == ["pt_main_thread"]


def test_legacy_format_without_pid_or_name(tmp_path: Path) -> None:
    found = _by(_run("issue_dxvk-1027_geforce_xid31-xid13-xid32_legacy-format.log", ["0000:01:00.0"],
                     tmp_path=tmp_path))
    _expect(found[("gpu/0", 31)], Severity.WARN, "restart_app", 2)
    _expect(found[("gpu/0", 13)], Severity.WARN, "restart_app", 4)
    _expect(found[("gpu/0", 32)], Severity.WARN, "restart_app", 1)


def test_journal_pid_without_name(tmp_path: Path) -> None:
    found = _by(_run("issue_dxvk-1799_journalctl-k_xid31_450.80.02.log", ["0000:c1:00.0"], tmp_path=tmp_path))
    f = found[("gpu/0", 31)]
    _expect(f, Severity.WARN, "restart_app", 2)
    assert f.evidence["pids"] == [12890] and "processes" not in f.evidence


def test_modern_xid31_with_pid_and_name(tmp_path: Path) -> None:
    found = _by(_run("issue_open-gpu-kernel-modules-1030_xid31-with-pid-name_595.71.05.log",
                     ["0000:01:00.0"], tmp_path=tmp_path))
    f = found[("gpu/0", 31)]
    assert f.evidence["processes"] == ["UnrealEditor"] and f.evidence["uuid"] == \
        "GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa"


def test_xid119_gsp_timeout_needs_gpu_reset_and_names_the_board(tmp_path: Path) -> None:
    found = _by(_run("dmesg-ctime_xid119_gsp-rpc-timeout.log", ["0000:9b:00.0"], tmp_path=tmp_path))
    f = found[("gpu/0", 119)]
    _expect(f, Severity.FAIL, "reset_gpu", 5)
    assert f.evidence["uuid"] == "GPU-509665ad-b600-ac93-3616-d754b23d636d"
    assert f.evidence["serial"] == "1650124014249"
    assert f.evidence["processes"] == ["nvidia-smi", "cache_mgr_main", "gpud"]


def test_xid79_fallen_off_bus_needs_reboot_once_not_twice(tmp_path: Path) -> None:
    # the lost GPU is on the bus but no longer in NVML: placed by PCI order
    found = _by(_run("dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log",
                     ["0000:18:00.0", "0000:2a:00.0"], lost=["0000:91:00.0"], tmp_path=tmp_path))
    assert set(found) == {("gpu/2", 79)}  # SXid lines belong to the nvswitch check
    f = found[("gpu/2", 79)]
    _expect(f, Severity.FAIL, "reboot_node", 1)
    assert f.evidence["serial"] == "1653723052734"


def test_gpu_missing_from_nvml_is_named_by_its_pci_address(tmp_path: Path) -> None:
    # NVML no longer counts it, so NVML indexes shifted: do not guess an index
    events = parse_file(DATA / "dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log")
    inv = _inventory(["0000:18:00.0", "0000:2a:00.0"])
    inv.pci_devices.append(PciDevice("0000:91:00.0", "0x10de", "0x2330", "0x030200"))
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=inv, profile=GENERIC, options=XidConfig(),
                       state={}, kernel_log=KernelLog(events=events), clock=lambda: 0.0)
    [f] = run_on_json(XidCheck(), ctx)
    assert (f.component, f.action.value) == ("pci/0000:91:00.0", "reboot_node")


def test_fallen_off_bus_without_any_xid_line_is_xid79(tmp_path: Path) -> None:
    found = _by(_run("issue_nvsentinel-155_fallen-off-bus-no-xid_570.158.01.log", [], tmp_path=tmp_path))
    f = found[("pci/0000:b3:00.0", 79)]
    _expect(f, Severity.FAIL, "reboot_node", 1)


def test_nvlink5_by_nvidias_decode_sheet(tmp_path: Path) -> None:
    found = _by(_run("gb200_xid145-rlw-xid149-netir_with-pid-name_nots.log",
                     ["0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"], tmp_path=tmp_path))
    # RLW_SRC_TRACK status 0x8 is XID_154_EVAL, and no Xid 154 came with it: RESTART_APP
    src = found[("nvlink/0/12", 145)]
    _expect(src, Severity.WARN, "restart_app", 1)
    assert "no Xid 154" in src.message and src.evidence["nvidia_resolution"] == "XID_154_EVAL"
    _expect(found[("gpu/0", 149)], Severity.FAIL, "reset_gpu", 1)        # NETIR Fatal Link -1
    link = found[("nvlink/0/8", 149)]                                    # NETIR_LINK_EVT sub-code 4
    _expect(link, Severity.FAIL, "reset_gpu", 1)
    assert "sub-code 4" in link.message and link.evidence["nvidia_investigatory"] == "INVESTIGATE_LINK_SI"
    # NVIDIA's IGNORE: NETIR_BER_EVENT (any status) and RLW_RXPIPE status 0x8 are not faults
    assert ("nvlink/0/1", 149) not in found and ("nvlink/2/13", 145) not in found
    assert found[("nvlink/0/3", 145)].evidence["processes"] == ["cache_mgr_main"]


def test_xid154_acts_on_the_new_recovery_action(tmp_path: Path) -> None:
    found = _by(_run("gb200_xid149-netir-link-evt_xid154-recovery-action.log",
                     ["0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"], tmp_path=tmp_path))
    drain = found[("gpu/1", 154)]
    assert (drain.severity, drain.action.value) == (Severity.FAIL, "reset_gpu")
    assert "Drain and Reset" in drain.message
    reset = found[("gpu/3", 154)]
    assert "GPU Reset Required" in reset.message and reset.action.value == "reset_gpu"
    _expect(found[("nvlink/1/1", 149)], Severity.FAIL, "reset_gpu", 1)


def test_xid45_acts_on_the_root_xid(tmp_path: Path) -> None:
    pcis = ["0000:97:00.0", "0000:ba:00.0", "0000:dc:00.0", "0000:ed:00.0"]
    found = _by(_run("issue_open-gpu-kernel-modules-1150_xid45-caused-by-xid149-145_590.48.01.log", pcis,
                     tmp_path=tmp_path))
    assert not [k for k in found if k[1] == 45]
    root149 = found[("gpu/2", 149)]
    _expect(root149, Severity.FAIL, "reset_gpu", 2)
    assert root149.evidence["reported_via_xid"] == [45] and "via Xid 45" in root149.message
    _expect(found[("gpu/0", 145)], Severity.FAIL, "reset_gpu", 1)
    _expect(found[("gpu/3", 145)], Severity.FAIL, "reset_gpu", 2)


def test_redacted_lines_are_judged_by_the_unit_name(tmp_path: Path) -> None:
    # "RLW_RXPIPE Nonfatal ... (...)": no words, but every RLW_RXPIPE rule of NVIDIA's sheet is
    # IGNORE, as is 137: nothing to report
    found = _by(_run("issue_nccl-2241_b200_xid145-rlw-rxpipe_xid137.log", [], tmp_path=tmp_path))
    assert set(found) == {("node", 0)} and found[("node", 0)].severity is Severity.OK


def test_redacted_pci_still_reports_on_the_node(tmp_path: Path) -> None:
    # the same redaction on a unit whose statuses differ: the printed word decides, on the node
    found = _by(_lines(tmp_path, [],
                       "kernel: NVRM: Xid (PCI:...): 145, RLW_REMAP Fatal XC0 i0 Link 11 (...)"))
    _expect(found[("node", 145)], Severity.FAIL, "reset_gpu", 1)


@pytest.mark.parametrize("name", ["dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log",
                                  "journalctl-k-short-iso_peermem.log", "dev-kmsg-raw_nvswitch-open.log"])
def test_healthy_logs_give_one_ok(name: str, tmp_path: Path) -> None:
    findings = _run(name, ["0000:18:00.0"], tmp_path=tmp_path)
    assert [(f.component, f.severity) for f in findings] == [("node", Severity.OK)]


def test_incremental_runs_keep_counting_and_app_errors_expire(tmp_path: Path) -> None:
    state: dict[str, Any] = {}
    name = "issue_dxvk-1799_journalctl-k_xid31_450.80.02.log"
    first = _by(_run(name, ["0000:c1:00.0"], state=state, tmp_path=tmp_path))
    assert first[("gpu/0", 31)].evidence["count"] == 2
    second = _by(_run(name, ["0000:c1:00.0"], state=state, tmp_path=tmp_path))
    assert second[("gpu/0", 31)].evidence["count"] == 4
    quiet = _run(name, ["0000:c1:00.0"], state=state, options=XidConfig(recent_window_s=0),
                 tmp_path=tmp_path)
    # count 6 now, but the newest line is 60 s old and the window is 0: quiet again
    assert [(f.component, f.severity) for f in quiet] == [("node", Severity.OK)]


def test_unreadable_kernel_log_is_unknown_not_ok(tmp_path: Path) -> None:
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=_inventory(["0000:18:00.0"]), profile=GENERIC,
                       options=XidConfig(), state={},
                       kernel_log=KernelLog(available=False, error="/dev/kmsg: permission denied"))
    [f] = run_on_json(XidCheck(), ctx)
    assert f.severity is Severity.UNKNOWN and "permission denied" in f.message


# -- simulated node: NVML Xid events as a second source, Xid 63 / 74 / NVLink5 workflows -------------


class _Runner:
    """Runs the xid check on a simulated node the way one daemon runner does.

    The harness makes a new Hardware per call; a runner keeps one for its life, and one instance
    of each check, which keeps its NVML event set. So the first Hardware and one check are
    carried over every call.
    """

    def __init__(self, h: Any) -> None:
        self.h = h
        self.hw: Hardware | None = None
        self.check = XidCheck()

    def context(self, t: float, kernel_log: KernelLog | None = None) -> CheckContext:
        ctx: CheckContext = self.h.context(XidCheck, t)
        self.hw = self.hw or ctx.hw
        ctx.hw = self.hw
        if kernel_log is not None:
            ctx.kernel_log = kernel_log
        return ctx

    def run(self, t: float, kernel_log: KernelLog | None = None) -> dict[tuple[str, int], Finding]:
        findings = run_on_json(self.check, self.context(t, kernel_log))
        assert json.loads(json.dumps(self.h.states["xid"])) == self.h.states["xid"]  # JSON state only
        return {(f.component, f.evidence.get("code", 0)): f for f in findings}


NO_KMSG = KernelLog(available=False, error="/dev/kmsg: no such file (container without /dev/kmsg)")


def _scenario(*faults: str, sku: str = "h100-sxm") -> str:
    return f"name: t\nsku: {sku}\ngpus: 8\nfaults:\n" + ("".join(f"  - {f}\n" for f in faults) or "  []\n")


def test_nvml_event_without_kernel_log_is_a_finding_from_nvml(sim: Any) -> None:
    r = _Runner(sim(_scenario("{at_s: 5, kind: xid, gpu: 2, code: 48}")))
    first = r.run(1, NO_KMSG)
    # the event set opens now: the boot so far is unseen, so the check cannot say ok yet
    assert first[("node", 0)].severity is Severity.UNKNOWN and "from now on" in first[("node", 0)].message
    second = r.run(10, NO_KMSG)
    dbe = second[("gpu/2", 48)]
    _expect(dbe, Severity.FAIL, "reset_gpu", 1)
    assert dbe.evidence["source"] == "nvml" and dbe.evidence["pci_bus_id"] == "0000:4c:00.0"
    node = second[("node", 0)]
    assert node.severity is Severity.OK and node.evidence["missing_source"] == "kernel_log"
    assert "no such file" in node.message


def test_neither_source_is_unknown(sim: Any) -> None:
    h = sim(_scenario())
    ctx = h.context(XidCheck, 1)
    ctx.kernel_log = NO_KMSG
    ctx.inventory = Inventory()  # no GPU NVML can read: no event set can be opened
    [f] = run_on_json(XidCheck(), ctx)
    assert f.severity is Severity.UNKNOWN and "no GPU readable through NVML" in f.message


_LINK6 = "NVLink: fatal error detected on link 6({})"
_MECHANICAL = ", ".join(["0x10000"] + ["0x0"] * 6)  # bit 16: link mechanical (NVIDIA WORKFLOW_NVLINK_ERR)
_IGNORABLE = ", ".join(["0x800001"] + ["0x0"] * 6)  # bits 0 and 23: "can be safely ignored"
_ECC = ", ".join(["0x10"] + ["0x0"] * 6)  # bit 4: ECC/parity


def test_both_sources_counted_once_and_the_remap_and_nvlink_workflows(sim: Any) -> None:
    # one node, several faults, stepped like a daemon: each step is a full render of the node
    r = _Runner(sim(_scenario(
        "{at_s: 8, kind: xid, gpu: 6, code: 119}",
        "{at_s: 5, kind: remap, gpu: 1, pending: true, uncorrected: 1, duration_s: 20}",
        "{at_s: 5, kind: xid, gpu: 1, code: 63}",
        "{at_s: 5, kind: xid, gpu: 2, code: 63}",
        "{at_s: 5, kind: remap, gpu: 7, failure: true}",
        "{at_s: 5, kind: xid, gpu: 7, code: 63}",
        "{at_s: 6, kind: xid, gpu: 7, code: 64}",
        f"{{at_s: 5, kind: xid, gpu: 3, code: 74, message: '{_LINK6.format(_MECHANICAL)}'}}",
        f"{{at_s: 2, kind: xid, gpu: 0, code: 74, message: '{_LINK6.format(_IGNORABLE)}'}}",
        *(f"{{at_s: {t}, kind: xid, gpu: 5, code: 74, message: '{_LINK6.format(_ECC)}'}}"
          for t in (3, 20, 21)),
        "{at_s: 25, kind: xid, gpu: 6, code: 119}")))
    assert [k for k, f in r.run(1).items() if f.severity is not Severity.OK] == []

    found = r.run(10)
    gsp = found[("gpu/6", 119)]
    _expect(gsp, Severity.FAIL, "reset_gpu", 1)  # the kernel line and NVML's event: one event
    assert gsp.evidence["source"] == "kernel+nvml"
    pending = found[("gpu/1", 63)]  # Xid 63 with NVML's remap pending flag set
    assert (pending.severity, pending.action.value) == (Severity.WARN, "reset_gpu")
    assert pending.evidence["remap"]["pending"] is True and "pending" in pending.message
    info = found[("gpu/2", 63)]  # no remap pending: the row is already remapped
    assert (info.severity, info.action.value) == (Severity.OK, "none")
    failed = found[("gpu/7", 63)]
    assert (failed.severity, failed.action.value) == (Severity.FAIL, "inspect_hardware")
    _expect(found[("gpu/7", 64)], Severity.FAIL, "inspect_hardware", 1)
    link = found[("nvlink/3/6", 74)]  # Xid 74 names its link: a link fault
    _expect(link, Severity.FAIL, "check_cables", 1)
    assert link.evidence["nvlink_classes"] == ["mechanical"] and link.evidence["source"] == "kernel+nvml"
    assert not [k for k in found if k[1] == 74 and k[0].startswith("gpu/")]  # NVML's events matched
    assert ("nvlink/0/6", 74) not in found  # bits 0 and 23: NVIDIA "can be safely ignored"
    _expect(found[("nvlink/5/6", 74)], Severity.FAIL, "reset_gpu", 1)  # ECC/parity once: reset

    found = r.run(30)
    # the second fault is a second event, and neither is counted twice
    _expect(found[("gpu/6", 119)], Severity.FAIL, "reset_gpu", 2)
    applied = found[("gpu/1", 63)]  # the reset applied the remap: the Xid stays, as info
    assert (applied.severity, applied.action.value) == (Severity.OK, "none")
    assert applied.evidence["remap"]["pending"] is False and "already applied" in applied.message
    # NVIDIA: ECC/parity bits more than 2 times on one link -> hardware
    _expect(found[("nvlink/5/6", 74)], Severity.FAIL, "inspect_hardware", 3)


def test_kernel_line_arriving_after_its_nvml_event_is_still_one_event(sim: Any) -> None:
    r = _Runner(sim(_scenario("{at_s: 8, kind: xid, gpu: 4, code: 109}")))
    r.run(1)
    ctx = r.context(10)
    late = ctx.kernel_log  # the line is in the log, but the check sees NVML's event first
    ctx.kernel_log = KernelLog(source=late.source, boot_time=late.boot_time)
    early = {(f.component, f.evidence.get("code")): f for f in run_on_json(r.check, ctx)}
    assert early[("gpu/4", 109)].evidence["source"] == "nvml"
    found = r.run(12, late)
    _expect(found[("gpu/4", 109)], Severity.FAIL, "reset_gpu", 1)
    assert found[("gpu/4", 109)].evidence["source"] == "kernel+nvml"
    assert found[("gpu/4", 109)].evidence["pids"] == [1797828]  # the detail came with the line


_RLW = "RLW_REMAP Nonfatal XC0 i0 Link 10 ({} 0x00000000 0x00000000 0x00000000 0x00000000)"


def test_nvlink5_decode_rules_refine_the_fatal_word(sim: Any) -> None:
    r = _Runner(sim(_scenario(
        # RLW_REMAP status 0x40 is Fatal in NVIDIA's decode sheet, whatever word the line printed
        f"{{at_s: 2, kind: xid, gpu: 0, code: 145, message: '{_RLW.format('0x00000004 0x00000040')}'}}",
        f"{{at_s: 2, kind: xid, gpu: 1, code: 145, message: '{_RLW.format('0x00000004 0x00000008')}'}}",
        # a unit the rules do not cover: the printed word decides
        "{at_s: 2, kind: xid, gpu: 2, code: 146, "
        "message: 'TLW_RX Fatal XC0 i0 Link 03 (0x1 0x2 0x0 0x0 0x0 0x0)'}",
        sku="b200")))
    found = r.run(5)
    fatal = found[("nvlink/0/10", 145)]
    _expect(fatal, Severity.FAIL, "reset_gpu", 1)
    assert "RLW_REMAP status 0x40" in fatal.message and "is Fatal, RESET_GPU" in fatal.message
    assert fatal.evidence["error_status"] == "0x40"
    nonfatal = found[("nvlink/1/10", 145)]  # status 0x8: XID_154_EVAL, and no Xid 154
    assert (nonfatal.severity, nonfatal.action.value) == (Severity.WARN, "restart_app")
    assert "no Xid 154" in nonfatal.message
    _expect(found[("nvlink/2/3", 146)], Severity.FAIL, "reset_gpu", 1)


# -- a host tree through `gpumon check`: kernel time without btime, an unusable kernel log ---------


def _host_tree(tmp_path: Path, faults: list[str]) -> Any:
    """A simulated 8x H100 node rendered once into a host-root tree (after every fault), for
    ``gpumon --host-root`` with the NVML injection library; the test then edits the tree."""
    from gpumon.schema import load_yaml
    from gpumon.sim.render import SimNode
    from gpumon.sim.scenario import _build

    data, src = load_yaml(_scenario(*faults), str(tmp_path / "scenario.yaml"))
    scenario = _build(data, src)
    node = SimNode(scenario, tmp_path / "node", start_wall=time.time() - 3600)
    node.render(scenario.horizon_s)
    return node


def _check(node: Any, lib_dir: Path, *names: str) -> tuple[int, dict[tuple[str, str], dict[str, Any]]]:
    env = nvml_inject.subprocess_env(lib_dir, node.nvml_state_path, base=clean_env())
    proc = run_gpumon("--host-root", str(node.host_root), "check", *names, "--json", env=env)
    assert proc.stdout, proc.stderr
    doc = json.loads(proc.stdout)
    return proc.returncode, {(f["check"], f["component"]): f for f in doc["findings"]}


def test_xid13_bursts_dated_by_kernel_time_without_btime(tmp_path: Path, inject_lib_dir: Path) -> None:
    """Issue 14 #6: /proc/stat without btime dated every kernel record "now", so three Xid 13
    bursts minutes apart were one burst and never escalated. Records carry their kernel time
    (the /dev/kmsg usec field): dated by it, the bursts stay apart with or without btime."""
    node = _host_tree(tmp_path, [f"{{at_s: {t}, kind: xid, gpu: 3, code: 13}}" for t in (0, 300, 600)])
    kmsg = (node.host_root / "dev" / "kmsg").read_text()
    assert kmsg.count(": 13, ") == 3 and "T" not in kmsg.split(";")[0]  # kernel time only
    stat = node.host_root / "proc" / "stat"
    with_btime = stat.read_text()
    assert "btime " in with_btime
    uptime = node.host_root / "proc" / "uptime"
    for case in ("btime", "no btime: /proc/uptime", "neither: the newest record"):
        if case != "btime":
            stat.write_text("".join(line for line in with_btime.splitlines(True)
                                    if not line.startswith("btime ")))
        if case.startswith("neither"):
            uptime.unlink()
        code, found = _check(node, inject_lib_dir, "xid")
        f = found[("xid", "gpu/3")]
        assert (code, f["severity"], f["action"]) == (2, "fail", "inspect_hardware"), (case, f)
        assert (f["evidence"]["count"], f["evidence"]["bursts"]) == (3, 3), case


def test_kernel_log_that_is_a_directory_is_unknown_not_ok(tmp_path: Path, inject_lib_dir: Path) -> None:
    """Issue 14 bad input #4: <host-root>/dev/kmsg replaced by a directory read as an empty log
    (xid, nvswitch, pcie ok, exit 0). It is a log that cannot be read: unknown, with the reason."""
    node = _host_tree(tmp_path, [])
    kmsg = node.host_root / "dev" / "kmsg"
    kmsg.unlink()
    kmsg.mkdir()
    code, found = _check(node, inject_lib_dir, "xid", "nvswitch", "pcie")
    assert code == 1, found
    for check in ("xid", "nvswitch", "pcie"):
        said = [f for (c, _), f in found.items() if c == check and "kernel log" in f["message"]]
        assert [f["severity"] for f in said] == ["unknown"], found
        assert "is a directory" in said[0]["message"] and str(kmsg) in said[0]["message"], said
    assert {f["severity"] for f in found.values()} <= {"ok", "unknown"}, found


# -- issue 11: NVIDIA's full catalog, NVLink5 decode sheet, Xid 74 registers ----------------------
# Lines quoted from other projects' tests (tests/data/peer-fixtures, case id named at each).

_RLW_SRC_TRACK = ("NVRM: Xid (PCI:0008:01:00): 145, RLW_SRC_TRACK Nonfatal XC1 i0 Link 16 (0x040a08e2 "
                  "0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)")  # gpud-nvl5-07
_XID154_RESET = ("NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
                 "(GPU Reset Required)")  # nvs-csv-154
_XID154_NONE = ("NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset "
                "Required) to 0x0 (None)")  # nvs-csv-154none


def test_xid154_eval_follows_the_accompanying_xid154(tmp_path: Path) -> None:
    alone = _by(_lines(tmp_path, ["0008:01:00.0"], _RLW_SRC_TRACK))
    _expect(alone[("nvlink/0/16", 145)], Severity.WARN, "restart_app", 1)
    found = _by(_lines(tmp_path, ["0008:01:00.0"], _RLW_SRC_TRACK, _XID154_RESET))
    link = found[("nvlink/0/16", 145)]
    _expect(link, Severity.FAIL, "reset_gpu", 1)
    assert "follows the Xid 154 on this GPU: recovery action GPU Reset Required" in link.message
    _expect(found[("gpu/0", 154)], Severity.FAIL, "reset_gpu", 1)
    # the Xid 154 says no recovery is needed (any more): NVIDIA says take that action
    found = _by(_lines(tmp_path, ["0008:01:00.0"], _RLW_SRC_TRACK, _XID154_NONE))
    assert set(found) == {("node", 0)}


def test_xid154_eval_waits_for_the_restart_when_the_xid154_is_older(tmp_path: Path) -> None:
    # a Xid 154 from long before the NVLink line does not accompany it
    old = "[    5.000000] " + _XID154_RESET
    late = "[ 3600.000000] " + _RLW_SRC_TRACK
    found = _by(_lines(tmp_path, ["0008:01:00.0"], old, late, now=1_700_003_700.0))
    _expect(found[("nvlink/0/16", 145)], Severity.WARN, "restart_app", 1)


def test_netir_link_evt_subcodes_38_and_40_are_ignored(tmp_path: Path) -> None:
    sub38 = ("NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 "
             "0x00000000 0x00000000 0x00000000 0x00000000)")  # gpud-hs-sub38
    sub37 = sub38.replace("0x026001c6", "0x025001c6")  # gpud-hs-sub37
    assert set(_by(_lines(tmp_path, ["0000:00:00.0"], sub38))) == {("node", 0)}
    f = _by(_lines(tmp_path, ["0000:00:00.0"], sub37))[("nvlink/0/0", 149)]
    _expect(f, Severity.FAIL, "reset_gpu", 1)
    assert "sub-code 37" in f.message and "INVESTIGATE_PEER_DEVICE" in f.message


_XID74_R3 = ("NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected "
             "on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)")  # nvs-csv-74


def test_xid74_third_register_repeats_escalate(tmp_path: Path) -> None:
    once = _by(_lines(tmp_path, ["0003:00:00.0"], _XID74_R3))[("nvlink/0/14", 74)]
    _expect(once, Severity.WARN, "none", 1)
    assert once.evidence["nvlink_classes"] == ["repeat_field_diag"]
    stamped = [f"[{100 + 200 * i:>5}.000000] {_XID74_R3}" for i in range(3)]
    twice = _by(_lines(tmp_path, ["0003:00:00.0"], *stamped[:2]))[("nvlink/0/14", 74)]
    _expect(twice, Severity.WARN, "none", 2)
    thrice = _by(_lines(tmp_path, ["0003:00:00.0"], *stamped))[("nvlink/0/14", 74)]
    _expect(thrice, Severity.FAIL, "inspect_hardware", 3)
    assert "repeat_field_diag bits on 3 lines of this link" in thrice.message
    assert "run field diags" in thrice.message


def test_unknown_codes_and_unreadable_xid154_warn_inspect_hardware(tmp_path: Path) -> None:
    unknown = "NVRM: Xid (PCI:0000:66:00): 999, pid=1234, name=test"  # nvs-csv-999
    garbage = "NVRM: Xid (PCI:0000:01:00): 154 ("  # nvs-csv-154garbage
    found = _by(_lines(tmp_path, ["0000:01:00.0", "0000:66:00.0"], unknown, garbage))
    f = found[("gpu/1", 999)]
    _expect(f, Severity.WARN, "inspect_hardware", 1)
    assert "(not in NVIDIA's catalog)" in f.message and "have it looked at" in f.message
    g = found[("gpu/0", 154)]
    _expect(g, Severity.WARN, "inspect_hardware", 1)
    assert "cannot be read" in g.message


def test_update_swfw_is_a_warning_with_its_advice(tmp_path: Path) -> None:
    line = "NVRM: Xid (PCI:0000:04:00): 78, vGPU start failed"  # our words; Xid 78 is NVIDIA's UPDATE_SWFW
    f = _by(_lines(tmp_path, ["0000:04:00.0"], line))[("gpu/0", 78)]
    _expect(f, Severity.WARN, "none", 1)
    assert "update the GPU driver and firmware (UPDATE_SWFW)" in f.message


def test_overrides_are_named_in_the_evidence(tmp_path: Path) -> None:
    line = ("NVRM: Xid (PCI:0000:04:00): 64, Failed to persist row remap table — GPU may require "
            "servicing")  # gpud-inject-64
    f = _by(_lines(tmp_path, ["0000:04:00.0"], line))[("gpu/0", 64)]
    _expect(f, Severity.FAIL, "inspect_hardware", 1)
    assert f.evidence["nvidia_action"] == "RESET_GPU" and "RMA" in f.evidence["gpumon_override"]


def test_fallen_off_bus_without_a_pci_domain(tmp_path: Path) -> None:
    line = "NVRM: GPU 18:00.0: GPU has fallen off the bus."  # gpud-kmsg-09
    f = _by(_lines(tmp_path, ["0000:18:00.0"], line))[("gpu/0", 79)]
    _expect(f, Severity.FAIL, "reboot_node", 1)


# -- issue 11: a saved kernel log judged on purpose (`gpumon check --kmsg-file`) ----------------------

_GPUD_46 = DATA / "issue_gpud-46_dmesg-ctime_xid13-then-xid109-ctxsw-timeout.log"  # GPU 0000:cb:00 = gpu/6


def test_saved_log_is_judged_at_its_own_end(tmp_path: Path) -> None:
    from gpumon.hw.kernellog import SavedKernelLog

    events = parse_file(_GPUD_46)
    end = datetime(2024, 8, 30, 11, 43, 14, tzinfo=timezone.utc).timestamp()
    log = SavedKernelLog(events=events, source=str(_GPUD_46), judged_at=end)
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=_inventory(["0000:cb:00.0"]), profile=GENERIC,
                       options=XidConfig(), state={}, kernel_log=log, clock=time.time)
    found = _by(run_on_json(XidCheck(), ctx))
    # judged when the log ended, the Xid 13s are an hour-fresh application error, as on the node then
    _expect(found[("gpu/0", 13)], Severity.WARN, "restart_app", 3)
    _expect(found[("gpu/0", 109)], Severity.FAIL, "reset_gpu", 1)
    assert found[("gpu/0", 109)].evidence["source"] == "kernel"  # this host's NVML is not asked
    # the same records as the live log (judged now): the application error has long expired
    ctx.kernel_log, ctx.state = KernelLog(events=events, source="live"), {}
    assert set(_by(run_on_json(XidCheck(), ctx))) == {("gpu/0", 109)}


def test_gpumon_check_kmsg_file_judges_an_earlier_boot_the_live_log_ignores(
        tmp_path: Path, inject_lib_dir: Path) -> None:
    node = _host_tree(tmp_path, [])
    saved = tmp_path / "saved-dmesg.log"
    earlier = _GPUD_46.read_text(encoding="utf-8")
    # a journal of two boots: the Xids, then a boot that logged nothing about the GPUs
    saved.write_text(earlier + "-- Boot 4f1e2d3c4b5a69788796a5b4c3d2e1f0 --\n"
                     "[Sat Aug 31 08:00:00 2024] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115)\n")
    # the live log holding that file: records from before this host's boot are not this boot's
    kmsg = node.host_root / "dev" / "kmsg"
    kmsg.unlink()
    kmsg.write_text(saved.read_text())
    code, found = _check(node, inject_lib_dir, "xid")
    assert code == 0 and found[("xid", "node")]["severity"] == "ok", found
    # judged on purpose: its last boot (nothing), then every boot
    code, found = _check(node, inject_lib_dir, "xid", "--kmsg-file", str(saved))
    assert code == 0 and str(saved) in found[("xid", "node")]["message"], found
    code, found = _check(node, inject_lib_dir, "xid", "--kmsg-file", str(saved), "--all-boots")
    f = found[("xid", "gpu/6")]
    assert (code, f["severity"], f["action"]) == (2, "fail", "reset_gpu"), found
    assert f["evidence"]["code"] == 109
    saved.write_text(earlier)  # a saved log of one earlier boot: judged without --all-boots
    code, found = _check(node, inject_lib_dir, "xid", "--kmsg-file", str(saved))
    assert code == 2 and found[("xid", "gpu/6")]["action"] == "reset_gpu", found


def test_all_boots_needs_a_kmsg_file(tmp_path: Path, inject_lib_dir: Path) -> None:
    node = _host_tree(tmp_path, [])
    env = nvml_inject.subprocess_env(inject_lib_dir, node.nvml_state_path, base=clean_env())
    proc = run_gpumon("--host-root", str(node.host_root), "check", "xid", "--all-boots", env=env)
    assert proc.returncode == 3 and "--kmsg-file" in proc.stderr


# -- saved state: the previous release's file, and files that do not fit ---------------------------

STATE_DATA = Path(__file__).resolve().parents[1] / "data" / "checkstate"
_SAVED_XID = ("name: saved\nsku: b200\ngpus: 8\nfaults:\n"
              + "".join(f"  - {{at_s: 2, kind: xid, gpu: {i}, code: 145, message: '{_RLW.format(words)}'}}\n"
                        for i, words in enumerate(("0x00000004 0x00000040", "0x00000004 0x00000008")))
              + "  - {at_s: 3, kind: xid, gpu: 1, code: 154, message: 'GPU recovery action changed from 0x0 "
              "(None) to 0x1 (GPU Reset Required)'}\n"
              + "".join(f"  - {{at_s: {t}, kind: xid, gpu: 3, code: 13}}\n" for t in (5, 100, 200))
              + "".join(f"  - {{at_s: {t}, kind: xid, gpu: 5, code: 74, message: '{_LINK6.format(_ECC)}'}}\n"
                        for t in (3, 20, 21))
              + "  - {at_s: 6, kind: xid, gpu: 6, code: 48}\n"
              "  - {at_s: 7, kind: xid, gpu: 2, code: 31}\n")


def _judged(findings: dict[tuple[str, int], Finding]) -> dict[tuple[str, int], dict[str, Any]]:
    # the node finding names when this instance's NVML event set opened: not the state's doing
    return {k: f.to_json() for k, f in findings.items() if k[0] != "node"}


def test_state_saved_by_the_previous_release_loads_unchanged_and_judges_the_same(sim: Any) -> None:
    # tests/data/checkstate/xid-release.json: ctx.state after these same runs of _SAVED_XID, written by
    # the release before the state was typed (an untyped dict kept by hand)
    saved = json.loads((STATE_DATA / "xid-release.json").read_text(encoding="utf-8"))
    h = sim(_SAVED_XID)
    r = _Runner(h)
    for t in (1, 10, 50, 150, 250):
        r.run(t)
    assert r.hw is not None
    before = {**saved, "boot_id": r.hw.fs.boot_id()}  # each simulated node boots with an id of its own
    assert h.states["xid"] == before  # the same JSON, key for key
    later = {t: r.run(t) for t in (300, 4000)}
    # an hour on, the app-level Xid 31 has gone quiet; the rest stand (the Xid 145 of GPU 1 follows
    # its Xid 154: reset_gpu)
    assert {(c, code) for c, code in later[4000] if c != "node"} == {
        ("gpu/3", 13), ("gpu/6", 48), ("gpu/1", 154), ("nvlink/0/10", 145), ("nvlink/1/10", 145),
        ("nvlink/5/6", 74)}
    # the file read back by a new instance (a daemon restart): every verdict as if never stopped
    fresh = _Runner(h)
    for t in (300, 4000):  # the first run reads the file, the second runs on what it kept
        ctx = fresh.context(t)
        if t == 300:
            ctx.state.clear()
            ctx.state.update(json.loads(json.dumps(before)))
        found = {(f.component, f.evidence.get("code", 0)): f for f in run_on_json(fresh.check, ctx)}
        assert _judged(found) == _judged(later[t])
    # a reboot since: nothing of the last boot is kept (gpumon.bootstate.enter_boot)
    ctx = fresh.context(4000)
    ctx.state.clear()
    ctx.state.update({**json.loads(json.dumps(before)), "boot_id": "an-earlier-boot"})
    assert [f.component for f in run_on_json(XidCheck(), ctx)] == ["node"]
    assert ctx.state["groups"] == {} and ctx.state["boot_id"] == before["boot_id"]


_GROUP = {"component": "gpu/0", "code": 13, "pci": "0000:c1:00.0", "count": 1, "first": 1.0, "last": 1.0,
          "bursts": [1.0], "samples": [], "pids": [], "processes": [], "via": [], "recovery_to": None,
          "sources": ["kernel"], "detail": None}
_MALFORMED = {
    "groups is a list": {"groups": []},
    "a group is a string": {"groups": {"gpu/0|13": "x"}},
    "a number where the burst times are": {"groups": {"gpu/0|13": {**_GROUP, "bursts": 5}}},
    "a burst time that is a string": {"groups": {"gpu/0|13": {**_GROUP, "bursts": ["1.0"]}}},
    "a component no finding accepts": {"groups": {"gpu/x|13": {**_GROUP, "component": "gpu/x"}}},
    "a severity no enum knows": {"groups": {"gpu/0|13": {
        **_GROUP, "detail": {"severity": "dire", "action": "none", "basis": "", "resolution": ""}}}},
    "a recovery action of one element": {"groups": {
        "gpu/0|154": {**_GROUP, "code": 154, "recovery_to": [1]}}},
    "a ledger entry too short": {"kernel_unmatched": [[0, 13, 5.0]]},
    "an identity that is a string": {"identities": {"0000:c1:00.0": "GPU-1"}},
    "a key of another release": {"groups": {}, "watermark": 3},
    "boot_id a number": {"boot_id": 7},
}


_XID119, _XID119_PCI = "dmesg-ctime_xid119_gsp-rpc-timeout.log", "0000:9b:00.0"


def _ctx119(tmp_path: Path, state: dict[str, Any], *, lines: bool = True) -> CheckContext:
    """A context with the Xid 119 capture's lines (or none: what a later run reads) and ``state``."""
    events = parse_file(DATA / _XID119) if lines else []
    return CheckContext(hw=Hardware(tmp_path), inventory=_inventory([_XID119_PCI]), profile=GENERIC,
                        options=XidConfig(), state=state, clock=lambda: 1_800_000_000.0,
                        kernel_log=KernelLog(events=events, source="t", boot_time=1_700_000_000.0))


@pytest.mark.parametrize("name", list(_MALFORMED))
def test_saved_state_that_does_not_fit_is_logged_once_and_started_afresh(
        name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # what the release before typed state did: AttributeError, TypeError... on every run, forever
    expected = [(f.component, f.severity, f.message) for f in run_on_json(XidCheck(), _ctx119(tmp_path, {}))]
    assert ("gpu/0", Severity.FAIL) in [e[:2] for e in expected]
    state = json.loads(json.dumps(_MALFORMED[name]))
    check = XidCheck()
    with caplog.at_level("WARNING", logger="gpumon.bootstate"):
        found = run_on_json(check, _ctx119(tmp_path, state))
        assert [(f.component, f.severity, f.message) for f in found] == expected
        # the next run goes on from what the first left: nothing is refused again, nothing lost
        again = run_on_json(check, _ctx119(tmp_path, state, lines=False))
        assert [(f.component, f.severity, f.message) for f in again] == expected
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "saved state of check xid refused, starting afresh"]
    assert isinstance(state["groups"], dict) and json.loads(json.dumps(state)) == state


def test_state_emptied_by_the_daemon_is_started_afresh(tmp_path: Path) -> None:
    # the daemon sets aside a state its check raised on (CheckStateStore.set_aside) by emptying the
    # same mapping: the check must then read it again, not go on from what it kept
    state: dict[str, Any] = {}
    check = XidCheck()
    assert "gpu/0" in [f.component for f in run_on_json(check, _ctx119(tmp_path, state))]
    state.clear()
    assert [f.component for f in run_on_json(check, _ctx119(tmp_path, state, lines=False))] == ["node"]
    assert state["groups"] == {}
