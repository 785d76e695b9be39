"""thermal: GPU core and HBM temperatures against the limits the GPU itself reports.

Per GPU: core temperature (``nvmlDeviceGetTemperature``), HBM temperature (NVML field
``NVML_FI_DEV_MEMORY_TEMP``), and NVML's own limits (``nvmlDeviceGetTemperatureThreshold``); where
NVML reports no limit, the SKU profile's ``thermal.*`` numbers.

NVML's limits (NVML API reference, ``nvmlTemperatureThresholds_t``): SLOWDOWN, "temperature at which
the GPU will begin HW slowdown"; GPU_MAX, "GPU temperature at which the GPU can be throttled below
base clock"; MEM_MAX, "memory temperature at which the GPU will begin SW slowdown".

- HBM at/above its max -> fail, inspect_hardware: the GPU is already slowing itself down to hold
  the memory there, so the cooling cannot carry the load.
- Core at/above the HW slowdown threshold -> fail, inspect_hardware. The throttle check reports the
  same fault from the HW_THERMAL_SLOWDOWN clock-event bit with the same remedy, and worst-wins folding
  gives one remedy per GPU, so reporting it here too costs nothing; what it buys is independence: the
  temperature is a separate NVML reading that also works where the clock-event reasons are not
  supported, and the evidence says by how much the limit is exceeded.
- Core at/above the warn line -> warn: the lower of NVML's GPU_MAX (where software thermal slowdown
  starts) and ``slowdown - core_margin_c``. This is what thermal adds over throttle: a warning before
  the hardware trip.
- HBM minus core above the gradient -> warn: HBM running hot against its own die points at the HBM
  side of the cooling (cold-plate contact, thermal interface), which a uniform airflow fault does not
  produce (that raises both and is caught by the limits).

A reading the GPU does not offer (HBM temperature on GDDR parts, NOT_SUPPORTED) is its own
``skipped`` finding, so the rules that needed it are visibly not judged; a GPU with no limit known
for a reading is not called ok on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext, each_gpu
from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported
from gpumon.hw.inventory import Inventory
from gpumon.model import Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

# Bounds of a believable limit (the profile schema's thermal.* bounds): a threshold outside them
# (0 from a driver that does not fill it in) would fail or pass every GPU, so it is not used.
_PLAUSIBLE_C = (20, 150)

DEFAULT_GRADIENT_C = 20.0
_GRADIENT_SOURCE = (
    "no NVIDIA figure exists for H100/H200/B200 (and the profiles carry none). Judgement from "
    "measurement: HBM minus core is 7-10 C on all 16 idle H100 80GB HBM3 of "
    "realdata/nvidia-smi-q/h100x8_535.161.08.txt and h100x8_535.183.01.txt (leptonai/gpud testdata "
    "@ fdf5b3217dc96883f57e89229e4d75a3a2ef62e2, core 29-39 C); 20 C is twice the largest healthy gap. "
    "Under compute load the core heats faster than HBM and the gap shrinks, so a growing gap points "
    "at the HBM side of the cooling. Not validated on a known cooling fault: warn only")


@dataclass(frozen=True)
class ThermalConfig:
    core_margin_c: float = field(default=2.0, metadata={
        "min": 0, "max": 50,
        "source": "measurement: NVIDIA puts HW slowdown 2 C above the max operating temperature on the 16 "
                  "H100 of realdata/nvidia-smi-q/h100x8_535.*.txt and the 8 RTX 4090 of "
                  "rtx4090x8_535.154.05.txt ('GPU Slowdown T.Limit Temp : -2 C' vs 'GPU Max Operating "
                  "T.Limit Temp : 0 C'), 4 C on A100-SXM4-80GB (89/85 C, a100-sxm-80gb profile source), "
                  "6-7 C on TITAN V and A10 (97/91, 98/91 C). The smallest gap is the default, so the "
                  "margin never warns earlier than NVIDIA's own max operating temperature would on a "
                  "measured SKU; raise it for an earlier warning"})
    # None: the profile's thermal.hbm_core_gradient_warn_c, else DEFAULT_GRADIENT_C
    gradient_warn_c: float | None = field(default=None, metadata={
        "min": 0, "max": 100, "source": f"default {DEFAULT_GRADIENT_C:g} C: {_GRADIENT_SOURCE}"})


@dataclass
class _Limit:
    value: float | None
    source: str  # where the value came from, or why there is none


@dataclass
class _Judgement:
    severity: Severity
    action: Action
    message: str


class ThermalCheck(Check):
    name = "thermal"
    phase = Phase.CONTINUOUS
    description = "GPU core and HBM temperature against NVML's limits; HBM-core gradient"
    readings = (
        ReadingSpec(
            "gpu_temperature_celsius", "gauge",
            "GPU core (die) temperature at the thermal check's last run.",
            unit="degrees Celsius",
            source="NVML nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU); judged against the GPU's own "
                   "nvmlDeviceGetTemperatureThreshold limits"),
        ReadingSpec(
            "hbm_temperature_celsius", "gauge",
            "GPU memory (HBM) temperature at the thermal check's last run; absent on GPUs without an HBM "
            "sensor.",
            unit="degrees Celsius",
            source="NVML field NVML_FI_DEV_MEMORY_TEMP (nvmlDeviceGetFieldValues)"),
    )
    interval = 30.0
    timeout = 20.0
    Config = ThermalConfig

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(ThermalConfig)
        out = self.unreadable_gpus(ctx.inventory)
        # every GPU at once: a call that hangs on all of them costs one bound, not one per GPU
        for info, got in each_gpu(ctx, ctx.inventory.gpus, lambda info: self._gpu(ctx, options, info.index)):
            if isinstance(got, HwCondition):
                # a lost or hung GPU is the finding; asking it more would only wait again
                out.append(self.from_condition(got, gpu(info.index)))
            else:
                out.extend(got)
        return out

    def _gpu(self, ctx: CheckContext, options: ThermalConfig, index: int) -> list[Finding]:
        comp = gpu(index)
        nvml = ctx.hw.nvml
        out: list[Finding] = []
        errors: dict[str, str] = {}  # limits that could not be read (the readings get findings)
        core = _read(lambda: nvml.temperature_c(index))
        hbm = _read(lambda: nvml.memory_temperature_c(index))
        for value, what in ((core, "core temperature"), (hbm, "HBM temperature")):
            if isinstance(value, HwCondition):
                out.append(self._unread(comp, what, value))
        core_c = core if isinstance(core, int) else None
        hbm_c = hbm if isinstance(hbm, int) else None

        slowdown = self._nvml_limit(ctx, index, "slowdown", None, errors) if core_c is not None else None
        gpu_max = (self._nvml_limit(ctx, index, "gpu_max", ctx.profile.thermal.gpu_max_operating_c, errors)
                   if core_c is not None else None)
        # Only asked where HBM is read: without an HBM sensor there is no HBM limit to judge
        hbm_max = (self._nvml_limit(ctx, index, "mem_max", ctx.profile.thermal.hbm_max_operating_c, errors)
                   if hbm_c is not None else None)

        evidence: dict[str, Any] = {"core_c": core_c, "hbm_c": hbm_c}
        readings: list[list[Any]] = []
        if core_c is not None:
            readings.append(reading("gpu_temperature_celsius", core_c))
        if hbm_c is not None:
            readings.append(reading("hbm_temperature_celsius", hbm_c))
        evidence["readings"] = readings
        judged: list[_Judgement] = []
        not_judged: list[str] = []
        if core_c is not None and slowdown is not None and gpu_max is not None:
            self._core(core_c, slowdown, gpu_max, options, judged, not_judged, evidence)
        if hbm_c is not None and hbm_max is not None:
            self._hbm(hbm_c, hbm_max, judged, not_judged, evidence)
        if core_c is not None and hbm_c is not None:
            self._gradient(ctx, core_c, hbm_c, options, judged, evidence)
        if not_judged:
            evidence["not_judged"] = not_judged
        if errors:
            evidence["errors"] = errors
        main = self._summary(comp, index, judged, not_judged, errors, evidence)
        return ([main] if main else []) + out

    def _nvml_limit(self, ctx: CheckContext, index: int, kind: str, profile_value: float | None,
                    errors: dict[str, str]) -> _Limit:
        nvml_value = _read(lambda: ctx.hw.nvml.temperature_threshold_c(index, kind))
        if isinstance(nvml_value, HwCondition) and not isinstance(nvml_value, NotSupported):
            errors[f"{kind} threshold"] = str(nvml_value)
        if isinstance(nvml_value, int):
            if _PLAUSIBLE_C[0] <= nvml_value <= _PLAUSIBLE_C[1]:
                return _Limit(float(nvml_value), "nvml")
            why = f"NVML reports an implausible {nvml_value} C"
        elif isinstance(nvml_value, NotSupported):
            why = "NVML does not report it"
        else:
            why = "NVML read failed"
        if profile_value is not None:
            return _Limit(float(profile_value), f"profile {ctx.profile.name} ({why})")
        return _Limit(None, f"{why}; profile {ctx.profile.name} has none")

    def _core(self, core_c: int, slowdown: _Limit, gpu_max: _Limit, options: ThermalConfig,
              judged: list[_Judgement], not_judged: list[str], evidence: dict[str, Any]) -> None:
        evidence["slowdown_c"], evidence["slowdown_source"] = slowdown.value, slowdown.source
        evidence["gpu_max_c"], evidence["gpu_max_source"] = gpu_max.value, gpu_max.source
        lines = []
        if gpu_max.value is not None:
            lines.append((gpu_max.value, f"max operating temperature {gpu_max.value:g} C"))
        if slowdown.value is not None:
            lines.append((slowdown.value - options.core_margin_c,
                          f"{options.core_margin_c:g} C below HW slowdown {slowdown.value:g} C"))
        if slowdown.value is not None and core_c >= slowdown.value:
            judged.append(_Judgement(Severity.FAIL, Action.INSPECT_HARDWARE,
                                     f"core {core_c} C at/above HW slowdown threshold {slowdown.value:g} C "
                                     "(the GPU halves its clocks; check cooling)"))
            return
        if not lines:
            not_judged.append(f"core {core_c} C: no limit known (slowdown: {slowdown.source}; "
                              f"max operating: {gpu_max.source})")
            return
        warn_at, why = min(lines, key=lambda line: line[0])  # a tie names NVIDIA's own limit
        evidence["core_warn_c"] = warn_at
        if core_c >= warn_at:
            judged.append(_Judgement(Severity.WARN, Action.NONE,
                                     f"core {core_c} C at/above {warn_at:g} C ({why}): little thermal "
                                     "headroom left"))
        else:
            judged.append(_Judgement(Severity.OK, Action.NONE, f"core {core_c} C (warn at {warn_at:g} C)"))
        if slowdown.value is None:
            not_judged.append(f"HW slowdown: {slowdown.source}")

    def _hbm(self, hbm_c: int, hbm_max: _Limit, judged: list[_Judgement], not_judged: list[str],
             evidence: dict[str, Any]) -> None:
        evidence["hbm_max_c"], evidence["hbm_max_source"] = hbm_max.value, hbm_max.source
        if hbm_max.value is None:
            not_judged.append(f"HBM {hbm_c} C: no HBM limit known ({hbm_max.source})")
        elif hbm_c >= hbm_max.value:
            judged.append(_Judgement(Severity.FAIL, Action.INSPECT_HARDWARE,
                                     f"HBM {hbm_c} C at/above its max operating temperature "
                                     f"{hbm_max.value:g} C (the GPU is slowing itself down to hold it; "
                                     "check cooling)"))
        else:
            judged.append(_Judgement(Severity.OK, Action.NONE, f"HBM {hbm_c} C (max {hbm_max.value:g} C)"))

    def _gradient(self, ctx: CheckContext, core_c: int, hbm_c: int, options: ThermalConfig,
                  judged: list[_Judgement], evidence: dict[str, Any]) -> None:
        if options.gradient_warn_c is not None:
            limit, source = options.gradient_warn_c, "config"
        elif ctx.profile.thermal.hbm_core_gradient_warn_c is not None:
            limit, source = ctx.profile.thermal.hbm_core_gradient_warn_c, f"profile {ctx.profile.name}"
        else:
            limit, source = DEFAULT_GRADIENT_C, "built-in default"
        gap = hbm_c - core_c
        evidence.update(hbm_minus_core_c=gap, gradient_warn_c=limit, gradient_source=source)
        if gap > limit:
            judged.append(_Judgement(Severity.WARN, Action.NONE,
                                     f"HBM {gap} C hotter than the core (warn above {limit:g} C): "
                                     "suspect the HBM side of the cooling (cold plate contact, "
                                     "thermal interface)"))
        else:
            judged.append(_Judgement(Severity.OK, Action.NONE, f"HBM-core {gap:+d} C"))

    def _summary(self, comp: str, index: int, judged: list[_Judgement], not_judged: list[str],
                 errors: dict[str, str], evidence: dict[str, Any]) -> Finding | None:
        if not judged and not errors and not not_judged:
            return None  # both readings unavailable: their own findings say so
        if not judged and not errors:
            return self.finding(comp, Severity.SKIPPED, f"GPU {index}: not judged: {'; '.join(not_judged)}",
                                **evidence)
        severity = max((j.severity for j in judged), default=Severity.OK)
        action = max((j.action for j in judged), default=Action.NONE)
        if errors and severity < Severity.UNKNOWN:
            severity = Severity.UNKNOWN
        bad = [j.message for j in judged if j.severity > Severity.OK]
        parts = bad or [j.message for j in judged]
        if errors:
            parts.append("could not read " + ", ".join(f"{k} ({v})" for k, v in errors.items()))
        if not_judged and not bad:
            parts.append("not judged: " + "; ".join(not_judged))
        return self.finding(comp, severity, f"GPU {index}: " + "; ".join(parts), action, **evidence)

    def _unread(self, comp: str, what: str, cond: HwCondition) -> Finding:
        if isinstance(cond, NotSupported):
            consequence = {"core temperature": "core limits and HBM-core gradient not judged",
                           "HBM temperature": "HBM limit and HBM-core gradient not judged"}[what]
            return self.finding(comp, Severity.SKIPPED, f"{what} not reported by this GPU "
                                f"(NVML NOT_SUPPORTED): {consequence}", Action.NONE, call=cond.call)
        return self.from_condition(cond, comp)


def _read(read: Callable[[], int]) -> int | HwCondition:
    """The reading, or the condition that stopped it; GpuLost and HwTimeout end the GPU's turn."""
    try:
        return read()
    except (GpuLost, HwTimeout):
        raise
    except HwCondition as cond:
        return cond


