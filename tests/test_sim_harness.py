"""The simulated-node harness used by the check tests drives the real stack."""

from __future__ import annotations

from typing import Any

from gpumon.model import Severity
from gpumon_checks.throttle import ThrottleCheck
from gpumon_checks.xid import XidCheck

SCENARIO = """
name: harness
sku: h100-sxm
faults:
  - {at_s: 5, kind: throttle, gpu: 2, reasons: [hw_power_brake_slowdown], duration_s: 10}
  - {at_s: 8, kind: xid, gpu: 6, code: 119}
"""


def test_harness_steps_time_through_real_interfaces(sim: Any) -> None:
    h = sim(SCENARIO)
    before = h.run(ThrottleCheck, t=1)
    assert {f.severity for f in before} == {Severity.OK}
    during = {f.component: f for f in h.run(ThrottleCheck, t=6)}
    assert during["gpu/2"].severity is Severity.FAIL
    assert [f.severity for f in h.run(XidCheck, t=7)] == [Severity.OK]
    assert {f.severity for f in h.run(ThrottleCheck, t=20)} == {Severity.OK}
    xid = {f.component: f for f in h.run(XidCheck, t=20)}
    assert xid["gpu/6"].evidence["code"] == 119 and xid["gpu/6"].action.value == "reset_gpu"


def test_replay_times_are_every_change_of_the_node_up_to_the_end() -> None:
    from gpumon.sim.scenario import load_scenario

    faulty = load_scenario("faulty-8xh100")  # faults at 10, 30, 40, 60 (an IB outage to 69)
    assert faulty.replay_times(faulty.horizon_s) == [0.0, 10.0, 30.0, 40.0, 60.0, 69.0, 70.0]
    assert faulty.replay_times(35.0) == [0.0, 10.0, 30.0, 35.0]
    assert faulty.replay_times(5.0) == [5.0]  # nothing happens before 5 s: one reading
    healthy = load_scenario("healthy-8xh100")
    assert healthy.replay_times(healthy.horizon_s) == [healthy.horizon_s]


def test_default_root_is_per_user_and_per_scenario(tmp_path: Any, monkeypatch: Any) -> None:
    from gpumon.sim.render import default_root
    from gpumon.sim.scenario import load_scenario

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_root(load_scenario("faulty-8xh100")) == tmp_path / "gpumon" / "sim" / "faulty-8xh100"
    a, b = tmp_path / "a" / "s.yaml", tmp_path / "b" / "s.yaml"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("name: ../mine\nsku: h100-sxm\n")
    ra, rb = default_root(load_scenario(str(a))), default_root(load_scenario(str(b)))
    assert ra != rb and ra.parent == rb.parent == tmp_path / "gpumon" / "sim"  # never outside it
    assert ra.name.startswith("_.._mine-"), ra
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the spec: relative paths are ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root(load_scenario("faulty-8xh100")) == (
        tmp_path / "home" / ".local" / "state" / "gpumon" / "sim" / "faulty-8xh100")
