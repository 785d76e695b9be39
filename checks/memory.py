"""memory: GPU memory errors from NVML: ECC, row remapping (Ampere and later), page retirement (older).

Per GPU (sources: NVIDIA "GPU Memory Error Management", docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt,
covering Ampere and Hopper; NVIDIA "Dynamic Page Retirement", docs.nvidia.com/deploy/dynamic-page-retirement;
the NVML API reference; NVIDIA's Xid catalog as re-tabulated in shared/reference/xid-catalog.md):

- Volatile uncorrectable ECC errors > 0 -> fail, reset_gpu. NVIDIA's WORKFLOW_XID_48 (double-bit
  error) routes on what the memory does next: a remap pending -> reset the GPU, a remap failure ->
  RMA. The reset is what applies the spare row (or, before Ampere, maps the retired page out; until
  then "no further context will be created on the GPU", per the page-retirement document), and it
  is also what clears the volatile counter, so the finding goes away exactly when the remedy was
  applied. Aggregate and corrected counts are evidence only.
- Row remap pending -> fail, reset_gpu: "the process of row-remapping requires a GPU reset to take
  effect". NVML adds that a pending remap will not affect future work because error containment and
  dynamic page offlining cover it, but NVIDIA's own table lists those two features for GA100 and
  GH100 only, not for GA10x or AD10x, where the bad row stays in use until the reset.
- Row remapping failure -> fail, inspect_hardware: NVIDIA's RMA criterion for row remapping.
- Uncorrectable remapped rows >= the profile's memory.remapped_rows_uncorrectable_limit -> warn,
  inspect_hardware: NVIDIA's 8 is per bank while NVML's count is per GPU, so the total is a warning
  sign and the failure flag is the verdict (the profile's own source note says so).
- Bank remap histogram (NVML: "None means that there are no reserved rows available"): banks with
  none left -> warn, inspect_hardware (the next uncorrectable error in such a bank cannot be remapped,
  which is the RMA criterion above); banks at low availability -> warn.
- Retired pages (Volta and older): pending -> fail, reset_gpu (the retirement "will need the driver to
  be reloaded" / GPU reset to take effect); SBE + DBE retired pages >= ``retired_pages_limit`` -> fail,
  inspect_hardware.
- ECC disabled on a datacenter GPU -> warn: memory errors then go undetected and pages cannot be
  retired ("retiring of pages may only occur when ECC is enabled"); reset_gpu if ECC is already set
  to come on at the next reset, else no fixed remedy (enable it: ``nvidia-smi -e 1``).

A reading the GPU does not offer (NOT_SUPPORTED: row remapping before Ampere or on MIG-enabled GPUs,
ECC on GeForce parts) is not judged and says so in its own ``skipped`` finding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpumon.check import Check, CheckContext, each_gpu
from gpumon.errors import GpuLost, HwCondition, HwTimeout, NotSupported
from gpumon.hw.inventory import Inventory
from gpumon.hw.nvml import EccCounts, GpuInfo, RemapHistogram, RemappedRows, RetiredPages
from gpumon.model import Action, Finding, Phase, ReadingSpec, Severity, gpu, reading
from gpumon.profiles import GENERIC

T = TypeVar("T")

# Architectures that retire pages instead of remapping rows (NVIDIA GPU Memory Error Management,
# "Row Remapping": starts with the Ampere architecture, "a replacement for the page retirement scheme
# used in prior generation GPUs"; so Turing, after Volta, still retires pages).
PAGE_RETIREMENT_ARCHS = frozenset({"kepler", "maxwell", "pascal", "volta", "turing"})
# NVML brands of datacenter parts: NVML_BRAND_TESLA (2; V100 and older) and NVML_BRAND_NVIDIA
# (14; 'Product Brand : NVIDIA' on the A10 and H100 captures in realdata/nvidia-smi-q).
DATACENTER_BRANDS = frozenset({2, 14})


@dataclass(frozen=True)
class MemoryConfig:
    retired_pages_limit: int = field(default=62, metadata={
        "min": 1, "max": 64,
        "source": "Azure/azurehpc-health-checks customTests/azure_gpu_ecc.nhc "
                  "@ 0295e2f1c29cc17725f0150817b4e6e7e05a74ca, check_SDBE_ecc (run on V100 nodes): "
                  "'Retirement Table Full' when SBE + DBE retired pages >= 62; NVIDIA GPU Memory Error "
                  "Management, Row Remapping table: page retirement 'supported a maximum of 64 retirements "
                  "for the frame buffer'. Azure also requires a pending retirement; with 62 of 64 entries "
                  "used the table is full either way, so gpumon does not"})


@dataclass
class _Verdict:
    severity: Severity
    action: Action
    message: str


@dataclass
class _Gpu:
    """What one GPU's readings showed: verdicts for the finding, evidence, readings not made."""

    index: int
    verdicts: list[_Verdict] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    unread: list[tuple[str, HwCondition, str]] = field(default_factory=list)  # (reading, why, consequence)

    def add(self, severity: Severity, action: Action, message: str) -> None:
        self.verdicts.append(_Verdict(severity, action, message))


class MemoryCheck(Check):
    name = "memory"
    phase = Phase.CONTINUOUS
    description = "GPU memory errors: volatile DBE, row remapping, bank remap histogram, retired pages"
    readings = (
        ReadingSpec(
            "ecc_volatile_errors_total", "counter",
            "ECC errors counted by this GPU's memory since the last GPU reset or driver load (label kind: "
            "corrected, uncorrected); the reset or driver load sets it back to 0, an ordinary counter reset "
            "for rate() and increase().",
            unit="errors",
            source="NVML nvmlDeviceGetTotalEccErrors (NVML_VOLATILE_ECC)",
            labels=("kind",),
            note="A volatile uncorrected error fails the GPU (reset_gpu). Published by the memory check "
                 "(and the bootstrap's memory_headroom)."),
        ReadingSpec(
            "ecc_aggregate_errors_total", "counter",
            "ECC errors counted by this GPU's memory over its life, kept in its InfoROM across resets and "
            "reboots (label kind: corrected, uncorrected); includes the volatile count's errors, so never "
            "add the two.",
            unit="errors",
            source="NVML nvmlDeviceGetTotalEccErrors (NVML_AGGREGATE_ECC)",
            labels=("kind",),
            note="Evidence only in the memory check; the bootstrap's memory_headroom fails a GPU above its "
                 "aggregate_errors_fail."),
        ReadingSpec(
            "remapped_rows", "gauge",
            "HBM rows of this GPU replaced by spare rows over its life (label kind: correctable, "
            "uncorrectable = remapped after a correctable or an uncorrectable error); kept in the InfoROM, "
            "survives resets and reboots.",
            unit="rows",
            source="NVML nvmlDeviceGetRemappedRows (Ampere and later)",
            labels=("kind",)),
        ReadingSpec(
            "remapped_rows_pending", "gauge",
            "1 while a row remap of this GPU waits for a GPU reset to take effect, else 0 (a flag, not a "
            "count of rows).",
            unit=None,
            source="NVML nvmlDeviceGetRemappedRows isPending",
            note="Fails the GPU (reset_gpu)."),
        ReadingSpec(
            "remapped_rows_failure", "gauge",
            "1 once a row remap of this GPU has failed (NVIDIA's RMA criterion for GPU memory), else 0 (a "
            "flag).",
            unit=None,
            source="NVML nvmlDeviceGetRemappedRows failureOccurred",
            note="Fails the GPU (inspect_hardware)."),
    )
    interval = 60.0
    timeout = 30.0
    Config = MemoryConfig

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(MemoryConfig)
        out = self.unreadable_gpus(ctx.inventory)
        # every GPU at once: a call that hangs on all of them costs one bound, not one per GPU
        for info, got in each_gpu(ctx, ctx.inventory.gpus, lambda info: self._gpu(ctx, options, info)):
            if isinstance(got, HwCondition):
                # a lost or hung GPU is the finding; asking it more would only wait again
                out.append(self.from_condition(got, gpu(info.index)))
            else:
                out.extend(got)
        return out

    def _gpu(self, ctx: CheckContext, options: MemoryConfig, info: GpuInfo) -> list[Finding]:
        g = _Gpu(info.index, evidence={"architecture": info.architecture})
        self._ecc(ctx, g, info)
        arch = info.architecture
        remap_missing = self._remap(ctx, g, info) if arch not in PAGE_RETIREMENT_ARCHS else None
        if arch in PAGE_RETIREMENT_ARCHS or remap_missing is not None:
            pages_missing = self._retired(ctx, options, g, info, expected=arch != "unknown")
            if remap_missing is not None and pages_missing is not None and arch == "unknown":
                # architecture unknown: either source would do, so only say so when neither answers
                g.unread.append(("remapped rows", remap_missing, "row remapping not judged"))
                g.unread.append(("retired pages", pages_missing, "page retirement not judged"))
        return self._findings(g)

    # -- ECC ---------------------------------------------------------------

    def _ecc(self, ctx: CheckContext, g: _Gpu, info: GpuInfo) -> None:
        nvml = ctx.hw.nvml
        mode = _read(lambda: nvml.ecc_mode(info.index))
        if isinstance(mode, HwCondition):
            g.unread.append(("ECC mode", mode, "ECC not judged"))
            return
        current, pending = bool(mode[0]), bool(mode[1])
        g.evidence["ecc_mode"] = {"current": current, "pending": pending}
        if not current:
            self._ecc_disabled(ctx, g, info, pending)
            return
        counts = _read(lambda: nvml.ecc_errors(info.index))
        if isinstance(counts, HwCondition):
            g.unread.append(("ECC error counts", counts, "uncorrectable ECC errors not judged"))
            return
        self._ecc_counts(g, counts)

    def _ecc_disabled(self, ctx: CheckContext, g: _Gpu, info: GpuInfo, pending: bool) -> None:
        brand = _read(lambda: ctx.hw.nvml.brand(info.index))
        if isinstance(brand, HwCondition):
            # no brand: a GPU that matched a SKU profile is a datacenter part (all profiles are)
            datacenter = ctx.profile.name != GENERIC.name
            g.evidence["datacenter_from"] = f"profile {ctx.profile.name}"
        else:
            datacenter = int(brand) in DATACENTER_BRANDS
            g.evidence["brand"] = int(brand)
        if not datacenter:
            # not a fault on a consumer GPU, but ECC errors cannot be judged either: skipped, not ok
            g.add(Severity.SKIPPED, Action.NONE, "ECC disabled (not a datacenter GPU: ECC errors not judged)")
        elif pending:
            g.add(Severity.WARN, Action.RESET_GPU, "ECC disabled; set to come on at the next GPU reset")
        else:
            g.add(Severity.WARN, Action.NONE, "ECC disabled on a datacenter GPU: memory errors go "
                                              "undetected (enable with nvidia-smi -e 1, then reset)")

    def _ecc_counts(self, g: _Gpu, c: EccCounts) -> None:
        g.evidence["ecc"] = {"volatile_corrected": c.volatile_corrected,
                             "volatile_uncorrected": c.volatile_uncorrected,
                             "aggregate_corrected": c.aggregate_corrected,
                             "aggregate_uncorrected": c.aggregate_uncorrected}
        g.evidence.setdefault("readings", []).extend([
            # two counter families, not one with a volatile/aggregate label: the two overlap, so a
            # sum over such a label would count each error twice
            reading("ecc_volatile_errors_total", c.volatile_corrected, kind="corrected"),
            reading("ecc_volatile_errors_total", c.volatile_uncorrected, kind="uncorrected"),
            reading("ecc_aggregate_errors_total", c.aggregate_corrected, kind="corrected"),
            reading("ecc_aggregate_errors_total", c.aggregate_uncorrected, kind="uncorrected")])
        if c.volatile_uncorrected > 0:
            g.add(Severity.FAIL, Action.RESET_GPU,
                  f"{c.volatile_uncorrected} uncorrectable ECC error(s) since the last reset "
                  "(NVIDIA WORKFLOW_XID_48: reset applies the remap / page retirement)")
        else:
            g.add(Severity.OK, Action.NONE, "no uncorrectable ECC errors since the last reset")

    # -- row remapping -----------------------------------------------------

    def _remap(self, ctx: CheckContext, g: _Gpu, info: GpuInfo) -> NotSupported | None:
        """Judge row remapping; on a GPU of unknown architecture that lacks it, hand back why."""
        nvml = ctx.hw.nvml
        rows = _read(lambda: nvml.remapped_rows(info.index))
        if isinstance(rows, NotSupported) and info.architecture == "unknown":
            return rows  # maybe a page-retirement GPU: the caller tries that next
        if isinstance(rows, HwCondition):
            g.unread.append(("remapped rows", rows, "row remapping not judged"))
            return None
        self._rows(ctx, g, rows)
        hist = _read(lambda: nvml.remap_histogram(info.index))
        if isinstance(hist, HwCondition):
            g.unread.append(("row remapper histogram", hist, "spare rows per bank not judged"))
        else:
            self._histogram(g, hist)
        return None

    def _rows(self, ctx: CheckContext, g: _Gpu, r: RemappedRows) -> None:
        limit = ctx.profile.memory.remapped_rows_uncorrectable_limit
        g.evidence["remapped_rows"] = {"corrected": r.corrected, "uncorrected": r.uncorrected,
                                       "pending": r.pending, "failure": r.failure}
        g.evidence.setdefault("readings", []).extend([
            reading("remapped_rows", r.corrected, kind="correctable"),
            reading("remapped_rows", r.uncorrected, kind="uncorrectable"),
            reading("remapped_rows_pending", r.pending), reading("remapped_rows_failure", r.failure)])
        g.evidence["remapped_rows_uncorrectable_limit"] = limit
        if r.failure:
            g.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                  "row remapping failed (NVIDIA's RMA criterion for GPU memory)")
        if r.pending:
            g.add(Severity.FAIL, Action.RESET_GPU,
                  f"row remap pending ({r.uncorrected} uncorrectable, {r.corrected} correctable rows "
                  "remapped): takes effect at the next GPU reset")
        if limit is None:
            g.evidence["remapped_rows_limit_note"] = f"profile {ctx.profile.name} has no limit: not judged"
        elif r.uncorrected >= limit:
            g.add(Severity.WARN, Action.INSPECT_HARDWARE,
                  f"{r.uncorrected} rows remapped for uncorrectable errors (>= {limit}, "
                  f"profile {ctx.profile.name}): memory wearing out")
        if not (r.failure or r.pending):
            g.add(Severity.OK, Action.NONE, f"row remapping ok ({r.uncorrected} uncorrectable, "
                                            f"{r.corrected} correctable rows remapped)")

    def _histogram(self, g: _Gpu, h: RemapHistogram) -> None:
        g.evidence["remap_histogram"] = {"max": h.max, "high": h.high, "partial": h.partial,
                                         "low": h.low, "none": h.none}
        if h.none:
            g.add(Severity.WARN, Action.INSPECT_HARDWARE,
                  f"{h.none} memory bank(s) have no spare rows left: the next uncorrectable error "
                  "there cannot be remapped")
        if h.low:
            g.add(Severity.WARN, Action.NONE, f"{h.low} memory bank(s) low on spare rows")

    # -- page retirement ---------------------------------------------------

    def _retired(self, ctx: CheckContext, options: MemoryConfig, g: _Gpu, info: GpuInfo, *,
                 expected: bool) -> NotSupported | None:
        """Judge page retirement; if it is not supported where it was only a guess, hand back why."""
        pages = _read(lambda: ctx.hw.nvml.retired_pages(info.index))
        if isinstance(pages, NotSupported) and not expected:
            return pages
        if isinstance(pages, HwCondition):
            g.unread.append(("retired pages", pages, "page retirement not judged"))
            return None
        self._pages(options, g, pages)
        return None

    def _pages(self, options: MemoryConfig, g: _Gpu, p: RetiredPages) -> None:
        total = p.single_bit + p.double_bit
        g.evidence["retired_pages"] = {"single_bit": p.single_bit, "double_bit": p.double_bit,
                                       "pending": p.pending, "limit": options.retired_pages_limit}
        if total >= options.retired_pages_limit:
            g.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                  f"{total} retired pages ({p.single_bit} single-bit, {p.double_bit} double-bit; "
                  f"limit {options.retired_pages_limit}, NVIDIA's table holds 64): retirement table "
                  "nearly or wholly used up")
        if p.pending:
            g.add(Severity.FAIL, Action.RESET_GPU,
                  "page retirement pending: takes effect at the next GPU reset")
        if total < options.retired_pages_limit and not p.pending:
            g.add(Severity.OK, Action.NONE, f"{total} retired pages, none pending")

    # -- findings ----------------------------------------------------------

    def _findings(self, g: _Gpu) -> list[Finding]:
        comp = gpu(g.index)
        out: list[Finding] = []
        if g.verdicts:
            severity = max(v.severity for v in g.verdicts)
            action = max(v.action for v in g.verdicts)
            bad = [v.message for v in g.verdicts if v.severity > Severity.OK]
            text = "; ".join(bad or [v.message for v in g.verdicts])
            if g.unread:
                text += "; not read: " + ", ".join(what for what, _, _ in g.unread)
            out.append(self.finding(comp, severity, f"GPU {g.index}: {text}", action, **g.evidence))
        for what, cond, consequence in g.unread:
            if isinstance(cond, NotSupported):
                out.append(self.finding(comp, Severity.SKIPPED,
                                        f"{what} not reported by this GPU (NVML NOT_SUPPORTED): "
                                        f"{consequence}",
                                        Action.NONE, call=cond.call))
            else:
                out.append(self.from_condition(cond, comp))
        return out


def _read(read: Callable[[], T]) -> T | HwCondition:
    """The reading, or the condition that stopped it; GpuLost and HwTimeout end the GPU's turn."""
    try:
        return read()
    except (GpuLost, HwTimeout):
        raise
    except HwCondition as cond:
        return cond
