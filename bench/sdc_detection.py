"""Detection power of the SDC canaries, with the fault harness, on 8 worker processes ("GPUs").

    .venv/bin/python bench/sdc_detection.py [--workers 8] [--healthy 1000] [--faulty 300] [--seed 0]
                                            [--workload NAME ...] [--device cpu|cuda]

One pool of workers runs all the time (like ``gpumon canary run``, one iteration = every workload on
every worker at once). A golden is recorded from the first iteration (all workers must agree). Then:

- healthy iterations (no fault anywhere): a false positive is any worker reported as differing,
  against the golden or against the majority;
- faulty iterations: each draws a random fault — a random worker of the 8, one dtype path
  (float32, float64, bfloat16, float16, int64), a rate per kernel call (1, 0.1, 0.01), a value range,
  a bit range — and the harness flips bits in that worker's kernel outputs. The faulty worker's and
  a healthy worker's tensors come back, and the truth is computed from them bit by bit: the first
  recorded tensor (in computation order) whose bits differ, or where the faulty run stopped.

Reported: faults that flipped at least one bit; of those, the ones that changed a recorded tensor or
crashed the workload ("effective": the others were masked inside the computation, e.g. a flip in an
output no later op reads, and no comparison of results can see them); detected / effective;
localised (exactly the faulty worker flagged) / detected; first differing tensor named correctly /
detected; and false positives over the healthy iterations.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe

from gpumon.sdc.fingerprint import words
from gpumon.sdc.golden import Golden, GoldenKey, majority
from gpumon.sdc.inject import FaultSpec
from gpumon.sdc.runner import Options, Session
from gpumon.sdc.workloads import WORKLOAD_NAMES, WorkloadRun, builtin_workloads

DTYPES = [("float32", 3), ("float64", 3), ("bfloat16", 2), ("float16", 2), ("int64", 1)]
RATES = [1.0, 0.1, 0.01]
RANGES = [(-math.inf, math.inf), (-1.0, 1.0), (1.0, math.inf), (-math.inf, -1e-3)]
WIDTH = {"float32": 32, "float64": 64, "bfloat16": 16, "float16": 16, "int64": 64}


def draw_fault(rng: random.Random, workers: int, seed: int) -> FaultSpec:
    dtype = rng.choices([d for d, _ in DTYPES], weights=[w for _, w in DTYPES])[0]
    width = WIDTH[dtype]
    low, high = rng.choice(RANGES)
    bits = rng.choice([None, (0, 7), (width - 8, width - 1)])
    return FaultSpec(worker=rng.randrange(workers), dtype=dtype, rate=rng.choice(RATES), low=low, high=high,
                     bits=bits, seed=seed)


def truth(faulty: list[WorkloadRun], reference: list[WorkloadRun],
          tensors: dict[tuple[int, str], dict[str, torch.Tensor]], w: int,
          ref: int) -> tuple[str, str] | None:
    """(workload, point) of the first recorded tensor whose bits differ, or where the run stopped."""
    for fr, rr in zip(faulty, reference, strict=True):
        ft, rt = tensors.get((w, fr.workload), {}), tensors.get((ref, rr.workload), {})
        for i, rp in enumerate(rr.points):
            if i >= len(fr.points):
                return fr.workload, rp.name  # the faulty run ended (raised) before this point
            name = rp.name
            a, b = ft[name], rt[name]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(words(a)[0], words(b)[0]):
                return fr.workload, name
        if fr.error and not rr.error:
            return fr.workload, "(end)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--healthy", type=int, default=1000, help="healthy iterations (false positives)")
    ap.add_argument("--faulty", type=int, default=300, help="iterations with a drawn fault")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", action="append", default=[], help="default: every built-in workload")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    names = tuple(args.workload) or WORKLOAD_NAMES
    started = time.monotonic()

    print(describe())
    params = {n: w.params for n, w in builtin_workloads(args.device).items() if n in names}
    print(f"torch {torch.__version__}; {args.workers} worker processes on {args.device}, 1 thread each; "
          f"workloads: {', '.join(f'{n} ({p})' for n, p in params.items())}")
    print(f"healthy iterations: {args.healthy}; faulty iterations: {args.faulty}; seed {args.seed}")

    options = Options(workers=args.workers, workloads=names, device=args.device, keep_runs=False,
                      timeout_s=300)
    with Session(options) as session:
        report = session.report
        boot = time.monotonic() - started
        # golden: the first iteration, all workers agreeing
        it = session.iterate(None)
        runs = {w.index: [report.runs[(w.index, it, n)] for n in report.workloads] for w in report.workers}
        if len({tuple(r.signature() for r in rs) for rs in runs.values()}) != 1:
            print("workers disagree on the first (healthy) iteration: no golden, stopping")
            return 2
        golden = Golden()
        key = report.workers[0].key
        for r in runs[0]:
            golden.put(GoldenKey(r.workload, r.params, key), r.points)
        session.options = dataclasses.replace(options, golden=golden)

        t0 = time.monotonic()
        fp_golden = fp_majority = 0
        for k in range(args.healthy):
            it = session.iterate(None)
            flagged = {m.worker for m in report.mismatches if m.iteration == it}
            fp_golden += bool(flagged)
            sigs = {w.index: tuple(report.runs[(w.index, it, n)].signature() for n in report.workloads)
                    for w in report.workers}
            value, split = majority(sigs.items())
            fp_majority += value is None or len(split) > 1
            if (k + 1) % 200 == 0:
                print(f"  healthy {k + 1}/{args.healthy} ({time.monotonic() - t0:.0f} s)", flush=True)
        healthy_s = time.monotonic() - t0

        t0 = time.monotonic()
        stats: Counter[str] = Counter()
        missed: list[dict[str, Any]] = []
        by_dtype: Counter[str] = Counter()
        by_dtype_effective: Counter[str] = Counter()
        for k in range(args.faulty):
            if k and k % 50 == 0:
                print(f"  faulty {k}/{args.faulty} ({time.monotonic() - t0:.0f} s)", flush=True)
            spec = draw_fault(rng, args.workers, seed=args.seed * 100_000 + k)
            w = spec.worker
            ref = (w + 1) % args.workers
            it = session.iterate(spec, tensors_of=(w, ref))
            faulty = [report.runs[(w, it, n)] for n in report.workloads]
            reference = [report.runs[(ref, it, n)] for n in report.workloads]
            flips = sum(len(r.flips) for r in faulty)
            if not flips:
                stats["no_flip"] += 1
                continue
            stats["flipped"] += 1
            by_dtype[spec.dtype] += 1
            tensors = {(i, n): t for (i, _it, n), t in report.tensors.items() if _it == it}
            true_first = truth(faulty, reference, tensors, w, ref)
            mine = [m for m in report.mismatches if m.iteration == it]
            flagged = {m.worker for m in mine}
            if true_first is None:
                stats["masked"] += 1
                stats["masked_but_flagged"] += bool(flagged)
                continue
            stats["effective"] += 1
            by_dtype_effective[spec.dtype] += 1
            if w not in flagged:
                missed.append({"spec": spec.to_text(), "truth": true_first})
                continue
            stats["detected"] += 1
            stats["localised"] += flagged == {w}
            first = next(m for m in mine if m.worker == w)
            reported = (first.workload, first.first_tensor if first.observed is not None or
                        first.expected is not None else "(end)")
            stats["first_tensor_ok"] += reported == true_first
            first_flip = next((f for r in faulty for f in r.flips), None)
            stats["nearest_point"] += bool(first_flip and first_flip["next_point"] == first.first_tensor)
        faulty_s = time.monotonic() - t0

    def pct(a: int, b: int) -> str:
        return f"{a}/{b} = {100 * a / b:.1f} %" if b else f"{a}/0"

    print()
    per_it = healthy_s / max(args.healthy, 1) * 1e3
    print(f"startup {boot:.1f} s; healthy phase {healthy_s:.0f} s ({per_it:.0f} ms per iteration of "
          f"{args.workers} workers); faulty phase {faulty_s:.0f} s")
    print(f"faulty iterations drawn: {args.faulty}; no bit flipped (no kernel of the drawn dtype/range ran): "
          f"{stats['no_flip']}; at least one bit flipped: {stats['flipped']} "
          f"({', '.join(f'{d} {n}' for d, n in sorted(by_dtype.items()))})")
    print(f"  masked inside the computation (no recorded tensor changed, nothing crashed): {stats['masked']}"
          f" (of which flagged anyway: {stats['masked_but_flagged']})")
    print(f"  effective (a recorded tensor changed or the workload crashed): {stats['effective']} "
          f"({', '.join(f'{d} {n}' for d, n in sorted(by_dtype_effective.items()))})")
    print(f"detected: {pct(stats['detected'], stats['effective'])} of effective faults "
          f"({pct(stats['detected'], stats['flipped'])} of all runs with a flip)")
    print(f"localised to the faulty worker among {args.workers}: "
          f"{pct(stats['localised'], stats['detected'])}")
    print(f"first differing tensor named correctly: {pct(stats['first_tensor_ok'], stats['detected'])}")
    print(f"  (first differing tensor = the point recorded right after the first flipped kernel: "
          f"{pct(stats['nearest_point'], stats['detected'])})")
    print(f"false positives over {args.healthy} healthy iterations x {args.workers} workers: "
          f"vs golden {fp_golden}, vs majority {fp_majority}")
    for m in missed[:10]:
        print(f"  missed: {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
