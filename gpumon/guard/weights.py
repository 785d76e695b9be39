"""Check 3, the weights (imports torch): every replica's weights compared by fingerprint (only
fingerprints travel), every ``weight_check_every`` steps, on demand (``check_weights``) and before
the audit or check 1's reruns compare computations across GPUs; a strict majority of >= 3 replicas
names the one that differs.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpumon.guard.base import GuardBase
from gpumon.guard.verdict import Verdict
from gpumon.sdc.fingerprint import Fingerprint, fingerprint_tensor


@dataclass(frozen=True)
class WeightReport:
    """One weight check: which replicas agree, the fingerprints compared."""

    step: int
    groups: list[list[int]]  # ranks with equal fingerprints, largest first
    verdicts: list[Verdict]

    @property
    def agree(self) -> bool:
        return len(self.groups) == 1


class WeightCheckMixin(GuardBase):
    """``Guard``'s weight check: ``check_weights`` and the comparison before a recomputation."""

    _named: list[tuple[str, torch.nn.Parameter]]  # the model's trainable parameters, by name

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


def fingerprint_hex(row: torch.Tensor) -> str:
    """A parameter's 128-bit fingerprint from its row of two int64s (as gathered), in hex."""
    plain, weighted = (int(v) & 0xFFFFFFFFFFFFFFFF for v in row.tolist())
    return Fingerprint(plain, weighted).hex()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(index of the first parameter whose fingerprints differ, how many differ)."""
    diff = (a != b).any(dim=1).nonzero().reshape(-1)
    return int(diff[0]), int(diff.numel())
