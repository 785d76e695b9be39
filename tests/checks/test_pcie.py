"""The pcie check: on the simulated node, on a host tree built from a real HGX H100 lspci capture,
and on real kernel-log AER lines (quoted verbatim, each with the issue thread it comes from)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.nvml import GpuInfo
from gpumon.model import Finding, Severity
from gpumon.profiles import GENERIC, builtin_profiles
from gpumon_checks.pcie import PcieCheck, PcieConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "pcie-aer"
LSPCI_H100 = DATA / "lspci-vvv_h100-sxm5-hgx_aer-correctable-errors.txt"

SIM_GPUS = ["19", "3b", "4c", "5d", "9b", "bb", "cb", "db"]  # gpumon.sim.render.GPU_BUSES
SIM_NICS = ["1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc"]


def _by(findings: Iterable[Finding]) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for f in findings:
        assert f.component not in out, f"two findings for {f.component}"
        out[f.component] = f
    return out


def _bad(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is not Severity.OK]


# --------------------------------------------------------------------------- simulated node


def test_healthy_node_every_gpu_nic_nvswitch_and_bridge_is_ok(sim: Any) -> None:
    h = sim("name: healthy\nsku: h100-sxm\n")
    for t in (1, 61):
        found = _by(h.run(PcieCheck, t=t))
        assert not _bad(found.values()), [f.message for f in _bad(found.values())]
    for i, bus in enumerate(SIM_GPUS):
        gpu = found[f"pci/0000:{bus}:00.0"]
        assert gpu.evidence["is"] == f"gpu/{i}"
        assert gpu.evidence["link"]["current"] == "Gen5 x16" and gpu.evidence["port"] == "endpoint"
        g = int(bus, 16)
        root, up, down = f"0000:{g - 4:02x}:01.0", f"0000:{g - 3:02x}:00.0", f"0000:{g - 2:02x}:00.0"
        assert gpu.evidence["upstream"] == [root, up, down]
        assert found[f"pci/{down}"].evidence["is"] == f"upstream of gpu/{i}"
        assert found[f"pci/{root}"].evidence["is"] == f"upstream of gpu/{i}, mlx5_{i}"
        assert found[f"pci/{root}"].evidence["port"] == "root_port"
        assert found[f"pci/{up}"].evidence["port"] == "switch_upstream"
        assert found[f"pci/{down}"].evidence["port"] == "switch_downstream"
    for i, bus in enumerate(SIM_NICS):
        assert found[f"pci/0000:{bus}:00.0"].evidence["is"] == f"mlx5_{i}"
    for bus in ("83", "84", "85", "86"):
        assert found[f"pci/0000:{bus}:00.0"].evidence["is"] == "NVSwitch"
    assert len(found) == 8 + 8 + 4 + 8 * 4  # GPUs, NICs, NVSwitches, root + switch up + 2 switch down


def test_uncorrectable_increase_fails_that_gpu(sim: Any) -> None:
    h = sim("name: aer\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 30, kind: aer, gpu: 3, severity: fatal, count: 2}\n"
            "  - {at_s: 30, kind: aer, gpu: 6, severity: nonfatal, count: 1}\n")
    assert not _bad(h.run(PcieCheck, t=1))
    for t in (40, 400):  # stays failed for the boot although the counters no longer rise
        bad = _by(_bad(h.run(PcieCheck, t=t)))
        assert set(bad) == {"pci/0000:5d:00.0", "pci/0000:cb:00.0"}
        for comp, gpu, kind, bit, count in (("pci/0000:5d:00.0", 3, "fatal", "DLP", 2),
                                             ("pci/0000:cb:00.0", 6, "nonfatal", "CmpltTO", 1)):
            f = bad[comp]
            assert f.evidence["is"] == f"gpu/{gpu}"
            assert (f.severity, f.action.value) == (Severity.FAIL, "inspect_hardware")
            # the simulator counts DLP (fatal) and CmpltTO (non-fatal)
            assert f.evidence[f"{kind}_errors"]["count"] == count
            assert f.evidence[f"{kind}_errors"]["errors"] == {bit: count}


def test_first_reading_since_boot_fatal_fails_nonfatal_warns(sim: Any) -> None:
    h = sim("name: before\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 0, kind: aer, gpu: 1, severity: fatal, count: 1}\n"
            "  - {at_s: 0, kind: aer, gpu: 6, severity: nonfatal, count: 3}\n")
    found = _by(_bad(h.run(PcieCheck, t=5)))
    assert set(found) == {"pci/0000:3b:00.0", "pci/0000:cb:00.0"}
    fatal, nonfatal = found["pci/0000:3b:00.0"], found["pci/0000:cb:00.0"]
    assert fatal.severity is Severity.FAIL and "before gpumon watched" in fatal.message
    assert nonfatal.severity is Severity.WARN and "3 non-fatal" in nonfatal.message
    assert nonfatal.evidence["aer_since_boot"] == {"correctable": 0, "nonfatal": 3, "fatal": 0}
    # label aer_severity: "severity" is what alerting rules route on, and would overwrite it
    assert {r[2]["aer_severity"]: (r[0], r[1]) for r in nonfatal.evidence["readings"]} == {
        "correctable": ("pcie_aer_errors_total", 0.0), "nonfatal": ("pcie_aer_errors_total", 3.0),
        "fatal": ("pcie_aer_errors_total", 0.0)}
    assert all(set(r[2]) == {"aer_severity"} for r in nonfatal.evidence["readings"])


def test_correctable_ramp_warns_and_a_slow_trickle_does_not(sim: Any) -> None:
    h = sim("name: cor\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 10, kind: aer, gpu: 0, severity: correctable, per_s: 1}\n"      # 3600/h
            "  - {at_s: 10, kind: aer, gpu: 5, severity: correctable, per_s: 0.05}\n")  # 180/h
    first = _by(h.run(PcieCheck, t=0))
    assert not _bad(first.values()) and "correctable_per_hour" not in first["pci/0000:19:00.0"].evidence
    found = _by(h.run(PcieCheck, t=130))
    [bad] = _bad(found.values())
    assert bad.component == "pci/0000:19:00.0"
    assert (bad.severity, bad.action.value) == (Severity.WARN, "inspect_hardware")
    assert 3000 < bad.evidence["correctable_per_hour"] < 3600
    slow = found["pci/0000:bb:00.0"]
    assert slow.severity is Severity.OK and 100 < slow.evidence["correctable_per_hour"] < 480


def test_counters_going_backwards_reset_the_baseline(sim: Any) -> None:
    h = sim("name: back\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 0, kind: aer, gpu: 2, severity: correctable, count: 500}\n")
    assert not _bad(h.run(PcieCheck, t=1))
    gpu = (h.node.host_root / "sys/bus/pci/devices/0000:4c:00.0").resolve()
    ctx = h.context(PcieCheck, t=100)
    # the function was removed and re-added: its statistics restart from zero
    (gpu / "aer_dev_correctable").write_text("RxErr 0\nTOTAL_ERR_COR 0\n")
    (gpu / "aer_dev_nonfatal").write_text("CmpltTO 0\nTOTAL_ERR_NONFATAL 0\n")
    found = _by(run_on_json(PcieCheck(), ctx))
    f = found["pci/0000:4c:00.0"]
    assert f.severity is Severity.OK and f.evidence["counter_resets"] == 1
    assert f.evidence.get("correctable_per_hour") is None  # no negative rate, and no rate from nothing
    ctx = h.context(PcieCheck, t=200)
    (gpu / "aer_dev_correctable").write_text("RxErr 1\nTOTAL_ERR_COR 1\n")
    (gpu / "aer_dev_nonfatal").write_text("CmpltTO 0\nTOTAL_ERR_NONFATAL 0\n")
    f = _by(run_on_json(PcieCheck(), ctx))["pci/0000:4c:00.0"]
    assert f.severity is Severity.OK and f.evidence["correctable_per_hour"] == pytest.approx(36.0)


def test_width_below_max_fails_speed_below_max_warns_only_under_load(sim: Any) -> None:
    h = sim("name: link\nsku: h100-sxm\nfaults:\n"
            "  - {at_s: 10, kind: pcie_link, gpu: 4, width: 8}\n"
            "  - {at_s: 10, kind: pcie_link, gpu: 2, gen: 3}\n"
            "  - {at_s: 50, kind: utilization, gpu: 2, pct: 95}\n")
    found = _by(h.run(PcieCheck, t=20))
    [narrow] = _bad(found.values())
    assert narrow.component == "pci/0000:9b:00.0"
    assert (narrow.severity, narrow.action.value) == (Severity.FAIL, "inspect_hardware")
    assert "x8" in narrow.message and narrow.evidence["link"]["current"] == "Gen5 x8"
    idle = found["pci/0000:4c:00.0"]
    assert "idle downshift" in idle.message and idle.evidence["link"]["gpu_utilization_pct"] == 0
    assert "idle_downshift" in idle.evidence["link"]
    bad = _by(_bad(h.run(PcieCheck, t=60)))
    assert set(bad) == {"pci/0000:9b:00.0", "pci/0000:4c:00.0"}
    busy = bad["pci/0000:4c:00.0"]
    assert (busy.severity, busy.action.value) == (Severity.WARN, "inspect_hardware")
    assert "95 %" in busy.message and "Gen3" in busy.message


def test_garbage_or_truncated_aer_file_is_unknown_for_that_device_only(sim: Any) -> None:
    h = sim("name: garbage\nsku: h100-sxm\n")
    ctx = h.context(PcieCheck, t=1)
    nic = (h.node.host_root / "sys/bus/pci/devices/0000:5e:00.0").resolve()
    gpu = (h.node.host_root / "sys/bus/pci/devices/0000:db:00.0").resolve()
    (nic / "aer_dev_fatal").write_bytes(b"Undefined 0\nDLP \xff\xfe\n")
    (gpu / "aer_dev_correctable").write_text("RxErr 0\nBadTLP 0\nBadD")
    found = _by(run_on_json(PcieCheck(), ctx))
    bad = _by(_bad(found.values()))
    assert set(bad) == {"pci/0000:5e:00.0", "pci/0000:db:00.0"}
    assert all(f.severity is Severity.UNKNOWN for f in bad.values())
    assert "aer_dev_fatal" in bad["pci/0000:5e:00.0"].message
    assert "aer_dev_correctable" in bad["pci/0000:db:00.0"].message
    assert bad["pci/0000:db:00.0"].evidence["link"]["current"] == "Gen5 x16"  # the link was still judged


def test_a_device_link_out_of_the_host_root_is_refused(sim: Any, tmp_path: Path) -> None:
    h = sim("name: escape\nsku: h100-sxm\n")
    ctx = h.context(PcieCheck, t=1)
    outside = tmp_path / "elsewhere" / "0000:19:00.0"
    outside.mkdir(parents=True)
    # a fake GPU outside the host root, with a fatal error the check must never see
    for name, text in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200"),
                       ("aer_dev_fatal", "DLP 9\nTOTAL_ERR_FATAL 9\n")):
        (outside / name).write_text(text + "\n")
    link = h.node.host_root / "sys/bus/pci/devices/0000:19:00.0"
    link.unlink()
    link.symlink_to(outside)
    found = _by(run_on_json(PcieCheck(), ctx))
    refused = found["pci/0000:19:00.0"]
    assert refused.severity is Severity.UNKNOWN and "outside the host root" in refused.message
    assert "fatal_errors" not in refused.evidence
    assert not [f for f in found.values() if f.severity in (Severity.WARN, Severity.FAIL)]


def test_kernel_log_uncorrectable_line_fails_the_port_event_driven(sim: Any) -> None:
    # The pcieport line of https://github.com/rwth-i6/returnn/issues/1500, with the bus id of the
    # simulated root port above gpu/5 (0000:b7:01.0) in place of 0000:00:03.0.
    lines = [
        "pcieport 0000:b7:01.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, "
        "(Requester ID)",
        "pcieport 0000:b7:01.0:   device [8086:6f08] error status/mask=00004020/00000000",
        "pcieport 0000:b7:01.0:    [ 5] SDES                  ",
        "pcieport 0000:b7:01.0:    [14] CmpltTO                (First)",
    ]
    faults = "".join(f"  - {{at_s: 30, kind: kernel_line, text: {line!r}}}\n" for line in lines)
    h = sim(f"name: kmsg\nsku: h100-sxm\nfaults:\n{faults}")
    [bad] = _bad(h.run(PcieCheck, t=31))
    assert bad.component == "pci/0000:b7:01.0" and bad.evidence["is"] == "upstream of gpu/5, mlx5_5"
    assert (bad.severity, bad.action.value) == (Severity.FAIL, "inspect_hardware")
    log = bad.evidence["kernel_log"]["fatal"]
    assert log["count"] == 1 and log["errors"] == ["SDES", "CmpltTO (First)"]
    assert log["device_ids"] == "8086:6f08" and log["status_mask"] == "00004020/00000000"
    [again] = _bad(h.run(PcieCheck, t=90))  # no new line, same boot: still failed
    assert again.component == "pci/0000:b7:01.0"


def test_no_pci_tree_is_skipped(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, [])
    [f] = run_on_json(PcieCheck(), ctx)
    assert f.severity is Severity.SKIPPED and "sys/bus/pci/devices" in f.message
    assert PcieCheck().supported(Inventory()) is not None


# --------------------------------------------------------------------------- hand-built trees, real lines


def _ctx(root: Path, gpus: list[str], records: Sequence[str] = (), *, available: bool = True,
         state: dict[str, Any] | None = None, now: float = 1_800_000_000.0, profile: str | None = None,
         ) -> CheckContext:
    infos = [GpuInfo(i, f"GPU-{i}", None, bus, "NVIDIA H100 80GB HBM3", "hopper", 18, i)
             for i, bus in enumerate(gpus)]
    log = KernelLog(records=[parse_line(r) for r in records], available=available,
                    error=None if available else "permission denied", source="test")
    return CheckContext(hw=Hardware(root), inventory=Inventory(gpus=infos),
                        profile=builtin_profiles()[profile] if profile else GENERIC, options=PcieConfig(),
                        state=state if state is not None else {}, kernel_log=log, clock=lambda: now)


def _function(root: Path, path: str, vendor: str, device: str, cls: str, *,
              link: tuple[str, str, str, str] = ("8.0 GT/s PCIe", "8.0 GT/s PCIe", "16", "16")) -> None:
    bdf = path.rsplit("/", 1)[-1]
    d = root / "sys/devices" / path
    d.mkdir(parents=True)
    files = {"vendor": vendor, "device": device, "class": cls, "current_link_speed": link[0],
             "max_link_speed": link[1], "current_link_width": link[2], "max_link_width": link[3]}
    for kind, (name, total) in pcihw.AER_FILES.items():
        files[name] = f"{'RxErr' if kind == 'correctable' else 'DLP'} 0\n{total} 0"
    for name, text in files.items():
        (d / name).write_text(text + "\n")
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / bdf).symlink_to(f"../../../devices/{path}")


# https://github.com/rwth-i6/returnn/issues/1500 (comment by albertz, 2024-01-21), dmesg -H
RETURNN_1500 = """\
[  +0.000844] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)
[  +0.000001] snd_hda_intel 0000:03:00.1: AER: can't recover (no error_detected callback)
[  +0.000008] pcieport 0000:00:03.0: AER: device recovery failed
[  +0.000001] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:00:03.0
[  +0.000004] pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)
[  +0.000898] pcieport 0000:00:03.0:   device [8086:6f08] error status/mask=00004020/00000000
[  +0.000889] pcieport 0000:00:03.0:    [ 5] SDES                  
[  +0.000894] pcieport 0000:00:03.0:    [14] CmpltTO                (First)
[  +0.000921] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)
[  +0.000002] snd_hda_intel 0000:03:00.1: AER: can't recover (no error_detected callback)
[  +1.050439] pcieport 0000:00:03.0: AER: Root Port link has been reset (0)
[  +0.000041] pcieport 0000:00:03.0: AER: device recovery failed
"""  # noqa: E501, W291 (lines and trailing blanks as pasted)

# https://github.com/pop-os/pop/issues/3363 (comment by Vetpetmon), journal of an RTX 3060 Ti host, kernel 6.x
POP_3363 = """\
Sep 19 16:18:04 bubz kernel: [68185.875052] pcieport 0000:00:03.1: AER: Multiple Correctable error message received from 0000:00:00.0
Sep 19 16:18:04 bubz kernel: [68185.875237] pcieport 0000:00:03.1: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)
Sep 19 16:18:04 bubz kernel: [68185.875244] pcieport 0000:00:03.1:   device [1022:1453] error status/mask=000011c0/00006000
Sep 19 16:18:04 bubz kernel: [68185.875252] pcieport 0000:00:03.1:    [ 6] BadTLP                
Sep 19 16:18:04 bubz kernel: [68185.875259] pcieport 0000:00:03.1:    [ 7] BadDLLP               
Sep 19 16:18:04 bubz kernel: [68185.875265] pcieport 0000:00:03.1:    [ 8] Rollover              
Sep 19 16:18:04 bubz kernel: [68185.875270] pcieport 0000:00:03.1:    [12] Timeout               
Sep 19 16:18:04 bubz kernel: [68185.875295] nvidia 0000:07:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)
Sep 19 16:18:04 bubz kernel: [68185.875301] nvidia 0000:07:00.0:   device [10de:2184] error status/mask=00001000/0000a000
Sep 19 16:18:04 bubz kernel: [68185.875308] nvidia 0000:07:00.0:    [12] Timeout               
"""  # noqa: E501, W291 (lines and trailing blanks as pasted)


def test_real_fatal_report_on_the_root_port_above_a_gpu(tmp_path: Path) -> None:
    # the thread names the root port [8086:6f08] and the GPU's bus id; the GPU's device id is not in it
    _function(tmp_path, "pci0000:00/0000:00:03.0", "0x8086", "0x6f08", "0x060400")
    _function(tmp_path, "pci0000:00/0000:00:03.0/0000:03:00.0", "0x10de", "0x0000", "0x030000")
    found = _by(run_on_json(PcieCheck(), _ctx(tmp_path, ["0000:03:00.0"], RETURNN_1500.splitlines())))
    port, gpu = found["pci/0000:00:03.0"], found["pci/0000:03:00.0"]
    assert (port.severity, port.action.value) == (Severity.FAIL, "inspect_hardware")
    assert port.evidence["is"] == "upstream of gpu/0"
    fatal = port.evidence["kernel_log"]["fatal"]
    assert fatal["count"] == 1 and fatal["errors"] == ["SDES", "CmpltTO (First)"]
    assert fatal["device_ids"] == "8086:6f08"
    # "nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)" (twice): the GPU itself
    # was not brought back (issue 11)
    assert (gpu.severity, gpu.action.value) == (Severity.FAIL, "inspect_hardware")
    assert gpu.evidence["kernel_log"]["not_recovered"]["can't recover (no error_detected callback)"][
        "count"] == 2 and "not recovered" in gpu.message


def test_real_correctable_reports_are_counted_not_failed(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:00/0000:00:03.1", "0x1022", "0x1453", "0x060400")
    _function(tmp_path, "pci0000:00/0000:00:03.1/0000:07:00.0", "0x10de", "0x2184", "0x030000")
    state: dict[str, Any] = {}
    found = _by(run_on_json(PcieCheck(),
                            _ctx(tmp_path, ["0000:07:00.0"], POP_3363.splitlines(), state=state)))
    assert not _bad(found.values())
    gpu = found["pci/0000:07:00.0"]
    cor = gpu.evidence["kernel_log"]["correctable"]
    assert cor["count"] == 1 and cor["errors"] == ["Timeout"] and cor["device_ids"] == "10de:2184"
    assert "1 corrected error report(s)" in gpu.message
    assert found["pci/0000:00:03.1"].evidence["kernel_log"]["correctable"]["errors"] == [
        "BadTLP", "BadDLLP", "Rollover", "Timeout"]
    # the same records handed again (a second source, a daemon restart) are counted again: the log is
    # evidence, the counters in sysfs are the criterion
    found = _by(run_on_json(PcieCheck(),
                            _ctx(tmp_path, ["0000:07:00.0"], POP_3363.splitlines(), state=state)))
    assert found["pci/0000:07:00.0"].evidence["kernel_log"]["correctable"]["count"] == 2


def test_unreadable_kernel_log_is_unknown_but_sysfs_is_still_read(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:00/0000:00:03.0", "0x8086", "0x6f08", "0x060400")
    _function(tmp_path, "pci0000:00/0000:00:03.0/0000:03:00.0", "0x10de", "0x2330", "0x030200")
    found = _by(run_on_json(PcieCheck(), _ctx(tmp_path, ["0000:03:00.0"], available=False)))
    assert found["node"].severity is Severity.UNKNOWN and "permission denied" in found["node"].message
    assert found["pci/0000:03:00.0"].severity is Severity.OK


def test_gpu_link_below_the_profile_warns_wrong_slot(tmp_path: Path) -> None:
    gen4 = ("16.0 GT/s PCIe", "16.0 GT/s PCIe", "16", "16")
    gen5 = ("16.0 GT/s PCIe", "32.0 GT/s PCIe", "16", "16")
    _function(tmp_path, "pci0000:00/0000:00:01.0", "0x8086", "0x352a", "0x060400", link=gen4)  # a Gen4 slot
    _function(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.0", "0x10de", "0x2330", "0x030200", link=gen5)
    found = _by(run_on_json(PcieCheck(), _ctx(tmp_path, ["0000:01:00.0"], profile="h100-sxm")))
    gpu = found["pci/0000:01:00.0"]
    assert (gpu.severity, gpu.action.value) == (Severity.WARN, "inspect_hardware")
    assert "only Gen4" in gpu.message and "expects Gen5" in gpu.message
    assert gpu.evidence["link"]["expected"] == "Gen4 x16"  # trained as far as the slot allows: not a fault
    assert found["pci/0000:00:01.0"].severity is Severity.OK


def test_vanished_device_is_unknown(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:00/0000:00:03.0", "0x8086", "0x6f08", "0x060400")
    _function(tmp_path, "pci0000:00/0000:00:03.0/0000:03:00.0", "0x10de", "0x2330", "0x030200")
    state: dict[str, Any] = {}
    run_on_json(PcieCheck(), _ctx(tmp_path, ["0000:03:00.0"], state=state))
    (tmp_path / "sys/bus/pci/devices/0000:03:00.0").unlink()
    found = _by(run_on_json(PcieCheck(), _ctx(tmp_path, [], state=state)))
    gone = found["pci/0000:03:00.0"]
    assert gone.severity is Severity.UNKNOWN and "no longer listed" in gone.message
    assert gone.evidence["was"] == "gpu/0"


def test_virtual_functions_are_not_watched_and_only_function_0_owns_the_link(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:00/0000:00:01.0", "0x8086", "0x352a", "0x060400")
    nic = "pci0000:00/0000:00:01.0/0000:01:00.0"
    _function(tmp_path, nic, "0x15b3", "0x101d", "0x020000")
    # function 1 of the same card with link registers that disagree with function 0
    _function(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.1", "0x15b3", "0x101d", "0x020000",
              link=("8.0 GT/s PCIe", "8.0 GT/s PCIe", "2", "16"))
    # an SR-IOV VF: reserved link registers read as width 0
    _function(tmp_path, "pci0000:00/0000:00:01.0/0000:01:00.2", "0x15b3", "0x101e", "0x020000",
              link=("Unknown", "8.0 GT/s PCIe", "0", "16"))
    (tmp_path / "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.2/physfn").symlink_to(f"../../../{nic}")
    found = _by(run_on_json(PcieCheck(), _ctx(tmp_path, [])))
    assert set(found) == {"pci/0000:00:01.0", "pci/0000:01:00.0", "pci/0000:01:00.1"}
    assert not _bad(found.values())
    assert found["pci/0000:01:00.1"].evidence["link"]["judged"].startswith("at function 0 (0000:01:00.0)")


# --------------------------------------------------------------------------- the real HGX H100 capture


_CLASSES = {  # class and subclass by lspci's name (pci.ids "C" section)
    "3D controller": "0302", "VGA compatible controller": "0300", "PCI bridge": "0604", "Bridge": "0680",
    "Host bridge": "0600", "ISA bridge": "0601", "Ethernet controller": "0200",
    "Infiniband controller": "0207",
    "Non-Volatile memory controller": "0108", "Serial Attached SCSI controller": "0107",
    "SATA controller": "0106", "USB controller": "0c03", "SMBus": "0c05", "Serial bus controller": "0c80",
    "System peripheral": "0880", "Performance counters": "1101", "Communication controller": "0780",
    "RAM memory": "0500", "Memory controller": "0580",
}
_VENDORS = {  # pci.ids vendor names as lspci prints them
    "Intel Corporation": "0x8086", "NVIDIA Corporation": "0x10de", "Mellanox Technologies": "0x15b3",
    "Broadcom / LSI": "0x1000", "Broadcom Inc. and subsidiaries": "0x14e4", "PLDA": "0x1556",
    "Matrox Electronics Systems Ltd.": "0x102b", "Micron Technology Inc": "0x1344",
    "PMC-Sierra Inc.": "0x11f8",
}
_NAMED = {  # lspci printed a name instead of "Device XXXX": the id pci.ids gives that name
    "MT2910 Family [ConnectX-7]": "0x1021", "MT2892 Family [ConnectX-6 Dx]": "0x101d",
    "PEX890xx PCIe Gen 5 Switch": "0xc030",  # pci.ids also names 0xc034 so; the check does not use it
    "NetXtreme BCM5720 Gigabit Ethernet PCIe": "0x165f", "PCI Express Bridge": "0xbe00",
    "Integrated Matrox G200eW3 Graphics Controller": "0x0536",
    "NVMe DC SSD [3DNAND, Sentinel Rock Controller]": "0x0b60", "PCIe Switch management endpoint": "0x00b2",
}
_HEAD_RE = re.compile(r"^(?P<bdf>[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) (?P<cls>[^:\[]+?)"
                      r"(?: \[(?P<code>[0-9a-f]{4})\])?: (?P<rest>.*)$")
_BITS_RE = re.compile(r"(\w+)([+-])")


@dataclass
class _Lspci:
    bdf: str
    vendor: str
    device: str
    pci_class: str
    secondary: str | None = None
    express: str | None = None  # Root Port, Upstream Port, Downstream Port, Endpoint
    lnkcap: tuple[str, str] | None = None
    lnksta: tuple[str, str] | None = None
    aer: dict[str, dict[str, bool]] = field(default_factory=dict)  # UESta/UEMsk/UESvrt/CESta/CEMsk


def _parse_lspci(text: str) -> list[_Lspci]:
    out: list[_Lspci] = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        m = _HEAD_RE.match(lines[0])
        assert m, lines[0]
        rest = m.group("rest")
        vendor_name = max((v for v in _VENDORS if rest.startswith(v + " ")), key=len)
        name = re.sub(r" \((?:rev|prog-if) [^)]*\)", "", rest[len(vendor_name) + 1:]).strip()
        name = re.sub(r" \(prog-if [0-9a-f]{2} \[[^]]*\]\)$", "", name)
        device = f"0x{name[7:11]}" if re.fullmatch(r"Device [0-9a-f]{4}", name) else _NAMED[name]
        progif = re.search(r"\(prog-if ([0-9a-f]{2})", rest)
        cls = m.group("code") or _CLASSES[m.group("cls")]
        fn = _Lspci(f"0000:{m.group('bdf')}", _VENDORS[vendor_name], device,
                    f"0x{cls}{progif.group(1) if progif else '00'}")
        for line in lines[1:]:
            s = line.strip()
            if s.startswith("Bus: primary="):
                fn.secondary = re.search(r"secondary=([0-9a-f]{2})", s).group(1)  # type: ignore[union-attr]
            elif (e := re.search(r"Express \(v\d\) (Root Port|Upstream Port|Downstream Port|Endpoint)", s)):
                fn.express = e.group(1)
            elif s.startswith(("LnkCap:", "LnkSta:")):
                ls = re.search(r"Speed ([0-9.]+)GT/s.*?Width x(\d+)", s)
                assert ls, s
                setattr(fn, s[:6].lower(), (ls.group(1), ls.group(2)))
            elif s.startswith(("UESta:", "UEMsk:", "UESvrt:", "CESta:", "CEMsk:")):
                key, bits = s.split(":", 1)
                fn.aer[key] = {b: v == "+" for b, v in _BITS_RE.findall(bits)}
        out.append(fn)
    return out


_LSPCI_TO_KERNEL = {"AdvNonFatalErr": "NonFatalErr"}
_COR = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
_UNCOR = ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
          "ECRC", "UnsupReq", "ACSViol"]


def _aer_files(fn: _Lspci) -> dict[str, str]:
    """AER counter files consistent with the captured registers.

    lspci shows the AER status registers, not the kernel's counters. A status bit that is set and
    not masked was signalled at least once, so it counts 1 (its severity from UESvrt); a masked bit
    never reaches the kernel and counts 0. TOTAL is 1 when anything was signalled (one message
    may carry several bits).
    """
    counts: dict[str, dict[str, int]] = {"correctable": {}, "nonfatal": {}, "fatal": {}}
    for bit, set_ in fn.aer.get("CESta", {}).items():
        if set_ and not fn.aer["CEMsk"].get(bit, False):
            counts["correctable"][_LSPCI_TO_KERNEL.get(bit, bit)] = 1
    for bit, set_ in fn.aer.get("UESta", {}).items():
        if set_ and not fn.aer["UEMsk"].get(bit, False):
            counts["fatal" if fn.aer["UESvrt"].get(bit) else "nonfatal"][bit] = 1
    files = {}
    for kind, (name, total) in pcihw.AER_FILES.items():
        names = _COR if kind == "correctable" else _UNCOR
        body = "".join(f"{n} {counts[kind].get(n, 0)}\n" for n in names)
        files[name] = body + f"{total} {1 if counts[kind] else 0}\n"
    return files


def _speed(gts: str) -> str:
    return f"{float(gts):.1f} GT/s PCIe"


def _host_from_lspci(text: str, root: Path) -> dict[str, _Lspci]:
    """A host-root tree with every function of the capture where the kernel would put it."""
    fns = {f.bdf: f for f in _parse_lspci(text)}
    bridge_of_bus = {f.secondary: f.bdf for f in fns.values() if f.secondary}

    def path(bdf: str) -> str:
        parent = bridge_of_bus.get(bdf[5:7])
        return f"{path(parent)}/{bdf}" if parent else f"pci0000:{bdf[5:7]}/{bdf}"

    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    for bdf, fn in fns.items():
        d = root / "sys/devices" / path(bdf)
        d.mkdir(parents=True, exist_ok=True)
        files = {"vendor": fn.vendor, "device": fn.device, "class": fn.pci_class}
        if fn.lnkcap and fn.lnksta:
            files.update(max_link_speed=_speed(fn.lnkcap[0]), max_link_width=fn.lnkcap[1],
                         current_link_speed=_speed(fn.lnksta[0]), current_link_width=fn.lnksta[1])
        if fn.aer:
            files.update(_aer_files(fn))
        for name, value in files.items():
            (d / name).write_text(value if value.endswith("\n") else value + "\n")
        (bus / bdf).symlink_to(f"../../../devices/{path(bdf)}")
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text("3d0c5f0e-0d8e-4a52-9a3e-000000000001\n")
    return fns


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, _Lspci]]:
    root = tmp_path_factory.mktemp("h100")
    return root, _host_from_lspci(LSPCI_H100.read_text(encoding="utf-8"), root)


def _h100_gpus(fns: dict[str, _Lspci]) -> list[str]:
    return sorted(b for b, f in fns.items() if f.vendor == "0x10de" and f.pci_class.startswith("0x0302"))


def test_real_h100_capture_maps_every_gpu_nic_and_port_without_false_positive(
        h100: tuple[Path, dict[str, _Lspci]]) -> None:
    root, fns = h100
    gpus = _h100_gpus(fns)
    cx7 = sorted(b for b, f in fns.items() if f.device == "0x1021")
    assert len(gpus) == 8 and len(cx7) == 8
    findings = run_on_json(PcieCheck(), _ctx(root, gpus, profile="h100-sxm"))
    assert not _bad(findings), [f.message for f in _bad(findings)]
    found = _by(findings)
    for i, bdf in enumerate(gpus):
        f = found[f"pci/{bdf}"]
        assert f.evidence["is"] == f"gpu/{i}" and f.evidence["link"]["current"] == "Gen5 x16"
        assert len(f.evidence["upstream"]) == 3  # root port, switch upstream port, switch downstream port
        for port in f.evidence["upstream"]:
            assert f"gpu/{i}" in found[f"pci/{port}"].evidence["is"]
    for bdf in cx7:
        f = found[f"pci/{bdf}"]
        assert f.evidence["is"] == "Mellanox NIC" and f.evidence["link"]["current"] == "Gen5 x16"
        assert len(f.evidence["upstream"]) == 3
        assert all(found[f"pci/{p}"].severity is Severity.OK for p in f.evidence["upstream"])
    nvswitches = [c for c, f in found.items() if f.evidence.get("is") == "NVSwitch"]
    assert len(nvswitches) == 4
    # sysfs says nothing of port types: the check's reading must agree with lspci's Express capability
    roles = {"root_port": "Root Port", "switch_upstream": "Upstream Port",
             "switch_downstream": "Downstream Port", "endpoint": "Endpoint"}
    for comp, f in found.items():
        assert roles[f.evidence["port"]] == fns[comp[4:]].express, comp
    # ports above NVMe drives hold a latched Unsupported Request; they are not on a GPU/NIC path
    for port in ("0000:4a:00.0", "0000:5b:00.0", "0000:99:00.0", "0000:b9:00.0", "0000:c9:00.0",
                 "0000:d9:00.0"):
        aer = pcihw.read_aer(Hardware(root).fs, pcihw.read_function(Hardware(root).fs, port))
        assert aer is not None and aer.nonfatal.total == 1
        assert f"pci/{port}" not in found


def test_real_h100_capture_nonfatal_rise_on_a_switch_port_fails_that_port(
        h100: tuple[Path, dict[str, _Lspci]], tmp_path: Path) -> None:
    root, fns = h100
    gpus = _h100_gpus(fns)
    state: dict[str, Any] = {}
    assert not _bad(run_on_json(PcieCheck(), _ctx(root, gpus, state=state)))
    fs = Hardware(root).fs
    port = pcihw.read_function(fs, gpus[3]).parent
    assert port is not None
    nonfatal = root / pcihw.read_function(fs, port).path / "aer_dev_nonfatal"
    saved = nonfatal.read_text()
    try:
        nonfatal.write_text(saved.replace("CmpltTO 0", "CmpltTO 1").replace("TOTAL_ERR_NONFATAL 0",
                                                                           "TOTAL_ERR_NONFATAL 1"))
        [bad] = _bad(run_on_json(PcieCheck(), _ctx(root, gpus, state=state, now=1_800_000_060.0)))
    finally:
        nonfatal.write_text(saved)
    assert bad.component == f"pci/{port}" and bad.evidence["is"] == "upstream of gpu/3"
    assert (bad.severity, bad.action.value) == (Severity.FAIL, "inspect_hardware")
    assert bad.evidence["nonfatal_errors"]["errors"] == {"CmpltTO": 1}
