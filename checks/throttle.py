"""throttle: how long each hardware clock slowdown held a GPU over a window.

NVIDIA documents HW_SLOWDOWN as "reducing the core clocks by a factor of 2 or more"
(nvmlClocksEventReasonHwSlowdown); HW_THERMAL_SLOWDOWN and HW_POWER_BRAKE_SLOWDOWN are
the same cut triggered by temperature and by the board's power-brake signal. A GPU held
there runs at half speed or worse and a synchronous job waits for it. A one-off blip is
normal electrical and thermal life; a GPU held down for a large share of the window is not.

Per GPU and run the check reads the current reasons mask (``nvmlDeviceGetCurrentClocksEventReasons``)
and the NVML violation counters (``nvmlDeviceGetViolationStatus``, cumulative ns), and keeps
them in its declared ``State`` (``ThrottleState``, loaded and saved by the framework: saved state
of another shape is logged and started afresh, never raised on). The share of the window
each reason was active comes from:

- sampling: the masks read run after run, time-weighted (the time between two readings is
  split evenly between them; a gap longer than ``max_sample_gap_s`` counts for neither);
- the THERMAL violation counter, which counts thermal slowdown time exactly, blips between
  readings included, but does not say whether SW or HW thermal slowdown held the clocks. The
  readings say which: the counter's share goes to the thermal reason the readings saw, and to
  the milder SW thermal reason when they saw none or both (so a counter never fails a GPU on a
  guess). NVML has no counter for HW_SLOWDOWN or HW_POWER_BRAKE (its per-reason field values,
  NVML_FI_DEV_CLOCKS_EVENT_REASON_*, are not read by gpumon's hardware layer): sampling only.
- The POWER counter is SW power-cap time (NVML's header defines
  NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP as the POWER perf-policy counter): evidence only.

A counter that goes backwards (driver reload, GPU reset) restarts from that reading. Idle,
SW power cap and application clocks are normal operation and never judged.

With less than ``min_history_s`` of readings in the window (a one-shot ``gpumon check``, the
daemon's first minute) there is no window to speak of: the current reading decides (a fail
reason active now fails, a warn reason warns).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon.bootstate import OMIT_DEFAULT, BootState
from gpumon.check import Check, CheckContext, each_gpu
from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported
from gpumon.hw.inventory import Inventory
from gpumon.hw.nvml import CLOCK_EVENT_REASONS, PERF_POLICIES, GpuInfo
from gpumon.model import Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

# NVIDIA documents HW slowdown as engaged by the board for thermal or power
# protection (nvmlClocksEventReasonHwSlowdown in the NVML API reference), so
# the remedy is at the hardware (cooling, power delivery), not the job.
_ACTIONS = {
    "hw_slowdown": Action.INSPECT_HARDWARE,
    "hw_thermal_slowdown": Action.INSPECT_HARDWARE,
    "hw_power_brake_slowdown": Action.INSPECT_HARDWARE,
}
_HW_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
_THERMAL = ("hw_thermal_slowdown", "sw_thermal_slowdown")
# Reported in evidence besides the judged reasons: normal operation, but worth seeing.
_SHOWN = ("sw_power_cap",)
# A counter may run slightly ahead of the wall clock between two readings (the two are
# read at different instants); more than this is not a measurement but a reset or garbage.
_COUNTER_SLACK = 1.05
_COUNTER_SLACK_S = 1.0

_FRACTION_SOURCE = (
    "argued from NVIDIA's definition: HW slowdown cuts core clocks by a factor of 2 or more "
    "(NVML nvmlClocksEventReasonHwSlowdown), so a GPU held there for a fraction f of the window "
    "loses at least f/2 of its throughput, and a synchronous job on it loses the same. ")
_WARN_DEFAULT = {r: 0.05 for r in (*_HW_REASONS, "sw_thermal_slowdown")}
_FAIL_DEFAULT = {r: 0.25 for r in _HW_REASONS}


def _reason_names() -> tuple[str, ...]:
    return tuple(CLOCK_EVENT_REASONS)


@dataclass(frozen=True)
class ThrottleConfig:
    # Reasons that fail a GPU (held for fail_fraction of the window, or active in a lone
    # reading) and reasons that can only warn.
    fail_reasons: list[str] = field(default_factory=lambda: list(_HW_REASONS))
    warn_reasons: list[str] = field(default_factory=lambda: ["sw_thermal_slowdown"])
    window_s: float = field(default=600.0, metadata={
        "min": 10, "max": 86400,
        "source": "leptonai/gpud components/accelerator/nvidia/hw-slowdown "
                  "DefaultStateHWSlowdownEvaluationWindow = 10 * time.Minute"})
    # reason -> share of the window at or above which the GPU warns / fails. Entries given in
    # a config file or profile replace the built-in entry for that reason; others keep theirs.
    warn_fraction: dict[str, float] = field(default_factory=lambda: dict(_WARN_DEFAULT), metadata={
        "source": _FRACTION_SOURCE + "5 % (30 s in 10 min, >= 2.5 % lost) is more than a blip and "
                  "worth a look; one 10 s reading is 1.7 % and stays quiet. gpud counts a minute as "
                  "slowed if any reading in it is, which is far more sensitive, and asks 60 % of "
                  "minutes before unhealthy (DefaultStateHWSlowdownEventsThresholdFrequencyPerMinute)"})
    fail_fraction: dict[str, float] = field(default_factory=lambda: dict(_FAIL_DEFAULT), metadata={
        "source": _FRACTION_SOURCE + "25 % of the window costs the whole job >= 12.5 %, beyond "
                  "run-to-run noise and worth taking the GPU out; below gpud's 60 % of minutes "
                  "(leptonai/gpud hw-slowdown DefaultStateHWSlowdownEventsThresholdFrequencyPerMinute"
                  " = 0.6) because a half-speed GPU stalls every rank of the job, not just itself"})
    min_history_s: float = field(default=60.0, metadata={
        "min": 0,
        "source": "argued: six readings at the default 10 s interval; with less history a share of "
                  "the window is a share of almost nothing, so the current reading decides"})
    max_sample_gap_s: float = field(default=120.0, metadata={
        "min": 1,
        "source": "argued: 12 default intervals; a longer silence (daemon stopped, check hung) is "
                  "not attributed to either reading. Keep it above the check's interval_s"})

    def __post_init__(self) -> None:
        for name in (*self.fail_reasons, *self.warn_reasons, *self.warn_fraction, *self.fail_fraction):
            if name not in CLOCK_EVENT_REASONS:
                raise ValueError(f"unknown clock event reason {name!r} "
                                 f"(known: {', '.join(_reason_names())})")
        # a partial mapping overrides only the reasons it names
        object.__setattr__(self, "warn_fraction", {**_WARN_DEFAULT, **self.warn_fraction})
        object.__setattr__(self, "fail_fraction", {**_FAIL_DEFAULT, **self.fail_fraction})
        for kind, table in (("warn_fraction", self.warn_fraction), ("fail_fraction", self.fail_fraction)):
            for name, value in table.items():
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"{kind}.{name} must be a share of the window in (0, 1], got {value}")
        for name in self.fail_reasons:
            if name not in self.fail_fraction:
                raise ValueError(f"fail reason {name!r} needs a fail_fraction entry")
            if name in self.warn_fraction and self.warn_fraction[name] > self.fail_fraction[name]:
                raise ValueError(f"warn_fraction.{name} is above fail_fraction.{name}")
        for name in self.warn_reasons:
            if name not in self.warn_fraction:
                raise ValueError(f"warn reason {name!r} needs a warn_fraction entry")
        if self.min_history_s > self.window_s:
            raise ValueError("min_history_s must not exceed window_s")


@dataclass
class Window:
    """Shares of the window, per reason, and how much of the window was observed."""

    observed_s: float
    fractions: dict[str, float]
    basis: dict[str, str]
    counter_fractions: dict[str, float]


def sampled_shares(samples: Sequence[Sequence[float]], start: float, end: float,
                   max_gap: float) -> tuple[float, dict[str, float]]:
    """(observed seconds, reason -> active seconds) in [start, end] from (time, mask) readings.

    Each gap between two readings is split at its middle: the first half in the earlier
    reading's state, the second in the later one's. A gap over ``max_gap`` is unobserved.
    """
    observed = 0.0
    active = {r: 0.0 for r in CLOCK_EVENT_REASONS}
    for (t0, m0), (t1, m1) in itertools.pairwise(samples):
        if not 0 < t1 - t0 <= max_gap:
            continue
        mid = (t0 + t1) / 2
        for a, b, mask in ((t0, mid, int(m0)), (mid, t1, int(m1))):
            span = min(b, end) - max(a, start)
            if span <= 0:
                continue
            observed += span
            for reason, bit in CLOCK_EVENT_REASONS.items():
                if mask & bit:
                    active[reason] += span
    return observed, active


def counter_share(spans: Iterable[Sequence[float]], start: float, end: float) -> float | None:
    """Share of [start, end] a violation counter ran, from (t0, t1, ns) spans; None if none overlap."""
    covered = busy = 0.0
    for t0, t1, ns in spans:
        if t1 <= t0:
            continue
        overlap = min(t1, end) - max(t0, start)
        if overlap <= 0:
            continue
        covered += overlap
        busy += ns / 1e9 * overlap / (t1 - t0)
    if covered <= 0:
        return None
    return min(1.0, max(0.0, busy / covered))


def window_shares(samples: Sequence[Sequence[float]], spans: Mapping[str, Sequence[Sequence[float]]],
                  now: float, window_s: float, max_gap: float) -> Window:
    start = now - window_s
    observed, active = sampled_shares(samples, start, now, max_gap)
    fractions = {r: (min(1.0, s / observed) if observed > 0 else 0.0) for r, s in active.items()}
    basis = {r: "readings" for r in fractions}
    counters = {name: f for name, s in spans.items() if (f := counter_share(s, start, now)) is not None}
    thermal = counters.get("thermal")
    if thermal is not None:
        hw, sw = (fractions[r] for r in _THERMAL)
        # the readings say which thermal reason; the counter says for how long
        target = "hw_thermal_slowdown" if hw > 0 and sw == 0 else "sw_thermal_slowdown"
        excess = thermal - (hw + sw)
        if excess > 0:
            fractions[target] = min(1.0, fractions[target] + excess)
            basis[target] = "THERMAL violation counter"
    return Window(observed, fractions, basis, counters)


@dataclass
class _History:
    """One GPU's readings in the window (JSON: lists for the tuples, as in the untyped state files)."""

    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, reasons mask)
    # counter name -> (t0, t1, ns it ran between two readings)
    spans: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    counters: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> last (time, ns)
    # counters seen going backwards; left out of the JSON while 0, where older files have no key
    resets: int = field(default=0, metadata=OMIT_DEFAULT)


@dataclass
class ThrottleState(BootState):
    """The check's declared state: ``{"boot_id", "gpus": {index: history}}``. A reboot restarts
    every counter and ends every slowdown: nothing is kept (``new_boot``)."""

    gpus: dict[str, _History] = field(default_factory=dict)


class ThrottleCheck(Check):
    name = "throttle"
    phase = Phase.CONTINUOUS
    description = "NVML clock event reasons over a window: HW slowdown, HW thermal slowdown, HW power brake"
    readings = (
        ReadingSpec(
            "throttle_active_ratio", "gauge",
            "Share of the throttle check's window (window_s, default 600 s) during which a clock-event "
            "(throttle) reason held this GPU's clocks (label reason, by default: hw_slowdown, "
            "hw_thermal_slowdown, hw_power_brake_slowdown, sw_thermal_slowdown, sw_power_cap).",
            unit="ratio 0..1",
            source="NVML nvmlDeviceGetCurrentClocksEventReasons sampled on every run, time-weighted, and "
                   "the thermal violation counter of nvmlDeviceGetViolationStatus",
            labels=("reason",)),
    )
    interval = 10.0
    timeout = 20.0
    Config = ThrottleConfig
    State = ThrottleState

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(ThrottleConfig)
        out = self.unreadable_gpus(ctx.inventory)
        gpus = ctx.state_as(ThrottleState).gpus

        def read(info: GpuInfo) -> tuple[int, dict[str, Any], dict[str, int]]:
            return (ctx.hw.nvml.clocks_event_reasons(info.index), *self._readings(ctx, info.index))

        # every GPU at once: a call that hangs on all of them costs one bound, not one per GPU
        for info, got in each_gpu(ctx, ctx.inventory.gpus, read, catch=(HwCondition,)):
            comp = gpu(info.index)
            if isinstance(got, HwCondition):
                # the reasons unreadable, or the GPU lost or hung in a reading: that is its finding
                out.append(self.from_condition(got, comp))
                continue
            mask, readings, counters = got
            now = ctx.clock()
            history = gpus.get(key := str(info.index))
            if history is None:
                history = gpus[key] = _History()
            _record(history, now, mask, counters, options)
            win = window_shares(history.samples, history.spans, now, options.window_s,
                                options.max_sample_gap_s)
            out.append(self._verdict(info.index, mask, win, readings, history.resets, options))
        return out

    def _verdict(self, index: int, mask: int, win: Window, readings: dict[str, Any], resets: int,
                 options: ThrottleConfig) -> Finding:
        comp = gpu(index)
        active = [n for n, bit in CLOCK_EVENT_REASONS.items() if mask & bit]
        judged = [*options.fail_reasons, *(r for r in options.warn_reasons if r not in options.fail_reasons)]
        shown = [*judged, *(r for r in _SHOWN if r not in judged)]
        minutes = f"{options.window_s / 60:g} min"
        evidence: dict[str, Any] = {
            "reasons_mask": hex(mask), "active": active, "window_s": options.window_s,
            "observed_s": round(win.observed_s, 1),
            "fractions": {r: round(win.fractions[r], 4) for r in shown},
            "basis": {r: win.basis[r] for r in shown if win.fractions[r] > 0},
        }
        if win.counter_fractions:
            evidence["violation_fraction"] = {k: round(v, 4) for k, v in win.counter_fractions.items()}
        if resets:
            evidence["counter_resets"] = resets
        evidence.update(readings)
        evidence["readings"] = [reading("throttle_active_ratio", win.fractions[r], reason=r) for r in shown]
        if win.observed_s < options.min_history_s:
            evidence["judged_by"] = (f"current reading ({win.observed_s:.0f} s of history in the window, "
                                     f"under min_history_s {options.min_history_s:g} s)")
            failing = [r for r in active if r in options.fail_reasons]
            warning = [r for r in active if r in options.warn_reasons and r not in failing]
            lone = " (current reading; no window history yet)"
            if failing:
                return self.finding(comp, Severity.FAIL,
                                    f"GPU {index} clocks held down by {', '.join(failing)}{lone}",
                                    _action(failing), **evidence)
            if warning:
                return self.finding(comp, Severity.WARN,
                                    f"GPU {index} clocks reduced by {', '.join(warning)}{lone}",
                                    Action.NONE, **evidence)
            why = f" ({', '.join(active)})" if active else ""
            return self.finding(comp, Severity.OK, f"no hardware slowdown{why}", **evidence)
        evidence["judged_by"] = f"share of the last {minutes}"
        share = win.fractions
        failing = [r for r in options.fail_reasons if share[r] >= options.fail_fraction[r]]
        warning = [r for r in judged if r not in failing and share[r] >= options.warn_fraction.get(r, 2.0)]
        if failing:
            what = ", ".join(f"{r} {share[r]:.0%} (fail at {options.fail_fraction[r]:.0%})" for r in failing)
            return self.finding(comp, Severity.FAIL,
                                f"GPU {index} clocks held down by {what} of the last {minutes}",
                                _action(failing), **evidence)
        if warning:
            what = ", ".join(f"{r} {share[r]:.0%} (warn at {options.warn_fraction[r]:.0%})" for r in warning)
            return self.finding(comp, Severity.WARN,
                                f"GPU {index} clocks reduced by {what} of the last {minutes}",
                                Action.NONE, **evidence)
        brief = [f"{r} {share[r]:.1%}" for r in judged if share[r] > 0]
        now = [r for r in active if r in judged]
        note = f"; of the last {minutes}: {', '.join(brief)}" if brief else ""
        note += f"; active now: {', '.join(now)}" if now else ""
        return self.finding(comp, Severity.OK, f"no sustained hardware slowdown{note}", **evidence)

    def _readings(self, ctx: CheckContext, index: int) -> tuple[dict[str, Any], dict[str, int]]:
        """Context for the operator, and the raw violation counters (ns) for the window.

        A reading that is unsupported is left out, not guessed; one that fails is named in the
        evidence. A lost GPU, or a reading that hangs, is raised: the GPU's finding (a GPU whose
        NVML calls hang is itself the fault, and asking it more would only be refused).
        """
        readings: dict[str, Any] = {}
        for key, read in (("sm_clock_mhz", ctx.hw.nvml.sm_clock_mhz),
                          ("temperature_c", ctx.hw.nvml.temperature_c),
                          ("power_w", ctx.hw.nvml.power_w)):
            try:
                readings[key] = read(index)
            except (GpuLost, HwTimeout):
                raise
            except NotSupported:
                continue
            except HwCondition as cond:
                readings[f"{key}_error"] = str(cond)
        counters: dict[str, int] = {}
        for policy in ("thermal", "power", "reliability"):
            try:
                counters[policy] = ctx.hw.nvml.violation_ns(index, PERF_POLICIES[policy])
            except (GpuLost, HwTimeout):
                raise
            except NotSupported:
                continue
            except HwCondition as cond:
                readings[f"violation_{policy}_error"] = str(cond)
        if counters:
            readings["violation_s"] = {k: v / 1e9 for k, v in counters.items()}
        return readings, counters


def _action(reasons: Sequence[str]) -> Action:
    return max(_ACTIONS.get(r, Action.INSPECT_HARDWARE) for r in reasons)


def _record(history: _History, now: float, mask: int, counters: Mapping[str, int],
            options: ThrottleConfig) -> None:
    """Add one reading (mask and violation counters) to a GPU's history, trimmed to the window."""
    samples, spans, last = history.samples, history.spans, history.counters
    if samples and now < samples[-1][0]:
        # the clock stepped back: earlier readings cannot be placed on it any more
        samples.clear()
        spans.clear()
        last.clear()
    samples.append((now, mask))
    for name in ("thermal", "power"):
        if name not in counters:
            continue
        value = counters[name]
        prev = last.get(name)
        last[name] = (now, value)
        if prev is None or now <= prev[0]:
            continue
        elapsed, delta = now - prev[0], value - prev[1]
        if delta < 0 or delta / 1e9 > elapsed * _COUNTER_SLACK + _COUNTER_SLACK_S:
            # restarted (driver reload, GPU reset) or garbage: count again from this reading
            history.resets += 1
            continue
        spans.setdefault(name, []).append((prev[0], now, min(delta, elapsed * 1e9)))
    start = now - options.window_s
    # keep the last reading before the window: the gap from it reaches into the window
    first = next((i for i, s in enumerate(samples) if s[0] >= start), len(samples))
    del samples[:max(0, first - 1)]
    for name in list(spans):
        spans[name] = [s for s in spans[name] if s[1] > start]
