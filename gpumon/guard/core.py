"""The guard inside a DDP training loop (imports torch; ``gpumon.guard`` loads it on first use).

``Guard`` is built here: its options, its groups and hooks, ``step`` (``before_step``, the
optimizer, ``after_step``); what it does is in the modules it is made of:

- ``gpumon.guard.hook``: the comm hook (each bucket's NaN/Inf flags, the guard's own all-reduce);
- ``gpumon.guard.after``: check 1 with ``nonfinite="after"`` (no comm hook: one fused pass over the
  reduced gradients after the backward; the audit's and the straggler meter's hooks without it);
- ``gpumon.guard.step_verdict``: the verdict of a step (check 1 and the exchange, the audit's step,
  the failing step kept);
- ``gpumon.guard.weights``: check 3 (``check_weights``, ``WeightReport``);
- ``gpumon.guard.stragglers``: the pace meter's windows judged;
- ``gpumon.guard.base``: what ``Guard`` and ``ShardedGuard`` share (``GuardState``, verdicts, alarms
  raised, internal errors, ``close()``); ``gpumon.guard.alarm``: ``GuardAlarm``, ``GuardError``,
  leaving an alarm together; ``gpumon.guard.handover``: a verdict handed to the node's daemon.

The names this module held before it was split are still importable from it.

No ``from __future__ import annotations`` here nor in ``gpumon.guard.hook``: DDP checks a comm
hook's annotations against the real ``GradBucket`` and ``torch.futures.Future[torch.Tensor]``
objects, and strings would not match.
"""

import datetime
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.hooks import RemovableHandle

from gpumon.guard.after import AfterHooksMixin
from gpumon.guard.alarm import GuardAlarm as GuardAlarm
from gpumon.guard.alarm import GuardError as GuardError
from gpumon.guard.alarm import leave_together as leave_together
from gpumon.guard.audit import (
    HOW_TO_FIX,
    AuditError,
    Auditor,
    Backward,
    BatchFor,
    LossFn,
    determinism_problems,
    profile,
    step_seed,
)
from gpumon.guard.base import CLOSED as CLOSED
from gpumon.guard.base import GuardBase as GuardBase
from gpumon.guard.base import GuardState as GuardState
from gpumon.guard.handover import hand_over as hand_over
from gpumon.guard.hook import BucketFlags, CommHookMixin
from gpumon.guard.hook import CommHook as CommHook
from gpumon.guard.hook import nonfinite as nonfinite
from gpumon.guard.identity import identify
from gpumon.guard.pace import PaceMeter, work_of
from gpumon.guard.step_verdict import REDUCE_EXCHANGE_SHARE as REDUCE_EXCHANGE_SHARE
from gpumon.guard.step_verdict import REDUCE_EXCHANGE_TIMEOUT_S as REDUCE_EXCHANGE_TIMEOUT_S
from gpumon.guard.step_verdict import StepVerdictMixin
from gpumon.guard.stragglers import StragglerMixin
from gpumon.guard.verdict import Identity, Verdict
from gpumon.guard.weights import WeightReport as WeightReport
from gpumon.guard.weights import fingerprint_hex as fingerprint_hex
from gpumon.guard.weights import first_difference as first_difference

log = logging.getLogger("gpumon.guard")


NONFINITE_MODES = ("hook", "after")


class Guard(CommHookMixin, AfterHooksMixin, StepVerdictMixin, StragglerMixin, GuardBase):
    """SDC checks in a DDP training step.

    - non-finite gradients (check 1), ``nonfinite="hook"`` (the default): a comm hook flags NaN/Inf
      in each bucket's local gradients before the all-reduce and in the reduced ones after it (one
      0-d flag per bucket, on the device, no host sync); every rank's local flag travels in DDP's
      last gradient bucket, so ``before_step`` reads the same list on every rank with no collective
      of its own (with a ``comm_hook=`` of the user's, the flags are all-reduced once, a tiny int
      tensor on the guard's own gloo group), and, on a hit, skips the update on every rank;
      ``nonfinite="after"``: no comm hook (DDP's C++ all-reduce, or the user's ``comm_hook``
      registered as it is), one fused NaN/Inf pass over the reduced gradients in ``before_step``
      (a NaN/Inf of any rank survives the sum), the update skipped on every rank on a hit; the rank
      it came from is named afterwards, by its loss (``step(loss)``) and by the reruns where
      ``batch_for`` and ``loss_fn`` are given, or said to be unknown (``gpumon.guard.after``;
      what each mode catches, misses and costs: the guard's overhead page);
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
                 on_straggler: Callable[[list[Verdict]], None] | None = None,
                 nonfinite: str = "hook") -> None:
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite: {nonfinite!r} is not one of {', '.join(NONFINITE_MODES)} (the "
                             "same on every rank)")
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
        self._flags: list[BucketFlags] = []
        self._lock = threading.Lock()
        self.nonfinite_mode = nonfinite
        self._after = nonfinite == "after"
        self._capture_handles: list[RemovableHandle] = []
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
        self._carry = comm_hook is None and not self._after
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
            seconds=min(timeout_s * REDUCE_EXCHANGE_SHARE, REDUCE_EXCHANGE_TIMEOUT_S)))
            if self._carry or self._after else self._group)
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
            if self._after and audit_every:
                module.register_forward_pre_hook(self._never_raises("the audit's look at the local gradients",
                                                                    self._capture_pre_forward))
        # stragglers: every rank times its own compute; every pace_window steps they are scored
        self.on_straggler = on_straggler
        self.pace: PaceMeter | None = None
        if pace_window:
            self.pace = PaceMeter(rank=self.rank, world=self.world, group=self._group, device=self._device,
                                  window=pace_window, of_last=pace_of_last, need=pace_need)
            module.register_forward_pre_hook(self.pace.forward_pre)
            if self._after:
                module.register_forward_hook(self._never_raises("the straggler meter's hook",
                                                                self._pace_forward))
        self._step_work: float | None = None
        if not self._after:
            model.register_comm_hook(None, self._hook)
        elif comm_hook is not None:
            # the user's hook as it is: the guard reads the gradients after it, in before_step
            model.register_comm_hook(comm_state, comm_hook)

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
        if getattr(self, "_capture_handles", None):
            self._end_capture()
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
        cannot judge (a rebuilt micro-batch of another shape, ...). With ``nonfinite="after"`` a
        NaN/Inf ``loss`` also names its rank when the reduced gradients are non-finite."""
        if self._capture_handles:
            self._end_capture()  # the audit's own backward must not be captured
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
            alarm = (self._judge_after(loss, batch) if self._after
                     else self._judge_gradients(flags, batch, carried))
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


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)

