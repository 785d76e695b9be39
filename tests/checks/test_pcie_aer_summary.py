"""The pcie check on AER summary lines (issue 11): "AER: Uncorrectable (Fatal) error received", the
non-fatal one, "AER: can't recover (no error_detected callback)" and "AER: device recovery failed",
on a GPU's PCIe path. The lines are gcm's test lines (tests/data/peer-fixtures/gcm.txt, provenance in
SOURCES.md there) and the kernel's wordings quoted in tests/checks/test_pcie.py (rwth-i6/returnn#1500,
pop-os/pop#3363)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pci_tree import add_function

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.nvml import GpuInfo
from gpumon.model import Finding, Severity
from gpumon.profiles import GENERIC
from gpumon_checks.pcie import PcieCheck

PORT, GPU = "0000:00:03.0", "0000:03:00.0"




def _run(root: Path, *lines: str) -> dict[str, Finding]:
    add_function(root, f"pci0000:00/{PORT}", "0x8086", "0x060400", device="0x6f08")
    add_function(root, f"pci0000:00/{PORT}/{GPU}", "0x10de", "0x030200", device="0x2330")
    inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, GPU, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)])
    log = KernelLog(records=[parse_line(line) for line in lines], source="test", boot_time=1.7e9)
    ctx = CheckContext(hw=Hardware(root), inventory=inv, profile=GENERIC, options=None, state={},
                       kernel_log=log, clock=lambda: 1.8e9)
    return {f.component: f for f in run_on_json(PcieCheck(), ctx)}


@pytest.mark.parametrize(
    ("line", "where", "kind"),
    [
        # gcm's test lines (no source: the port that printed it; the non-fatal one moved to this port)
        ("[12345.680] pcieport 0000:00:03.0: AER: Uncorrectable (Fatal) error received", PORT, "fatal"),
        ("[12345.679] pcieport 0000:00:03.0: AER: Uncorrectable (Non-Fatal) error received", PORT,
         "nonfatal"),
        # the kernel's own wordings: 4.x ": <source>", 6.x "message received from <source>", 3.x "id="
        ("[ 1.0] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:03:00.0",
         GPU, "fatal"),
        ("[ 1.0] pcieport 0000:00:03.0: AER: Uncorrected (Non-Fatal) error message received from "
         "0000:03:00.0", GPU, "nonfatal"),
        ("[ 1.0] pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: id=0300", GPU, "fatal"),
    ],
)
def test_uncorrectable_summary_line_fails_the_function_it_names(tmp_path: Path, line: str, where: str,
                                                                 kind: str) -> None:
    found = _run(tmp_path, line)
    f = found[f"pci/{where}"]
    assert (f.severity, f.action.value) == (Severity.FAIL, "inspect_hardware"), f
    assert "summary line only" in f.message
    assert f.evidence["kernel_log"]["summary"][kind]["count"] == 1
    other = found[f"pci/{GPU if where == PORT else PORT}"]
    assert other.severity is Severity.OK


def test_cant_recover_fails_the_gpu(tmp_path: Path) -> None:
    found = _run(tmp_path, "[12345.680] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)")
    gpu = found[f"pci/{GPU}"]
    assert (gpu.severity, gpu.action.value) == (Severity.FAIL, "inspect_hardware")
    assert "not recovered" in gpu.message and "until a reset or a reboot" in gpu.message
    assert found[f"pci/{PORT}"].severity is Severity.OK


def test_corrected_summary_is_evidence_only(tmp_path: Path) -> None:
    found = _run(tmp_path, "[12345.678] pcieport 0000:00:03.0: AER: Corrected error received: 0000:03:00.0",
                 "[ 2.0] pcieport 0000:00:03.0: AER: Multiple Correctable error message received from "
                 "0000:03:00.0")
    gpu = found[f"pci/{GPU}"]
    assert gpu.severity is Severity.OK
    assert gpu.evidence["kernel_log"]["summary"]["correctable"]["count"] == 2


def test_summary_with_its_detail_lines_is_one_report(tmp_path: Path) -> None:
    # rwth-i6/returnn#1500: the summary line and the "PCIe Bus Error" detail of the same error
    found = _run(tmp_path,
                 "[ 1.0] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: "
                 "0000:00:03.0",
                 "[ 1.0] pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
                 "type=Transaction Layer, (Requester ID)",
                 "[ 1.0] pcieport 0000:00:03.0:    [14] CmpltTO                (First)")
    port = found[f"pci/{PORT}"]
    assert port.severity is Severity.FAIL
    assert "1 uncorrectable (fatal) PCIe Bus Error report(s) (CmpltTO (First))" in port.message
    assert "summary line only" not in port.message


def test_functions_off_the_watched_paths_are_not_reported(tmp_path: Path) -> None:
    # the GPU's audio function (not watched) and a device elsewhere on the bus
    found = _run(tmp_path,
                 "[ 1.0] snd_hda_intel 0000:03:00.1: AER: can't recover (no error_detected callback)",
                 "[ 1.0] pcieport 0000:00:1c.0: AER: Uncorrected (Fatal) error received: 0000:05:00.0")
    assert all(f.severity is Severity.OK for f in found.values()), found
