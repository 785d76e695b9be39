"""Which node or link is slow: pair tests in rounds, then attribution. Pure (no I/O, no clock).

The fabric probe measures pairs of nodes (large-message send/recv bandwidth, small-message p95
latency). A slow pair says "a, b, or the path between them"; this module decides which, from
pairs chosen in rounds (the two-pass idea of Google's cluster-health-scanner: test everything once,
then re-test the suspects against nodes that passed).

Rounds (``next_round``; each round is a set of disjoint pairs, at most N/2, never all N² pairs):

1. The first pass: the rounds the caller gives (``first``: the probe's coverage rounds, every pair
   of a small group or the next rounds of a kept tournament, ``gpumon.fabric.schedule``), measured
   as given; without them one round, a seeded random perfect matching of all nodes (odd N: one node
   sits out; as an untested node it is paired in round 2).
2. Later rounds (follow-ups, at most ``max_rounds`` - 1 after the first pass): every *suspect*
   (below) and every untested node is paired with a *good* node it has not been paired with yet. A
   good node may serve in many rounds but is in at most one pair per round. When good nodes run
   out (small N, or many failures), the rest are paired with each other, again only with partners
   not yet tried (re-measuring a pair adds nothing).
3. Stop (``next_round`` returns ``[]``) when no suspect or untested node can be given a new
   partner, or after ``max_rounds`` - 1 follow-ups. One more rule, for small N: when no pair is
   slower than the reference and every fast pair goes through one node (N=3: a-b and a-c, equal),
   the reference may be that one node's own (bad) speed, so a round of untried pairs is added (for
   N=3: b-c).
   Two fast pairs with no common node, or a fast triangle, need two nodes at the reference.

Reference values are relative (no profile number is needed), and robust to bad nodes: each node's
BEST pair (highest busbw, lowest p95 among pairs that did not fail) is an upper bound on the
slower of the two nodes, so a healthy node's best reaches nominal as soon as it has one healthy
partner. A plain median of pairs is not robust: with 1 bad node of 4, half of round 1's pairs
are slow, and each bad node makes its round-1 partner look slow too. So the bandwidth reference
is the upper median of those node bests that are not slow next to the upper quartile of all node
bests (latency: lower median, lower quartile). It holds while a quarter of the nodes have met a
healthy partner, and one pair's too-high number cannot move it in a group of 9 or more. It
cannot see a uniformly slow group (compare the reference with the SKU profile for that), it
assumes one kind of node per group (nodes with twice the NICs would make the others "slow"), and
it improves each round as suspects meet good nodes.

Classification (recomputed from all pairs after every ``add``):

- a pair is *bad* if it failed (``failed`` set: error, hang, wrong data), or busbw <
  ``slow_fraction`` x reference, or p95 > ``latency_factor`` x reference and p95 > reference +
  ``latency_floor_us`` (the floor keeps a 2 µs -> 7 µs wobble of a tiny number from counting);
  a pair with a value and not bad is *fast*; a pair with no value and no failure tells nothing;
- a node fast with at least one partner is *good* (its NIC and path reach the reference);
- *node fault*: fast with none, and bad with more than ``confirm_partners`` distinct partners that
  are good, or with exactly that many when no good partner it has not met is left. Only good
  partners count: a bad pair of two suspects is evidence against both, explained by either. The
  extra partner is the re-measurement: a node is not failed on one pair that read slow once next
  to a slow path. A node fault so costs a third round (a fourth when two bad nodes met in round 1);
- *link fault*: a bad pair whose two nodes are each fast with some other partner (both named);
- *suspect*: fast with none, not a node fault, and bad with a partner that is not a node fault.
  Suspects left when the rounds end are ``unresolved``;
- *untested*: fast with none and no unexplained bad pair (never measured, only pairs that
  measured nothing, or only pairs with node faults): not cleared.

A link fault is found only on a pair that is measured: a random round 1 samples N/2 of the N(N-1)/2
pairs, which is why the probe passes its own first pass (every pair of a group of up to 16 nodes, a
kept rotation above that: ``gpumon.fabric.schedule``). With N=2 there is
one pair and no other value to compare it with: only a failed pair shows, and it cannot be
attributed (both unresolved). Repeated results for one pair are merged: best busbw, lowest p95
(performance noise), but a failure sticks (a flaky pair is bad).

Work per round is O(N log N + P log P) for the P pairs measured so far (P <= rounds x N/2):
nothing is indexed by all N² pairs. Everything is deterministic for a seed and the results fed in.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median_high, median_low
from typing import Any

KIND_FAILED = "failed"
KIND_BANDWIDTH = "bandwidth"
KIND_LATENCY = "latency"
_KIND_ORDER = (KIND_FAILED, KIND_BANDWIDTH, KIND_LATENCY)


@dataclass(frozen=True)
class PairResult:
    """One measured pair of nodes (order of ``a`` and ``b`` does not matter)."""

    a: str  # node name
    b: str
    busbw_gbps: float | None  # large-message bandwidth of the pair (None: not measured)
    p95_latency_us: float | None  # small-message p95 latency (None: not measured)
    failed: str | None = None  # transfers failed / hung / wrong data: the reason (a failed pair is "bad")

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"a pair needs two different nodes, got {self.a!r} twice")
        for name, value in (("busbw_gbps", self.busbw_gbps), ("p95_latency_us", self.p95_latency_us)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} of pair {self.a}-{self.b} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class IsolationSettings:
    slow_fraction: float = 0.7  # pair slow if busbw < slow_fraction * reference
    latency_factor: float = 3.0  # pair slow if p95 > latency_factor * reference AND > reference + floor
    latency_floor_us: float = 50.0
    confirm_partners: int = 2  # node fault: slow with this many distinct good partners, fast with none
    max_rounds: int = 8  # the first pass counts as one round: at most max_rounds - 1 follow-ups

    def __post_init__(self) -> None:
        if not 0 < self.slow_fraction <= 1:
            raise ValueError(f"slow_fraction must be in (0, 1], got {self.slow_fraction}")
        if self.latency_factor < 1:
            raise ValueError(f"latency_factor must be >= 1, got {self.latency_factor}")
        if self.latency_floor_us < 0:
            raise ValueError(f"latency_floor_us must be >= 0, got {self.latency_floor_us}")
        if self.confirm_partners < 1:
            raise ValueError(f"confirm_partners must be >= 1, got {self.confirm_partners}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")


@dataclass(frozen=True)
class PairEvidence:
    """One pair of a node, as seen from that node."""

    partner: str
    busbw_gbps: float | None
    p95_latency_us: float | None
    failed: str | None
    kinds: tuple[str, ...]  # why the pair is bad; () = fast (or nothing measured)
    partner_good: bool  # the partner is fast with some node

    def to_json(self) -> dict[str, Any]:
        return {
            "partner": self.partner,
            "busbw_gbps": self.busbw_gbps,
            "p95_latency_us": self.p95_latency_us,
            "failed": self.failed,
            "kinds": list(self.kinds),
            "partner_good": self.partner_good,
        }


@dataclass(frozen=True)
class NodeFault:
    node: str
    kinds: tuple[str, ...]  # union over its bad pairs: failed / bandwidth / latency
    slow_partners: tuple[str, ...]
    good_partners: tuple[str, ...]  # the slow partners that are fast with someone else (the proof)
    pairs: tuple[PairEvidence, ...]  # every measured pair of the node
    reference_busbw_gbps: float | None
    reference_p95_us: float | None
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "kinds": list(self.kinds),
            "slow_partners": list(self.slow_partners),
            "good_partners": list(self.good_partners),
            "pairs": [p.to_json() for p in self.pairs],
            "reference_busbw_gbps": self.reference_busbw_gbps,
            "reference_p95_us": self.reference_p95_us,
            "why": self.why,
        }


@dataclass(frozen=True)
class LinkFault:
    a: str
    b: str
    kinds: tuple[str, ...]
    busbw_gbps: float | None
    p95_latency_us: float | None
    failed: str | None
    reference_busbw_gbps: float | None
    reference_p95_us: float | None
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "kinds": list(self.kinds),
            "busbw_gbps": self.busbw_gbps,
            "p95_latency_us": self.p95_latency_us,
            "failed": self.failed,
            "reference_busbw_gbps": self.reference_busbw_gbps,
            "reference_p95_us": self.reference_p95_us,
            "why": self.why,
        }


@dataclass(frozen=True)
class IsolationVerdict:
    """Every node is in exactly one of: node_faults, unresolved, untested, good, or is an end of a
    link fault (and then fast with some other partner)."""

    node_faults: dict[str, NodeFault]
    link_faults: list[LinkFault]
    unresolved: list[str]  # suspects the rounds could not settle (see notes for why)
    untested: list[str]  # never measured against a partner that could clear it
    good: list[str]
    rounds: int
    pairs_measured: int
    reference_busbw_gbps: float | None
    reference_p95_us: float | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "node_faults": {name: fault.to_json() for name, fault in self.node_faults.items()},
            "link_faults": [fault.to_json() for fault in self.link_faults],
            "unresolved": list(self.unresolved),
            "untested": list(self.untested),
            "good": list(self.good),
            "rounds": self.rounds,
            "pairs_measured": self.pairs_measured,
            "reference_busbw_gbps": self.reference_busbw_gbps,
            "reference_p95_us": self.reference_p95_us,
            "notes": list(self.notes),
        }


@dataclass
class _Merged:
    """All results for one pair, merged (best performance, sticky failure)."""

    busbw: float | None = None
    p95: float | None = None
    failed: str | None = None

    def merge(self, r: PairResult) -> None:
        if r.busbw_gbps is not None and (self.busbw is None or r.busbw_gbps > self.busbw):
            self.busbw = r.busbw_gbps
        if r.p95_latency_us is not None and (self.p95 is None or r.p95_latency_us < self.p95):
            self.p95 = r.p95_latency_us
        if r.failed is not None and self.failed is None:
            self.failed = r.failed

    @property
    def informative(self) -> bool:
        return self.failed is not None or self.busbw is not None or self.p95 is not None


@dataclass
class _State:
    """One classification of everything measured so far."""

    ref_bw: float | None
    ref_lat: float | None
    kinds: dict[tuple[str, str], tuple[str, ...]]  # informative pairs only; () = fast
    fast: dict[str, list[str]]  # node -> fast partners
    bad: dict[str, list[str]]  # node -> bad partners
    node_faults: set[str]
    suspects: list[str]
    untested: list[str]
    trusted: bool

    def is_good(self, node: str) -> bool:
        return bool(self.fast.get(node))


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


class Isolator:
    """Plans pair rounds and attributes slow pairs to nodes or links. See the module docstring."""

    def __init__(self, nodes: Sequence[str], settings: IsolationSettings = IsolationSettings(),
                 seed: int = 0, first: Sequence[Sequence[tuple[str, str]]] | None = None) -> None:
        if len(set(nodes)) != len(nodes):
            raise ValueError("node names must be unique")
        self._nodes: tuple[str, ...] = tuple(sorted(nodes))  # caller's order does not matter
        self._known = frozenset(self._nodes)
        self.settings = settings
        self._seed = seed
        if first is None:
            # the same generator as a follow-up round's, for round 0: a seed gives the matching it
            # always gave
            order = list(self._nodes)
            random.Random(f"gpumon.fabric.isolate:{seed}:0").shuffle(order)
            first = [[(order[i], order[i + 1]) for i in range(0, len(order) - 1, 2)]]
        self._first: list[list[tuple[str, str]]] = []
        for pairs in first:
            seen: set[str] = set()
            for a, b in pairs:
                if a == b or a not in self._known or b not in self._known or a in seen or b in seen:
                    raise ValueError(f"first-pass round {list(pairs)}: pair {a}-{b} is not two distinct "
                                     "known nodes of disjoint pairs")
                seen.update((a, b))
            if pairs:
                self._first.append([(a, b) for a, b in pairs])
        self._pairs: dict[tuple[str, str], _Merged] = {}
        self._met: dict[str, set[str]] = {n: set() for n in self._nodes}
        self._rounds = 0
        self._pending: list[tuple[str, str]] | None = None

    @property
    def rounds(self) -> int:
        return self._rounds

    # -- planning ---------------------------------------------------------------

    def next_round(self) -> list[tuple[str, str]]:
        """Disjoint pairs to measure next; ``[]`` when done (resolved, nothing left to try, or
        ``max_rounds``). Asking again before ``add`` returns the same round (not a new one)."""
        if self._pending is not None:
            return list(self._pending)
        if self._rounds >= self._limit() or len(self._nodes) < 2:
            return []
        # A fresh generator per round: the plan depends on the seed, the round and the results,
        # not on how often the caller asked.
        rng = random.Random(f"gpumon.fabric.isolate:{self._seed}:{self._rounds}")
        if self._rounds < len(self._first):
            plan = list(self._first[self._rounds])
        else:
            plan = self._plan(self._classify(), rng)
        if not plan:
            return []
        self._rounds += 1
        self._pending = plan
        return list(plan)

    def _limit(self) -> int:
        """Rounds in all: the first pass, then ``max_rounds`` - 1 follow-ups (the first pass counts as
        one round, as the single random round did before the probe passed rounds of its own)."""
        return max(1, len(self._first)) + self.settings.max_rounds - 1

    @property
    def first_pass(self) -> int:
        """Rounds of the first pass (the caller's, or the one random matching)."""
        return len(self._first)

    def _plan(self, st: _State, rng: random.Random) -> list[tuple[str, str]]:
        suspects = list(st.suspects)
        untested = list(st.untested)
        rng.shuffle(suspects)
        rng.shuffle(untested)
        # Suspects first: they are what the round is for; untested nodes (odd N's sit-out, nodes
        # whose only partner was faulty) next.
        needy = suspects + untested
        good = [n for n in self._nodes if st.is_good(n)]
        rng.shuffle(good)
        pool = deque(good)
        plan: list[tuple[str, str]] = []
        leftover: list[str] = []
        for node in needy:
            met = self._met[node]
            skipped: list[str] = []
            partner: str | None = None
            # Cost per node: at most len(met) skips (a node has met <= one partner per round).
            while pool:
                candidate = pool.popleft()
                if candidate in met:
                    skipped.append(candidate)
                    continue
                partner = candidate
                break
            pool.extendleft(reversed(skipped))
            if partner is None:
                leftover.append(node)
            else:
                plan.append((node, partner))
        # No good partner left: a pair of two suspects still tells something (a fast result
        # clears both; a slow one gives each another partner).
        plan.extend(self._greedy(leftover))
        if not plan and not st.trusted:
            # No suspect, but the reference may be the speed of one bad node (small N, see
            # _classify): measure untried pairs until it cannot be, or every pair is measured.
            candidates = [n for n in self._nodes if n not in st.node_faults]
            rng.shuffle(candidates)
            plan = self._greedy(candidates)
        return plan

    def _greedy(self, nodes: list[str]) -> list[tuple[str, str]]:
        """Pair ``nodes`` among themselves, in order, with partners not tried yet."""
        rest = list(nodes)
        plan: list[tuple[str, str]] = []
        while rest:
            node = rest.pop(0)
            met = self._met[node]
            for j, other in enumerate(rest):  # stops after <= len(met) + 1 candidates
                if other not in met:
                    plan.append((node, rest.pop(j)))
                    break
        return plan

    # -- results -----------------------------------------------------------------

    def add(self, results: Iterable[PairResult]) -> None:
        """Record results (of the planned round or any other pairs of these nodes)."""
        for r in results:
            for n in (r.a, r.b):
                if n not in self._known:
                    raise ValueError(f"unknown node {n!r} in pair {r.a}-{r.b}")
            key = _key(r.a, r.b)
            merged = self._pairs.get(key)
            if merged is None:
                merged = self._pairs[key] = _Merged()
                self._met[r.a].add(r.b)
                self._met[r.b].add(r.a)
            merged.merge(r)
        self._pending = None

    # -- classification ------------------------------------------------------------

    def _classify(self) -> _State:
        s = self.settings
        best_bw: dict[str, float] = {}
        best_lat: dict[str, float] = {}
        for (a, b), m in self._pairs.items():
            if m.failed is not None:
                continue  # numbers of a failed transfer are not a speed
            for n in (a, b):
                if m.busbw is not None and m.busbw > best_bw.get(n, -1.0):
                    best_bw[n] = m.busbw
                if m.p95 is not None and m.p95 < best_lat.get(n, math.inf):
                    best_lat[n] = m.p95
        ref_bw = _reference_bw(list(best_bw.values()), s)
        ref_lat = _reference_lat(list(best_lat.values()), s)

        kinds: dict[tuple[str, str], tuple[str, ...]] = {}
        fast: dict[str, list[str]] = {n: [] for n in self._nodes}
        bad: dict[str, list[str]] = {n: [] for n in self._nodes}
        fast_pairs: list[tuple[str, str]] = []
        for key in sorted(self._pairs):
            m = self._pairs[key]
            if not m.informative:
                continue
            k = _pair_kinds(m, ref_bw, ref_lat, s)
            kinds[key] = k
            a, b = key
            if k:
                bad[a].append(b)
                bad[b].append(a)
            else:
                fast[a].append(b)
                fast[b].append(a)
                fast_pairs.append(key)

        # Only good partners confirm: a bad pair of two suspects is evidence against both and is
        # explained by either (a bad node paired with a node whose round-1 pair failed by chance
        # would otherwise convict that node too).
        # A node is failed only after one more measurement with a fresh partner: one pair that read
        # slow once (noise, contention) next to a slow path would otherwise fail a healthy node. So a
        # node bad with confirm_partners good partners stays a suspect (paired with a good node it
        # has not met) until it is bad with one more, or no good partner is left to try.
        good = [n for n in self._nodes if fast[n]]
        node_faults = set()
        for n in self._nodes:
            if fast[n]:
                continue
            proven = sum(1 for p in bad[n] if fast[p])
            if proven > s.confirm_partners or (
                    proven == s.confirm_partners
                    and not any(g != n and g not in self._met[n] for g in good)):
                node_faults.add(n)
        suspects: list[str] = []
        untested: list[str] = []
        for n in self._nodes:
            if fast[n] or n in node_faults:
                continue
            if any(p not in node_faults for p in bad[n]):
                suspects.append(n)
            else:
                untested.append(n)

        # Can the reference be the speed of one bad node? Only if nothing measured is slower than it
        # (no contrast) and every fast pair goes through one node (a star: N=3, a-b and a-c equal).
        contrast = any(KIND_BANDWIDTH in k or KIND_LATENCY in k for k in kinds.values())
        healthy = len(self._nodes) - len(node_faults)
        among = sum(1 for a, b in kinds if a not in node_faults and b not in node_faults)
        exhausted = among >= healthy * (healthy - 1) // 2
        trusted = contrast or exhausted or not _star(fast_pairs)
        return _State(ref_bw, ref_lat, kinds, fast, bad, node_faults, suspects, untested, trusted)

    # -- verdict ---------------------------------------------------------------------

    def verdict(self) -> IsolationVerdict:
        st = self._classify()
        s = self.settings
        ref_text = _ref_text(st.ref_bw, st.ref_lat, s)

        node_faults: dict[str, NodeFault] = {}
        for n in sorted(st.node_faults):
            pairs = tuple(self._evidence(n, p, st) for p in sorted(self._met[n]))
            slow = tuple(sorted(st.bad[n]))
            good_partners = tuple(p for p in slow if st.is_good(p))
            kinds = _union(pe.kinds for pe in pairs)
            why = (f"bad with {len(slow)} partners ({', '.join(slow)}; known good: "
                   f"{', '.join(good_partners)}), fast with none; {'/'.join(kinds)}; {ref_text}")
            node_faults[n] = NodeFault(n, kinds, slow, good_partners, pairs, st.ref_bw, st.ref_lat, why)

        link_faults: list[LinkFault] = []
        link_ends: set[str] = set()
        for (a, b), k in sorted(st.kinds.items()):
            if not k or not (st.is_good(a) and st.is_good(b)):
                continue
            m = self._pairs[(a, b)]
            why = (f"{a}-{b} {'/'.join(k)} ({_values(m)}); {ref_text}; "
                   f"{a} fast with {', '.join(sorted(st.fast[a]))}; "
                   f"{b} fast with {', '.join(sorted(st.fast[b]))}")
            link_faults.append(LinkFault(a, b, k, m.busbw, m.p95, m.failed, st.ref_bw, st.ref_lat, why))
            link_ends.update((a, b))

        good = [n for n in self._nodes if st.is_good(n) and n not in link_ends]
        notes = self._notes(st)
        pairs_measured = len(self._pairs)
        return IsolationVerdict(node_faults, link_faults, list(st.suspects), list(st.untested), good,
                                self._rounds, pairs_measured, st.ref_bw, st.ref_lat, notes)

    def _untried(self, node: str, st: _State) -> bool:
        """Whether ``node`` has a partner not tried yet that is not a node fault."""
        met = self._met[node]
        tried = sum(1 for p in met if p not in st.node_faults)
        others = len(self._nodes) - 1 - len(st.node_faults - {node})
        return tried < others

    def _evidence(self, node: str, partner: str, st: _State) -> PairEvidence:
        m = self._pairs[_key(node, partner)]
        return PairEvidence(partner, m.busbw, m.p95, m.failed, st.kinds.get(_key(node, partner), ()),
                            st.is_good(partner))

    def _notes(self, st: _State) -> list[str]:
        notes: list[str] = []
        n = len(self._nodes)
        if n < 2:
            notes.append(f"{n} node(s): nothing to pair")
        elif n == 2:
            notes.append("2 nodes: one pair only. Its own value is the only reference, so only a failed "
                         "transfer shows, and a bad pair cannot be attributed to either node")
        if st.suspects:
            if self._rounds >= self._limit():
                notes.append(f"max_rounds ({self.settings.max_rounds}) reached with "
                             f"{len(st.suspects)} suspect(s) unresolved")
            elif self._pending is None and not any(self._untried(x, st) for x in st.suspects):
                notes.append(f"{len(st.suspects)} suspect(s) unresolved: no untried partner left to "
                             f"pair them with (of {n} nodes)")
        if self._pending is not None:
            notes.append(f"round {self._rounds} planned but its results not added yet")
        if self._pairs and st.ref_bw is None:
            notes.append("no bandwidth value measured: no bandwidth reference")
        if self._pairs and not st.trusted:
            notes.append("every fast pair goes through one node and none is slower: the reference may "
                         "be that node's own speed")
        return notes


def _reference_bw(bests: list[float], s: IsolationSettings) -> float | None:
    """Upper median of the node bests that are not slow next to the upper quartile of the bests."""
    if not bests:
        return None
    ordered = sorted(bests)
    # The quartile, not the maximum: one pair's wrong, too-high number moves it only in a group
    # of <= 8 nodes (a pair gives two nodes the same best).
    anchor = ordered[(3 * len(ordered)) // 4]
    # Bests far below the anchor are nodes that only met bad nodes or are bad: left out, so that
    # up to 3 of 4 nodes touched by a fault in round 1 do not drag the reference down.
    top = [v for v in ordered if v >= s.slow_fraction * anchor]
    # Upper median: a tie between two clusters goes to the fast one.
    return float(median_high(top))


def _reference_lat(bests: list[float], s: IsolationSettings) -> float | None:
    """Lower median of the node bests that are not slow next to the lower quartile of the bests."""
    if not bests:
        return None
    ordered = sorted(bests)
    anchor = ordered[(len(ordered) - 1) // 4]
    limit = max(s.latency_factor * anchor, anchor + s.latency_floor_us)
    return float(median_low([v for v in ordered if v <= limit]))


def _pair_kinds(m: _Merged, ref_bw: float | None, ref_lat: float | None,
                s: IsolationSettings) -> tuple[str, ...]:
    kinds: list[str] = []
    if m.failed is not None:
        kinds.append(KIND_FAILED)
    if m.busbw is not None and ref_bw is not None and m.busbw < s.slow_fraction * ref_bw:
        kinds.append(KIND_BANDWIDTH)
    if (m.p95 is not None and ref_lat is not None and m.p95 > s.latency_factor * ref_lat
            and m.p95 > ref_lat + s.latency_floor_us):
        kinds.append(KIND_LATENCY)
    return tuple(kinds)


def _star(fast_pairs: list[tuple[str, str]]) -> bool:
    """Whether one node is in every fast pair (or there is none). A graph of pairs with no such
    node holds two node-disjoint pairs or a triangle: at least two nodes reach the reference."""
    if not fast_pairs:
        return True
    u, v = fast_pairs[0]
    return all(u in p for p in fast_pairs) or all(v in p for p in fast_pairs)


def _union(kind_sets: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    seen: set[str] = set()
    for kinds in kind_sets:
        seen.update(kinds)
    return tuple(k for k in _KIND_ORDER if k in seen)


def bw_text(gbps: float) -> str:
    """A bandwidth in the unit that shows it: 46.2 GB/s on GPUs, 160 MB/s on CPU ranks (not 0.0 GB/s)."""
    for unit, scale in (("GB/s", 1.0), ("MB/s", 1e-3), ("kB/s", 1e-6)):
        if abs(gbps) >= scale:
            value = gbps / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{gbps * 1e9:.0f} B/s"


def _values(m: _Merged) -> str:
    parts: list[str] = []
    if m.failed is not None:
        parts.append(f"failed: {m.failed}")
    if m.busbw is not None:
        parts.append(bw_text(m.busbw))
    if m.p95 is not None:
        parts.append(f"p95 {m.p95:.1f} us")
    return ", ".join(parts) or "no value"


def _ref_text(ref_bw: float | None, ref_lat: float | None, s: IsolationSettings) -> str:
    parts: list[str] = []
    if ref_bw is not None:
        parts.append(f"reference {bw_text(ref_bw)} (slow below {bw_text(s.slow_fraction * ref_bw)})")
    if ref_lat is not None:
        limit = max(s.latency_factor * ref_lat, ref_lat + s.latency_floor_us)
        parts.append(f"reference p95 {ref_lat:.1f} us (slow above {limit:.1f})")
    return "; ".join(parts) or "no reference"
