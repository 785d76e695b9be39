"""Stragglers, judged (imports torch): every ``pace_window`` steps the pace meter's scores
(``gpumon.guard.pace``) are written to each node's spool and a rank slow in enough windows, not
explained by its share of the work, is named in a ``straggler`` verdict.
"""

import logging
import time
from collections.abc import Callable

from gpumon.guard.base import GuardBase
from gpumon.guard.handover import hand_over
from gpumon.guard.pace import SLOW_BELOW, TRIM, PaceMeter, table_of
from gpumon.guard.verdict import Identity, PaceRow, Verdict, job_id, write_pace

log = logging.getLogger("gpumon.guard")


class StragglerMixin(GuardBase):
    """``Guard``'s straggler verdicts: ``_judge_pace``, when the pace meter's window is due."""

    pace: PaceMeter | None
    identity: Identity
    on_straggler: Callable[[list[Verdict]], None] | None

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
