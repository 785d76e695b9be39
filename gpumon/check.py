"""The Check protocol: what a check is, and what it is handed when it runs.

A check knows nothing of exporters, cordons or other checks. It touches the
machine only through ``ctx.hw`` and returns at least one finding for every
component it examined (``ok`` included).
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported, ToolMissing
from gpumon.hw.kernellog import KernelLog as KernelLog  # what a check is handed: part of the protocol
from gpumon.model import Action, Finding, Phase, ReadingSpec, Severity, gpu

if TYPE_CHECKING:
    from gpumon.bootstate import BootState
    from gpumon.checkstate import CheckState
    from gpumon.hw import Hardware
    from gpumon.hw.inventory import Inventory
    from gpumon.intake_protocol import IntakeReply, Peer
    from gpumon.profiles import Profile
    from gpumon.sdc.runner import Report as CanaryReport


class KernelLogFold(ABC):
    """A check's own summary of its kernel-log lines, kept up to date by the daemon's kernel-log
    pump as records arrive (``KernelLogNeeds.fold``), so that a storm of lines the check only
    counts costs a dictionary update per line, not a run of the check per batch.

    The pump calls ``add_many`` with each read's records of the current boot not yet seen by the
    check (in order, on its own thread) and ``take`` when the check runs; the check gets what
    ``take`` returned in ``KernelLog.folded``. Both are called under the pump's lock, never at
    once. A fold defines ``add`` and ``take``; ``add_many`` is ``add`` for each record unless the
    fold does better (one that skips most lines need not have each dated first)."""

    @abstractmethod
    def add(self, record: Any, when: float) -> Iterable[Hashable]:
        """Fold one record (logged at ``when``, epoch seconds); return the keys of what in it
        should run the check at once (e.g. an uncorrectable error on a device): none for a
        record the check only counts, which waits for its regular run."""
        raise NotImplementedError

    def add_many(self, records: Iterable[Any], time_of: Callable[[Any], float]) -> Sequence[Hashable]:
        """``add`` for each of one read's records, ``time_of(record)`` its ``when``; the keys."""
        keys: list[Hashable] = []
        for record in records:
            keys.extend(self.add(record, time_of(record)))
        return keys

    @abstractmethod
    def take(self) -> Any:
        """What was folded since the last take (None: nothing), and start afresh."""
        raise NotImplementedError


@dataclass(frozen=True)
class KernelLogNeeds:
    """What a check reads of the kernel log (``Check.kernel_log``). In the daemon that is all the
    pump keeps for it between its runs, and what arrives of it runs the check at once (at most
    every 0.5 s unless it is new: gpumon.kernel_pump). Outside the daemon (``gpumon check``, the
    bootstrap suite, a saved log) the check is handed every event and record of the log."""

    # the NVRM event types (gpumon.hw.nvrm) it reads in KernelLog.events. None: every event and
    # every raw record (gpumon.hw.kmsg_record.KernelRecord, in KernelLog.records), any of which runs it
    events: tuple[type, ...] | None = None
    # makes the fold of the records that the pump keeps for it, handed over in KernelLog.folded
    # (a new one for each pump: a daemon start, a restart of the pump's reader)
    fold: Callable[[], KernelLogFold] | None = None
    # it counts XidEvent.repeats (and dates the last of them by XidEvent.last_record), so the
    # pump may hand it the same Xid line logged many times within a second as one event (a storm
    # of one line costs the check one event, not thousands)
    repeats: bool = False


P = TypeVar("P")
B = TypeVar("B", bound="BootState")
G = TypeVar("G")
R = TypeVar("R")

# Evidence of a finding that says its GPU is lost (fallen off the bus, NVML answers GPU_IS_LOST):
# ``gpu_lost: true``. Every check that reads the GPU through NVML says so once the GPU is gone
# (``Check.unreadable_gpus``, ``condition_finding``), besides the checks that name the loss itself
# (gpu_presence, xid's Xid 79): one event, which the daemon logs once, at WARNING, for the first
# finding that says it; the other checks' findings of the same loss are logged at INFO. All of
# them are still findings, in the health state and on /metrics.
GPU_LOST = "gpu_lost"

# Evidence of a finding that is a measurement to repeat before it fails (bandwidth varies run to
# run): ``retryable: true``, and ``retry_id`` to tell apart several on one component. The
# bootstrap suite runs the check once more for those below threshold (gpumon/bootstrap.py).
RETRYABLE = "retryable"
RETRY_ID = "retry_id"
# Evidence of a ``skipped`` finding that says the measurement the check exists for did not happen
# (p2p's copies without torch), though other findings of the run are ok: a check the bootstrap
# suite requires then counts as not run (gpumon/bootstrap.py, required checks). A run whose every
# finding is skipped needs no marker.
NOT_TESTED = "not_tested"


@dataclass(frozen=True)
class RetryRequest:
    """The bootstrap suite's second run of a check whose retryable findings were below threshold:
    a check may re-measure only these (``ctx.retry``), and the retry's verdict replaces the
    first's for exactly them."""

    attempt: int
    components: tuple[str, ...]
    # (component, retry_id) of each finding to measure again ("" when it had no retry_id)
    retry_ids: frozenset[tuple[str, str]]


@dataclass
class CheckContext:
    hw: Hardware
    inventory: Inventory
    profile: Profile
    # the check's options: an instance of its ``Config`` dataclass (None when it has none); read
    # it typed with ``options_as``
    options: object
    # The check's saved state, the store's entry for it (gpumon.checkstate.CheckState): a check
    # that declares a ``State`` reads it typed with ``state_as``; a check without one keeps
    # JSON-friendly data in the mapping itself.
    state: CheckState
    kernel_log: KernelLog
    clock: Callable[[], float] = time.time
    node: str = "localhost"
    # the agent's state directory (a simulated node's own one); None: not known to this caller
    state_dir: Path | None = None
    # set on the bootstrap suite's retry of this check; None on every other run
    retry: RetryRequest | None = None

    def options_as(self, config: type[P]) -> P:
        """The check's options as its ``Config`` dataclass (its defaults when none were handed in,
        as a test's context may do); a ``TypeError`` names a context built for another check."""
        if self.options is None:
            return config()
        if not isinstance(self.options, config):
            raise TypeError(f"check options are {type(self.options).__name__}, not {config.__name__}")
        return self.options

    # Site checks written against gpumon 0.1 read ``ctx.params`` / ``ctx.params_as``: both still
    # answer, as the same options.
    @property
    def params(self) -> object:
        return self.options

    def params_as(self, config: type[P]) -> P:
        return self.options_as(config)

    def state_as(self, cls: type[B]) -> B:
        """The check's saved state as its ``State`` dataclass: loaded from the saved JSON and
        checked the first time (state of another shape is logged, its file copied aside, and a
        fresh ``cls()`` used), kept from run to run, reset at a reboot, saved by the framework.
        A plain mapping handed in instead of a ``CheckState`` (a context built by hand) is read,
        and nothing is carried back into it."""
        from gpumon.checkstate import CheckState  # at run time: checkstate builds on gpumon.bootstate

        state = self.state
        if not isinstance(state, CheckState):
            state = self.state = CheckState(state)
        return state.load(cls, self.hw.fs.boot_id())

    def save_state_now(self) -> bool:
        """Write the check's state to disk now (atomically, fsync'd), for a change a crash must not
        lose (an IB port went down); False when it is not persisted (a one-shot ``gpumon check``, a
        context built by hand) or the write failed."""
        return self.state.save_now()


def each_gpu(ctx: CheckContext, gpus: Sequence[G], read: Callable[[G], R],
             catch: tuple[type[HwCondition], ...] = (GpuLost, HwTimeout)) -> list[tuple[G, R | HwCondition]]:
    """``read(g)`` for every GPU at once, one thread per GPU: ``(g, value or the condition it raised)``
    in the order given. A check that reads its GPUs one after the other waits out the call bound
    once per GPU when a call hangs on every GPU (a driver-wide hang, the common real case): 8 GPUs
    x 5 s passes the check's own timeout and no GPU is named. Read at once, every GPU's hung call
    is named within one bound. Conditions in ``catch`` are the GPU's result; anything else raised
    is re-raised here (the first in GPU order). The runner's "hung in" names a call the helper
    threads wait on (``BoundedCaller.on_behalf_of``)."""
    items = list(gpus)
    if len(items) <= 1:
        out: list[tuple[G, R | HwCondition]] = []
        for g in items:
            try:
                out.append((g, read(g)))
            except catch as cond:
                out.append((g, cond))
        return out
    parent = threading.get_ident()
    caller = getattr(getattr(ctx, "hw", None), "caller", None)
    results: list[tuple[bool, Any]] = [(False, None)] * len(items)

    def one(i: int) -> None:
        scope = caller.on_behalf_of(parent) if caller is not None else contextlib.nullcontext()
        with scope:
            try:
                results[i] = (True, read(items[i]))
            except catch as cond:
                results[i] = (True, cond)
            except BaseException as exc:  # re-raised on the check's thread
                results[i] = (False, exc)

    threads = [threading.Thread(target=one, args=(i,), name=f"gpumon-gpu-read-{i}", daemon=True)
               for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for done, value in results:
        if not done:
            raise value
    return [(g, value) for g, (_, value) in zip(items, results, strict=True)]


class Check:
    """Base class for checks. Subclasses set the class attributes and ``run``.

    ``name`` is one string everywhere: entry point, CLI argument, config
    section, JSON ``check`` and metric label.
    """

    name: ClassVar[str] = ""
    phase: ClassVar[Phase] = Phase.CONTINUOUS
    description: ClassVar[str] = ""
    # What each reading the check publishes (``gpumon.model.reading``) means, in which unit, from
    # where: the HELP and TYPE of its family on /metrics (gpumon.export.readings)
    readings: ClassVar[tuple[ReadingSpec, ...]] = ()
    # seconds between runs of a continuous check (the daemon's schedule); other phases ignore it
    interval: ClassVar[float] = 60.0
    timeout: ClassVar[float] = 30.0
    # seconds a healthy run takes (bootstrap: order, cheap first, and progress ETA); None: its
    # time budget
    cost: ClassVar[float | None] = None
    # A dataclass of the check's own options (its YAML section), or None.
    Config: ClassVar[type[Any] | None] = None
    # The dataclass of the check's saved state (a gpumon.bootstate.BootState: read with
    # ctx.state_as), or None: the framework loads, checks, saves and resets it at a reboot.
    State: ClassVar[type[BootState] | None] = None
    # What it reads of the kernel log (KernelLogNeeds); None: it reads none, and is handed an
    # unavailable KernelLog.
    kernel_log: ClassVar[KernelLogNeeds | None] = None

    def kernel_log_fold(self) -> KernelLogFold | None:
        """A new fold of this check's kernel-log records (``KernelLogNeeds.fold``), None without one."""
        needs = self.kernel_log
        return needs.fold() if needs is not None and needs.fold is not None else None

    def supported(self, inventory: Inventory) -> str | None:
        """None if the check applies to this node, else the reason it does not."""
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise NotImplementedError

    def after_suite(self, ctx: CheckContext) -> list[Finding]:
        """A bootstrap check's second look once the whole suite has run (e.g. counters from before
        the first load to after the last): the suite calls it, with the same state as its run,
        under the same deadline, and adds what it finds to that run's findings. A check that does
        not define it has no after-suite step (``has_after_suite``)."""
        return []

    @classmethod
    def has_after_suite(cls) -> bool:
        return cls.after_suite is not Check.after_suite

    def canary_verdict(self, report: CanaryReport) -> list[Finding]:
        """A canary check's findings on a canary run (``gpumon.sdc.runner.Report``): what its own
        run returns and what ``gpumon canary`` judges a run by, so that both judge alike. A check
        that does not define it judges no canary run (``judges_canaries``)."""
        raise NotImplementedError(f"{self.name} does not judge canary runs")

    @classmethod
    def judges_canaries(cls) -> bool:
        return cls.canary_verdict is not Check.canary_verdict

    def intake(self, document: dict[str, Any], peer: Peer, ctx: CheckContext) -> IntakeReply:
        """A document a local process handed to the daemon for this check over its intake socket
        (``gpumon.intake``): ``peer`` is the sender as the kernel names it (pid, uid, gid), ``ctx`` the
        check's context as in a run (hardware, inventory, options, state directory), but with a state
        of its own, not the runs' (they may be changing theirs at the same moment, on their own
        thread) and no kernel log. Called on the connection's thread, possibly for several
        documents at once; what it keeps, it keeps on disk for its runs to read. The reply says
        whether the check has the document (the sender keeps no other copy then) and whether the
        sender's claim could be confirmed. A check that does not define it takes no documents
        (``accepts_documents``)."""
        raise NotImplementedError(f"{self.name} takes no documents")

    @classmethod
    def accepts_documents(cls) -> bool:
        return cls.intake is not Check.intake

    # Helpers so that every check words common outcomes the same way.

    def finding(self, component: str, severity: Severity, message: str,
                action: Action = Action.NONE, **evidence: Any) -> Finding:
        return Finding(check=self.name, component=component, severity=severity,
                       message=message, action=action, evidence=evidence)

    def ok(self, component: str, message: str, **evidence: Any) -> Finding:
        return self.finding(component, Severity.OK, message, **evidence)

    def from_condition(self, cond: HwCondition, component: str | None = None) -> Finding:
        return condition_finding(self.name, cond, component)

    def unreadable_gpus(self, inventory: Inventory) -> list[Finding]:
        """A finding for each GPU NVML counts but could not describe (``Inventory.unreadable_gpus``),
        from every check that reads GPUs through NVML: a lost GPU needs a reboot, another a reset."""
        return [self.finding(gpu(index), Severity.FAIL,
                             f"GPU lost: {why}" if why.lost else f"GPU unreadable: {why}",
                             Action.REBOOT_NODE if why.lost else Action.RESET_GPU, nvml=why.reason,
                             **({GPU_LOST: True} if why.lost else {}))
                for index, why in sorted(inventory.unreadable_gpus.items())]


def condition_finding(check: str, cond: HwCondition, component: str | None = None) -> Finding:
    """The one place where a hardware condition becomes a finding."""
    comp = component or cond.component
    if isinstance(cond, GpuLost):
        return Finding(check, comp, Severity.FAIL, f"GPU lost ({cond.call}): {cond}",
                       Action.REBOOT_NODE, {"call": cond.call, GPU_LOST: True})
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
