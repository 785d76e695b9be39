"""Runs checks concurrently, each within its own deadline.

A check that hangs is reported as ``fail`` ("hung after N s in <call>")
within its timeout (+ scheduling slack) while the others finish; its thread
is abandoned (Python cannot kill it) and the check is not started again
until it returns. An exception in a check becomes an ``unknown`` finding;
nothing a check does can crash the runner.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import Check, CheckContext, KernelLog, condition_finding
from gpumon.config import Config
from gpumon.errors import HwCondition
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Action, Finding, Severity
from gpumon.profiles import Profile


@dataclass
class CheckRun:
    check: str
    findings: list[Finding]
    started: float
    seconds: float
    outcome: str  # "completed" | "hung" | "error" | "skipped" | "still-hung"


@dataclass
class _Slot:
    check: Check
    thread: threading.Thread | None = None
    result: list[Finding] | None = None
    error: BaseException | None = None
    tb: str = ""
    started: float = 0.0
    finished: threading.Event = field(default_factory=threading.Event)


class Runner:
    def __init__(self, hw: Hardware, inventory: Inventory, profile: Profile, config: Config,
                 *, node: str, clock: Callable[[], float] = time.time,
                 state: Callable[[str], MutableMapping[str, Any]] | None = None,
                 state_dir: Path | None = None) -> None:
        self.hw = hw
        self.state_dir = state_dir
        self.inventory = inventory
        self.profile = profile
        self.config = config
        self.node = node
        self.clock = clock
        self._states: dict[str, MutableMapping[str, Any]] = {}
        self._state_factory = state or (lambda name: self._states.setdefault(name, {}))
        self._inflight: dict[str, _Slot] = {}
        self.extras: dict[str, Any] = {}

    def _context(self, check: Check, kernel_log: KernelLog) -> CheckContext:
        settings = self.config.settings(type(check))
        return CheckContext(hw=self.hw, inventory=self.inventory, profile=self.profile,
                            params=settings.params, state=self._state_factory(check.name),
                            kernel_log=kernel_log, clock=self.clock, node=self.node,
                            extras=self.extras, state_dir=self.state_dir)

    def run(self, checks: Sequence[Check], kernel_log: KernelLog | None = None,
            on_done: Callable[[CheckRun], None] | None = None) -> list[CheckRun]:
        kernel_log = kernel_log or KernelLog(available=False, error="kernel log not read in this run")
        runs: list[CheckRun] = []
        slots: list[tuple[_Slot, float]] = []
        for check in checks:
            early = self._precheck(check)
            if early is not None:
                runs.append(early)
                if on_done:
                    on_done(early)
                continue
            slot = _Slot(check)
            ctx = self._context(check, kernel_log)
            slot.thread = threading.Thread(target=self._body, args=(slot, ctx),
                                           name=f"gpumon-check-{check.name}", daemon=True)
            slot.started = time.monotonic()
            self._inflight[check.name] = slot
            slot.thread.start()
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

    def _precheck(self, check: Check) -> CheckRun | None:
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
            reason = check.supported(self.inventory)
        except Exception as exc:
            reason = None
            f = Finding(check.name, NODE, Severity.UNKNOWN,
                        f"capability gate raised {type(exc).__name__}: {exc}", Action.NONE, {})
            return CheckRun(check.name, [f], now, 0.0, "error")
        if reason is not None:
            f = Finding(check.name, NODE, Severity.SKIPPED, reason, Action.NONE, {})
            return CheckRun(check.name, [f], now, 0.0, "skipped")
        return None

    def _body(self, slot: _Slot, ctx: CheckContext) -> None:
        try:
            slot.result = list(slot.check.run(ctx))
        except BaseException as exc:
            slot.error = exc
            slot.tb = traceback.format_exc(limit=6)
        finally:
            slot.finished.set()

    def _where(self, slot: _Slot) -> str:
        ident = slot.thread.ident if slot.thread is not None else None
        call = self.hw.current_call(ident) if ident is not None else None
        return call or "check code (no hardware call in progress)"

    def _collect(self, slot: _Slot) -> CheckRun:
        check = slot.check
        elapsed = time.monotonic() - slot.started
        started = self.clock() - elapsed
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
            f = Finding(check.name, NODE, Severity.UNKNOWN,
                        f"check raised {type(exc).__name__}: {exc}", Action.NONE,
                        {"traceback": slot.tb[-2000:]})
            return CheckRun(check.name, [f], started, elapsed, "error")
        findings = slot.result or []
        bad = [f for f in findings if not isinstance(f, Finding)]
        if bad or not findings:
            why = "returned no findings" if not findings else f"returned {type(bad[0]).__name__}"
            f = Finding(check.name, NODE, Severity.UNKNOWN, f"check {why}", Action.NONE, {})
            return CheckRun(check.name, [f], started, elapsed, "error")
        return CheckRun(check.name, findings, started, elapsed, "completed")
