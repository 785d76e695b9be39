"""What a daemon would export for a simulated node, from ``gpumon check --simulate <scenario> --json -v``
(a child process: the real checks on the simulated node): every check's findings folded into a health
store, and the store's own finding. For the exposition benchmarks (scrape.py, series.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpumon import __version__
from gpumon.export.prometheus import Snapshot
from gpumon.health import Health
from gpumon.model import CheckRun, Finding


def node_snapshot(scenario: str, state_dir: Path) -> Snapshot:
    proc = subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", scenario, "--json", "-v"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 1, 2):
        raise SystemExit(f"gpumon check failed ({proc.returncode}): {proc.stderr}")
    doc = json.loads(proc.stdout)
    findings: dict[str, list[Finding]] = {}
    for f in doc["findings"]:
        findings.setdefault(f["check"], []).append(Finding.from_json(f))
    runs = {c["check"]: CheckRun(c["check"], findings.get(c["check"], []), doc["time"] - c["seconds"],
                                 c["seconds"], c["outcome"]) for c in doc["checks"]}
    health = Health.open(state_dir, boot_id="bench-boot")
    try:
        for run in runs.values():
            health.record_run(run)
        view = health.view()
        store = health.store_finding()
    finally:
        health.close()
    runs[store.check] = CheckRun(store.check, [store], doc["time"], 0.0, "completed")
    states = {name: (c.level.value, c.action.value) for name, c in view.components.items()}
    states["node"] = (view.node.level.value, view.node.action.value)
    return Snapshot(doc["node"], doc["profile"], __version__, runs, states)
