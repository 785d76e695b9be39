"""``why --job`` when the accounting database lags the controller: at an EpilogSlurmctld, sacct may
still have the job PENDING with no end while scontrol already has it COMPLETING with its end.

The tools' outputs are those of the first job of a fresh Slurm 22.05.8 cluster with slurmdbd
(tests/fabric/slurm_cluster.py, accounting=True), printed by an EpilogSlurmctld that ran sacct and
scontrol at its start (2026-12-03); a second job's epilog, 7 s later, already read it FAILED from
sacct. Here they are served by stand-in sacct and scontrol executables on the runner's search path,
so gpumon's own tool runner runs them as it runs Slurm's."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from gpumon.hw.tools import ToolRunner
from gpumon.why.job import slurm_job

SACCT_PENDING = "1|PENDING|0:0|2026-12-03T09:09:51|Unknown|node[0-1]"
SACCT_FAILED = "1|FAILED|3:0|2026-12-03T09:09:51|2026-12-03T09:09:53|node[0-1]"
SCONTROL = (
    "JobId=1 JobName=sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=root QOS=normal JobState=COMPLETING Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=0 Reboot=0 ExitCode=3:0 RunTime=00:00:02 TimeLimit=00:02:00 TimeMin=N/A "
    "SubmitTime=2026-12-03T09:09:51 EligibleTime=2026-12-03T09:09:51 AccrueTime=Unknown "
    "StartTime=2026-12-03T09:09:51 EndTime=2026-12-03T09:09:53 Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-12-03T09:09:51 Scheduler=Main Partition=fabric "
    "AllocNode:Sid=0.0.0.0:9722 ReqNodeList=(null) ExcNodeList=(null) NodeList= BatchHost=node0 "
    "NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1")


def _tools(tmp_path: Path, sacct: str, scontrol_job: str | None) -> ToolRunner:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "sacct").write_text(f"#!/bin/sh\necho '{sacct}'\n")
    job = (f"echo '{scontrol_job}'" if scontrol_job is not None
           else "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        '"show hostnames") echo node0; echo node1 ;;\n'
        f'"show job") {job} ;;\n'
        "*) exit 2 ;;\n"
        "esac\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return ToolRunner(5.0, search_path=str(bin_dir))


def _t(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_a_job_sacct_has_not_seen_end_takes_its_end_from_the_controller(tmp_path: Path) -> None:
    job = slurm_job("1", _tools(tmp_path, SACCT_PENDING, SCONTROL))
    assert job.source == "scontrol" and job.state == "COMPLETING" and job.exit_code == "3:0"
    assert (job.start, job.end) == (_t("2026-12-03T09:09:51"), _t("2026-12-03T09:09:53"))
    # a completing job lists no node at the controller: the allocation is sacct's
    assert job.nodes == ("node0", "node1")
    assert job.failed is True
    assert job.notes and "had not recorded its end yet" in job.notes[0] and "PENDING" in job.notes[0]


def test_a_job_sacct_has_ended_is_sacct_s(tmp_path: Path) -> None:
    job = slurm_job("1", _tools(tmp_path, SACCT_FAILED, SCONTROL))
    assert job.source == "sacct" and job.state == "FAILED" and job.notes == ()
    assert job.end == _t("2026-12-03T09:09:53")


def test_a_running_job_the_controller_has_no_end_for_stays_open(tmp_path: Path) -> None:
    running = SCONTROL.replace("JobState=COMPLETING", "JobState=RUNNING")
    job = slurm_job("1", _tools(tmp_path, SACCT_PENDING.replace("PENDING", "RUNNING"), running))
    assert job.source == "sacct" and job.end is None and job.notes == ()
    # and one the controller no longer knows
    job = slurm_job("1", _tools(tmp_path / "gone", SACCT_PENDING, None))
    assert job.source == "sacct" and job.end is None
