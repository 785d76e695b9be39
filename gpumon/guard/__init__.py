"""gpumon.guard: SDC checks inside a PyTorch DDP training job.

Importing this package imports no torch: ``Guard``, ``GuardAlarm`` and ``GuardError`` load
``gpumon.guard.core`` (and torch) on first use. Verdicts go to the node's daemon as files
(``gpumon.guard.verdict``); the ``guard`` check turns them into findings.

    from gpumon.guard import Guard, GuardAlarm
    guard = Guard(ddp_model, optimizer, weight_check_every=100)
    ...
    loss.backward()
    guard.step()            # optimizer.step() unless an alarm stopped it (GuardAlarm)
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
    from gpumon.guard.checkpoint import save_checkpoint, weights_fingerprint
    from gpumon.guard.core import Guard, GuardAlarm, GuardError, WeightReport

_LAZY = ("Guard", "GuardAlarm", "GuardError", "WeightReport")
# verified checkpoints (gpumon.guard.checkpoint, imports torch too)
_LAZY_CHECKPOINT = ("save_checkpoint", "weights_fingerprint")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gpumon.guard import core

        return getattr(core, name)
    if name in _LAZY_CHECKPOINT:
        from gpumon.guard import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'gpumon.guard' has no attribute {name!r}")


__all__ = ["DEFAULT_DIR", "DIR_ENV", "EXIT_FAILED_VALIDATION", "EXIT_RESUME_ELSEWHERE", "Guard",
           "GuardAlarm", "GuardError", "Identity", "Verdict", "VerdictError", "WeightReport",
           "save_checkpoint", "weights_fingerprint"]
