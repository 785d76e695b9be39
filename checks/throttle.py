"""throttle: hardware clock slowdowns from NVML clock event reasons.

Reads ``nvmlDeviceGetCurrentClocksEventReasons`` per GPU. HW_SLOWDOWN,
HW_THERMAL_SLOWDOWN and HW_POWER_BRAKE mean the board itself cut the clocks
(thermal trip, power-supply brake signal, or the slowdown pin): the GPU runs
at a fraction of its speed and the whole synchronous job waits for it.
Idle and the software power cap are normal operation, not faults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition, NotSupported
from gpumon.hw.nvml import CLOCK_EVENT_REASONS, PERF_POLICIES
from gpumon.model import Action, Finding, Phase, Severity, gpu

# NVIDIA documents HW slowdown as engaged by the board for thermal or power
# protection (nvmlClocksEventReasonHwSlowdown in the NVML API reference), so
# the remedy is at the hardware (cooling, power delivery), not the job.
_ACTIONS = {
    "hw_slowdown": Action.INSPECT_HARDWARE,
    "hw_thermal_slowdown": Action.INSPECT_HARDWARE,
    "hw_power_brake_slowdown": Action.INSPECT_HARDWARE,
}


def _reason_names() -> tuple[str, ...]:
    return tuple(CLOCK_EVENT_REASONS)


@dataclass(frozen=True)
class ThrottleConfig:
    fail_reasons: list[str] = field(default_factory=lambda: [
        "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"])
    warn_reasons: list[str] = field(default_factory=lambda: ["sw_thermal_slowdown"])

    def __post_init__(self) -> None:
        for name in (*self.fail_reasons, *self.warn_reasons):
            if name not in CLOCK_EVENT_REASONS:
                raise ValueError(f"unknown clock event reason {name!r} "
                                 f"(known: {', '.join(_reason_names())})")


class ThrottleCheck(Check):
    name = "throttle"
    phase = Phase.CONTINUOUS
    description = "NVML clock event reasons: HW slowdown, HW thermal slowdown, HW power brake"
    interval = 10.0
    timeout = 20.0
    Config = ThrottleConfig

    def supported(self, inventory: Any) -> str | None:
        if not inventory.gpus and not inventory.unreadable_gpus:
            return "no GPUs visible to NVML"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        params: ThrottleConfig = ctx.params or ThrottleConfig()
        out: list[Finding] = []
        for index in sorted(ctx.inventory.unreadable_gpus):
            reason = ctx.inventory.unreadable_gpus[index]
            lost = reason.startswith("GPU is lost")
            out.append(self.finding(gpu(index), Severity.FAIL,
                                    f"GPU lost: {reason}" if lost else f"GPU unreadable: {reason}",
                                    Action.REBOOT_NODE if lost else Action.RESET_GPU, nvml=reason))
        for info in ctx.inventory.gpus:
            comp = gpu(info.index)
            try:
                mask = ctx.hw.nvml.clocks_event_reasons(info.index)
            except HwCondition as cond:
                out.append(self.from_condition(cond, comp))
                continue
            active = [n for n, bit in CLOCK_EVENT_REASONS.items() if mask & bit]
            evidence: dict[str, Any] = {"reasons_mask": hex(mask), "active": active}
            evidence.update(self._readings(ctx, info.index))
            failing = [r for r in active if r in params.fail_reasons]
            warning = [r for r in active if r in params.warn_reasons]
            if failing:
                action = max(_ACTIONS.get(r, Action.INSPECT_HARDWARE) for r in failing)
                out.append(self.finding(comp, Severity.FAIL,
                                        f"GPU {info.index} clocks held down by {', '.join(failing)}",
                                        action, **evidence))
            elif warning:
                out.append(self.finding(comp, Severity.WARN,
                                        f"GPU {info.index} clocks reduced by {', '.join(warning)}",
                                        Action.NONE, **evidence))
            else:
                why = f" ({', '.join(active)})" if active else ""
                out.append(self.finding(comp, Severity.OK, f"no hardware slowdown{why}", **evidence))
        return out

    def _readings(self, ctx: CheckContext, index: int) -> dict[str, Any]:
        """Context for the operator; a reading that is unsupported is left out, not guessed."""
        readings: dict[str, Any] = {}
        for key, read in (("sm_clock_mhz", ctx.hw.nvml.sm_clock_mhz),
                          ("temperature_c", ctx.hw.nvml.temperature_c),
                          ("power_w", ctx.hw.nvml.power_w)):
            try:
                readings[key] = read(index)
            except NotSupported:
                continue
            except HwCondition as cond:
                readings[f"{key}_error"] = str(cond)
        violations: dict[str, float] = {}
        for policy in ("thermal", "power", "reliability"):
            try:
                violations[policy] = ctx.hw.nvml.violation_ns(index, PERF_POLICIES[policy]) / 1e9
            except NotSupported:
                continue
            except HwCondition as cond:
                readings[f"violation_{policy}_error"] = str(cond)
        if violations:
            readings["violation_s"] = violations
        return readings
