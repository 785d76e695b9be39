"""memory_headroom: the bootstrap's deep ECC / HBM check, before a node is admitted to work.

It is the continuous ``memory`` check's reading of every GPU (checks/memory.py: ECC mode and counts,
row remapping and its bank histogram on Ampere and later, page retirement before), with the same
verdicts, so the two never disagree on one reading:

- row remap pending -> fail, reset_gpu: the GPU must be reset before it takes work (the reset is
  what applies the spare row);
- row remapping failure -> fail, inspect_hardware (NVIDIA's RMA criterion);
- uncorrectable remapped rows at the profile's ``memory.remapped_rows_uncorrectable_limit`` -> warn,
  inspect_hardware; banks with no spare rows left -> warn, inspect_hardware; low -> warn;
- volatile uncorrectable ECC errors -> fail, reset_gpu.

and what an admission gate adds to a continuous watch, judged on lifetime (aggregate) counts that
the continuous check keeps as evidence only:

- uncorrectable remapped rows above ``uncorrectable_rows_fail`` -> fail, inspect_hardware;
- aggregate ECC errors (corrected or uncorrected) above ``aggregate_errors_fail`` -> fail,
  inspect_hardware;
- on a row-remapping GPU, more aggregate uncorrectable errors than rows remapped for them -> warn:
  errors the remapper did not absorb were in memory that cannot be remapped (on-chip SRAM, which
  Azure's health checks fail outright) or hit the same row again before its remap was applied;
  NVML's totals cannot tell which, so this is a warning with the counts, not a verdict.

The spare-row headroom (share of banks that still have spare rows) is evidence on every GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import CheckContext
from gpumon.model import Action, Finding, Phase, Severity

from .memory import MemoryCheck, MemoryConfig, _Gpu


@dataclass(frozen=True)
class MemoryHeadroomConfig(MemoryConfig):
    uncorrectable_rows_fail: int = field(default=512, metadata={
        "min": 1,
        "source": "Azure/azurehpc-health-checks customTests/azure_gpu_ecc.nhc @ "
                  "0295e2f1c29cc17725f0150817b4e6e7e05a74ca, check_ecc (A100/H100): 'Row remap uncorrectable "
                  "error count is too high' when remapped_rows.uncorrectable > 512"})
    aggregate_errors_fail: int = field(default=20_000_000, metadata={
        "min": 1,
        "source": "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ "
                  "7e6ac7796e4398d2a6b0b29ca39f1060f0a993cb: 'check_gpu_ecc 20000000 10000', whose first "
                  "argument azure_gpu_ecc.nhc compares with the volatile and aggregate DRAM corrected and "
                  "uncorrected counts; NVML's totals here add SRAM to DRAM, so this is slightly stricter"})


class MemoryHeadroomCheck(MemoryCheck):
    name = "memory_headroom"
    phase = Phase.BOOTSTRAP
    description = ("deep ECC/HBM check before admitting work: remap pending/failure, remapped rows and bank "
                   "headroom, volatile and lifetime ECC counts")
    timeout = 30.0
    cost = 1.0
    Config = MemoryHeadroomConfig

    def __init__(self) -> None:
        super().__init__()
        # the per-GPU verdicts of MemoryCheck (_findings) read these limits: set by each run
        self._limits = MemoryHeadroomConfig()

    def run(self, ctx: CheckContext) -> list[Finding]:
        self._limits = ctx.options_as(MemoryHeadroomConfig)
        return super().run(ctx)

    def _findings(self, g: _Gpu) -> list[Finding]:
        limits = self._limits
        ev: dict[str, Any] = g.evidence
        rows = ev.get("remapped_rows")
        ecc = ev.get("ecc")
        if isinstance(rows, dict) and rows["uncorrected"] > limits.uncorrectable_rows_fail:
            g.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                  f"{rows['uncorrected']} rows remapped for uncorrectable errors (> "
                  f"{limits.uncorrectable_rows_fail}): too little spare memory left to admit work")
        if isinstance(ecc, dict):
            worst = max(ecc["aggregate_corrected"], ecc["aggregate_uncorrected"])
            if worst > limits.aggregate_errors_fail:
                g.add(Severity.FAIL, Action.INSPECT_HARDWARE,
                      f"{worst} ECC errors over the GPU's life (aggregate; > {limits.aggregate_errors_fail})")
            if isinstance(rows, dict):
                unabsorbed = ecc["aggregate_uncorrected"] - rows["uncorrected"]
                ev["aggregate_uncorrectable_not_remapped"] = max(0, unabsorbed)
                if unabsorbed > 0:
                    g.add(Severity.WARN, Action.NONE,
                          f"{ecc['aggregate_uncorrected']} uncorrectable ECC errors over the GPU's life but "
                          f"{rows['uncorrected']} rows remapped for them: {unabsorbed} were not absorbed by "
                          "row remapping (on-chip SRAM, or a row hit again before its remap)")
        hist = ev.get("remap_histogram")
        if isinstance(hist, dict):
            banks = sum(hist.values())
            if banks:
                ev["banks_with_spare_rows_pct"] = round(100.0 * (banks - hist["none"]) / banks, 2)
        return super()._findings(g)
