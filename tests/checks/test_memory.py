"""The memory check on real captures (nvidia-smi -q and page-retirement / remapped-rows captures, served
through the NVML injection library), on simulated ECC / remap faults, and fuzzing of the converter.
Captures: tests/data/nvidia-smi-q and tests/data/remapped-rows, provenance in their SOURCES.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvidia_smi_capture import (
    NOT_SUPPORTED,
    by_component,
    load,
    parse_capture,
    run_check,
    to_node_state,
)

from gpumon.errors import ConfigError
from gpumon.model import Action, Finding, Severity
from gpumon.schema import Source, build
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, render_state
from gpumon_checks.memory import MemoryCheck, MemoryConfig
from gpumon_checks.thermal import ThermalCheck

DATA = Path(__file__).resolve().parents[1] / "data"
SMI = DATA / "nvidia-smi-q"
REMAP = DATA / "remapped-rows"
H100_CAPTURES = ["h100x8_535.161.08.txt", "h100x8_535.183.01.txt"]


def _run(path: Path, nvml_state: Path, tmp_path: Path, **kw: Any) -> list[Finding]:
    return run_check(MemoryCheck, load(path).state, nvml_state, tmp_path / "host", **kw)


# ------------------------------------------------------------------------------- real captures


@pytest.mark.parametrize("name", H100_CAPTURES)
def test_real_h100_captures_have_healthy_memory(name: str, nvml_state: Path, tmp_path: Path) -> None:
    text = (SMI / name).read_text()
    # what the capture shows, read without the converter: 8 GPUs, every ECC / remap count 0
    assert len(re.findall(r"^\s+DRAM Uncorrectable\s+: 0$", text, re.MULTILINE)) == 16
    assert len(re.findall(r"^\s+Remapping Failure Occurred\s+: No$", text, re.MULTILINE)) == 8
    assert len(re.findall(r"^\s+Max\s+: 2560 bank\(s\)$", text, re.MULTILINE)) == 8
    findings = _run(SMI / name, nvml_state, tmp_path)
    assert [f.component for f in findings] == [f"gpu/{i}" for i in range(8)]
    assert {f.severity for f in findings} == {Severity.OK}, [f.message for f in findings]
    for f in findings:
        e = f.evidence
        assert e["architecture"] == "hopper" and e["ecc_mode"] == {"current": True, "pending": True}
        assert set(e["ecc"].values()) == {0}
        assert e["remapped_rows"] == {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False}
        assert e["remap_histogram"] == {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0}
        assert e["remapped_rows_uncorrectable_limit"] == 8  # profile h100-sxm
        assert "retired_pages" not in e  # Hopper remaps rows; page retirement is not read


def test_real_a10_with_a_pending_row_remap(nvml_state: Path, tmp_path: Path) -> None:
    # gpud labelled this capture '.valid', but it shows Uncorrectable Error 4, Pending Yes
    assert "Pending                           : Yes" in (SMI / "a10x1_535.129.03.txt").read_text()
    [f] = _run(SMI / "a10x1_535.129.03.txt", nvml_state, tmp_path)
    assert (f.severity, f.action) == (Severity.FAIL, Action.RESET_GPU)
    assert "row remap pending (4 uncorrectable" in f.message
    assert f.evidence["remapped_rows"]["uncorrected"] == 4
    assert f.evidence["remapped_rows_uncorrectable_limit"] is None  # no A10 profile: count not judged
    assert f.evidence["remap_histogram"]["max"] == 192


def test_real_rtx4090_ecc_off_is_not_flagged_on_a_geforce(nvml_state: Path, tmp_path: Path) -> None:
    findings = _run(SMI / "rtx4090x8_535.154.05.txt", nvml_state, tmp_path)
    # not a fault on a GeForce, but ECC errors cannot be judged: skipped, never ok
    assert len(findings) == 8 and {f.severity for f in findings} == {Severity.SKIPPED}
    assert all(f.evidence["brand"] == 5 and "not a datacenter GPU" in f.message for f in findings)


def test_real_titan_v_reports_what_it_cannot_read(nvml_state: Path, tmp_path: Path) -> None:
    # Volta: ECC Mode N/A and Retired Pages N/A on this TITAN V: nothing judged, nothing called ok
    findings = _run(SMI / "titanv_x1_560.35.03.txt", nvml_state, tmp_path)
    assert [f.severity for f in findings] == [Severity.SKIPPED, Severity.SKIPPED]
    assert "ECC mode not reported" in findings[0].message
    assert "retired pages not reported" in findings[1].message


def test_real_truncated_capture(nvml_state: Path, tmp_path: Path) -> None:
    converted = load(SMI / "h100x8_535.183.01_truncated_invalid.txt")
    assert converted.attached_gpus == 8 and len(converted.gpus) == 1  # cut inside the first GPU
    assert converted.gpus[0].state.uuid == "GPU-566e6f65-c38e-b12f-4824-6944218668b9"
    findings = _run(SMI / "h100x8_535.183.01_truncated_invalid.txt", nvml_state, tmp_path)
    assert [f.severity for f in findings] == [Severity.SKIPPED, Severity.SKIPPED]
    assert not any(f.severity is Severity.OK for f in findings)


def test_real_remap_pending_fragment(nvml_state: Path, tmp_path: Path) -> None:
    converted = load(REMAP / ("issue_gpud-80_nvidia-smi-q_remapped-rows_uncorrectable4_pending-yes"
                              "_FRAGMENT.txt"))
    # the fragment has no failure line: that one value is the simulator's "No", and says so
    assert "remapped_rows_failure" in converted.gpus[0].assumed
    findings = run_check(MemoryCheck, converted.state, nvml_state, tmp_path / "host")
    main, *skipped = findings
    assert (main.severity, main.action) == (Severity.FAIL, Action.RESET_GPU)
    assert main.evidence["remapped_rows"] == {"corrected": 0, "uncorrected": 4, "pending": True,
                                              "failure": False}
    assert [f.severity for f in skipped] == [Severity.SKIPPED, Severity.SKIPPED]
    assert {"ECC mode", "row remapper histogram"} == {f.message.split(" not reported")[0] for f in skipped}


def test_real_page_retirement_clean(nvml_state: Path, tmp_path: Path) -> None:
    found = by_component(_run(REMAP / "nvidia-smi-q-d-PAGE_RETIREMENT_8gpu_535.86.10_clean.txt",
                              nvml_state, tmp_path))
    assert len(found) == 8
    for main, ecc in found.values():
        assert main.severity is Severity.OK and main.evidence["retired_pages"]["single_bit"] == 0
        assert ecc.severity is Severity.SKIPPED  # -d PAGE_RETIREMENT shows no ECC section


# What the bad capture shows, GPU by GPU: (single-bit, double-bit, pending) -> the verdict.
RETIRED = [
    (60, 5, False, Severity.FAIL, Action.INSPECT_HARDWARE),   # 65 pages
    (2, 61, True, Severity.FAIL, Action.INSPECT_HARDWARE),    # 63 pages, also pending
    (0, 0, False, Severity.OK, Action.NONE),
    (6, 0, True, Severity.FAIL, Action.RESET_GPU),            # pending only
    (0, 0, False, Severity.OK, Action.NONE),
    (20, 45, True, Severity.FAIL, Action.INSPECT_HARDWARE),   # 65 pages
    (0, 0, False, Severity.OK, Action.NONE),
    (8, 56, True, Severity.FAIL, Action.INSPECT_HARDWARE),    # 64 pages
]


def test_real_page_retirement_faults(nvml_state: Path, tmp_path: Path) -> None:
    path = REMAP / "nvidia-smi-q-d-PAGE_RETIREMENT_8gpu_535.86.10_retired-pages-sbe60-dbe5.txt"
    text = path.read_text()
    sbe = [int(v) for v in re.findall(r"Single Bit ECC\s+: (\d+)", text)]
    dbe = [int(v) for v in re.findall(r"Double Bit ECC\s+: (\d+)", text)]
    pending = [v == "Yes" for v in re.findall(r"Pending Page Blacklist\s+: (\w+)", text)]
    assert list(zip(sbe, dbe, pending, strict=True)) == [r[:3] for r in RETIRED]
    found = by_component(_run(path, nvml_state, tmp_path))
    for index, (s, d, p, severity, action) in enumerate(RETIRED):
        main = found[f"gpu/{index}"][0]
        assert (main.severity, main.action) == (severity, action), main.message
        assert main.evidence["retired_pages"] == {"single_bit": s, "double_bit": d, "pending": p, "limit": 62}
        assert ("page retirement pending" in main.message) == p


def test_retired_pages_limit_is_configurable(nvml_state: Path, tmp_path: Path) -> None:
    path = REMAP / "nvidia-smi-q-d-PAGE_RETIREMENT_8gpu_535.86.10_retired-pages-sbe60-dbe5.txt"
    found = by_component(_run(path, nvml_state, tmp_path, options=MemoryConfig(retired_pages_limit=64)))
    assert found["gpu/1"][0].action is Action.RESET_GPU  # 63 pages: under 64, still pending
    assert found["gpu/0"][0].action is Action.INSPECT_HARDWARE  # 65 pages
    with pytest.raises(ConfigError, match="retired_pages_limit: must be >= 1"):
        build(MemoryConfig, {"retired_pages_limit": 0}, Source("site.yaml"), ("checks", "memory"))


# ------------------------------------------------------------------------------- simulated faults

SCENARIO = """
name: memory
sku: h100-sxm
faults:
{faults}
"""

# one fault per GPU; (gpu, fault fields, severity, action, words in the message)
CASES = [
    (0, "kind: ecc, uncorrected: 1", Severity.FAIL, Action.RESET_GPU, "1 uncorrectable ECC error"),
    (1, "kind: ecc, corrected: 500", Severity.OK, Action.NONE, "no uncorrectable ECC errors"),
    (2, "kind: remap, pending: true, uncorrected: 1", Severity.FAIL, Action.RESET_GPU, "row remap pending"),
    (3, "kind: remap, failure: true", Severity.FAIL, Action.INSPECT_HARDWARE, "row remapping failed"),
    (4, "kind: remap, uncorrected: 8", Severity.WARN, Action.INSPECT_HARDWARE, "8 rows remapped"),
    (5, "kind: remap, uncorrected: 7", Severity.OK, Action.NONE, "7 uncorrectable"),
    (6, "kind: remap, banks_low: 3", Severity.WARN, Action.NONE, "3 memory bank(s) low on spare rows"),
    (7, "kind: remap, banks_none: 1", Severity.WARN, Action.INSPECT_HARDWARE, "no spare rows left"),
]


def test_memory_faults(sim: Any) -> None:
    faults = "\n".join(f"  - {{at_s: 5, duration_s: 10, gpu: {i}, {body}}}" for i, body, *_ in CASES)
    h = sim(SCENARIO.format(faults=faults))
    before = h.run(MemoryCheck, t=1)
    assert len(before) == 8 and {f.severity for f in before} == {Severity.OK}
    found = by_component(h.run(MemoryCheck, t=6))
    for index, _, severity, action, words in CASES:
        [f] = found[f"gpu/{index}"]
        assert (f.severity, f.action) == (severity, action), f.message
        assert words in f.message, f.message
    assert found["gpu/1"][0].evidence["ecc"]["volatile_corrected"] == 500
    assert found["gpu/7"][0].evidence["remap_histogram"]["none"] == 1
    later = by_component(h.run(MemoryCheck, t=20))
    # remap faults end (the simulated reset applied them); ECC counters stay until a reset
    assert later["gpu/2"][0].severity is Severity.OK
    assert later["gpu/0"][0].severity is Severity.FAIL


def test_nvml_conditions_per_gpu_and_the_others_still_checked(sim: Any) -> None:
    h = sim(SCENARIO.format(faults="\n".join([
        "  - {at_s: 0, kind: xid, gpu: 3, code: 79}",  # lost before the inventory
        "  - {at_s: 0, kind: nvml_error, gpu: 4, function: nvmlDeviceGetRemappedRows, error: gpu_is_lost}",
        "  - {at_s: 0, kind: nvml_error, gpu: 5, function: nvmlDeviceGetTotalEccErrors, error: unknown}",
        "  - {at_s: 0, kind: nvml_error, gpu: 6, function: nvmlDeviceGetRemappedRows, error: not_supported}",
        "  - {at_s: 0, kind: remap, gpu: 6, pending: true}",
    ])))
    found = by_component(h.run(MemoryCheck, t=1))
    for lost in ("gpu/3", "gpu/4"):
        assert [(f.severity, f.action) for f in found[lost]] == [(Severity.FAIL, Action.REBOOT_NODE)]
    main, ecc = found["gpu/5"]
    assert main.severity is Severity.OK and "remapped_rows" in main.evidence
    assert ecc.severity is Severity.UNKNOWN and "nvmlDeviceGetTotalEccErrors" in ecc.message
    # row remapping unreadable (as on a MIG-enabled GPU): not judged, so its pending remap is not
    # seen, and the finding says so instead of calling the memory ok
    main, remap = found["gpu/6"]
    assert main.severity is Severity.OK and "not read: remapped rows" in main.message
    assert remap.severity is Severity.SKIPPED and "row remapping not judged" in remap.message
    for index in (0, 1, 2, 7):
        assert [f.severity for f in found[f"gpu/{index}"]] == [Severity.OK]


# ------------------------------------------------------------------------------- states made here


def _one(nvml_state: Path, tmp_path: Path, **fields: Any) -> list[Finding]:
    return run_check(MemoryCheck, NvmlNodeState(gpus=[GpuState(index=0, **fields)]), nvml_state,
                     tmp_path / "host")


@pytest.mark.parametrize(("fields", "severity", "action", "words"), [
    ({"ecc_mode_current": False, "ecc_mode_pending": False}, Severity.WARN, Action.NONE,
     "ECC disabled on a datacenter GPU"),
    ({"ecc_mode_current": False, "ecc_mode_pending": True}, Severity.WARN, Action.RESET_GPU,
     "set to come on at the next GPU reset"),
    ({"ecc_mode_current": False, "ecc_mode_pending": False,
      "calls": [InjectedCall("nvmlDeviceGetBrand", error=NOT_SUPPORTED)]}, Severity.WARN, Action.NONE,
     "ECC disabled on a datacenter GPU"),  # no brand: the h100-sxm profile says datacenter
    ({"ecc_mode_current": False, "ecc_mode_pending": False, "name": "NVIDIA Something",
      "calls": [InjectedCall("nvmlDeviceGetBrand", error=NOT_SUPPORTED)]}, Severity.SKIPPED, Action.NONE,
     "not a datacenter GPU"),  # no brand, no profile: not called a datacenter GPU
])
def test_ecc_disabled(nvml_state: Path, tmp_path: Path, fields: dict[str, Any], severity: Severity,
                      action: Action, words: str) -> None:
    [f] = _one(nvml_state, tmp_path, **fields)
    assert (f.severity, f.action) == (severity, action), f.message
    assert words in f.message and "ecc" not in f.evidence  # no counters while ECC is off


def test_ecc_counts_are_two_counter_families_one_per_nvml_counter(nvml_state: Path, tmp_path: Path) -> None:
    # volatile and aggregate overlap (the aggregate count includes the volatile one): one family
    # each, so that a sum over every label of either family counts each error once
    [f] = _one(nvml_state, tmp_path, ecc_volatile_corrected=3, ecc_aggregate_corrected=40,
               ecc_aggregate_uncorrected=2)
    ecc = [r for r in f.evidence["readings"] if r[0].startswith("ecc_")]
    assert ecc == [["ecc_volatile_errors_total", 3.0, {"kind": "corrected"}],
                   ["ecc_volatile_errors_total", 0.0, {"kind": "uncorrected"}],
                   ["ecc_aggregate_errors_total", 40.0, {"kind": "corrected"}],
                   ["ecc_aggregate_errors_total", 2.0, {"kind": "uncorrected"}]]


def test_volta_reads_retired_pages_not_remapped_rows(nvml_state: Path, tmp_path: Path) -> None:
    [f] = _one(nvml_state, tmp_path, architecture=5, name="Tesla V100-SXM2-32GB", retired_pages_sbe=3,
               retired_pages_dbe=1, retired_pages_pending=True, remapped_rows_pending=True)
    assert (f.severity, f.action) == (Severity.FAIL, Action.RESET_GPU)
    assert "remapped_rows" not in f.evidence  # a Volta answer for remapping would be meaningless
    assert f.evidence["retired_pages"]["double_bit"] == 1
    # ECC disabled on Volta: no retirement possible, and the counts are not supported
    findings = _one(nvml_state, tmp_path, architecture=5, ecc_mode_current=False, ecc_mode_pending=False)
    assert [x.severity for x in findings] == [Severity.WARN, Severity.SKIPPED]
    assert "retired pages not reported" in findings[1].message


def test_unknown_architecture_uses_whichever_source_answers(nvml_state: Path, tmp_path: Path) -> None:
    arch_off = InjectedCall("nvmlDeviceGetArchitecture", error=NOT_SUPPORTED)
    [f] = _one(nvml_state, tmp_path, calls=[arch_off], remapped_rows_pending=True)
    assert f.action is Action.RESET_GPU and "retired_pages" not in f.evidence
    [f] = _one(nvml_state, tmp_path, retired_pages_sbe=62, retired_pages_dbe=0,
               calls=[arch_off, InjectedCall("nvmlDeviceGetRemappedRows", error=NOT_SUPPORTED)])
    assert f.action is Action.INSPECT_HARDWARE and "remapped_rows" not in f.evidence
    main, remap, pages = _one(nvml_state, tmp_path, calls=[
        arch_off, InjectedCall("nvmlDeviceGetRemappedRows", error=NOT_SUPPORTED)])
    assert main.severity is Severity.OK  # ECC judged
    assert [remap.severity, pages.severity] == [Severity.SKIPPED, Severity.SKIPPED]


# ------------------------------------------------------------------------------- the converter

REAL_CAPTURES = sorted(SMI.glob("*.txt")) + sorted(REMAP.glob("*.txt"))


@given(st.text(max_size=3000))
@settings(max_examples=200)
def test_converter_survives_any_text(text: str) -> None:
    converted = to_node_state(parse_capture(text))
    render_state(converted.state)  # the injection library would accept it


@given(st.sampled_from(REAL_CAPTURES), st.floats(0, 1), st.lists(st.integers(0, 10**6), max_size=20),
       st.sampled_from(["", "x", ":", " : N/A", "-9 C", "99999999999 C", "\t", "GPU 0:0:0.0", "\x00"]))
@settings(max_examples=300)
def test_converter_survives_cut_and_damaged_real_captures(path: Path, cut: float, holes: list[int],
                                                          junk: str) -> None:
    text = path.read_text()
    text = text[:int(len(text) * cut)]
    for hole in holes:  # damage: a character replaced by junk at random places
        at = hole % (len(text) + 1)
        text = text[:at] + junk + text[at + 1:]
    converted = to_node_state(parse_capture(text))
    render_state(converted.state)
    for g in converted.gpus:  # every GPU answers its identity, so the inventory can list it
        assert g.state.name and g.state.uuid


@given(st.sampled_from(REAL_CAPTURES), st.floats(0, 1))
@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_checks_over_truncated_real_captures_never_crash_nor_invent_health(
        nvml_state: Path, tmp_path: Path, path: Path, cut: float) -> None:
    text = path.read_text()
    converted = to_node_state(parse_capture(text[:int(len(text) * cut)]))
    for check in (MemoryCheck, ThermalCheck):
        findings = run_check(check, converted.state, nvml_state, tmp_path / "host")
        comps = {f.component for f in findings}
        assert comps == {f"gpu/{i}" for i in range(len(converted.gpus))}
        for f in findings:
            # an ok can only rest on readings the cut capture still holds
            if f.severity is Severity.OK and check is MemoryCheck:
                assert {"ecc", "remapped_rows", "retired_pages"} & set(f.evidence), f
            if f.severity is Severity.OK and check is ThermalCheck:
                assert f.evidence["core_c"] is not None or f.evidence["hbm_c"] is not None, f
