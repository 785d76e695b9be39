"""The canary's verdict: one finding per GPU from a run's report (gpumon/sdc/runner.py), for the
``sdc_canary`` check and ``gpumon canary`` alike."""

from __future__ import annotations

from typing import Any

from gpumon.model import Action, Finding, Severity, gpu
from gpumon.sdc.runner import CHECK, Mismatch, Report


def findings(report: Report, check: str = CHECK) -> list[Finding]:
    out: list[Finding] = []
    by_worker: dict[int, list[Mismatch]] = {}
    for m in report.mismatches:
        by_worker.setdefault(m.worker, []).append(m)
    no_golden = sorted({k["workload"] for k in report.no_golden})
    for w in report.workers:
        g = report.gpu_of(w.index)
        comp = gpu(g)
        runs = report.iterations.get(w.index, 0)
        base: dict[str, Any] = {"device": w.device, "key": w.key.describe(), "iterations": runs,
                                "workloads": report.workloads}
        ident = report.identity_of(w.index)
        base.update({k: ident[k] for k in ("uuid", "serial", "identity_note") if ident.get(k)})
        if w.index in report.worker_failures:
            out.append(Finding(check, comp, Severity.FAIL,
                               f"canary on GPU {g}: {report.worker_failures[w.index]}",
                               Action.RESET_GPU, {**base, "failure": report.worker_failures[w.index]}))
            continue
        mine = by_worker.get(w.index, [])
        if mine:
            first = mine[0]
            iterations_bad = sorted({m.iteration for m in mine})
            msg = (f"GPU {g} computed wrong bits: {first.workload} iteration {first.iteration}, "
                   f"first differing tensor {first.first_tensor!r} (vs {first.against}: {first.detail}); "
                   f"{len(iterations_bad)} of {runs} iterations differ")
            ev = {**base, **first.evidence(), "mismatches": [m.evidence() for m in mine[:20]],
                  "iterations_differing": len(iterations_bad)}
            out.append(Finding(check, comp, Severity.FAIL, msg, Action.INSPECT_HARDWARE, ev))
            continue
        split = [s for s in report.splits if any(w.index in grp for grp in s.groups)]
        agreed = [m for m in report.golden_mismatch_agreed if m.worker == w.index]
        if split:
            s = split[0]
            groups = [[report.gpu_of(i) for i in grp] for grp in s.groups]
            shown = " | ".join(",".join(map(str, grp)) for grp in groups)
            out.append(Finding(check, comp, Severity.UNKNOWN,
                               f"no strict majority among the GPUs for {s.workload} iteration {s.iteration}: "
                               f"split {shown}; no golden to decide", Action.NONE,
                               {**base, "workload": s.workload, "iteration": s.iteration, "split": groups}))
            continue
        if agreed:
            m = agreed[0]
            out.append(Finding(check, comp, Severity.UNKNOWN,
                               f"GPU {g} agrees with the majority of the node but not with the golden "
                               f"({m.workload}, first differing tensor {m.first_tensor!r}): golden stale or "
                               "recorded under another setup", Action.NONE, {**base, **m.evidence()}))
            continue
        if runs == 0:
            out.append(Finding(check, comp, Severity.UNKNOWN, f"canary ran no iteration on GPU {g}"
                               + (f" ({report.stopped_early})" if report.stopped_early else ""),
                               Action.NONE, base))
            continue
        golden_wl = [n for n in report.workloads if report.golden_used.get(n)]
        peers = len(report.workers) - 1
        if not golden_wl and peers < 1:
            out.append(Finding(check, comp, Severity.UNKNOWN,
                               f"no golden for this key and no other GPU to compare with "
                               f"({', '.join(no_golden)})", Action.NONE,
                               {**base, "no_golden": report.no_golden}))
            continue
        basis = []
        if golden_wl:
            basis.append(f"golden ({len(golden_wl)} workloads)")
        if peers:
            basis.append(f"{peers} other GPUs")
        note = f"; no golden for {', '.join(no_golden)}" if no_golden else ""
        ev = {**base, "compared_with": basis}
        if no_golden:
            ev["no_golden"] = report.no_golden
        out.append(Finding(check, comp, Severity.OK,
                           f"bit-exact over {runs} iterations of {len(report.workloads)} workloads "
                           f"(vs {' and '.join(basis)}){note}", Action.NONE, ev))
    for i, why in sorted(report.worker_failures.items()):
        if not any(w.index == i for w in report.workers):
            # a worker that never started says nothing about its GPU (environment, torch, CUDA init)
            out.append(Finding(check, gpu(report.gpu_of(i)), Severity.UNKNOWN,
                               f"canary could not start on GPU {report.gpu_of(i)}: {why}",
                               Action.NONE, {"failure": why}))
    return out


