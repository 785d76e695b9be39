"""xid: NVIDIA driver Xid errors from the kernel log and NVML events, acted on per NVIDIA's catalog.

Two sources:

- the kernel log: parsed NVRM records (``gpumon.hw.nvrm``), with the line's detail
  (pid, process, NVLink unit and register words, Xid 45's root, Xid 154's new action);
- NVML Xid events (``nvmlEventSetWait``): only (GPU, code), but they reach gpumon where
  the kernel log does not (a container without ``/dev/kmsg``, an unreadable log).

An NVML event and a kernel line for the same GPU and code within ``dedup_window_s`` of
each other are one event, whichever arrives first. Events are folded into one group per
(component, root code) for the current boot, so a storm of 629 Xid 13 lines on one GPU is
one finding with a count. Catalog workflows applied here:

- Xid 45 "caused by previous Xid N" is a sympathetic cleanup: act on N.
- Xid 154 only announces the GPU's new recovery action: act on that action.
- NVLink5 Xids 144-150 take NVIDIA's decode sheet (unit, IntrInfo pattern and sub-code, error
  status), else the Fatal/Nonfatal word; a line NVIDIA resolves as XID_154_EVAL follows the Xid
  154 that accompanies it on the same GPU (from ``burst_gap_s`` before the NVLink line on), else
  it is restart_app. Xid 74 decodes NVIDIA's bit lists of registers 1, 3, 4 and 5
  (``catalog.decode_xid74``), and a bit class NVIDIA qualifies with "more than 2 times on the
  same link" / "if seen repeatedly" / "if it persists" escalates past ``XID74_REPEAT_LIMIT`` lines
  of the link. Both are link faults on ``nvlink/<gpu>/<link>``.
- Xid 63 (row remap event) asks NVML whether the remap is still pending.
- "GPU has fallen off the bus" without an Xid line is Xid 79 (NVSentinel #155).
- Xid 13/31 repeated on the same GPU (default 3 bursts in 24 h) escalate from
  restart_app to inspect_hardware; spread over GPUs they stay app errors.
- A code NVIDIA's catalog does not list, and a Xid 154 whose new action cannot be read, are
  warn / inspect_hardware (``catalog.UNKNOWN``).

A saved kernel log judged on purpose (``gpumon check --kmsg-file``: the kernel log handed in has
a ``judged_at`` time) is judged at the time of its newest record, as the node would have been
judged then, and without this host's NVML (its Xid events and row-remap state belong to this
boot, not to the saved one).

Application-level Xids (restart_app) stop being reported ``recent_window_s``
after their last line; GPU-level ones stay for the boot (a reboot or GPU reset
is what clears them).

The state kept across runs and restarts (the groups, GPU identities and the two de-duplication
ledgers) is the check's declared ``State`` (``state.py``), loaded, checked, saved and reset at a
reboot by the framework: saved state of another shape is logged and started afresh, never raised
on at every run.

The open NVML event set is a live object, not state: it is kept by the check instance (which
lives as long as the daemon, or one ``gpumon check``), re-opened when it breaks or when the
check is handed a new hardware session.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpumon.check import GPU_LOST, Check, CheckContext, KernelLogNeeds
from gpumon.errors import HwCondition, NotSupported
from gpumon.hw.inventory import Inventory
from gpumon.hw.kernellog import SavedKernelLog
from gpumon.hw.nvml import XidEventSet
from gpumon.hw.nvrm import FallenOffBus, GpuIdentity, XidEvent
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, gpu, nvlink, pci, reading

from .catalog import UNKNOWN, decode_nvlink5, decode_xid74, lookup, xid74_repeats
from .state import XidDetail, XidGroup, XidState

# nvmlGpuRecoveryAction_t values as printed in Xid 154 lines
_RECOVERY = {
    0: (Severity.OK, Action.NONE),            # None
    1: (Severity.FAIL, Action.RESET_GPU),     # GPU Reset Required
    2: (Severity.FAIL, Action.REBOOT_NODE),   # Node Reboot Required
    3: (Severity.WARN, Action.RESTART_APP),   # Drain P2P: stop peer traffic, no reset
    4: (Severity.FAIL, Action.RESET_GPU),     # Drain and Reset
}
_MAX_SAMPLES = 5
# Bounds on the de-duplication ledgers kept in state: a storm of 629 lines fits; a longer
# one keeps its newest entries (older ones could not be matched any more anyway).
_MAX_LEDGER = 1024
# How long an NVML event waits for its kernel line. The kernel log can lag behind NVML
# (a regular-file log is polled; an unreadable log can come back), so this is far longer
# than the matching window itself.
_PENDING_KEEP_S = 600.0
_KERNEL, _NVML = "kernel", "nvml"


@dataclass(frozen=True)
class XidConfig:
    # NVIDIA's WORKFLOW_XID_13/31: repeats on the same GPU point at hardware.
    # 3 in 24 h is the default (see issue notes); a burst is lines
    # closer than burst_gap_s, since one fault prints many lines at once.
    repeat_count: int = field(default=3, metadata={"min": 2})
    repeat_window_s: float = field(default=86400.0, metadata={"min": 60})
    burst_gap_s: float = field(default=60.0, metadata={"min": 0})
    recent_window_s: float = field(default=3600.0, metadata={"min": 0})
    ignore_codes: list[int] = field(default_factory=list)
    dedup_window_s: float = field(default=5.0, metadata={
        "min": 0, "max": 60,
        "source": "argued: the driver reports one Xid to the kernel log and to NVML event listeners "
                  "from its error-reporting path, moments apart; the window absorbs the error of the "
                  "kernel record's time (boot time from /proc/stat btime has 1 s resolution, and "
                  "boot time + uptime drifts from the wall clock by NTP slew) and stays far below "
                  "the 60 s burst gap, so two real faults are not merged"})


@dataclass
class _NvmlSource:
    """The NVML Xid event set of one hardware session, kept by the check between runs."""

    hw: Any
    events: XidEventSet | None
    opened_at: float
    last_poll: float
    error: str | None = None
    permanent: bool = False  # not worth re-opening (NVML off, or events unsupported)
    polls: int = 0
    unsupported_gpus: list[int] = field(default_factory=list)

    def close(self) -> None:
        if self.events is not None:
            with contextlib.suppress(HwCondition):
                self.events.close()
            self.events = None


@dataclass
class _Poll:
    ok: bool
    events: list[tuple[int, int]]
    lo: float
    hi: float
    new: bool  # the event set was opened in this run: nothing before now is covered
    error: str | None
    since: float


class XidCheck(Check):
    name = "xid"
    phase = Phase.CONTINUOUS
    description = "NVIDIA Xid errors (kernel log and NVML events), with NVIDIA's catalog actions"
    readings = (
        ReadingSpec(
            "xid_events_total", "counter",
            "NVIDIA Xid error events on this component since boot, per root Xid code (label code; an Xid 45 "
            "counts under the Xid it cleans up after; component: the GPU, nvlink/<gpu>/<link> for NVLink "
            "Xids, node when the GPU is unknown).",
            unit="events",
            source="the kernel log's NVRM Xid lines and NVML Xid events (nvmlEventSetWait), one event when "
                   "both report it",
            labels=("code",),
            note="Resets at reboot; an application Xid's series ends recent_window_s after its last event."),
    )
    interval = 60.0
    timeout = 10.0
    Config = XidConfig
    State = XidState
    kernel_log = KernelLogNeeds(events=(XidEvent, FallenOffBus, GpuIdentity), repeats=True)

    def __init__(self) -> None:
        self._nvml: _NvmlSource | None = None

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.gpus and not inventory.nvidia_pci_gpus and not inventory.unreadable_gpus:
            return "no NVIDIA GPU on this node"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        state = ctx.state_as(XidState)  # a reboot has cleared every Xid (XidState.new_boot)
        options = ctx.options_as(XidConfig)
        log = ctx.kernel_log
        groups = state.groups
        saved = isinstance(log, SavedKernelLog)
        now = log.judged_at if isinstance(log, SavedKernelLog) else ctx.clock()
        if saved:
            # a saved log of another boot: this host's NVML has nothing to say about it
            poll = _Poll(False, [], now, now, False, "not used for a saved kernel log", now)
            if log.available:
                self._kernel_events(ctx, state, options, now, watching=False)
        else:
            source = self._nvml_source(ctx, now)
            if log.available:
                self._kernel_events(ctx, state, options, now, watching=source.events is not None)
            poll = self._poll(source, now)
            for gpu_index, code in poll.events:
                if code not in options.ignore_codes:
                    self._nvml_event(ctx, state, gpu_index, code, poll, options)
            self._prune(state, now, options)
        remaps = {} if saved else {i: r for i in _gpus_with(groups, 63)
                                   if (r := _remap_state(ctx, i)) is not None}
        recoveries = _recoveries(groups)
        findings = [f for g in list(groups.values())
                    if (f := self._finding(g, now, options, state.identities, remaps, recoveries))]
        return findings + self._node_findings(log, poll, bool(findings), saved=saved)

    # -- NVML events --------------------------------------------------------

    def _nvml_source(self, ctx: CheckContext, now: float) -> _NvmlSource:
        src = self._nvml
        if src is not None and src.hw is not ctx.hw:
            src.close()  # a new hardware session: the old set belongs to the old one
            src = None
        if src is None or (src.events is None and not src.permanent):
            src = self._nvml = _open_events(ctx, now)
        return src

    def _poll(self, src: _NvmlSource, now: float) -> _Poll:
        new = src.polls == 0
        lo = src.last_poll
        if src.events is None:
            return _Poll(False, [], lo, now, new, src.error, src.opened_at)
        try:
            # zero timeout: whatever has queued since the last run, without waiting
            got = src.events.wait(0.0)
        except HwCondition as cond:
            src.close()
            src.error = f"{cond.call}: {cond}"
            return _Poll(False, [], lo, now, new, src.error, src.opened_at)
        src.last_poll = now
        src.polls += 1
        return _Poll(True, got, lo, now, new, None, src.opened_at)

    def _nvml_event(self, ctx: CheckContext, state: XidState, gpu_index: int, code: int, poll: _Poll,
                    options: XidConfig) -> None:
        groups = state.groups
        ledger = state.kernel_unmatched
        lo, hi = poll.lo - options.dedup_window_s, poll.hi + options.dedup_window_s
        for i, (k_gpu, k_code, k_when, key) in enumerate(ledger):
            # The event happened after the previous poll (else it would have come then)
            # and before this one: a kernel line of the same GPU and code inside that
            # span, widened by the window, is the same event.
            if k_gpu == gpu_index and k_code == code and lo <= k_when <= hi:
                del ledger[i]
                if key in groups:
                    _mark(groups[key], _NVML)
                return
        component = gpu(gpu_index) if gpu_index >= 0 else NODE
        key = f"{component}|{code}"
        g = _group(groups, key, component, code, _bus_of(ctx.inventory, gpu_index), poll.hi)
        _count(g, poll.hi, options)
        _mark(g, _NVML)
        if len(g.samples) < _MAX_SAMPLES:
            g.samples.append(f"NVML Xid event {code} (no kernel log line seen for it)")
        pending = state.nvml_unmatched
        pending.append((gpu_index, code, poll.lo, poll.hi, key))
        del pending[:-_MAX_LEDGER]

    # -- kernel log -----------------------------------------------------------

    def _kernel_events(self, ctx: CheckContext, state: XidState, options: XidConfig, now: float, *,
                       watching: bool) -> None:
        log = ctx.kernel_log
        groups, identities = state.groups, state.identities
        for event in log.events:
            if isinstance(event, GpuIdentity):
                ident = identities.setdefault(event.pci or "?", {})
                if event.uuid:
                    ident["uuid"] = event.uuid
                if event.serial:
                    ident["serial"] = event.serial
                continue
            if isinstance(event, XidEvent):
                if event.code in options.ignore_codes:
                    continue
                code = event.code
            elif isinstance(event, FallenOffBus):
                code = 79
            else:
                continue
            when = log.time_of(event.record, now)
            # the same line logged `repeats` times within a second (the daemon's pump counts
            # them instead of handing each over), the last of them at `last`
            repeats, last = 1, when
            if isinstance(event, XidEvent) and event.repeats > 1:
                repeats = event.repeats
                if event.last_record is not None:
                    last = max(when, log.time_of(event.last_record, now))
            key = self._add(groups, ctx.inventory, event, event.pci, code, when, options, repeats, last)
            if key is None:
                continue
            gpu_index = _gpu_index(ctx.inventory, event.pci)
            if gpu_index is None:
                continue  # NVML events name a GPU index: nothing to match against
            # each line matches one NVML event; lines past the ledger's size would only push
            # their own kind out of it
            ledger = state.kernel_unmatched
            for i in range(min(repeats, _MAX_LEDGER)):
                at = when if i == 0 else last
                if state.nvml_unmatched and self._matches_pending(state, gpu_index, code, at, options):
                    _mark(groups[key], _NVML)
                elif watching:
                    ledger.append((gpu_index, code, at, key))
            del ledger[:-_MAX_LEDGER]

    def _matches_pending(self, state: XidState, gpu_index: int, code: int, when: float,
                         options: XidConfig) -> bool:
        """A kernel line arriving after its NVML event: take the event back out of its NVML-only group."""
        groups, pending = state.groups, state.nvml_unmatched
        w = options.dedup_window_s
        for i, (n_gpu, n_code, lo, hi, key) in enumerate(pending):
            if n_gpu == gpu_index and n_code == code and lo - w <= when <= hi + w:
                del pending[i]
                g = groups.get(key)
                if g is not None:
                    g.count -= 1
                    if g.count <= 0:
                        del groups[key]
                return True
        return False

    def _prune(self, state: XidState, now: float, options: XidConfig) -> None:
        # the next NVML events cover (now, next run]: older kernel lines cannot match them
        oldest = now - options.dedup_window_s
        state.kernel_unmatched[:] = [e for e in state.kernel_unmatched if e[2] >= oldest]
        state.nvml_unmatched[:] = [e for e in state.nvml_unmatched if e[3] >= now - _PENDING_KEEP_S]

    def _add(self, groups: dict[str, XidGroup], inv: Inventory, event: Any, bus: str | None,
             code: int, when: float, options: XidConfig, repeats: int = 1,
             last: float | None = None) -> str | None:
        gpu_index = _gpu_index(inv, bus)
        via: int | None = None
        if isinstance(event, XidEvent) and code == 45 and event.cause_xid:
            via, code = 45, event.cause_xid
        link = event.nvlink_link if isinstance(event, XidEvent) and via is None and (
            code == 74 or 144 <= code <= 150) else None
        if gpu_index is not None and link is not None and link >= 0:
            component = nvlink(gpu_index, link)
        elif gpu_index is not None:
            component = gpu(gpu_index)
        elif bus is not None:
            component = pci(bus)
        else:
            component = NODE
        key = f"{component}|{code}"
        g = _group(groups, key, component, code, bus, when)
        if isinstance(event, FallenOffBus) and g.count:
            return None  # the same fall reported again in the driver's own words: one event
        _count(g, when, options)
        if repeats > 1:
            # the repeats came within a second of the first (gpumon.kernel_pump): a burst that
            # began among them is dated by their last, at most that second late
            _count(g, when if last is None else last, options)
            g.count += repeats - 2
        _mark(g, _KERNEL)
        if via is not None and via not in g.via:
            g.via.append(via)
        if isinstance(event, XidEvent):
            _details(g, event, code, via)
        elif isinstance(event, FallenOffBus) and len(g.samples) < _MAX_SAMPLES:
            g.samples.append("GPU has fallen off the bus (no Xid line)")
        return key

    # -- verdicts ---------------------------------------------------------------

    def _finding(self, g: XidGroup, now: float, options: XidConfig,
                 identities: dict[str, dict[str, str]],
                 remaps: dict[int, dict[str, Any]],
                 recoveries: dict[str, XidGroup]) -> Finding | None:
        code = g.code
        info = lookup(code)
        severity = info.severity if info else UNKNOWN.severity
        action = info.action if info else UNKNOWN.action
        name = info.mnemonic.split(" / ")[0] if info else "(not in NVIDIA's catalog)"
        label = f"Xid {code} {name}"
        advice = info.advice if info else UNKNOWN.advice
        note = f": {advice}" if advice else ""
        extra: dict[str, Any] = {}
        detail = g.detail
        if code == 154:
            to = g.recovery_to
            if to is None:
                severity, action = UNKNOWN.severity, UNKNOWN.action
                note = (": the GPU's recovery action changed, but to what cannot be read (a damaged line, "
                        "or an NVML event without its line): read it with nvidia-smi -q")
            else:
                severity, action = _RECOVERY.get(int(to[0]), (Severity.WARN, Action.RESET_GPU))
                note = f": GPU recovery action is now {to[1]}"
        elif detail is not None:
            severity, action = Severity(detail.severity), Action(detail.action)
            note = f": {detail.basis}"
            if detail.resolution == "XID_154_EVAL":
                follow = recoveries.get(g.pci or "")
                if follow is not None and follow.last >= g.first - options.burst_gap_s:
                    to = follow.recovery_to
                    assert to is not None  # _recoveries keeps only groups with one
                    severity, action = _RECOVERY.get(int(to[0]), (Severity.WARN, Action.RESET_GPU))
                    note += f"; follows the Xid 154 on this GPU: recovery action {to[1]}"
                else:
                    note += "; no Xid 154 with it, so NVIDIA says restart the application"
            if code == 74:
                repeated = xid74_repeats(g.x74_lines or {})
                if repeated is not None and (repeated[0], repeated[1]) > (severity, action):
                    severity, action = repeated[0], repeated[1]
                    note += f"; {repeated[2]}"
            extra = {k: v for k in ("register_words", "nvlink_classes", "nvlink_unit", "error_status",
                                    "nvidia_resolution", "nvidia_investigatory")
                     if (v := getattr(g, k)) is not None}
        elif code == 45 and not g.via:
            # Solo Xid 45: NVIDIA says restart fabric manager; the job itself was killed.
            severity, action = Severity.WARN, Action.RESTART_APP
            note = ": solo (no root Xid named): NVIDIA says restart the fabric manager (WORKFLOW_XID_45)"
        elif code == 63 and g.component.startswith("gpu/"):
            remap = remaps.get(int(g.component.split("/")[1]))
            if remap is not None:
                severity, action, note = remap["severity"], remap["action"], f": {remap['note']}"
                extra = {"remap": remap["evidence"]}
        bursts = [b for b in g.bursts if now - b <= options.repeat_window_s]
        if code in (13, 31) and g.component.startswith("gpu/") and len(bursts) >= options.repeat_count:
            severity, action = Severity.FAIL, Action.INSPECT_HARDWARE
            note = (f": {len(bursts)} separate bursts on this GPU within "
                    f"{options.repeat_window_s / 3600:g} h (NVIDIA WORKFLOW_XID_{code}: suspect hardware)")
        elif action <= Action.RESTART_APP and now - g.last > options.recent_window_s:
            return None  # an application fault that has gone quiet
        if severity is Severity.OK and not (code == 63 and extra):
            return None
        ident = identities.get(g.pci or "", {})
        evidence: dict[str, Any] = {
            "code": code, "count": g.count, "first_seen": g.first, "last_seen": g.last,
            "pci_bus_id": g.pci, "samples": g.samples, "bursts": len(bursts),
            "source": "+".join(g.sources or [_KERNEL]),
        }
        if info:
            evidence["mnemonic"] = info.mnemonic
            evidence["nvidia_action"] = info.nvidia_action
            if info.override:
                evidence["gpumon_override"] = info.override
        if g.pids:
            evidence["pids"] = g.pids
        if g.processes:
            evidence["processes"] = g.processes
        if g.via:
            evidence["reported_via_xid"] = g.via
        evidence.update(extra)
        evidence.update({k: v for k, v in ident.items()})
        if code == 79 and g.component.startswith("gpu/"):
            evidence[GPU_LOST] = True  # the loss the NVML checks then report too: logged once
        # counted per boot: the series restarts at 0 after a reboot, as a counter may
        evidence["readings"] = [reading("xid_events_total", g.count, code=code)]
        times = "" if g.count == 1 else f" ({g.count} events)"
        where = g.component if g.component != NODE else "an unidentified GPU"
        via = " via Xid 45" if g.via else ""
        return self.finding(g.component, severity, f"{label} on {where}{via}{times}{note}", action,
                            **evidence)

    def _node_findings(self, log: Any, poll: _Poll, have_findings: bool, *, saved: bool) -> list[Finding]:
        nvml_status = (f"watching since {_iso(poll.since)}" if poll.ok
                       else f"unavailable: {poll.error or 'unknown reason'}")
        if not log.available:
            why = f"kernel log unreadable: {log.error or 'unknown reason'}"
            if not poll.ok:
                return [self.finding(NODE, Severity.UNKNOWN, f"{why}; NVML Xid events {nvml_status}",
                                     kernel_log=log.source, nvml_events=nvml_status)]
            if poll.new:
                # NVML reports only events after the set was opened: the boot so far is unseen
                return [self.finding(NODE, Severity.UNKNOWN,
                                     f"{why}; NVML Xid events are watched from now on, so Xids "
                                     "earlier in this boot cannot be seen", kernel_log=log.source,
                                     missing_source="kernel_log", nvml_events=nvml_status)]
            return [self.finding(NODE, Severity.OK,
                                 f"Xids seen through NVML events only ({why})", kernel_log=log.source,
                                 missing_source="kernel_log", nvml_events=nvml_status)]
        if not have_findings:
            said = f"no Xid errors in the saved kernel log {log.source}" if saved else \
                "no Xid errors in the kernel log this boot"
            return [self.ok(NODE, said,
                            source=log.source, records_read=log.records_read,
                            lost_records=log.lost_records, nvml_events=nvml_status)]
        if log.lost_records:
            return [self.finding(NODE, Severity.WARN,
                                 f"{log.lost_records} kernel log records were overwritten "
                                 "before gpumon read them", source=log.source)]
        return []


def _open_events(ctx: CheckContext, now: float) -> _NvmlSource:
    nvml = ctx.hw.nvml
    if not nvml.initialized:
        return _NvmlSource(ctx.hw, None, now, now, "NVML is not initialized", permanent=True)
    indices = [g.index for g in ctx.inventory.gpus]
    if not indices:
        return _NvmlSource(ctx.hw, None, now, now, "no GPU readable through NVML")
    try:
        events = nvml.open_xid_events(indices)
    except NotSupported as cond:
        return _NvmlSource(ctx.hw, None, now, now, f"{cond.call}: {cond}", permanent=True)
    except HwCondition as cond:
        return _NvmlSource(ctx.hw, None, now, now, f"{cond.call}: {cond}")
    missing = [i for i in indices if i not in events.registered]
    if not events.registered:
        with contextlib.suppress(HwCondition):
            events.close()
        return _NvmlSource(ctx.hw, None, now, now, "Xid events not supported on any GPU", permanent=True)
    return _NvmlSource(ctx.hw, events, now, now, unsupported_gpus=missing)


def _group(groups: dict[str, XidGroup], key: str, component: str, code: int, bus: str | None,
           when: float) -> XidGroup:
    g = groups.get(key)
    if g is None:
        g = groups[key] = XidGroup(component=component, code=code, pci=bus, first=when, last=when)
    return g


def _count(g: XidGroup, when: float, options: XidConfig) -> None:
    g.count += 1
    g.first = min(g.first, when)
    g.last = max(g.last, when)
    bursts = g.bursts
    if not bursts or when - bursts[-1] > options.burst_gap_s:
        bursts.append(when)
        del bursts[:-50]


def _mark(g: XidGroup, source: str) -> None:
    sources = g.sources
    if source not in sources:
        sources.append(source)
        sources.sort()


def _details(g: XidGroup, event: XidEvent, code: int, via: int | None) -> None:
    if len(g.samples) < _MAX_SAMPLES:
        g.samples.append(event.message[:300])
    if event.pid is not None and event.pid not in g.pids and len(g.pids) < _MAX_SAMPLES:
        g.pids.append(event.pid)
    if event.process and event.process not in g.processes and len(g.processes) < _MAX_SAMPLES:
        g.processes.append(event.process)
    if code == 154 and event.recovery_to is not None:
        g.recovery_to = event.recovery_to
    if via is not None:
        return  # the Xid 45 line carries none of its root's detail
    if 144 <= code <= 150:
        nvl5 = decode_nvlink5(code, event.nvlink_unit, event.nvlink_fatal, event.nvlink_words)
        if nvl5 is not None:
            if _worst_detail(g, nvl5.severity, nvl5.action, nvl5.basis, nvl5.resolution):
                g.nvidia_resolution = nvl5.resolution or None
                g.nvidia_investigatory = nvl5.investigatory or None
                if nvl5.status is not None:
                    g.error_status = hex(nvl5.status)
            g.nvlink_unit = event.nvlink_unit
    elif code == 74:
        x74 = decode_xid74(event.register_words)
        if x74 is not None:
            _worst_detail(g, x74.severity, x74.action, x74.basis)
            g.nvlink_classes = sorted(set(g.nvlink_classes or []) | set(x74.classes))
            g.register_words = [hex(w) for w in event.register_words]
            if g.x74_lines is None:
                g.x74_lines = {}
            lines = g.x74_lines
            for name in x74.classes:
                lines[name] = lines.get(name, 0) + 1


def _worst_detail(g: XidGroup, severity: Severity, action: Action, basis: str,
                  resolution: str = "") -> bool:
    """Keep the worst line's verdict as the group's detail; True when this line's was kept."""
    old = g.detail
    if old is not None and (Severity(old.severity), Action(old.action)) >= (severity, action):
        return False
    g.detail = XidDetail(severity.value, action.value, basis, resolution)
    return True


def _recoveries(groups: dict[str, XidGroup]) -> dict[str, XidGroup]:
    """The Xid 154 group with a readable recovery action, per PCI bus id, newest line first."""
    out: dict[str, XidGroup] = {}
    for g in groups.values():
        if g.code == 154 and g.recovery_to is not None and g.pci and (
                g.pci not in out or g.last > out[g.pci].last):
            out[g.pci] = g
    return out


def _gpus_with(groups: dict[str, XidGroup], code: int) -> set[int]:
    return {int(g.component.split("/")[1]) for g in groups.values()
            if g.code == code and g.component.startswith("gpu/")}


def _remap_state(ctx: CheckContext, index: int) -> dict[str, Any] | None:
    """What NVML says of a GPU's row remapping, for an Xid 63; None to keep the catalog verdict."""
    nvml = ctx.hw.nvml
    if not nvml.initialized:
        return None
    try:
        rows = nvml.remapped_rows(index)
    except NotSupported:
        return _retired_pages_state(ctx, index)  # pre-Ampere: Xid 63 is a page retirement
    except HwCondition as cond:
        return {"severity": Severity.WARN, "action": Action.RESET_GPU,
                "note": f"row remap state unreadable ({cond}); a remap may be pending",
                "evidence": {"error": f"{cond.call}: {cond}"}}
    ev = {"pending": rows.pending, "failure": rows.failure, "corrected_rows": rows.corrected,
          "uncorrected_rows": rows.uncorrected}
    if rows.failure:
        return {"severity": Severity.FAIL, "action": Action.INSPECT_HARDWARE, "evidence": ev,
                "note": "NVML reports a row-remapping failure (NVIDIA's RMA criterion)"}
    if rows.pending:
        # NVIDIA (memory error management guide, "Row-remapping pending flag"; NVML
        # nvmlDeviceGetRemappedRows): running and new work are unaffected until the reset that
        # applies the remap, so it is scheduled (warn), not an emergency.
        return {"severity": Severity.WARN, "action": Action.RESET_GPU, "evidence": ev,
                "note": "row remap pending: reset the GPU at the next drain to apply it"}
    return {"severity": Severity.OK, "action": Action.NONE, "evidence": ev,
            "note": "row remap already applied (nothing pending)"}


def _retired_pages_state(ctx: CheckContext, index: int) -> dict[str, Any] | None:
    try:
        pages = ctx.hw.nvml.retired_pages(index)
    except HwCondition:
        return None
    ev = {"retired_pages_pending": pages.pending, "retired_sbe": pages.single_bit,
          "retired_dbe": pages.double_bit}
    if pages.pending:
        return {"severity": Severity.WARN, "action": Action.RESET_GPU, "evidence": ev,
                "note": "page retirement pending: it takes effect at the next GPU reset"}
    return {"severity": Severity.OK, "action": Action.NONE, "evidence": ev,
            "note": "page already retired (nothing pending)"}


def _bus_of(inv: Inventory, index: int) -> str | None:
    for g in inv.gpus:
        if g.index == index:
            return g.pci_bus_id
    return None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")




def _gpu_index(inv: Inventory, bus: str | None) -> int | None:
    if bus is None:
        return None
    found = inv.gpu_by_pci(bus)
    if found is not None:
        return found.index
    # A GPU that fell off the bus is often missing from NVML; NVML numbers GPUs
    # in PCI bus order, so its place among the NVIDIA GPUs on the bus is its index.
    buses = sorted(d.bus_id for d in inv.nvidia_pci_gpus)
    if bus in buses and len(buses) == len(inv.gpus) + len(inv.unreadable_gpus):
        return buses.index(bus)
    return None
