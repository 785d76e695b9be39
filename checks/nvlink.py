"""nvlink: NVLink state per link against the SKU's link count, and error-counter rates.

Per GPU, every link NVML reports is read with ``nvmlDeviceGetNvLinkState``; a
GPU with fewer active links than the profile's ``nvlink.links_per_gpu`` fails,
with one finding per inactive link (``nvlink/<gpu>/<link>``) and a summary on
``gpu/<i>``. On active links the DL error counters (replay, recovery, CRC
flit, CRC data) are turned into rates from the previous run's sample kept in
``ctx.state``; the first run of a boot is a baseline, and a counter that went
backwards means the counters were reset (GPU reset, driver reload), never a
negative rate.

Capability gate (DESIGN.md "NVLink-down reported on PCIe GPUs"): a SKU whose
profile has no NVLink is not examined unless NVML reports active links (a
PCIe card with a bridge); inactive links there are not faults.

Remedy for a link fault (down, retrained, or a CRC storm): reboot the node. On
NVSwitch baseboards the GPU-to-NVSwitch links are trained by Fabric Manager
when it starts (NVIDIA Fabric Manager user guide, "What is Fabric Manager?",
https://docs.nvidia.com/datacenter/tesla/fabric-manager-user-guide/), so a
reboot is what re-runs link training, and with it the link equalisation, for
the whole fabric. NVIDIA's health-validation check ``nvlink_active``
(https://docs.nvidia.com/health-validation/reference/checks/nvlink) fails on
any inactive link and recommends reset_gpu -> restart_os -> service_required;
gpud maps Xid 74 (NVLink error) to RebootSystem, HardwareInspection
(shared/reference/xid-catalog.md). The same link faulting again after a
reboot points at the channel itself: inspect_hardware (within ``repeat_window_s``, the
repeat-after-reboot rule of ``gpumon.bootstate``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gpumon.bootstate import REPEAT_WINDOW_S, REPEAT_WINDOW_SOURCE, RepeatHistory, start_boot
from gpumon.check import Check, CheckContext
from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported
from gpumon.hw.inventory import Inventory
from gpumon.hw.nvml import GpuInfo, NvlinkErrors
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu, nvlink

COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")
_STATE_VERSION = 1
# what a counter means, for messages
_MEANING = {
    "replay": "flits retransmitted after a failed CRC",
    "recovery": "link lost lock and retrained",
    "crc_flit": "flits received with a bad CRC",
    "crc_data": "data packets received with a bad CRC",
}

_DCGM_LIMITS = ("NVIDIA DCGM common/DcgmGPUHardwareLimits.h @ 28bfbd4c97413d4aec249cdd9543a67d24f95b78: "
                "DCGM_LIMIT_MAX_NVLINK_ERROR 1, DCGM_LIMIT_MAX_NVLINK_CRC_ERROR 100.0 ('RM has informed us "
                "that CRC errors only matter at rates of 100+ per second')")
_DCGM_WATCH = ("NVIDIA DCGM modules/health/DcgmHealthWatch.cpp MonitorNVLink @ "
               "ffde4e54bc7249a6039a5e6b45b395141e1217f9")
_CRC_WARN = (f"{_DCGM_WATCH}: any CRC flit/data increase (>= DCGM_LIMIT_MAX_NVLINK_ERROR = 1) in its "
             "one-minute window is a warning; 0 here means any increase")
_CRC_FAIL = (f"{_DCGM_WATCH}: CRC errors at >= DCGM_LIMIT_MAX_NVLINK_CRC_ERROR per second fail; "
             f"{_DCGM_LIMITS}")
_REPLAY_WARN = (f"{_DCGM_WATCH} fails on any replay increase; gpumon warns instead because each replay is "
                "the retransmission of one CRC-failed flit, so replays track the CRC count and get the "
                "CRC rule (0 = any increase)")
_REPLAY_FAIL = (f"the CRC fail rate applied to the replays the CRC errors cause: {_DCGM_LIMITS}")
_RECOVERY = (f"{_DCGM_WATCH}: any recovery increase is a failure ('Replay and recovery errors are failures, "
             "not warnings', DCGM_FR_NVLINK_ERROR_CRITICAL); a recovery is a link retrain. 0 = any increase")


# a threshold rate: .inf (never reached) turns its level off, which the schema allows only where asked
_RATE = {"min": 0, "allow_inf": True}


@dataclass(frozen=True)
class NvlinkConfig:
    """Per-counter rates (errors per second over the time since the previous run) that warn or fail.

    A threshold of 0 means "any increase", ``.inf`` turns that level off. The fail threshold is
    tested first.
    """

    replay_warn_per_s: float = field(default=0.0, metadata={**_RATE, "source": _REPLAY_WARN})
    replay_fail_per_s: float = field(default=100.0, metadata={**_RATE, "source": _REPLAY_FAIL})
    recovery_warn_per_s: float = field(default=0.0, metadata={**_RATE, "source": _RECOVERY})
    recovery_fail_per_s: float = field(default=0.0, metadata={**_RATE, "source": _RECOVERY})
    crc_flit_warn_per_s: float = field(default=0.0, metadata={**_RATE, "source": _CRC_WARN})
    crc_flit_fail_per_s: float = field(default=100.0, metadata={**_RATE, "source": _CRC_FAIL})
    crc_data_warn_per_s: float = field(default=0.0, metadata={**_RATE, "source": _CRC_WARN})
    crc_data_fail_per_s: float = field(default=100.0, metadata={**_RATE, "source": _CRC_FAIL})
    # A rate is seen only in the run after it happened; holding it keeps a one-off
    # retrain visible to `gpumon check` and to the health state (issue 4).
    hold_s: float = field(default=3600.0, metadata={
        "min": 0, "source": "gpumon design choice: the same 1 h that xid.recent_window_s keeps an "
                            "application-level Xid reported after its last line"})
    repeat_window_s: float = field(default=REPEAT_WINDOW_S, metadata={
        "min": 0, "source": REPEAT_WINDOW_SOURCE})

    def __post_init__(self) -> None:
        for name in COUNTERS:
            warn, fail = self.warn_per_s(name), self.fail_per_s(name)
            if math.isnan(warn) or math.isnan(fail):
                raise ValueError(f"{name} thresholds must be numbers (.inf turns a level off)")
            if warn > fail:
                raise ValueError(f"{name}_warn_per_s ({warn:g}) is above {name}_fail_per_s ({fail:g})")

    def warn_per_s(self, counter: str) -> float:
        return float(getattr(self, f"{counter}_warn_per_s"))

    def fail_per_s(self, counter: str) -> float:
        return float(getattr(self, f"{counter}_fail_per_s"))


# ----------------------------------------------------------------------------- counter arithmetic


@dataclass(frozen=True)
class Sample:
    t: float
    values: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, **self.values}

    @classmethod
    def from_json(cls, data: Any) -> Sample | None:
        """A sample kept by an earlier run; None when it is missing or not in the shape we write."""
        if not isinstance(data, Mapping):
            return None
        t = data.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            return None
        values: dict[str, int] = {}
        for name in COUNTERS:
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                return None
            values[name] = v
        return cls(float(t), values)


@dataclass(frozen=True)
class Delta:
    """How the counters of one link moved between two samples."""

    reset: bool  # a counter went backwards: the counters were cleared in between
    dt: float
    increase: dict[str, int]
    rate_per_s: dict[str, float]


def counter_delta(prev: Sample | None, cur: Sample) -> Delta | None:
    """None when there is nothing to compare (no earlier sample, or time did not move forward)."""
    if prev is None or not cur.t > prev.t:
        return None
    dt = cur.t - prev.t
    if any(cur.values[c] < prev.values[c] for c in COUNTERS):
        return Delta(True, dt, {}, {})
    inc = {c: cur.values[c] - prev.values[c] for c in COUNTERS}
    return Delta(False, dt, inc, {c: inc[c] / dt for c in COUNTERS})


def classify(counter: str, increase: int, rate: float, options: NvlinkConfig) -> Severity | None:
    if increase <= 0:
        return None
    if rate >= options.fail_per_s(counter):
        return Severity.FAIL
    if rate >= options.warn_per_s(counter):
        return Severity.WARN
    return None


def _errors_sample(t: float, e: NvlinkErrors) -> Sample:
    return Sample(t, {"replay": e.replay, "recovery": e.recovery, "crc_flit": e.crc_flit,
                      "crc_data": e.crc_data})


# ----------------------------------------------------------------------------- persisted state


def _dict_at(parent: MutableMapping[str, Any], key: str) -> dict[str, Any]:
    """``parent[key]`` as a dict, replacing anything else (state written by an older or broken run)."""
    value = parent.get(key)
    if not isinstance(value, dict):
        value = parent[key] = {}
    return value


def _prepare_state(state: MutableMapping[str, Any], boot: str | None) -> None:
    if state.get("version") != _STATE_VERSION:
        state.clear()
        state["version"] = _STATE_VERSION
    # NVLink error counters are volatile: a new boot starts them (and their alarms) afresh;
    # only the history of faulted links survives, to escalate a fault the reboot did not cure
    start_boot(state, boot, keep=("version", "faults"))
    for key in ("samples", "breaches", "faults"):
        _dict_at(state, key)


# ----------------------------------------------------------------------------- the check


@dataclass
class _GpuResult:
    findings: list[Finding]
    summary: dict[str, Any]


class NvlinkCheck(Check):
    name = "nvlink"
    phase = Phase.CONTINUOUS
    description = "NVLink: active links against the SKU's count, replay/recovery/CRC error rates"
    # DCGM's NVLink health watch judges counters over one minute (DcgmHealthWatch.cpp MonitorNVLink)
    interval = 60.0
    timeout = 60.0
    Config = NvlinkConfig

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(NvlinkConfig)
        inv = ctx.inventory
        expected = ctx.profile.nvlink.links_per_gpu or 0
        with_links = [g for g in inv.gpus if (g.nvlink_count or 0) > 0]
        if expected == 0 and not with_links:
            return [self.finding(NODE, Severity.SKIPPED,
                                 f"no NVLink here: profile {ctx.profile.name} expects none and NVML "
                                 "reports no links", profile=ctx.profile.name)]
        boot = ctx.hw.fs.boot_id()
        _prepare_state(ctx.state, boot)
        now = ctx.clock()
        out = self.unreadable_gpus(inv)
        linkless = [g for g in inv.gpus if (g.nvlink_count or 0) == 0]
        results: dict[int, _GpuResult] = {}
        for info in inv.gpus:
            if (info.nvlink_count or 0) == 0:
                if expected > 0:
                    out.append(self._no_links(info, expected, every_gpu=len(linkless) == len(inv.gpus)))
                continue
            results[info.index] = self._gpu(ctx, info, expected, options, now, boot)
        if expected == 0:
            out.extend(self._unprofiled(ctx, results))
        else:
            for res in results.values():
                out.extend(res.findings)
        self._forget_history(ctx.state, now, options)
        return out

    # -- per GPU ---------------------------------------------------------

    def _no_links(self, info: GpuInfo, expected: int, *, every_gpu: bool) -> Finding:
        # NVML answering NOT_SUPPORTED for NVLink on a SKU built with it: on every GPU this is the
        # driver (NVLink disabled, e.g. NVreg_NvLinkDisable), a VM without NVLink passthrough, or a
        # wrong profile -- configuration no reset fixes, so no automatic remedy; on some GPUs only,
        # the driver lost those GPUs' links and a reboot re-initialises them.
        if every_gpu:
            msg = (f"NVML reports no NVLink on GPU {info.index} (nor on any GPU) but {info.name} has "
                   f"{expected} links: NVLink disabled in the driver, a VM without NVLink, or a wrong "
                   "profile; GPU-to-GPU traffic falls back to PCIe")
            action = Action.NONE
        else:
            msg = (f"NVML reports no NVLink on GPU {info.index} while other GPUs have theirs "
                   f"({expected} expected)")
            action = Action.REBOOT_NODE
        return self.finding(gpu(info.index), Severity.FAIL, msg, action, active=0, expected=expected,
                            nvml_links=0, uuid=info.uuid, pci_bus_id=info.pci_bus_id)

    def _gpu(self, ctx: CheckContext, info: GpuInfo, expected: int, options: NvlinkConfig, now: float,
             boot: str | None) -> _GpuResult:
        comp = gpu(info.index)
        count = info.nvlink_count or 0
        states: dict[int, bool | None] = {}
        out: list[Finding] = []
        for link in range(count):
            try:
                states[link] = ctx.hw.nvml.nvlink_state(info.index, link)
            except (GpuLost, HwTimeout) as cond:
                return _GpuResult([self.from_condition(cond, comp)], {"error": str(cond)})
            except HwCondition as cond:
                states[link] = None
                out.append(self.from_condition(cond, nvlink(info.index, link)))
        active = [link for link, up in states.items() if up]
        unread = [link for link, up in states.items() if up is None]
        inactive = [link for link, up in states.items() if up is False]
        not_reported = list(range(count, expected))
        summary: dict[str, Any] = {"active": len(active), "expected": expected or None,
                                   "nvml_links": count, "inactive_links": inactive,
                                   "uuid": info.uuid, "pci_bus_id": info.pci_bus_id}
        if not_reported:
            summary["links_not_reported_by_nvml"] = not_reported
        counter_findings, counters_note = self._counters(ctx, info, active, options, now, boot)
        if counters_note:
            summary["error_counters"] = counters_note
        if expected and len(active) < expected:
            down = inactive + not_reported
            if len(active) + len(unread) < expected or not unread:
                actions = []
                for link in down:
                    action = self._remedy(ctx.state, info, link, boot, now, options)
                    actions.append(action)
                    why = "not reported by NVML" if link >= count else "inactive"
                    out.append(self.finding(nvlink(info.index, link), Severity.FAIL,
                                            f"NVLink {link} of GPU {info.index} is {why}", action,
                                            uuid=info.uuid, pci_bus_id=info.pci_bus_id,
                                            repeated_after_reboot=action is Action.INSPECT_HARDWARE))
                out.append(self.finding(comp, Severity.FAIL,
                                        f"GPU {info.index}: {len(active)} of {expected} NVLinks active "
                                        f"(down: {', '.join(map(str, down))})",
                                        max(actions, default=Action.REBOOT_NODE), **summary))
            else:
                out.append(self.finding(comp, Severity.UNKNOWN,
                                        f"GPU {info.index}: {len(active)} of {expected} NVLinks known "
                                        f"active, {len(unread)} unreadable", **summary))
        elif expected and len(active) > expected:
            out.append(self.finding(comp, Severity.WARN,
                                    f"GPU {info.index}: {len(active)} NVLinks active, more than the "
                                    f"{expected} of profile {ctx.profile.name}: wrong profile?", **summary))
        else:
            out.append(self.ok(comp, f"GPU {info.index}: {len(active)} NVLinks active"
                                     + (f" of {expected}" if expected else ""), **summary))
        if counters_note and counters_note.startswith("not supported"):
            out.append(self.finding(comp, Severity.SKIPPED,
                                    f"GPU {info.index}: NVLink error counters {counters_note}"))
        out.extend(counter_findings)
        return _GpuResult(out, summary)

    def _unprofiled(self, ctx: CheckContext, results: dict[int, _GpuResult]) -> list[Finding]:
        """No NVLink in the profile but NVML reports links (a PCIe card, maybe bridged).

        Inactive links are no fault here: only the counters of links in use are judged.
        """
        if not any(r.summary.get("active") for r in results.values()):
            return [self.finding(NODE, Severity.SKIPPED,
                                 f"NVLinks present but none active, and profile {ctx.profile.name} "
                                 "expects none (no NVLink bridge?)",
                                 gpus={i: r.summary.get("nvml_links") for i, r in results.items()})]
        out: list[Finding] = []
        for res in results.values():
            out.extend(res.findings)
        return out

    # -- error counters --------------------------------------------------

    def _counters(self, ctx: CheckContext, info: GpuInfo, links: list[int], options: NvlinkConfig,
                  now: float, boot: str | None) -> tuple[list[Finding], str | None]:
        samples = _dict_at(_dict_at(ctx.state, "samples"), info.uuid)
        breaches = _dict_at(_dict_at(ctx.state, "breaches"), info.uuid)
        out: list[Finding] = []
        for link in links:
            comp = nvlink(info.index, link)
            try:
                errors = ctx.hw.nvml.nvlink_errors(info.index, link)
            except NotSupported as cond:
                return out, f"not supported ({cond.call})"
            except (GpuLost, HwTimeout) as cond:
                return [*out, self.from_condition(cond, gpu(info.index))], f"unreadable: {cond}"
            except HwCondition as cond:
                out.append(self.from_condition(cond, comp))
                continue
            cur = _errors_sample(now, errors)
            key = str(link)
            delta = counter_delta(Sample.from_json(samples.get(key)), cur)
            samples[key] = cur.to_json()
            held = _dict_at(breaches, key)
            if delta is not None and delta.reset:
                held.clear()  # the counters were cleared: the remedy (reset, reload) happened
            elif delta is not None:
                self._record(held, delta, options, now)
            finding = self._held_finding(ctx, info, link, held, cur, options, now, boot)
            if finding is not None:
                out.append(finding)
        return out, None

    @staticmethod
    def _record(held: dict[str, Any], delta: Delta, options: NvlinkConfig, now: float) -> None:
        for name in COUNTERS:
            sev = classify(name, delta.increase[name], delta.rate_per_s[name], options)
            if sev is not None:
                _dict_at(held, name)[sev.value] = {"last": now, "increase": delta.increase[name],
                                                   "rate_per_s": round(delta.rate_per_s[name], 6),
                                                   "over_s": round(delta.dt, 3)}

    def _held_finding(self, ctx: CheckContext, info: GpuInfo, link: int, held: dict[str, Any],
                      cur: Sample, options: NvlinkConfig, now: float, boot: str | None) -> Finding | None:
        worst: Severity | None = None
        parts: list[str] = []
        detail: dict[str, Any] = {}
        for name in COUNTERS:
            per_sev = held.get(name)
            if not isinstance(per_sev, dict):
                held.pop(name, None)
                continue
            for sev in (Severity.FAIL, Severity.WARN):
                entry = per_sev.get(sev.value)
                if not isinstance(entry, dict) or not _recent(entry.get("last"), now, options.hold_s):
                    per_sev.pop(sev.value, None)
                    continue
                detail[name] = {"severity": sev.value, **entry}
                parts.append(f"{name} +{entry.get('increase')} in {entry.get('over_s')} s "
                             f"({_MEANING[name]})")
                worst = sev if worst is None else max(worst, sev)
                break
        if worst is None:
            return None
        action = Action.NONE
        if worst is Severity.FAIL:
            action = self._remedy(ctx.state, info, link, boot, now, options)
        return self.finding(nvlink(info.index, link), worst,
                            f"NVLink {link} of GPU {info.index}: {'; '.join(parts)}", action,
                            counters=cur.values, breaches=detail, uuid=info.uuid, pci_bus_id=info.pci_bus_id,
                            repeated_after_reboot=action is Action.INSPECT_HARDWARE)

    # -- escalation across boots -----------------------------------------

    @staticmethod
    def _remedy(state: MutableMapping[str, Any], info: GpuInfo, link: int, boot: str | None, now: float,
                options: NvlinkConfig) -> Action:
        """reboot_node; inspect_hardware when the same link faulted in another boot recently."""
        repeated = RepeatHistory(_dict_at(state, "faults")).record(
            f"{info.uuid}/{link}", boot, now, options.repeat_window_s)
        return Action.INSPECT_HARDWARE if repeated else Action.REBOOT_NODE

    @staticmethod
    def _forget_history(state: MutableMapping[str, Any], now: float, options: NvlinkConfig) -> None:
        RepeatHistory(_dict_at(state, "faults")).forget(now, options.repeat_window_s)


def _recent(t: Any, now: float, window: float) -> bool:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return False
    return now - t <= window
