"""Faults rendered into a simulated node while its daemon watches it.

A scenario's ``at_s`` counts from the simulated node's start, not from when its daemon begins to
watch: on a busy machine a daemon can take seconds to start, and a fault timed in the scenario can
come and go before any check runs. A test that needs the daemon to see a fault whole renders it
here, once the daemon is up: the fault is appended to the node's scenario file at the node's
scenario time now and the node is rendered there with the simulator's own renderer (what the
daemon's clock would have rendered had the fault been in the scenario from the start). The daemon's
own clock, whose scenario has no change at that time, does not render over it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gpumon.sim.render import SimNode
from gpumon.sim.scenario import load_scenario


def _rewrite(scenario: Path, sim_dir: Path, change: Callable[[list[dict[str, Any]], float], dict[str, Any]],
             skew: float) -> dict[str, Any]:
    data = yaml.safe_load(scenario.read_text())
    start = float(json.loads((sim_dir / "sim.json").read_text())["start_wall"])
    t = time.time() + skew - start
    data["faults"] = list(data.get("faults") or [])
    written = change(data["faults"], t)
    scenario.write_text(yaml.safe_dump(data))
    sim = SimNode(load_scenario(str(scenario)), sim_dir, resume=True)
    assert sim.resumed, f"the daemon's node is not in {sim_dir}"
    sim.render(t)
    return dict(written)


def start_fault(scenario: Path, sim_dir: Path, fault: dict[str, Any], skew: float = 0.0) -> dict[str, Any]:
    """Append ``fault`` at the node's scenario time now (on its own clock, ``skew`` ahead of ours)
    and render it; the fault as written. (Its time is rounded down: a fault a few ms after the time
    rendered would not show yet.)"""
    def add(faults: list[dict[str, Any]], t: float) -> dict[str, Any]:
        faults.append({**fault, "at_s": math.floor(t * 100) / 100})
        return faults[-1]
    return _rewrite(scenario, sim_dir, add, skew)


def end_fault(scenario: Path, sim_dir: Path, kind: str, skew: float = 0.0) -> None:
    """The last fault of ``kind`` ends now (its duration set to now), rendered."""
    def end(faults: list[dict[str, Any]], t: float) -> dict[str, Any]:
        f: dict[str, Any] = next(f for f in reversed(faults) if f["kind"] == kind)
        # rounded down, or the fault would still be on at the time rendered
        f["duration_s"] = max(0.01, math.floor((t - float(f["at_s"])) * 100) / 100)
        return f
    _rewrite(scenario, sim_dir, end, skew)
