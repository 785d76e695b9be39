"""The pcie check's judgments of one watched function: its AER counters against their baseline
and rate, its link against what both ends can do (and the SKU profile), its kernel-log entry
(gpumon_checks.pcie.aer_log), each a list of :class:`Problem`; and the summary of an ok one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumon.check import CheckContext
from gpumon.errors import HwCondition
from gpumon.hw import pci as pcihw
from gpumon.model import Action, Severity, reading

from .aer_log import MAX_NAMES, UNCORRECTABLE, WORDS
from .options import PcieConfig


@dataclass(frozen=True)
class Problem:
    severity: Severity
    action: Action
    text: str


def fail(text: str) -> Problem:
    return Problem(Severity.FAIL, Action.INSPECT_HARDWARE, text)


def warn(text: str) -> Problem:
    return Problem(Severity.WARN, Action.INSPECT_HARDWARE, text)


def unknown(text: str) -> Problem:
    return Problem(Severity.UNKNOWN, Action.NONE, text)


# --------------------------------------------------------------------------- AER counters


def judge_counters(options: PcieConfig, ds: dict[str, Any], aer: pcihw.AerStats, now: float,
                   evidence: dict[str, Any]) -> list[Problem]:
    totals = {kind: aer.of(kind).total for kind in pcihw.AER_FILES}
    evidence["aer_since_boot"] = dict(totals)
    # AER counters count since boot in the kernel: counters in Prometheus terms
    # label aer_severity, not severity: that is the alert-routing label of alerting rules
    evidence["readings"] = [reading("pcie_aer_errors_total", n, aer_severity=kind)
                            for kind, n in totals.items()]
    if "totals" not in ds:
        ds["totals"] = dict(totals)
        ds["names"] = {kind: dict(aer.of(kind).errors) for kind in UNCORRECTABLE}
        ds["before_watch"] = {kind: totals[kind] for kind in UNCORRECTABLE if totals[kind]}
        ds["events"] = {}
        ds["resets"] = 0
        ds["cor"] = [[now, totals["correctable"]]]
    else:
        for kind in UNCORRECTABLE:
            _compare(ds, kind, aer.of(kind), now)
        _correctable(options, ds, aer.correctable.total, now)
    if ds["resets"]:
        evidence["counter_resets"] = ds["resets"]
    out: list[Problem] = []
    for kind in UNCORRECTABLE:
        ev = ds["events"].get(kind)
        if ev:
            evidence[f"{kind}_errors"] = copy.deepcopy(ev)
            names = ", ".join(f"{n} +{c}" for n, c in sorted(ev["errors"].items())) or "no named bit"
            out.append(fail(f"{ev['count']} new uncorrectable ({WORDS[kind]}) AER error(s) since gpumon "
                            f"started watching ({names})"))
    before = ds["before_watch"]
    if before.get("fatal"):
        out.append(fail(f"{before['fatal']} fatal AER error(s) since boot, before gpumon watched: a fatal "
                        "error makes the link unreliable and the kernel reset it"))
    if before.get("nonfatal"):
        out.append(warn(f"{before['nonfatal']} non-fatal AER error(s) since boot, before gpumon watched "
                        f"({_nonzero(ds['names'].get('nonfatal', {}))}): cannot be dated; firmware probing "
                        "at boot leaves some on healthy ports"))
    rate = ds.get("cor_rate")
    if rate is not None:
        evidence["correctable_per_hour"] = round(rate, 1)
        if rate > options.correctable_per_hour:
            out.append(warn(f"{rate:.0f} correctable AER errors/hour (limit "
                            f"{options.correctable_per_hour:g}; {_nonzero(aer.correctable.errors)}): "
                            "a marginal link, reseat at the next maintenance"))
    return out


def _compare(ds: dict[str, Any], kind: pcihw.AerKind, counts: pcihw.AerCounts, now: float) -> None:
    last_total: int = ds["totals"][kind]
    last_names: dict[str, int] = ds["names"].get(kind, {})
    went_back = counts.total < last_total or any(counts.errors.get(n, 0) < c for n, c in last_names.items())
    if went_back:
        # the function was removed and re-added (its statistics restart):
        # a new baseline, never a negative rate
        ds["resets"] += 1
    elif counts.total > last_total:
        ev = ds["events"].setdefault(kind, {"count": 0, "first": now, "last": now, "errors": {}})
        ev["count"] += counts.total - last_total
        ev["last"] = now
        for name, count in counts.errors.items():
            delta = count - last_names.get(name, 0)
            if delta > 0 and (name in ev["errors"] or len(ev["errors"]) < MAX_NAMES):
                ev["errors"][name] = ev["errors"].get(name, 0) + delta
    ds["totals"][kind] = counts.total
    ds["names"][kind] = dict(counts.errors)


def _correctable(options: PcieConfig, ds: dict[str, Any], total: int, now: float) -> None:
    samples: list[list[float]] = ds["cor"]
    ds["totals"]["correctable"] = total
    if samples and total < samples[-1][1]:
        ds["resets"] += 1
        samples[:] = []
    # keep about 120 samples per window however often the kernel log wakes the check
    if not samples or now - samples[-1][0] >= options.correctable_window_s / 120:
        samples.append([now, total])
    samples[:] = [s for s in samples if now - s[0] <= options.correctable_window_s] or [[now, total]]
    t0, c0 = samples[0]
    span = now - t0
    ds["cor_rate"] = (total - c0) / span * 3600.0 if span >= options.correctable_min_span_s else None


# --------------------------------------------------------------------------- link


def judge_link(ctx: CheckContext, options: PcieConfig, tree: pcihw.PciScan, fn: pcihw.PciFunction,
               link: pcihw.LinkState, evidence: dict[str, Any]) -> list[Problem]:
    info: dict[str, Any] = {"current": link.describe(), "max": link.describe(current=False)}
    evidence["link"] = info
    role = tree.role(fn.bdf)
    if role in ("root_port", "switch_downstream"):
        info["judged"] = "at the function below (this port's link faces down)"
        return []
    if role == "bridge":
        info["judged"] = "no: the port above is not listed, so which way this link faces is unknown"
        return []
    function0 = fn.bdf[:-1] + "0"
    if fn.bdf != function0 and function0 in tree.functions:
        # one link per device, owned by function 0; the others' link registers need not agree
        # (HGX H100 capture in tests/data/pcie-aer: 81:00.1 claims x16 and runs x2, while 81:00.0,
        # the port that owns the link, is x2 of x2)
        info["judged"] = f"at function 0 ({function0}): one link per device"
        return []
    width, max_width, max_gts = link.current_width, link.max_width, link.max_gts
    if width is None or max_width is None or max_gts is None:
        return [unknown(f"link attributes incomplete (current {link.describe()}, max "
                        f"{link.describe(current=False)})")]
    best_width, best_gts = max_width, max_gts
    partner = tree.link_partner(fn.bdf)
    if partner is not None:
        info["partner"] = partner
        try:
            other = pcihw.read_link(ctx.hw.fs, tree.functions[partner])
        except HwCondition as cond:
            info["partner_error"] = str(cond)
            other = None
        if other is not None:
            info["partner_max"] = other.describe(current=False)
            best_width = min(best_width, other.max_width or best_width)
            best_gts = min(best_gts, other.max_gts or best_gts)
    best_gen = pcihw.generation(best_gts)
    info["expected"] = f"Gen{best_gen} x{best_width}"
    out: list[Problem] = []
    if width == 0:
        out.append(fail("link down (width 0)"))
    elif width > max_width:
        out.append(unknown(f"current link width x{width} above the maximum x{max_width}: "
                           "the device's registers read back invalid (not responding?)"))
    elif width < best_width:
        out.append(fail(f"link trained at x{width}, both ends can do x{best_width} "
                        f"(x{width} carries {width / best_width:.0%} of the host-device bandwidth): "
                        "reseat or inspect the card, riser or cable"))
    if width:
        out += _speed(ctx, options, fn, link, best_gts, info)
    if fn.is_nvidia_gpu:
        out += _against_profile(ctx, best_gen, best_width, info)
    return out


def _speed(ctx: CheckContext, options: PcieConfig, fn: pcihw.PciFunction, link: pcihw.LinkState,
           best_gts: float, info: dict[str, Any]) -> list[Problem]:
    if link.current_gts is None:
        return [unknown("current link speed reads 'Unknown'")]
    if link.current_gts >= best_gts:
        return []
    below = (f"link at Gen{link.current_gen} ({link.current_gts:g} GT/s), both ends can do "
             f"Gen{pcihw.generation(best_gts)}")
    if not fn.is_nvidia_gpu:
        return [warn(below)]
    gpu = ctx.inventory.gpu_by_pci(fn.bdf)
    if gpu is None:
        return [unknown(f"{below}; the GPU is not in NVML, so whether it is idle (a normal downshift) "
                        "is unknown")]
    try:
        util = ctx.hw.nvml.utilization_pct(gpu.index)
    except HwCondition as cond:
        return [unknown(f"{below}; GPU load unreadable ({cond.call}: {cond}), so an idle downshift "
                        "cannot be ruled out")]
    info["gpu_utilization_pct"] = util
    if util > options.load_utilization_pct:
        return [warn(f"{below} while the GPU is busy ({util} % utilization)")]
    info["idle_downshift"] = (f"Gen{link.current_gen} at {util} % utilization (not above "
                              f"{options.load_utilization_pct} %): GPUs lower the link speed when idle")
    return []


def _against_profile(ctx: CheckContext, best_gen: int | None, best_width: int,
                     info: dict[str, Any]) -> list[Problem]:
    spec = ctx.profile.pcie
    out: list[Problem] = []
    if spec.generation is None and spec.width is None:
        info["profile"] = f"profile {ctx.profile.name} states no PCIe generation or width"
        return out
    if spec.generation is not None and best_gen is not None and best_gen < spec.generation:
        out.append(warn(f"this GPU's link can reach only Gen{best_gen}; profile {ctx.profile.name} expects "
                        f"Gen{spec.generation}: wrong slot or riser?"))
    if spec.width is not None and best_width < spec.width:
        out.append(warn(f"this GPU's link can reach only x{best_width}; profile {ctx.profile.name} expects "
                        f"x{spec.width}: wrong slot or riser?"))
    return out


# --------------------------------------------------------------------------- kernel log


def judge_kernel_log(entry: Mapping[str, Any], evidence: dict[str, Any]) -> list[Problem]:
    evidence["kernel_log"] = copy.deepcopy({k: v for k, v in entry.items() if k != "current"})
    out: list[Problem] = []
    summary = entry.get("summary") or {}
    for kind in UNCORRECTABLE:
        group = entry.get(kind)
        if group:
            errors = ", ".join(group["errors"]) or "no error bits logged"
            out.append(fail(f"kernel log: {group['count']} uncorrectable ({WORDS[kind]}) PCIe Bus Error "
                            f"report(s) ({errors})"))
        elif summary.get(kind):
            out.append(fail(f"kernel log: {summary[kind]['count']} uncorrectable ({WORDS[kind]}) AER error "
                            "report(s) (summary line only, no 'PCIe Bus Error' detail)"))
    for what, group in sorted((entry.get("not_recovered") or {}).items()):
        out.append(fail(f"kernel log: not recovered after an AER error ('{what}', {group['count']} "
                        "report(s)): the device stays unusable until a reset or a reboot"))
    return out


def _nonzero(errors: Mapping[str, int]) -> str:
    named = [f"{n} {c}" for n, c in sorted(errors.items()) if c]
    return ", ".join(named) or "no named bit"


def ok_summary(evidence: Mapping[str, Any]) -> str:
    parts = []
    since = evidence.get("aer_since_boot")
    if since:
        parts.append(f"no new AER errors (since boot: {since['fatal']} fatal, {since['nonfatal']} non-fatal, "
                     f"{since['correctable']} correctable)")
    link = evidence.get("link")
    if isinstance(link, Mapping):
        parts.append(f"link {link['current']}" + (" (idle downshift)" if "idle_downshift" in link else ""))
    log = evidence.get("kernel_log")
    if log and "correctable" in log:
        parts.append(f"{log['correctable']['count']} corrected error report(s) in the kernel log")
    return "; ".join(parts) or "nothing to report"
