"""How many pair rounds the fabric probe's isolation needs, and how right it is (gpumon.fabric.isolate).

    .venv/bin/python bench/fabric_isolation.py [--sizes 16,64,256,1024,4096] [--bad 1,4,1%]
                                               [--links 2] [--seeds 100] [--noise 0.05] [--seed 0]

No network: pair results are simulated ("measured-like"), only for the pairs the isolator asks for
(nothing indexed by N² is built). Per node a NIC speed as a fraction of nominal; a pair's busbw =
min(speed_a, speed_b) x link factor x nominal x noise; its p95 = (base + the larger of the two
nodes' added latency) x latency noise. Per run, k bad nodes each draw one fault:

- ``port200``  speed 0.5: a 400G port trained at 200G (weight 0.4)
- ``degraded`` speed uniform 0.3 - 0.7 (e.g. lanes down, PCIe downshift; 0.7 is the slow_fraction,
  so the top of the range is at the detection limit by design) (weight 0.3)
- ``latency``  p95 + 60 - 200 us, bandwidth fine (weight 0.15)
- ``failing``  every transfer fails (hang, NCCL error) (weight 0.15)

and ``--links`` bad links (bandwidth x 0.3 - 0.6, or p95 + 60 - 200 us) are planted on pairs that
round 1 measures and that touch no bad node: a link that is never measured cannot be found (a round
samples N/2 of the N(N-1)/2 links; a periodic probe covers links over runs with new seeds), so
planting them on measured pairs measures attribution, not sampling luck.

Reported per (N, k): rounds used (mean/max), pairs measured (mean, and per node), precision and
recall of node faults and of link faults (summed over the seeds), unresolved suspects per run, and
wall time per run (isolator + the simulated measurement), then recall by fault kind.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _machine import describe

from gpumon.fabric.isolate import IsolationSettings, Isolator, PairResult

# 400 Gb/s NDR = 50 GB/s line rate; ~48 GB/s is an assumed achieved send/recv busbw per rail. The
# isolator is relative, so this only sets the unit and the round-time estimate.
NOMINAL_GBPS = 48.0
# Assumed healthy small-message p95 of a pair (a few us on IB); not from a capture.
BASE_P95_US = 5.0
# Bandwidth noise +-5 % uniform per measurement: ASSUMED. The only 2-node nccl-tests capture we have
# (realdata nccl-tests/all_reduce_perf_gcp-a3mega_h100x16_2node_tcp.txt) has in-place and out-of-place
# busbw within 0.04 - 0.94 % of each other from 64 MiB up (one run); run-to-run and pair-to-pair
# spread on a real fabric is larger (the fabric settings argue 5 - 10 %), hence 5 % and --noise.
# Latency noise: x uniform(0.9, 1.3) (p95 is skewed upwards), assumed.
LAT_NOISE = (0.9, 1.3)

KINDS = (("port200", 0.4), ("degraded", 0.3), ("latency", 0.15), ("failing", 0.15))


@dataclass
class Fabric:
    rng: random.Random
    noise: float
    speed: dict[str, float] = field(default_factory=dict)
    extra_us: dict[str, float] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    link_bw: dict[frozenset[str], float] = field(default_factory=dict)
    link_us: dict[frozenset[str], float] = field(default_factory=dict)

    def measure(self, a: str, b: str) -> PairResult:
        if a in self.failing or b in self.failing:
            return PairResult(a, b, None, None, failed="NCCL timeout")
        pair = frozenset((a, b))
        bw = NOMINAL_GBPS * min(self.speed.get(a, 1.0), self.speed.get(b, 1.0)) * self.link_bw.get(pair, 1.0)
        bw *= self.rng.uniform(1 - self.noise, 1 + self.noise)
        extra = max(self.extra_us.get(a, 0.0), self.extra_us.get(b, 0.0)) + self.link_us.get(pair, 0.0)
        return PairResult(a, b, bw, (BASE_P95_US + extra) * self.rng.uniform(*LAT_NOISE))


@dataclass
class Tally:
    runs: int = 0
    rounds: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    unresolved: int = 0
    node_tp: int = 0
    node_fp: int = 0
    node_fn: int = 0
    link_tp: int = 0
    link_fp: int = 0
    link_fn: int = 0
    found_by_kind: Counter[str] = field(default_factory=Counter)
    bad_by_kind: Counter[str] = field(default_factory=Counter)
    missed_speeds: list[float] = field(default_factory=list)


def one_run(n: int, k: int, links: int, seed: int, noise: float, settings: IsolationSettings,
            tally: Tally) -> None:
    rng = random.Random(f"bench:{n}:{k}:{seed}")
    nodes = [f"node{i:05d}" for i in range(n)]
    fabric = Fabric(random.Random(f"noise:{n}:{k}:{seed}"), noise)
    kind_of: dict[str, str] = {}
    for node in rng.sample(nodes, k):
        kind = rng.choices([name for name, _ in KINDS], weights=[w for _, w in KINDS])[0]
        kind_of[node] = kind
        if kind == "port200":
            fabric.speed[node] = 0.5
        elif kind == "degraded":
            fabric.speed[node] = rng.uniform(0.3, 0.7)
        elif kind == "latency":
            fabric.extra_us[node] = rng.uniform(60.0, 200.0)
        else:
            fabric.failing.add(node)

    start = time.perf_counter()
    iso = Isolator(nodes, settings, seed=seed)
    planted: set[frozenset[str]] = set()
    first = True
    while pairs := iso.next_round():
        if first:
            free = [p for p in pairs if p[0] not in kind_of and p[1] not in kind_of]
            for a, b in rng.sample(free, min(links, len(free))):
                pair = frozenset((a, b))
                planted.add(pair)
                if rng.random() < 0.7:
                    fabric.link_bw[pair] = rng.uniform(0.3, 0.6)
                else:
                    fabric.link_us[pair] = rng.uniform(60.0, 200.0)
            first = False
        iso.add([fabric.measure(a, b) for a, b in pairs])
    verdict = iso.verdict()
    tally.seconds.append(time.perf_counter() - start)

    tally.runs += 1
    tally.rounds.append(verdict.rounds)
    tally.pairs.append(verdict.pairs_measured)
    tally.unresolved += len(verdict.unresolved)
    named = set(verdict.node_faults)
    bad = set(kind_of)
    tally.node_tp += len(named & bad)
    tally.node_fp += len(named - bad)
    tally.node_fn += len(bad - named)
    found_links = {frozenset((lf.a, lf.b)) for lf in verdict.link_faults}
    tally.link_tp += len(found_links & planted)
    tally.link_fp += len(found_links - planted)
    tally.link_fn += len(planted - found_links)
    for node, kind in kind_of.items():
        tally.bad_by_kind[kind] += 1
        tally.found_by_kind[kind] += node in named
        if node not in named and node in fabric.speed:
            tally.missed_speeds.append(fabric.speed[node])


def ratio(num: int, den: int) -> str:
    return f"{num / den:.3f}" if den else "  -  "


def k_values(n: int, spec: str) -> list[int]:
    out: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        k = max(1, round(n * float(item[:-1]) / 100)) if item.endswith("%") else int(item)
        if 0 < k <= n // 2 and k not in out:
            out.append(k)
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024,4096", help="node counts N, comma-separated")
    ap.add_argument("--bad", default="1,4,1%", help="bad nodes k per run: counts or percentages of N")
    ap.add_argument("--links", type=int, default=2, help="bad links planted on round-1 pairs per run")
    ap.add_argument("--seeds", type=int, default=100, help="runs per (N, k), seeds 0..S-1 (+ --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.05, help="busbw noise: x uniform(1-f, 1+f)")
    ap.add_argument("--pair-bytes", type=int, default=2 << 30, help="large message for the round-time line")
    ap.add_argument("--iterations", type=int, default=25, help="timed + warm-up iterations per pair test")
    args = ap.parse_args()

    settings = IsolationSettings()
    print(describe())
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; command: {' '.join(sys.argv)}")
    print(f"settings: {settings}")
    print(f"nominal {NOMINAL_GBPS} GB/s per pair (one 400G rail, assumed), busbw noise +-{args.noise:.0%}; "
          f"p95 {BASE_P95_US} us x uniform{LAT_NOISE}; fault mix "
          + ", ".join(f"{name} {w:.0%}" for name, w in KINDS)
          + f"; {args.links} bad links per run on round-1 pairs; {args.seeds} seeds per row")
    print()
    print(f"{'N':>5} {'k':>3} {'runs':>4}  {'rounds':>10}  {'pairs':>7} {'/node':>5}  "
          f"{'node P':>6} {'node R':>6}  {'link P':>6} {'link R':>6}  {'unres/run':>9}  {'ms/run':>7}")
    total = Tally()
    t0 = time.perf_counter()
    for n in (int(x) for x in args.sizes.split(",")):
        for k in k_values(n, args.bad):
            tally = Tally()
            for s in range(args.seeds):
                one_run(n, k, args.links, args.seed + s, args.noise, settings, tally)
            total.found_by_kind.update(tally.found_by_kind)
            total.bad_by_kind.update(tally.bad_by_kind)
            total.missed_speeds.extend(tally.missed_speeds)
            pairs = statistics.mean(tally.pairs)
            rounds = statistics.mean(tally.rounds)
            print(f"{n:>5} {k:>3} {tally.runs:>4}  {rounds:>5.2f}/{max(tally.rounds):<4}  "
                  f"{pairs:>7.1f} {pairs / n:>5.2f}  "
                  f"{ratio(tally.node_tp, tally.node_tp + tally.node_fp):>6} "
                  f"{ratio(tally.node_tp, tally.node_tp + tally.node_fn):>6}  "
                  f"{ratio(tally.link_tp, tally.link_tp + tally.link_fp):>6} "
                  f"{ratio(tally.link_tp, tally.link_tp + tally.link_fn):>6}  "
                  f"{tally.unresolved / tally.runs:>9.2f}  {1000 * statistics.mean(tally.seconds):>7.1f}",
                  flush=True)
    print()
    print("node-fault recall by kind (all rows): " + ", ".join(
        f"{kind} {total.found_by_kind[kind]}/{total.bad_by_kind[kind]}" for kind, _ in KINDS))
    if total.missed_speeds:
        print(f"missed slow nodes: speed {min(total.missed_speeds):.3f} - {max(total.missed_speeds):.3f} "
              f"of nominal (slow_fraction {settings.slow_fraction})")
    per_iter_s = args.pair_bytes / (NOMINAL_GBPS * 1e9)
    print(f"round time, assumed: disjoint pairs run at once at nominal; one pair test of "
          f"{args.pair_bytes / 2**30:g} GiB x {args.iterations} iterations at {NOMINAL_GBPS} GB/s = "
          f"{per_iter_s * 1000:.1f} ms x {args.iterations} = {per_iter_s * args.iterations:.2f} s "
          f"(plus communicator setup, not modelled)")
    print(f"bench wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
