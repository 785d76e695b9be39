"""gpumon.guard: SDC checks inside a PyTorch DDP training job.

Importing this package imports no torch: ``Guard`` loads ``gpumon.guard.core`` (``GuardAlarm`` and
``GuardError``: ``gpumon.guard.alarm``), and torch, on first use. Verdicts go to the node's daemon
over its intake socket (``gpumon.guard.handover``: the daemon attests the sender by its GPU), else as
files in the spool (``gpumon.guard.verdict``); the ``guard`` check turns them into findings.

    from gpumon.guard import Guard, GuardAlarm
    guard = Guard(ddp_model, optimizer, weight_check_every=100)
    ...
    loss.backward()
    guard.step(loss)        # optimizer.step() unless an alarm stopped it (GuardAlarm)

With the audit (check 2): ``gpumon.guard.deterministic()`` first, then ``Guard(..., audit_every=500,
batch_for=..., loss_fn=...)`` (see ``gpumon.guard.audit``). FSDP / HSDP: ``ShardedGuard``
(``gpumon.guard.sharded``: which checks apply there).
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
    from gpumon.guard.alarm import GuardAlarm, GuardError
    from gpumon.guard.audit import AuditError, deterministic, step_seed
    from gpumon.guard.checkpoint import save_checkpoint, weights_fingerprint
    from gpumon.guard.core import Guard
    from gpumon.guard.sharded import ShardedGuard, ShardedWeightReport
    from gpumon.guard.weights import WeightReport

# each name -> the module that holds it (every one imports torch, so none is loaded before use)
_LAZY = {
    "Guard": "core",
    **dict.fromkeys(("GuardAlarm", "GuardError"), "alarm"),
    "WeightReport": "weights",
    **dict.fromkeys(("AuditError", "deterministic", "step_seed"), "audit"),
    **dict.fromkeys(("save_checkpoint", "weights_fingerprint"), "checkpoint"),
    **dict.fromkeys(("ShardedGuard", "ShardedWeightReport"), "sharded"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"gpumon.guard.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gpumon.guard' has no attribute {name!r}")


__all__ = ["DEFAULT_DIR", "DIR_ENV", "EXIT_FAILED_VALIDATION", "EXIT_RESUME_ELSEWHERE", "AuditError", "Guard",
           "GuardAlarm", "GuardError", "Identity", "ShardedGuard", "ShardedWeightReport", "Verdict",
           "VerdictError", "WeightReport", "deterministic", "save_checkpoint", "step_seed",
           "weights_fingerprint"]
