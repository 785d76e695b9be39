"""The collective_hang check's saved state, typed: per GPU, the run of samples that showed the signature.

A run starts at the first sample that shows the hung-collective signature and lasts while every later
sample shows it too. It ends (``since`` back to None) at the first sample that does not, at a sample
taken more than ``max_gap_s`` after the one before (nobody looked in between, so nobody can say it
held), when the clock steps back, and when none of the processes that held the GPU at the start of the
run is on it any more (another workload, another run). Pure: no hardware, no clock of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumon.bootstate import BootState


@dataclass
class Run:
    """One GPU: when its current run of signature samples began, and the last sample's time."""

    since: float | None = None  # time of the first sample of the run; None: no run now
    last: float | None = None  # time of the last sample taken, whatever it showed
    pids: list[int] = field(default_factory=list)  # the processes seen during the run

    def step(self, now: float, shows: bool, pids: list[int] | None, max_gap_s: float) -> float:
        """Add one sample at ``now``: ``shows`` the signature or not, with the compute processes on
        the GPU (None: NVML cannot list them here). Returns how long the run has held (0 without one)."""
        prev, self.last = self.last, now
        if not shows:
            self.since, self.pids = None, []
            return 0.0
        seen = sorted(set(pids or ()))
        fresh = (self.since is None or prev is None or now < prev or now - prev > max_gap_s
                 or (bool(seen) and bool(self.pids) and not set(seen) & set(self.pids)))
        if fresh:
            self.since, self.pids = now, seen
            return 0.0
        self.pids = sorted(set(self.pids) | set(seen))
        assert self.since is not None
        return now - self.since


@dataclass
class CollectiveHangState(BootState):
    """The check's declared state: ``{"boot_id", "gpus": {index: run}}``. A reboot ends every job
    and every run: nothing is kept (``new_boot``)."""

    gpus: dict[str, Run] = field(default_factory=dict)
