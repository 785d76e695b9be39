"""Which node pairs a probe run measures: every pair of a small group, a kept rotation above it.

A slow path between two nodes shows only when that pair is measured. A random pairing per run misses
a given pair of 4 nodes three runs in a row about 30 % of the time (2/3 per run), and of more nodes far
more often, so coverage is a schedule, not a draw. Pure (no I/O, no clock): the probe hands in the
group and the time, and keeps the JSON this module makes.

**Tournament** (the circle method). M slots (the group's nodes, an empty slot added when N is odd),
M-1 rounds. In round r slot M-1 meets slot r, and slot (r+k) mod (M-1) meets slot (r-k) mod (M-1) for
k = 1 .. M/2-1. Two slots i, j < M-1 meet only in the round r with 2r = i+j (mod M-1) (M-1 is odd, so
there is one), and slot M-1 meets slot r in round r: every pair of slots meets exactly once, and the
pairs of a round are disjoint (a round measures them all at once). A node whose partner is the empty
slot, or a node not in this run, sits that round out.

**Per run** at most ``per_run`` rounds (``checks.fabric.coverage_rounds``, 15; settings.py says why).
A group whose tournament fits (M-1 <= per_run: up to 16 nodes) plays all of it in every run: every
pair, every run. A larger group plays the next ``per_run`` rounds of its rotation (the last run of a
cycle the rounds left), so a cycle is ceil((M-1) / per_run) runs and a group that stays the same has
every pair measured once per cycle: that is the bound. Only rounds whose results all came in count
as played; a run that ends early leaves the rest of its rounds to the next one.

**Coverage** is of the group as it is in this run: ``pairs_total`` = N(N-1)/2 of its nodes,
``pairs_measured`` = those of them measured in the rotation's current cycle (with both nodes taking
part), ``runs_since_full_coverage`` = runs since the last run that completed a cycle with every pair
measured (since the rotation began, if none did). A small group's cycle is one run.

**Membership** (nodes come and go between runs: drained, added, a probe on the idle ones).

- At the start of a cycle the slot table is rebuilt from this run's nodes: those already in it keep
  their order, new ones are added after them. Nothing measured is lost (a new cycle starts anyway).
  A small group starts a cycle every run.
- Mid-cycle, a node that is not in this run keeps its slot: its partners sit out its rounds, the
  rounds it misses are noted, and if it comes back in the same cycle its pairs of those rounds are
  measured next cycle. Pairs among the others go on as planned.
- Mid-cycle, a new node takes a free slot (an empty one, else one of a node not in this run, which
  gives it up); the rounds already played this cycle count as missed by it, so its pairs there are
  measured next cycle (within two cycles of joining). With no free slot the tournament has to grow,
  and a tournament of more slots pairs every node differently: the rotation restarts at round 0 with
  the new table (the restart is noted; runs since full coverage go on counting).

A node keeps one rotation (``<state_dir>/fabric/rotation.json``, written by the probe): a node probed
in two different groups by turns carries each group's rotation into the other, which then looks like
nodes coming and going. Probe fixed groups (one per leaf switch: docs/operators/fabric-probe.md,
"At fleet scale").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
# A hostname is at most 253 characters: a table of 16k such names is about 4.2 MB. A larger file is
# not a rotation this module wrote.
MAX_BYTES = 8 << 20


class RotationError(ValueError):
    """A stored rotation that cannot be used (unreadable, not JSON, not a rotation of this version)."""


def circle_round(slots: int, r: int) -> list[tuple[int, int]]:
    """Round ``r`` (0 <= r < slots-1) of the circle method over an even number of ``slots``."""
    if slots < 2 or slots % 2:
        raise ValueError(f"the circle method needs an even number of slots >= 2, got {slots}")
    m = slots - 1
    if not 0 <= r < m:
        raise ValueError(f"round {r} outside 0..{m - 1}")
    return [(m, r), *(((r + k) % m, (r - k) % m) for k in range(1, slots // 2))]


def slot_round(m: int, i: int, j: int) -> int:
    """The round in which slots ``i`` and ``j`` meet (``m`` = slots - 1, the number of rounds)."""
    if i == m:
        return j
    if j == m:
        return i
    return (i + j) * ((m + 1) // 2) % m  # (m+1)/2 is the inverse of 2 modulo the odd m


def slot_partner(m: int, i: int, r: int) -> int:
    """Slot ``i``'s partner in round ``r`` (``m`` = slots - 1)."""
    if i == m:
        return r
    if i == r:
        return m
    return (2 * r - i) % m


def runs_per_cycle(rounds: int, per_run: int) -> int:
    """The bound: runs a rotation of ``rounds`` rounds takes to measure every pair once."""
    return max(1, math.ceil(rounds / per_run)) if rounds else 1


def _padded(nodes: Sequence[str]) -> list[str | None]:
    table: list[str | None] = list(nodes)
    if len(table) % 2:
        table.append(None)
    return table


@dataclass(frozen=True)
class Plan:
    """What one run measures for coverage: ``rounds`` = (tournament round, node pairs) in order."""

    members: tuple[str, ...]
    rounds: tuple[tuple[int, tuple[tuple[str, str], ...]], ...]
    whole: bool  # the whole tournament in this run (a small group)
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Coverage:
    """Where the rotation stands after a run, for the report and ``/metrics``."""

    whole: bool
    pairs_measured: int
    pairs_total: int
    runs_since_full_coverage: int
    full_coverage_time: float | None
    rounds_played: tuple[int, ...]  # the tournament rounds this run measured
    rounds_planned: tuple[int, ...]
    cycle_rounds: int
    next_round: int
    runs_per_cycle: int  # the bound: every pair of an unchanged group within this many runs
    per_run: int
    rotation_runs: int
    notes: tuple[str, ...]
    errors: tuple[str, ...] = ()
    seconds: float | None = None
    source: str | None = None  # the node whose copy the run continued from (None: a fresh rotation)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": "every pair each run" if self.whole else "rotation",
            "pairs_measured": self.pairs_measured,
            "pairs_total": self.pairs_total,
            "runs_since_full_coverage": self.runs_since_full_coverage,
            "full_coverage_time": self.full_coverage_time,
            "rounds_played": list(self.rounds_played),
            "rounds_planned": list(self.rounds_planned),
            "cycle_rounds": self.cycle_rounds,
            "next_round": self.next_round,
            "runs_per_cycle": self.runs_per_cycle,
            "rounds_per_run": self.per_run,
            "rotation_runs": self.rotation_runs,
            "notes": list(self.notes),
            "errors": list(self.errors),
            "continued_from": self.source,
            "seconds": self.seconds,
        }


@dataclass
class Rotation:
    """A group's round-robin rotation. ``begin`` plans a run, ``end`` records what it measured."""

    slots: list[str | None] = field(default_factory=list)
    next_round: int = 0
    runs: int = 0
    missed: dict[str, list[int]] = field(default_factory=dict)  # node -> rounds of this cycle missed
    full_at_run: int | None = None
    full_at_time: float | None = None

    @property
    def rounds(self) -> int:
        return max(0, len(self.slots) - 1)

    # -- planning ----------------------------------------------------------------------------

    def begin(self, members: Iterable[str], per_run: int) -> Plan:
        """The rounds of this run for the group ``members``; adapts the slot table to them first."""
        if per_run < 1:
            raise ValueError(f"per_run must be >= 1, got {per_run}")
        group = sorted(set(members))
        present = set(group)
        notes: list[str] = []
        fresh_rounds = len(_padded(group)) - 1
        whole = fresh_rounds <= per_run
        if whole or self.next_round == 0 or not self.slots:
            self._rebuild(group, notes, whole)
        else:
            self._remap(group, notes)
        end = self.rounds if whole else min(self.rounds, self.next_round + per_run)
        m = len(self.slots)
        rounds = []
        for r in range(self.next_round, end):
            pairs = []
            for i, j in circle_round(m, r):
                a, b = self.slots[i], self.slots[j]
                if a is not None and b is not None and a in present and b in present:
                    pairs.append((a, b))
            rounds.append((r, tuple(pairs)))
        return Plan(tuple(group), tuple(rounds), whole, tuple(notes))

    def _rebuild(self, group: list[str], notes: list[str], whole: bool) -> None:
        """A new cycle: the table of this run's nodes, the earlier order kept."""
        old = [n for n in self.slots if n is not None]
        present = set(group)
        kept = [n for n in old if n in present]
        added = [n for n in group if n not in set(old)]
        gone = [n for n in old if n not in present]
        if old and (added or gone) and not whole:
            notes.append(f"new cycle: slot table rebuilt for this run's {len(group)} nodes"
                         + (f", joined: {', '.join(added)}" if added else "")
                         + (f", left: {', '.join(gone)}" if gone else ""))
        self.slots = _padded(kept + added)
        self.next_round = 0
        self.missed = {}

    def _remap(self, group: list[str], notes: list[str]) -> None:
        """Mid-cycle: away nodes keep their slots; a new node takes a free one, else the rotation
        restarts (a larger tournament pairs everyone differently)."""
        present = set(group)
        in_table = {n for n in self.slots if n is not None}
        joined: list[str] = []
        for node in (n for n in group if n not in in_table):
            free = next((i for i, n in enumerate(self.slots) if n is None), None)
            if free is None:
                free = next((i for i, n in enumerate(self.slots) if n is not None and n not in present), None)
            if free is None:
                played = self.next_round
                self._rebuild(group, [], False)
                notes.append(f"{node} joined mid-cycle with no free slot: the rotation restarts at round 0 "
                             f"with {len(self.slots)} slots ({played} rounds of the old cycle dropped)")
                return
            gave_up = self.slots[free]
            if gave_up is not None:
                self.missed.pop(gave_up, None)
            self.slots[free] = node
            self.missed[node] = list(range(self.next_round))
            joined.append(f"{node} in slot {free}" + (f" (given up by {gave_up})" if gave_up else ""))
        if joined:
            notes.append(f"joined mid-cycle: {', '.join(joined)}; their pairs of the {self.next_round} "
                         "rounds already played are measured next cycle")
        away = [n for n in self.slots if n is not None and n not in present]
        if away:
            notes.append(f"not in this run: {', '.join(away)} (slots kept; their partners sit out their "
                         "rounds, and their pairs missed are measured next cycle)")

    # -- results -----------------------------------------------------------------------------

    def end(self, plan: Plan, played: int, now: float, *, per_run: int,
            errors: Sequence[str] = (), seconds: float | None = None, source: str | None = None) -> Coverage:
        """Record that the first ``played`` rounds of ``plan`` were measured (a prefix: a round that did
        not finish leaves it and the rest to the next run); returns the coverage after this run."""
        done = [r for r, _ in plan.rounds[:max(0, played)]]
        present = set(plan.members)
        for node in (n for n in self.slots if n is not None and n not in present):
            self.missed.setdefault(node, []).extend(done)
        if done:
            self.next_round = done[-1] + 1
        self.runs += 1
        measured = self._measured(present)
        total = len(present) * (len(present) - 1) // 2
        cycle_done = self.rounds > 0 and self.next_round >= self.rounds
        if (cycle_done or total == 0) and measured == total:
            self.full_at_run, self.full_at_time = self.runs, now
        cov = Coverage(
            whole=plan.whole, pairs_measured=measured, pairs_total=total,
            runs_since_full_coverage=self.runs - (self.full_at_run or 0),
            full_coverage_time=self.full_at_time, rounds_played=tuple(done),
            rounds_planned=tuple(r for r, _ in plan.rounds), cycle_rounds=self.rounds,
            next_round=0 if cycle_done else self.next_round,
            runs_per_cycle=runs_per_cycle(self.rounds, per_run), per_run=per_run, rotation_runs=self.runs,
            notes=plan.notes + ((f"cycle ended with {total - measured} pair(s) not measured (nodes away "
                                 "for their rounds): measured next cycle",)
                                if cycle_done and measured < total else ()),
            errors=tuple(errors), seconds=seconds, source=source)
        if cycle_done or plan.whole:
            # a small group plays its whole tournament every run: each run is a cycle of its own
            self.next_round = 0
            self.missed = {}
        return cov

    def _measured(self, present: set[str]) -> int:
        """Pairs of ``present`` nodes measured in this cycle's rounds so far (0 .. next_round-1), without
        walking the rounds: every round has M/2 pairs and every slot is in one pair per round, so
        the pairs that touch a slot left out (empty, or a node not in this run) are counted from those
        slots alone, and the pairs missed from the nodes' missed rounds. O(left-out slots^2 + missed
        rounds): 2 ms for a 4,096-node table with 96 nodes away, where a walk checks 8M pairs."""
        m, played = len(self.slots) - 1, self.next_round
        if m < 1 or played == 0:
            return 0
        out = [i for i, n in enumerate(self.slots) if n is None or n not in present]
        count = played * len(self.slots) // 2 - played * len(out)
        # a pair of two left-out slots was subtracted twice
        count += sum(1 for x, i in enumerate(out) for j in out[x + 1:] if slot_round(m, i, j) < played)
        index = {n: i for i, n in enumerate(self.slots) if n is not None}
        lost: set[tuple[int, int]] = set()
        for node, rounds in self.missed.items():
            i = index.get(node)
            if i is None or node not in present:
                continue
            for r in rounds:
                j = slot_partner(m, i, r)
                if r < played and self.slots[j] is not None and self.slots[j] in present:
                    lost.add((min(i, j), max(i, j)))
        return count - len(lost)

    # -- storage -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "slots": list(self.slots), "next_round": self.next_round,
                "runs": self.runs, "missed": {k: list(v) for k, v in sorted(self.missed.items())},
                "full_at_run": self.full_at_run, "full_at_time": self.full_at_time}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, doc: Any) -> Rotation:
        """Raises ``RotationError`` saying what is wrong."""
        if not isinstance(doc, Mapping):
            raise RotationError(f"not a JSON object but {type(doc).__name__}")
        if doc.get("version") != VERSION:
            raise RotationError(f"version {doc.get('version')!r}, this gpumon reads version {VERSION}")
        slots = doc.get("slots")
        if not isinstance(slots, list) or any(s is not None and not isinstance(s, str) for s in slots):
            raise RotationError("slots: not a list of node names and nulls")
        names = [s for s in slots if s is not None]
        if len(set(names)) != len(names) or len(slots) % 2:
            raise RotationError("slots: a node twice, or an odd number of slots")
        rounds = max(0, len(slots) - 1)

        def count(key: str, upper: int | None = None, *, null: bool = False) -> Any:
            v = doc.get(key)
            if v is None and null:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (upper is not None and v > upper):
                raise RotationError(f"{key}: {v!r} is not a count" + (f" in 0..{upper}" if upper is not None
                                                                      else ""))
            return v

        next_round = count("next_round", max(0, rounds - 1))
        runs = count("runs")
        full_at_run = count("full_at_run", runs, null=True)
        when = doc.get("full_at_time")
        if when is not None and (isinstance(when, bool) or not isinstance(when, int | float)
                                 or not math.isfinite(when)):
            raise RotationError(f"full_at_time: {when!r} is not a time")
        missed = doc.get("missed", {})
        if not isinstance(missed, Mapping) or any(
                k not in names or not isinstance(v, list)
                or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < rounds for x in v)
                for k, v in missed.items()):
            raise RotationError("missed: not a map of the table's nodes to rounds")
        return cls(list(slots), next_round, runs, {str(k): list(v) for k, v in missed.items()}, full_at_run,
                   None if when is None else float(when))

    @classmethod
    def loads(cls, raw: bytes | str) -> Rotation:
        """Parse a stored rotation; ``RotationError`` says why it cannot be used."""
        if len(raw) > MAX_BYTES:
            raise RotationError(f"larger than {MAX_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            # truncated by a crash mid-write on a filesystem without atomic rename, or hand-edited
            raise RotationError(f"not JSON ({exc})") from None
        return cls.from_json(doc)


def preference(runs: Mapping[str, int]) -> list[str]:
    """The order in which to try the nodes' copies: most runs first (every node writes the same state
    after a run, so fewer runs is a node that missed some), then by node name."""
    return sorted(runs, key=lambda n: (-runs[n], n))
