"""The job a post-mortem is about: its nodes and its window, from Slurm or from the command line.

Slurm: ``sacct`` first (the accounting database keeps finished jobs; ``-X`` the allocation, not
its steps), ``scontrol show job`` when sacct is missing or has no accounting storage (it knows a
job only for ``MinJobAge`` after its end, 300 s by default), or has no end for the job yet while
the controller has one. ``source`` says which answered.
Slurm prints times in the controller's local time without a zone: they are read as this host's
local time (run ``why`` where Slurm's clients run, as the epilog does).

Kubernetes (a Job's or a PyTorchJob's pods): gpumon.why.kube.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from gpumon.errors import GpumonError, HwCondition
from gpumon.hw.tools import ToolRunner

SLURM_TIMEOUT_S = 20.0  # as gpumon.remediate.slurm: above Slurm's own client retry
_SACCT_FIELDS = ("JobID", "State", "ExitCode", "Start", "End", "NodeList")
_JOB_ID = re.compile(r"\d+(?:_\d+)?(?:\+\d+)?\Z")
_UNKNOWN_TIMES = frozenset({"", "Unknown", "None", "N/A"})
# A job that ended in one of these failed: the post-mortem looks for the cause of a failure
FAILED_STATES = frozenset({"FAILED", "NODE_FAIL", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "BOOT_FAIL",
                           "DEADLINE", "PREEMPTED"})


class JobError(GpumonError):
    """The job cannot be resolved (no such job, Slurm unreachable, a bad time)."""


@dataclass(frozen=True)
class Job:
    nodes: tuple[str, ...]
    start: float
    end: float | None  # None: still running (the window ends now)
    id: str | None = None
    state: str | None = None
    exit_code: str | None = None
    source: str = "command line"
    # Slurm prints whole seconds (the start and end it says are floored): the job ran until up
    # to this long after ``end``; an event in that second is the job's
    resolution_s: float = 0.0
    # what the source said beyond nodes and times (pods never scheduled, which container exited how)
    notes: tuple[str, ...] = ()
    # a source that says whether the job failed (Kubernetes: its Failed / Complete / Succeeded
    # condition; a pod's non-zero exit before a retry that succeeded is no failure of the job)
    ended_failed: bool | None = None

    @property
    def failed(self) -> bool | None:
        if self.ended_failed is not None:
            return self.ended_failed
        if self.state is None or self.source.startswith("kubernetes"):
            return None
        # "CANCELLED by 1000": the first word is the state
        return self.state.split()[0] in FAILED_STATES or self.exit_code not in (None, "0:0")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "nodes": list(self.nodes), "start": self.start, "end": self.end,
                "state": self.state, "exit_code": self.exit_code, "source": self.source,
                "failed": self.failed, "notes": list(self.notes)}


def parse_time(text: str, what: str) -> float:
    """Unix seconds, or an ISO 8601 / RFC 3339 time; one without a zone is this host's local time."""
    value = text.strip()
    try:
        return float(value)
    except ValueError:
        pass
    iso = value[:-1] + "+00:00" if value[-1:] in ("Z", "z") else value
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        raise JobError(f"{what} {text!r}: not Unix seconds nor an ISO 8601 time "
                       "(2024-06-10T06:13:20Z, or local time without the Z)") from None


def explicit_job(nodes: str, start: str, end: str | None) -> Job:
    names = tuple(dict.fromkeys(n.strip() for n in nodes.split(",") if n.strip()))
    if not names:
        raise JobError("--nodes names no node")
    t0 = parse_time(start, "--start")
    t1 = parse_time(end, "--end") if end else None
    if t1 is not None and t1 < t0:
        raise JobError("--end is before --start")
    return Job(names, t0, t1)


def slurm_job(job_id: str, runner: ToolRunner | None = None, timeout_s: float = SLURM_TIMEOUT_S,
              nodes: str | None = None) -> Job:
    """The job from sacct, else scontrol. ``nodes``: the job's allocation as a Slurm hostlist (an
    EpilogSlurmctld's ``$SLURM_JOB_NODELIST``), which replaces the nodes Slurm lists: while a job
    is COMPLETING, ``scontrol show job`` lists only the nodes still completing (at an
    EpilogSlurmctld, often none)."""
    if not _JOB_ID.match(job_id):
        raise JobError(f"--job {job_id!r}: not a Slurm job id (digits, an array task 12_3, a het job 12+1)")
    runner = runner or ToolRunner(timeout_s)
    why_not: list[str] = []
    job: Job | None = None
    try:
        job = _from_sacct(job_id, runner, timeout_s)
    except (HwCondition, JobError) as exc:
        why_not.append(f"sacct: {exc}")
    if job is not None and job.end is None:
        # slurmctld sends a job's records to slurmdbd through a queue: at an EpilogSlurmctld the
        # database may still have the job PENDING or RUNNING, with no end; the controller knows
        with contextlib.suppress(HwCondition, JobError):
            live = _from_scontrol(job_id, runner, timeout_s)
            if live.end is not None:
                job = replace(live, nodes=live.nodes or job.nodes, notes=(
                    f"sacct had job {job_id} {job.state} with no end (the accounting database had not "
                    "recorded its end yet): its end, state and exit code are scontrol's",))
    if job is None:
        try:
            job = _from_scontrol(job_id, runner, timeout_s)
        except (HwCondition, JobError) as exc:
            why_not.append(f"scontrol: {exc}")
    if job is None:
        raise JobError(f"Slurm job {job_id} not found: " + "; ".join(why_not))
    if nodes is not None:
        try:
            given = expand_nodes(nodes, runner, timeout_s)
        except HwCondition as exc:
            raise JobError(f"--job-nodes {nodes!r}: {exc}") from None
        if not given:
            raise JobError(f"--job-nodes {nodes!r} names no node")
        job = replace(job, nodes=given)
    if not job.nodes:
        raise JobError(f"Slurm lists no node for job {job_id} ({job.source}, state {job.state}: a "
                       "completing job lists only the nodes still completing); give --job-nodes HOSTLIST")
    return job


def _run(runner: ToolRunner, argv: list[str], timeout_s: float) -> str:
    result = runner.run(argv, timeout=timeout_s)
    if result.returncode != 0:
        raise JobError((result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}")[:300])
    return result.stdout


def _slurm_time(text: str) -> float | None:
    if text.strip() in _UNKNOWN_TIMES:
        return None
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def expand_nodes(spec: str, runner: ToolRunner, timeout_s: float) -> tuple[str, ...]:
    """A Slurm hostlist (``gpu[01-03],login1``) as names, by Slurm's own ``scontrol show hostnames``."""
    if spec.strip() in ("", "None assigned", "(null)"):
        return ()
    out = _run(runner, ["scontrol", "show", "hostnames", spec], timeout_s)
    return tuple(n.strip() for n in out.splitlines() if n.strip())


def _from_sacct(job_id: str, runner: ToolRunner, timeout_s: float) -> Job:
    out = _run(runner, ["sacct", "--parsable2", "--noheader", "-X", "-j", job_id,
                        "-o", ",".join(_SACCT_FIELDS)], timeout_s)
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    rows = [r for r in rows if len(r) == len(_SACCT_FIELDS) and r[0] == job_id] or \
        [r for r in rows if len(r) == len(_SACCT_FIELDS)]
    if not rows:
        raise JobError("no such job in the accounting database")
    jid, state, exit_code, start, end, nodelist = rows[0]
    t0 = _slurm_time(start)
    if t0 is None:
        raise JobError(f"job {jid} has not started (state {state})")
    return Job(expand_nodes(nodelist, runner, timeout_s), t0, _slurm_time(end), jid, state, exit_code,
               "sacct", 1.0)


def scontrol_fields(text: str) -> dict[str, str]:
    """``scontrol show job -o`` is ``Key=Value`` words; values hold no spaces but for a few
    free-text keys, which come after the ones read here."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and key not in fields:
            fields[key] = value
    return fields


def _from_scontrol(job_id: str, runner: ToolRunner, timeout_s: float) -> Job:
    out = _run(runner, ["scontrol", "show", "job", "-o", job_id], timeout_s)
    fields = scontrol_fields(out)
    if "JobState" not in fields:
        raise JobError("no such job known to the controller")
    t0 = _slurm_time(fields.get("StartTime", ""))
    if t0 is None:
        raise JobError(f"job {job_id} has not started (state {fields['JobState']})")
    end = _slurm_time(fields.get("EndTime", ""))
    if fields["JobState"] in ("RUNNING", "PENDING", "SUSPENDED"):
        end = None  # EndTime of a running job is its time limit, not an end
    return Job(expand_nodes(fields.get("NodeList", ""), runner, timeout_s), t0, end,
               fields.get("JobId", job_id), fields["JobState"], fields.get("ExitCode"), "scontrol", 1.0)
