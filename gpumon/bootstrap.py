"""The bootstrap suite (``gpumon run-bootstrap``): every bootstrap check, one at a time, cheap first.

A node runs the suite when it is provisioned and between workloads, and the next workload starts on
a node that just passed it, so the suite is thorough but bounded, and says where its time went.

- **Order**: cheap to expensive, by the check's ``cost`` class attribute (seconds a healthy run
  takes, also the progress bar's ETA) or, without one, its time budget (``timeout``); name breaks
  ties. A cheap check that fails then costs seconds, not the minutes of a burn-in that comes after it.
- **One at a time**, each through the framework's :class:`~gpumon.runner.Runner` (its deadline,
  hung and error handling): a GEMM burn-in and an NCCL all-reduce at once would measure each other.
- **Time budget** per check: the runner's deadline, i.e. ``checks.<name>.timeout_s`` (default: the
  check's ``timeout``). A check past it is a ``fail`` "hung after N s in <call>" and the suite goes on.
- **Retryable measurements**: a performance measurement varies run to run (NCCL bandwidth variance
  is one of the field lessons in DESIGN.md), so a check marks such a finding as retryable (evidence
  ``retryable: true``; optionally ``retry_id`` to tell several on one component apart). One below its
  threshold (``warn`` or ``fail``) is measured again, unless the check already did so itself
  (evidence ``attempts`` >= 2): the check runs once more with ``ctx.retry`` (a
  :class:`~gpumon.check.RetryRequest`: attempt, components, (component, retry_id) pairs) so that it
  may re-measure only those, and the retry's verdict replaces the first for exactly those. A
  retryable finding fails only if it stays below threshold on the retry; any other fault (a wrong
  all-reduce element, a remap pending) is never retried away, and a new fault the retry shows is
  kept.
- ``--fail-fast``: stop after the first check with a ``fail``; the checks not run are reported as
  ``skipped`` "not run" (outcome ``not-run``), never as ok.
- **Before/after the whole suite**: a check may define ``after_suite(ctx) -> list[Finding]``
  (``Check.after_suite``; ``Check.has_after_suite``); the suite calls it through the runner (its
  deadline, its error handling, the same check state) once every check has run, and adds its
  findings to that check's. ``pcie_topology`` uses it to compare PCIe AER counters from before the
  first load to after the last. Why a hook rather than a snapshot taken by this runner: the framework knows no
  individual check or reading (DESIGN.md), and any check can use the hook (Xid counts, ECC counts);
  and rather than "run that check last": it would then have no reading from before the load.
- **Report**: the JSON document of the contract (``report.json_report``, every finding, plus a
  ``bootstrap`` section: order, attempts, budgets, passed) written atomically to
  ``<state_dir>/bootstrap-<UTC time>.json`` and ``bootstrap-latest.json``; the newest
  ``keep_reports`` are kept. A report that cannot be written is logged and named in the result; it
  does not change the verdict.
- **Required checks**: the profile's ``bootstrap.required``, plus the site's ``bootstrap.required``,
  minus its ``bootstrap.optional`` (and what the machine cannot host by its nature). A required
  check that could not run here (every finding ``skipped``: torch missing, a tool not installed; not
  installed at all; disabled in the config) becomes ``unknown`` "required by ..., could not run:
  <reason>; <fix>", and the suite is INCOMPLETE: status ``error``, exit 3, not passed, so the unit
  that gates kubelet and slurmd keeps the node out and no fault is cleared. A failure found beside
  it still wins (NOT PASSED, exit 2). A required check left out on purpose (``--only``/``--skip``)
  makes the run *partial*: exit code by its findings, but no retest credit.
- **Exit code** (NHC): 0 ok, 1 warnings only (``unknown`` included), 2 a failure, 3 interrupted or
  incomplete.
- **Health hook**: :attr:`SuiteResult.passed` (no ``fail``, no ``unknown``, not interrupted, not
  incomplete, not partial) and
  :func:`record_health`, which folds every run into the health state and, when the suite passed,
  records ``retest_passed(by="bootstrap")``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpumon.atomic import write_atomic
from gpumon.check import NOT_TESTED, RETRY_ID, RETRYABLE, Check, RetryRequest
from gpumon.errors import ConfigError
from gpumon.model import (
    NODE,
    CheckRun,
    Finding,
    Phase,
    Severity,
    Status,
    overall_status,
    worst_action,
    worst_severity,
)
from gpumon.report import console_for, json_report, print_table

if TYPE_CHECKING:
    from gpumon.agent import Agent

log = logging.getLogger("gpumon.bootstrap")

# how many times the check itself measured it (its own retry); the suite's count is SUITE_ATTEMPTS
ATTEMPTS = "attempts"
SUITE_ATTEMPTS = "suite_attempts"
NOT_RUN = "not-run"
NOT_INSTALLED = "not-installed"
REPORT_PREFIX = "bootstrap-"
LATEST = "bootstrap-latest.json"
_TICK_S = 0.1


def is_retryable(finding: Finding) -> bool:
    return bool(finding.evidence.get(RETRYABLE))


def measured_again(finding: Finding) -> bool:
    """The check already measured it a second time itself (evidence ``attempts`` >= 2)."""
    n = finding.evidence.get(ATTEMPTS)
    return isinstance(n, int) and not isinstance(n, bool) and n >= 2


def retry_key(finding: Finding) -> tuple[str, str]:
    return finding.component, str(finding.evidence.get(RETRY_ID, ""))


def failing_retryable(findings: Sequence[Finding]) -> list[Finding]:
    """Retryable findings below threshold that the suite should measure again: not those the check
    itself already measured twice (the compute checks retry inside one run: a third run of a burn-in
    would cost minutes for nothing)."""
    return [f for f in findings if is_retryable(f) and f.severity in (Severity.WARN, Severity.FAIL)
            and not measured_again(f)]


def expected_seconds(check: Check | type[Check], budget_s: float) -> float:
    """What a healthy run takes: the check's ``cost`` class attribute, else its budget."""
    cost = check.cost
    if cost is not None and cost > 0:
        return float(cost)
    return budget_s


def order(checks: Sequence[Check], budget: Callable[[Check], float]) -> list[Check]:
    """Cheap first (``cost``, else the budget), then by name."""
    return sorted(checks, key=lambda c: (expected_seconds(c, budget(c)), c.name))


def select(agent: Agent, only: Sequence[str] = (), skip: Sequence[str] = ()) -> list[Check]:
    """The suite's checks: ``only`` these (any phase, enabled or not: asked for by name), else every
    enabled bootstrap check; minus ``skip``. An unknown name is a ConfigError (exit 3)."""
    for name in (*only, *skip):
        if name not in agent.checks:
            raise ConfigError(f"unknown check {name!r} (registered: {', '.join(agent.checks)})",
                              key="--only/--skip")
    return [c for c in agent.selected(Phase.BOOTSTRAP, list(only)) if c.name not in set(skip)]


def merge_retry(first: CheckRun, second: CheckRun, attempt: int = 2) -> CheckRun:
    """The verdict after a retry (``attempt``: its number): the retry's reading for every retryable
    finding that was below threshold, the first run's findings for everything else, and any new
    non-ok finding of the retry."""
    failing = {retry_key(f) for f in failing_retryable(first.findings)}
    again = {retry_key(f): f for f in second.findings if is_retryable(f)}
    merged: list[Finding] = []
    for f in first.findings:
        key = retry_key(f)
        if not (is_retryable(f) and key in failing):
            merged.append(f)
            continue
        first_attempt = {"severity": f.severity.value, "message": f.message}
        g = again.get(key)
        if g is None:
            merged.append(dataclasses.replace(f, evidence={**f.evidence, SUITE_ATTEMPTS: attempt,
                                                          "retry": "the retry did not measure it again"}))
            continue
        below = g.severity in (Severity.WARN, Severity.FAIL)
        note = " (again on the retry)" if below else " (passed on the retry)"
        first_attempt = f.evidence.get("first_attempt", first_attempt)  # a third attempt keeps the first
        merged.append(dataclasses.replace(g, message=g.message + note, evidence={
            **g.evidence, SUITE_ATTEMPTS: attempt, "first_attempt": first_attempt}))
    seen = {(f.component, f.message) for f in first.findings}
    for g in second.findings:
        new_fault = g.severity not in (Severity.OK, Severity.SKIPPED) and (g.component, g.message) not in seen
        if new_fault and not is_retryable(g):
            merged.append(g)
    outcome = first.outcome if second.outcome == "completed" else second.outcome
    return CheckRun(first.check, merged, first.started, first.seconds + second.seconds, outcome)


# --------------------------------------------------------------------------- required checks


@dataclass(frozen=True)
class Requirement:
    """A check the suite cannot pass without, who requires it, and (once judged) why it did not run."""

    check: str
    required_by: str
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "required_by": self.required_by, "reason": self.reason}


def required_checks(agent: Agent) -> dict[str, str]:
    """Check name -> who requires it: the profile's, less the site's optional ones, plus the site's
    required ones, less what the machine cannot host by its nature."""
    out = {n: f"profile {agent.profile.name}" for n in agent.profile.bootstrap.required}
    for name in agent.config.bootstrap.optional:
        out.pop(name, None)
    # the site's required wins over its optional (a name in both: the safe reading)
    for name in agent.config.bootstrap.required:
        out[name] = "the site config (bootstrap.required)"
    for name in agent.machine.cannot_host():
        out.pop(name, None)
    return out


_FIX = "install what it needs and run the suite again, or declare it optional (bootstrap.optional)"


def could_not_run(run: CheckRun) -> str | None:
    """Why the check did not test what it is for (every finding ``skipped``, or one marked
    ``not_tested``), else None. A skip of one part (a VM's flattened PCIe tree in pcie_topology)
    is not that: the rest was judged."""
    if run.outcome == NOT_RUN or not run.findings:
        return None
    skips = [f for f in run.findings if f.severity is Severity.SKIPPED]
    untested = [f for f in skips if f.evidence.get(NOT_TESTED)]
    if untested or (skips and len(skips) == len(run.findings)):
        return "; ".join(dict.fromkeys(f.message for f in (untested or skips)))
    return None


def _required_unknown(run: CheckRun, req: Requirement) -> CheckRun:
    f = Finding(run.check, NODE, Severity.UNKNOWN,
                f"required by {req.required_by}, could not run: {req.reason}; {_FIX}",
                evidence={"required_by": req.required_by, "skipped": req.reason})
    return dataclasses.replace(run, findings=[f])


def judge_requirements(result: SuiteResult, agent: Agent) -> None:
    """Mark the result INCOMPLETE (or partial) for each required check that did not run."""
    required = required_checks(agent)
    in_suite = {c.check: c for c in result.checks}
    for name, by in required.items():
        entry = in_suite.get(name)
        if entry is not None:
            reason = could_not_run(entry.run)
            if reason is not None:
                req = Requirement(name, by, reason)
                entry.run = _required_unknown(entry.run, req)
                result.incomplete.append(req)
            continue
        cls = agent.checks.get(name)
        if cls is None and name in agent.not_loaded:
            req = Requirement(name, by, f"it did not load: {agent.not_loaded[name].error}")
        elif cls is None:
            req = Requirement(name, by, f"no check {name!r} is installed (entry point group gpumon.checks)")
        elif not agent.config.settings(cls).enabled:
            req = Requirement(name, by, f"disabled in the config (checks.{name}.enabled: false)")
        else:
            result.left_out.append(Requirement(name, by, "left out by --only/--skip"))
            continue
        run = _required_unknown(CheckRun(name, [], time.time(), 0.0, NOT_INSTALLED), req)
        result.checks.append(SuiteCheck(name, 0.0, 0.0, run, attempts=0))
        result.incomplete.append(req)


# --------------------------------------------------------------------------- results


@dataclass
class SuiteCheck:
    """How one check went in the suite."""

    check: str
    expected_s: float
    budget_s: float
    run: CheckRun
    attempts: int = 1
    retried: list[str] = field(default_factory=list)  # components measured again (retryable findings)
    after_suite: bool = False

    @property
    def severity(self) -> Severity:
        return worst_severity(self.run.findings)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "outcome": self.run.outcome, "severity": self.severity.value,
                "action": worst_action(self.run.findings).value, "seconds": round(self.run.seconds, 3),
                "expected_s": self.expected_s, "budget_s": self.budget_s, "attempts": self.attempts,
                "retried": self.retried, "after_suite": self.after_suite}


@dataclass
class SuiteResult:
    node: str
    profile: str
    checks: list[SuiteCheck]
    started: float
    finished: float
    fail_fast: bool = False
    stopped_after: str | None = None  # --fail-fast: the check whose failure ended the suite
    interrupted: bool = False
    # what the machine says the node is (a simulated node's scenario), said in the report
    node_label: str | None = None
    report_paths: list[Path] = field(default_factory=list)
    report_error: str | None = None
    # required checks that could not run (the suite is INCOMPLETE), and those left out by
    # --only/--skip (the run is partial)
    incomplete: list[Requirement] = field(default_factory=list)
    left_out: list[Requirement] = field(default_factory=list)

    @property
    def runs(self) -> list[CheckRun]:
        return [c.run for c in self.checks]

    @property
    def findings(self) -> list[Finding]:
        return [f for c in self.checks for f in c.run.findings]

    @property
    def status(self) -> Status:
        if self.interrupted:
            return Status.ERROR
        found = overall_status(self.findings)
        # a failure is a verdict whatever else could not run; without one, the node is untested
        return Status.ERROR if self.incomplete and found is not Status.FAIL else found

    @property
    def exit_code(self) -> int:
        return self.status.exit_code

    @property
    def passed(self) -> bool:
        """Whether the node may be admitted: the suite ran to its end (or stopped only on a failure)
        and no check failed or could not say. Warnings pass: they are degraded, not broken."""
        return (not self.interrupted and not self.incomplete and not self.left_out
                and all(f.severity not in (Severity.FAIL, Severity.UNKNOWN) for f in self.findings))

    @property
    def verdict(self) -> str:
        if self.interrupted:
            return "INTERRUPTED"
        if self.status is Status.FAIL:
            return "NOT PASSED"
        if self.incomplete:
            return "INCOMPLETE"
        if any(f.severity is Severity.UNKNOWN for f in self.findings):
            return "NOT PASSED"
        return "PASSED (partial)" if self.left_out else "PASSED"

    @property
    def detail(self) -> str:
        """One line for the health event: what ran and how long it took."""
        counts: dict[str, int] = {}
        for c in self.checks:
            counts[c.severity.value] = counts.get(c.severity.value, 0) + 1
        parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        verdict = "passed" if self.passed else "did not pass"
        missing = (f"; required but could not run: {', '.join(r.check for r in self.incomplete)}"
                   if self.incomplete else "")
        return (f"bootstrap suite {verdict}: {len(self.checks)} checks ({parts}) "
                f"in {self.finished - self.started:.0f} s{missing}")

    def report(self, verbose: bool = False) -> dict[str, Any]:
        extra: dict[str, Any] = {"bootstrap": {
            "passed": self.passed, "started": self.started, "finished": self.finished,
            "seconds": round(self.finished - self.started, 3), "fail_fast": self.fail_fast,
            "stopped_after": self.stopped_after, "interrupted": self.interrupted,
            "verdict": self.verdict,
            "incomplete": [r.to_json() for r in self.incomplete],
            "left_out": [r.to_json() for r in self.left_out],
            "order": [c.check for c in self.checks], "checks": [c.to_json() for c in self.checks]}}
        if self.node_label:
            extra["simulated"] = self.node_label
        doc = json_report(self.runs, node=self.node, profile=self.profile, verbose=verbose, extra=extra)
        doc["status"] = self.status.value  # interrupted or incomplete: "error" (exit 3)
        return doc


@dataclass(frozen=True)
class ProgressEvent:
    kind: Literal["start", "retry", "done", "after_suite"]
    index: int  # 1-based position in the suite
    total: int
    check: str
    expected_s: float
    budget_s: float
    run: CheckRun | None = None


class HealthSink(Protocol):
    """What :func:`record_health` needs of ``gpumon.health.Health``."""

    def record_run(self, run: CheckRun) -> Any: ...

    def retest_passed(self, component: str = NODE, *, check: str = "", by: str = "",
                      detail: str = "") -> Any: ...


def record_health(result: SuiteResult, health: HealthSink) -> bool:
    """Fold the suite into the health state; a passed suite is the node's retest. Returns ``passed``.

    Checks that did not run (``--fail-fast``) are left out: they say nothing about the node.
    """
    for run in result.runs:
        if run.outcome != NOT_RUN:
            health.record_run(run)
    if result.passed:
        health.retest_passed(NODE, by="bootstrap", detail=result.detail)
    return result.passed


# --------------------------------------------------------------------------- progress


class _Display:
    """A rich progress bar per check on a terminal; one plain line per event otherwise."""

    def __init__(self, console: Console | None, checks: Sequence[tuple[Check, float, float]]) -> None:
        self.console = console
        self.total_expected = sum(e for _, e, _ in checks)
        self.done_expected = 0.0
        self.progress: Progress | None = None
        self.suite_task: TaskID | None = None
        self.task: TaskID | None = None
        if console is not None and console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}", justify="left"), BarColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), console=console, transient=False)

    def __enter__(self) -> _Display:
        if self.progress is not None:
            self.progress.start()
            self.suite_task = self.progress.add_task("bootstrap suite", total=max(self.total_expected, 0.001),
                                                     eta=self._eta(self.total_expected))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    @staticmethod
    def _eta(seconds: float) -> str:
        return f"ETA ~{max(0.0, seconds):.0f} s"

    def start(self, index: int, total: int, check: Check, expected: float, budget: float) -> None:
        if self.progress is not None:
            self.task = self.progress.add_task(f"[{index}/{total}] {check.name}", total=max(expected, 0.001),
                                               eta=self._eta(expected))
        elif self.console is not None:
            self.console.print(f"gpumon bootstrap [{index}/{total}] {check.name}: started "
                               f"(expect ~{expected:g} s, budget {budget:g} s)", highlight=False)

    def tick(self, elapsed: float, expected: float) -> None:
        if self.progress is None or self.task is None or self.suite_task is None:
            return
        # a check running past its expected time stays just short of full until it ends
        shown = min(elapsed, expected * 0.99)
        self.progress.update(self.task, completed=shown, eta=self._eta(expected - elapsed))
        remaining = self.total_expected - self.done_expected - shown
        self.progress.update(self.suite_task, completed=self.done_expected + shown, eta=self._eta(remaining))

    def note(self, text: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=text)
        elif self.console is not None:
            self.console.print(f"gpumon bootstrap {text}", highlight=False)

    def done(self, index: int, total: int, outcome: SuiteCheck) -> None:
        self.done_expected += outcome.expected_s
        sev = outcome.severity.value
        extra = f", {outcome.attempts} attempts" if outcome.attempts > 1 else ""
        line = f"[{index}/{total}] {outcome.check}: {sev} in {outcome.run.seconds:.1f} s{extra}"
        if self.progress is not None and self.task is not None and self.suite_task is not None:
            self.progress.update(self.task, completed=outcome.expected_s, total=outcome.expected_s,
                                 description=line, eta="")
            self.progress.update(self.suite_task, completed=self.done_expected,
                                 eta=self._eta(self.total_expected - self.done_expected))
        elif self.console is not None:
            self.console.print(f"gpumon bootstrap {line}", highlight=False)


# --------------------------------------------------------------------------- the suite


def _not_run(check: Check, why: str, now: float) -> CheckRun:
    f = Finding(check.name, NODE, Severity.SKIPPED, f"not run: {why}")
    return CheckRun(check.name, [f], now, 0.0, NOT_RUN)


class _Suite:
    def __init__(self, agent: Agent, console: Console | None,
                 on_progress: Callable[[ProgressEvent], None] | None, retries: int) -> None:
        self.agent = agent
        self.console = console
        self.on_progress = on_progress
        self.retries = retries

    def budget(self, check: Check) -> float:
        return float(self.agent.config.settings(type(check)).timeout_s)

    def emit(self, event: ProgressEvent) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(event)
            except Exception:  # a progress listener must not stop a suite
                log.exception("bootstrap progress callback failed")

    def run_one(self, check: Check, display: _Display, expected: float,
                retry: RetryRequest | None = None) -> CheckRun:
        """One bounded run through the Runner, on a worker thread so that the bar moves meanwhile."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["runs"] = self.agent.runner.run([check], self.agent.kernel_log_snapshot(), retry=retry)
            except BaseException as exc:  # the runner guards checks; this guards the runner
                box["error"] = exc

        start = time.monotonic()
        worker = threading.Thread(target=work, name=f"gpumon-bootstrap-{check.name}", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(_TICK_S)
            display.tick(time.monotonic() - start, expected)
        runs: list[CheckRun] | None = box.get("runs")
        if runs:
            return runs[0]
        exc = box.get("error")
        f = Finding(check.name, NODE, Severity.UNKNOWN, f"the runner raised {type(exc).__name__}: {exc}")
        return CheckRun(check.name, [f], time.time(), time.monotonic() - start, "error")

    def run_with_retries(self, check: Check, display: _Display, index: int, total: int,
                         expected: float, budget: float) -> SuiteCheck:
        run = self.run_one(check, display, expected)
        outcome = SuiteCheck(check.name, expected, budget, run)
        while outcome.attempts <= self.retries:
            below = failing_retryable(outcome.run.findings)
            if not below:
                break
            components = sorted({f.component for f in below})
            display.note(f"[{index}/{total}] {check.name}: {len(below)} probe(s) below threshold, "
                         "measuring again")
            self.emit(ProgressEvent("retry", index, total, check.name, expected, budget, outcome.run))
            retry = RetryRequest(outcome.attempts + 1, tuple(components),
                                 frozenset(retry_key(f) for f in below))
            again = self.run_one(type(check)(), display, expected, retry)
            outcome.run = merge_retry(outcome.run, again, outcome.attempts + 1)
            outcome.attempts += 1
            outcome.retried = sorted(set(outcome.retried) | set(components))
        return outcome

    def after_suite(self, outcome: SuiteCheck, check: Check) -> None:
        """``check``'s after-suite step through the runner, on a new instance as a retry is: its
        deadline, its error handling and the same state (keyed by name) as its run."""
        runs = self.agent.runner.run([type(check)()], after_suite=True)
        extra = runs[0]
        run = outcome.run
        outcome.run = CheckRun(run.check, [*run.findings, *extra.findings], run.started,
                               run.seconds + extra.seconds, run.outcome if extra.outcome == "completed"
                               else extra.outcome)
        outcome.after_suite = True


def run_suite(agent: Agent, checks: Sequence[Check], *, fail_fast: bool = False,
              console: Console | None = None, on_progress: Callable[[ProgressEvent], None] | None = None,
              retries: int = 1,
              write_report: bool = True, keep_reports: int = 100) -> SuiteResult:
    """Run the bootstrap suite on a started agent. ``console``: where progress goes (a bar on a
    terminal, plain lines otherwise; None for none). Never raises for a check; Ctrl-C ends the
    suite as ``interrupted`` (exit code 3) with what was found so far."""
    suite = _Suite(agent, console, on_progress, retries)
    ordered = order(checks, suite.budget)
    plan = [(c, expected_seconds(c, suite.budget(c)), suite.budget(c)) for c in ordered]
    total = len(plan)
    started = time.time()
    result = SuiteResult(agent.node, agent.profile.name, [], started, started, fail_fast=fail_fast,
                         node_label=agent.machine.label())
    ran: list[tuple[SuiteCheck, Check]] = []
    with _Display(console, plan) as display:
        try:
            for index, (check, expected, budget) in enumerate(plan, 1):
                if result.stopped_after is not None:
                    why = f"--fail-fast stopped the suite after {result.stopped_after} failed"
                    run = _not_run(check, why, time.time())
                    result.checks.append(SuiteCheck(check.name, expected, budget, run, attempts=0))
                    continue
                suite.emit(ProgressEvent("start", index, total, check.name, expected, budget))
                display.start(index, total, check, expected, budget)
                outcome = suite.run_with_retries(check, display, index, total, expected, budget)
                result.checks.append(outcome)
                ran.append((outcome, check))
                display.done(index, total, outcome)
                suite.emit(ProgressEvent("done", index, total, check.name, expected, budget, outcome.run))
                if fail_fast and outcome.severity is Severity.FAIL:
                    result.stopped_after = check.name
            for outcome, check in ran:
                if check.has_after_suite() and outcome.run.outcome in ("completed", "error"):
                    index = result.checks.index(outcome) + 1
                    display.note(f"[{index}/{total}] {check.name}: comparing with the start of the suite")
                    suite.after_suite(outcome, check)
                    suite.emit(ProgressEvent("after_suite", index, total, check.name, outcome.expected_s,
                                             outcome.budget_s, outcome.run))
        except KeyboardInterrupt:
            result.interrupted = True
            done = {c.check for c in result.checks}
            for check, expected, budget in plan:
                if check.name not in done:
                    result.checks.append(SuiteCheck(check.name, expected, budget,
                                                    _not_run(check, "the suite was interrupted", time.time()),
                                                    attempts=0))
    if not result.interrupted:
        judge_requirements(result, agent)
    result.finished = time.time()
    if write_report:
        _write_reports(result, agent.state_dir, keep_reports)
    return result


def report_name(started: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started))
    return f"{REPORT_PREFIX}{stamp}.{int(started * 1000) % 1000:03d}Z.json"


def _write_reports(result: SuiteResult, state_dir: Path, keep: int) -> None:
    """The complete report (ok findings included) for the record, as of this run and as the latest."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result.report(verbose=True), indent=2) + "\n"
        dated = state_dir / report_name(result.started)
        write_atomic(dated, text)
        write_atomic(state_dir / LATEST, text)
        result.report_paths = [dated, state_dir / LATEST]
        old = sorted(p for p in state_dir.glob(f"{REPORT_PREFIX}*.json") if p.name != LATEST)
        for stale in old[:max(0, len(old) - keep)]:
            with contextlib.suppress(OSError):
                stale.unlink()
    except OSError as exc:
        result.report_error = f"could not write the bootstrap report to {state_dir}: {exc.strerror or exc}"
        log.error("%s", result.report_error)


# --------------------------------------------------------------------------- human output

_STYLE = {Severity.OK: "green", Severity.SKIPPED: "dim", Severity.UNKNOWN: "yellow", Severity.WARN: "yellow",
          Severity.FAIL: "bold red"}


def print_summary(result: SuiteResult, console: Console) -> None:
    if not console.is_terminal:
        # piped to a file or a pager: one record per line (as report.print_table)
        console = console_for(console.file)
    # the headline on a line of its own: a table title is padded with blanks to the table's width
    console.print(f"bootstrap suite on {result.node} (profile {result.profile}): {result.verdict} "
                  f"in {result.finished - result.started:.1f} s", highlight=False)
    for req in result.incomplete:
        # markup=False: a reason's "pip install 'gpumon-node[compute]'" is not a style tag
        console.print(f"  required, could not run: {req.check} (required by {req.required_by}): {req.reason}",
                      highlight=False, soft_wrap=True, markup=False)
    if result.incomplete:
        console.print(f"  the node is untested: exit 3; {_FIX}", highlight=False, soft_wrap=True,
                      markup=False)
    if result.left_out:
        names = ", ".join(r.check for r in result.left_out)
        console.print(f"  partial run: required checks left out by --only/--skip: {names}; a partial run "
                      "clears no fault", highlight=False, soft_wrap=True, markup=False)
    table = Table()
    for col in ("#", "check", "result", "action", "seconds", "budget", "attempts", "note"):
        table.add_column(col, overflow="fold")
    for i, c in enumerate(result.checks, 1):
        notes = []
        if c.run.outcome not in ("completed",):
            notes.append(c.run.outcome)
        if c.retried:
            notes.append("probes retried: " + ", ".join(c.retried))
        if c.after_suite:
            notes.append("compared after the suite")
        action = worst_action(c.run.findings).value
        table.add_row(str(i), c.check, f"[{_STYLE[c.severity]}]{c.severity.value}[/]",
                      "" if action == "none" else action, f"{c.run.seconds:.1f}", f"{c.budget_s:g}",
                      str(c.attempts), "; ".join(notes))
    console.print(table)
    for path in result.report_paths[:1]:
        console.print(f"report: {path}", highlight=False)
    if result.report_error:
        console.print(f"[yellow]{result.report_error}[/]")


def print_suite(result: SuiteResult, console: Console, verbose: bool = False) -> Status:
    """The findings table (as ``gpumon check`` prints it), then the per-check summary."""
    print_table(result.runs, node=result.node, profile=result.profile, verbose=verbose, file=console.file)
    print_summary(result, console)
    return result.status
