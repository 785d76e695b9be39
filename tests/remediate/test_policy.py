"""The remediation policy: the real ``Health`` on a tmp state dir, and an in-memory scheduler.

The backend is the seam: the policy gets a ``SchedulerBackend`` passed in, and
``FakeScheduler`` implements that interface over a few fields (gpumon's mark,
someone else's mark, the fleet share) and records every call. The Kubernetes
backend's own wire format is tested in test_kubernetes.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpumon.health import DB_NAME, EventKind, Health, Level
from gpumon.model import Action, Finding, Severity
from gpumon.remediate.base import FleetShare, Mode, NodeOut, Outcome, SchedulerBackend
from gpumon.remediate.policy import (
    DEFAULT_TAKE_OUT_ACTIONS,
    MAX_SUMMARY,
    Decision,
    RemediationPolicy,
    summarize,
)

NOW = 1_800_000_000.0
XID79 = "Xid 79 fallen off the bus on gpu/3"


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeScheduler:
    """``SchedulerBackend`` in memory. ``foreign``: someone else took the node out (kept by
    take_out and bring_back, as the interface requires); ``fail``: method name -> exception."""

    name: str = "fake"
    gpumon: Action | None = None
    foreign: bool = False
    share: FleetShare = field(default_factory=lambda: FleetShare(0, 10))
    fail: dict[str, Exception] = field(default_factory=dict)
    incomplete: int = 0  # take_outs that report done=False (a write cut short)
    declines_foreign: bool = False  # like Slurm: its only mark is the one the operator set
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def _maybe_fail(self, name: str) -> None:
        exc = self.fail.pop(name, None)
        if exc is not None:
            raise exc

    def current(self) -> NodeOut:
        self.calls.append(("current",))
        self._maybe_fail("current")
        return NodeOut(out=self.foreign or self.gpumon is not None, by_gpumon=self.gpumon is not None,
                       reason=f"gpumon: {self.gpumon.value}: ..." if self.gpumon else "")

    def take_out(self, action: Action, summary: str, *, dry_run: bool) -> Outcome:
        self.calls.append(("take_out", action, summary, dry_run))
        self._maybe_fail("take_out")
        if self.declines_foreign and self.foreign:
            return Outcome(False, "out with someone else's reason; gpumon leaves it alone")
        changes = [] if self.gpumon is action else [f"mark {action.value}"]
        if dry_run:
            return Outcome(False, "dry run", changes)
        self.gpumon = action
        if self.incomplete:
            self.incomplete -= 1
            return Outcome(False, "second write failed", changes)
        return Outcome(True, "taken out", changes)

    def bring_back(self, summary: str, *, dry_run: bool) -> Outcome:
        self.calls.append(("bring_back", summary, dry_run))
        self._maybe_fail("bring_back")
        changes = ["unmark"] if self.gpumon is not None else []
        if not dry_run:
            self.gpumon = None
        return Outcome(not dry_run, "brought back", changes)

    def fleet_share(self, window_s: float) -> FleetShare:
        self.calls.append(("fleet_share", window_s))
        self._maybe_fail("fleet_share")
        return self.share

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _typed(backend: FakeScheduler) -> SchedulerBackend:
    return backend  # mypy checks here that the fake implements the interface


class Node:
    """Health + fake scheduler + policy for one node."""

    def __init__(self, state_dir: Path, *, mode: Mode = Mode.ENFORCE, **kwargs: Any) -> None:
        self.state_dir = state_dir
        self.clock = Clock()
        self.health = Health.open(state_dir, boot_id="boot-1", clock=self.clock)
        self.sched = FakeScheduler()
        self.kwargs = kwargs
        self.policy = RemediationPolicy(_typed(self.sched), self.health, mode=mode, clock=self.clock,
                                        **kwargs)

    def record(self, check: str, *findings: Finding) -> None:
        self.health.record_findings(check, list(findings), complete=True)

    def restart(self, boot_id: str) -> None:
        """The daemon starts again (after a reboot when boot_id is new): fresh Health and policy."""
        self.health.close()
        self.clock.t += 300
        self.health = Health.open(self.state_dir, boot_id=boot_id, clock=self.clock)
        self.policy = RemediationPolicy(self.sched, self.health, mode=self.policy.mode, clock=self.clock,
                                        **self.kwargs)

    def events(self, kind: EventKind) -> list[dict[str, Any]]:
        return [dict(e.payload) for e in self.health.store.events() if e.kind is kind]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path / "state")
    yield n
    n.health.close()


def xid79() -> Finding:
    return Finding("xid", "gpu/3", Severity.FAIL, XID79, Action.REBOOT_NODE, {"code": 79})


def ok(check: str, component: str) -> Finding:
    return Finding(check, component, Severity.OK, "ok")


def warn(component: str = "gpu/0") -> Finding:
    return Finding("thermal", component, Severity.WARN, "HBM 12 C above core")


# -- take out ---------------------------------------------------------------------------------


def test_nothing_is_decided_before_a_check_reports(node: Node) -> None:
    node.sched.gpumon = Action.RESET_GPU  # even gpumon's own old mark is not lifted on no knowledge
    result = node.policy.step()
    assert result.decision is Decision.WAIT and node.sched.calls == []


def test_a_healthy_node_is_left_alone(node: Node) -> None:
    node.record("xid", ok("xid", "gpu/3"))
    result = node.policy.step()
    assert result.decision is Decision.NONE and result.error is None
    assert node.sched.names() == ["current"]


def test_unhealthy_takes_out_once_and_records_the_quarantine(node: Node) -> None:
    node.record("xid", xid79())
    result = node.policy.step()
    assert result.decision is Decision.TAKE_OUT and result.changed and result.recorded == "quarantine"
    assert node.sched.calls == [("current",), ("fleet_share", 600.0),
                                ("take_out", Action.REBOOT_NODE, f"{XID79} (xid, gpu/3)", False)]
    view = node.health.view()
    assert view.node.level is Level.QUARANTINED and view.node.quarantine is not None
    assert (view.node.quarantine.by, view.node.quarantine.action) == ("gpumon", Action.REBOOT_NODE)
    assert node.events(EventKind.QUARANTINE) == [
        {"by": "gpumon", "reason": f"{XID79} (xid, gpu/3)", "action": "reboot_node"}]

    node.sched.calls.clear()
    for _ in range(3):
        assert node.policy.step().decision is Decision.KEEP_OUT
    assert node.sched.names() == ["current"] * 3
    assert len(node.events(EventKind.QUARANTINE)) == 1


def test_an_escalated_action_updates_the_marks_without_asking_the_breaker(node: Node) -> None:
    node.record("memory", Finding("memory", "gpu/1", Severity.FAIL, "DBE on gpu/1", Action.RESET_GPU,
                                  {"kind": "dbe"}))
    node.policy.step()
    node.sched.share = FleetShare(9, 10)  # would block a new take-out; this one is not new
    node.sched.calls.clear()
    node.record("memory", Finding("memory", "gpu/1", Severity.FAIL, "remap failure on gpu/1",
                                  Action.INSPECT_HARDWARE, {"kind": "dbe"}))
    result = node.policy.step()
    assert result.decision is Decision.TAKE_OUT and not result.breaker_open
    assert node.sched.names() == ["current", "take_out"]
    assert node.sched.gpumon is Action.INSPECT_HARDWARE
    q = node.health.view().node.quarantine
    assert q is not None and q.action is Action.INSPECT_HARDWARE
    assert [e["action"] for e in node.events(EventKind.QUARANTINE)] == ["reset_gpu", "inspect_hardware"]


def test_restart_app_alone_does_not_take_the_node_out(node: Node) -> None:
    node.record("xid", Finding("xid", "gpu/2", Severity.WARN, "Xid 13 on gpu/2", Action.RESTART_APP,
                               {"code": 13}))
    assert node.health.view().node.level is Level.UNHEALTHY
    result = node.policy.step()
    assert result.decision is Decision.NONE and "take_out" not in node.sched.names()
    assert Action.RESTART_APP not in DEFAULT_TAKE_OUT_ACTIONS


def test_take_out_actions_are_configurable_but_never_none(tmp_path: Path) -> None:
    n = Node(tmp_path / "s", take_out_actions=[Action.RESTART_APP, *DEFAULT_TAKE_OUT_ACTIONS])
    n.record("xid", Finding("xid", "gpu/2", Severity.WARN, "Xid 13 on gpu/2", Action.RESTART_APP,
                            {"code": 13}))
    assert n.policy.step().decision is Decision.TAKE_OUT
    # the worst action among the configured ones, even beside a worse one not configured
    n.record("memory", Finding("memory", "gpu/1", Severity.FAIL, "DBE", Action.RESET_GPU))
    n.policy.take_out_actions = frozenset({Action.RESTART_APP})
    n.sched.gpumon = None
    assert n.policy.step().action is Action.RESTART_APP
    n.health.close()
    with pytest.raises(ValueError, match="none"):
        RemediationPolicy(FakeScheduler(), n.health, mode=Mode.ENFORCE, take_out_actions=[Action.NONE])
    with pytest.raises(ValueError, match="breaker_share"):
        RemediationPolicy(FakeScheduler(), n.health, mode=Mode.ENFORCE, breaker_share=1.5)


# -- bring back -------------------------------------------------------------------------------


def test_brought_back_only_after_the_retest(node: Node) -> None:
    node.record("xid", xid79())
    node.policy.step()
    # the reboot alone does not bring it back: reboot_node faults wait for a retest
    node.restart("boot-2")
    node.record("xid")  # the xid check ran and saw nothing: silence is not a retest
    assert node.health.view().node.action is Action.REBOOT_NODE
    node.sched.calls.clear()
    first = node.policy.step()  # a new process reconciles once: the backend's take_out is idempotent
    assert first.decision is Decision.TAKE_OUT and first.recorded is None
    assert node.policy.step().decision is Decision.KEEP_OUT
    assert "bring_back" not in node.sched.names()

    node.record("xid", ok("xid", "gpu/3"))  # the retest passed
    result = node.policy.step()
    assert result.decision is Decision.BRING_BACK and result.recorded == "release" and result.changed
    assert node.sched.gpumon is None
    view = node.health.view()
    assert view.node.quarantine is None and view.node.level is Level.HEALTHY
    assert node.events(EventKind.RELEASE) == [{"by": "gpumon", "reason": "no open faults"}]
    assert node.policy.step().decision is Decision.NONE


def test_degraded_brings_back_too(node: Node) -> None:
    """Warnings or a failure with no action must not keep the node out (NVSentinel #911)."""
    node.record("ib", Finding("ib", "ib/mlx5_0/1", Severity.FAIL, "port down 9 s", Action.CHECK_CABLES))
    node.policy.step()
    node.record("ib", ok("ib", "ib/mlx5_0/1"))
    node.record("thermal", warn())
    node.record("gpu_presence", Finding("gpu_presence", "gpu/5", Severity.FAIL, "hung after 5 s"))
    assert node.health.view().components["gpu/5"].level is Level.DEGRADED
    result = node.policy.step()
    assert result.decision is Decision.BRING_BACK and node.sched.gpumon is None
    assert result.summary == "no fault needs the node out (2 open with no such action)"
    assert node.health.view().node.level is Level.DEGRADED


def test_someone_elses_mark_is_never_brought_back(node: Node) -> None:
    node.sched.foreign = True
    node.record("xid", ok("xid", "gpu/3"))
    assert node.policy.step().decision is Decision.NONE
    node.record("thermal", warn())
    assert node.policy.step().decision is Decision.NONE
    assert "bring_back" not in node.sched.names() and "take_out" not in node.sched.names()
    assert node.sched.foreign


def test_unhealthy_beside_someone_elses_mark_adds_gpumons_and_lifts_only_its_own(node: Node) -> None:
    node.sched.foreign = True
    node.record("xid", xid79())
    taken = node.policy.step()
    # the breaker is asked: gpumon's marks are new on this node
    assert taken.decision is Decision.TAKE_OUT
    assert node.sched.names() == ["current", "fleet_share", "take_out"]
    assert taken.node is not None and taken.node.out and not taken.node.by_gpumon
    node.restart("boot-2")
    node.record("xid", ok("xid", "gpu/3"))
    back = node.policy.step()
    assert back.decision is Decision.BRING_BACK
    assert node.sched.foreign and node.sched.gpumon is None  # the operator's mark stays


def test_a_backend_that_adds_nothing_beside_someone_elses_mark(node: Node) -> None:
    node.sched.foreign = True
    node.sched.declines_foreign = True
    node.record("xid", xid79())
    result = node.policy.step()
    assert result.decision is Decision.LEFT_ALONE and result.error is None and not result.changed
    assert result.outcome is not None and "leaves it alone" in result.outcome.detail
    assert node.health.view().node.quarantine is None  # gpumon did not take it out
    node.sched.foreign = False  # the operator resumed it: now gpumon takes it out
    assert node.policy.step().decision is Decision.TAKE_OUT
    assert node.sched.gpumon is Action.REBOOT_NODE


def test_a_quarantine_whose_marks_were_removed_by_hand_is_released_in_the_record(node: Node) -> None:
    node.record("memory", Finding("memory", "gpu/1", Severity.FAIL, "DBE", Action.RESET_GPU))
    node.policy.step()
    node.health.set_healthy(who="alice", reason="swapped the GPU")
    node.sched.gpumon = None  # alice also removed gpumon's marks herself
    result = node.policy.step()
    assert result.decision is Decision.NONE and result.recorded == "release"
    assert "bring_back" not in node.sched.names()
    assert node.health.view().node.quarantine is None


# -- circuit breaker --------------------------------------------------------------------------


def test_circuit_breaker_blocks_above_the_share(node: Node) -> None:
    node.sched.share = FleetShare(3, 10)
    node.record("xid", xid79())
    result = node.policy.step()
    assert result.decision is Decision.BLOCKED and result.breaker_open
    assert result.to_json()["share"] == {"taken_out_recently": 3, "total": 10, "share": 0.3}
    assert "take_out" not in node.sched.names()
    assert node.health.view().node.quarantine is None

    node.sched.share = FleetShare(2, 10)  # exactly the limit is not above it
    result = node.policy.step()
    assert result.decision is Decision.TAKE_OUT and not result.breaker_open
    assert node.sched.gpumon is Action.REBOOT_NODE


def test_circuit_breaker_window_and_share_are_passed(tmp_path: Path) -> None:
    n = Node(tmp_path / "s", breaker_share=0.5, breaker_window_s=300)
    n.sched.share = FleetShare(4, 10)
    n.record("xid", xid79())
    assert n.policy.step().decision is Decision.TAKE_OUT
    assert ("fleet_share", 300) in n.sched.calls
    n.health.close()


# -- observe mode -----------------------------------------------------------------------------


def test_observe_mode_reports_and_changes_nothing(tmp_path: Path) -> None:
    n = Node(tmp_path / "s", mode=Mode.OBSERVE)
    n.record("xid", xid79())
    before = n.health.store.count()
    result = n.policy.step()
    assert result.decision is Decision.TAKE_OUT and not result.changed
    assert result.would_change == ["mark reboot_node"]
    assert n.sched.calls[-1] == ("take_out", Action.REBOOT_NODE, f"{XID79} (xid, gpu/3)", True)
    assert n.sched.gpumon is None and n.health.store.count() == before
    assert n.health.view().node.quarantine is None

    n.sched.share = FleetShare(5, 10)  # the breaker is reported in observe mode too
    assert n.policy.step().breaker_open

    # gpumon's mark from an earlier enforce run: observe reports the bring-back, does not do it
    n.sched.gpumon = Action.RESET_GPU
    n.record("xid", ok("xid", "gpu/3"))
    n.restart("boot-2")
    n.record("xid", ok("xid", "gpu/3"))
    result = n.policy.step()
    assert result.decision is Decision.BRING_BACK and result.would_change == ["unmark"]
    assert n.sched.gpumon is Action.RESET_GPU
    n.health.close()


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["current", "fleet_share", "take_out"])
def test_backend_errors_are_reported_and_retried(node: Node, failing: str) -> None:
    node.record("xid", xid79())
    node.sched.fail[failing] = OSError("connection refused")
    result = node.policy.step()
    assert result.error is not None and "connection refused" in result.error
    assert node.health.view().node.quarantine is None
    again = node.policy.step()
    assert again.error is None and again.decision is Decision.TAKE_OUT
    assert node.health.view().node.quarantine is not None


def test_bring_back_errors_are_retried(node: Node) -> None:
    node.record("xid", xid79())
    node.policy.step()
    node.restart("boot-2")
    node.record("xid", ok("xid", "gpu/3"))
    node.sched.fail["bring_back"] = RuntimeError("scontrol: error: Unable to contact slurm controller")
    result = node.policy.step()
    assert result.decision is Decision.BRING_BACK and result.error is not None and "slurm" in result.error
    assert node.health.view().node.quarantine is not None
    assert node.policy.step().recorded == "release"


def test_an_unfinished_take_out_is_tried_again_and_recorded_when_done(node: Node) -> None:
    node.sched.incomplete = 1
    node.record("xid", xid79())
    first = node.policy.step()
    assert first.error == "second write failed" and node.health.view().node.quarantine is None
    second = node.policy.step()  # out by gpumon now, but not in sync: take_out again
    assert second.decision is Decision.TAKE_OUT and second.error is None
    assert node.sched.names().count("take_out") == 2
    assert node.sched.names().count("fleet_share") == 1  # the second is not a new take-out
    assert node.health.view().node.quarantine is not None


def test_a_store_that_cannot_be_written_keeps_the_quarantine_in_memory(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / DB_NAME).mkdir(parents=True)  # SQLite cannot open a directory
    n = Node(state)
    n.record("xid", xid79())
    result = n.policy.step()
    assert result.decision is Decision.TAKE_OUT and result.recorded == "quarantine"
    assert result.error is not None and "in memory only" in result.error
    assert n.health.view().node.quarantine is not None
    assert n.policy.step().decision is Decision.KEEP_OUT
    n.health.close()


# -- summary ----------------------------------------------------------------------------------


def test_summary_is_the_worst_fault_and_bounded(node: Node) -> None:
    node.record("xid", xid79(), Finding("xid", "gpu/1", Severity.FAIL, "Xid 48 DBE on gpu/1",
                                        Action.RESET_GPU, {"code": 48}))
    node.record("thermal", warn())
    why = node.health.view().node.why
    assert summarize(why, DEFAULT_TAKE_OUT_ACTIONS) == f"{XID79} (xid, gpu/3) and 1 more"
    node.record("pcie", Finding("pcie", "gpu/0", Severity.FAIL, "x" * 500, Action.INSPECT_HARDWARE))
    text = summarize(node.health.view().node.why, DEFAULT_TAKE_OUT_ACTIONS)
    assert len(text) == MAX_SUMMARY and text.endswith("...")
    assert summarize((), DEFAULT_TAKE_OUT_ACTIONS) == ""
