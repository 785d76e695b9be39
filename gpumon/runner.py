"""Runs checks concurrently, each within its own deadline.

A check that hangs is reported as ``fail`` ("hung after N s in <call>")
within its timeout (+ scheduling slack) while the others finish; its thread
is abandoned (Python cannot kill it) and the check is not started again
until it returns. An exception in a check becomes an ``unknown`` finding;
nothing a check does can crash the runner.

A check runs on a thread of its own that is kept for its next run while it
runs often (see :class:`CheckThread`), so that a check sampling every second does
not start a thread every second.

A check's saved state comes from the store (``states``): a check that declares a ``State`` has it
loaded (checked, reset at a reboot) before its run, and read typed with ``ctx.state_as``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import Check, CheckContext, KernelLog, RetryRequest, condition_finding
from gpumon.checkstate import CheckState, CheckStateStore
from gpumon.config import Config
from gpumon.errors import HwCondition
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.hw.kernellog import KernelLogFeed
from gpumon.model import NODE, Action, CheckRun, Finding, Severity
from gpumon.profiles import Profile

# A check's thread with nothing to do for this long ends: a check run every second (ib) or
# every 10 s keeps its thread; one run hourly gets a new one each time.
WORKER_IDLE_S = 15.0


class CheckThread:
    """A thread that runs one job at a time and waits for the next, instead of a new thread
    per job: starting and ending a thread costs ~0.1 ms of CPU (2-core VM), and the daemon
    started two for every run of the 1 s ``ib`` check. ``submit`` hands a job over only when
    the thread is idle; a job stuck in it keeps it busy (and is never waited for), and a job
    that raises ends the thread as it would have ended a thread of its own."""

    def __init__(self, name: str, idle_s: float = WORKER_IDLE_S) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle_s = idle_s
        self.busy = False
        self.alive = True
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._started = False

    def submit(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on this thread; False when it is busy or has ended (nothing is queued)."""
        with self._lock:
            if self.busy or not self.alive:
                return False
            self.busy = True
            self.idle.clear()
            self._jobs.put(job)
            start, self._started = not self._started, True
        if start:
            try:
                self.thread.start()
            except BaseException:
                with self._lock:
                    self.busy, self.alive = False, False
                    self.idle.set()
                raise
        return True

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self.busy:  # submitted just now: its job is in the queue
                        continue
                    self.alive = False
                    return
            ok = False
            try:
                job()
                ok = True
            finally:
                with self._lock:
                    self.busy = False
                    self.alive = ok
                    self.idle.set()  # under the lock: a job submitted next must find it clear


@dataclass
class _Slot:
    check: Check
    after_suite: bool = False  # run its after_suite step, not its run
    thread: threading.Thread | None = None
    result: list[Finding] | None = None
    error: BaseException | None = None
    tb: str = ""
    started: float = 0.0
    ended: float = 0.0  # monotonic time the check returned (0: still running)
    finished: threading.Event = field(default_factory=threading.Event)


class Runner:
    def __init__(self, hw: Hardware, inventory: Inventory, profile: Profile, config: Config,
                 *, node: str, clock: Callable[[], float] = time.time,
                 states: CheckStateStore | None = None,
                 state_dir: Path | None = None) -> None:
        self.hw = hw
        self.state_dir = state_dir
        self.inventory = inventory
        self.profile = profile
        self.config = config
        self.node = node
        self.clock = clock
        # a one-shot command keeps its checks' state in memory only (CheckStateStore(None))
        self.states = states if states is not None else CheckStateStore(None)
        self._inflight: dict[str, _Slot] = {}
        self._threads: dict[str, CheckThread] = {}

    def _context(self, check: Check, kernel_log: KernelLog, retry: RetryRequest | None) -> CheckContext:
        settings = self.config.settings(type(check))
        state = self.states.get(check.name)
        if check.State is not None:
            # loaded here, not at the check's first state_as: a refused state is said, and a
            # reboot resets the state, whatever the run does
            state.load(check.State, self.hw.fs.boot_id())
        return CheckContext(hw=self.hw, inventory=self.inventory, profile=self.profile,
                            options=settings.options, state=state,
                            kernel_log=kernel_log, clock=self.clock, node=self.node,
                            state_dir=self.state_dir, retry=retry)

    def intake_context(self, check: Check) -> CheckContext:
        """What ``check.intake`` is handed (the daemon's intake, gpumon.intake): a run's context, with a
        state of its own (the check's runs own theirs, on another thread) and no kernel log."""
        return CheckContext(hw=self.hw, inventory=self.inventory, profile=self.profile,
                            options=self.config.settings(type(check)).options,
                            state=CheckState(name=check.name),
                            kernel_log=KernelLog(available=False, error="not read for a document"),
                            clock=self.clock, node=self.node, state_dir=self.state_dir)

    def run(self, checks: Sequence[Check], kernel_log: KernelLogFeed | None = None,
            on_done: Callable[[CheckRun], None] | None = None, *,
            retry: RetryRequest | None = None, gate: bool = True,
            after_suite: bool = False) -> list[CheckRun]:
        """Run ``checks`` at once, each within its deadline. ``kernel_log``: where each check that
        declares ``kernel_log`` gets its log (asked before its gate, so that a check not run
        this time still takes what the daemon's pump kept for it, as its run would); None: not
        read in this run. ``retry``: the bootstrap suite's
        second run of a check (handed to each as ``ctx.retry``). ``gate=False``: no capability
        gate (``supported``): a saved kernel log judged on another machine is about the log's
        node, not about this one's GPUs. ``after_suite``: each check's ``after_suite`` step instead
        of its ``run`` (the bootstrap suite's look once every check has run)."""
        runs: list[CheckRun] = []
        slots: list[tuple[_Slot, float]] = []
        for check in checks:
            log = (kernel_log.for_check(check) if kernel_log is not None and check.kernel_log is not None
                   else KernelLog(available=False, error="kernel log not read in this run"))
            early = self._precheck(check, gate)
            if early is not None:
                runs.append(early)
                if on_done:
                    on_done(early)
                continue
            slot = _Slot(check, after_suite=after_suite)
            ctx = self._context(check, log, retry)
            slot.started = time.monotonic()
            self._inflight[check.name] = slot
            self._start(slot, ctx)
            slots.append((slot, slot.started + self.config.settings(type(check)).timeout_s))
        # Judge each check at its own deadline, earliest first: a check stuck
        # behind a slower one must still be reported hung at its own timeout.
        done: dict[int, CheckRun] = {}
        for i, (slot, deadline) in sorted(enumerate(slots), key=lambda item: item[1][1]):
            slot.finished.wait(max(0.0, deadline - time.monotonic()))
            run = self._collect(slot)
            done[i] = run
            if on_done:
                on_done(run)
        runs.extend(done[i] for i in range(len(slots)))
        return runs

    def _precheck(self, check: Check, gate: bool = True) -> CheckRun | None:
        now = self.clock()
        stuck = self._inflight.get(check.name)
        if stuck is not None and not stuck.finished.is_set():
            held = time.monotonic() - stuck.started
            where = self._where(stuck)
            f = Finding(check.name, NODE, Severity.FAIL,
                        f"still hung after {held:.0f} s in {where}; not started again", Action.NONE,
                        {"hung_in": where, "hung_s": round(held, 1)})
            return CheckRun(check.name, [f], now, 0.0, "still-hung")
        try:
            reason = check.supported(self.inventory) if gate else None
        except Exception as exc:
            reason = None
            f = Finding(check.name, NODE, Severity.UNKNOWN,
                        f"capability gate raised {type(exc).__name__}: {exc}", Action.NONE, {})
            return CheckRun(check.name, [f], now, 0.0, "error")
        if reason is not None:
            f = Finding(check.name, NODE, Severity.SKIPPED, reason, Action.NONE, {})
            return CheckRun(check.name, [f], now, 0.0, "skipped")
        return None

    def _start(self, slot: _Slot, ctx: CheckContext) -> None:
        """Run the check on its kept thread when that one is idle, else on a new thread of
        its own (the kept one still busy: a run that has returned, its thread not yet back
        for the next job)."""
        name = slot.check.name

        def job() -> None:
            self._body(slot, ctx)

        kept = self._threads.get(name)
        if kept is None or not kept.alive:
            kept = self._threads[name] = CheckThread(f"gpumon-check-{name}")
        slot.thread = kept.thread
        if kept.submit(job):
            return
        slot.thread = threading.Thread(target=job, name=f"gpumon-check-{name}", daemon=True)
        slot.thread.start()

    def _body(self, slot: _Slot, ctx: CheckContext) -> None:
        try:
            check = slot.check
            slot.result = list(check.after_suite(ctx) if slot.after_suite else check.run(ctx))
        except BaseException as exc:
            slot.error = exc
            slot.tb = traceback.format_exc(limit=6)
        finally:
            slot.ended = time.monotonic()
            slot.finished.set()

    def _where(self, slot: _Slot) -> str:
        ident = slot.thread.ident if slot.thread is not None else None
        call = self.hw.current_call(ident) if ident is not None else None
        return call or "check code (no hardware call in progress)"

    def _collect(self, slot: _Slot) -> CheckRun:
        check = slot.check
        now = time.monotonic()
        started = self.clock() - (now - slot.started)
        # the check's own run time: it is judged at the earliest deadline, maybe long after it ended
        elapsed = (slot.ended if slot.finished.is_set() else now) - slot.started
        if not slot.finished.is_set():
            timeout = self.config.settings(type(check)).timeout_s
            where = self._where(slot)
            f = Finding(check.name, NODE, Severity.FAIL, f"hung after {timeout:g} s in {where}",
                        Action.NONE, {"hung_in": where, "timeout_s": timeout})
            return CheckRun(check.name, [f], started, elapsed, "hung")
        self._inflight.pop(check.name, None)
        if slot.error is not None:
            exc = slot.error
            if isinstance(exc, HwCondition):
                return CheckRun(check.name, [condition_finding(check.name, exc)], started, elapsed,
                                "error")
            message = f"check raised {type(exc).__name__}: {exc}"
            evidence: dict[str, Any] = {"traceback": slot.tb[-2000:]}
            moved = self.states.set_aside(check.name, message)
            if moved is not None:
                message += f"; its saved state ({moved.name}) was set aside and the next run starts afresh"
                evidence["state_set_aside"] = str(moved)
            f = Finding(check.name, NODE, Severity.UNKNOWN, message, Action.NONE, evidence)
            return CheckRun(check.name, [f], started, elapsed, "error")
        findings = slot.result or []
        bad = [f for f in findings if not isinstance(f, Finding)]
        if bad or not findings:
            why = "returned no findings" if not findings else f"returned {type(bad[0]).__name__}"
            f = Finding(check.name, NODE, Severity.UNKNOWN, f"check {why}", Action.NONE, {})
            return CheckRun(check.name, [f], started, elapsed, "error")
        self.states.proven(check.name)
        return CheckRun(check.name, findings, started, elapsed, "completed")
