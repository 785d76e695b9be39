"""Rank 0's judgement of a probe: group figures per collective and size, and one finding per node.

Pure: plain records in (every rank's ``OpResult``s, the pair results, the isolation verdict, the
ranks lost), findings and a report out.

- **Collectives** are judged for the group: per operation and size, the slowest rank's median time
  gives algbw and busbw, the worst rank's p95/p99 the latency. Large sizes (>= ``large_min_bytes``)
  by their best busbw against the profile's ``busbw_min_gbps``; small sizes (<= ``small_max_bytes``)
  by their worst p95 against ``latency_p95_us_max``. A collective is a group figure: every rank
  waits for the slowest, so it says *that* the fabric is slow, not *where*.
- **Where** comes from the pair exchanges (``gpumon.fabric.isolate``): every node against the
  group's reference (relative: no profile needed), large sizes by busbw, small sizes by p95. A
  node slow with every partner is a node fault (its NIC, cable or switch port: ``check_cables``);
  a pair slow only together is a path fault, recorded on both nodes as a warning without a
  remedy (cordoning two healthy nodes would not repair a switch path). The group's pair reference
  is held against the profile's ``sendrecv`` floor and ceiling like a collective.
- **Wrong data** fails the node whose rank sent it (``inspect_hardware``: data that arrives wrong
  without a link error was corrupted in a GPU, NIC or PCIe path, not on the wire, whose CRC
  would have caught it).
- A group that is slow against the profile with no node to blame gets a warning on every node
  (a switch or the whole fabric).
- **Lost ranks** (no heartbeat while the others went on) fail their node in the group report
  (``check_cables``: a node that drops off mid-collective is the fault the probe hunts; the lost
  node itself, cut off, records ``unknown`` locally, and its own ``ib`` check sees a port down); the
  other nodes get ``unknown``: the probe could not vouch for them. When rank 0 loses most of the
  group it may be the one cut off, and nobody is failed.
- **Which reference.** NCCL ranks on GPUs are held against the SKU profile's floors and the group's
  own pairs. Gloo ranks on CPU (``--device cpu``, a machine without GPUs, a simulated node) are
  never held against a profile's floors: those are NVLink/InfiniBand figures (330 GB/s on an H100),
  and a CPU rank below them says nothing about the fabric. They are judged against the group's own
  pairs with the ``cpu.*`` margins, and every result is checked exactly. Every finding says which
  reference judged it (``evidence.judged_against``, and in short at the end of its message).

Each node gets exactly one ``fabric`` finding for component ``node`` (worst wins, every problem in
the message and the evidence), carrying the node's readings for Prometheus.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon.fabric.isolate import IsolationVerdict, PairResult, bw_text
from gpumon.fabric.schedule import Coverage
from gpumon.fabric.settings import FabricConfig
from gpumon.fabric.sweep import OpResult, busbw_factor
from gpumon.model import NODE, Action, Finding, Severity, Status, overall_status, reading

CHECK = "fabric"
GB = 1e9


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: str
    local_rank: int
    pid: int = 0


def size_class(nbytes: int, settings: FabricConfig, large_min: int) -> str:
    if nbytes <= settings.small_max_bytes:
        return "small"
    if nbytes >= large_min:
        return "large"
    return "mid"


@dataclass
class Row:
    """One collective at one size, for the group."""

    op: str
    nbytes: int
    size_class: str
    iterations: int
    p50_us: float
    p95_us: float
    p99_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    ranks: int

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else
                    (round(v, 3) if isinstance(v, float) else v)) for k, v in self.__dict__.items()}


def group_rows(results: Mapping[int, Sequence[OpResult]], world: int, settings: FabricConfig,
               large_min: int) -> list[Row]:
    by_key: dict[tuple[str, int], list[OpResult]] = {}
    for per_rank in results.values():
        for r in per_rank:
            by_key.setdefault((r.op, r.nbytes), []).append(r)
    rows = []
    for (op, nbytes), rs in by_key.items():
        t50 = max((r.p50_s for r in rs if math.isfinite(r.p50_s)), default=math.nan)
        algbw = nbytes / t50 / GB if t50 and math.isfinite(t50) and t50 > 0 else math.nan
        rows.append(Row(
            op=op, nbytes=nbytes, size_class=size_class(nbytes, settings, large_min),
            iterations=min(r.iterations for r in rs), p50_us=t50 * 1e6,
            p95_us=max((r.p95_s for r in rs if math.isfinite(r.p95_s)), default=math.nan) * 1e6,
            p99_us=max((r.p99_s for r in rs if math.isfinite(r.p99_s)), default=math.nan) * 1e6,
            algbw_gbps=algbw, busbw_gbps=algbw * busbw_factor(op, world), wrong=sum(r.wrong for r in rs),
            ranks=len(rs)))
    rows.sort(key=lambda row: (row.op, row.nbytes))
    return rows


@dataclass(frozen=True)
class ProfileMiss:
    op: str
    what: str  # "busbw" | "latency"
    measured: float
    limit: float
    nbytes: int

    def text(self) -> str:
        if self.what == "busbw":
            return (f"{self.op} busbw {bw_text(self.measured)} at large sizes, below the profile's "
                    f"{self.limit:g} GB/s")
        return f"{self.op} p95 {self.measured:.0f} us at small sizes, above the profile's {self.limit:g} us"


def profile_misses(rows: Sequence[Row], settings: FabricConfig) -> list[ProfileMiss]:
    out = []
    for op in sorted({r.op for r in rows}):
        mine = [r for r in rows if r.op == op]
        floor = settings.busbw_min_gbps.get(op)
        large = [r for r in mine if r.size_class == "large" and math.isfinite(r.busbw_gbps)]
        if floor is not None and large:
            best = max(large, key=lambda r: r.busbw_gbps)
            if best.busbw_gbps < floor:
                out.append(ProfileMiss(op, "busbw", best.busbw_gbps, floor, best.nbytes))
        ceiling = settings.latency_p95_us_max.get(op)
        small = [r for r in mine if r.size_class == "small" and math.isfinite(r.p95_us)]
        if ceiling is not None and small:
            worst = max(small, key=lambda r: r.p95_us)
            if worst.p95_us > ceiling:
                out.append(ProfileMiss(op, "latency", worst.p95_us, ceiling, worst.nbytes))
    return out


@dataclass
class Probe:
    """Everything rank 0 knows when it judges."""

    settings: FabricConfig
    ranks: dict[int, RankInfo]
    world: int
    large_min_bytes: int
    cpu: bool  # gloo on CPU: judged without the profile's GPU floors
    collectives: dict[int, list[OpResult]] = field(default_factory=dict)
    pairs: list[PairResult] = field(default_factory=list)
    pair_results: dict[int, list[OpResult]] = field(default_factory=dict)  # per rank, every round
    isolation: IsolationVerdict | None = None
    lost: dict[int, str] = field(default_factory=dict)  # rank -> what it was doing when last heard
    errors: dict[int, str] = field(default_factory=dict)  # rank -> error it reported
    hung: str | None = None  # the phase the group stopped in, when it did not finish
    time: float = 0.0
    profile: str = ""  # the SKU profile the floors come from (named in the findings)
    # heartbeat silences that ended: rank -> [(seconds, what it said before, what it said after)]
    silences: dict[int, list[tuple[float, str, str]]] = field(default_factory=dict)
    coverage: Coverage | None = None  # the group's pair coverage after this run (gpumon.fabric.schedule)

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node for r in self.ranks.values()})

    def node_of(self, rank: int) -> str:
        info = self.ranks.get(rank)
        return info.node if info else f"rank {rank}"


@dataclass(frozen=True)
class Stall:
    """A call far slower than its own size's median, or a heartbeat that went silent and came back:
    a link that went down for a moment. ``nodes`` are the ones involved; ``named``: they are the
    culprit's side (a rank's own silence), else "one of these" (a pair, a whole-group collective,
    where every rank waits for the slowest)."""

    where: str  # "all_gather 32768 B timed", "sendrecv 8 B warm-up with rank 2", "heartbeat"
    nodes: tuple[str, ...]
    seconds: float  # the stalled call (or silence)
    median_s: float | None  # the size's median call
    named: bool

    def to_json(self) -> dict[str, Any]:
        return {"where": self.where, "nodes": list(self.nodes), "seconds": round(self.seconds, 3),
                "median_s": None if self.median_s is None else round(self.median_s, 6), "named": self.named}

    def text(self) -> str:
        med = f" (its median {self.median_s * 1e3:.1f} ms)" if self.median_s is not None else ""
        if self.named:
            return f"{', '.join(self.nodes)} went silent for {self.seconds:.1f} s {self.where}"
        return (f"{self.where} stalled {self.seconds:.2f} s{med}: one of {', '.join(self.nodes)} "
                "(or the path between them)")


def _stalled(seconds: float, median: float, factor: float, floor: float) -> bool:
    """Far above its own median: ``factor`` times, and ``floor`` seconds more (CPU noise and
    scheduling cannot reach it; a lost packet's retransmit timeout does)."""
    return (math.isfinite(seconds) and math.isfinite(median) and seconds > factor * median
            and seconds - median > floor)


def find_stalls(p: Probe) -> list[Stall]:
    """Every stall the ranks' own numbers show: a collective's tail (p99), its slowest warm-up call,
    its agreements (through the store), the same for each pair exchange, and heartbeat silences."""
    margins = p.settings.cpu if p.cpu else p.settings
    factor, floor = margins.stall_factor, margins.stall_floor_s
    group = tuple(p.nodes)
    seen: dict[tuple[str, tuple[str, ...]], Stall] = {}

    def add(st: Stall) -> None:
        key = (st.where, st.nodes)
        if key not in seen or seen[key].seconds < st.seconds:
            seen[key] = st

    def scan(rank: int, results: Sequence[OpResult]) -> None:
        for r in results:
            if r.peer is not None:
                nodes = tuple(sorted({p.node_of(rank), p.node_of(r.peer)}))
                label = f"sendrecv {r.nbytes} B between {' and '.join(nodes)}"
            else:
                nodes, label = group, f"{r.op} {r.nbytes} B"
            med = r.p50_s
            for what, value, base in (("timed", r.p99_s, med), ("warm-up", r.warmup_max_s, med),
                                      ("agreement", r.agree_max_s, med)):
                if _stalled(value, base, factor, floor):
                    add(Stall(f"{label} {what}", nodes, value, med, named=False))

    for rank, results in sorted(p.collectives.items()):
        scan(rank, results)
    for rank, results in sorted(p.pair_results.items()):
        scan(rank, results)
    silent = {q: v for q, v in p.silences.items() if v}
    others = [q for q in p.ranks if q != 0]
    if silent and others and len(silent) * 2 > len(others) and 0 not in silent:
        # most ranks silent at once, as rank 0 saw it: rank 0's own node was the one cut off
        worst = max((x for v in silent.values() for x in v), key=lambda x: x[0])
        add(Stall(f"(rank 0 heard most of the group go silent, during {worst[1]})",
                  (p.node_of(0),), worst[0], None, named=True))
    else:
        for q, events in sorted(silent.items()):
            worst = max(events, key=lambda x: x[0])
            add(Stall(f"(its heartbeat, during {worst[1]})", (p.node_of(q),), worst[0], None, named=True))
    return sorted(seen.values(), key=lambda st: -st.seconds)


@dataclass
class Verdict:
    rows: list[Row]
    findings: dict[str, Finding]  # node -> its one finding
    misses: list[ProfileMiss]
    corrupt: dict[int, int]  # source rank -> wrong elements traced to it
    complete: bool
    stalls: list[Stall] = field(default_factory=list)

    @property
    def status(self) -> Status:
        return overall_status(self.findings.values())


def judged_against(p: Probe) -> tuple[str, str]:
    """(short, full): the reference this probe's figures were judged against, for the findings."""
    margins = p.settings.cpu if p.cpu else p.settings
    pairs = (f"the group's own node pairs (slow below {margins.slow_fraction:g} x the reference busbw; "
             f"p95 above {margins.latency_factor:g} x the reference and {margins.latency_floor_us:g} us "
             "more)")
    if p.cpu:
        where = "gloo on CPU"
        never = (f"never the GPU floors of profile {p.profile}" if p.profile
                 else "never a GPU profile's floors")
        if len(p.nodes) < 2:
            return (f"{where}, one node: data checked exactly, speed not judged",
                    f"{where}: every result checked exactly; speed not judged (one node: no pair to compare "
                    f"with); {never} (NVLink/InfiniBand figures)")
        return (f"{where}: the group's own pairs, not a GPU profile",
                f"{where}: every result checked exactly; speed against {pairs} (checks.fabric.cpu); {never} "
                "(NVLink/InfiniBand figures)")
    floors = ", ".join(f"{k} {v:g} GB/s" for k, v in sorted(p.settings.busbw_min_gbps.items()))
    ceilings = ", ".join(f"{k} {v:g} us" for k, v in sorted(p.settings.latency_p95_us_max.items()))
    name = f"profile {p.profile}" if p.profile else "the profile"
    return (f"NCCL on GPUs: {name} and the group's own pairs",
            f"NCCL on GPUs: every result checked exactly; busbw floors of {name}: {floors or 'none set'}; "
            f"p95 ceilings: {ceilings or 'none set'}; and {pairs}")


def judge(p: Probe) -> Verdict:
    rows = group_rows(p.collectives, p.world, p.settings, p.large_min_bytes)
    # a CPU rank's bandwidth against an NVLink/InfiniBand floor would fail every CPU group
    misses = [] if p.cpu else profile_misses(rows, p.settings)
    iso = p.isolation
    floor, ceiling = p.settings.busbw_min_gbps.get("sendrecv"), p.settings.latency_p95_us_max.get("sendrecv")
    if p.cpu:
        floor = ceiling = None
    if iso is not None and floor is not None and iso.reference_busbw_gbps is not None \
            and iso.reference_busbw_gbps < floor:
        misses.append(ProfileMiss("sendrecv", "busbw", iso.reference_busbw_gbps, floor, 0))
    if iso is not None and ceiling is not None and iso.reference_p95_us is not None \
            and iso.reference_p95_us > ceiling:
        misses.append(ProfileMiss("sendrecv", "latency", iso.reference_p95_us, ceiling, 0))
    corrupt: dict[int, int] = {}
    for per_rank in (*p.collectives.values(), *p.pair_results.values()):
        for r in per_rank:
            for src, n in r.wrong_sources.items():
                corrupt[int(src)] = corrupt.get(int(src), 0) + n
    # a wrong sum nobody's contribution explains: the ranks that received it
    unexplained = {rank: sum(r.wrong for r in rs if r.op in ("all_reduce", "reduce_scatter"))
                   for rank, rs in p.collectives.items()}
    unexplained = {k: v for k, v in unexplained.items() if v} if not corrupt else {}
    complete = not p.lost and not p.errors and p.hung is None
    pair_bw = _node_pair_values(p)
    stalls = find_stalls(p)
    findings = {node: _node_finding(p, node, rows, misses, corrupt, unexplained, pair_bw, complete, stalls)
                for node in p.nodes}
    return Verdict(rows, findings, misses, corrupt, complete, stalls)


def _node_pair_values(p: Probe) -> dict[str, tuple[float | None, float | None]]:
    """Per node: the median busbw and p95 latency of its pairs (its own sendrecv readings)."""
    per: dict[str, tuple[list[float], list[float]]] = {}
    for pr in p.pairs:
        for node in (pr.a, pr.b):
            bws, lats = per.setdefault(node, ([], []))
            if pr.busbw_gbps is not None:
                bws.append(pr.busbw_gbps)
            if pr.p95_latency_us is not None:
                lats.append(pr.p95_latency_us)
    return {n: (_median(b), _median(lat)) for n, (b, lat) in per.items()}


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _node_finding(p: Probe, node: str, rows: Sequence[Row], misses: Sequence[ProfileMiss],
                  corrupt: Mapping[int, int], unexplained: Mapping[int, int],
                  pair_bw: Mapping[str, tuple[float | None, float | None]], complete: bool,
                  stalls: Sequence[Stall] = ()) -> Finding:
    mine = sorted(r for r, info in p.ranks.items() if info.node == node)
    problems: list[tuple[Severity, Action, str]] = []
    short, full = judged_against(p)
    evidence: dict[str, Any] = {"ranks": mine, "group_nodes": len(p.nodes), "group_ranks": p.world,
                                "device": "cpu" if p.cpu else "cuda", "judged_against": full}
    bad_ranks = {r: n for r, n in corrupt.items() if r in mine}
    if bad_ranks:
        evidence["corrupted_from_ranks"] = {str(k): v for k, v in sorted(bad_ranks.items())}
        problems.append((Severity.FAIL, Action.INSPECT_HARDWARE,
                         f"data sent by rank(s) {', '.join(map(str, sorted(bad_ranks)))} on {node} arrived "
                         f"wrong ({sum(bad_ranks.values())} elements): a GPU, NIC or PCIe path corrupts "
                         "what it sends"))
    wrong_here = {r: n for r, n in unexplained.items() if r in mine}
    if wrong_here:
        evidence["wrong_sums_on_ranks"] = {str(k): v for k, v in sorted(wrong_here.items())}
        problems.append((Severity.FAIL, Action.INSPECT_HARDWARE,
                         f"rank(s) {', '.join(map(str, sorted(wrong_here)))} on {node} received wrong sums "
                         "although every contribution arrived intact"))
    iso = p.isolation
    if iso is not None:
        fault = iso.node_faults.get(node)
        if fault is not None:
            evidence["node_fault"] = fault.to_json()
            partners = ", ".join(fault.slow_partners)
            problems.append((Severity.FAIL, Action.CHECK_CABLES,
                             f"{node} is slow ({'/'.join(fault.kinds)}) with every partner ({partners}): "
                             f"its NIC, cable or switch port; {fault.why}"))
        links = [lf for lf in iso.link_faults if node in (lf.a, lf.b)]
        if links:
            evidence["link_faults"] = [lf.to_json() for lf in links]
            for lf in links:
                other = lf.b if lf.a == node else lf.a
                problems.append((Severity.WARN, Action.NONE,
                                 f"the path between {node} and {other} is slow ({'/'.join(lf.kinds)}) "
                                 f"while both are fast with other nodes: a switch path; {lf.why}"))
        if node in iso.unresolved:
            problems.append((Severity.WARN, Action.NONE,
                             f"{node} was slow with its partner(s) and the rounds could not tell which side "
                             f"is at fault ({'; '.join(iso.notes) or 'too few nodes'})"))
    mine_stalls = [st for st in stalls if node in st.nodes]
    if mine_stalls:
        # a link that went down for a moment and came back: never "ok". Named (its own heartbeat
        # went silent): its NIC, cable or port; else one of the nodes measured when it stalled
        evidence["stalls"] = [st.to_json() for st in mine_stalls]
        named = [st for st in mine_stalls if st.named]
        if named:
            problems.append((Severity.WARN, Action.CHECK_CABLES,
                             f"{node} stalled during the probe: {named[0].text()}: a link that went "
                             "down and came back (its NIC, cable or switch port)"))
        others = [st for st in mine_stalls if not st.named]
        if others:
            more = f" (+{len(others) - 1} more)" if len(others) > 1 else ""
            problems.append((Severity.WARN, Action.NONE,
                             f"a call stalled during the probe: {others[0].text()}{more}"))
    lost_here = {r: what for r, what in p.lost.items() if r in mine}
    lost_nodes = {p.node_of(r) for r in p.lost}
    # rank 0 losing most of the group is more likely cut off itself than seeing a majority fail
    majority_lost = len(lost_nodes) * 2 > len(p.nodes) - 1
    if lost_here:
        evidence["lost_ranks"] = {str(k): v for k, v in lost_here.items()}
        last = next(iter(lost_here.values()))
        if majority_lost:
            problems.append((Severity.UNKNOWN, Action.NONE,
                             f"{node} stopped answering during the probe (last heard: {last}), as did most "
                             "of the group: the rendezvous host may be the one cut off"))
        else:
            problems.append((Severity.FAIL, Action.CHECK_CABLES,
                             f"{node} was lost during the probe: its rank(s) "
                             f"{', '.join(map(str, lost_here))} "
                             f"stopped answering (last heard: {last}) while the rest of the group went on: "
                             "its NIC, cable or switch port"))
    elif not complete:
        why = (f"lost {', '.join(sorted(lost_nodes))}" if lost_nodes else
               (f"rank errors: {'; '.join(f'{r}: {e}' for r, e in sorted(p.errors.items()))}" if p.errors
                else f"the group stopped in {p.hung}"))
        problems.append((Severity.UNKNOWN, Action.NONE, f"probe incomplete ({why}): {node} not fully judged"))
    if misses and not problems and (iso is None or not iso.node_faults):
        evidence["profile_misses"] = [m.__dict__ for m in misses]
        problems.append((Severity.WARN, Action.NONE,
                         "the whole group is below the profile and no node stands out (a switch, the "
                         "fabric, or congestion): " + "; ".join(m.text() for m in misses)))
    if p.coverage is not None:
        c = p.coverage
        evidence["coverage"] = {"pairs_measured": c.pairs_measured, "pairs_total": c.pairs_total,
                                "runs_since_full_coverage": c.runs_since_full_coverage,
                                "runs_per_cycle": c.runs_per_cycle}
    evidence["readings"] = _readings(node, rows, pair_bw, p.time, complete and not problems, p.coverage)
    if not problems:
        bw, lat = pair_bw.get(node, (None, None))
        detail = (f"; pairs: {bw_text(bw)}, p95 {lat:.0f} us" if bw is not None and lat is not None else "")
        return Finding(CHECK, NODE, Severity.OK,
                       f"fabric probe passed on {len(p.nodes)} node(s) / {p.world} ranks{detail} "
                       f"(judged against: {short})", Action.NONE, evidence)
    severity = max(s for s, _, _ in problems)
    action = max(a for _, a, _ in problems)
    ordered = sorted(problems, key=lambda t: (t[0], t[1]), reverse=True)
    return Finding(CHECK, NODE, severity, "; ".join(m for _, _, m in ordered) + f" (judged against: {short})",
                   action, evidence)


def _readings(node: str, rows: Sequence[Row], pair_bw: Mapping[str, tuple[float | None, float | None]],
              when: float, passed: bool, coverage: Coverage | None = None) -> list[Any]:
    out: list[Any] = []
    for op in sorted({r.op for r in rows}):
        for cls in ("small", "mid", "large"):
            sel = [r for r in rows if r.op == op and r.size_class == cls]
            bws = [r.busbw_gbps for r in sel if math.isfinite(r.busbw_gbps)]
            lats = [r.p95_us for r in sel if math.isfinite(r.p95_us)]
            if bws:
                out.append(reading("fabric_busbw_bytes_per_second", max(bws) * GB, op=op, size_class=cls))
            if lats:
                out.append(reading("fabric_latency_p95_seconds", max(lats) / 1e6, op=op, size_class=cls))
    bw, lat = pair_bw.get(node, (None, None))
    if bw is not None:
        out.append(reading("fabric_busbw_bytes_per_second", bw * GB, op="sendrecv", size_class="large"))
    if lat is not None:
        out.append(reading("fabric_latency_p95_seconds", lat / 1e6, op="sendrecv", size_class="small"))
    out.append(reading("fabric_last_probe_timestamp_seconds", when))
    out.append(reading("fabric_last_probe_passed", passed))
    if coverage is not None:
        out.append(reading("fabric_pairs_measured", coverage.pairs_measured))
        out.append(reading("fabric_pairs_in_group", coverage.pairs_total))
        out.append(reading("fabric_runs_since_full_coverage", coverage.runs_since_full_coverage))
        out.append(reading("fabric_runs_per_coverage_cycle", coverage.runs_per_cycle))
    return out
