"""collective_hang: a GPU spinning in a collective that will not complete, seen from the node.

A rank that waits in an NCCL collective for a peer that never arrives keeps a kernel resident that
polls: NVML calls the GPU ~100 % utilized (a kernel is executing all the time), yet the GPU draws
little more than idle power, reads and writes almost no device memory and moves no PCIe traffic.
Real work at 100 % utilization draws power and moves memory; an idle GPU is not at 100 %. scitix/
sichek's GPUHang rule (components/gpuevents/config/default_event_rules.yaml) names that signature:
utilization > 95 %, power < 100 W (H100/H200 SXM: 160 W), memory utilization < 5 %, PCIe RX and TX
< 300 MB/s, all of them for 60 s.

Every run samples each GPU (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetPowerUsage``,
``nvmlDeviceGetComputeRunningProcesses``, and ``nvmlDeviceGetPcieThroughput`` in both directions
when the rest already shows the signature: that call samples the link for 20 ms per direction, so a
working GPU is not asked). The signature must also have a compute process on the GPU (a GPU with
none runs no collective). The duration is the time since the first sample of the current unbroken
run of signature samples (``state.Run``): one sample without it ends the run, as does a gap between
samples longer than ``max_sample_gap_s`` or a change to processes none of which were there before.

Held for ``hold_s`` -> warn, action none: a hung collective is the job's problem, and the GPUs that
show it are the ones *waiting*; the rank that does not arrive is usually elsewhere (the node whose
GPUs do not show it, issue 21's post-mortem reads that from ``gpu_collective_hang`` and the
findings' ``activity``). Nothing here is proof of a bad GPU, so nothing is taken out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import GpuLost, HwCondition, HwTimeout
from gpumon.hw.inventory import Inventory
from gpumon.model import Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

from .state import CollectiveHangState, Run

SICHEK = ("scitix/sichek components/gpuevents/config/default_event_rules.yaml @ "
          "b6344db3fe04133ea9bc5785c532fce4c9b8871f, rule GPUHang")
_GETTER = ("sichek components/gpuevents/collector/getter.go (same commit) reads it from NVML "
           "through its nvidia component")


@dataclass(frozen=True)
class CollectiveHangConfig:
    # strictly above / below, as sichek compares (GetIndicatorDuration in checker/utils.go)
    min_utilization_pct: float = field(default=95.0, metadata={
        "min": 0, "max": 100,
        "source": f"{SICHEK}: check_items sm threshold 95 compare high; {_GETTER}: sm = "
                  "Utilization.GPUUsagePercent, i.e. nvmlDeviceGetUtilizationRates .gpu (time a "
                  "kernel was executing), the reading used here"})
    max_power_w: float = field(default=100.0, metadata={
        "min": 0, "max": 4000,
        "source": f"{SICHEK}: check_items pwr threshold 100 compare low (the default for every "
                  f"model without an override); {_GETTER}: pwr = PowerUsage / 1000, i.e. "
                  "nvmlDeviceGetPowerUsage in W. SKU profiles set their own (checks.collective_hang"
                  ".max_power_w: H100/H200 SXM 160 W, sichek's check_items_by_model)"})
    max_memory_utilization_pct: float = field(default=5.0, metadata={
        "min": 0, "max": 100,
        "source": f"{SICHEK}: check_items mem threshold 5 compare low; {_GETTER}: mem = "
                  "Utilization.MemoryUsagePercent, i.e. nvmlDeviceGetUtilizationRates .memory"})
    max_pcie_mbps: float = field(default=300.0, metadata={
        "min": 0,
        "source": f"{SICHEK}: check_items rxpci and txpci threshold 300 '# MB/s' compare low; "
                  f"{_GETTER}: PCIeRx / 1024 and PCIeTx / 1024 of nvmlDeviceGetPcieThroughput's KB/s, "
                  "the unit used here, each direction on its own. sichek compares the change of the "
                  "value between two samples; this check compares the throughput itself (a GPU "
                  "streaming 20 GB/s steadily is working, not hung)"})
    hold_s: float = field(default=60.0, metadata={
        "min": 0, "max": 86400,
        "source": f"{SICHEK}: duration_threshold 60s (every indicator held that long). sichek then "
                  "samples every 10 s and confirms after abnormal_detected_times 5; this check's "
                  "10 s interval gives 7 consecutive samples over the 60 s, none of which may break"})
    max_sample_gap_s: float = field(default=30.0, metadata={
        "min": 1,
        "source": "argued: three default intervals (10 s); after a longer silence (daemon stopped, a "
                  "run that timed out) nobody saw whether the signature held, so the run starts again "
                  "from the next sample. Keep it above the check's interval_s"})


@dataclass
class _Sample:
    """What one run read of one GPU; None where NVML could not say (see ``not_judged``)."""

    util: int
    memory: int
    power_w: float
    pids: list[int] | None = None
    tx_mbps: float | None = None
    rx_mbps: float | None = None
    not_judged: list[str] = field(default_factory=list)


def _fmt(value: float) -> str:
    return f"{round(value, 1):g}"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


class CollectiveHangCheck(Check):
    name = "collective_hang"
    phase = Phase.CONTINUOUS
    description = ("GPU ~100 % utilized at low power, no memory or PCIe traffic, with a compute process, "
                   "for 60 s: spinning in a collective that will not complete")
    readings = (
        ReadingSpec(
            "gpu_collective_hang", "gauge",
            "1 while this GPU has shown the hung-collective signature without a break for at least hold_s "
            "(default 60 s), else 0 (a flag): a compute process on it, utilization above "
            "min_utilization_pct (95 %), board power below max_power_w (the SKU profile's: 160 W on "
            "H100/H200 SXM, 100 W on A100 and H100 PCIe), memory utilization below 5 % and PCIe below 300 "
            "MB/s each way, i.e. a kernel spinning in a collective that will not complete (scitix/sichek's "
            "GPUHang rule).",
            unit=None,
            source="NVML nvmlDeviceGetUtilizationRates, nvmlDeviceGetPowerUsage, "
                   "nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetPcieThroughput, sampled every run of "
                   "the collective_hang check (10 s)",
            note="The GPUs showing it wait; a node of the same job whose GPUs show 0 meanwhile is the one "
                 "to look at."),
        ReadingSpec(
            "gpu_collective_hang_seconds", "gauge",
            "How long this GPU's current unbroken run of hung-collective signature samples had lasted at "
            "the collective_hang check's last run: 0 when that sample did not show it; gpu_collective_hang "
            "turns 1 when it reaches hold_s (default 60 s).",
            unit="seconds",
            source="gpumon's timing of the check's NVML samples (any sample without the signature, or a gap "
                   "over max_sample_gap_s, starts it again from 0)"),
    )
    interval = 10.0
    timeout = 20.0
    Config = CollectiveHangConfig
    State = CollectiveHangState

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(CollectiveHangConfig)
        out = self.unreadable_gpus(ctx.inventory)
        state = ctx.state_as(CollectiveHangState)
        for info in ctx.inventory.gpus:
            comp = gpu(info.index)
            run = state.gpus.setdefault(str(info.index), Run())
            try:
                sample = self._sample(ctx, info.index, options)
            except HwCondition as cond:
                # unread is not "still showing it": the run ends here
                run.step(ctx.clock(), False, None, options.max_sample_gap_s)
                out.append(self.from_condition(cond, comp))
                continue
            now = ctx.clock()
            breaks = _breaks(sample, options)
            held = run.step(now, not breaks, sample.pids, options.max_sample_gap_s)
            out.append(self._verdict(info.index, sample, breaks, run, held, options))
        return out

    def _sample(self, ctx: CheckContext, index: int, options: CollectiveHangConfig) -> _Sample:
        nvml = ctx.hw.nvml
        rates = nvml.utilization(index)  # NotSupported here: the GPU cannot be judged (skipped)
        sample = _Sample(rates.gpu_pct, rates.memory_pct, nvml.power_w(index))
        try:
            sample.pids = [p.pid for p in nvml.compute_processes(index)]
        except (GpuLost, HwTimeout):
            raise
        except HwCondition as cond:  # not supported (vGPU, some MIG setups) or refused
            sample.not_judged.append(f"compute processes: {cond}")
        if _breaks(sample, options):
            return sample  # already not the signature: the 2 x 20 ms PCIe sampling is not needed
        try:
            pcie = nvml.pcie_throughput(index)
            sample.tx_mbps, sample.rx_mbps = pcie.tx_kbps / 1024, pcie.rx_kbps / 1024
        except (GpuLost, HwTimeout):
            raise
        except HwCondition as cond:
            sample.not_judged.append(f"PCIe throughput: {cond}")
        return sample

    def _verdict(self, index: int, s: _Sample, breaks: list[str], run: Run, held: float,
                 options: CollectiveHangConfig) -> Finding:
        comp = gpu(index)
        stuck = not breaks and held >= options.hold_s
        evidence: dict[str, Any] = {
            "utilization_pct": s.util, "memory_utilization_pct": s.memory, "power_w": round(s.power_w, 1),
        }
        if s.tx_mbps is not None and s.rx_mbps is not None:
            evidence["pcie_tx_mbps"], evidence["pcie_rx_mbps"] = round(s.tx_mbps, 1), round(s.rx_mbps, 1)
        if s.pids is not None:
            evidence["compute_pids"] = s.pids
        evidence["activity"] = _activity(s, breaks, stuck, options)
        evidence["signature"] = not breaks
        if breaks:
            evidence["breaks"] = breaks
        else:
            assert run.since is not None
            evidence.update(held_s=round(held, 1), since=run.since, since_utc=_utc(run.since),
                            pids_during=run.pids)
        if s.not_judged:
            evidence["not_judged"] = s.not_judged
        evidence["thresholds"] = {
            "min_utilization_pct": options.min_utilization_pct, "max_power_w": options.max_power_w,
            "max_memory_utilization_pct": options.max_memory_utilization_pct,
            "max_pcie_mbps": options.max_pcie_mbps, "hold_s": options.hold_s}
        evidence["readings"] = [reading("gpu_collective_hang", stuck),
                                reading("gpu_collective_hang_seconds", 0.0 if breaks else held)]
        pcie = ("n/a" if s.tx_mbps is None or s.rx_mbps is None else _fmt(max(s.tx_mbps, s.rx_mbps)))
        words = (f"util {s.util} %, power {s.power_w:.0f} W, memory {s.memory} %, PCIe {pcie} MB/s "
                 f"for {held:.0f} s")
        if stuck:
            who = ", ".join(str(p) for p in run.pids) if run.pids else "not listed by NVML"
            return self.finding(comp, Severity.WARN,
                                f"GPU {index} looks stuck in a collective: {words}, process(es) {who}",
                                Action.NONE, **evidence)
        if not breaks:
            return self.ok(comp, f"collective-hang signature ({words}; judged at {options.hold_s:g} s)",
                           **evidence)
        return self.ok(comp, f"not stuck in a collective ({evidence['activity']}): {'; '.join(breaks)}",
                       **evidence)


def _breaks(s: _Sample, p: CollectiveHangConfig) -> list[str]:
    """What in this sample is not the signature (empty: it is the signature)."""
    out = []
    if s.pids is not None and not s.pids:
        out.append("no compute process")
    if not s.util > p.min_utilization_pct:
        out.append(f"util {s.util} % (signature > {p.min_utilization_pct:g} %)")
    if not s.power_w < p.max_power_w:
        out.append(f"power {s.power_w:.0f} W (signature < {p.max_power_w:g} W)")
    if not s.memory < p.max_memory_utilization_pct:
        out.append(f"memory {s.memory} % (signature < {p.max_memory_utilization_pct:g} %)")
    for what, value in (("PCIe TX", s.tx_mbps), ("PCIe RX", s.rx_mbps)):
        if value is not None and not value < p.max_pcie_mbps:
            out.append(f"{what} {_fmt(value)} MB/s (signature < {p.max_pcie_mbps:g} MB/s)")
    return out


def _activity(s: _Sample, breaks: list[str], stuck: bool, p: CollectiveHangConfig) -> str:
    """One word for the post-mortem: what this GPU was doing while others may have been stuck."""
    if not breaks:
        return "stuck" if stuck else "signature"
    if s.pids is not None and not s.pids:
        return "no_process"  # no rank of any job on it
    quiet = s.power_w < p.max_power_w and s.memory < p.max_memory_utilization_pct
    if not s.util > p.min_utilization_pct and quiet:
        return "idle"  # a process, but the GPU mostly waits for it (host side, data, a CPU hang)
    return "working"  # drawing power or moving memory or PCIe traffic: real work
