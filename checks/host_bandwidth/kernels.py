"""The host_bandwidth check's measurement, run inside a worker (gpumon/workers.py): pinned host <-> device
copy bandwidth per device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumon.workers import WorkerContext, cuda_identity, timing_event

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class HostCopySpec:
    devices: tuple[int, ...]  # CUDA ordinals, measured one at a time
    nbytes: int
    iterations: int
    warmup: int = 2
    # normalized GPU UUID -> the CPUs local to that GPU (sysfs local_cpulist): the pinned buffer
    # is then allocated on the GPU's own NUMA node, as a job pinned by its launcher would be
    cpus_by_uuid: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class HostCopy:
    device: int
    uuid: str | None
    h2d_gbps: float
    d2h_gbps: float
    pinned: bool
    cpus: tuple[int, ...]  # the affinity used ((): unchanged)


def host_copy_worker(ctx: WorkerContext, spec: HostCopySpec) -> list[HostCopy]:
    """Worker (one process): pinned host -> device and device -> host bandwidth per device."""
    import torch

    out: list[HostCopy] = []
    for index in spec.devices:
        uuid = cuda_identity(index)["uuid"]
        cpus = tuple(spec.cpus_by_uuid.get(uuid or "", ()))
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)
        ctx.progress(f"host copies GPU {index}", device=index)
        host = torch.empty(spec.nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(spec.nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        with torch.cuda.device(index):
            h2d = _timed_copies(dev, host, spec.iterations, spec.warmup)
            d2h = _timed_copies(host, dev, spec.iterations, spec.warmup)
        out.append(HostCopy(index, uuid, h2d, d2h, bool(host.is_pinned()), cpus))
        del host, dev
    return out


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, iterations: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    begin, end = timing_event(), timing_event()
    begin.record()
    for _ in range(iterations):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    seconds = float(begin.elapsed_time(end)) / 1000.0
    return src.numel() * src.element_size() * iterations / seconds / 1e9 if seconds > 0 else 0.0


def parse_cpulist(text: str) -> tuple[int, ...]:
    """sysfs ``local_cpulist`` (``0-3,8-11``) -> CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)
