"""The guard's alarm and how the ranks leave it together (imports torch).

``GuardAlarm``: a check fired (its verdicts, the exit code a launcher should see, whether the update
was skipped); ``GuardError``: an internal error of the guard, raised only in strict mode;
``leave_together``: every rank waits for the others before leaving an alarm they all have.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from gpumon.guard.verdict import EXIT_FAILED_VALIDATION, EXIT_RESUME_ELSEWHERE, Verdict


class GuardError(RuntimeError):
    """An internal error of the guard, raised only in strict mode (otherwise logged; training goes on)."""


class GuardAlarm(Exception):
    """A check fired. ``verdicts``: one per rank named; ``exit_code``: what a launcher should see
    (16 resume elsewhere to disambiguate, 17 failed validation); ``skipped``: the update was not
    applied on any rank."""

    def __init__(self, verdicts: Sequence[Verdict], *, skipped: bool) -> None:
        self.verdicts = list(verdicts)
        self.skipped = skipped
        persistent = any(v.fault == "persistent" for v in self.verdicts)
        self.exit_code = EXIT_FAILED_VALIDATION if persistent else EXIT_RESUME_ELSEWHERE
        super().__init__("; ".join(v.message for v in self.verdicts))

    @property
    def ranks(self) -> list[int]:
        return sorted({v.subject.rank for v in self.verdicts})


def leave_together(group: Any, timeout_s: float) -> Exception | None:
    """Every rank of ``group`` has the same alarm: wait until each has got this far, so that none
    leaves it first. A loop exits on an alarm, and a launcher stops the other ranks as soon as one
    exits (torchrun): a named rank still keeping its failing step or writing its verdict would be
    killed before the node's daemon heard of its GPU (seen in CI). Bounded by ``timeout_s``; the
    error (a rank that never came) is returned, never raised."""
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except Exception as exc:
        return exc
    return None
