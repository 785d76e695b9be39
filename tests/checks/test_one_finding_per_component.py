"""Every continuous check, on a healthy simulated node: one finding per component per run, and the
same findings run after run (issue 14 #3: the nvswitch check gave ``node`` an ok and a skipped
finding every run, so the daemon logged a change every minute and the exported severity sat at 1).

A check may report several faults on one component, told apart by their ``code`` (Xid 79 and Xid 13
on one GPU: the health state keys faults by it); a healthy node has none, so here every component
has exactly one finding. The first run is a warm-up: a check with a window (throttle) says "no
history yet" once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpumon.model import Finding, Phase
from gpumon.registry import load_checks

HEALTHY = "name: healthy\nsku: h100-sxm\nfaults: []\n"


def _said(findings: list[Finding]) -> list[tuple[str, str, str, str]]:
    return [(f.component, f.severity.value, f.action.value, f.message) for f in findings]


def test_continuous_checks_one_finding_per_component_stable(sim: Any) -> None:
    h = sim(HEALTHY)
    checks = {n: c for n, c in load_checks().items() if c.phase is Phase.CONTINUOUS}
    inventory = h.context(checks["xid"], 1).inventory
    ran = []
    for name, cls in checks.items():
        if cls().supported(inventory) is not None:
            continue
        runs = [h.run(cls, t) for t in (1, 70, 130)]
        for findings in runs:
            assert findings, name
            twice = {c: n for c, n in Counter(f.component for f in findings).items() if n > 1}
            assert not twice, (name, [(f.component, f.severity.value, f.message) for f in findings
                                      if f.component in twice])
            assert all(f.check == name for f in findings)
        assert _said(runs[1]) == _said(runs[2]), name
        ran.append(name)
    # the H100 simulated node has every source these checks read
    assert {"xid", "nvswitch", "throttle", "ib", "nvlink", "pcie", "thermal", "memory", "gpu_presence"} <= \
        set(ran)
