"""The guard under FSDP and HSDP (imports torch; ``gpumon.guard`` loads it on first use).

What applies when the weights are sharded (docs/guard/fsdp.md's table says the same, per strategy):

- **check 3, weights**: under HSDP (FSDP1 ``ShardingStrategy.HYBRID_SHARD``, FSDP2 ``fully_shard``
  on a 2-D ``(replicate, shard)`` mesh) every replica group holds the same shards: rank (replica i,
  shard j) must hold the same bits as rank (replica k, shard j). Each rank fingerprints its own
  LOCAL shard of every parameter (FSDP1: its part of each ``FlatParameter``, split per original
  parameter; FSDP2: each DTensor's ``to_local()``), the fingerprints are all-gathered on the guard's
  gloo group and compared within each shard group (the ranks with the same shard index); a strict
  majority of >= 3 replicas names the odd rank, its replica, shard and first differing parameter.
  Pure sharding (FULL_SHARD, SHARD_GRAD_OP, a 1-D mesh) has one replica: no rank holds what
  another holds, nothing can be compared, and the check says "not applicable" (it never passes).
- **check 1, non-finite gradients**: after the backward each rank tests its local gradient SHARDS
  (what the reduce-scatter, and under HSDP the all-reduce across replicas, left it) and the flags
  of every rank are all-reduced on the guard's group: one small collective per step (a 3 x world
  int32 tensor), so the update is skipped on every rank or on none. Under FSDP2 each rank also flags
  its LOCAL gradients before the reduce-scatter (``set_custom_reduce_scatter`` wraps the default
  one), so the rank whose backward went non-finite is named, as under DDP. FSDP1 has no hook
  before its reduce-scatter for hybrid strategies (``register_comm_hook`` refuses them), so there
  the alarm says which ranks' shards hold NaN/Inf and that the source is unknown (the
  reduce-scatter sums every rank's gradients before any rank sees them); such a verdict names no
  GPU and no node file is written.
- **check 2, the audit** does not apply: a rank holds only its shard of the weights, so it cannot
  recompute another rank's micro-batch alone; doing it would take every rank's forward and backward
  again, with the all-gathers, on other micro-batches: a whole extra step. Not built; nor are the
  reruns (they recompute a micro-batch the same way) or verified checkpoints (``save_checkpoint``
  compares whole replicas).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from gpumon.guard.alarm import GuardAlarm, GuardError
from gpumon.guard.base import GuardBase
from gpumon.guard.hook import nonfinite
from gpumon.guard.identity import identify
from gpumon.guard.verdict import Identity, Verdict
from gpumon.guard.weights import fingerprint_hex, first_difference
from gpumon.sdc.fingerprint import fingerprint_tensor

log = logging.getLogger("gpumon.guard")


@dataclass(frozen=True)
class Place:
    """Where a rank sits in the sharding: replica ``replica`` of ``replicas``, shard ``shard`` of
    ``shards`` (its shard group: the ranks of every replica with the same shard index)."""

    replica: int
    replicas: int
    shard: int
    shards: int
    strategy: str  # "FSDP1 HYBRID_SHARD", "FSDP2 2-D mesh (replicate, shard)", ...

    def describe(self) -> str:
        return f"replica {self.replica}, shard {self.shard}"


@dataclass(frozen=True)
class ShardedWeightReport:
    """One weight check under FSDP/HSDP. ``applicable`` False: one replica, nothing to compare
    (``reason`` says why); ``groups``: per shard index, the ranks with equal fingerprints, largest
    group first."""

    step: int
    applicable: bool
    reason: str
    groups: dict[int, list[list[int]]] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def agree(self) -> bool | None:
        """True: every shard group agrees; False: one does not; None: not applicable."""
        if not self.applicable:
            return None
        return all(len(g) == 1 for g in self.groups.values())


def place_of(model: torch.nn.Module, mesh: Any = None) -> Place:
    """This rank's replica and shard. ``mesh``: the ``DeviceMesh`` the model was sharded on (a 2-D
    mesh: dim 0 replicates, dim 1 shards, FSDP's convention; 1-D: shards only); None: read from the
    model (FSDP1's process groups, FSDP2's DTensor placements)."""
    from torch.distributed.fsdp import FSDPModule, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if mesh is not None:
        if mesh.ndim == 2:
            return Place(mesh.get_local_rank(0), mesh.size(0), mesh.get_local_rank(1), mesh.size(1),
                         "2-D mesh (replicate, shard)")
        if mesh.ndim == 1:
            return Place(0, 1, mesh.get_local_rank(0), mesh.size(0), "1-D mesh (shard)")
        raise ValueError(f"ShardedGuard: mesh: {mesh.ndim}-D; the guard knows 1-D (shard) and 2-D "
                         "(replicate, shard) meshes")
    if isinstance(model, FSDP):
        strategy = model.sharding_strategy
        pg = model.process_group
        hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
        if hybrid:
            inter = model._inter_node_pg
            return Place(dist.get_rank(inter), dist.get_world_size(inter), dist.get_rank(pg),
                         dist.get_world_size(pg), f"FSDP1 {strategy.name}")
        if strategy == ShardingStrategy.NO_SHARD:
            return Place(dist.get_rank(pg), dist.get_world_size(pg), 0, 1, "FSDP1 NO_SHARD")
        return Place(0, 1, dist.get_rank(pg), dist.get_world_size(pg), f"FSDP1 {strategy.name}")
    if isinstance(model, FSDPModule):
        for p in model.parameters():
            if isinstance(p, DTensor):
                m, placements = p.device_mesh, p.placements
                rep = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
                sh = [d for d, pl in enumerate(placements) if isinstance(pl, Shard)]
                if len(rep) > 1 or len(sh) != 1 or len(rep) + len(sh) != m.ndim:
                    raise ValueError(f"ShardedGuard: placements {placements}: the guard knows (Shard) "
                                     "and (Replicate, Shard) meshes")
                if rep:
                    return Place(m.get_local_rank(rep[0]), m.size(rep[0]), m.get_local_rank(sh[0]),
                                 m.size(sh[0]), "FSDP2 2-D mesh (replicate, shard)")
                return Place(0, 1, m.get_local_rank(sh[0]), m.size(sh[0]), "FSDP2 1-D mesh (shard)")
        raise ValueError("ShardedGuard: the fully_shard'ed model has no DTensor parameter")
    raise ValueError(f"ShardedGuard: {type(model).__name__} is neither FullyShardedDataParallel nor a "
                     "fully_shard'ed module (for DistributedDataParallel use Guard)")


def local_pieces(model: torch.nn.Module, *, grads: bool = False) -> list[tuple[str, torch.Tensor]]:
    """This rank's local shard of every trainable parameter (``grads``: of its gradient; a
    parameter without one is left out), named by its FQN: FSDP2's DTensor ``to_local()``; FSDP1's
    ``FlatParameter`` local shard split per original parameter (a parameter outside this rank's
    shard is left out: its shard group's ranks leave out the same)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):
        out = []
        for n, p in model.named_parameters():
            t = p.grad if grads else p
            if p.requires_grad and t is not None:
                out.append((n, t.to_local() if isinstance(t, DTensor) else t))
        return out
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    out = []
    for prefix, mod in model.named_modules():
        handle: Any = getattr(mod, "_handle", None) if isinstance(mod, FSDP) else None
        if handle is None:
            continue
        flat: Any = handle.flat_param
        if not flat.requires_grad:
            continue
        if grads:
            data = flat.grad
            if data is None:
                continue
        else:
            shard = getattr(flat, "_local_shard", None)
            # sharded (after the step) the flat parameter IS the local shard, and _local_shard
            # holds it too; a strategy that keeps it unsharded between steps points flat elsewhere
            data = shard if shard is not None and shard.numel() else flat.detach()
        base = clean_tensor_name(prefix)
        for fqn, info in zip(flat._fqns, flat._shard_param_infos, strict=True):
            if not info.in_shard:
                continue
            name = clean_tensor_name(f"{base}.{fqn}" if base else fqn)
            out.append((name, data[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]))
    return out


def _flagging_reduce_scatter(guard: ShardedGuard) -> Any:
    """FSDP2's default reduce-scatter, first flagging NaN/Inf in its input: this rank's local,
    unsharded gradients (one 0-d flag on the device per call, no host sync)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class FlaggingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
            if guard.disabled is None:
                try:
                    guard._pending_local.append(nonfinite(input_tensor))
                except Exception as exc:  # never fail FSDP's backward
                    guard._internal("the pre-reduce-scatter check", exc, raise_strict=False)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return FlaggingReduceScatter()


class ShardedGuard(GuardBase):
    """SDC checks in an FSDP / HSDP training step (see this module's docstring for what applies).

    ``model``: the root ``FullyShardedDataParallel`` or the root ``fully_shard``'ed module;
    ``mesh``: its ``DeviceMesh`` (optional: read from the model otherwise). ``step()``,
    ``before_step()``, ``after_step()``, ``check_weights()``, ``on_alarm``, ``callback``,
    ``strict``, ``timeout_s``, ``spool_dir`` as for ``Guard``. ``checks``: each check and whether
    it applies here (and why not)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mesh: Any = None,
                 weight_check_every: int = 100, on_alarm: str = "raise",
                 callback: Callable[[GuardAlarm], None] | None = None, strict: bool = False,
                 timeout_s: float = 120.0, spool_dir: str | Path | None = None,
                 write_verdicts: bool = True) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__(model, optimizer, weight_check_every=weight_check_every, on_alarm=on_alarm,
                         callback=callback, strict=strict, timeout_s=timeout_s, spool_dir=spool_dir,
                         write_verdicts=write_verdicts)
        self.place = place_of(model, mesh)
        self._pending_local: list[torch.Tensor] = []
        self._pieces = local_pieces(model)
        self._grads = [p for p in model.parameters() if p.requires_grad]
        self._device = next((t.device for _, t in self._pieces), torch.device("cpu"))
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.identity = identify(self.rank, self.world, self._device)
        # Once: every rank's identity, place and the names of its local pieces (fixed for the run:
        # FSDP never reshards differently), so that each check gathers only fingerprints.
        mine = (self.identity, self.place, [n for n, _ in self._pieces])
        said: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(said, mine, group=self._group)
        except Exception as exc:  # a rank later than timeout_s: off (as Guard), training goes on
            self._internal("gathering the ranks' identities and places", exc)
            said = [mine] * self.world
        self.identities: list[Identity] = [s[0] for s in said]
        self.places: list[Place] = [s[1] for s in said]
        self._names: list[list[str]] = [s[2] for s in said]
        self._problem = self._check_layout() if self.disabled is None else ""
        if self._problem:
            raise ValueError(f"ShardedGuard: {self._problem}")
        self.replicas = self.place.replicas
        self.shards = self.place.shards
        self._fsdp2 = isinstance(model, FSDPModule)
        self._pre_reduce = self._fsdp2 and self.shards > 1
        if self._pre_reduce:
            try:
                for mod in model.modules():
                    if isinstance(mod, FSDPModule) and mod._get_fsdp_state()._fsdp_param_groups:
                        mod.set_custom_reduce_scatter(_flagging_reduce_scatter(self))
            except Exception as exc:  # a private interface of torch's: without it, the shards only
                # (the same on every rank: the same torch, the same model)
                log.error("gpumon.guard: cannot flag the gradients before FSDP2's reduce-scatter (%s: %s); "
                          "check 1 looks at the reduced shards only", type(exc).__name__, exc)
                self._pre_reduce = False
        shape = f"{self.replicas} replica(s) x {self.shards} shard(s), {self.place.strategy}"
        self.checks: dict[str, str] = {
            "nonfinite_grad": "on: " + (
                "local gradients flagged before the reduce-scatter, reduced shards after" if self._pre_reduce
                else "reduced gradient shards after the backward (the source rank is not known: "
                     f"{self._no_inputs_why()})"),
            "weights": (f"on: shard by shard across {self.replicas} replicas" if self.replicas > 1 else
                        f"not applicable: {shape}: every shard is held by one rank only, there is no "
                        "other replica to compare it with"),
            "audit": "not applicable: a rank holds only its shard of the weights and cannot recompute "
                     "another rank's micro-batch alone (not built)",
        }
        if self.replicas == 1 and self.rank == 0:
            log.warning("gpumon.guard: weight check: %s", self.checks["weights"])

    def _check_layout(self) -> str:
        first = self.places[0]
        seen: dict[tuple[int, int], int] = {}
        for r, p in enumerate(self.places):
            if (p.replicas, p.shards) != (first.replicas, first.shards):
                return f"rank {r} says {p.replicas} x {p.shards}, rank 0 {first.replicas} x {first.shards}"
            if (p.replica, p.shard) in seen:
                return (f"ranks {seen[(p.replica, p.shard)]} and {r} both say replica {p.replica}, "
                        f"shard {p.shard}")
            seen[(p.replica, p.shard)] = r
        if first.replicas * first.shards != self.world:
            return f"{first.replicas} replicas x {first.shards} shards is not the world size {self.world}"
        for j in range(first.shards):
            members = self.shard_group(j)
            if any(self._names[r] != self._names[members[0]] for r in members):
                return (f"the ranks of shard {j} ({members}) do not hold the same parameters: the replica "
                        "groups are not sharded alike")
        return ""

    def shard_group(self, shard: int) -> list[int]:
        """The ranks holding shard ``shard``, in replica order."""
        return sorted((r for r, p in enumerate(self.places) if p.shard == shard),
                      key=lambda r: self.places[r].replica)

    # -- check 1 -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """``before_step``, ``optimizer.step()`` unless an alarm stopped it, ``after_step``."""
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
        """Judge this step's gradients on every rank at once (one small all-reduce on the guard's
        group). False (or ``GuardAlarm``): do not call ``optimizer.step()``, on any rank."""
        pending, self._pending_local = self._pending_local, []
        if self.disabled is not None:
            if self.strict and not self._closed:
                raise GuardError(f"gpumon.guard is off: {self.disabled}")
            return True
        self._bad_step = False
        try:
            alarm = self._judge_gradients(pending)
        except Exception as exc:
            return self._judged_bad("the gradient check", exc)
        if alarm is None:
            return True
        self.skipped_steps.append(self.steps)
        self._raise_or_log(alarm)
        return False

    def _local_grads(self) -> list[torch.Tensor]:
        out = []
        for p in self._grads:
            g = p.grad
            if g is not None:
                out.append(g.to_local() if isinstance(g, DTensor) else g)
        return out

    def _judge_gradients(self, pending: list[torch.Tensor]) -> GuardAlarm | None:
        grads = [g for g in self._local_grads() if g.numel()]
        # rows: local gradients non-finite before the reduce-scatter; reduced shards non-finite;
        # this rank's reduce-scatter ran through the guard this step (else its inputs are unknown)
        mine = torch.zeros(3, dtype=torch.int32)
        if pending:
            mine[0] = int(torch.stack(pending).any())
            mine[2] = 1
        if grads:
            mine[1] = int(torch.stack([nonfinite(g) for g in grads]).any())
        vec = torch.zeros(3, self.world, dtype=torch.int32)
        vec[:, self.rank] = mine
        dist.all_reduce(vec, group=self._group)
        bad_local = [r for r in range(self.world) if vec[0, r]]
        bad_shards = [r for r in range(self.world) if vec[1, r]]
        inputs_seen = bool(vec[2].all())
        step = self.steps
        self._bad_step = bool(bad_local or bad_shards)
        if bad_local:
            where = self._bad_params() if self.rank in bad_local else []
            verdicts = [self._verdict(
                r, "nonfinite_grad", step,
                f"step {step}: rank {r}'s local gradients have NaN/Inf before the reduce-scatter "
                f"({self.places[r].describe()}; {self.identities[r].describe()}); the update is skipped "
                "on every rank", ranks_nonfinite_local=bad_local, ranks_nonfinite_shards=bad_shards,
                **self._place_evidence(r, where))
                for r in bad_local]
            return self._alarm(verdicts, skipped=True)
        if not bad_shards:
            return None
        where = self._bad_params() if self.rank in bad_shards else []
        if self._pre_reduce and inputs_seen:
            every = len(bad_shards) == self.world
            what = (f"every rank's local gradients were finite before the reduce-scatter and the reduced "
                    f"shards of ranks {bad_shards} are not: the reduction itself")
            verdicts = [self._verdict(
                r, "nonfinite_reduce", step,
                f"step {step}: {what} (rank {r}, {self.places[r].describe()}); the update is skipped on "
                "every rank", ranks_nonfinite_shards=bad_shards, reduce_on_every_rank=every,
                **self._place_evidence(r, where))
                for r in bad_shards]
            return self._alarm(verdicts, skipped=True, write_files=not every)
        verdicts = [self._verdict(
            r, "nonfinite_grad", step,
            f"step {step}: rank {r}'s reduced gradient shard holds NaN/Inf ({self.places[r].describe()}); "
            "which rank's gradients caused it is unknown (the reduce-scatter sums every rank's gradients "
            f"before any rank sees them, and {self._no_inputs_why()}); the update is skipped on every rank",
            ranks_nonfinite_shards=bad_shards, source_known=False,
            **self._place_evidence(r, where))
            for r in bad_shards]
        # no GPU is named: nothing for a node's daemon
        return self._alarm(verdicts, skipped=True, write_files=False)

    def _no_inputs_why(self) -> str:
        if self._pre_reduce:
            return "not every rank's reduce-scatter ran through the guard this step"
        if self._fsdp2:
            return "the guard could not wrap FSDP2's reduce-scatter (logged at start)"
        if "HYBRID" in self.place.strategy:
            return "FSDP1 gives no hook before it for hybrid sharding"
        return "the guard has no hook before FSDP1's reduce-scatter (not built)"

    def _bad_params(self) -> list[str]:
        """This rank's parameters whose local gradient shard is non-finite (only on an alarm; best
        effort, as Guard's)."""
        try:
            return [n for n, g in local_pieces(self.model, grads=True)
                    if g.numel() and not bool(torch.isfinite(g).all())][:20]
        except Exception as exc:
            log.error("gpumon.guard: could not name the parameters with non-finite gradients: %s: %s",
                      type(exc).__name__, exc)
            return []

    def after_step(self) -> None:
        """Count the step; the weight check when it is due."""
        self.steps += 1
        if self.weight_check_every and self.steps % self.weight_check_every == 0:
            self.check_weights()

    # -- check 3 -----------------------------------------------------------------------------------

    def check_weights(self) -> ShardedWeightReport | None:
        """Compare the replicas' copies of every shard by fingerprint. None when the guard is off;
        ``applicable`` False with one replica (nothing to compare: said, never a pass); raises
        ``GuardAlarm`` (``on_alarm="raise"``) on a mismatch."""
        step = self.steps - 1
        if self.replicas < 2:
            return ShardedWeightReport(step, False, self.checks["weights"].removeprefix("not applicable: "))
        if self.disabled is not None:
            return None
        try:
            report = self._compare_weights(step)
        except Exception as exc:
            self._internal("the weight check", exc)
            return None
        if report.verdicts:
            self._raise_or_log(self._alarm(report.verdicts, skipped=False))
        return report

    def _compare_weights(self, step: int) -> ShardedWeightReport:
        width = max(len(n) for n in self._names)
        local = torch.zeros(width, 2, dtype=torch.int64)
        with torch.no_grad():
            if self._pieces:
                local[:len(self._pieces)] = torch.stack(
                    [fingerprint_tensor(t.detach()) for _, t in self._pieces]).to("cpu")
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self._group)
        when = f"after step {step}" if step >= 0 else "before the first step"
        groups: dict[int, list[list[int]]] = {}
        verdicts: list[Verdict] = []
        for j in range(self.shards):
            members = self.shard_group(j)
            k = len(self._names[members[0]])
            rows = {r: gathered[r][:k] for r in members}
            keys: dict[bytes, list[int]] = {}
            for r in members:
                keys.setdefault(rows[r].numpy().tobytes(), []).append(r)
            split = sorted(keys.values(), key=lambda g: (-len(g), g))
            groups[j] = split
            if len(split) == 1:
                continue
            names = self._names[members[0]]
            n = len(members)
            majority = split[0] if n >= 3 and len(split[0]) * 2 > n else None
            if majority is not None:
                ref = rows[majority[0]]
                for r in sorted(r for g in split[1:] for r in g):
                    first, count = first_difference(rows[r], ref)
                    verdicts.append(self._verdict(
                        r, "weights", step,
                        f"{when}: rank {r} ({self.places[r].describe()}) holds shard {j} differently from "
                        f"the other replicas ({len(majority)} of {n} agree: ranks {majority}), first at "
                        f"parameter {names[first]!r} ({self.identities[r].describe()}); not rerun, so "
                        "transient or persistent is unknown",
                        first_parameter=names[first], parameter_index=first, parameters_differing=count,
                        fingerprint=fingerprint_hex(rows[r][first]),
                        majority_fingerprint=fingerprint_hex(ref[first]),
                        majority_ranks=majority, shard_group=members, **self._place_evidence(r)))
                continue
            why = ("two replicas cannot outvote each other" if n == 2
                   else f"no strict majority among {n} replicas")
            for g in split:
                for r in g:
                    other = next(o for o in members if o not in g)
                    first, count = first_difference(rows[r], rows[other])
                    verdicts.append(self._verdict(
                        r, "weights", step,
                        f"{when}: the replicas of shard {j} disagree ({why}): rank {r} "
                        f"({self.places[r].describe()}; {self.identities[r].describe()}) differs from rank "
                        f"{other} ({self.places[other].describe()}) first at parameter {names[first]!r}; "
                        "which is wrong is unknown", first_parameter=names[first], parameter_index=first,
                        parameters_differing=count, fingerprint=fingerprint_hex(rows[r][first]), groups=split,
                        other_rank=other, other=self.identities[other].describe(), shard_group=members,
                        **self._place_evidence(r)))
        return ShardedWeightReport(step, True, "", groups, verdicts)

    # -- verdicts ----------------------------------------------------------------------------------

    def _place_evidence(self, rank: int, parameters: list[str] | None = None) -> dict[str, Any]:
        """``rank``'s place in the mesh, and ``parameters`` (the non-finite ones this rank found)
        when ``rank`` is this rank: only it has looked at its own gradients."""
        p = self.places[rank]
        said: dict[str, Any] = {"replica": p.replica, "shard": p.shard, "replicas": p.replicas,
                                "shards": p.shards, "strategy": p.strategy}
        if parameters is not None and rank == self.rank:
            said["parameters"] = parameters
        return said
