"""The Check protocol: what a check is, and what it is handed when it runs.

A check knows nothing of exporters, cordons or other checks. It touches the
machine only through ``ctx.hw`` and returns at least one finding for every
component it examined (``ok`` included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported, ToolMissing
from gpumon.model import Action, Finding, Phase, Severity

if TYPE_CHECKING:
    from gpumon.hw import Hardware
    from gpumon.hw.inventory import Inventory
    from gpumon.profiles import Profile


@dataclass
class KernelLog:
    """Kernel-log events handed to a check: NVRM events parsed by the hw layer.

    ``available`` is False when the log could not be read; the check must then
    say ``unknown`` with ``error`` rather than report a clean log.
    """

    events: Sequence[Any] = ()
    # the raw kernel records (gpumon.hw.kmsg.KernelRecord), for checks that read non-NVRM lines
    records: Sequence[Any] = ()
    available: bool = True
    error: str | None = None
    source: str = ""
    records_read: int = 0
    lost_records: int = 0
    # epoch seconds of this boot, to date records that carry only kernel uptime
    boot_time: float | None = None
    # what the check's kernel_log_fold gathered from the records since its last run, when the
    # daemon's pump folded them as they came (those records are then not in ``records``)
    folded: Any = None

    def time_of(self, record: Any, now: float) -> float:
        """When a record was logged: its wall clock, else boot time + kernel uptime, else ``now``.

        ``boot_time`` is /proc/stat btime or, without it, the kernel-log follower's anchor
        (now - /proc/uptime, else now - the newest record's kernel time; see
        ``KernelLogFollower.boot_anchor``): records with kernel time are then dated by their
        own stamps, so intervals between them are right whatever the anchor's error. Only a
        record with no timestamp at all is dated ``now``."""
        wall = getattr(record, "wall_time", None)
        if wall is not None:
            return float(wall.timestamp())
        usec = getattr(record, "monotonic_us", None)
        if usec is not None and self.boot_time is not None:
            return float(self.boot_time + usec / 1e6)
        return now


class KernelLogFold(Protocol):
    """A check's own summary of its kernel-log lines, kept up to date by the daemon's kernel-log
    pump as records arrive (``Check.kernel_log_fold``), so that a storm of lines the check only
    counts costs a dictionary update per line, not a run of the check per batch.

    The pump calls ``add`` for every record of the current boot not yet seen by the check (in
    order, on its own thread) and ``take`` when the check runs; the check gets what ``take``
    returned in ``KernelLog.folded``. Both are called under the pump's lock, never at once."""

    def add(self, record: Any, when: float) -> Iterable[Hashable]:
        """Fold one record (logged at ``when``, epoch seconds); return the keys of what in it
        should run the check at once (e.g. an uncorrectable error on a device): none for a
        record the check only counts, which waits for its regular run."""
        ...

    def take(self) -> Any:
        """What was folded since the last take (None: nothing), and start afresh."""
        ...


@dataclass
class CheckContext:
    hw: Hardware
    inventory: Inventory
    profile: Profile
    params: Any
    state: MutableMapping[str, Any]
    kernel_log: KernelLog
    clock: Callable[[], float] = time.time
    node: str = "localhost"
    extras: dict[str, Any] = field(default_factory=dict)
    # the agent's state directory (a simulated node's own one); None: not known to this caller
    state_dir: Path | None = None


class Check:
    """Base class for checks. Subclasses set the class attributes and ``run``.

    ``name`` is one string everywhere: entry point, CLI argument, config
    section, JSON ``check`` and metric label.
    """

    name: ClassVar[str] = ""
    phase: ClassVar[Phase] = Phase.CONTINUOUS
    description: ClassVar[str] = ""
    interval: ClassVar[float] = 60.0
    timeout: ClassVar[float] = 30.0
    # A dataclass of the check's own options (its YAML section), or None.
    Config: ClassVar[type[Any] | None] = None
    # Checks fed by the kernel log run as soon as something they read arrives (in the daemon,
    # at most every 0.5 s unless it is new: gpumon.daemon.KernelLogPump). What they read,
    # which is all that the daemon keeps for them between runs:
    uses_kernel_log: ClassVar[bool] = False
    # - these NVRM event types (gpumon.hw.nvrm) in KernelLog.events (None: every event);
    kernel_log_events: ClassVar[tuple[type, ...] | None] = None
    # - the raw records (gpumon.hw.kmsg.KernelRecord) in KernelLog.records; the check then
    #   runs for a record that contains one of kernel_log_match (empty: any record). Kernel
    #   noise (network, USB) must not re-run a check that reads sysfs on every turn;
    kernel_log_records: ClassVar[bool] = True
    kernel_log_match: ClassVar[tuple[str, ...]] = ()
    # - a fold of the records (kernel_log_fold), handed over in KernelLog.folded.
    # Outside the daemon (gpumon check, a saved log) a check gets every event and record.

    def kernel_log_fold(self) -> KernelLogFold | None:
        """A fold of this check's kernel-log records for the daemon's pump to keep (see
        KernelLogFold); None: the pump queues events and records as declared above."""
        return None

    def supported(self, inventory: Inventory) -> str | None:
        """None if the check applies to this node, else the reason it does not."""
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise NotImplementedError

    # Helpers so that every check words common outcomes the same way.

    def finding(self, component: str, severity: Severity, message: str,
                action: Action = Action.NONE, **evidence: Any) -> Finding:
        return Finding(check=self.name, component=component, severity=severity,
                       message=message, action=action, evidence=evidence)

    def ok(self, component: str, message: str, **evidence: Any) -> Finding:
        return self.finding(component, Severity.OK, message, **evidence)

    def from_condition(self, cond: HwCondition, component: str | None = None) -> Finding:
        return condition_finding(self.name, cond, component)


def condition_finding(check: str, cond: HwCondition, component: str | None = None) -> Finding:
    """The one place where a hardware condition becomes a finding."""
    comp = component or cond.component
    if isinstance(cond, GpuLost):
        return Finding(check, comp, Severity.FAIL, f"GPU lost ({cond.call}): {cond}",
                       Action.REBOOT_NODE, {"call": cond.call})
    if isinstance(cond, HwTimeout):
        # An NVML call on a GPU that does not return is the driver not answering for that GPU:
        # the caller sits in the kernel (D state), cannot be killed, and a GPU reset goes through
        # the same driver, so only a reboot clears it. NVIDIA/NVSentinel
        # health-monitors/gpu-health-monitor/gpu_health_monitor/platform_connector/platform_connector.py
        # (dcgm_probe_unresponsive: a node-local probe hang is GpuDriverUnresponsive/DRIVER_PROBE_HANG
        # with RESTART_BM) and docs/runbooks/gpu-monitor-dcgm-failures.md ("Unresponsive Driver":
        # "reboot the node ... nothing short of a reboot clears the wedge"); leptonai/gpud
        # pkg/nvidia-query/nvidia_smi_query.go (RunSMI: a driver issue leaves nvidia-smi stuck in
        # state D, which no kill ends; leptonai/gpud#117 suggests a reboot for it).
        # Any other hang on a GPU (a tool, a worker) asks for a reset; elsewhere (a file) no remedy.
        if comp.startswith("gpu/") and cond.call.startswith("nvml"):
            action = Action.REBOOT_NODE
        elif comp.startswith("gpu/"):
            action = Action.RESET_GPU
        else:
            action = Action.NONE
        return Finding(check, comp, Severity.FAIL,
                       f"hung after {cond.seconds:g} s in {cond.call}", action,
                       {"call": cond.call, "timeout_s": cond.seconds})
    if isinstance(cond, ToolMissing):
        return Finding(check, comp, Severity.SKIPPED, str(cond), Action.NONE, {"call": cond.call})
    if isinstance(cond, NotSupported):
        return Finding(check, comp, Severity.SKIPPED, f"not supported here: {cond}", Action.NONE,
                       {"call": cond.call})
    return Finding(check, comp, Severity.UNKNOWN, f"{cond.call} failed: {cond}", Action.NONE,
                   {"call": cond.call})
