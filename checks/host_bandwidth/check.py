"""host_bandwidth: pinned host <-> device copy bandwidth per GPU (the bandwidth part of pcie-topology).

One worker process measures each GPU in turn (one at a time, as nvbandwidth's
host_to_device_memcpy_ce / device_to_host_memcpy_ce do, so GPUs behind one PCIe switch do not
share its uplink during the measurement): ``nbytes`` from page-locked host memory to the GPU and
back, ``iterations`` times each, GB/s = bytes / s / 1e9. Before each GPU the worker binds itself to
the CPUs local to that GPU (sysfs ``local_cpulist`` of the GPU's PCI function, under the host
root), so the pinned buffer lives on the GPU's own NUMA node as a well-placed job's would; a
buffer on the far socket measures the inter-socket link, not the GPU's.

Both directions are compared with the profile's ``min_gbps``; a GPU below it is measured once
more and fails only if it stays low (``retryable: true``). A low link is usually a PCIe link
trained down (width or generation: see the ``pcie`` check) or a failing riser/retimer:
``inspect_hardware``, as ``pcie`` does for a narrow link. GPU only: without CUDA the check is
``skipped`` with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon import workers
from gpumon.check import Check, CheckContext
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


@dataclass(frozen=True)
class HostBandwidthConfig:
    nbytes: int = field(default=256 << 20, metadata={
        "min": 4096,
        "source": "argued: ~5 ms per copy at 50 GB/s, well past the per-copy overhead; small enough to pin "
                  "quickly on any host"})
    iterations: int = field(default=20, metadata={"min": 1})
    # from the SKU profile (checks.host_bandwidth.min_gbps, with its source there)
    min_gbps: float | None = field(default=None, metadata={"min": 0})
    numa_local: bool = field(default=True, metadata={
        "source": "argued: Azure's checks pin to the GPU's NUMA node for the same reason "
                  "(azure_nccl_allreduce.nhc: mpirun -bind-to numa)"})
    startup_s: float = field(default=60.0, metadata={"min": 1})
    per_gpu_s: float = field(default=20.0, metadata={
        "min": 0.1, "source": "argued: pinning 256 MiB and 2 x 20 copies take well under a second"})


@dataclass(frozen=True)
class Measured:
    """One GPU's result: best of its attempts per direction."""

    index: int
    ordinal: int  # the CUDA device number it was measured as
    h2d: float
    d2h: float
    attempts: dict[str, list[float]]
    cpus: tuple[int, ...]
    pinned: bool


def below(results: Mapping[int, Measured], minimum: float | None) -> dict[int, list[str]]:
    """GPU index -> directions below ``minimum``."""
    if minimum is None:
        return {}
    out: dict[int, list[str]] = {}
    for index, m in results.items():
        low = [d for d, v in (("host-to-device", m.h2d), ("device-to-host", m.d2h)) if v < minimum]
        if low:
            out[index] = low
    return out


class HostBandwidthCheck(Check):
    name = "host_bandwidth"
    phase = Phase.BOOTSTRAP
    description = "pinned host-to-device and device-to-host copy bandwidth per GPU vs the profile"
    readings = (
        ReadingSpec(
            "host_bandwidth_bytes_per_second", "gauge",
            "Pinned host memory <-> this GPU copy bandwidth in the last host_bandwidth run (label "
            "direction: h2d, d2h), one direction's bytes, the best of the attempts, from CPUs local to the "
            "GPU.",
            unit=UNIT_BYTES_PER_SECOND,
            source="gpumon's CUDA copy worker (torch), as nvbandwidth's memcpy_ce tests measure",
            labels=("direction",)),
    )
    # seconds a healthy run takes (suite order and ETA), an estimate, not measured:
    # 8 GPUs x ~0.5 s plus start-up
    cost = 15.0
    timeout = 600.0
    Config = HostBandwidthConfig

    def supported(self, inventory: Inventory) -> str | None:
        if not inventory.gpus and not inventory.unreadable_gpus:
            return "no GPUs visible to NVML"
        return workers.torch_missing()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(HostBandwidthConfig)
        try:
            place = ctx.hw.devices.place(ctx.inventory, 0)
        except placement.NoCudaOnGpuNode as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"GPUs not tested: {exc}")]
        if not place.is_cuda:
            return [self.finding(NODE, Severity.SKIPPED,
                                 "host-device bandwidth needs CUDA devices; torch sees none"
                                 + (f" ({where})" if (where := ctx.hw.devices.describe()) else ""))]
        by_uuid = workers.gpu_index_by_uuid(ctx.inventory)
        cpus = local_cpus(ctx) if options.numa_local else {}
        ordinals = tuple(range(place.devices))
        first = self._measure(options, ordinals, cpus, by_uuid)
        if isinstance(first, Finding):
            return [first]
        results, unmapped = first
        low = below(results, options.min_gbps)
        if low:
            # bandwidth varies run to run: measure the low GPUs once more before failing
            redo = tuple(results[index].ordinal for index in low)
            again = self._measure(options, redo, cpus, by_uuid)
            if not isinstance(again, Finding):
                for index, m in again[0].items():
                    old = results[index]
                    results[index] = Measured(index, m.ordinal, max(old.h2d, m.h2d), max(old.d2h, m.d2h),
                                              {k: old.attempts[k] + m.attempts[k] for k in old.attempts},
                                              m.cpus, m.pinned)
        return judge(ctx, results, unmapped, options, place)

    def _measure(self, options: HostBandwidthConfig, ordinals: tuple[int, ...],
                 cpus: Mapping[str, tuple[int, ...]], by_uuid: Mapping[str, int]
                 ) -> tuple[dict[int, Measured], list[kernels.HostCopy]] | Finding:
        """Measurements by NVML index (and those of CUDA devices NVML does not know), or a finding."""
        spec = kernels.HostCopySpec(devices=ordinals, nbytes=options.nbytes, iterations=options.iterations,
                                    cpus_by_uuid=dict(cpus))
        deadline = options.startup_s + options.per_gpu_s * len(ordinals)
        try:
            run = workers.run_workers(kernels.host_copy_worker, [spec], kind="cuda", bind=False,
                                      timeout_s=deadline, name=self.name,
                                      lock_wait_s=workers.lock_wait(self.timeout, 2 * deadline))
        except workers.DevicesBusy as exc:
            return self.finding(NODE, Severity.UNKNOWN, str(exc))
        outcome = run.outcomes[0]
        if not outcome.ok:
            # a copy that hangs or crashes names the GPU it was on (the worker's last phase)
            return self.finding(NODE, Severity.FAIL, f"host copy worker: {outcome.describe()}",
                                Action.RESET_GPU if outcome.state in ("hung", "stuck") else Action.NONE,
                                phase=outcome.phase, error=outcome.error[-2000:])
        out: dict[int, Measured] = {}
        unmapped: list[kernels.HostCopy] = []
        for c in outcome.result:
            index = by_uuid.get(c.uuid or "")
            if index is None:
                unmapped.append(c)
                continue
            out[index] = Measured(index, c.device, c.h2d_gbps, c.d2h_gbps,
                                  {"h2d": [round(c.h2d_gbps, 2)], "d2h": [round(c.d2h_gbps, 2)]},
                                  c.cpus, c.pinned)
        return out, unmapped

def local_cpus(ctx: CheckContext) -> dict[str, tuple[int, ...]]:
    """Normalized GPU UUID -> its local CPUs from sysfs (empty where unreadable: not bound)."""
    out: dict[str, tuple[int, ...]] = {}
    for info in ctx.inventory.gpus:
        uuid = placement.normalize_uuid(info.uuid)
        if not uuid:
            continue
        try:
            text = ctx.hw.fs.read_text(f"sys/bus/pci/devices/{info.pci_bus_id}/local_cpulist")
            out[uuid] = kernels.parse_cpulist(text)
        except (HwCondition, ValueError):
            continue
    return out


def judge(ctx: CheckContext, results: Mapping[int, Measured], unmapped: Sequence[kernels.HostCopy],
          options: HostBandwidthConfig, place: placement.Placement) -> list[Finding]:
    """One finding per GPU: both directions against the profile's minimum (best of the attempts)."""
    low = below(results, options.min_gbps)
    name = HostBandwidthCheck.name
    source = ctx.profile.source_of("checks.host_bandwidth.min_gbps")
    out: list[Finding] = []
    for index, m in sorted(results.items()):
        ev: dict[str, Any] = {
            "h2d_gbps": round(m.h2d, 2), "d2h_gbps": round(m.d2h, 2), "attempts_gbps": m.attempts,
            "bytes": options.nbytes, "iterations": options.iterations, "pinned": m.pinned,
            "cpus": _ranges(m.cpus) or "unbound", "min_gbps": options.min_gbps, "source": source,
            "retryable": True,
            "readings": [reading("host_bandwidth_bytes_per_second", m.h2d * 1e9, direction="h2d"),
                         reading("host_bandwidth_bytes_per_second", m.d2h * 1e9, direction="d2h")],
        }
        if index in low:
            out.append(Finding(name, gpu(index), Severity.FAIL,
                               f"GPU {index}: {' and '.join(low[index])} below the profile's "
                               f"{options.min_gbps:g} GB/s (h2d {m.h2d:.3g}, d2h {m.d2h:.3g}; best of "
                               f"{len(m.attempts['h2d'])} measurements)", Action.INSPECT_HARDWARE, ev))
        else:
            judged = (f"profile minimum {options.min_gbps:g}" if options.min_gbps is not None
                      else "not judged: no min_gbps in the profile")
            out.append(Finding(name, gpu(index), Severity.OK,
                               f"GPU {index}: h2d {m.h2d:.3g} GB/s, d2h {m.d2h:.3g} GB/s ({judged})",
                               Action.NONE, ev))
    tested = set(results)
    for info in ctx.inventory.gpus:
        if info.index not in tested:
            out.append(Finding(name, gpu(info.index), Severity.UNKNOWN,
                               f"GPU {info.index} not tested: no CUDA device with its UUID is visible "
                               "to torch"))
    if unmapped:
        measured = {f"cuda:{c.device}": {"h2d_gbps": round(c.h2d_gbps, 2),
                                         "d2h_gbps": round(c.d2h_gbps, 2)} for c in unmapped}
        out.append(Finding(name, NODE, Severity.UNKNOWN,
                           f"{len(unmapped)} CUDA device(s) whose UUID NVML does not know: measured, "
                           "not judged",
                           Action.NONE, {"measured": measured}))
    if not out:
        out.append(Finding(name, NODE, Severity.UNKNOWN, f"no GPU measured ({place.note})"))
    return out


def _ranges(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8", as sysfs writes CPU lists."""
    out: list[str] = []
    start = prev = None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif prev is not None and c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)
