"""fabric: this node's verdict from the last multi-node fabric probe (``gpumon probe-fabric``).

The probe is a multi-node job started by a launcher between jobs (see gpumon/fabric); each node's
lowest rank records the node's finding in the health state and in ``<state_dir>/fabric/latest.json``.
This check reports that result in every run of the node's own checks, so the daemon exports it
(``gpumon_finding_severity{check="fabric"}``, the busbw and p95 readings, the last probe's time) and
a ``gpumon check`` run as a Slurm health check sees it too. The finding stands until the next probe
replaces it (a passing probe clears it); its age is in the evidence. No probe yet: ``skipped``; a
result file that cannot be read: ``unknown`` with the reason. A result file written before the busbw
reading took its base unit (``fabric_busbw_gbps``, GB/s) is reported under today's name in bytes per
second, so one upgrade does not leave the old series on ``/metrics`` until the next probe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.fabric.settings import FabricConfig
from gpumon.model import NODE, UNIT_BYTES_PER_SECOND, Finding, ReadingSpec, Severity

LATEST = Path("fabric") / "latest.json"
MAX_BYTES = 1 << 20  # a result file is a few KiB; anything larger is not ours
# (old name, its unit in bytes per second) -> today's name, for result files written before the rename
RENAMED = {"fabric_busbw_gbps": ("fabric_busbw_bytes_per_second", 1e9)}


class FabricCheck(Check):
    name = "fabric"
    description = "last multi-node fabric probe's verdict on this node (gpumon probe-fabric)"
    readings = (
        ReadingSpec(
            "fabric_busbw_bytes_per_second", "gauge",
            "Bus bandwidth in the last multi-node fabric probe (gpumon probe-fabric) that judged this node: "
            "per collective (label op: all_reduce, all_gather, reduce_scatter, alltoall; sendrecv = the "
            "median of this node's pair exchanges) and size class (label size_class: small, mid, large), "
            "the best over the class's sizes.",
            unit=UNIT_BYTES_PER_SECOND,
            source="gpumon's own timing of the collectives (the slowest rank's median), busbw as nccl-tests "
                   "defines it",
            labels=("op", "size_class")),
        ReadingSpec(
            "fabric_latency_p95_seconds", "gauge",
            "95th-percentile time of one operation in the last fabric probe that judged this node, the "
            "worst over the size class's sizes and ranks (labels op and size_class as "
            "fabric_busbw_bytes_per_second; sendrecv: the median of this node's pair exchanges, small "
            "messages).",
            unit="seconds",
            source="gpumon's own timing of the probe's operations",
            labels=("op", "size_class")),
        ReadingSpec(
            "fabric_last_probe_timestamp_seconds", "gauge",
            "When the last fabric probe that judged this node ran.",
            unit="Unix time in seconds",
            source="the probe's group report (gpumon probe-fabric, rank 0)"),
        ReadingSpec(
            "fabric_last_probe_passed", "gauge",
            "1 if the last fabric probe completed and found nothing wrong with this node, else 0 (a flag).",
            unit=None,
            source="gpumon's judgement of the probe (gpumon probe-fabric, rank 0)"),
        ReadingSpec(
            "fabric_pairs_measured", "gauge",
            "Node pairs of the probe group measured in its pair rotation's current cycle, as of the last "
            "fabric probe that judged this node (a group of up to 16 nodes: in that probe alone).",
            unit="node pairs",
            source="the probe's pair schedule (gpumon/fabric/schedule.py), kept on the group's nodes"),
        ReadingSpec(
            "fabric_pairs_in_group", "gauge",
            "Node pairs of the group of the last fabric probe that judged this node: N(N-1)/2 of its N "
            "nodes (compare fabric_pairs_measured).",
            unit="node pairs",
            source="the probe's group (gpumon probe-fabric, rank 0)"),
        ReadingSpec(
            "fabric_runs_since_full_coverage", "gauge",
            "Probe runs since the last one that completed a cycle with every pair of the group measured "
            "(0: that probe did; since the rotation began if none did).",
            unit="probe runs",
            source="the probe's pair schedule (gpumon/fabric/schedule.py), kept on the group's nodes",
            note="Above fabric_runs_per_coverage_cycle: pairs went unmeasured (nodes away, runs that "
                 "ended early)."),
        ReadingSpec(
            "fabric_runs_per_coverage_cycle", "gauge",
            "The bound: runs in which the group's pair rotation measures every pair of an unchanged group "
            "(1 up to 16 nodes; above, ceil(rounds / coverage_rounds): N-1 rounds, odd N: N).",
            unit="probe runs",
            source="the probe's pair schedule (gpumon/fabric/schedule.py) and checks.fabric.coverage_rounds"),
    )
    interval = 60.0
    timeout = 10.0
    Config = FabricConfig

    def run(self, ctx: CheckContext) -> list[Finding]:
        if ctx.state_dir is None:
            return [self.finding(NODE, Severity.SKIPPED,
                                 "no state directory: fabric probe results not known")]
        path = ctx.state_dir / LATEST
        try:
            with path.open("rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return [self.finding(NODE, Severity.SKIPPED, "no fabric probe has run on this node "
                                 "(gpumon probe-fabric)", path=str(path))]
        except OSError as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot read {path}: {exc.strerror or exc}",
                                 path=str(path))]
        try:
            if len(raw) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES} bytes")
            doc = json.loads(raw.decode("utf-8"))
            finding = Finding.from_json(doc["finding"])
            when = float(doc["time"])
        except (ValueError, KeyError, TypeError) as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"unreadable fabric probe result {path}: {exc}",
                                 path=str(path))]
        if finding.check != self.name or finding.component != NODE:
            return [self.finding(NODE, Severity.UNKNOWN,
                                 f"{path} holds a finding of {finding.check} for {finding.component}",
                                 path=str(path))]
        evidence = {**finding.evidence, "probe_time": when, "age_s": round(max(0.0, ctx.clock() - when), 1),
                    "path": str(path)}
        if isinstance(evidence.get("readings"), list):
            evidence["readings"] = [_current(item) for item in evidence["readings"]]
        return [Finding(self.name, NODE, finding.severity, finding.message, finding.action, evidence)]


def _current(item: Any) -> Any:
    """A reading as this version names it (``RENAMED``); anything else, even malformed, as it is."""
    if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and item[0] in RENAMED
            and isinstance(item[1], int | float) and not isinstance(item[1], bool)):
        name, scale = RENAMED[item[0]]
        return [name, float(item[1]) * scale, item[2]]
    return item
