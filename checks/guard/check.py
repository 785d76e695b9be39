"""guard: the verdicts that training jobs on this node wrote (``gpumon.guard``), as findings.

A job's ranks write one JSON file per verdict into the spool (``/var/lib/gpumon/guard`` by default;
the job's ``$GPUMON_GUARD_DIR``). Each valid verdict becomes a finding on ``gpu/<index>``, the GPU of
this node's inventory with the verdict's NVML UUID; a verdict from a CPU rank, or with a UUID this
node does not have, goes on ``node`` and says why. ``fault``: persistent -> fail/inspect_hardware
(closed only by an operator's set-healthy, like any RMA-path fault); transient and unknown -> warn;
application (the rerun on another node's GPU reproduced the result: the data or the program, not the
hardware) -> an ok finding on ``node`` that says so: held against no GPU, and never on a GPU's
component (an ok there would close that GPU's other guard faults).

Judged once, lost never, across daemon restarts too:

- a new verdict (a file in the spool's top level) is reported by every run until a LATER run of this
  same daemon process moves it to ``judged/``. Within one process the daemon folds a run's findings
  into the health store before the check runs again, so a moved verdict is in health.db; a daemon
  that dies in between reports the file again after its restart (a repeat is one fault, not two:
  the fault key is the verdict's id);
- once judged, a persistent verdict is no longer reported: its fault stays until set-healthy (a
  reboot does not bring back a fault the operator closed). A transient or unknown one is reported
  for ``warn_hold_s`` after it was written, then resolves like any warning whose condition is gone;
- a file that is not a verdict this gpumon reads (bad JSON, a newer ``version``, or anything the
  verdict's JSON Schema refuses: ``gpumon/guard/schema/verdict-v1.schema.json``, the one the package
  ships, compiled once per process) is left where it is and reported (warn, on ``node``, naming the
  file, what is wrong and, for the schema, the JSON path of the value refused) on every run until
  someone removes or fixes it, or a newer gpumon reads it. Temp files of ``write_atomic``
  (``.<name>.tmp``) are not verdicts yet and are skipped.
"""

from __future__ import annotations

import contextlib
import os
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.guard import verdict as vf
from gpumon.hw.nvml import CLOCK_EVENT_REASONS
from gpumon.hw.placement import normalize_uuid
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

JUDGED = "judged"
# One token per daemon process: a file reported by an earlier run of THIS process is in health.db.
_PROCESS = uuidlib.uuid4().hex


@dataclass(frozen=True)
class GuardConfig:
    spool_dir: str = field(default="", metadata={
        "source": "empty: <host-root>/var/lib/gpumon/guard, the jobs' default ($GPUMON_GUARD_DIR "
                  "unset); the directory must be writable by the jobs (mode 1777, like /tmp)"})
    warn_hold_s: float = field(default=86400.0, metadata={
        "min": 0,
        "source": "argued: a transient or unknown SDC verdict stays visible (health, /metrics) for a "
                  "day, long enough for an operator or the next canary to look, then resolves"})
    pace_max_age_s: float = field(default=900.0, metadata={
        "min": 1,
        "source": "argued: a job's ranks rewrite their node's pace file every window (100 steps by "
                  "default: seconds to minutes); older than 15 min, the job has ended or stalled and its "
                  "scores are not exported"})
    max_files: int = field(default=1000, metadata={
        "min": 1,
        "source": "argued: a job writes one file per named rank per alarm; more than this at once is "
                  "a runaway writer, and reading them all must not cost the daemon its interval"})


class GuardCheck(Check):
    name = "guard"
    phase = Phase.CONTINUOUS
    description = "verdicts of the in-job SDC checks (gpumon.guard) of jobs on this node"
    readings = (
        ReadingSpec(
            "guard_pace_score", "gauge",
            "In-job pace of this node's GPU (label gpu: its index) in the latest window of a guarded "
            "training job (gpumon.guard): the job's median compute per step over all ranks divided by this "
            "GPU's rank's own (forward to its last gradient bucket, plus optimizer.step(); waiting for "
            "other ranks excluded). 1 is the group's pace, 0.5 half speed; below 0.75 (NVIDIA Resiliency "
            "Extension's straggler threshold) in 3 of 5 windows the job names it a straggler.",
            unit="ratio",
            source="the job's pace file in the guard spool, exported while under pace_max_age_s (15 min) old",
            labels=("gpu",)),
        ReadingSpec(
            "guard_pace_slowest_score", "gauge",
            "The lowest guard_pace_score of this node's GPUs: how far the slowest GPU of this node holds "
            "back its guarded training job (1: at the group's pace).",
            unit="ratio",
            source="as guard_pace_score"),
    )
    interval = 10.0
    timeout = 30.0
    Config = GuardConfig

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(GuardConfig)
        spool = (Path(options.spool_dir) if options.spool_dir
                 else ctx.hw.host_root / vf.DEFAULT_DIR.lstrip("/"))
        if not spool.is_dir():
            return [self.ok(NODE, f"no guard verdicts (spool {spool} does not exist)", spool=str(spool))]
        try:
            new = sorted(p for p in spool.iterdir() if _candidate(p))
            judged_dir = spool / JUDGED
            judged = sorted(p for p in judged_dir.iterdir() if _candidate(p)) if judged_dir.is_dir() else []
        except OSError as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot list the guard spool {spool}: {exc}",
                                 spool=str(spool))]
        try:
            vf.validator()
        except Exception as exc:  # a broken install: judging no file beats calling every file bad
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot load the guard verdict schema "
                                 f"({vf.SCHEMA_PACKAGE}/{vf.SCHEMA_FILE}): {type(exc).__name__}: {exc}; "
                                 "the spool is not read (reinstall gpumon)", spool=str(spool))]
        now = ctx.clock()
        by_uuid = {normalize_uuid(g.uuid): g.index for g in ctx.inventory.gpus}
        reported: dict[str, str] = dict(ctx.state.get("reported", {}))
        out: list[Finding] = []
        dropped = max(0, len(new) - options.max_files)
        still: dict[str, str] = {}
        for path in new[:options.max_files]:
            try:
                verdict = vf.read(path)
            except (vf.VerdictError, OSError) as exc:
                out.append(self._bad_file(path, exc))
                continue
            if reported.get(path.name) == _PROCESS and self._judge(path, judged_dir):
                moved = judged_dir / path.name
                if _holds(verdict, now, options.warn_hold_s):
                    out.append(self._finding(verdict, moved, by_uuid))
                continue
            out.append(self._finding(verdict, path, by_uuid))
            still[path.name] = _PROCESS
        for path in judged:
            # cheap first: a file moved long ago cannot hold a warning any more
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > options.warn_hold_s + 3600 and path.stat().st_mtime < now:
                    continue
            try:
                verdict = vf.read(path)
            except (vf.VerdictError, OSError):
                continue  # it was valid when judged; a file changed since is not news for health
            if _holds(verdict, now, options.warn_hold_s):
                out.append(self._finding(verdict, path, by_uuid))
        ctx.state["reported"] = still
        for f in out:
            if f.evidence.get("verdict_check") == "straggler" and f.component != NODE:
                assert isinstance(f.evidence, dict)
                f.evidence["node_signals"] = _signals(ctx, int(f.component.split("/")[1]))
        if dropped:
            out.append(self.finding(NODE, Severity.WARN,
                                    f"{dropped} more guard verdict files than the {options.max_files} read "
                                    f"per run are waiting in {spool}: read on later runs",
                                    spool=str(spool), waiting=dropped, fault_key="spool-backlog"))
        if not out:
            out.append(self.ok(NODE, f"no guard verdicts to report (spool {spool})", spool=str(spool)))
        pace = _pace(spool / vf.PACE_DIR, by_uuid, now, options.pace_max_age_s)
        if pace:
            slowest = min(pace, key=lambda kv: kv[1])
            readings = [reading("guard_pace_score", score, gpu=index) for index, score in sorted(pace)]
            readings.append(reading("guard_pace_slowest_score", slowest[1]))
            said = f"in-job pace of {len(pace)} GPU(s): slowest GPU {slowest[0]} at {slowest[1]:.2f}"
            node_finding = next((f for f in out if f.component == NODE), None)
            if node_finding is None:
                out.append(self.ok(NODE, said, readings=readings, spool=str(spool)))
            else:
                assert isinstance(node_finding.evidence, dict)
                node_finding.evidence["readings"] = [*node_finding.evidence.get("readings", []), *readings]
        return out

    def _judge(self, path: Path, judged_dir: Path) -> bool:
        try:
            judged_dir.mkdir(exist_ok=True)
            os.replace(path, judged_dir / path.name)
        except OSError:
            return False  # left in place: reported again, moved on a later run
        return True

    def _bad_file(self, path: Path, exc: Exception) -> Finding:
        future = isinstance(exc, vf.FutureVerdict)
        what = "a newer guard's verdict" if future else "not a guard verdict this gpumon reads"
        said: dict[str, Any] = {}
        if isinstance(exc, vf.SchemaViolation):
            said = {"schema": vf.SCHEMA_ID, "schema_error_path": exc.where, "schema_rule": exc.rule}
        return self.finding(NODE, Severity.WARN, f"guard spool file {path}: {what}: {exc}; left in place "
                            "(remove or fix it; it is read again every run)", file=str(path),
                            error=str(exc), fault_key=f"file:{path.name}", **said)

    def _finding(self, v: vf.Verdict, path: Path, by_uuid: dict[str | None, int]) -> Finding:
        s = v.subject
        if v.fault == "application":
            job = f"job {v.job}, " if v.job else ""
            return self.ok(NODE, f"in-job SDC check {v.check} ({job}application: not a hardware fault, no "
                                 f"GPU held responsible) from rank {s.rank} on {s.host}: {v.message}",
                           verdict_file=str(path), verdict_check=v.check, fault=v.fault, step=v.step,
                           job=v.job, rank=s.rank, gpu_uuid=s.gpu_uuid, verdict_evidence=v.evidence)
        key = normalize_uuid(s.gpu_uuid)
        index = by_uuid.get(key) if key else None
        if index is not None:
            component, where = gpu(index), f"GPU {index} ({s.gpu_uuid})"
        elif key:
            component = NODE
            where = (f"GPU {s.gpu_uuid}, which is not one of this node's GPUs (written on host "
                     f"{s.host}: a spool shared between nodes, or a GPU gone from NVML)")
        else:
            component, where = NODE, f"this node, not a GPU ({s.gpu_note or f'device {s.device}'})"
        if v.fault == "persistent":
            severity, action = Severity.FAIL, Action.INSPECT_HARDWARE
        else:
            severity, action = Severity.WARN, Action.NONE
        job = f"job {v.job}, " if v.job else ""
        message = f"in-job SDC check {v.check} ({job}{v.fault}) on {where}: {v.message}"
        if v.check == "straggler":
            message = (f"in-job straggler ({job.rstrip(', ') or 'a job'}) on {where}: {v.message}; "
                       "compare this GPU's throttle, thermal, pcie and nvlink findings (node_signals in "
                       "the evidence: read when the verdict was judged)")
        evidence: dict[str, Any] = {
            "fault_key": v.id, "verdict_file": str(path), "verdict_check": v.check, "fault": v.fault,
            "step": v.step, "job": v.job, "time": v.time, "rank": s.rank, "world_size": s.world_size,
            "host": s.host, "node_name": s.node_name, "local_rank": s.local_rank, "device": s.device,
            "gpu_uuid": s.gpu_uuid, "gpu_pci_bus_id": s.gpu_pci_bus_id, "verdict_evidence": v.evidence}
        return self.finding(component, severity, message, action, **evidence)


def _signals(ctx: CheckContext, index: int) -> dict[str, Any]:
    """What this node's hardware says of a GPU a job called slow: throttle reasons, temperature,
    PCIe link against its maximum, NVLink links up. Each reading bounded; one that fails says why."""
    nvml = ctx.hw.nvml

    def reasons() -> list[str]:
        mask = nvml.clocks_event_reasons(index)
        return [n for n, bit in CLOCK_EVENT_REASONS.items() if mask & bit and n != "gpu_idle"]

    def pcie() -> dict[str, Any]:
        link = nvml.pcie_link(index)
        return {"generation": link.generation, "max_generation": link.max_generation, "width": link.width,
                "max_width": link.max_width,
                "degraded": link.width < link.max_width or link.generation < link.max_generation}

    def nvlink() -> str:
        n = nvml.nvlink_count(index)
        return f"{sum(nvml.nvlink_state(index, i) for i in range(n))}/{n}"

    out: dict[str, Any] = {}
    for key, fn in (("clock_event_reasons", reasons), ("temperature_c", lambda: nvml.temperature_c(index)),
                    ("pcie_link", pcie), ("nvlink_up", nvlink)):
        try:
            out[key] = fn()
        except Exception as exc:  # a signal that cannot be read is said, never a crash of the check
            out[key] = f"unreadable: {type(exc).__name__}: {exc}"
    return out


def _pace(directory: Path, by_uuid: dict[str | None, int], now: float,
          max_age_s: float) -> list[tuple[int, float]]:
    """(GPU index, pace score) of this node's GPUs from fresh pace files (the newest file per GPU)."""
    if not directory.is_dir():
        return []
    newest: dict[int, tuple[float, float]] = {}
    try:
        files = sorted(directory.glob("*.json"))[:200]
    except OSError:
        return []
    for path in files:
        try:
            when, _, rows = vf.read_pace(path)
        except (vf.VerdictError, OSError):
            continue
        if now - when > max_age_s:
            continue
        for row in rows:
            index = by_uuid.get(normalize_uuid(row.gpu_uuid)) if row.gpu_uuid else None
            if index is not None and (index not in newest or newest[index][0] < when):
                newest[index] = (when, row.pace)
    return [(i, score) for i, (_, score) in newest.items()]


def _candidate(path: Path) -> bool:
    return path.name.endswith(".json") and not path.name.startswith(".") and path.is_file()


def _holds(v: vf.Verdict, now: float, hold_s: float) -> bool:
    """A judged verdict is still reported: a warning within its hold (a persistent one lives on in
    the health state by itself; an application one was never a fault)."""
    return v.fault in ("transient", "unknown") and now - v.time < hold_s
