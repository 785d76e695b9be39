"""The verdict of a step (imports torch): check 1's flags judged on every rank at once (the
exchange among ranks whose all-reduce result alone was non-finite, the reruns), check 2's audit on
its steps, and the failing step kept by the rank a verdict names.
"""

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpumon.guard import rerun
from gpumon.guard.after import grads_of, reduced_nonfinite
from gpumon.guard.alarm import GuardAlarm
from gpumon.guard.audit import AuditError, Auditor, LossFn, SettleFailed, step_seed
from gpumon.guard.hook import BucketFlags
from gpumon.guard.verdict import Verdict, spool_dir
from gpumon.guard.weights import WeightCheckMixin

log = logging.getLogger("gpumon.guard")

# How long ranks whose all-reduce result was non-finite wait for each other: every rank that got
# such a result arrives within one step's skew (the result reached them all at once); one that never
# arrives got a finite result. Bounded well below the guard's timeout_s (120 s): the job waits this
# long once, on such a step only, and the ranks that did not come, already waiting in the guard's
# next collective (the weight check, bounded by timeout_s), are still there when the wait ends.
REDUCE_EXCHANGE_TIMEOUT_S = 15.0
REDUCE_EXCHANGE_SHARE = 0.25  # of timeout_s, when that is less


class StepVerdictMixin(WeightCheckMixin):
    """``Guard``'s verdict of a step: ``_judge_gradients`` (check 1), ``_audit`` (check 2), and
    ``_keep`` (the named rank keeps the failing step)."""

    model: torch.nn.parallel.DistributedDataParallel
    _auditor: Auditor | None
    audit_off: str | None
    audits: int
    seed: int
    bundle_dir: str | Path | None
    bundles: list[Path]
    model_factory: Callable[..., torch.nn.Module] | None
    model_kwargs: dict[str, Any] | None
    _loss_fn: LossFn | None
    _device: torch.device
    _named: list[tuple[str, torch.nn.Parameter]]
    _name_of: dict[int, str]
    _reduce_group: Any
    _exchange_off: str | None

    # -- check 1: non-finite gradients ---------------------------------------------------------

    def _judge_gradients(self, flags: list[BucketFlags], batch: Any = None,
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
        got = self._exchange_flags(step, [True], "all-reduce result has")
        return [self.rank] if got is None else got[0]

    def _exchange_flags(self, step: int, mine: list[bool], what: str) -> list[list[int]] | None:
        """The ranks whose result is non-finite meet on the reduce-exchange group (bounded by its
        timeout): for each of this rank's ``mine`` flags, the ranks that set it. None: not every rank
        came (only some results were non-finite), logged once; that group is not used again."""
        vec = torch.zeros(len(mine), self.world, dtype=torch.int32)
        for i, flag in enumerate(mine):
            vec[i, self.rank] = int(flag)
        try:
            dist.all_reduce(vec, group=self._reduce_group)
        except Exception as exc:
            # Only the exchange's own group is out of step (the others never came): the rest of the
            # guard stays on, so that the next weight check, on its own group, names this replica,
            # which skipped an update the others applied.
            self._exchange_off = f"{type(exc).__name__}: {exc}"
            log.error("gpumon.guard: step %d: this rank's %s NaN/Inf and not every rank's does (%s); this "
                      "rank skips the update the others apply, so its weights now differ from theirs and the "
                      "weight check names it", step, what, self._exchange_off)
            return None
        return [[r for r in range(self.world) if vec[i, r]] for i in range(len(mine))]

    def _bad_params(self, flags: list[BucketFlags], *, local: bool) -> list[str]:
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

    # -- check 1 in mode "after": the reduced gradients, the rank named afterwards ------------------

    def _judge_after(self, loss: torch.Tensor | None, batch: Any) -> GuardAlarm | None:
        """Check 1 with ``nonfinite="after"``: one fused NaN/Inf pass over the reduced gradients
        (every rank's are the same, so every rank reaches the same answer with no collective; the
        flag's read is the step's one host sync). On a hit the ranks that saw it meet (bounded): if
        every rank did, the rank whose gradients it came from is named by its loss (NaN/Inf where
        the loop handed it in) and by the reruns (every rank computes its micro-batch again, and
        another rank computes it too), or said to be unknown; if not every rank did, this rank's
        result of the all-reduce is named, as in mode "hook"."""
        step = self.steps
        bad = reduced_nonfinite(grads_of([p for _, p in self._named]))
        if bad is None or not bool(bad):  # the one host sync of the step
            return None
        self._bad_step = True
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        saw, loss_ranks = self._exchange_after(step, loss_bad)
        where = self._bad_reduced_params()
        common: dict[str, Any] = {"nonfinite_mode": "after", "ranks_nonfinite_reduced": saw,
                                  "parameters": where}
        if len(saw) < self.world:
            v = self._verdict(
                self.rank, "nonfinite_reduce", step,
                f"step {step}: NaN/Inf in rank {self.rank}'s reduced gradients and not in every rank's (the "
                "all-reduce gave the ranks different results, or this rank's gradients changed after it); "
                "the update is skipped on this rank only: the ranks whose result was finite applied it, so "
                "this replica's weights now differ from theirs (the weight check names it)",
                reduce_on_every_rank=False, replica_diverged=True, **common)
            return self._alarm([v], skipped=True, every_rank=False)
        reran: dict[int, tuple[bool, bool | None, list[dict[str, Any]]]] = {}
        diverged = None
        not_rerun = ""
        if self._auditor is None:
            not_rerun = ("no rerun: the guard was given no batch_for and loss_fn to compute a micro-batch "
                         "again")
        else:
            diverged = self._diverged_before(step, "the rerun of check 1")
            if diverged is not None:
                not_rerun = ("not rerun: the replicas' weights differ (see the weight verdict), so a rerun "
                             "on another GPU would start from other weights")
            else:
                try:
                    reran = self._auditor.rerun_every(step)
                except Exception as exc:
                    # the gradients are known to be NaN/Inf: the update is skipped all the same, only
                    # the naming is lost (a peer gone mid-rerun turns the guard off)
                    if not isinstance(exc, AuditError):
                        self._internal("the rerun of check 1", exc, raise_strict=False)
                    log.error("gpumon.guard: step %d: the rerun of the non-finite gradients failed: %s", step,
                              exc)
                    not_rerun = f"the reruns failed ({type(exc).__name__}: {exc})"
        named: dict[int, tuple[str, str, dict[str, Any]]] = {}
        for r in range(self.world):
            again_bad, there_bad, rows = reran.get(r, (False, None, []))
            evidence: dict[str, Any] = {"reruns": rows} if rows else {}
            if rows and again_bad:
                fault, why = rerun.nonfinite_fault(True, there_bad)
                named[r] = (fault, f"named by its rerun; {fault}: {why}",
                            {**evidence, "rerun_judgement": why})
            elif r in loss_ranks and rows:
                fault, why = rerun.nonfinite_fault(False, there_bad)
                named[r] = (fault, f"named by its loss, which was NaN/Inf; {fault}: {why}",
                            {**evidence, "rerun_judgement": why})
            elif r in loss_ranks:
                named[r] = ("unknown", f"named by its loss, which was NaN/Inf; {not_rerun}", {})
        verdicts = []
        for r, (fault, why, evidence) in sorted(named.items()):
            v = self._verdict(
                r, "nonfinite_grad", step,
                f"step {step}: rank {r}'s local gradients had NaN/Inf, seen after the all-reduce in "
                f"every rank's reduced gradients ({self.identities[r].describe()}); {why}; the update is "
                "skipped on every rank", fault=fault, source_known=True, ranks_named=sorted(named),
                ranks_nonfinite_loss=loss_ranks, **common, **evidence)
            verdicts.append(self._keep(v, r, step, batch if r == self.rank else None))
        unfiled = []
        if not named:
            if not not_rerun:
                not_rerun = ("every rank computed its micro-batch again and got finite gradients: a "
                             "transient fault, of one rank's GPU or of the all-reduce, that no rerun "
                             "reproduces")
            no_loss = ("; the loop handed no loss to guard.step()" if loss is None
                       else "; no rank's loss was NaN/Inf")
            for r in range(self.world):
                v = self._verdict(
                    r, "nonfinite_grad", step,
                    f"step {step}: NaN/Inf in the reduced gradients after the all-reduce, on every rank "
                    f"({self.identities[r].describe()}); whose gradients it came from is not known: "
                    f"{not_rerun}{no_loss} (nonfinite='after' sees only the sum of every rank's gradients; "
                    "nonfinite='hook' sees each rank's own); the update is skipped on every rank",
                    source_known=False, ranks_nonfinite_loss=loss_ranks, rerun_judgement=not_rerun, **common)
                unfiled.append(v)
            verdicts = unfiled
        if diverged is not None:
            verdicts = diverged.verdicts + verdicts
        # no GPU named: nothing for a node's daemon (the weight verdicts of a diverged replica still go)
        return self._alarm(verdicts, skipped=True, unfiled=unfiled)

    def _exchange_after(self, step: int, loss_bad: bool) -> tuple[list[int], list[int]]:
        """This rank's reduced gradients are non-finite: which ranks' are, and whose loss was? Every
        rank whose reduced gradients are comes here (all of them, when a rank's local gradients were
        non-finite); if one does not, the wait ends after REDUCE_EXCHANGE_TIMEOUT_S and this rank
        names itself alone, as ``_exchange_reduced`` does (that group is then not used again)."""
        if self._exchange_off is not None:
            return [self.rank], ([self.rank] if loss_bad else [])
        got = self._exchange_flags(step, [True, loss_bad], "reduced gradients have")
        if got is None:
            return [self.rank], ([self.rank] if loss_bad else [])
        return got[0], got[1]

    def _bad_reduced_params(self) -> list[str]:
        """Names of the parameters whose reduced gradients are non-finite (the same on every rank;
        only on an alarm; best effort, as ``_bad_params``)."""
        out: list[str] = []
        try:
            for name, p in self._named:
                got = grads_of([p])
                if got and not bool(torch.isfinite(got[0]).all()):
                    out.append(name)
        except Exception as exc:
            log.error("gpumon.guard: could not name the parameters with non-finite gradients: %s: %s",
                      type(exc).__name__, exc)
        return out[:20]

    # -- check 2: the audit ------------------------------------------------------------------------

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

    # -- the failing step, kept ----------------------------------------------------------------------

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
