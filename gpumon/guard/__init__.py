"""gpumon.guard: SDC checks inside a PyTorch DDP training job.

Importing this package imports no torch: ``Guard``, ``GuardAlarm`` and ``GuardError`` load
``gpumon.guard.core`` (and torch) on first use. Verdicts go to the node's daemon as files
(``gpumon.guard.verdict``); the ``guard`` check turns them into findings.

    from gpumon.guard import Guard, GuardAlarm
    guard = Guard(ddp_model, optimizer, weight_check_every=100)
    ...
    loss.backward()
    guard.step(loss)        # optimizer.step() unless an alarm stopped it (GuardAlarm)

With the audit (check 2): ``gpumon.guard.deterministic()`` first, then ``Guard(..., audit_every=500,
batch_for=..., loss_fn=...)`` (see ``gpumon.guard.audit``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumon.guard.verdict import (
    DEFAULT_DIR,
    DIR_ENV,
    EXIT_FAILED_VALIDATION,
    EXIT_RESUME_ELSEWHERE,
    Identity,
    Verdict,
    VerdictError,
)

if TYPE_CHECKING:
    from gpumon.guard.audit import AuditError, deterministic, step_seed
    from gpumon.guard.core import Guard, GuardAlarm, GuardError, WeightReport

_LAZY = ("Guard", "GuardAlarm", "GuardError", "WeightReport")
_LAZY_AUDIT = ("AuditError", "deterministic", "step_seed")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gpumon.guard import core

        return getattr(core, name)
    if name in _LAZY_AUDIT:
        from gpumon.guard import audit

        return getattr(audit, name)
    raise AttributeError(f"module 'gpumon.guard' has no attribute {name!r}")


__all__ = ["DEFAULT_DIR", "DIR_ENV", "EXIT_FAILED_VALIDATION", "EXIT_RESUME_ELSEWHERE", "AuditError", "Guard",
           "GuardAlarm", "GuardError", "Identity", "Verdict", "VerdictError", "WeightReport", "deterministic",
           "step_seed"]
