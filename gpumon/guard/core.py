"""The guard inside a DDP training loop (imports torch; ``gpumon.guard`` loads it on first use).

No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations against the real
``GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, and strings would not match.
"""

import atexit
import datetime
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gpumon.guard.audit import (
    HOW_TO_FIX,
    AuditError,
    Auditor,
    Backward,
    BatchFor,
    LossFn,
    SettleFailed,
    determinism_problems,
    grad_fingerprint,
    profile,
    step_seed,
)
from gpumon.guard.identity import identify
from gpumon.guard.pace import SLOW_BELOW, TRIM, PaceMeter, table_of, work_of
from gpumon.guard.verdict import (
    EXIT_FAILED_VALIDATION,
    EXIT_RESUME_ELSEWHERE,
    Identity,
    PaceRow,
    Verdict,
    job_id,
    new_id,
    spool_dir,
    write,
    write_pace,
)
from gpumon.sdc.fingerprint import Fingerprint, fingerprint_tensor

log = logging.getLogger("gpumon.guard")

CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
# How long ranks whose all-reduce result was non-finite wait for each other: every rank that got
# such a result arrives within one step's skew (the result reached them all at once); one that never
# arrives got a finite result. Bounded well below the guard's timeout_s (120 s): the job waits this
# long once, on such a step only, and the ranks that did not come, already waiting in the guard's
# next collective (the weight check, bounded by timeout_s), are still there when the wait ends.
REDUCE_EXCHANGE_TIMEOUT_S = 15.0
REDUCE_EXCHANGE_SHARE = 0.25  # of timeout_s, when that is less


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


@dataclass
class _BucketFlags:
    index: int
    local_bad: torch.Tensor | None  # 0-d bool on the bucket's device; None: not computed
    reduced_bad: torch.Tensor | None = None
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class WeightReport:
    """One weight check: which replicas agree, the fingerprints compared."""

    step: int
    groups: list[list[int]]  # ranks with equal fingerprints, largest first
    verdicts: list[Verdict]

    @property
    def agree(self) -> bool:
        return len(self.groups) == 1


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
               every_rank: bool = True) -> GuardAlarm:
        """The alarm of ``verdicts``, after each named rank wrote its verdict file. ``every_rank``:
        every rank has this alarm now (the guard's decisions are collective, except a reduce result
        that only some ranks saw non-finite); they then leave it together (``leave_together``)."""
        for v in verdicts:
            # each named rank reports itself, on its own node, to that node's daemon
            if write_files and self.write_verdicts and v.subject.rank == self.rank:
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


class Guard(GuardBase):
    """SDC checks in a DDP training step.

    - non-finite gradients: a comm hook flags NaN/Inf in each bucket's local gradients before the
      all-reduce and in the reduced ones after it (one 0-d flag per bucket, on the device, no host
      sync); ``before_step`` all-reduces the flags of every rank once (a tiny int tensor on the
      guard's own gloo group) and, on a hit, skips the update on every rank;
    - weight fingerprints: every ``weight_check_every`` steps (and on demand, ``check_weights``,
      e.g. before a checkpoint save) the 128-bit fingerprint of every parameter, all-gathered (only
      fingerprints travel); a strict majority of >= 3 replicas names the one that differs.

    ``on_alarm``: ``"raise"`` (``GuardAlarm``) or ``"skip"`` (log it, skip the update, go on);
    ``callback`` is called with the alarm either way. Every collective of the guard has
    ``timeout_s``; an internal error (a timeout included) is logged, the guard switches itself off
    and training goes on, unless ``strict`` (then ``GuardError``).

    - the ring re-execution audit (``gpumon.guard.audit``), every ``audit_every`` steps (0: off):
      each rank recomputes another node's rank's micro-batch on the model's module and compares the
      loss and every gradient's fingerprint bit for bit; needs ``batch_for(rank, step)`` (rebuilds
      any rank's micro-batch), ``loss_fn(model, batch)`` (the loop's forward and loss), optionally
      ``backward(loss)``, and a deterministic run (``gpumon.guard.deterministic()``: refused with
      ``AuditError`` here otherwise). Pass the step's loss (and micro-batch) to ``step(loss, batch)``
      so that the loss is compared too. If the forward draws random numbers, call ``seed_step()``
      right before it, every step.
    - reruns: with ``batch_for`` and ``loss_fn`` given (``audit_every`` may be 0), a rank named by
      check 1 or by the audit computes its micro-batch again, and a rank of another node computes
      it too: the verdict's fault is then ``transient``, ``persistent`` or ``application``.
    - the named rank keeps the failing step (``gpumon.guard.keep``) under ``bundle_dir`` (default:
      ``<spool>/bundles``): a replay bundle for ``gpumon canary replay`` where ``model_factory``
      (module-level, rebuilds the model from JSON ``model_kwargs``), a module-level ``loss_fn`` and
      a dict-of-tensors micro-batch allow it, else the state to replay by hand.
    """

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 *, weight_check_every: int = 100, on_alarm: str = "raise",
                 callback: Callable[[GuardAlarm], None] | None = None, strict: bool = False,
                 timeout_s: float = 120.0, spool_dir: str | Path | None = None,
                 comm_hook: CommHook | None = None, comm_state: Any = None,
                 write_verdicts: bool = True, audit_every: int = 0, batch_for: BatchFor | None = None,
                 loss_fn: LossFn | None = None, backward: Backward | None = None, seed: int = 0,
                 model_factory: Callable[..., torch.nn.Module] | None = None,
                 model_kwargs: dict[str, Any] | None = None, bundle_dir: str | Path | None = None,
                 pace_window: int = 100, pace_of_last: int = 5, pace_need: int = 3,
                 on_straggler: Callable[[list[Verdict]], None] | None = None) -> None:
        if audit_every < 0:
            raise ValueError("audit_every: must be >= 0 (0: no audit)")
        if audit_every and (batch_for is None or loss_fn is None):
            raise ValueError("audit_every: the audit needs batch_for(rank, step) (rebuilds any rank's "
                             "micro-batch) and loss_fn(model, batch) (the forward and the loss)")
        if audit_every and dist.get_world_size() < 2:
            raise ValueError("audit_every: the audit needs at least 2 ranks (a rank cannot audit itself)")
        syncing = [n or "the model" for n, m in model.module.named_modules()
                   if isinstance(m, torch.nn.SyncBatchNorm)] if loss_fn is not None else []
        if syncing:
            # The audit, the reruns and a kept step run loss_fn on some ranks only (or on other
            # micro-batches than the step's): a SyncBatchNorm forward then all-gathers on the
            # job's default group with ranks that are not in it (a hang until NCCL's timeout) or
            # mixes other micro-batches' statistics (false alarms). Refused on every rank alike.
            raise ValueError(f"loss_fn: the model has SyncBatchNorm ({', '.join(syncing[:3])}), whose "
                             "forward all-gathers across ranks; the guard's recomputations (audit, reruns, "
                             "kept steps) run it on some ranks only and would hang or disagree. Leave "
                             "loss_fn, batch_for and audit_every out (checks 1 and 3 still apply) or use "
                             "BatchNorm")
        super().__init__(model, optimizer, weight_check_every=weight_check_every, on_alarm=on_alarm,
                         callback=callback, strict=strict, timeout_s=timeout_s, spool_dir=spool_dir,
                         write_verdicts=write_verdicts)
        self.model: torch.nn.parallel.DistributedDataParallel = model
        self.bundles: list[Path] = []  # failing steps this rank kept
        self.audits = 0  # audits run (every rank takes part in each)
        self.audit_off: str | None = None  # why the audit stopped (an AuditError after the first)
        self.audit_every = audit_every
        self.seed = seed
        self.model_factory = model_factory
        self.model_kwargs = model_kwargs
        self.bundle_dir = bundle_dir
        self._loss_fn = loss_fn
        self._local: dict[int, torch.Tensor] = {}  # param id -> local gradient's fingerprint
        self._flags: list[_BucketFlags] = []
        self._lock = threading.Lock()
        # The all-reduce goes over the DDP model's own group. One that is not the whole job (data
        # parallel inside tensor or pipeline parallelism) is refused: the guard's checks take every
        # rank of the job for a replica of the same weights, and its all-reduce must never mix
        # gradients of different data-parallel groups.
        group = getattr(model, "process_group", None) or dist.group.WORLD
        assert group is not None  # dist is initialised: DDP was built
        self._ddp_group: dist.ProcessGroup = group
        ddp_world = dist.get_world_size(self._ddp_group)
        if ddp_world != dist.get_world_size():
            raise ValueError(f"gpumon.guard: the DDP model's process group has {ddp_world} of the job's "
                             f"{dist.get_world_size()} ranks: the guard compares every rank of the job as a "
                             "replica of the same weights, so it guards DDP over the whole job only (with "
                             "FSDP/HSDP use ShardedGuard)")
        self._inner: CommHook = comm_hook if comm_hook is not None else default_hooks.allreduce_hook
        self._inner_state = comm_state
        # Without a hook of the user's the guard does DDP's all-reduce itself, and the step's last
        # bucket carries every rank's "my local gradients were non-finite" flag (one element per
        # rank): the verdict then needs no collective of its own on a healthy step (a separate
        # 8-byte all-reduce per step cost more than everything else the check does: bench/
        # guard_overhead.py). Decided here, alike on every rank, never per step: the bucket's size
        # must be the same on every rank or the all-reduce would mix them.
        self._carry = comm_hook is None
        self._carried: torch.Tensor | None = None  # this step's flags, after the all-reduce
        self._payload: torch.Tensor | None = None  # the last bucket's all-reduce buffer
        self._pending_local: list[torch.Tensor] = []  # this step's local flags, before it
        module = model.module
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._name_of = {id(p): n for n, p in self._named}
        self._device = next((p.device for _, p in self._named), torch.device("cpu"))
        # The guard's own group: gloo, CPU tensors, its own timeout. A wedged peer then costs
        # timeout_s and a log line, never a hang of the training (the default group's NCCL timeout
        # is 10 minutes, and a flag all-reduce on it would also add a device sync per step).
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # Only ranks whose reduced gradients were non-finite (with finite inputs everywhere) meet
        # here: if that is every rank they learn it at once, if not the others never come and the
        # wait is short (an all-reduce that gave different ranks different results).
        self._reduce_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=min(timeout_s * REDUCE_EXCHANGE_SHARE, REDUCE_EXCHANGE_TIMEOUT_S))) if self._carry
            else self._group)
        self._exchange_off: str | None = None  # why that group is out of step (a wait that timed out)
        self.identity = identify(self.rank, self.world, self._device)
        gathered: list[Any] = [None] * self.world
        self.identities: list[Identity] = [self.identity] * self.world
        try:
            dist.all_gather_object(gathered, self.identity, group=self._group)
            self.identities = [g if isinstance(g, Identity) else self.identity for g in gathered]
        except Exception as exc:
            self._internal("gathering the ranks' identities", exc)
        self._auditor: Auditor | None = None
        if batch_for is not None and loss_fn is not None and self.world >= 2 and self.disabled is None:
            self._auditor = Auditor(module, self._named, self._device, self.identities, self.rank,
                                    self._group, every=audit_every, batch_for=batch_for, loss_fn=loss_fn,
                                    backward=backward, seed=seed)
            self._auditor.step_now = lambda: self.steps
            if audit_every:
                self._refuse_unless_deterministic()
            module.register_forward_pre_hook(self._never_raises("the audit's copy of the buffers",
                                                                self._auditor.pre_forward))
        # stragglers: every rank times its own compute; every pace_window steps they are scored
        self.on_straggler = on_straggler
        self.pace: PaceMeter | None = None
        if pace_window:
            self.pace = PaceMeter(rank=self.rank, world=self.world, group=self._group, device=self._device,
                                  window=pace_window, of_last=pace_of_last, need=pace_need)
            module.register_forward_pre_hook(self.pace.forward_pre)
        self._step_work: float | None = None
        model.register_comm_hook(None, self._hook)

    def _audit_state(self) -> str:
        if not self.audit_every:
            return "not configured"
        return "off" if self.audit_off is not None else "on"

    def _release(self) -> list[Any]:
        groups = super()._release()
        reduce_group = getattr(self, "_reduce_group", None)
        if reduce_group is not None and all(g is not reduce_group for g in groups):
            groups.append(reduce_group)
        self._reduce_group = None
        auditor = getattr(self, "_auditor", None)
        if auditor is not None:
            auditor.group = None
            auditor._buffers = None
        pace = getattr(self, "pace", None)
        if pace is not None:
            pace.group = None
        with self._lock:
            self._flags, self._local = [], {}
        self._payload = self._carried = None
        self._pending_local = []
        return groups

    def _never_raises(self, where: str, hook: Callable[..., None]) -> Callable[..., None]:
        """``hook`` as a hook in the user's forward: never raises into it (an error turns the guard
        off), and does nothing once the guard is off."""
        def guarded(*args: Any) -> None:
            if self.disabled is None:
                try:
                    hook(*args)
                except Exception as exc:
                    self._internal(where, exc, raise_strict=False)
        return guarded

    def _refuse_unless_deterministic(self) -> None:
        """The audit compares bits across GPUs: every rank must be deterministic and alike. Refused
        on every rank at once (the ranks' answers are gathered first)."""
        mine = {"problems": determinism_problems(self._device), "profile": profile(self._device)}
        said: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(said, mine, group=self._group)
        except Exception as exc:
            self._internal("gathering the ranks' determinism settings", exc)
            return
        bad = [f"rank {r}: {'; '.join(s['problems'])}" for r, s in enumerate(said) if s and s["problems"]]
        if bad:
            raise AuditError(f"gpumon.guard: audit_every={self.audit_every}: the audit compares results bit "
                             f"for bit and this run is not deterministic ({'; '.join(bad)}): {HOW_TO_FIX}")
        profiles = {json_key(s["profile"]): r for r, s in enumerate(said) if s}
        if len(profiles) > 1:
            rows = "; ".join(f"rank {r}: {s['profile']}" for r, s in enumerate(said) if s)
            raise AuditError("gpumon.guard: audit: the ranks differ in what decides their bits (torch, GPU "
                             f"model, CUDA, cuDNN, TF32, CPU threads): {rows}; the audit needs them equal")

    def seed_step(self) -> int:
        """Seed torch's generators for this rank's coming step (call it right before the forward if
        the forward draws random numbers, e.g. dropout): the audit and the reruns replay a rank's
        step with the same seed. Returns the seed."""
        seed = step_seed(self.seed, self.rank, self.steps)
        torch.manual_seed(seed)
        return seed

    # -- the comm hook -------------------------------------------------------------------------

    def _hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        flags: _BucketFlags | None = None
        if self.pace is not None and bucket.is_last():
            self.pace.backward_done()  # this rank's backward is done; waiting for the others is not
        if self.disabled is None:
            try:
                # one 0-d flag per bucket, on the device: no host sync inside the backward (on the
                # guard's own all-reduce it is taken there, on the divided buffer while it is hot)
                flags = _BucketFlags(bucket.index(), None if self._carry else nonfinite(bucket.buffer()),
                                     params=list(bucket.parameters()))
                if self._auditor is not None and self._auditor.due(self.steps):
                    # the audited rank's own result: its LOCAL gradients, before the reduce changes
                    # them (fingerprints on the device, in stream order before the inner hook's div_)
                    got = {id(p): grad_fingerprint(g) for p, g in zip(bucket.parameters(), bucket.gradients(),
                                                                       strict=True)}
                    with self._lock:
                        self._local.update({k: v for k, v in got.items() if v is not None})
            except Exception as exc:
                self._internal("the pre-reduce check", exc, raise_strict=False)
        if self._carry:
            return self._allreduce_own(bucket, flags)
        fut = self._inner(self._inner_state, bucket)
        if flags is None:
            return fut

        def after(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = done.value()
            try:
                reduced = value[0] if isinstance(value, (list, tuple)) else value
                flags.reduced_bad = nonfinite(reduced)
                with self._lock:
                    self._flags.append(flags)
            except Exception as exc:  # never fail the bucket's future: DDP would raise in backward
                self._internal("the post-reduce check", exc, raise_strict=False)
            return value

        return fut.then(after)

    def _allreduce_own(self, bucket: GradBucket,
                       flags: _BucketFlags | None) -> torch.futures.Future[torch.Tensor]:
        """DDP's default all-reduce (the sum of the buffer / world, over the model's group) with the
        check on both sides: the local flag on the divided buffer (x / world is finite exactly when x
        is), the reduced one in the all-reduce's one callback. The step's last bucket carries one
        element per rank: 1 where that rank's local gradients had NaN/Inf. Runs on every rank
        whatever the guard's state (a rank that is off sends 0), so the sizes always match. The
        process group is called directly: the Python wrapper of ``dist.all_reduce`` and the
        default hook's second callback cost more per bucket than the check (bench/guard_overhead.py)."""
        group = self._ddp_group
        world = group.size()
        buf = bucket.buffer()
        last = bucket.is_last()
        n = buf.numel()
        if last:
            sent = self._payload_for(n + world, buf)
            torch.div(buf, world, out=sent[:n])
            local = sent[:n]
        else:
            sent = local = buf.div_(world)
        if flags is not None:
            try:
                flags.local_bad = nonfinite(local)
                self._pending_local.append(flags.local_bad)
            except Exception as exc:
                self._internal("the pre-reduce check", exc, raise_strict=False)
        if last:
            tail = sent[n:]
            tail.zero_()
            pending, self._pending_local = self._pending_local, []
            if self.disabled is None and pending:
                try:
                    tail[group.rank()] = torch.stack(pending).any()
                except Exception as exc:  # the tail goes out all the same (every rank's sizes match)
                    tail.zero_()
                    self._internal("the pre-reduce check", exc, raise_strict=False)
        fut: torch.futures.Future[Any] = group.allreduce([sent]).get_future()

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            if last:
                out = f.value()[0]
                buf.copy_(out[:n])
                self._carried = out[n:] != 0
            if flags is not None:
                try:
                    flags.reduced_bad = nonfinite(buf)
                    with self._lock:
                        self._flags.append(flags)
                except Exception as exc:  # never fail the bucket's future: DDP would raise in backward
                    self._internal("the post-reduce check", exc, raise_strict=False)
            return buf

        return fut.then(done)

    def _payload_for(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """The last bucket's all-reduce buffer, kept from step to step (a fresh one of a bucket's
        size each step cost more than the check on a CPU: allocation and page faults). Safe to
        reuse: DDP waits for every bucket's future before backward() returns."""
        p = self._payload
        if p is None or p.numel() != size or p.dtype != like.dtype or p.device != like.device:
            p = self._payload = torch.empty(size, dtype=like.dtype, device=like.device)
        return p

    # -- before / after optimizer.step() ------------------------------------------------------------

    def step(self, loss: torch.Tensor | None = None, batch: Any = None, *, work: float | None = None) -> bool:
        """``before_step``, ``optimizer.step()`` unless an alarm stopped it, ``after_step``.
        True when the update was applied. ``loss``, ``batch``: this step's loss and micro-batch, for
        the audit (see ``before_step``); ``work``: how much work this rank's step was, for the
        straggler scores (default: the element count of the micro-batch's first tensor)."""
        try:
            ok = self.before_step(loss, batch, work=work)
        except GuardAlarm as alarm:
            try:
                self.after_step()
            except GuardAlarm as later:  # the weight check due after this step: one alarm with both
                raise GuardAlarm(alarm.verdicts + later.verdicts, skipped=alarm.skipped) from None
            raise
        if ok:
            if self.pace is not None:
                self.pace.optimizer(self.optimizer.step)
            else:
                self.optimizer.step()
        self.after_step()
        return ok

    def before_step(self, loss: torch.Tensor | None = None, batch: Any = None, *,
                    work: float | None = None) -> bool:
        """Judge this step's gradients on every rank at once. False (or ``GuardAlarm``): do not call
        ``optimizer.step()`` — the same answer on every rank, so the weights stay equal.

        On an audit step (``audit_due()``) the audit runs here: ``loss`` is this rank's loss of the
        step (compared bit for bit; None: only the gradients are), ``batch`` the micro-batch it
        trained on (None: rebuilt with ``batch_for``). ``AuditError`` (on every rank): the audit
        cannot judge (a rebuilt micro-batch of another shape, ...)."""
        with self._lock:
            flags, self._flags = self._flags, []
            local, self._local = self._local, {}
        carried, self._carried = self._carried, None
        self._pending_local = []
        if self.pace is not None:
            self.pace.active = False  # the audit's and reruns' forwards are not the step's
            self._step_work = work if work is not None else (work_of(batch) if batch is not None else None)
        if self.disabled is not None:
            if self.strict and not self._closed:
                raise GuardError(f"gpumon.guard is off: {self.disabled}")
            return True
        self._bad_step = False
        try:
            alarm = self._judge_gradients(flags, batch, carried)
            if alarm is None and self.audit_due():
                alarm = self._audit(loss, batch, local)
        except AuditError as exc:
            # at the first audit (step 0) it is the setup (batch_for, loss_fn, determinism): said at
            # once, on every rank; later it is one step's data (a shard that fails to read): the
            # audit is off for the rest of the run, its other checks and the training go on
            if self.audits == 0 or self.strict:
                raise
            self.audit_off = str(exc)
            log.error("gpumon.guard: step %d: the audit is off for the rest of this run, the other checks "
                      "go on: %s", self.steps, exc)
            return True
        except Exception as exc:
            return self._judged_bad("the audit" if self.audit_due() else "the gradient check", exc)
        if alarm is None:
            return True
        self.skipped_steps.append(self.steps)
        self._raise_or_log(alarm)
        return False

    def after_step(self) -> None:
        """Count the step; the weight check and the straggler scores when they are due."""
        self.steps += 1
        if self.pace is not None:
            self.pace.end_step(self._step_work)
            self._step_work = None
            self.pace.active = True
        if self.weight_check_every and self.steps % self.weight_check_every == 0:
            self.check_weights()
        if self.pace is not None and self.disabled is None and self.pace.due(self.steps):
            self._judge_pace()

    def _judge_pace(self) -> None:
        assert self.pace is not None
        try:
            window = self.pace.judge(self.steps - 1)
        except Exception as exc:
            self._internal("the straggler scores", exc, raise_strict=False)
            return
        if window is None:
            return
        step = window.step
        by_rank = {s.rank: s for s in window.scores}
        # the ranks of this node (the scheduler's node name where there is one: containers on one
        # host each have their own, and each node's daemon reads its own spool)
        node = self.identity.node_name or self.identity.host
        mine = [r for r, i in enumerate(self.identities) if (i.node_name or i.host) == node]
        if mine and min(mine) == self.rank and self.write_verdicts:
            rows = [PaceRow(r, self.identities[r].gpu_uuid, by_rank[r].pace, by_rank[r].pace_per_work,
                            by_rank[r].slow) for r in mine]
            try:
                write_pace(self.spool_dir, job=job_id(), host=node, step=step, rows=rows,
                           when=time.time())
            except OSError as exc:
                log.warning("gpumon.guard: could not write this node's pace scores: %s", exc)
        for r in window.load:
            s = by_rank[r]
            if r == self.rank:
                log.info("gpumon.guard: steps up to %d: rank %d is slower (pace %.2f) only because it gets "
                         "more work (%.0f vs the group's median; pace per unit of work %.2f): load, not its "
                         "GPU", step, r, s.pace, s.work, s.pace_per_work)
        if not window.named:
            return
        median_ms = sorted(s.compute_s for s in window.scores)[len(window.scores) // 2] * 1e3
        verdicts = []
        for r in window.named:
            s = by_rank[r]
            slow_windows = sum(self.pace.history(r))
            verdicts.append(self._verdict(
                r, "straggler", step,
                f"steps up to {step}: rank {r} ({self.identities[r].describe()}) is a straggler: its own "
                f"compute per step {s.compute_s * 1e3:.1f} ms (mean, its slowest {TRIM:.0%} of steps left "
                f"out) against the group's median {median_ms:.1f} ms "
                f"(pace {s.pace:.2f}, {s.pace_per_work:.2f} per unit of work, slow below {SLOW_BELOW}) in "
                f"{slow_windows} of the last {len(self.pace.history(r))} windows of {self.pace.window} "
                "steps; not explained by its share of the work; the job runs at its pace",
                pace=s.pace, pace_per_work=s.pace_per_work, compute_ms=round(s.compute_s * 1e3, 3),
                group_median_ms=round(median_ms, 3), slow_windows=slow_windows,
                windows=len(self.pace.history(r)), window_steps=self.pace.window,
                scores=table_of(window.scores)))
        log.warning("gpumon.guard: %s", "; ".join(v.message for v in verdicts))
        for v in verdicts:
            if self.write_verdicts and v.subject.rank == self.rank:
                hand_over(v, self.spool_dir, self.verdict_files)
        if self.on_straggler is not None:
            try:
                self.on_straggler(verdicts)
            except Exception as exc:
                self._internal("the user's on_straggler callback", exc, raise_strict=False)

    def audit_due(self) -> bool:
        """The step being taken (``steps``) is an audit step: 0, M, 2M, ... (``audit_every`` M)."""
        return self._auditor is not None and self.audit_off is None and self._auditor.due(self.steps)

    def _audit(self, loss: torch.Tensor | None, batch: Any,
               local: dict[int, torch.Tensor]) -> GuardAlarm | None:
        assert self._auditor is not None
        step = self.steps
        diverged = self._diverged_before(step, "the audit")
        if diverged is not None:
            self._bad_step = True
            return self._alarm(diverged.verdicts, skipped=True)
        own = self._auditor.own(loss, local)
        try:
            blames = self._auditor.audit(step, own, batch)
        except SettleFailed as failed:
            self._internal("settling the audit's disagreement", failed, raise_strict=False)
            blames = failed.blames
        self.audits += 1
        if not blames:
            return None
        self._bad_step = True
        verdicts = [self._verdict(b.rank, b.check, step, b.message, fault=b.fault, **b.evidence)
                    for b in blames]
        verdicts = [self._keep(v, b.owner, step, batch if b.owner == self.rank else None)
                    for v, b in zip(verdicts, blames, strict=True)]
        return self._alarm(verdicts, skipped=True)

    def _keep(self, v: Verdict, owner: int, step: int, batch: Any) -> Verdict:
        """The named rank keeps the failing step (the micro-batch of ``owner``) and says where. Best
        effort: the verdict goes out whatever keeping the step does (the user's loss_fn, a full disk)."""
        if v.subject.rank != self.rank or not self.write_verdicts or self._loss_fn is None:
            return v
        try:
            return self._keep_step(v, owner, step, batch)
        except Exception as exc:
            log.error("gpumon.guard: step %d: could not keep the failing step: %s: %s", step,
                      type(exc).__name__, exc)
            return replace(v, evidence={**v.evidence, "bundle": None,
                                        "bundle_error": f"{type(exc).__name__}: {exc}"})

    def _keep_step(self, v: Verdict, owner: int, step: int, batch: Any) -> Verdict:
        from gpumon.guard.keep import keep_step

        assert self._loss_fn is not None  # (_keep)

        if batch is None and self._auditor is not None:
            try:
                batch = self._auditor.batch_for(owner, step)
            except Exception as exc:
                return replace(v, evidence={**v.evidence, "bundle": None,
                                            "bundle_error": f"batch_for({owner}, {step}): {exc}"})
        if batch is None:
            return v
        root = Path(self.bundle_dir) if self.bundle_dir else spool_dir(self.spool_dir) / "bundles"
        seed = step_seed(self.seed, owner, step)
        facts = {"verdict": v.id, "check": v.check, "fault": v.fault, "step": step, "micro_batch_of": owner,
                 "subject": v.subject.describe()}
        kept = keep_step(root / v.id, module=self.model.module, optimizer=self.optimizer, batch=batch,
                         loss_fn=self._loss_fn, seed=seed, model_factory=self.model_factory,
                         model_kwargs=self.model_kwargs, name=f"guard-{v.check}-step{step}-rank{owner}",
                         facts=facts)
        if kept.get("bundle"):
            self.bundles.append(Path(kept["bundle"]))
        return replace(v, evidence={**v.evidence, **kept, "bundle_micro_batch_of": owner,
                                    "bundle_seed": seed})

    def _judge_gradients(self, flags: list[_BucketFlags], batch: Any = None,
                         carried: torch.Tensor | None = None) -> GuardAlarm | None:
        reduced = [f.reduced_bad for f in flags if f.reduced_bad is not None]
        step = self.steps
        if carried is not None and carried.numel() == self.world:
            # every rank's local flag came with the gradients: the same list on every rank
            summary = (torch.cat([carried, torch.stack(reduced).any().reshape(1)]) if reduced
                       else carried).tolist()  # the one host sync of the step
            bad_local = [r for r in range(self.world) if summary[r]]
            bad_reduced = [self.rank] if reduced and summary[-1] else []
            if bad_reduced and not bad_local:
                bad_reduced = self._exchange_reduced(step)
        else:
            local = [f.local_bad for f in flags if f.local_bad is not None]
            mine = torch.zeros(2, dtype=torch.bool, device=self._device)
            if local:
                mine[0] = torch.stack(local).any()
            if reduced:
                mine[1] = torch.stack(reduced).any()
            vec = torch.zeros(2, self.world, dtype=torch.int32)
            vec[:, self.rank] = mine.to("cpu", torch.int32)  # the one host sync of the step
            dist.all_reduce(vec, group=self._group)
            bad_local = [r for r in range(self.world) if vec[0, r]]
            bad_reduced = [r for r in range(self.world) if vec[1, r]]
        if bad_local or bad_reduced:
            self._bad_step = True
        if bad_local:
            where = self._bad_params(flags, local=True) if self.rank in bad_local else []
            reran: dict[int, tuple[str, str, dict[str, Any]]] = {}
            # A rerun elsewhere starts from that rank's weights: if a replica already diverged, a NaN
            # its own weights produce reproduces on its GPU and not on another node's, which would
            # read as a persistent GPU fault. The weights are compared first (check 3's verdict).
            diverged = self._diverged_before(step, "the rerun of check 1") if self._auditor is not None \
                else None
            if diverged is not None:
                not_rerun = ("not rerun: the replicas' weights differ (see the weight verdict), so a rerun "
                             "on another GPU would start from other weights")
                reran = {r: ("unknown", not_rerun, {"rerun_skipped": "replicas_diverged",
                                                    "replica_groups": diverged.groups}) for r in bad_local}
            elif self._auditor is not None:
                try:
                    reran = self._auditor.rerun_nonfinite(step, bad_local)
                except Exception as exc:
                    # the gradients are known to be NaN/Inf: the update is skipped all the same,
                    # only the disambiguation is lost (a peer gone mid-rerun turns the guard off)
                    if not isinstance(exc, AuditError):
                        self._internal("the rerun of check 1", exc, raise_strict=False)
                    log.error("gpumon.guard: step %d: the rerun of the non-finite gradients failed: %s", step,
                              exc)
                    reran = {r: ("unknown", "", {"rerun_error": f"{type(exc).__name__}: {exc}"})
                             for r in bad_local}
            verdicts = []
            for r in bad_local:
                fault, why, evidence = reran.get(r, ("unknown", "", {}))
                said = f"; {fault}: {why}" if why else ""
                v = self._verdict(
                    r, "nonfinite_grad", step,
                    f"step {step}: rank {r}'s local gradients have NaN/Inf before the all-reduce "
                    f"({self.identities[r].describe()}){said}; the update is skipped on every rank",
                    fault=fault, ranks_nonfinite_local=bad_local, ranks_nonfinite_reduced=bad_reduced,
                    **evidence, **({"parameters": where} if r == self.rank else {}))
                verdicts.append(self._keep(v, r, step, batch if r == self.rank else None))
            if diverged is not None:
                verdicts = diverged.verdicts + verdicts
            return self._alarm(verdicts, skipped=True)
        if bad_reduced:
            every = len(bad_reduced) == self.world
            # carried, some ranks only: the others saw a finite result and no alarm, and applied it
            alone = carried is not None and carried.numel() == self.world and not every
            skipped = ("the update is skipped on this rank only: the ranks whose result was finite applied "
                       "it, so this replica's weights now differ from theirs (the weight check names it)"
                       if alone else "the update is skipped on every rank")
            verdicts = []
            for r in bad_reduced:
                what = ("the all-reduce itself (every rank's inputs were finite, every rank's result is "
                        "not)" if every else f"rank {r}'s result of the all-reduce (finite inputs on every "
                        f"rank; {len(bad_reduced)} of {self.world} ranks got NaN/Inf)")
                verdicts.append(self._verdict(
                    r, "nonfinite_reduce", step,
                    f"step {step}: NaN/Inf after the all-reduce with finite inputs everywhere: {what}; "
                    f"{skipped}", ranks_nonfinite_reduced=bad_reduced, reduce_on_every_rank=every,
                    replica_diverged=alone))
            # The all-reduce on every rank names no GPU: no node file (the fabric probe is the tool).
            # Ranks whose result was finite have no alarm: only with every rank's is it collective.
            return self._alarm(verdicts, skipped=True, write_files=not every, every_rank=not alone)
        return None

    def _exchange_reduced(self, step: int) -> list[int]:
        """This rank's reduced gradients are non-finite, every rank's inputs were finite: which ranks
        got such a result? Every rank that did comes here; if one did not, the wait ends after
        REDUCE_EXCHANGE_TIMEOUT_S and this rank names itself alone (the all-reduce gave ranks
        different results). That group is then out of step and not used again (a later such result
        names this rank at once); the guard's other checks go on."""
        if self._exchange_off is not None:
            return [self.rank]
        vec = torch.zeros(self.world, dtype=torch.int32)
        vec[self.rank] = 1
        try:
            dist.all_reduce(vec, group=self._reduce_group)
        except Exception as exc:
            # Only the exchange's own group is out of step (the others never came): the rest of the
            # guard stays on, so that the next weight check, on its own group, names this replica,
            # which skipped an update the others applied.
            self._exchange_off = f"{type(exc).__name__}: {exc}"
            log.error("gpumon.guard: step %d: this rank's all-reduce result has NaN/Inf and not every "
                      "rank's does (%s); this rank skips the update the others apply, so its weights now "
                      "differ from theirs and the weight check names it", step, self._exchange_off)
            return [self.rank]
        return [r for r in range(self.world) if vec[r]]

    def _bad_params(self, flags: list[_BucketFlags], *, local: bool) -> list[str]:
        """Names of this rank's parameters with non-finite gradients (only computed on an alarm; best
        effort: none named when the look fails, e.g. out of memory for its per-element test)."""
        out: list[str] = []
        try:
            for f in flags:
                bad = f.local_bad if local else f.reduced_bad
                if bad is None or not bool(bad):
                    continue
                for p in f.params:
                    g = p.grad
                    if g is not None and not bool(torch.isfinite(g).all()):
                        out.append(self._name_of.get(id(p), f"bucket {f.index}"))
        except Exception as exc:
            log.error("gpumon.guard: could not name the parameters with non-finite gradients: %s: %s",
                      type(exc).__name__, exc)
        return out[:20]

    # -- weights -----------------------------------------------------------------------------------

    def check_weights(self) -> WeightReport | None:
        """Compare every replica's weights by fingerprint (call it before saving a checkpoint too).
        None when the guard is off; raises ``GuardAlarm`` (``on_alarm="raise"``) on a mismatch."""
        if self.disabled is not None:
            return None
        try:
            report = self._compare_weights()
        except Exception as exc:
            self._internal("the weight check", exc)
            return None
        if report.verdicts:
            self._raise_or_log(self._alarm(report.verdicts, skipped=False))
        return report

    def _diverged_before(self, step: int, what: str) -> WeightReport | None:
        """The audit and check 1's reruns compare computations across GPUs, each made from its own
        replica's weights: they judge a GPU only if every replica holds the same weights. A replica
        that already diverged (a flipped bit in its optimizer state or weight storage, an update
        only it skipped) would recompute its own wrong result on its own GPU and be called a
        persistent fault. So the weights are compared first (check 3, on every rank alike); if they
        differ, the report of check 3 is returned (the odd replica by strict majority, ``unknown``)
        and ``what`` is not judged. None: the replicas agree."""
        report = self._compare_weights(before=(step, what))
        return None if report.agree else report

    def _compare_weights(self, before: tuple[int, str] | None = None) -> WeightReport:
        """Check 3. ``before``: (step, what) when the comparison precedes a recomputation of that
        step (the audit, check 1's reruns), which is then not judged if the replicas differ."""
        with torch.no_grad():
            pairs = [fingerprint_tensor(p.detach()) for _, p in self._named]
            local = (torch.stack(pairs) if pairs else torch.zeros(0, 2, dtype=torch.int64)).to("cpu")
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self._group)
        keys: dict[bytes, list[int]] = {}
        for r, t in enumerate(gathered):
            keys.setdefault(t.numpy().tobytes(), []).append(r)
        groups = sorted(keys.values(), key=lambda g: (-len(g), g))
        step = self.steps - 1  # the step just applied (-1: before the first)
        when = f"after step {step}" if step >= 0 else "before the first step"
        if len(groups) == 1:
            return WeightReport(step, groups, [])
        tail, found = "", dict[str, Any]()
        if before is not None:
            tail = (f"; found before {before[1]} of step {before[0]}, which is not judged: its "
                    "computations would start from different weights, so a disagreement would say nothing "
                    "about a GPU; the update is skipped on every rank")
            found = {"found_before": before[1], "not_judged_step": before[0]}
        verdicts: list[Verdict] = []
        majority = groups[0] if self.world >= 3 and len(groups[0]) * 2 > self.world else None
        if majority is not None:
            ref = gathered[majority[0]]
            for r in sorted(r for g in groups[1:] for r in g):
                first, count = first_difference(gathered[r], ref)
                name = self._named[first][0]
                verdicts.append(self._verdict(
                    r, "weights", step,
                    f"{when}: rank {r}'s weights differ from the majority ({len(majority)} of "
                    f"{self.world} replicas agree), first at parameter {name!r} "
                    f"({self.identities[r].describe()}); not rerun, so transient or persistent is "
                    f"unknown{tail}", first_parameter=name, parameter_index=first, parameters_differing=count,
                    fingerprint=fingerprint_hex(gathered[r][first]),
                    majority_fingerprint=fingerprint_hex(ref[first]),
                    majority_ranks=majority, **found))
        else:
            for g in groups:
                for r in g:
                    other = next(o for o in range(self.world) if o not in g)
                    first, count = first_difference(gathered[r], gathered[other])
                    name = self._named[first][0]
                    why = ("two replicas cannot outvote each other" if self.world == 2
                           else f"no strict majority among {self.world} replicas")
                    verdicts.append(self._verdict(
                        r, "weights", step,
                        f"{when}: weights disagree between replicas ({why}): rank {r} "
                        f"({self.identities[r].describe()}) differs from rank {other} first at parameter "
                        f"{name!r}; which is wrong is unknown{tail}", first_parameter=name,
                        parameter_index=first, parameters_differing=count,
                        fingerprint=fingerprint_hex(gathered[r][first]), groups=groups, other_rank=other,
                        other=self.identities[other].describe(), **found))
        return WeightReport(step, groups, verdicts)

    # -- verdicts ----------------------------------------------------------------------------------


def hand_over(v: Verdict, spool_dir: str | Path | None, files: list[Path]) -> None:
    """Hand this rank's verdict to its node's daemon and say how, in the job's log, at once: a
    launcher stops the other ranks when the first one exits, so a line printed after the alarm is
    raised may never be written (torchrun's SIGTERM), while this one is out before the ranks leave.

    Over the daemon's intake socket first (``gpumon.guard.handover``, ``$GPUMON_INTAKE_SOCKET``):
    from this process, which holds the GPU the verdict names, so that the daemon can attest it. A
    daemon that cannot be reached, or that does not take the verdict, leaves it to the spool file
    (``files`` lists those written), judged as before. Never raises: the ranks must still leave the
    alarm together."""
    from gpumon.guard import handover

    try:
        reply = handover.send("guard", v.to_json())
    except handover.Unreachable as exc:
        why = f"could not reach this node's daemon: {exc}"
    except Exception as exc:
        why = f"could not reach this node's daemon: {type(exc).__name__}: {exc}"
    else:
        if reply.accepted:
            said = "attested" if reply.attested else f"not attested: {reply.message}"
            log.warning("gpumon.guard: rank %d: verdict handed to this node's daemon (%s)", v.subject.rank,
                        said)
            return
        why = f"this node's daemon did not take the verdict: {reply.message}"
    try:
        path = write(v, spool_dir)
    except OSError as exc:
        log.error("gpumon.guard: rank %d: %s; could not write the %s verdict to the spool either: %s (is the "
                  "spool directory there and writable by this job?)", v.subject.rank, why, v.check, exc)
        return
    except Exception as exc:  # never out of an alarm: the ranks must still leave it together
        log.error("gpumon.guard: rank %d: %s; could not write the %s verdict to the spool either: %s: %s",
                  v.subject.rank, why, v.check, type(exc).__name__, exc)
        return
    files.append(path)
    # the line's start is what the README promises ("verdict written for this node's daemon: PATH")
    log.warning("gpumon.guard: rank %d: verdict written for this node's daemon: %s (to the spool: %s)",
                v.subject.rank, path, why)


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


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def nonfinite(buf: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``buf``'s device: does ``buf`` hold a NaN or an Inf? One read of the buffer and no
    host sync: NaN and Inf survive a sum (NaN + x is NaN, Inf + finite is Inf, Inf - Inf is NaN), which
    costs a 27th of ``isfinite(buf).all()`` (that writes a bool per element: 847 vs 31 us for 339k
    fp32 values on one CPU thread, measured). fp16 and bf16 buckets are summed in fp32, where a finite
    fp16 bucket cannot overflow (65504 x 2^24 elements < 3.4e38); an fp32 or bf16 bucket overflows only
    with gradient elements beyond ~1e31, which is then reported as non-finite (the exact
    per-parameter look, ``isfinite``, runs only on an alarm and names the parameters)."""
    acc = torch.float32 if buf.dtype in (torch.float16, torch.bfloat16) else None
    return torch.logical_not(torch.isfinite(buf.sum(dtype=acc)))


def fingerprint_hex(row: torch.Tensor) -> str:
    """A parameter's 128-bit fingerprint from its row of two int64s (as gathered), in hex."""
    plain, weighted = (int(v) & 0xFFFFFFFFFFFFFFFF for v in row.tolist())
    return Fingerprint(plain, weighted).hex()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(index of the first parameter whose fingerprints differ, how many differ)."""
    diff = (a != b).any(dim=1).nonzero().reshape(-1)
    return int(diff[0]), int(diff.numel())
