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
