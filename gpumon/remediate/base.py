"""The interface every scheduler backend (Kubernetes, Slurm) implements.

The policy (``gpumon.remediate.policy``) decides from the health state; a
backend only reads and changes the scheduler's view of this node, and tells
apart what gpumon set from what someone else set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from gpumon.model import Action

# Every mark gpumon leaves starts with this, so that gpumon can tell its own
# cordon/drain from an operator's (NVSentinel #1424, #363).
OWNER_PREFIX = "gpumon"


class Mode(enum.Enum):
    OBSERVE = "observe"  # report what would be done, change nothing (default on a fresh install)
    ENFORCE = "enforce"


@dataclass(frozen=True)
class NodeOut:
    """The scheduler's current view of this node."""

    out: bool  # cordoned (Kubernetes) / drained or draining (Slurm)
    by_gpumon: bool  # the mark is gpumon's own
    reason: str = ""  # the scheduler's reason text, as set
    since: float | None = None


@dataclass(frozen=True)
class FleetShare:
    """For the circuit breaker: how much of the fleet gpumon already took out recently."""

    taken_out_recently: int
    total: int

    @property
    def share(self) -> float:
        return self.taken_out_recently / self.total if self.total else 0.0


@dataclass(frozen=True)
class Outcome:
    done: bool
    detail: str
    changes: list[str] = field(default_factory=list)  # what was (or, in observe mode, would be) changed


class SchedulerBackend(Protocol):
    name: str

    def current(self) -> NodeOut:
        """Read the node's state from the scheduler."""
        ...

    def take_out(self, action: Action, summary: str, *, dry_run: bool) -> Outcome:
        """Cordon/taint/condition (Kubernetes) or drain (Slurm), marked as gpumon's."""
        ...

    def bring_back(self, summary: str, *, dry_run: bool) -> Outcome:
        """Lift only gpumon's own marks; never an operator's."""
        ...

    def fleet_share(self, window_s: float) -> FleetShare:
        """Nodes gpumon took out within ``window_s`` (its annotation / drain-reason prefix) and all nodes."""
        ...
