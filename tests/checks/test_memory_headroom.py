"""The memory_headroom bootstrap check: real nvidia-smi -q captures and simulated ECC / row-remap faults,
served through the NVML injection library under the real nvidia-ml-py (captures: tests/data/nvidia-smi-q,
provenance in its SOURCES.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nvidia_smi_capture import load, run_check

from gpumon.model import Action, Finding, Severity
from gpumon.sim.nvml_state import NvmlNodeState
from gpumon_checks.memory import MemoryCheck
from gpumon_checks.memory_headroom import MemoryHeadroomCheck, MemoryHeadroomConfig

SMI = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-q"


def _sim(sim: Callable[..., Any], faults: str = "") -> list[Finding]:
    h = sim("name: mem\nsku: h100-sxm\n" + (f"faults:\n{faults}" if faults else ""))
    findings: list[Finding] = h.run(MemoryHeadroomCheck, 0.0)
    return findings


def _gpu(findings: list[Finding], index: int) -> Finding:
    [f] = [f for f in findings if f.component == f"gpu/{index}"]
    return f


def test_healthy_node_has_full_headroom(sim: Callable[..., Any]) -> None:
    findings = _sim(sim)
    assert [f.component for f in findings] == [f"gpu/{i}" for i in range(8)]
    assert {(f.check, f.severity) for f in findings} == {("memory_headroom", Severity.OK)}
    e = findings[0].evidence
    assert e["banks_with_spare_rows_pct"] == 100.0 and e["aggregate_uncorrectable_not_remapped"] == 0
    assert e["remapped_rows_uncorrectable_limit"] == 8


def test_real_h100_captures_pass(nvml_state: Path, tmp_path: Path) -> None:
    for name in ("h100x8_535.161.08.txt", "h100x8_535.183.01.txt"):
        findings = run_check(MemoryHeadroomCheck, load(SMI / name).state, nvml_state, tmp_path / "host")
        assert len(findings) == 8 and {f.severity for f in findings} == {Severity.OK}, name


def test_real_a10_with_a_pending_remap_must_be_reset_first(nvml_state: Path, tmp_path: Path) -> None:
    a10 = load(SMI / "a10x1_535.129.03.txt").state
    [f] = run_check(MemoryHeadroomCheck, a10, nvml_state, tmp_path / "host")
    assert (f.severity, f.action) == (Severity.FAIL, Action.RESET_GPU)
    assert "row remap pending (4 uncorrectable" in f.message
    # the same verdict as the continuous check on the same reading
    [m] = run_check(MemoryCheck, a10, nvml_state, tmp_path / "host")
    assert (m.severity, m.action) == (f.severity, f.action)


def test_remap_pending_and_failure(sim: Callable[..., Any]) -> None:
    findings = _sim(sim, "  - {at_s: 0, kind: remap, gpu: 2, pending: true, uncorrected: 3}\n"
                         "  - {at_s: 0, kind: remap, gpu: 5, failure: true, uncorrected: 7}\n")
    pending, failed = _gpu(findings, 2), _gpu(findings, 5)
    assert (pending.severity, pending.action) == (Severity.FAIL, Action.RESET_GPU)
    assert pending.message.startswith("GPU 2: row remap pending (3 uncorrectable, 0 correctable rows "
                                      "remapped)")
    assert (failed.severity, failed.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "row remapping failed (NVIDIA's RMA criterion" in failed.message


def test_many_remapped_rows_fail_the_admission(sim: Callable[..., Any]) -> None:
    findings = _sim(sim, "  - {at_s: 0, kind: remap, gpu: 1, uncorrected: 600}\n"
                         "  - {at_s: 0, kind: remap, gpu: 3, uncorrected: 8}\n")
    many, some = _gpu(findings, 1), _gpu(findings, 3)
    assert (many.severity, many.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "600 rows remapped for uncorrectable errors (> 512): too little spare memory left" in many.message
    # at the profile's limit but under Azure's: the continuous check's warning, not a failure
    assert (some.severity, some.action) == (Severity.WARN, Action.INSPECT_HARDWARE)
    assert "8 rows remapped for uncorrectable errors (>= 8, profile h100-sxm)" in some.message


def test_banks_without_spare_rows(sim: Callable[..., Any]) -> None:
    findings = _sim(sim, "  - {at_s: 0, kind: remap, gpu: 4, banks_none: 2, banks_low: 254}\n")
    f = _gpu(findings, 4)
    assert (f.severity, f.action) == (Severity.WARN, Action.INSPECT_HARDWARE)
    assert "2 memory bank(s) have no spare rows left" in f.message and "254 memory bank(s) low" in f.message
    assert f.evidence["banks_with_spare_rows_pct"] == round(100 * 2558 / 2560, 2)


def test_volatile_uncorrectable_errors(sim: Callable[..., Any]) -> None:
    f = _gpu(_sim(sim, "  - {at_s: 0, kind: ecc, gpu: 6, uncorrected: 2}\n"), 6)
    assert (f.severity, f.action) == (Severity.FAIL, Action.RESET_GPU)
    assert "2 uncorrectable ECC error(s) since the last reset" in f.message
    # no row was remapped for them: also said, as a warning
    assert "2 were not absorbed by row remapping" in f.message


def test_lifetime_counts_after_a_reset(nvml_state: Path, tmp_path: Path) -> None:
    # volatile counts cleared by a reset; the aggregate ones remember
    node = NvmlNodeState.hgx(2)
    node.gpus[0].ecc_aggregate_uncorrected = 5
    node.gpus[0].remapped_rows_uncorrected = 3
    node.gpus[1].ecc_aggregate_corrected = 25_000_000
    f0, f1 = run_check(MemoryHeadroomCheck, node, nvml_state, tmp_path / "host")
    assert (f0.severity, f0.action) == (Severity.WARN, Action.NONE)
    assert ("5 uncorrectable ECC errors over the GPU's life but 3 rows remapped for them: 2 were not absorbed"
            in f0.message)
    assert f0.evidence["aggregate_uncorrectable_not_remapped"] == 2
    assert (f1.severity, f1.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "25000000 ECC errors over the GPU's life (aggregate; > 20000000)" in f1.message
    # thresholds are options
    relaxed = MemoryHeadroomConfig(aggregate_errors_fail=30_000_000)
    _, f1 = run_check(MemoryHeadroomCheck, node, nvml_state, tmp_path / "host", options=relaxed)
    assert f1.severity is Severity.OK
