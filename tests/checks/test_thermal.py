"""The thermal check on real nvidia-smi -q captures (served through the NVML injection library) and on
simulated temperature faults. Captures: tests/data/nvidia-smi-q, provenance in its SOURCES.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from nvidia_smi_capture import NOT_SUPPORTED, by_component, load, run_check

from gpumon.errors import ConfigError
from gpumon.model import Action, Finding, Severity
from gpumon.schema import Source, build
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState
from gpumon_checks.thermal import DEFAULT_GRADIENT_C, ThermalCheck, ThermalConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-q"
H100_CAPTURES = ["h100x8_535.161.08.txt", "h100x8_535.183.01.txt"]


def _capture_values(name: str, label: str) -> list[int]:
    """Per-GPU values straight from the capture text, independent of the converter."""
    return [int(v) for v in re.findall(rf"^\s+{re.escape(label)}\s+: (\d+) C$",
                                       (DATA / name).read_text(), re.MULTILINE)]


def _run_capture(name: str, nvml_state: Path, tmp_path: Path) -> list[Finding]:
    return run_check(ThermalCheck, load(DATA / name).state, nvml_state, tmp_path / "host")


# ------------------------------------------------------------------------------- real captures


@pytest.mark.parametrize("name", H100_CAPTURES)
def test_every_gpu_of_the_real_h100_captures_is_healthy(name: str, nvml_state: Path,
                                                        tmp_path: Path) -> None:
    findings = _run_capture(name, nvml_state, tmp_path)
    assert [f.component for f in findings] == [f"gpu/{i}" for i in range(8)]
    assert {f.severity for f in findings} == {Severity.OK}, [f.message for f in findings]
    cores = _capture_values(name, "GPU Current Temp")
    hbms = _capture_values(name, "Memory Current Temp")
    assert [f.evidence["core_c"] for f in findings] == cores
    assert [f.evidence["hbm_c"] for f in findings] == hbms
    gaps = [f.evidence["hbm_minus_core_c"] for f in findings]
    assert min(gaps) >= 7 and max(gaps) <= 10  # the healthy idle gap the default is argued from
    for f in findings:
        assert f.evidence["gradient_warn_c"] == DEFAULT_GRADIENT_C
        assert f.evidence["gradient_source"] == "built-in default"
        # slowdown comes from the capture's T.Limit lines: current + margin + 2 C
        assert f.evidence["slowdown_source"] == "nvml"
        assert 85 <= f.evidence["slowdown_c"] - 2 <= 87
        assert f.evidence["core_warn_c"] == f.evidence["slowdown_c"] - 2


def test_h100_hbm_limit_is_not_in_the_capture_and_says_so(tmp_path: Path) -> None:
    # r535 prints no memory margin, so the converter cannot derive MEM_MAX: the HBM-limit verdict
    # on these captures rests on the simulator's 95 C, which any HBM reading of 38-46 C is far below
    converted = load(DATA / "h100x8_535.161.08.txt")
    for g in converted.gpus:
        assert "temp_mem_max_c" in g.assumed
        assert g.assumed["temp_slowdown_c"].startswith("derived: T.Limit")


def test_hbm_temperature_not_supported_is_a_skipped_reading(nvml_state: Path, tmp_path: Path) -> None:
    # a real A10 (GDDR6): 'Memory Current Temp : N/A'
    findings = _run_capture("a10x1_535.129.03.txt", nvml_state, tmp_path)
    main, hbm = findings
    assert (main.severity, main.evidence["core_c"], main.evidence["hbm_c"]) == (Severity.OK, 33, None)
    assert "hbm_max_c" not in main.evidence and "hbm_minus_core_c" not in main.evidence
    assert main.evidence["slowdown_c"] == 98 and main.evidence["gpu_max_c"] == 91  # absolute format
    assert hbm.severity is Severity.SKIPPED and "HBM temperature not reported" in hbm.message
    assert "gradient not judged" in hbm.message


def test_rtx4090_capture_without_hbm_sensor(nvml_state: Path, tmp_path: Path) -> None:
    findings = by_component(_run_capture("rtx4090x8_535.154.05.txt", nvml_state, tmp_path))
    assert len(findings) == 8
    for comp, (main, hbm) in findings.items():
        assert main.severity is Severity.OK, comp
        assert hbm.severity is Severity.SKIPPED


def test_titan_v_absolute_thresholds_and_negative_gradient(nvml_state: Path, tmp_path: Path) -> None:
    [f] = _run_capture("titanv_x1_560.35.03.txt", nvml_state, tmp_path)
    assert f.severity is Severity.OK
    e = f.evidence
    assert (e["core_c"], e["hbm_c"], e["hbm_minus_core_c"]) == (44, 41, -3)
    assert (e["slowdown_c"], e["gpu_max_c"], e["hbm_max_c"], e["core_warn_c"]) == (97, 91, 95, 91)


def test_truncated_capture_gives_skipped_readings_never_ok(nvml_state: Path, tmp_path: Path) -> None:
    findings = _run_capture("h100x8_535.183.01_truncated_invalid.txt", nvml_state, tmp_path)
    assert [f.severity for f in findings] == [Severity.SKIPPED, Severity.SKIPPED]
    assert not any(f.severity is Severity.OK for f in findings)


# ------------------------------------------------------------------------------- simulated faults

SCENARIO = """
name: thermal
sku: {sku}
faults:
{faults}
"""


def _sim(sim: Any, faults: str, sku: str = "h100-sxm") -> Any:
    return sim(SCENARIO.format(sku=sku, faults=faults))


def _by(findings: list[Finding]) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for f in findings:
        out.setdefault(f.component, f)  # the GPU's main finding comes first
    return out


# One scenario, one fault per GPU: each row is (gpu, core C, HBM C, severity, action, words in message).
# The simulated H100 idles at core 35 C / HBM 42 C; NVML limits: slowdown 89, max operating 87, HBM 95.
CASES = [
    (0, 86, None, Severity.OK, Action.NONE, "core 86 C (warn at 87 C)"),
    (1, 87, None, Severity.WARN, Action.NONE, "max operating temperature 87 C"),
    (2, 89, None, Severity.FAIL, Action.INSPECT_HARDWARE, "HW slowdown threshold 89 C"),
    (3, None, 60, Severity.WARN, Action.NONE, "HBM 25 C hotter than the core"),
    (4, 60, 95, Severity.FAIL, Action.INSPECT_HARDWARE, "HBM 95 C at/above its max"),
    (5, 35, 55, Severity.OK, Action.NONE, "HBM-core +20 C"),
    (6, 35, 56, Severity.WARN, Action.NONE, "HBM 21 C hotter than the core"),
]


def test_temperature_faults(sim: Any) -> None:
    lines = []
    for index, core, hbm, *_ in CASES:
        temps = ", ".join(p for p in (f"core_c: {core}" if core is not None else "",
                                      f"hbm_c: {hbm}" if hbm is not None else "") if p)
        lines.append(f"  - {{at_s: 5, kind: temperature, gpu: {index}, {temps}}}")
    lines.append("  - {at_s: 5, duration_s: 10, kind: temperature, gpu: 7, core_c: 92}")
    h = _sim(sim, "\n".join(lines))
    before = h.run(ThermalCheck, t=1)
    assert len(before) == 8 and {f.severity for f in before} == {Severity.OK}
    after = _by(h.run(ThermalCheck, t=6))
    for index, _, _, severity, action, words in CASES:
        f = after[f"gpu/{index}"]
        assert (f.severity, f.action) == (severity, action), f.message
        assert words in f.message, f.message
    assert after["gpu/7"].severity is Severity.FAIL
    later = _by(h.run(ThermalCheck, t=20))  # the timed fault on GPU 7 is over, the others persist
    assert later["gpu/7"].severity is Severity.OK and later["gpu/2"].severity is Severity.FAIL


def test_site_gradient_and_margin_override(sim: Any) -> None:
    h = _sim(sim, "  - {at_s: 0, kind: temperature, gpu: 1, core_c: 80, hbm_c: 105}")
    ctx = h.context(ThermalCheck, t=1)
    ctx.options = ThermalConfig(gradient_warn_c=30.0, core_margin_c=10.0)
    f = _by(ThermalCheck().run(ctx))["gpu/1"]
    # 105 C HBM fails on its own; the gap of 25 is under the site's 30; core 80 is within 10 C of 89
    assert f.severity is Severity.FAIL and f.evidence["gradient_source"] == "config"
    assert f.evidence["core_warn_c"] == 79 and "10 C below HW slowdown" in f.message
    assert "hotter than the core" not in f.message


def test_profile_limits_when_nvml_reports_none(sim: Any) -> None:
    # A100 profile: gpu_max_operating_c 85, hbm_max_operating_c 95 (measured NVML thresholds)
    h = _sim(sim, "  - {at_s: 0, kind: nvml_error, gpu: 0, function: nvmlDeviceGetTemperatureThreshold,"
                  " error: not_supported}\n"
                  "  - {at_s: 0, kind: temperature, gpu: 0, core_c: 85, hbm_c: 96}", sku="a100-sxm-80gb")
    f = _by(h.run(ThermalCheck, t=1))["gpu/0"]
    assert (f.severity, f.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.evidence["hbm_max_source"].startswith("profile a100-sxm-80gb")
    assert f.evidence["gpu_max_c"] == 85 and f.evidence["core_warn_c"] == 85
    assert any("HW slowdown" in n for n in f.evidence["not_judged"])


def test_no_limit_known_is_not_ok(sim: Any) -> None:
    # H100 profile has no thermal numbers: with NVML silent, the core cannot be judged
    h = _sim(sim, "  - {at_s: 0, kind: nvml_error, gpu: 0, function: nvmlDeviceGetTemperatureThreshold,"
                  " error: not_supported}\n"
                  "  - {at_s: 0, kind: nvml_error, gpu: 0, function: nvmlDeviceGetFieldValues,"
                  " error: not_supported}")
    findings = [f for f in h.run(ThermalCheck, t=1) if f.component == "gpu/0"]
    assert [f.severity for f in findings] == [Severity.SKIPPED, Severity.SKIPPED]
    assert "no limit known" in findings[0].message
    assert "HBM temperature not reported" in findings[1].message


def test_nvml_conditions_per_gpu_and_the_others_still_checked(sim: Any) -> None:
    h = _sim(sim, "\n".join([
        "  - {at_s: 0, kind: xid, gpu: 3, code: 79}",  # lost before the inventory: every call fails
        "  - {at_s: 0, kind: nvml_error, gpu: 5, function: nvmlDeviceGetTemperature, error: gpu_is_lost}",
        "  - {at_s: 0, kind: nvml_error, gpu: 4, function: nvmlDeviceGetFieldValues, error: unknown}",
        "  - {at_s: 0, kind: nvml_error, gpu: 6, function: nvmlDeviceGetTemperatureThreshold,"
        " error: unknown}",
    ]))
    found = by_component(h.run(ThermalCheck, t=1))
    for lost in ("gpu/3", "gpu/5"):  # lost in the inventory, lost during the reading
        assert [(f.severity, f.action) for f in found[lost]] == [(Severity.FAIL, Action.REBOOT_NODE)]
    main, hbm = found["gpu/4"]  # HBM unreadable: unknown, the core is still judged
    assert main.severity is Severity.OK and main.evidence["core_c"] == 35
    assert hbm.severity is Severity.UNKNOWN and "nvmlDeviceGetFieldValues" in hbm.message
    [limits] = found["gpu/6"]  # limits unreadable: unknown, not ok
    assert limits.severity is Severity.UNKNOWN and "could not read" in limits.message
    assert set(limits.evidence["errors"]) == {"slowdown threshold", "gpu_max threshold", "mem_max threshold"}
    for index in (0, 1, 2, 7):
        assert [f.severity for f in found[f"gpu/{index}"]] == [Severity.OK]


def test_implausible_nvml_threshold_is_not_used(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState(gpus=[GpuState(index=0, temp_slowdown_c=0, temp_gpu_max_c=0, temperature_c=50)])
    [f] = run_check(ThermalCheck, node, nvml_state, tmp_path / "host")
    assert f.evidence["slowdown_c"] is None and "implausible 0 C" in f.evidence["slowdown_source"]
    assert f.severity is Severity.OK  # judged on HBM and gradient; the core is listed as not judged
    assert any(n.startswith("core 50 C: no limit known") for n in f.evidence["not_judged"])


def test_core_temperature_not_supported(nvml_state: Path, tmp_path: Path) -> None:
    node = NvmlNodeState(gpus=[GpuState(index=0, calls=[InjectedCall("nvmlDeviceGetTemperature",
                                                                     error=NOT_SUPPORTED)])])
    main, core = run_check(ThermalCheck, node, nvml_state, tmp_path / "host")
    assert main.severity is Severity.OK and main.evidence["core_c"] is None and "HBM 42 C" in main.message
    assert core.severity is Severity.SKIPPED and "core temperature not reported" in core.message


def test_config_rejects_bad_values() -> None:
    # the bounds are declared once, in the fields' metadata, and enforced where a file is read
    src = Source("site.yaml", lines={("checks", "thermal", "core_margin_c"): 3})
    with pytest.raises(ConfigError, match="must be >= 0") as err:
        build(ThermalConfig, {"core_margin_c": -1}, src, ("checks", "thermal"))
    assert (err.value.line, err.value.key) == (3, "checks.thermal.core_margin_c")
    with pytest.raises(ConfigError, match="must be <= 100"):
        build(ThermalConfig, {"gradient_warn_c": 500}, src, ("checks", "thermal"))
