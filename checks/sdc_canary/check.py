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

It runs only on idle GPUs: a canary must not steal a job's GPU, and a busy GPU's results would be
compared under other heat. A GPU is idle when NVML lists no compute process on it
(``nvmlDeviceGetComputeRunningProcesses``; this gpumon process's own pid aside) AND its utilization is
at or below ``idle_max_utilization_pct``. Processes come first because utilization is a sampled share
of time with a kernel running: a job between steps, loading data or waiting on a collective reads 0 %
while its processes still hold the GPU. A busy GPU is ``skipped`` with the pids (or the utilization)
in the evidence. Where the driver cannot list processes (NotSupported) idle falls back to utilization
alone, and the finding's evidence (``idle_gate``) says so; any other NVML error on either reading is
that GPU's finding and the GPU is left alone. Between iterations it stops when a GPU it is not using
turns busy by utilization (a job is arriving). See ``gpumon.sdc`` for the workloads, fingerprints and
bundles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon import workers
from gpumon.check import Check, CheckContext
from gpumon.errors import ConfigError, HwCondition
from gpumon.idle import idle_gate
from gpumon.model import NODE, Finding, Phase, Severity, gpu

if TYPE_CHECKING:
    from gpumon.hw.inventory import Inventory
    from gpumon.hw.placement import StandIn
    from gpumon.sdc.inject import FaultSpec
    from gpumon.sdc.runner import Report


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
    # empty: <state_dir>/sdc/bundles, the agent's state directory
    bundle_dir: str = ""
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

    def supported(self, inventory: Inventory) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return workers.TORCH_MISSING
        if not inventory.gpus:
            return "no GPUs visible to NVML"
        return None

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(SdcCanaryConfig)
        if not options.golden_file and not options.majority:
            return [self.finding(NODE, Severity.SKIPPED,
                                 "no golden_file configured and majority mode off: nothing to compare with")]
        out: list[Finding] = []
        wanted = {g.index for g in ctx.inventory.gpus if not options.gpus or g.index in options.gpus}
        gates: dict[int, dict[str, Any]] = {}  # idle GPUs we canary -> what idle was judged on
        idle_elsewhere: list[int] = []
        for info in ctx.inventory.gpus:
            index = info.index
            try:
                gate = idle_gate(ctx.hw, index, options.idle_max_utilization_pct)
            except HwCondition as cond:
                if index in wanted:
                    out.append(self.from_condition(cond, gpu(index)))
                continue
            if index not in wanted:
                if gate.busy is None:
                    idle_elsewhere.append(index)
            elif gate.busy is not None:
                out.append(self.finding(gpu(index), Severity.SKIPPED,
                                        f"{gate.busy}; canaries run on idle GPUs", **gate.evidence))
            else:
                gates[index] = gate.evidence
        idle = list(gates)
        if not idle:
            return out or [self.finding(NODE, Severity.SKIPPED, "no idle GPU to run canaries on")]
        if not options.golden_file and len(idle) < 2:
            out.append(self.finding(gpu(idle[0]), Severity.SKIPPED,
                                    "one idle GPU and no golden_file: nothing to compare with"))
            return with_idle_gate(out, gates)
        # GPUs already busy stay busy; an idle one we left alone turning busy means a job arrived
        return with_idle_gate(out + self._canary(ctx, options, idle, idle_elsewhere), gates)

    def _canary(self, ctx: CheckContext, options: SdcCanaryConfig, idle: list[int],
                others: list[int]) -> list[Finding]:
        from gpumon.sdc import runner
        from gpumon.sdc.bundle import BundleError, expected_golden
        from gpumon.sdc.golden import Golden, cpu_model_of

        bundles, refused = trusted_bundles(self, options.bundles)
        if refused and not bundles and not options.workloads:
            return refused  # nothing left of what was asked for (the built-ins were not)
        try:
            golden = Golden.load(Path(options.golden_file)) if options.golden_file else Golden()
            for b in bundles:
                for key, points in expected_golden(b).entries.items():
                    golden.entries.setdefault(key, points)
        except (ConfigError, BundleError) as exc:
            return [*refused, self.finding(NODE, Severity.UNKNOWN, f"cannot load canary inputs: {exc}")]
        try:
            cpu = cpu_model_of(ctx.hw.fs.read_text("proc/cpuinfo"))
        except HwCondition:
            cpu = "unknown CPU"

        def wanted_elsewhere() -> bool:
            # our own canary makes our GPUs busy, so only the idle GPUs we left alone can tell
            for index in others:
                try:
                    if ctx.hw.nvml.utilization_pct(index) > options.idle_max_utilization_pct:
                        return True
                except HwCondition:
                    continue
            return False

        device, inject = options.device, None
        stand_ins = ctx.hw.devices.stand_ins(ctx.inventory)
        if stand_ins:
            # CPU workers stand in for the GPUs: never the machine's real GPUs under their names;
            # a GPU whose stand-in computes wrong bits runs its worker under the fault harness
            device, inject = ctx.hw.devices.only_device or "cpu", stand_in_sdc(stand_ins, idle)
        run_options = runner.Options(
            workers=len(idle), device_indices=tuple(idle), iterations=options.iterations,
            workloads=tuple(options.workloads), bundles=tuple(bundles),
            golden=golden, bundle_dir=bundle_dir(options, ctx), device=device,
            timeout_s=options.iteration_timeout_s, driver=ctx.inventory.driver_version, cpu_model=cpu,
            should_stop=wanted_elsewhere if others else None, inject=inject, inject_origin="simulated",
            gpu_identity=gpu_identity(ctx, idle),
            lock_wait_s=workers.lock_wait(self.timeout, options.iterations * options.iteration_timeout_s))
        try:
            report = runner.run(run_options)
        except (runner.CanaryError, BundleError, workers.DevicesBusy) as exc:
            return [*refused, self.finding(NODE, Severity.UNKNOWN, f"canary could not run: {exc}")]
        return [*refused, *self.canary_verdict(report)]

    def canary_verdict(self, report: Report) -> list[Finding]:
        """One finding per GPU from a canary run (also what ``gpumon canary`` judges by)."""
        from . import verdict

        return verdict.findings(report, self.name)


def trusted_bundles(check: Check, configured: list[str]) -> tuple[list[Path], list[Finding]]:
    """The configured bundles the daemon may replay (as root, with its workers checking them again
    before importing their code), and an ``unknown`` finding for each it refuses: one that anyone
    but root could have written or could change (``gpumon.sdc.trust``), or that cannot be read."""
    from gpumon.sdc.trust import BundleError, UntrustedBundle, check_bundle

    ok: list[Path] = []
    refused: list[Finding] = []
    for b in configured:
        try:
            ok.append(check_bundle(Path(b)).path)
        except UntrustedBundle as exc:
            refused.append(check.finding(
                NODE, Severity.UNKNOWN,
                f"{exc}: the daemon does not replay a bundle another user could have written; look at the "
                f"bundle, then make it root's and writable by root only, or replay it as its owner "
                f"(gpumon canary replay --as-owner {b})",
                bundle=b, path=str(exc.path), owner_uid=exc.owner))
        except BundleError as exc:
            refused.append(check.finding(NODE, Severity.UNKNOWN, f"cannot load canary inputs: {exc}",
                                         bundle=b))
    return ok, refused


def with_idle_gate(findings: list[Finding], gates: dict[int, dict[str, Any]]) -> list[Finding]:
    """Each canaried GPU's findings carry what its idleness was judged on (``idle_gate``)."""
    by_component = {gpu(i): ev for i, ev in gates.items()}
    return [dataclasses.replace(f, evidence={**f.evidence, "idle_gate": by_component[f.component]})
            if f.component in by_component else f for f in findings]


def stand_in_sdc(stand_ins: tuple[StandIn, ...], idle: list[int]) -> FaultSpec | None:
    """The fault harness spec for the first idle GPU whose stand-in computes wrong bits
    (``StandIn.sdc``), for its worker; None when there is none."""
    from gpumon.sdc.inject import stand_in_fault  # at run time: it imports torch

    return stand_in_fault({s.index: s.sdc for s in stand_ins}, idle)


def gpu_identity(ctx: CheckContext, indices: list[int]) -> dict[int, dict[str, Any]]:
    """What NVML says of the canaried GPUs, for their findings and replay bundles: the canary runs
    on the idle GPUs only, so its worker numbers are not GPU numbers and a bundle must name the GPU."""
    return {g.index: {"uuid": g.uuid, "serial": g.serial, "pci_bus_id": g.pci_bus_id, "name": g.name}
            for g in ctx.inventory.gpus if g.index in indices}


def bundle_dir(options: SdcCanaryConfig, ctx: CheckContext) -> Path:
    """Where a failing run's replay bundle goes: ``bundle_dir``, else under the agent's state directory."""
    if options.bundle_dir:
        return Path(options.bundle_dir)
    return (ctx.state_dir or Path("/var/lib/gpumon")) / "sdc" / "bundles"
