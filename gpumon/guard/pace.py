"""Stragglers inside the job: each rank's own compute per step, scored against the group.

A degraded GPU rarely stops a job; the whole job runs at the pace of its slowest rank. Every rank
times its own compute of each step — from the first forward of the step to the moment its last
gradient bucket is ready (the comm hook's call for the step's last bucket: the backward is done
there, and waiting for the other ranks' gradients comes after it), plus ``optimizer.step()`` — so
the time a fast rank spends waiting for a slow one is never counted. On CUDA the points are CUDA
events, read at the end of a window (no sync per step); on CPU wall time.

Every ``window`` steps each rank's compute per step and work per step (the element count of the
micro-batch's first tensor, or what the loop passes as ``work=``) are all-gathered on the guard's
group (16 bytes per rank), and each rank is scored. A rank's compute per step is the **mean** of its
steps' compute with its slowest ``TRIM`` (10 %) left out: what the job pays for it (every step waits
for the slowest rank, so a rank 3x slow on every third step makes the job ~1.7x slower, and a median
of its steps would never move), while a pause or two in a window (a collection, a checkpoint's
write) is left out as a median would. Its work per step is the mean of its steps' work.

- **pace** = the group's median of those compute figures / the rank's (NVIDIA Resiliency
  Extension's straggler detector scores reference median / rank median and flags below 0.75,
  ``identify_stragglers(gpu_rel_threshold=0.75)``; its reference is the fastest rank's median, which
  makes a lucky rank the yardstick: the group median is used here);
- **pace per unit of work**: the same on compute / work. A rank slow on the first score but not on
  the second got more work (a longer sequence, a larger micro-batch): that is load, said so, never a
  GPU verdict. Slow on both: the GPU (or its host) is slow.

A rank slow in ``need`` of the last ``of_last`` windows is named once (again only after ``of_last``
windows in a row in which it was not slow: one good window in a run of slow ones is noise, not a
recovery, and must not file a second verdict), with node and GPU, in a ``straggler`` verdict its
node's daemon turns into a warning on that GPU (with the node's own signals beside it). Never an
alarm: training goes on.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("gpumon.guard")

# NVIDIA Resiliency Extension, attribution/straggler/reporting.py: identify_stragglers(
# gpu_rel_threshold=0.75); a score of 0.5 is half speed
SLOW_BELOW = 0.75
# The share of a rank's slowest steps left out of its mean compute per step. Argued: a window of 100
# steps may hold a few pauses every rank has at other moments (a garbage collection, a checkpoint
# write), which 10 % leaves out; what it keeps: a rank 3x slow on every third step reads as pace
# 0.65 (named), on every fourth 0.75 (the edge), on every fifth 0.82 (not named: the job pays ~1.4x
# there, which a smaller trim would catch at the cost of more noise named).
TRIM = 0.10


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``values`` without the largest ``trim`` share of them (at least one value kept)."""
    ordered = sorted(values)
    keep = max(1, len(ordered) - int(len(ordered) * trim))
    return sum(ordered[:keep]) / keep


@dataclass(frozen=True)
class PaceScore:
    """One rank's scores in one window."""

    rank: int
    compute_s: float  # mean compute per step, its slowest TRIM of steps left out
    work: float  # mean work per step
    pace: float  # group median compute / this rank's
    pace_per_work: float  # the same on compute / work
    slow: bool  # the GPU is slow (slow on both scores)
    load: bool  # slow only because it got more work


@dataclass
class PaceWindow:
    """One window: every rank's scores, the ranks named in it."""

    step: int  # the last step of the window
    steps: int
    scores: list[PaceScore]
    named: list[int] = field(default_factory=list)
    load: list[int] = field(default_factory=list)


class _Marks:
    """The time points of one step: floats on CPU, CUDA events on a GPU (read at window end)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.start: Any = None
        self.backward_done: Any = None
        self.opt_start: Any = None
        self.opt_end: Any = None

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1000.0
        return float(b - a)

    def compute_s(self) -> float | None:
        if self.start is None or self.backward_done is None:
            return None
        total = self.seconds(self.start, self.backward_done)
        if self.opt_start is not None and self.opt_end is not None:
            total += self.seconds(self.opt_start, self.opt_end)
        return total


def work_of(batch: Any) -> float | None:
    """Elements of the micro-batch's first tensor (depth-first through dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor):
        return float(batch.numel())
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = work_of(item)
            if found is not None:
                return found
    return None


def score(rows: Sequence[tuple[float, float]], threshold: float = SLOW_BELOW) -> list[PaceScore]:
    """Score each rank's (compute s per step, work per step) against the group's medians."""
    times = [t for t, _ in rows]
    ref = statistics.median(times)
    per = [t / w if w > 0 else t for t, w in rows]
    ref_per = statistics.median(per)
    out = []
    for r, ((t, w), u) in enumerate(zip(rows, per, strict=True)):
        pace = ref / t if t > 0 else 1.0
        pace_w = ref_per / u if u > 0 else 1.0
        slow = pace < threshold and pace_w < threshold
        out.append(PaceScore(r, t, w, round(pace, 4), round(pace_w, 4), slow,
                             load=pace < threshold and not slow))
    return out


class PaceMeter:
    """Times this rank's compute per step; every ``window`` steps scores every rank (collective)."""

    def __init__(self, *, rank: int, world: int, group: Any, device: torch.device, window: int,
                 of_last: int, need: int, threshold: float = SLOW_BELOW) -> None:
        if window < 2:
            raise ValueError("pace_window: must be >= 2 steps (a median of one step is noise)")
        if not 1 <= need <= of_last:
            raise ValueError(f"pace: need ({need}) must be between 1 and of_last ({of_last})")
        self.rank, self.world, self.group = rank, world, group
        self.window, self.of_last, self.need, self.threshold = window, of_last, need, threshold
        self._cuda = device.type == "cuda"
        self._marks = _Marks(self._cuda)
        self._steps: list[_Marks] = []
        self._work: list[float] = []
        self._history: list[deque[bool]] = [deque(maxlen=of_last) for _ in range(world)]
        self._named: set[int] = set()
        self.active = True  # False while the guard itself computes (audit, reruns)
        self._mark_failed = False
        self.windows: list[PaceWindow] = []

    # -- the step's time points (hooks) -------------------------------------------------------

    # They run inside the user's forward, backward and optimizer step: they never raise (a time
    # point that cannot be taken, e.g. a CUDA event out of memory, leaves that step unscored).

    def _mark(self) -> Any:
        try:
            return self._marks.now()
        except Exception as exc:
            if not self._mark_failed:
                self._mark_failed = True
                log.error("gpumon.guard: pace: a step's time point could not be taken (%s: %s); such "
                          "steps are left out of the straggler scores", type(exc).__name__, exc)
            return None

    def forward_pre(self, *_: Any) -> None:
        if self.active and self._marks.start is None:
            self._marks.start = self._mark()

    def backward_done(self) -> None:
        if self.active and self._marks.start is not None:
            self._marks.backward_done = self._mark()

    def optimizer(self, step_fn: Callable[[], Any]) -> None:
        """Run ``step_fn`` (the optimizer's step) once, timed."""
        self._marks.opt_start = self._mark()
        step_fn()
        self._marks.opt_end = self._mark() if self._marks.opt_start is not None else None

    def end_step(self, work: float | None) -> None:
        """Close this step's record (whether or not the update was applied)."""
        marks, self._marks = self._marks, _Marks(self._cuda)
        if marks.start is not None and marks.backward_done is not None:
            self._steps.append(marks)
            self._work.append(1.0 if work is None else float(work))

    # -- the window ------------------------------------------------------------------------------

    def due(self, steps_done: int) -> bool:
        return steps_done > 0 and steps_done % self.window == 0

    def judge(self, step: int) -> PaceWindow | None:
        """Gather every rank's compute and work per step and score them (every rank calls it at the
        same step)."""
        if self._cuda:
            torch.cuda.synchronize()
        times = [t for t in (m.compute_s() for m in self._steps) if t is not None]
        mine = torch.tensor([trimmed_mean(times) if times else -1.0,
                             statistics.fmean(self._work) if self._work else 0.0], dtype=torch.float64)
        n = len(times)
        self._steps, self._work = [], []
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        table = [(float(r[0]), float(r[1])) for r in rows]
        if any(t <= 0 for t, _ in table):
            # a rank without a timed step (e.g. its hooks never saw a forward): no judgement
            return None
        return self.observe(PaceWindow(step, n, score(table, self.threshold)))

    def observe(self, window: PaceWindow) -> PaceWindow:
        """Add one scored window to every rank's history; name the ranks it makes stragglers."""
        scores = window.scores
        for s in scores:
            hist = self._history[s.rank]
            hist.append(s.slow)
            if not any(hist):
                self._named.discard(s.rank)
            if s.load:
                window.load.append(s.rank)
            if s.slow and sum(hist) >= self.need and s.rank not in self._named:
                self._named.add(s.rank)
                window.named.append(s.rank)
        self.windows.append(window)
        del self.windows[:-self.of_last]
        return window

    def history(self, rank: int) -> list[bool]:
        return list(self._history[rank])


def table_of(scores: Iterable[PaceScore]) -> list[dict[str, Any]]:
    return [{"rank": s.rank, "compute_ms": round(s.compute_s * 1e3, 3), "work": s.work, "pace": s.pace,
             "pace_per_work": s.pace_per_work} for s in scores]
