"""sdc_canary: silent data corruption canaries on idle GPUs.

GPUs with marginal arithmetic units return wrong numbers with no ECC error, no Xid and no thermal
alarm; synthetic stress tests missed over 60 % of them at ByteDance, because they fail only on some
kernels, dtypes and value ranges. This check replays deterministic workloads (GEMM in five dtypes,
attention, a transformer training step, an MoE routing step, and captured real training steps) on
every idle GPU at once and compares their bit fingerprints with a golden run recorded on known-good
hardware of the same key, and across the GPUs of the node (a strict majority names a dissenting GPU
even without a golden). A GPU that computes different bits is ``fail``/``inspect_hardware`` with the
workload, iteration, first differing tensor and both fingerprints as evidence; the failing run is
kept as a replay bundle (``gpumon canary replay``).

It runs only on GPUs NVML reports idle (utilization at or below ``idle_max_utilization_pct``): a
canary must not steal a job's GPU, and a busy GPU's results would be compared under other heat.
Between iterations it stops when a GPU it is not using turns busy (a job is arriving). See
``gpumon.sdc`` for the workloads, fingerprints and bundles.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import ConfigError, HwCondition
from gpumon.model import NODE, Finding, Phase, Severity, gpu


@dataclass(frozen=True)
class SdcCanaryConfig:
    golden_file: str | None = field(default=None, metadata={
        "source": "site: written by `gpumon canary record --out FILE` on known-good hardware of each "
                  "SKU/driver/CUDA/torch combination"})
    majority: bool = field(default=True, metadata={
        "source": "argued: without a golden, a strict majority of the node's GPUs still names a "
                  "dissenting GPU (ByteDance SDC study: faulty GPUs are rare, so the majority is right)"})
    iterations: int = field(default=3, metadata={
        "min": 1,
        "source": "argued: intermittent faults need repetitions; 3 keeps one canary round of the "
                  "built-in workloads under a minute on an 8-GPU node"})
    workloads: list[str] = field(default_factory=list, metadata={
        "source": "empty: every built-in workload (gpumon.sdc.workloads.WORKLOAD_NAMES)"})
    bundles: list[str] = field(default_factory=list, metadata={
        "source": "site: captured training steps (gpumon.sdc.capture) to replay on every GPU"})
    gpus: list[int] = field(default_factory=list, metadata={
        "source": "empty: every idle GPU"})
    idle_max_utilization_pct: int = field(default=5, metadata={
        "min": 0, "max": 100,
        "source": "argued: NVML utilization is the share of the last sample period with a kernel "
                  "running; an idle GPU reads 0, monitoring agents' own probes stay in single digits"})
    bundle_dir: str = field(default="/var/lib/gpumon/sdc/bundles", metadata={
        "source": "the default state_dir (/var/lib/gpumon) + sdc/bundles"})
    device: str = field(default="auto", metadata={
        "choices": ("auto", "cuda", "cpu"),
        "source": "auto: the GPUs; cpu: CPU worker processes stand in for the GPUs (CI, tests)"})
    iteration_timeout_s: float = field(default=600.0, metadata={
        "min": 1,
        "source": "argued: one iteration of the built-in workloads takes seconds on an H100; a GPU "
                  "that does not finish in 10 minutes is hung"})

    def __post_init__(self) -> None:
        if self.gpus and len(set(self.gpus)) != len(self.gpus):
            raise ValueError("gpus: listed twice")


class SdcCanaryCheck(Check):
    name = "sdc_canary"
    phase = Phase.CANARY
    description = "SDC canaries on idle GPUs: bit fingerprints vs a golden run and across GPUs"
    interval = 6 * 3600.0
    timeout = 3600.0
    Config = SdcCanaryConfig

    def supported(self, inventory: Any) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install 'gpumon[compute]')"
        if not inventory.gpus:
            return "no GPUs visible to NVML"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        params: SdcCanaryConfig = ctx.params or SdcCanaryConfig()
        if not params.golden_file and not params.majority:
            return [self.finding(NODE, Severity.SKIPPED,
                                 "no golden_file configured and majority mode off: nothing to compare with")]
        out: list[Finding] = []
        wanted = {g.index for g in ctx.inventory.gpus if not params.gpus or g.index in params.gpus}
        idle: list[int] = []
        idle_elsewhere: list[int] = []
        for info in ctx.inventory.gpus:
            index = info.index
            try:
                util = ctx.hw.nvml.utilization_pct(index)
            except HwCondition as cond:
                if index in wanted:
                    out.append(self.from_condition(cond, gpu(index)))
                continue
            if index not in wanted:
                if util <= params.idle_max_utilization_pct:
                    idle_elsewhere.append(index)
            elif util > params.idle_max_utilization_pct:
                out.append(self.finding(gpu(index), Severity.SKIPPED,
                                        f"GPU {index} busy ({util} % utilization): canaries run on idle GPUs",
                                        utilization_pct=util))
            else:
                idle.append(index)
        if not idle:
            return out or [self.finding(NODE, Severity.SKIPPED, "no idle GPU to run canaries on")]
        if not params.golden_file and len(idle) < 2:
            out.append(self.finding(gpu(idle[0]), Severity.SKIPPED,
                                    "one idle GPU and no golden_file: nothing to compare with"))
            return out
        # GPUs already busy stay busy; an idle one we left alone turning busy means a job arrived
        return out + self._canary(ctx, params, idle, idle_elsewhere)

    def _canary(self, ctx: CheckContext, params: SdcCanaryConfig, idle: list[int],
                others: list[int]) -> list[Finding]:
        from gpumon.sdc import runner
        from gpumon.sdc.bundle import BundleError, expected_golden
        from gpumon.sdc.golden import Golden, cpu_model_of

        try:
            golden = Golden.load(Path(params.golden_file)) if params.golden_file else Golden()
            for b in params.bundles:
                for key, points in expected_golden(Path(b)).entries.items():
                    golden.entries.setdefault(key, points)
        except (ConfigError, BundleError) as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot load canary inputs: {exc}")]
        try:
            cpu = cpu_model_of(ctx.hw.fs.read_text("proc/cpuinfo"))
        except HwCondition:
            cpu = "unknown CPU"

        def wanted_elsewhere() -> bool:
            # our own canary makes our GPUs busy, so only the idle GPUs we left alone can tell
            for index in others:
                try:
                    if ctx.hw.nvml.utilization_pct(index) > params.idle_max_utilization_pct:
                        return True
                except HwCondition:
                    continue
            return False

        options = runner.Options(
            workers=len(idle), device_indices=tuple(idle), iterations=params.iterations,
            workloads=tuple(params.workloads), bundles=tuple(Path(b) for b in params.bundles),
            golden=golden, bundle_dir=Path(params.bundle_dir), device=params.device,
            timeout_s=params.iteration_timeout_s, driver=ctx.inventory.driver_version, cpu_model=cpu,
            should_stop=wanted_elsewhere if others else None)
        try:
            report = runner.run(options)
        except (runner.CanaryError, BundleError) as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"canary could not run: {exc}")]
        return report.findings(self.name)
