"""The health fold on hand-written event sequences, one test per rule, and property tests.

Events are built with the same constructors the daemon uses; check runs go
through ``HealthState.observe`` (what the daemon stores for a run) so that the
tests cover what is actually written, not only what the fold would do with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpumon.health.state import (
    Event,
    EventKind,
    HealthPolicy,
    HealthState,
    Level,
    boot_event,
    fault_key,
    finding_event,
    fold,
    quarantine_event,
    release_event,
    remediation_event,
    retest_passed_event,
    set_healthy_event,
)
from gpumon.model import NODE, Action, Finding, Severity

B1, B2, B3, B4 = "boot-1", "boot-2", "boot-3", "boot-4"


def xid79(component: str = "gpu/3", lines: int = 1) -> Finding:
    times = "" if lines == 1 else f" ({lines} lines)"
    return Finding("xid", component, Severity.FAIL,
                   f"Xid 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on {component}{times}",
                   Action.REBOOT_NODE, {"code": 79, "count": lines})


def xid_ok() -> Finding:
    return Finding("xid", NODE, Severity.OK, "no Xid errors in the kernel log this boot")


class Node:
    """A state driven like the daemon drives it: runs are observed, the events applied."""

    def __init__(self, policy: HealthPolicy | None = None) -> None:
        self.state = HealthState(policy)
        self.t = 1_000.0
        self.boot = B1
        self.log: list[Event] = []
        self.apply(boot_event(B1, time=self.t))

    def apply(self, event: Event) -> None:
        self.state.apply(event)
        self.log.append(event)

    def tick(self, dt: float = 10.0) -> float:
        self.t += dt
        return self.t

    def run(self, check: str, *findings: Finding, complete: bool = True) -> list[Event]:
        obs = self.state.observe(check, findings, complete=complete, time=self.tick(), boot_id=self.boot)
        for e in obs.events:
            self.apply(e)
        for fid in obs.seen:
            self.state.touch(fid, self.t, obs.words.get(fid))
        return obs.events

    def reboot(self, boot: str) -> None:
        self.boot = boot
        self.apply(boot_event(boot, time=self.tick(), previous=self.state.boot_id))

    def retest(self, component: str = NODE, check: str = "") -> None:
        self.apply(retest_passed_event(component, time=self.tick(), boot_id=self.boot, check=check,
                                       by="bootstrap"))

    def reset(self, component: str) -> None:
        self.apply(remediation_event(Action.RESET_GPU, component, time=self.tick(), boot_id=self.boot,
                                     by="operator"))

    def set_healthy(self, component: str = NODE) -> None:
        self.apply(set_healthy_event(component, time=self.tick(), boot_id=self.boot, who="alice",
                                     reason="replaced the GPU"))

    def level(self, component: str | None = None) -> Level:
        return self.state.node().level if component is None else self.state.component(component).level

    def action(self, component: str | None = None) -> Action:
        return self.state.node().action if component is None else self.state.component(component).action


# -- reboot-aware clearing ------------------------------------------------------------------


def test_xid79_disappearing_after_reboot_does_not_make_the_gpu_healthy() -> None:
    n = Node()
    n.run("xid", xid79())
    assert (n.level("gpu/3"), n.action("gpu/3")) == (Level.UNHEALTHY, Action.REBOOT_NODE)
    n.reboot(B2)
    # the new boot's log has no Xid: the check's run resolves the fault, which is not a retest
    events = n.run("xid", xid_ok())
    assert [e.kind for e in events] == [EventKind.FINDING, EventKind.RESOLVED]
    assert n.level("gpu/3") is Level.UNHEALTHY
    (fault,) = n.state.component("gpu/3").why
    assert fault.status == "remediated: awaiting retest" and not fault.reported
    # nor does another check being happy with the GPU
    n.run("throttle", Finding("throttle", "gpu/3", Severity.OK, "no hardware slowdown"))
    assert n.level("gpu/3") is Level.UNHEALTHY
    n.retest()
    assert n.level("gpu/3") is Level.HEALTHY
    assert n.level() is Level.HEALTHY and n.action() is Action.NONE


def test_reboot_fault_cleared_by_the_same_check_passing_after_the_reboot() -> None:
    n = Node()
    lost = Finding("throttle", "gpu/2", Severity.FAIL, "GPU lost: GPU is lost", Action.REBOOT_NODE)
    n.run("throttle", lost)
    # the GPU answering again before any reboot is not a cure: it stays, awaiting a reboot
    n.run("throttle", Finding("throttle", "gpu/2", Severity.OK, "no hardware slowdown"))
    assert n.level("gpu/2") is Level.UNHEALTHY
    assert n.state.component("gpu/2").why[0].status == "awaiting reboot_node (no longer reported)"
    n.reboot(B2)
    assert n.level("gpu/2") is Level.UNHEALTHY
    n.run("throttle", Finding("throttle", "gpu/2", Severity.OK, "no hardware slowdown"))
    assert n.level("gpu/2") is Level.HEALTHY


def test_a_retest_before_the_remedy_does_not_clear() -> None:
    n = Node()
    n.run("xid", xid79())
    n.retest()
    assert n.level("gpu/3") is Level.UNHEALTHY
    n.reboot(B2)
    n.retest()
    assert n.level("gpu/3") is Level.HEALTHY


def test_reset_gpu_needs_a_reset_of_that_gpu_then_a_retest() -> None:
    n = Node()
    dbe = Finding("xid", "gpu/1", Severity.FAIL, "Xid 48 DBE on gpu/1", Action.RESET_GPU, {"code": 48})
    n.run("xid", dbe)
    n.reset("gpu/0")  # another GPU
    n.retest("gpu/1")
    assert n.action("gpu/1") is Action.RESET_GPU
    n.reset("gpu/1")
    # xid keeps a GPU's Xids for the boot and knows nothing of resets: it repeats the line
    assert n.run("xid", dbe) == []
    assert n.action("gpu/1") is Action.RESET_GPU
    n.retest("gpu/1")
    assert n.level("gpu/1") is Level.HEALTHY
    # ... and the repeat after the retest is not the fault coming back
    assert n.run("xid", dbe) == []
    assert n.level("gpu/1") is Level.HEALTHY
    # a new Xid 48 line is
    n.run("xid", Finding("xid", "gpu/1", Severity.FAIL, "Xid 48 DBE on gpu/1 (2 lines)",
                         Action.RESET_GPU, {"code": 48}))
    assert n.action("gpu/1") is Action.RESET_GPU


def test_reset_gpu_is_also_satisfied_by_a_reboot_and_reaches_the_gpus_nvlinks() -> None:
    n = Node()
    link = Finding("xid", "nvlink/2/5", Severity.FAIL, "Xid 145 Fatal", Action.RESET_GPU, {"code": 145})
    gpu = Finding("throttle", "gpu/2", Severity.FAIL, "hung after 5 s in nvmlDeviceGetClock",
                  Action.RESET_GPU)
    n.run("xid", link)
    n.run("throttle", gpu)
    n.reset("gpu/2")
    assert all(f.remediated is not None for f in n.state.faults.values())
    n.retest("gpu/2")
    assert n.state.faults == {}

    n.run("xid", Finding("xid", "nvlink/2/5", Severity.FAIL, "Xid 145 Fatal (2 lines)", Action.RESET_GPU,
                         {"code": 145}))
    n.reboot(B2)
    n.retest()
    assert n.level() is Level.HEALTHY


def test_remediation_reboot_event_is_not_proof_of_a_reboot() -> None:
    n = Node()
    n.run("xid", xid79())
    n.apply(remediation_event(Action.REBOOT_NODE, time=n.tick(), boot_id=B1, by="gpumon"))
    n.retest()
    assert n.action("gpu/3") is Action.REBOOT_NODE  # the boot id did not change


def test_an_event_from_an_unannounced_boot_counts_as_the_reboot() -> None:
    n = Node()
    n.run("xid", xid79())
    n.boot = B2  # no boot event: the first event of the new boot carries its id
    n.retest()
    assert n.state.boot_id == B2
    assert n.level("gpu/3") is Level.HEALTHY


# -- escalation -----------------------------------------------------------------------------


def test_the_same_fault_back_after_two_remediations_escalates_to_inspect_hardware() -> None:
    n = Node()
    n.run("xid", xid79())
    for boot in (B2, B3):
        n.reboot(boot)
        n.run("xid", xid_ok())
        n.retest()
        assert n.level() is Level.HEALTHY
        n.run("xid", xid79())  # back, in the new boot
        if boot == B2:
            assert n.action("gpu/3") is Action.REBOOT_NODE  # one remediation so far
    fault = n.state.component("gpu/3").why[0]
    assert (fault.action, fault.escalated, fault.reported_action) == (
        Action.INSPECT_HARDWARE, True, Action.REBOOT_NODE)
    # a reboot and a passing retest no longer clear it
    n.reboot(B4)
    n.run("xid", xid_ok())
    n.retest()
    assert n.action() is Action.INSPECT_HARDWARE
    n.set_healthy("gpu/3")
    assert n.level() is Level.HEALTHY
    # the count starts again after the operator's word (a replaced part is a new part)
    n.run("xid", xid79())
    assert n.action("gpu/3") is Action.REBOOT_NODE


def test_a_fault_back_before_its_retest_counts_as_returning() -> None:
    n = Node()
    lost = Finding("throttle", "gpu/2", Severity.FAIL, "GPU lost: GPU is lost", Action.REBOOT_NODE)
    n.run("throttle", lost)
    n.reboot(B2)
    n.run("throttle", lost)  # still lost after the reboot: the same words, a new boot
    assert n.state.component("gpu/2").why[0].remediated is None
    n.reboot(B3)
    n.run("throttle", lost)
    assert n.action("gpu/2") is Action.INSPECT_HARDWARE


def test_remediations_outside_the_window_do_not_escalate() -> None:
    n = Node(HealthPolicy(escalation_window_s=3600))
    n.run("xid", xid79())
    for boot in (B2, B3):
        n.reboot(boot)
        n.retest()
        n.tick(7200)
        n.run("xid", xid79())
    assert n.action("gpu/3") is Action.REBOOT_NODE


def test_different_codes_are_different_faults_for_escalation() -> None:
    n = Node()
    for boot, code in ((B2, 79), (B3, 74), (B4, 48)):
        n.run("xid", Finding("xid", "gpu/3", Severity.FAIL, f"Xid {code}", Action.REBOOT_NODE,
                             {"code": code}))
        n.reboot(boot)
        n.retest()
    n.run("xid", Finding("xid", "gpu/3", Severity.FAIL, "Xid 63", Action.REBOOT_NODE, {"code": 63}))
    assert n.action("gpu/3") is Action.REBOOT_NODE


# -- faults cleared by the condition going away ---------------------------------------------


def test_application_errors_clear_when_the_check_says_ok() -> None:
    n = Node()
    app = Finding("xid", "gpu/0", Severity.WARN, "Xid 13 Graphics Engine Exception", Action.RESTART_APP,
                  {"code": 13})
    n.run("xid", app)
    assert (n.level(), n.action()) == (Level.UNHEALTHY, Action.RESTART_APP)
    n.run("xid", Finding("xid", "gpu/0", Severity.OK, "quiet"))
    assert n.level() is Level.HEALTHY


def test_a_fault_no_longer_reported_by_a_completed_run_clears() -> None:
    n = Node()
    app = Finding("xid", "gpu/0", Severity.WARN, "Xid 13", Action.RESTART_APP, {"code": 13})
    cables = Finding("xid", "nvlink/1/2", Severity.WARN, "Xid 149 NETIR_BER_EVENT Nonfatal",
                     Action.CHECK_CABLES, {"code": 149})
    n.run("xid", app, cables)
    # a hung or raising run vouches for nothing
    n.run("xid", Finding("xid", NODE, Severity.FAIL, "hung after 10 s in read", Action.NONE),
          complete=False)
    assert n.action("gpu/0") is Action.RESTART_APP
    # nor does a completed run that could not say
    n.run("xid", Finding("xid", NODE, Severity.UNKNOWN, "kernel log unreadable: EIO"))
    assert n.action("gpu/0") is Action.RESTART_APP
    assert n.level(NODE) is Level.DEGRADED
    # the hang and the unknown are there (degraded: no remedy) until the check runs cleanly
    n.run("xid", cables)  # Xid 13 went quiet after an hour: the check stops reporting it
    assert n.state.component("gpu/0").level is Level.HEALTHY
    assert n.state.component(NODE).level is Level.HEALTHY
    assert n.action() is Action.CHECK_CABLES
    n.run("xid", xid_ok())
    assert n.level() is Level.HEALTHY


def test_warnings_and_failures_without_a_remedy_are_degraded_not_unhealthy() -> None:
    n = Node()
    n.run("throttle", Finding("throttle", "gpu/4", Severity.WARN, "clocks reduced by SW_THERMAL"))
    assert (n.level("gpu/4"), n.level()) == (Level.DEGRADED, Level.DEGRADED)
    # a hung probe is a failure with no remedy: it must not take the node out (#911)
    n.run("ib", Finding("ib", NODE, Severity.FAIL, "hung after 2 s in read", Action.NONE), complete=False)
    assert n.level() is Level.DEGRADED and n.action() is Action.NONE
    n.run("throttle", Finding("throttle", "gpu/4", Severity.OK, "no hardware slowdown"))
    n.run("ib", Finding("ib", "ib/mlx5_0/1", Severity.OK, "up"))
    assert n.level() is Level.HEALTHY


# -- operator override ----------------------------------------------------------------------


def test_inspect_hardware_is_closed_only_by_set_healthy() -> None:
    n = Node()
    slow = Finding("throttle", "gpu/5", Severity.FAIL, "GPU 5 clocks held down by HW_SLOWDOWN",
                   Action.INSPECT_HARDWARE)
    n.run("throttle", slow)
    n.run("throttle", Finding("throttle", "gpu/5", Severity.OK, "no hardware slowdown"))
    n.reboot(B2)
    n.retest()
    assert n.action("gpu/5") is Action.INSPECT_HARDWARE
    n.set_healthy("gpu/5")
    assert n.level() is Level.HEALTHY
    # history is kept, with who and why
    kinds = [e.kind for e in n.state.history("gpu/5")]
    assert kinds[0] is EventKind.FINDING and EventKind.SET_HEALTHY in kinds
    assert n.state.history("gpu/5")[-1].payload == {"who": "alice", "reason": "replaced the GPU"}


def test_set_healthy_accepts_the_findings_repeated_now_but_not_new_ones() -> None:
    n = Node()
    bursts = Finding("xid", "gpu/6", Severity.FAIL, "Xid 13 on gpu/6 (9 lines): 3 separate bursts",
                     Action.INSPECT_HARDWARE, {"code": 13})
    n.run("xid", bursts)
    n.set_healthy("gpu/6")
    assert n.run("xid", bursts) == []  # xid repeats it all boot long: accepted
    assert n.level() is Level.HEALTHY
    n.run("xid", Finding("xid", "gpu/6", Severity.FAIL, "Xid 13 on gpu/6 (12 lines): 4 separate bursts",
                         Action.INSPECT_HARDWARE, {"code": 13}))
    assert n.action("gpu/6") is Action.INSPECT_HARDWARE
    n.set_healthy()
    # the same words in a new boot are a new fault
    n.reboot(B2)
    n.run("xid", bursts)
    assert n.action("gpu/6") is Action.INSPECT_HARDWARE


def test_set_healthy_on_a_component_leaves_the_others() -> None:
    n = Node()
    n.run("xid", xid79("gpu/3"), xid79("gpu/4"))
    n.set_healthy("gpu/3")
    assert n.level("gpu/3") is Level.HEALTHY
    assert n.level("gpu/4") is Level.UNHEALTHY and n.level() is Level.UNHEALTHY
    n.set_healthy()
    assert n.level() is Level.HEALTHY


# -- node level -----------------------------------------------------------------------------


def test_worst_action_wins_across_gpus_at_node_level() -> None:
    n = Node()
    app = Finding("xid", "gpu/0", Severity.WARN, "Xid 13", Action.RESTART_APP, {"code": 13})
    dbe = Finding("xid", "gpu/1", Severity.FAIL, "Xid 48", Action.RESET_GPU, {"code": 48})
    n.run("xid", app, dbe)
    n.run("throttle", Finding("throttle", "gpu/2", Severity.WARN, "SW thermal"))
    assert n.action() is Action.RESET_GPU
    since = n.state.node().since
    n.run("xid", xid79("gpu/7"), app, dbe)
    node = n.state.node()
    assert (node.level, node.action) == (Level.UNHEALTHY, Action.REBOOT_NODE)
    assert node.since > since
    assert [f.component for f in node.why][:2] == ["gpu/7", "gpu/1"]  # worst first
    assert {c: h.level for c, h in n.state.components().items()} == {
        "gpu/0": Level.UNHEALTHY, "gpu/1": Level.UNHEALTHY, "gpu/2": Level.DEGRADED,
        "gpu/7": Level.UNHEALTHY}


def test_since_moves_only_when_the_state_changes() -> None:
    n = Node()
    w = Finding("throttle", "gpu/4", Severity.WARN, "clocks reduced by SW_THERMAL")
    n.run("throttle", w)
    since = n.state.component("gpu/4").since
    for _ in range(5):
        n.run("throttle", w)
    n.run("throttle", Finding("throttle", "gpu/4", Severity.WARN, "clocks reduced by SW_THERMAL, SW_POWER"))
    assert n.state.component("gpu/4").since == since
    assert n.state.component("gpu/4").why[0].last_seen == n.t


def test_quarantine_until_release() -> None:
    n = Node()
    n.run("xid", xid79())
    n.apply(quarantine_event(time=n.tick(), boot_id=B1, by="gpumon", reason="xid 79",
                             action=Action.REBOOT_NODE))
    node = n.state.node()
    assert node.level is Level.QUARANTINED and node.action is Action.REBOOT_NODE
    assert node.quarantine is not None and node.quarantine.by == "gpumon"
    n.reboot(B2)
    n.retest()
    # healthy again, but still out until the remediator puts it back
    assert n.level() is Level.QUARANTINED and n.action() is Action.NONE
    n.apply(release_event(time=n.tick(), boot_id=B2, by="gpumon", reason="retest passed"))
    assert n.level() is Level.HEALTHY


# -- what is stored ---------------------------------------------------------------------------


def test_identical_repeats_are_not_stored() -> None:
    n = Node()
    gpus = [Finding("throttle", f"gpu/{i}", Severity.OK, "no hardware slowdown", evidence={"t": i})
            for i in range(8)]
    first = n.run("throttle", *gpus)
    assert len(first) == 8  # every component is known once checked
    hot = Finding("throttle", "gpu/3", Severity.WARN, "clocks reduced by SW_THERMAL", evidence={"c": 1})
    assert len(n.run("throttle", hot, *gpus[:3], *gpus[4:])) == 1
    for i in range(1000):
        warm = Finding("throttle", "gpu/3", Severity.WARN, "clocks reduced by SW_THERMAL",
                       evidence={"c": i})  # readings change every run: not news
        assert n.run("throttle", warm, *gpus[:3], *gpus[4:]) == []
    assert len(n.run("throttle", *gpus)) == 1  # the ok that clears it
    assert n.run("throttle", *gpus) == []


def test_history_is_bounded_per_component() -> None:
    n = Node(HealthPolicy(history_per_component=5))
    for i in range(20):
        # each run a transition (severity flips): new words alone are a refresh, not history
        n.run("throttle", Finding("throttle", "gpu/0", Severity.WARN if i % 2 else Severity.FAIL, f"w{i}"))
    assert len(n.state.history("gpu/0")) == 5
    assert n.state.history("gpu/0", 2)[-1].payload["message"] == "w19"


def test_snapshot_round_trip() -> None:
    n = Node()
    n.run("xid", xid79(), Finding("xid", "gpu/0", Severity.WARN, "Xid 13", Action.RESTART_APP, {"code": 13}))
    n.reboot(B2)
    n.apply(quarantine_event(time=n.tick(), boot_id=B2, by="gpumon", reason="r"))
    restored = HealthState.from_snapshot(n.state.to_snapshot())
    assert restored.to_snapshot() == n.state.to_snapshot()
    assert restored.node() == n.state.node()
    assert restored.components() == n.state.components()


# -- properties -------------------------------------------------------------------------------

CHECKS = ["xid", "throttle"]
COMPONENTS = [NODE, "gpu/0", "gpu/1", "nvlink/0/1"]
KEYS = ["", "79", "13"]
BOOTS = ["b1", "b2", "b3"]


@st.composite
def findings(draw: st.DrawFn, check: str | None = None) -> Finding:
    ev: dict[str, Any] = {}
    key = draw(st.sampled_from(KEYS))
    if key:
        ev["code"] = key
    return Finding(check or draw(st.sampled_from(CHECKS)), draw(st.sampled_from(COMPONENTS)),
                   draw(st.sampled_from(list(Severity))), draw(st.sampled_from(["m1", "m2"])),
                   draw(st.sampled_from(list(Action))), ev)


@st.composite
def events(draw: st.DrawFn) -> list[Event]:
    out: list[Event] = []
    t = 0.0
    for _ in range(draw(st.integers(0, 40))):
        t += draw(st.floats(0, 5e6, allow_nan=False))
        boot = draw(st.sampled_from(BOOTS))
        comp = draw(st.sampled_from(COMPONENTS))
        kind = draw(st.sampled_from(list(EventKind)))
        if kind is EventKind.FINDING:
            e = finding_event(draw(findings()), time=t, boot_id=boot)
        elif kind is EventKind.RESOLVED:
            e = Event(t, kind, comp, draw(st.sampled_from(CHECKS)), boot,
                      {"key": draw(st.sampled_from(KEYS))})
        elif kind is EventKind.BOOT:
            e = boot_event(boot, time=t)
        elif kind is EventKind.RETEST_PASSED:
            e = retest_passed_event(comp, time=t, boot_id=boot, check=draw(st.sampled_from(["", *CHECKS])))
        elif kind is EventKind.REMEDIATION:
            e = remediation_event(draw(st.sampled_from(list(Action))), comp, time=t, boot_id=boot, by="x")
        elif kind is EventKind.SET_HEALTHY:
            e = set_healthy_event(comp, time=t, boot_id=boot, who="w", reason="r")
        elif kind is EventKind.QUARANTINE:
            e = quarantine_event(time=t, boot_id=boot, by="gpumon", reason="r")
        else:
            e = release_event(time=t, boot_id=boot, by="gpumon", reason="r")
        out.append(e)
    return out


def _essence(state: HealthState) -> dict[str, Any]:
    """The state less what identical repeats only refresh (last_seen, evidence, event ids)."""
    snap = state.to_snapshot()
    for f in snap["faults"]:
        for k in ("last_seen", "evidence", "event_id"):
            f.pop(k)
    snap["faults"].sort(key=lambda f: (f["check"], f["component"], f["key"]))
    snap.pop("last_event_time")
    snap.pop("last_event_id")
    snap.pop("marks")
    snap["node"] = snap["node"][:2]
    return snap


@given(events())
def test_fold_never_raises_and_the_node_is_never_better_than_its_worst_component(seq: list[Event]) -> None:
    state = HealthState()
    for e in seq:
        state.apply(e)
        node = state.node()
        for c in state.components().values():
            assert node.level >= c.level and node.action >= c.action
        assert all(c.level is not Level.QUARANTINED for c in state.components().values())
        assert (node.level is Level.QUARANTINED) == (state.quarantine is not None)
        if node.level is not Level.QUARANTINED:
            assert node.level is max((c.level for c in state.components().values()), default=Level.HEALTHY)
    state.view().to_json()


@given(events(), st.integers(0, 40))
def test_a_snapshot_plus_the_later_events_is_the_whole_fold(seq: list[Event], cut: int) -> None:
    whole = fold(seq)
    head = HealthState.from_snapshot(fold(seq[:cut]).to_snapshot())
    for e in seq[cut:]:
        head.apply(e)
    assert head.to_snapshot() == whole.to_snapshot()
    assert head.node() == whole.node() and head.components() == whole.components()


@given(events(), st.sampled_from(CHECKS), st.lists(findings(), max_size=6), st.booleans(),
       st.sampled_from(BOOTS))
def test_observing_stores_only_changes(seq: list[Event], check: str, run: Sequence[Finding], complete: bool,
                                       boot: str) -> None:
    t = (seq[-1].time if seq else 0.0) + 1.0
    # the daemon records a new boot before anything else of that boot (Health.open)
    seq = [*seq, boot_event(boot, time=t)]
    state = fold(seq)
    run = [Finding(check, f.component, f.severity, f.message, f.action, f.evidence) for f in run]
    obs = state.observe(check, run, complete=complete, time=t, boot_id=boot)
    # what the daemon stores gives the same state as storing every finding would
    everything = fold(seq)
    for f in run:
        if f.severity is not Severity.SKIPPED:
            everything.apply(finding_event(f, time=t, boot_id=boot))
    for e in obs.events:
        state.apply(e)
        if e.kind is EventKind.RESOLVED:
            everything.apply(e)
    for fid in obs.seen:  # the same severity and action in other words: refreshed, not stored
        state.touch(fid, t, obs.words[fid])
    # (a run that says two things about one fault, or ok and not ok about one component,
    # is summarised by observe: storing it all would keep whichever came last)
    fids = [(f.component, fault_key(f)) for f in run if f.severity not in (Severity.OK, Severity.SKIPPED)]
    oks = {f.component for f in run if f.severity is Severity.OK}
    if len(set(fids)) == len(fids) and not oks & {c for c, _ in fids}:
        assert _essence(state) == _essence(everything)
    # and the same run again adds nothing
    assert state.observe(check, run, complete=complete, time=t + 1, boot_id=boot).events == []


# -- issue 14: transitions, not every new number ----------------------------------------------


def ib_port(severity: Severity, message: str, outages: int, action: Action = Action.CHECK_CABLES) -> Finding:
    if severity is Severity.OK:
        action = Action.NONE
    return Finding("ib", "ib/mlx5_2/1", severity, message, action, {"outages": outages})


def test_new_words_with_the_same_severity_and_action_refresh_the_fault_without_an_event() -> None:
    n = Node()
    n.run("ib", ib_port(Severity.OK, "up", 0))
    assert len(n.run("ib", ib_port(Severity.WARN, "down now for 0.0 s", 1))) == 1
    for i in range(1, 7):
        assert n.run("ib", ib_port(Severity.WARN, f"down now for {i}.0 s", 1)) == []
    (fault,) = n.state.component("ib/mlx5_2/1").why
    assert fault.message == "down now for 6.0 s" and fault.last_seen == n.t
    assert len(n.run("ib", ib_port(Severity.FAIL, "down for 7.1 s now", 1))) == 1  # a transition
    assert n.run("ib", ib_port(Severity.FAIL, "an outage of 10.0 s in the last 24 h", 1)) == []
    assert n.state.component("ib/mlx5_2/1").why[0].message == "an outage of 10.0 s in the last 24 h"
    assert [e.payload["message"] for e in n.state.history("ib/mlx5_2/1")] == [
        "up", "down now for 0.0 s", "down for 7.1 s now"]


def test_new_words_after_a_remedy_are_news() -> None:
    """A GPU reset, then the same Xid code again in the same boot (xid says "(2 events)"): the
    fault is back, not refreshed."""
    n = Node()
    dbe = Finding("xid", "gpu/1", Severity.FAIL, "Xid 48 on gpu/1", Action.RESET_GPU, {"code": 48})
    n.run("xid", dbe)
    n.reset("gpu/1")
    assert n.run("xid", dbe) == []  # xid repeating what it said before the reset
    assert n.state.component("gpu/1").why[0].remediated is not None
    again = Finding("xid", "gpu/1", Severity.FAIL, "Xid 48 on gpu/1 (2 events)", Action.RESET_GPU,
                    {"code": 48})
    assert len(n.run("xid", again)) == 1
    assert n.state.component("gpu/1").why[0].remediated is None


def test_a_blip_that_stays_ok_is_stored_then_at_most_every_ten_minutes() -> None:
    n = Node()
    assert len(n.run("ib", ib_port(Severity.OK, "up", 0))) == 1  # first seen
    assert n.run("ib", ib_port(Severity.OK, "up", 0)) == []
    blip = n.run("ib", ib_port(Severity.OK, "up; 1 outage(s) in the window", 1))
    assert len(blip) == 1 and blip[0].payload["evidence"]["outages"] == 1
    assert n.run("ib", ib_port(Severity.OK, "up; 1 outage(s) in the window", 1)) == []
    # a port that micro-flaps: one row per 10 minutes, the count in its evidence
    assert n.run("ib", ib_port(Severity.OK, "up; 2 outage(s) in the window", 2)) == []
    n.tick(600)
    later = n.run("ib", ib_port(Severity.OK, "up; 5 outage(s) in the window", 5))
    assert len(later) == 1 and later[0].payload["evidence"]["outages"] == 5
    assert n.level("ib/mlx5_2/1") is Level.HEALTHY
    # the count survives a snapshot: the same count again is no news
    restored = HealthState.from_snapshot(n.state.to_snapshot())
    assert restored.observe("ib", [ib_port(Severity.OK, "up; 5 outage(s) in the window", 5)], complete=True,
                            time=n.tick(), boot_id=B1).events == []
