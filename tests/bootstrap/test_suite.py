"""The bootstrap suite runner (gpumon/bootstrap.py) on a real agent over a simulated node.

The checks here are small real Check subclasses; the agent, runner, config, simulated node (NVML
injection library under nvidia-ml-py) and health store are gpumon's own, nothing is patched.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gpumon.agent import Agent
from gpumon.bootstrap import (
    LATEST,
    NOT_RUN,
    ProgressEvent,
    merge_retry,
    print_suite,
    print_summary,
    record_health,
    required_checks,
    run_suite,
    select,
)
from gpumon.check import NOT_TESTED, Check, CheckContext, RetryRequest
from gpumon.config import load_config
from gpumon.errors import ConfigError
from gpumon.health import Health
from gpumon.health.state import EventKind
from gpumon.model import NODE, Action, CheckRun, Finding, Phase, Severity
from gpumon.profiles import builtin_profiles
from gpumon.registry import load_checks
from gpumon.sim import nvml_inject
from gpumon.sim.scenario import load_scenario
from gpumon.sim.simulation import Simulation

# what the test checks saw, by check name (checks are instantiated by the suite)
SEEN: dict[str, list[Any]] = {}


def _seen(name: str, item: Any) -> None:
    SEEN.setdefault(name, []).append(item)


class Cheap(Check):
    name = "t_cheap"
    phase = Phase.BOOTSTRAP
    cost = 1.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        _seen(self.name, "run")
        return [self.ok(NODE, "cheap ok")]


class Pricey(Check):
    name = "t_pricey"
    phase = Phase.BOOTSTRAP
    cost = 50.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        _seen(self.name, "run")
        return [self.ok("gpu/0", "pricey ok")]


class NoCost(Check):
    """No cost attribute: ordered by its time budget (timeout) instead."""

    name = "t_nocost"
    phase = Phase.BOOTSTRAP
    timeout = 10.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.ok(NODE, "no cost ok")]


class Failing(Check):
    name = "t_fail"
    phase = Phase.BOOTSTRAP
    cost = 2.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        _seen(self.name, "run")
        return [self.finding("gpu/1", Severity.FAIL, "remap pending", Action.RESET_GPU)]


class Warns(Check):
    name = "t_warn"
    phase = Phase.BOOTSTRAP
    cost = 1.5

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.finding(NODE, Severity.WARN, "a little slow")]


class Unsure(Check):
    name = "t_unknown"
    phase = Phase.BOOTSTRAP
    cost = 1.5

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.finding(NODE, Severity.UNKNOWN, "could not say")]


class Flaky(Check):
    """A bandwidth probe below threshold on the first measurement only; a second, healthy probe."""

    name = "t_flaky"
    phase = Phase.BOOTSTRAP
    cost = 3.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        n = ctx.state["n"] = ctx.state.get("n", 0) + 1
        retry = ctx.retry
        _seen(self.name, retry)
        out = []
        if retry is None or ("gpu/0", "bw") in retry.retry_ids:
            sev = Severity.FAIL if n == 1 else Severity.OK
            out.append(self.finding("gpu/0", sev, f"{300 if n == 1 else 390} GB/s", Action.INSPECT_HARDWARE
                                    if n == 1 else Action.NONE, retryable=True, retry_id="bw"))
        if retry is None:  # the healthy probe is not measured again
            out.append(self.finding("gpu/1", Severity.OK, "392 GB/s", retryable=True, retry_id="bw"))
        return out


class AlwaysSlow(Check):
    name = "t_slow"
    phase = Phase.BOOTSTRAP
    cost = 3.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        n = ctx.state["n"] = ctx.state.get("n", 0) + 1
        return [self.finding("gpu/2", Severity.FAIL, f"attempt {n}: 200 GB/s", Action.INSPECT_HARDWARE,
                             retryable=True)]


class WrongAndSlow(Check):
    """A correctness failure (never retried away) next to a slow probe; the retry shows a new fault."""

    name = "t_wrong"
    phase = Phase.BOOTSTRAP
    cost = 3.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        n = ctx.state["n"] = ctx.state.get("n", 0) + 1
        out = [self.finding("gpu/3", Severity.FAIL, "2 wrong elements", Action.INSPECT_HARDWARE),
               self.finding("gpu/4", Severity.WARN if n == 1 else Severity.OK, "busbw", retryable=True)]
        if n == 2:
            out.append(self.finding("gpu/5", Severity.FAIL, "1 wrong element", Action.INSPECT_HARDWARE))
        return out


class HardFault(Check):
    name = "t_hard"
    phase = Phase.BOOTSTRAP
    cost = 2.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        _seen(self.name, "run")
        return [self.finding("gpu/6", Severity.FAIL, "row remap failure", Action.INSPECT_HARDWARE)]


class Retryable(Check):
    """Marks its probes as the compute checks do (``retryable``); gpu/0 low once, gpu/1 low after the
    check already measured it twice itself."""

    name = "t_retryable"
    phase = Phase.BOOTSTRAP
    cost = 3.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        n = ctx.state["n"] = ctx.state.get("n", 0) + 1
        _seen(self.name, n)
        return [self.finding("gpu/0", Severity.FAIL if n == 1 else Severity.OK, "h2d", retryable=True),
                self.finding("gpu/1", Severity.FAIL, "d2h low again on a second measurement",
                             Action.INSPECT_HARDWARE, retryable=True, attempts=2)]


class Hangs(Check):
    name = "t_hang"
    phase = Phase.BOOTSTRAP
    cost = 0.5
    release = threading.Event()

    def run(self, ctx: CheckContext) -> list[Finding]:
        self.release.wait(10)
        return [self.ok(NODE, "woke")]


class WithHook(Check):
    """Takes a reading in run and compares with it after the suite (as pcie_topology does with AER)."""

    name = "t_hook"
    phase = Phase.BOOTSTRAP
    cost = 0.1

    def run(self, ctx: CheckContext) -> list[Finding]:
        ctx.state["before"] = 7
        _seen("order", "hook.run")
        return [self.ok(NODE, "baseline taken")]

    def after_suite(self, ctx: CheckContext) -> list[Finding]:
        _seen("order", "hook.after")
        return [self.finding("gpu/0", Severity.FAIL, f"counter rose from {ctx.state['before']} to 9",
                             Action.INSPECT_HARDWARE)]


class Marker(Check):
    name = "t_marker"
    phase = Phase.BOOTSTRAP
    cost = 5.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        _seen("order", "marker.run")
        return [self.ok(NODE, "marker")]


class CannotRun(Check):
    """What burnin says without torch: skipped, with the fix."""

    name = "t_cannot"
    phase = Phase.BOOTSTRAP
    cost = 1.0

    def supported(self, inventory: Any) -> str | None:
        return "torch not installed (pip install 'gpumon-node[compute]')"

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise AssertionError("not supported: never run")


class PartlyRun(Check):
    """What p2p says without torch: the topology judged, the copies (what it is for) not."""

    name = "t_partly"
    phase = Phase.BOOTSTRAP
    cost = 1.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.ok(NODE, "NVLink on every pair"),
                self.finding(NODE, Severity.SKIPPED, "copy bandwidth not measured", **{NOT_TESTED: True})]


class PartSkipped(Check):
    """What pcie_topology says on a VM: one part skipped, the rest judged."""

    name = "t_part_skipped"
    phase = Phase.BOOTSTRAP
    cost = 1.0

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.ok("gpu/0", "x16 Gen5"),
                self.finding(NODE, Severity.SKIPPED, "no PCIe switch visible: affinity not judged")]


TEST_CHECKS: list[type[Check]] = [Cheap, Pricey, NoCost, Failing, Warns, Unsure, Flaky, AlwaysSlow,
                                  WrongAndSlow, HardFault, Retryable, Hangs, WithHook, Marker, CannotRun,
                                  PartlyRun, PartSkipped]


@pytest.fixture
def make_agent(inject_lib_dir: Path, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Agent]]:
    # Simulation.start sets these for the process: restore them after the test
    monkeypatch.setenv(nvml_inject.STATE_ENV, "unset")
    monkeypatch.setenv("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    SEEN.clear()
    Hangs.release.clear()
    made: list[tuple[Agent, Simulation]] = []

    def make(config_text: str = "{}\n") -> Agent:
        registry = {**load_checks(), **{c.name: c for c in TEST_CHECKS}}
        cfg = tmp_path / f"gpumon{len(made)}.yaml"
        if "bootstrap:" not in config_text:
            # these tests run the test checks above, not the profile's: what h100-sxm requires is
            # declared optional (the required-check tests below say otherwise)
            optional = "bootstrap:\n  optional: [" + ", ".join(
                builtin_profiles()["h100-sxm"].bootstrap.required) + "]\n"
            config_text = optional + ("" if config_text.strip() == "{}" else config_text)
        cfg.write_text(config_text)
        config = load_config(cfg, registry, site_file=tmp_path / "absent.yaml")
        sim = Simulation.start(load_scenario("healthy-8xh100"), None, tmp_path / f"sim{len(made)}")
        agent = Agent(config, registry, sim)
        agent.start()
        made.append((agent, sim))
        return agent

    yield make
    Hangs.release.set()
    for agent, sim in made:
        agent.stop()
        sim.close()


def _names(result: Any) -> list[str]:
    return [c.check for c in result.checks]


# --------------------------------------------------------------------------- order and selection


def test_order_is_cheap_to_expensive(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    events: list[ProgressEvent] = []
    result = run_suite(agent, [Pricey(), NoCost(), Cheap()], on_progress=events.append, write_report=False)
    # cost 1 < budget 10 (no cost: its timeout) < cost 50
    assert _names(result) == ["t_cheap", "t_nocost", "t_pricey"]
    assert [(e.kind, e.check) for e in events] == [("start", "t_cheap"), ("done", "t_cheap"),
                                                  ("start", "t_nocost"), ("done", "t_nocost"),
                                                  ("start", "t_pricey"), ("done", "t_pricey")]
    assert [(e.index, e.total, e.expected_s) for e in events if e.kind == "start"] == [
        (1, 3, 1.0), (2, 3, 10.0), (3, 3, 50.0)]
    assert result.exit_code == 0 and result.passed


def test_only_and_skip(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    assert [c.name for c in select(agent, only=["t_pricey", "t_cheap"], skip=["t_pricey"])] == ["t_cheap"]
    every = [c.name for c in select(agent, skip=["t_hang", "t_fail"])]
    assert {"t_cheap", "t_pricey", "t_flaky"} <= set(every) and not {"t_hang", "t_fail"} & set(every)
    assert "xid" not in every  # a continuous check is not part of the suite unless asked for by name
    with pytest.raises(ConfigError, match="unknown check 'nope'"):
        select(agent, only=["nope"])
    with pytest.raises(ConfigError, match="unknown check 'nada'"):
        select(agent, skip=["nada"])


def test_disabled_check_is_left_out_unless_named(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent("checks:\n  t_pricey: {enabled: false}\n")
    assert "t_pricey" not in [c.name for c in select(agent)]
    assert [c.name for c in select(agent, only=["t_pricey"])] == ["t_pricey"]


# --------------------------------------------------------------------------- fail-fast


def test_fail_fast_stops_after_the_first_failure(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [Pricey(), Failing(), Cheap()], fail_fast=True, write_report=False)
    assert _names(result) == ["t_cheap", "t_fail", "t_pricey"]
    assert "t_pricey" not in SEEN
    pricey = result.checks[2]
    assert (pricey.run.outcome, pricey.attempts) == (NOT_RUN, 0)
    [f] = pricey.run.findings
    assert (f.severity, f.message) == (Severity.SKIPPED,
                                       "not run: --fail-fast stopped the suite after t_fail failed")
    assert result.stopped_after == "t_fail" and result.exit_code == 2 and not result.passed


def test_without_fail_fast_every_check_runs(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [Pricey(), Failing(), Cheap()], write_report=False)
    assert SEEN["t_pricey"] == ["run"] and result.stopped_after is None and result.exit_code == 2


# --------------------------------------------------------------------------- probes


def test_probe_below_threshold_is_measured_again_and_passes(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    events: list[ProgressEvent] = []
    result = run_suite(agent, [Flaky()], on_progress=events.append, write_report=False)
    [c] = result.checks
    assert c.attempts == 2 and c.retried == ["gpu/0"]
    # the retry was told which probe to measure again, and only that one was
    assert SEEN["t_flaky"] == [None, RetryRequest(2, ("gpu/0",), frozenset({("gpu/0", "bw")}))]
    gpu0, gpu1 = c.run.findings
    assert (gpu0.component, gpu0.severity) == ("gpu/0", Severity.OK)
    assert gpu0.message == "390 GB/s (passed on the retry)"
    assert gpu0.evidence["first_attempt"] == {"severity": "fail", "message": "300 GB/s"}
    assert gpu0.evidence["suite_attempts"] == 2
    assert (gpu1.component, gpu1.message) == ("gpu/1", "392 GB/s")  # kept from the first run
    assert [e.kind for e in events] == ["start", "retry", "done"]
    assert result.exit_code == 0 and result.passed


def test_probe_that_stays_below_threshold_fails(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [AlwaysSlow()], write_report=False)
    [c] = result.checks
    [f] = c.run.findings
    assert c.attempts == 2
    assert (f.severity, f.message) == (Severity.FAIL, "attempt 2: 200 GB/s (again on the retry)")
    assert f.evidence["first_attempt"]["message"] == "attempt 1: 200 GB/s"
    assert result.exit_code == 2


def test_retryable_flag_and_the_checks_own_second_measurement(make_agent: Callable[..., Agent]) -> None:
    result = run_suite(make_agent(), [Retryable()], write_report=False)
    [c] = result.checks
    # gpu/0 was measured again by the suite; gpu/1 had been measured twice by the check: not a third time
    assert c.retried == ["gpu/0"] and SEEN["t_retryable"] == [1, 2]
    by = {f.component: f for f in c.run.findings}
    assert by["gpu/0"].severity is Severity.OK and by["gpu/0"].evidence["suite_attempts"] == 2
    assert by["gpu/1"].severity is Severity.FAIL and "suite_attempts" not in by["gpu/1"].evidence


def test_retries_zero_fails_a_probe_at_once(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [AlwaysSlow()], retries=0, write_report=False)
    assert result.checks[0].attempts == 1 and result.exit_code == 2


def test_a_correctness_failure_is_never_retried_away(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [WrongAndSlow(), HardFault()], write_report=False)
    wrong, hard = (c for c in result.checks if c.check == "t_wrong"), (c for c in result.checks
                                                                      if c.check == "t_hard")
    w, h = next(wrong), next(hard)
    assert h.attempts == 1 and SEEN["t_hard"] == ["run"]  # no probe: not run again
    by = {f.component: f for f in w.run.findings}
    assert w.attempts == 2
    assert by["gpu/3"].severity is Severity.FAIL  # from the first run, kept
    assert by["gpu/4"].severity is Severity.OK  # the probe passed on the retry
    assert by["gpu/5"].message == "1 wrong element"  # a new fault the retry showed is kept


def test_merge_retry_keeps_a_probe_the_retry_did_not_measure() -> None:
    probe = Finding("x", "gpu/0", Severity.FAIL, "slow", Action.INSPECT_HARDWARE,
                    {"retryable": True, "retry_id": "a"})
    other = Finding("x", "gpu/0", Severity.OK, "fine", Action.NONE, {"retryable": True, "retry_id": "b"})
    first = CheckRun("x", [probe, other], 1.0, 2.0, "completed")
    second = CheckRun("x", [Finding("x", "gpu/0", Severity.OK, "fine", Action.NONE,
                                    {"retryable": True, "retry_id": "b"})], 4.0, 3.0, "completed")
    merged = merge_retry(first, second)
    assert [f.severity for f in merged.findings] == [Severity.FAIL, Severity.OK]
    assert merged.findings[0].evidence["retry"] == "the retry did not measure it again"
    assert (merged.seconds, merged.outcome, merged.started) == (5.0, "completed", 1.0)
    hung = CheckRun("x", [Finding("x", NODE, Severity.FAIL, "hung after 3 s in ib_write_bw")], 4.0, 3.0,
                    "hung")
    merged = merge_retry(first, hung)
    assert merged.outcome == "hung" and merged.findings[-1].message == "hung after 3 s in ib_write_bw"


# --------------------------------------------------------------------------- budgets, hooks


def test_a_check_past_its_budget_fails_and_the_suite_goes_on(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent("checks:\n  t_hang: {timeout_s: 0.3}\n")
    start = time.monotonic()
    result = run_suite(agent, [Hangs(), Cheap()], write_report=False)
    assert time.monotonic() - start < 5
    hang = result.checks[0]
    assert (hang.check, hang.run.outcome, hang.budget_s) == ("t_hang", "hung", 0.3)
    assert hang.run.findings[0].severity is Severity.FAIL
    assert hang.run.findings[0].message.startswith("hung after 0.3 s")
    assert result.checks[1].run.outcome == "completed" and result.exit_code == 2


def test_after_suite_hook_runs_once_every_check_has_run(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    events: list[ProgressEvent] = []
    result = run_suite(agent, [Marker(), WithHook()], on_progress=events.append, write_report=False)
    assert SEEN["order"] == ["hook.run", "marker.run", "hook.after"]
    hook = result.checks[0]
    assert hook.after_suite and [f.message for f in hook.run.findings] == ["baseline taken",
                                                                          "counter rose from 7 to 9"]
    assert events[-1].kind == "after_suite" and result.exit_code == 2


# --------------------------------------------------------------------------- reports and exit codes


def test_json_reports_are_written_to_the_state_dir(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    result = run_suite(agent, [Warns(), Cheap()])
    dated, latest = result.report_paths
    assert dated.parent == agent.state_dir and latest == agent.state_dir / LATEST
    assert dated.name.startswith("bootstrap-") and dated.name.endswith("Z.json")
    assert dated.read_text() == latest.read_text()
    doc = json.loads(latest.read_text())
    assert doc["status"] == "warn" and doc["node"] == "sim-healthy-8xh100" and doc["profile"] == "h100-sxm"
    assert doc["simulated"] == "healthy-8xh100"
    # the record holds every finding, ok ones included
    assert {(f["check"], f["severity"]) for f in doc["findings"]} == {("t_cheap", "ok"), ("t_warn", "warn")}
    boot = doc["bootstrap"]
    assert boot["order"] == ["t_cheap", "t_warn"] and boot["passed"] is True and boot["fail_fast"] is False
    assert boot["checks"][1] == {"check": "t_warn", "outcome": "completed", "severity": "warn",
                                 "action": "none", "seconds": boot["checks"][1]["seconds"],
                                 "expected_s": 1.5, "budget_s": 30.0, "attempts": 1, "retried": [],
                                 "after_suite": False}
    assert [c["check"] for c in doc["checks"]] == ["t_cheap", "t_warn"]
    # --json without -v: non-ok findings, and one line for a check that was all ok
    assert [(f["check"], f["severity"]) for f in result.report()["findings"]] == [("t_cheap", "ok"),
                                                                                 ("t_warn", "warn")]


def test_old_reports_are_pruned(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    for _ in range(3):
        run_suite(agent, [Cheap()], keep_reports=2)
        time.sleep(0.002)  # report names carry milliseconds
    dated = sorted(p.name for p in agent.state_dir.glob("bootstrap-*.json") if p.name != LATEST)
    assert len(dated) == 2 and (agent.state_dir / LATEST).is_file()


def test_unwritable_state_dir_is_reported_not_raised(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    agent.state_dir.parent.mkdir(parents=True, exist_ok=True)
    agent.state_dir.write_text("a file where the directory should be")
    result = run_suite(agent, [Cheap()])
    assert result.report_paths == [] and "could not write the bootstrap report" in (result.report_error or "")
    assert result.exit_code == 0


@pytest.mark.parametrize(("checks", "code", "passed"), [
    ([Cheap], 0, True), ([Cheap, Warns], 1, True), ([Cheap, Unsure], 1, False), ([Warns, Failing], 2, False)])
def test_exit_codes(make_agent: Callable[..., Agent], checks: list[type[Check]], code: int,
                    passed: bool) -> None:
    result = run_suite(make_agent(), [c() for c in checks], write_report=False)
    assert (result.exit_code, result.passed) == (code, passed)


# --------------------------------------------------------------------------- required checks (issue 18)

_PROFILE_OPTIONAL = ", ".join(builtin_profiles()["h100-sxm"].bootstrap.required)


def _requiring(*names: str, extra: str = "") -> str:
    return f"bootstrap:\n  required: [{', '.join(names)}]\n  optional: [{_PROFILE_OPTIONAL}]\n{extra}"


def test_a_required_check_that_cannot_run_leaves_the_suite_incomplete(
        make_agent: Callable[..., Agent], tmp_path: Path) -> None:
    agent = make_agent(_requiring("t_cannot"))
    out = io.StringIO()
    result = run_suite(agent, [Cheap(), CannotRun()], write_report=True)
    assert result.verdict == "INCOMPLETE" and result.exit_code == 3 and not result.passed
    assert [(r.check, r.required_by) for r in result.incomplete] == [
        ("t_cannot", "the site config (bootstrap.required)")]
    (f,) = next(c for c in result.checks if c.check == "t_cannot").run.findings
    assert f.severity is Severity.UNKNOWN
    assert f.message == ("required by the site config (bootstrap.required), could not run: torch not "
                         "installed (pip install 'gpumon-node[compute]'); install what it needs and run the "
                         "suite again, or declare it optional (bootstrap.optional)")
    doc = json.loads(result.report_paths[1].read_text())
    assert doc["status"] == "error" and doc["bootstrap"]["verdict"] == "INCOMPLETE"
    assert doc["bootstrap"]["incomplete"][0]["check"] == "t_cannot"
    print_summary(result, Console(file=out, width=200))
    text = out.getvalue()
    assert ": INCOMPLETE in " in text and "pip install 'gpumon-node[compute]'" in text
    # an incomplete suite is no retest: the faults a reset or reboot should have cleared stay
    health = Health.open(tmp_path / "health", boot_id="boot-1")
    try:
        assert not record_health(result, health)
        assert not any(e.kind is EventKind.RETEST_PASSED for e in health.store.events())
    finally:
        health.close()


def test_a_required_check_is_optional_when_the_site_says_so(make_agent: Callable[..., Agent]) -> None:
    result = run_suite(make_agent(_requiring()), [Cheap(), CannotRun()], write_report=False)
    assert result.verdict == "PASSED" and result.exit_code == 0 and result.passed
    # the profile's own requirement, declared optional by the site
    agent = make_agent(f"bootstrap:\n  optional: [{_PROFILE_OPTIONAL}]\n")
    assert "burnin" not in required_checks(agent)
    assert required_checks(make_agent(_requiring("burnin")))["burnin"].startswith("the site config")


def test_the_profile_requires_its_checks(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent("bootstrap: {}\n")
    required = required_checks(agent)
    assert set(required) == {"memory_headroom", "pcie_topology", "burnin", "nccl", "p2p"}
    assert required["burnin"] == "profile h100-sxm"
    # host_bandwidth too, but a simulated node has no host-device link (Machine.cannot_host)
    assert "host_bandwidth" in agent.profile.bootstrap.required


def test_not_installed_disabled_left_out_and_partly_run(make_agent: Callable[..., Agent]) -> None:
    # required, but not installed, disabled, or what it is for not measured: INCOMPLETE
    agent = make_agent(_requiring("t_partly", "t_pricey", "t_part_skipped", "site_check",
                                  extra="checks:\n  t_pricey: {enabled: false}\n")
                       .replace("site_check", "t_nocost"))
    agent.checks.pop("t_nocost")  # as a site plugin whose package is not installed
    result = run_suite(agent, [Cheap(), PartlyRun(), PartSkipped()], write_report=False)
    reasons = {r.check: r.reason for r in result.incomplete}
    assert reasons == {"t_partly": "copy bandwidth not measured",
                       "t_pricey": "disabled in the config (checks.t_pricey.enabled: false)",
                       "t_nocost": "no check 't_nocost' is installed (entry point group gpumon.checks)"}
    assert result.exit_code == 3 and result.verdict == "INCOMPLETE"
    # left out on purpose (--only/--skip): exit code by what ran, but no retest credit
    partial = run_suite(make_agent(_requiring("t_pricey")), [Cheap()], write_report=False)
    assert (partial.exit_code, partial.verdict, partial.passed) == (0, "PASSED (partial)", False)
    # a failure found is a verdict whatever could not run
    failed = run_suite(make_agent(_requiring("t_cannot")), [Failing(), CannotRun()], write_report=False)
    assert (failed.exit_code, failed.verdict) == (2, "NOT PASSED") and failed.incomplete


def test_a_misspelt_bootstrap_name_is_refused_where_it_is_written(make_agent: Callable[..., Agent]) -> None:
    where = r"gpumon\d\.yaml:2: bootstrap\.optional\[0\]: unknown check 'burnim'"
    with pytest.raises(ConfigError, match=where):
        make_agent("bootstrap:\n  optional: [burnim]\n")


def test_interrupted_suite_is_exit_3_and_not_passed(make_agent: Callable[..., Agent]) -> None:
    def stop(event: ProgressEvent) -> None:
        if event.kind == "start" and event.check == "t_pricey":
            raise KeyboardInterrupt

    result = run_suite(make_agent(), [Cheap(), Pricey()], on_progress=stop)
    assert result.interrupted and result.exit_code == 3 and not result.passed
    assert [c.run.outcome for c in result.checks] == ["completed", NOT_RUN]
    assert json.loads(result.report_paths[1].read_text())["status"] == "error"


# --------------------------------------------------------------------------- health hook, output


def test_a_passed_suite_is_the_nodes_retest(make_agent: Callable[..., Agent], tmp_path: Path) -> None:
    agent = make_agent()
    health = Health.open(tmp_path / "health", boot_id="boot-1")
    try:
        result = run_suite(agent, [Cheap(), Warns()], write_report=False)
        assert record_health(result, health)
        kinds = [(e.kind, e.payload.get("by")) for e in health.store.events()]
        assert (EventKind.RETEST_PASSED, "bootstrap") in kinds
        failed = run_suite(agent, [Failing(), Pricey()], fail_fast=True, write_report=False)
        before = len([e for e in health.store.events() if e.kind is EventKind.RETEST_PASSED])
        assert not record_health(failed, health)
        after = [e for e in health.store.events() if e.kind is EventKind.RETEST_PASSED]
        assert len(after) == before
        assert any(e.kind is EventKind.FINDING and e.check == "t_fail" for e in health.store.events())
        assert not any(e.check == "t_pricey" for e in health.store.events())  # not run: not recorded
    finally:
        health.close()


def test_progress_plain_lines_when_not_a_terminal(make_agent: Callable[..., Agent]) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    run_suite(make_agent(), [Pricey(), Cheap()], console=console, write_report=False)
    lines = out.getvalue().splitlines()
    assert lines[0] == "gpumon bootstrap [1/2] t_cheap: started (expect ~1 s, budget 30 s)"
    assert lines[1].startswith("gpumon bootstrap [1/2] t_cheap: ok in ")
    assert lines[2] == "gpumon bootstrap [2/2] t_pricey: started (expect ~50 s, budget 30 s)"


def test_progress_bar_on_a_terminal_and_the_summary(make_agent: Callable[..., Agent]) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140)
    result = run_suite(make_agent(), [Cheap(), Flaky()], console=console, write_report=False)
    text = out.getvalue()
    assert "bootstrap suite" in text and "[2/2] t_flaky" in text and "ETA" in text
    table = io.StringIO()
    print_suite(result, Console(file=table, width=200))
    shown = table.getvalue()
    assert "PASSED" in shown and "probes retried: gpu/0" in shown and "t_cheap" in shown
