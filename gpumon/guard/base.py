"""What ``Guard`` and ``ShardedGuard`` share (imports torch): their options, the verdicts they make,
how an alarm is handed over and raised, how an internal error turns the guard off, ``state`` and
``close()``.
"""

import atexit
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpumon.guard.alarm import GuardAlarm, GuardError, leave_together
from gpumon.guard.handover import hand_over
from gpumon.guard.verdict import Identity, Verdict, job_id, new_id

log = logging.getLogger("gpumon.guard")


@dataclass(frozen=True)
class GuardState:
    """What the guard does now (``guard.state``): ``on``: its checks run; ``audit``: ``"on"``,
    ``"off"`` (it was on and stopped), ``"not configured"`` (``audit_every=0``) or ``"not applicable"``
    (``ShardedGuard``); ``reason``: why the guard is off, or, while it is on, why the audit is off
    (None when nothing is off); ``closed``: ``close()`` was called (or ran at exit)."""

    on: bool
    audit: str
    reason: str | None
    closed: bool = False


CLOSED = "closed (guard.close() or the interpreter's exit)"
_G = TypeVar("_G", bound="GuardBase")


def _close_at_exit(ref: "weakref.ReferenceType[GuardBase]") -> None:
    guard = ref()
    if guard is not None:
        guard.close()


class GuardBase:
    """What ``Guard`` and ``ShardedGuard`` share: their options, the verdicts they make, how an
    alarm is handed over and raised, how an internal error turns the guard off, and ``close()``."""

    identities: list[Identity]
    _group: Any

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 weight_check_every: int, on_alarm: str, callback: Callable[[GuardAlarm], None] | None,
                 strict: bool, timeout_s: float, spool_dir: str | Path | None, write_verdicts: bool) -> None:
        if on_alarm not in ("raise", "skip"):
            raise ValueError(f"on_alarm: {on_alarm!r} is not one of raise, skip")
        if weight_check_every < 0:
            raise ValueError("weight_check_every: must be >= 0 (0: only on demand)")
        self.model = model
        self.optimizer = optimizer
        self.weight_check_every = weight_check_every
        self.on_alarm = on_alarm
        self.callback = callback
        self.strict = strict
        self.timeout_s = timeout_s
        self.spool_dir = spool_dir
        self.write_verdicts = write_verdicts
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.steps = 0  # optimizer steps the guard has seen (applied or skipped)
        self.skipped_steps: list[int] = []
        self.disabled: str | None = None  # why the guard switched itself off
        self.verdict_files: list[Path] = []
        # set once this step's gradients are known to be bad (on every rank that must skip its
        # update): an error after that, while describing or keeping the step, skips it all the same
        self._bad_step = False
        self._closed = False
        # A loop that never calls close() still ends cleanly: the guard's groups are gone before the
        # interpreter tears down (a weak reference: registering does not keep the guard alive).
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- state and the end -------------------------------------------------------------------------

    @property
    def state(self) -> GuardState:
        """What the guard does now: on or off (with the reason), and the audit's state."""
        audit = self._audit_state()
        if self.disabled is not None:
            return GuardState(False, "off" if audit == "on" else audit, self.disabled, self._closed)
        return GuardState(True, audit, getattr(self, "audit_off", None), self._closed)

    def _audit_state(self) -> str:
        return "not applicable"

    def __enter__(self: _G) -> _G:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the guard in this process: its checks stop (training may go on unguarded: the comm
        hook then only does DDP's all-reduce), its own process groups are destroyed and every
        reference it held to them, to their results and to its buffers is dropped, so that their
        C++ threads are joined now, while the interpreter is whole. Call it when the training loop
        is done and BEFORE ``dist.destroy_process_group()`` (or leave the ``with Guard(...)`` block
        first); it also runs at the interpreter's exit if never called. Every collective of the guard
        completes before the guard returns from the call that made it, so none is pending here.
        Idempotent; never raises (a failure is logged)."""
        if self._closed:
            return
        self._closed = True
        if self.disabled is None:
            self.disabled = CLOSED
        groups = self._release()
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except ValueError:
                pass  # destroyed already (dist.destroy_process_group() destroys every group)
            except Exception as exc:
                log.warning("gpumon.guard: close: destroying the guard's process group: %s: %s",
                            type(exc).__name__, exc)
        groups.clear()

    def _release(self) -> list[Any]:
        """Drop this guard's references to its own process groups (returned, each once) and to what
        their collectives used."""
        group = getattr(self, "_group", None)  # (a constructor that raised before making it)
        self._group = None
        return [group] if group is not None else []

    def _judged_bad(self, where: str, exc: Exception) -> bool:
        """``before_step``'s answer after an internal error in ``where``: the guard is off (or
        ``GuardError`` in strict mode); the update is skipped if the step was already judged bad."""
        self._internal(where, exc)
        if not self._bad_step:
            return True
        log.error("gpumon.guard: step %d was judged bad before that error: its update is skipped",
                  self.steps)
        self.skipped_steps.append(self.steps)
        return False

    def _verdict(self, rank: int, check: str, step: int, message: str, *, fault: str = "unknown",
                 **evidence: Any) -> Verdict:
        subject = self.identities[rank]
        when = time.time()
        return Verdict(check=check, fault=fault, step=step, message=message, subject=subject,
                       evidence=evidence, job=job_id(), time=when, id=new_id(subject, when))

    def _alarm(self, verdicts: Sequence[Verdict], *, skipped: bool, write_files: bool = True,
               every_rank: bool = True, unfiled: Sequence[Verdict] = ()) -> GuardAlarm:
        """The alarm of ``verdicts``, after each named rank wrote its verdict file. ``every_rank``:
        every rank has this alarm now (the guard's decisions are collective, except a reduce result
        that only some ranks saw non-finite); they then leave it together (``leave_together``).
        ``unfiled``: verdicts of ``verdicts`` that name no GPU (no file for a node's daemon)."""
        for v in verdicts:
            # each named rank reports itself, on its own node, to that node's daemon
            if (write_files and self.write_verdicts and v.subject.rank == self.rank
                    and all(v is not u for u in unfiled)):
                hand_over(v, self.spool_dir, self.verdict_files)
        if every_rank and self.world > 1 and self.disabled is None:
            failed = leave_together(self._group, self.timeout_s)
            if failed is not None:
                self._internal("waiting for every rank to have written its verdict", failed,
                               raise_strict=False)
        return GuardAlarm(verdicts, skipped=skipped)

    def _raise_or_log(self, alarm: GuardAlarm) -> None:
        log.error("gpumon.guard: %s", alarm)
        if self.callback is not None:
            try:
                self.callback(alarm)
            except Exception as exc:
                self._internal("the user's callback", exc, raise_strict=False)
        if self.on_alarm == "raise":
            raise alarm

    def _internal(self, where: str, exc: BaseException, *, raise_strict: bool = True) -> None:
        """An internal error: the guard switches itself off (its group may be out of step after a
        timeout) and training goes on; in strict mode it is raised."""
        if self.disabled is None:
            self.disabled = f"{where}: {type(exc).__name__}: {exc}"
            log.error("gpumon.guard: internal error in %s (%s: %s); the guard is off for the rest of "
                      "this run, training goes on", where, type(exc).__name__, exc)
        if self.strict and raise_strict:
            raise GuardError(f"gpumon.guard: internal error in {where}: {exc}") from exc

