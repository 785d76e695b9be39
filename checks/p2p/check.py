"""p2p: peer-to-peer paths and copy bandwidth for every ordered GPU pair.

Two parts, each reported as a matrix in the node finding's evidence:

- **NVML** (every node with two or more GPUs, simulated ones included): for each ordered pair,
  ``nvmlDeviceGetP2PStatus`` for the READ, WRITE and NVLINK capabilities and
  ``nvmlDeviceGetTopologyCommonAncestor`` (the PCIe distance, as ``nvidia-smi topo -m`` prints
  it: PIX, PXB, PHB, NODE, SYS). On an NVLink SKU (``expect_nvlink``, by default the profile's
  ``nvlink.links_per_gpu`` > 0) every pair must report NVLink P2P status OK; a pair that does not
  would fall back to PCIe or host copies, an order of magnitude slower.
- **Copies** (two or more CUDA devices): ``nbytes`` copied GPU i -> GPU j for every
  ordered pair, one pair at a time (both directions are two pairs), GB/s compared with the
  profile's ``min_gbps``; the copied data is compared with its source. A pair below the minimum
  is measured once more before it fails (bandwidth varies run to run; ``retryable: true``).
  On a simulated node, CPU workers stand in for the simulated GPUs (``cpu`` sizes; a simulated
  slow link is a ``p2p_slow`` fault) and a pair is judged against ``cpu.min_share_of_median`` of
  the median pair instead of a datasheet figure.

Blame: a GPU in more than half of its ordered pairs' faults is the fault (``gpu/<i>``); a
fault that no single GPU explains is reported on ``node`` naming both GPUs of each pair. Without
CUDA on a node that is not simulated (CI) the copy part is ``skipped`` with the reason.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon import workers
from gpumon.check import NOT_TESTED, Check, CheckContext
from gpumon.errors import HwCondition
from gpumon.hw import placement
from gpumon.hw.inventory import Inventory
from gpumon.model import (
    NODE,
    UNIT_BYTES_PER_SECOND,
    Action,
    Finding,
    Phase,
    ReadingSpec,
    Severity,
    gpu,
    reading,
)

from . import kernels

# NVML nvmlGpuP2PCapsIndex_t, nvmlGpuP2PStatus_t, nvmlGpuTopologyLevel_t (nvml.h; the same values in
# nvidia-ml-py's NVML_P2P_CAPS_INDEX_*, NVML_P2P_STATUS_*, NVML_TOPOLOGY_*). Checks never import pynvml.
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2}
P2P_STATUS = {0: "OK", 1: "CHIPSET_NOT_SUPPORTED", 2: "GPU_NOT_SUPPORTED", 3: "IOH_TOPOLOGY_NOT_SUPPORTED",
              4: "DISABLED_BY_REGKEY", 5: "NOT_SUPPORTED", 6: "UNKNOWN"}
# nvidia-smi topo -m's legend for each level
TOPOLOGY = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

Pair = tuple[int, int]  # (source GPU, destination GPU), NVML indices


@dataclass(frozen=True)
class P2pCpu:
    """Copies between CPU workers standing in for a simulated node's GPUs (CI): judged by the median."""

    nbytes: int = field(default=1 << 20, metadata={"min": 4096, "max": 1 << 30})
    iterations: int = field(default=5, metadata={"min": 1})
    min_share_of_median: float = field(default=0.3, metadata={
        "min": 0.0, "max": 1.0,
        "source": "measured: 1 MiB copies between stand-ins timed by the copying thread's CPU time on the "
                  "2-core development VM (2026-11-30, 6 runs x 56 pairs, other tests running alongside): "
                  "lowest pair 0.41-0.72 of the median; a simulated slow link (p2p_slow factor 0.1) "
                  "reads ~0.1"})


@dataclass(frozen=True)
class P2pConfig:
    nbytes: int = field(default=512 << 20, metadata={
        "min": 4096, "max": 8 << 30,
        "source": "argued: large enough that a copy is bandwidth-bound (~1.5 ms at 335 GB/s), small "
                  "enough for 56 ordered pairs x 2 attempts within seconds"})
    iterations: int = field(default=10, metadata={"min": 1})
    # from the SKU profile (checks.p2p.min_gbps, with its source there)
    min_gbps: float | None = field(default=None, metadata={"min": 0})
    # None: expect NVLink P2P exactly when the profile gives the SKU NVLinks
    expect_nvlink: bool | None = None
    startup_s: float = field(default=120.0, metadata={
        "min": 1, "source": "argued: process start and a CUDA context on every GPU"})
    per_pair_s: float = field(default=5.0, metadata={
        "min": 0.1,
        "source": "argued: one pair at a healthy rate takes ~0.1 s including its warm-up; 56 pairs and a "
                  "retry of all of them stay inside the check's 900 s timeout"})
    # false: NVML paths only (copy bandwidth measured elsewhere, e.g. by nvbandwidth)
    copies: bool = True
    cpu: P2pCpu = field(default_factory=P2pCpu)


@dataclass(frozen=True)
class PairPath:
    """What NVML says about the path from one GPU to another."""

    src: int
    dst: int
    status: dict[str, str]  # capability -> NVML P2P status name
    topology: str  # X, PIX, PXB, PHB, NODE, SYS, or an error
    error: str | None = None

    @property
    def nvlink(self) -> bool:
        return self.status.get("nvlink") == "OK"

    @property
    def short(self) -> str:
        if self.error:
            return "ERR"
        if self.nvlink:
            return "NV"
        if self.status.get("read") == "OK" or self.status.get("write") == "OK":
            return self.topology
        return "--"


def nvml_paths(ctx: CheckContext, indices: Sequence[int]) -> dict[tuple[int, int], PairPath]:
    """NVML's P2P status and PCIe distance for every ordered pair of ``indices``.

    Read through the typed readings ``p2p_status`` and ``topology_common_ancestor`` (bounded and
    mapped in gpumon/hw/nvml.py, which resolves both GPUs' handles); a peer whose handle cannot be
    had makes each of its pairs an error naming that call.
    """
    nvml = ctx.hw.nvml
    out: dict[tuple[int, int], PairPath] = {}
    for i, j in itertools.permutations(indices, 2):
        status: dict[str, str] = {}
        try:
            for cap in P2P_CAPS:
                value = nvml.p2p_status(i, j, cap)
                status[cap] = P2P_STATUS.get(value, f"status {value}")
            level = nvml.topology_common_ancestor(i, j)
        except HwCondition as cond:
            out[(i, j)] = PairPath(i, j, status, "?", f"{cond.call}: {cond}")
            continue
        out[(i, j)] = PairPath(i, j, status, TOPOLOGY.get(level, f"level {level}"))
    return out


def matrix(indices: Sequence[int], cell: Mapping[tuple[int, int], str], width: int = 7) -> list[str]:
    """Rows of text, source GPUs down, destinations across (``X`` on the diagonal)."""
    head = " " * 6 + "".join(f"{'GPU' + str(j):>{width}}" for j in indices)
    rows = [head]
    for i in indices:
        cells = "".join(f"{('X' if i == j else cell.get((i, j), '-')):>{width}}" for j in indices)
        rows.append(f"{'GPU' + str(i):<6}{cells}")
    return rows


def blame(bad: Iterable[tuple[int, int]], indices: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """(GPUs in more than half of their ordered pairs' faults, faulty pairs none of those explains).

    Each GPU is in 2(n-1) ordered pairs. A GPU whose links are bad shows in most of them; one bad
    pair shows in one pair of each of its two GPUs, which blames neither (both are named). When every
    GPU would be blamed, none is: nothing singles one out.
    """
    bad = set(bad)
    n = len(indices)
    if n < 2:
        return [], sorted(bad)
    counts = {i: sum(1 for p in bad if i in p) for i in indices}
    culprits = sorted(i for i, c in counts.items() if c * 2 > 2 * (n - 1))
    if len(culprits) == n:
        # every GPU in most of its pairs' faults (two GPUs; a fabric or NVSwitch down): no single GPU
        # stands out, the fault is the node's
        culprits = []
    rest = sorted(p for p in bad if not (set(p) & set(culprits)))
    return culprits, rest


class P2pCheck(Check):
    name = "p2p"
    phase = Phase.BOOTSTRAP
    description = ("all ordered GPU pairs: NVML P2P status and topology vs the profile (NVLink expected on "
                   "NVLink SKUs), peer copy bandwidth per pair and direction vs the profile")
    readings = (
        ReadingSpec(
            "p2p_copy_bytes_per_second", "gauge",
            "Copy bandwidth from this GPU to GPU <peer> (label peer: the peer's NVML index) in the last p2p "
            "run, one direction's bytes.",
            unit=UNIT_BYTES_PER_SECOND,
            source="gpumon's CUDA peer-copy worker (torch), one ordered pair at a time",
            labels=("peer",)),
    )
    # seconds a healthy run takes (suite order and ETA), an estimate, not measured:
    # 56 ordered pairs x ~0.1 s plus start-up
    cost = 20.0
    timeout = 900.0
    Config = P2pConfig

    def supported(self, inventory: Inventory) -> str | None:
        if len(inventory.gpus) + len(inventory.unreadable_gpus) < 2:
            return "fewer than 2 GPUs: no GPU pairs"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(P2pConfig)
        indices = sorted(g.index for g in ctx.inventory.gpus)
        expect_nvlink = options.expect_nvlink
        if expect_nvlink is None:
            expect_nvlink = bool(ctx.profile.nvlink.links_per_gpu)
        paths = nvml_paths(ctx, indices)
        evidence: dict[str, Any] = {}
        plan = CopyPlan()
        copies, copy_note, missing = self._copies(ctx, options, indices, evidence, plan)
        return judge(ctx, indices, paths, copies, copy_note, options, expect_nvlink, evidence, missing, plan)

    def _copies(self, ctx: CheckContext, options: P2pConfig, indices: Sequence[int], evidence: dict[str, Any],
                plan: CopyPlan) -> tuple[dict[Pair, kernels.PeerCopy] | None, str, Severity]:
        """Peer copy bandwidth by NVML index pair; or None, why it was not measured, and how bad that is.

        No torch or a simulated node: ``skipped``. A real GPU node whose GPUs torch cannot use, or a
        copy worker that failed: ``unknown`` (the pairs should have been measured).
        """
        if not options.copies:
            return (None, "copy bandwidth not measured: switched off (checks.p2p.copies: false)",
                    Severity.SKIPPED)
        reason = workers.torch_missing()
        if reason:
            return None, f"copy bandwidth not measured: {reason}", Severity.SKIPPED
        try:
            place = ctx.hw.devices.place(ctx.inventory, 0)
        except placement.NoCudaOnGpuNode as exc:
            return None, f"copy bandwidth not measured: {exc}", Severity.UNKNOWN
        if not place.names_gpus:
            where = f" ({ctx.hw.devices.describe()})" if ctx.hw.devices.describe() else ""
            return None, f"copy bandwidth needs CUDA devices; torch sees none{where}", Severity.SKIPPED
        if place.devices < 2:
            return (None, f"copy bandwidth needs 2 or more CUDA devices; torch sees {place.devices} of the "
                          f"{len(ctx.inventory.gpus)} GPUs NVML sees", Severity.UNKNOWN)
        ordinals = list(range(place.devices))
        pairs = tuple(itertools.permutations(ordinals, 2))
        by_uuid = workers.gpu_index_by_uuid(ctx.inventory)
        first = self._measure(options, pairs, by_uuid, place)
        if isinstance(first, str):
            return None, first, Severity.UNKNOWN
        results, to_nvml = first
        floors: dict[Pair, float] = {}
        if options.min_gbps is not None and place.is_cuda:
            floors = dict.fromkeys(results, options.min_gbps)
        elif not place.is_cuda:
            # stand-ins: no datasheet to compare with, only the other pairs
            floors = peer_floors(results, options.cpu.min_share_of_median)
            evidence["min_gbps"] = None  # no datasheet figure for a CPU stand-in
            evidence["floor_gbps"] = {f"{to_nvml.get(a, a)}->{to_nvml.get(b, b)}": round(v, 3)
                                      for (a, b), v in sorted(floors.items())}
            evidence["min_gbps_source"] = (
                f"CPU stand-ins: {options.cpu.min_share_of_median:.0%} of the median of the pairs that "
                "involve neither GPU of the pair (a GPU slow to every peer must not set the bar)")
            if not floors:
                evidence["copies_judged"] = "no: fewer than 4 GPUs leave no pair to compare a pair with"
        low = tuple(p for p, c in results.items() if p in floors and c.gbps < floors[p])
        attempts = {p: [round(c.gbps, 2)] for p, c in results.items()}
        if low:
            again = self._measure(options, low, by_uuid, place)
            if isinstance(again, str):
                evidence["retry_error"] = again
            else:
                for p, c in again[0].items():
                    attempts[p].append(round(c.gbps, 2))
                    if c.gbps > results[p].gbps or not c.verified:
                        results[p] = c
        by_index: dict[tuple[int, int], kernels.PeerCopy] = {}
        for (a, b), c in results.items():
            if a in to_nvml and b in to_nvml:
                pair = (to_nvml[a], to_nvml[b])
                by_index[pair] = c
                if (a, b) in floors:
                    plan.floors[pair] = floors[(a, b)]
                if len(attempts[(a, b)]) > 1:
                    plan.measured_twice.add(pair)
        plan.measured = True
        evidence["copy_attempts_gbps"] = {f"{to_nvml.get(a, a)}->{to_nvml.get(b, b)}": v
                                          for (a, b), v in attempts.items() if len(v) > 1}
        evidence["copy_bytes"] = options.nbytes if place.is_cuda else options.cpu.nbytes
        evidence["retryable"] = True
        unmapped = [o for o in ordinals if o not in to_nvml]
        note = f"{len(pairs)} ordered pairs copied"
        if unmapped:
            note += f"; CUDA devices {unmapped} have no NVML GPU with their UUID (not judged)"
        return by_index, note, Severity.OK

    def _measure(self, options: P2pConfig, pairs: tuple[tuple[int, int], ...], by_uuid: Mapping[str, int],
                 place: placement.Placement
                 ) -> tuple[dict[tuple[int, int], kernels.PeerCopy], dict[int, int]] | str:
        """Copies of ``pairs`` (device ordinals) and the ordinal -> NVML index map, or why not."""
        if place.is_cuda:
            spec = kernels.PeerCopySpec(pairs=pairs, nbytes=options.nbytes, iterations=options.iterations)
        else:
            spec = kernels.PeerCopySpec(pairs=pairs, nbytes=options.cpu.nbytes,
                                        iterations=options.cpu.iterations)
        deadline = options.startup_s + options.per_pair_s * len(pairs)
        try:
            run = workers.run_workers(kernels.peer_copy_worker, [spec], kind=place.kind, bind=False,
                                      timeout_s=deadline, name=self.name,
                                      lock_wait_s=workers.lock_wait(self.timeout, 2 * deadline),
                                      stand_ins=place.stand_ins, faults=place.faults)
        except workers.DevicesBusy as exc:
            return str(exc)
        outcome = run.outcomes[0]
        if not outcome.ok:
            return f"copy worker: {outcome.describe()}"
        return {(c.src, c.dst): c for c in outcome.result}, ordinal_map(outcome.identity, by_uuid)

@dataclass
class CopyPlan:
    """How the measured copies are to be judged: each pair's floor, and which were measured twice."""

    floors: dict[Pair, float] = field(default_factory=dict)
    measured_twice: set[Pair] = field(default_factory=set)
    measured: bool = False  # False: copies came from elsewhere (judged against options.min_gbps)


def peer_floors(rates: Mapping[Pair, kernels.PeerCopy], share: float) -> dict[Pair, float]:
    """Each pair's floor: ``share`` of the median of the pairs that involve neither of its GPUs.

    Against the median of all pairs, a GPU slow to every peer drags the median down with it (it is in
    2/n of the pairs: half of them on 4 GPUs) and passes. Needs 4 GPUs: with fewer, no pair is left
    to compare with, and no floor is given.
    """
    out: dict[Pair, float] = {}
    for a, b in rates:
        others = [c.gbps for (x, y), c in rates.items() if not {x, y} & {a, b}]
        if others:
            out[(a, b)] = share * statistics.median(others)
    return out


def faults_for(paths: Mapping[Pair, PairPath], copies: Mapping[Pair, kernels.PeerCopy] | None,
               expect_nvlink: bool, min_gbps: float | Mapping[Pair, float] | None,
               measured_twice: Collection[Pair] | None = None
               ) -> tuple[dict[Pair, list[str]], dict[Pair, Action]]:
    """Faulty ordered pairs (what is wrong with each) and the remedy each calls for.

    ``min_gbps``: one floor for every pair, or each pair's own; ``measured_twice``: the pairs whose
    low copy was measured again (None: all of them).
    """
    faults: dict[tuple[int, int], list[str]] = {}
    actions: dict[tuple[int, int], Action] = {}

    def add(pair: tuple[int, int], text: str, action: Action) -> None:
        faults.setdefault(pair, []).append(text)
        actions[pair] = max(actions.get(pair, Action.NONE), action)

    for pair, path in paths.items():
        if path.error:
            add(pair, f"NVML: {path.error}", Action.NONE)
        elif expect_nvlink and not path.nvlink:
            # the same remedy as a down NVLink (checks/nvlink.py): retrain the links and the fabric
            add(pair, f"no NVLink P2P (status {path.status.get('nvlink')}, PCIe path {path.topology})",
                Action.REBOOT_NODE)
    for pair, c in (copies or {}).items():
        floor = min_gbps.get(pair) if isinstance(min_gbps, Mapping) else min_gbps
        if not c.verified:
            add(pair, "copied data differs from its source", Action.INSPECT_HARDWARE)
        elif floor is not None and c.gbps < floor:
            twice = " (twice)" if measured_twice is None or pair in measured_twice else ""
            add(pair, f"copy {c.gbps:.4g} GB/s below {floor:.4g}{twice}", Action.REBOOT_NODE)
    return faults, actions


def judge(ctx: CheckContext, indices: Sequence[int], paths: Mapping[tuple[int, int], PairPath],
          copies: Mapping[tuple[int, int], kernels.PeerCopy] | None, copy_note: str, options: P2pConfig,
          expect_nvlink: bool, evidence: Mapping[str, Any] | None = None,
          copies_missing: Severity = Severity.SKIPPED, plan: CopyPlan | None = None) -> list[Finding]:
    """Findings per GPU (a GPU in most of its pairs' faults fails) and for the node (the rest, by pair).

    ``copies`` None: the copy part did not run, for ``copy_note``; ``copies_missing`` says how bad.
    """
    name = P2pCheck.name
    # copies this check measured carry their own floors (stand-ins: other pairs' median)
    min_gbps: float | Mapping[Pair, float] | None = options.min_gbps
    twice: Collection[Pair] | None = None
    if plan is not None and plan.measured:
        min_gbps, twice = plan.floors, plan.measured_twice
    faults, actions = faults_for(paths, copies, expect_nvlink, min_gbps, twice)
    culprits, rest = blame(faults, indices)
    ev_node: dict[str, Any] = {
        "expect_nvlink": expect_nvlink,
        "nvml_paths": matrix(indices, {k: p.short for k, p in paths.items()}),
        "legend": "NV = NVLink P2P OK; PIX/PXB/PHB/NODE/SYS = PCIe P2P over that path "
                  "(nvidia-smi topo -m); -- = no P2P; ERR = NVML error",
        **(evidence or {}),
        "copies": copy_note, "min_gbps": (evidence or {}).get("min_gbps", options.min_gbps),
        "min_gbps_source": ((evidence or {}).get("min_gbps_source")
                            or ctx.profile.source_of("checks.p2p.min_gbps")),
    }
    if copies is not None:
        ev_node["copy_gbps"] = matrix(indices, {k: f"{c.gbps:.0f}" for k, c in copies.items()})
    out: list[Finding] = []
    for i in indices:
        mine = {p: faults[p] for p in faults if i in p}
        ev: dict[str, Any] = {}
        if copies is not None:
            ev["readings"] = [reading("p2p_copy_bytes_per_second", c.gbps * 1e9, peer=b)
                              for (a, b), c in sorted(copies.items()) if a == i]
        if i in culprits:
            sample = "; ".join(f"GPU {a} -> GPU {b}: {', '.join(w)}"
                               for (a, b), w in sorted(mine.items())[:4])
            out.append(Finding(name, gpu(i), Severity.FAIL,
                               f"GPU {i}: P2P faults with {len(mine)} of {2 * (len(indices) - 1)} ordered "
                               f"pairs ({sample})", max(actions[p] for p in mine),
                               {"pairs": {f"{a}->{b}": w for (a, b), w in sorted(mine.items())}, **ev}))
        elif mine:
            out.append(Finding(name, gpu(i), Severity.OK,
                               f"GPU {i}: {len(mine)} faulty pair(s) not attributable to this GPU alone "
                               "(see the node finding)", Action.NONE, ev))
        else:
            out.append(Finding(name, gpu(i), Severity.OK, f"GPU {i}: P2P paths and copies as expected",
                               Action.NONE, ev))
    if rest:
        text = "; ".join(f"GPU {a} -> GPU {b}: {', '.join(faults[(a, b)])}" for a, b in rest[:8])
        more = f" (+{len(rest) - 8} more)" if len(rest) > 8 else ""
        out.append(Finding(name, NODE, Severity.FAIL, f"{len(rest)} GPU pair(s) faulty: {text}{more}",
                           max(actions[p] for p in rest),
                           {"pairs": {f"{a}->{b}": faults[(a, b)] for a, b in rest}, **ev_node}))
    else:
        nv = bool(paths) and all(p.nvlink for p in paths.values())
        what = "NVLink on every pair" if nv else "paths as NVML reports them"
        out.append(Finding(name, NODE, Severity.OK, f"P2P over {len(indices)} GPUs: {what}; {copy_note}",
                           Action.NONE, ev_node))
    if copies is None:
        out.append(Finding(name, NODE, copies_missing, copy_note, Action.NONE, {NOT_TESTED: True}))
    for index, why in sorted(ctx.inventory.unreadable_gpus.items()):
        out.append(Finding(name, gpu(index), Severity.UNKNOWN, f"GPU {index} not tested: {why}"))
    return out


def ordinal_map(identity: Mapping[str, Any], by_uuid: Mapping[str, int]) -> dict[int, int]:
    """CUDA ordinal -> NVML index, matched by UUID, from an unbound worker's identity."""
    out: dict[int, int] = {}
    for d in identity.get("devices", []):
        index = by_uuid.get(placement.normalize_uuid(d.get("uuid")) or "")
        if index is not None:
            out[int(d["index"])] = index
    return out
