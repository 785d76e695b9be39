"""The guard inside a DDP training loop (imports torch; ``gpumon.guard`` loads it on first use).

No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations against the real
``GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, and strings would not match.
"""

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gpumon.guard.identity import identify
from gpumon.guard.verdict import (
    EXIT_FAILED_VALIDATION,
    EXIT_RESUME_ELSEWHERE,
    Identity,
    Verdict,
    job_id,
    new_id,
    write,
)
from gpumon.sdc.fingerprint import Fingerprint, fingerprint_tensor

log = logging.getLogger("gpumon.guard")

CommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


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


class Guard:
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
    """

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer,
                 *, weight_check_every: int = 100, on_alarm: str = "raise",
                 callback: Callable[[GuardAlarm], None] | None = None, strict: bool = False,
                 timeout_s: float = 120.0, spool_dir: str | Path | None = None,
                 comm_hook: CommHook | None = None, comm_state: Any = None,
                 write_verdicts: bool = True) -> None:
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
        self._flags: list[_BucketFlags] = []
        self._lock = threading.Lock()
        self._inner: CommHook = comm_hook if comm_hook is not None else default_hooks.allreduce_hook
        self._inner_state = comm_state
        module = model.module
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._name_of = {id(p): n for n, p in self._named}
        self._device = next((p.device for _, p in self._named), torch.device("cpu"))
        # The guard's own group: gloo, CPU tensors, its own timeout. A wedged peer then costs
        # timeout_s and a log line, never a hang of the training (the default group's NCCL timeout
        # is 10 minutes, and a flag all-reduce on it would also add a device sync per step).
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.identity = identify(self.rank, self.world, self._device)
        gathered: list[Any] = [None] * self.world
        self.identities: list[Identity] = [self.identity] * self.world
        try:
            dist.all_gather_object(gathered, self.identity, group=self._group)
            self.identities = [g if isinstance(g, Identity) else self.identity for g in gathered]
        except Exception as exc:
            self._internal("gathering the ranks' identities", exc)
        model.register_comm_hook(None, self._hook)

    # -- the comm hook -------------------------------------------------------------------------

    def _hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        flags: _BucketFlags | None = None
        if self.disabled is None:
            try:
                buf = bucket.buffer()
                # one 0-d flag per bucket, on the device: no host sync inside the backward
                flags = _BucketFlags(bucket.index(), torch.logical_not(torch.isfinite(buf).all()),
                                     params=list(bucket.parameters()))
            except Exception as exc:
                self._internal("the pre-reduce check", exc, raise_strict=False)
        fut = self._inner(self._inner_state, bucket)
        if flags is None:
            return fut

        def after(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = done.value()
            try:
                reduced = value[0] if isinstance(value, (list, tuple)) else value
                flags.reduced_bad = torch.logical_not(torch.isfinite(reduced).all())
                with self._lock:
                    self._flags.append(flags)
            except Exception as exc:  # never fail the bucket's future: DDP would raise in backward
                self._internal("the post-reduce check", exc, raise_strict=False)
            return value

        return fut.then(after)

    # -- before / after optimizer.step() ------------------------------------------------------------

    def step(self) -> bool:
        """``before_step``, ``optimizer.step()`` unless an alarm stopped it, ``after_step``.
        True when the update was applied."""
        try:
            ok = self.before_step()
        except GuardAlarm:
            self.after_step()
            raise
        if ok:
            self.optimizer.step()
        self.after_step()
        return ok

    def before_step(self) -> bool:
        """Judge this step's gradients on every rank at once. False (or ``GuardAlarm``): do not call
        ``optimizer.step()`` — the same answer on every rank, so the weights stay equal."""
        with self._lock:
            flags, self._flags = self._flags, []
        if self.disabled is not None:
            if self.strict:
                raise GuardError(f"gpumon.guard is off: {self.disabled}")
            return True
        try:
            alarm = self._judge_gradients(flags)
        except Exception as exc:
            self._internal("the gradient check", exc)
            return True
        if alarm is None:
            return True
        self.skipped_steps.append(self.steps)
        self._raise_or_log(alarm)
        return False

    def after_step(self) -> None:
        """Count the step; the weight check when it is due."""
        self.steps += 1
        if self.weight_check_every and self.steps % self.weight_check_every == 0:
            self.check_weights()

    def _judge_gradients(self, flags: list[_BucketFlags]) -> GuardAlarm | None:
        local = [f.local_bad for f in flags if f.local_bad is not None]
        reduced = [f.reduced_bad for f in flags if f.reduced_bad is not None]
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
        step = self.steps
        if bad_local:
            where = self._bad_params(flags, local=True) if self.rank in bad_local else []
            return self._alarm([self._verdict(
                r, "nonfinite_grad", step,
                f"step {step}: rank {r}'s local gradients have NaN/Inf before the all-reduce "
                f"({self.identities[r].describe()}); the update is skipped on every rank",
                ranks_nonfinite_local=bad_local, ranks_nonfinite_reduced=bad_reduced,
                **({"parameters": where} if r == self.rank else {})) for r in bad_local], skipped=True)
        if bad_reduced:
            every = len(bad_reduced) == self.world
            verdicts = []
            for r in bad_reduced:
                what = ("the all-reduce itself (every rank's inputs were finite, every rank's result is "
                        "not)" if every else f"rank {r}'s result of the all-reduce (finite inputs on every "
                        f"rank; {len(bad_reduced)} of {self.world} ranks got NaN/Inf)")
                verdicts.append(self._verdict(
                    r, "nonfinite_reduce", step,
                    f"step {step}: NaN/Inf after the all-reduce with finite inputs everywhere: {what}; "
                    "the update is skipped on every rank", ranks_nonfinite_reduced=bad_reduced,
                    reduce_on_every_rank=every))
            # The all-reduce on every rank names no GPU: no node file (the fabric probe is the tool).
            return self._alarm(verdicts, skipped=True, write_files=not every)
        return None

    def _bad_params(self, flags: list[_BucketFlags], *, local: bool) -> list[str]:
        """Names of this rank's parameters with non-finite gradients (only computed on an alarm)."""
        out: list[str] = []
        for f in flags:
            bad = f.local_bad if local else f.reduced_bad
            if bad is None or not bool(bad):
                continue
            for p in f.params:
                g = p.grad
                if g is not None and not bool(torch.isfinite(g).all()):
                    out.append(self._name_of.get(id(p), f"bucket {f.index}"))
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

    def _compare_weights(self) -> WeightReport:
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
        verdicts: list[Verdict] = []
        majority = groups[0] if self.world >= 3 and len(groups[0]) * 2 > self.world else None
        if majority is not None:
            ref = gathered[majority[0]]
            for r in sorted(r for g in groups[1:] for r in g):
                first, count = _first_difference(gathered[r], ref)
                name = self._named[first][0]
                verdicts.append(self._verdict(
                    r, "weights", step,
                    f"{when}: rank {r}'s weights differ from the majority ({len(majority)} of "
                    f"{self.world} replicas agree), first at parameter {name!r} "
                    f"({self.identities[r].describe()}); not rerun, so transient or persistent is "
                    "unknown", first_parameter=name, parameter_index=first, parameters_differing=count,
                    fingerprint=_fp(gathered[r][first]), majority_fingerprint=_fp(ref[first]),
                    majority_ranks=majority))
        else:
            for g in groups:
                for r in g:
                    other = next(o for o in range(self.world) if o not in g)
                    first, count = _first_difference(gathered[r], gathered[other])
                    name = self._named[first][0]
                    why = ("two replicas cannot outvote each other" if self.world == 2
                           else f"no strict majority among {self.world} replicas")
                    verdicts.append(self._verdict(
                        r, "weights", step,
                        f"{when}: weights disagree between replicas ({why}): rank {r} "
                        f"({self.identities[r].describe()}) differs from rank {other} first at parameter "
                        f"{name!r}; which is wrong is unknown", first_parameter=name, parameter_index=first,
                        parameters_differing=count, fingerprint=_fp(gathered[r][first]),
                        groups=groups, other_rank=other,
                        other=self.identities[other].describe()))
        return WeightReport(step, groups, verdicts)

    # -- verdicts ----------------------------------------------------------------------------------

    def _verdict(self, rank: int, check: str, step: int, message: str, **evidence: Any) -> Verdict:
        subject = self.identities[rank]
        when = time.time()
        return Verdict(check=check, fault="unknown", step=step, message=message, subject=subject,
                       evidence=evidence, job=job_id(), time=when, id=new_id(subject, when))

    def _alarm(self, verdicts: list[Verdict], *, skipped: bool, write_files: bool = True) -> GuardAlarm:
        for v in verdicts:
            # each named rank reports itself, on its own node, to that node's daemon
            if write_files and self.write_verdicts and v.subject.rank == self.rank:
                try:
                    self.verdict_files.append(write(v, self.spool_dir))
                except OSError as exc:
                    log.error("gpumon.guard: could not write the verdict for the node's daemon: %s "
                              "(is the spool directory there and writable by this job?)", exc)
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


def _fp(row: torch.Tensor) -> str:
    plain, weighted = (int(v) & 0xFFFFFFFFFFFFFFFF for v in row.tolist())
    return Fingerprint(plain, weighted).hex()


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(index of the first parameter whose fingerprints differ, how many differ)."""
    diff = (a != b).any(dim=1).nonzero().reshape(-1)
    return int(diff[0]), int(diff.numel())
