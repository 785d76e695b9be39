"""The guard check's options and where its spool is: shared by the check and its intake."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpumon.check import CheckContext
from gpumon.guard import verdict as vf


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
        "source": "measured (bench/guard_spool.py, a 2-core AMD EPYC VM): reading and judging a file "
                  "costs a run 8 us (not JSON) to 105 us (a verdict: its JSON Schema and all), so 1000 "
                  "files are at most ~0.1 s of the 10 s interval (1 % of a core); a job writes one file "
                  "per named rank per alarm, so more at once is a runaway writer, read on later runs"})
    max_scan: int = field(default=50000, metadata={
        "min": 1,
        "source": "measured (bench/guard_spool.py, a 2-core AMD EPYC VM): listing a spool entry costs "
                  "~0.5 us, ~2.6 us with the lstat a new file needs, so 50,000 entries are at most "
                  "~0.13 s of the 10 s interval, and the files remembered take ~300 bytes each (15 MB); "
                  "a spool that holds more is said in a warning, and the entries past these are not "
                  "seen until it holds fewer"})
    max_faults_per_gpu: int = field(default=5, metadata={
        "min": 1,
        "source": "argued: a GPU that computes wrong numbers is named by a few verdicts a day (a job's "
                  "alarm names a rank or two, and the job then leaves the node); past 5 within "
                  "warn_hold_s, a GPU's further verdicts of the same class are counted in one finding "
                  "with the newest ids, so a flood of fresh ids adds rows to health.db per hold window, "
                  "not per file"})
    uid_max_verdicts: int = field(default=50, metadata={
        "min": 1,
        "source": "argued: a guarded job writes one verdict per named rank per alarm and leaves the "
                  "node after it (exit 16 or 17), so one user's jobs on one node file a few verdicts an "
                  "hour; 50 an hour is six alarms that each name every rank of an 8-GPU node; past "
                  "it the user's other verdicts wait for a later window (persistent ones do not wait)"})
    uid_window_s: float = field(default=3600.0, metadata={
        "min": 1,
        "source": "argued: an hour, the window uid_max_verdicts is counted in: short enough that a "
                  "capped user's waiting verdicts are judged the same day"})
    confirm: bool = field(default=True, metadata={
        "source": "argued: a persistent verdict is one job's word, and a wrong one sends a good GPU down "
                  "the RMA path; the node's own SDC canaries (the sdc_confirm check) confirm it on that "
                  "GPU first, with the node out of service meanwhile. Off: such verdicts are warnings "
                  "that name the commands that would confirm them"})
    confirm_wait_s: float = field(default=900.0, metadata={
        "min": 1,
        "source": "argued: the sdc_confirm check looks for requests every 30 s; none noted 15 min after "
                  "a verdict was judged means no confirmer runs on this node (disabled, not loaded), and "
                  "the verdict is a warning instead of keeping the node out of service"})


def spool_of(options: GuardConfig, ctx: CheckContext) -> Path:
    """The spool the check reads (and the intake writes into)."""
    return Path(options.spool_dir) if options.spool_dir else ctx.hw.host_root / vf.DEFAULT_DIR.lstrip("/")
