"""nccl: intra-node all-reduce over every local device, checked element by element and timed.

One process per device joins a torch.distributed process group (NCCL on GPUs, gloo on CPU
stand-ins) and runs a sweep of all-reduce (sum) sizes (gpumon/compute.py ``allreduce_worker``):

- **correctness**: each rank contributes small integers in float32 (a pattern of rank, element and
  seed), so every expected sum is exact; the result is compared element by element before and
  after the timed loop and every wrong element is counted. Any wrong element fails the node
  (``inspect_hardware``: silently wrong sums are the fault that costs most, DESIGN.md "SDC").
- **speed**: per size, the slowest rank's mean time per all-reduce gives
  algbw = bytes / time and busbw = algbw x 2(n-1)/n (nccl-tests doc/PERFORMANCE.md, "AllReduce";
  the same figures ``all_reduce_perf`` prints). On GPUs the best busbw at sizes of at least
  ``judged_from_bytes`` is compared with the profile's ``busbw_min_gbps``. Below it, those sizes
  are measured once more in a fresh process group (bandwidth varies run to run) and only a
  second low result fails; the finding says ``retryable: true``.
- **hangs**: a rank that does not finish within the check's own deadline is killed and named
  with the phase it hung in; once one rank has died or failed, the others (stuck in a collective
  that can no longer complete) get ``peer_failure_grace_s`` before they are killed too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon import compute
from gpumon.check import Check, CheckContext
from gpumon.model import NODE, Action, Finding, Phase, Severity, reading


@dataclass(frozen=True)
class NcclCpu:
    """The gloo sweep on CPU stand-ins (CI): small sizes, a few iterations."""

    devices: int = field(default=4, metadata={"min": 2, "max": 64})
    sizes: list[int] = field(default_factory=lambda: [4 << 10, 256 << 10, 4 << 20])
    iterations: int = field(default=5, metadata={"min": 1})
    warmup: int = field(default=1, metadata={"min": 0})

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 4 for s in self.sizes):
            raise ValueError("cpu.sizes must list sizes of at least 4 bytes")


@dataclass(frozen=True)
class NcclConfig:
    min_bytes: int = field(default=1 << 20, metadata={"min": 4})
    max_bytes: int = field(default=16 << 30, metadata={
        "min": 4,
        "source": "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ "
                  "7e6ac7796e4398d2a6b0b29ca39f1060f0a993cb: check_nccl_allreduce 460.0 1 <topo> 16G "
                  "(one 16 GiB all-reduce)"})
    step_factor: int = field(default=4, metadata={"min": 2})
    iterations: int = field(default=20, metadata={
        "min": 1, "source": "nccl-tests all_reduce_perf defaults: -n 20 iterations, -w 5 warmup"})
    warmup: int = field(default=5, metadata={"min": 0})
    # from the SKU profile (checks.nccl.busbw_min_gbps, with its source there)
    busbw_min_gbps: float | None = field(default=None, metadata={"min": 0})
    judged_from_bytes: int = field(default=16 << 30, metadata={
        "min": 4,
        "source": "the size the profile's reference is measured at (Azure's 16G); smaller all-reduces "
                  "are latency-bound and would fail a healthy node"})
    startup_s: float = field(default=120.0, metadata={
        "min": 1, "source": "argued: process start, CUDA contexts and NCCL communicator setup on 8 GPUs"})
    per_size_s: float = field(default=30.0, metadata={
        "min": 1,
        "source": "argued: a 16 GiB sweep point is ~2 s at 460 GB/s busbw (25 all-reduces + 2 checks) and "
                  "~20 s at 50 GB/s; a sweep and its retry stay inside the check's 900 s timeout"})
    peer_failure_grace_s: float = field(default=15.0, metadata={
        "min": 0, "source": "argued: ranks of a collective whose peer died never finish on their own"})
    cpu: NcclCpu = field(default_factory=NcclCpu)

    def __post_init__(self) -> None:
        if self.min_bytes > self.max_bytes:
            raise ValueError("min_bytes must not exceed max_bytes")

    def sweep(self) -> tuple[int, ...]:
        sizes = []
        size = self.min_bytes
        while size < self.max_bytes:
            sizes.append(size)
            size *= self.step_factor
        sizes.append(self.max_bytes)
        return tuple(sizes)


@dataclass(frozen=True)
class SizeRow:
    """One sweep point over every rank."""

    nbytes: int
    seconds: float  # the slowest rank's mean time per all-reduce
    algbw: float  # GB/s
    busbw: float  # GB/s
    wrong: int
    wrong_by_rank: dict[int, int]
    checked: int


def combine(reports: Sequence[compute.AllReduceReport]) -> list[SizeRow]:
    """Sweep rows from every rank's report: time is the slowest rank's (the collective ends there)."""
    if not reports:
        return []
    world = reports[0].world
    rows = []
    for i, first in enumerate(reports[0].sizes):
        points = [rep.sizes[i] for rep in reports]
        seconds = max(p.seconds for p in points)
        algbw = first.nbytes / seconds / 1e9 if seconds > 0 else 0.0
        rows.append(SizeRow(nbytes=first.nbytes, seconds=seconds, algbw=algbw,
                            busbw=compute.busbw(algbw, world),
                            wrong=sum(p.wrong for p in points),
                            wrong_by_rank={rep.rank: rep.sizes[i].wrong for rep in reports},
                            checked=sum(p.checked for p in points)))
    return rows


def table(rows: Sequence[SizeRow]) -> list[str]:
    """The sweep as all_reduce_perf prints it (size, time, algbw, busbw, #wrong), for the report."""
    out = [f"{'size':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>8}"]
    for r in rows:
        out.append(f"{compute.size_label(r.nbytes):>10} {r.seconds * 1e6:>10.1f} {r.algbw:>12.2f} "
                   f"{r.busbw:>12.2f} {r.wrong:>8}")
    return out


def judged_busbw(rows: Sequence[SizeRow], from_bytes: int) -> float | None:
    """Best busbw among sizes of at least ``from_bytes`` (None: no such size in the sweep)."""
    values = [r.busbw for r in rows if r.nbytes >= from_bytes]
    return max(values) if values else None


@dataclass(frozen=True)
class Sweep:
    """What one check run measured, ready to be judged."""

    rows: list[SizeRow]
    cuda: bool
    labels: dict[int, str]  # rank -> device label
    retry: list[SizeRow] | None = None  # the judged sizes measured again
    note: str = ""
    wall_s: float = 0.0
    waited_for_devices_s: float = 0.0


def verdict(sweep: Sweep, params: NcclConfig, minimum: float | None, source: str | None) -> list[Finding]:
    """The node finding: wrong elements fail outright; busbw is judged on GPUs against ``minimum``."""
    rows = sweep.rows
    name = NcclCheck.name
    evidence: dict[str, Any] = {
        "backend": "nccl" if sweep.cuda else "gloo", "ranks": len(sweep.labels),
        "devices": [sweep.labels[r] for r in sorted(sweep.labels)], "placement": sweep.note,
        "sweep": [{"bytes": r.nbytes, "time_us": round(r.seconds * 1e6, 2),
                   "algbw_gbps": round(r.algbw, 3), "busbw_gbps": round(r.busbw, 3), "wrong": r.wrong}
                  for r in rows],
        "table": table(rows), "wall_s": round(sweep.wall_s, 2),
        "waited_for_devices_s": round(sweep.waited_for_devices_s, 2),
        "readings": [reading("nccl_allreduce_busbw_gbps", rows[-1].busbw, bytes=rows[-1].nbytes)],
    }
    if sweep.retry is not None:
        evidence["retry_table"] = table(sweep.retry)
    wrong = _wrong(rows)
    if wrong:
        by_device: dict[str, int] = {}
        for r in rows:
            for rank, n in r.wrong_by_rank.items():
                if n:
                    label = sweep.labels.get(rank, f"rank {rank}")
                    by_device[label] = by_device.get(label, 0) + n
        sizes = ", ".join(compute.size_label(r.nbytes) for r in rows if r.wrong)
        checked = sum(r.checked for r in rows)
        return [Finding(name, NODE, Severity.FAIL,
                        f"all-reduce gave {wrong} wrong element(s) of {checked} checked exact integer sums "
                        f"(at {sizes}); seen on {', '.join(sorted(by_device))}",
                        Action.INSPECT_HARDWARE if sweep.cuda else Action.NONE,
                        {**evidence, "wrong": wrong, "checked": checked, "wrong_by_device": by_device,
                         "retryable": False})]
    top = rows[-1]
    measured = judged_busbw(rows, params.judged_from_bytes)
    if sweep.retry is not None:
        again = judged_busbw(sweep.retry, params.judged_from_bytes)
        if again is not None and (measured is None or again > measured):
            measured = again
    if not sweep.cuda or minimum is None or measured is None:
        why = ("CPU stand-ins: no profile reference" if not sweep.cuda
               else "no busbw_min_gbps in the profile" if minimum is None
               else f"no size of at least {compute.size_label(params.judged_from_bytes)} in the sweep")
        return [Finding(name, NODE, Severity.OK,
                        f"all-reduce over {len(sweep.labels)} device(s) exact; busbw {top.busbw:.4g} GB/s at "
                        f"{compute.size_label(top.nbytes)} (not judged: {why})", Action.NONE, evidence)]
    attempts = 2 if sweep.retry is not None else 1
    evidence.update(busbw_min_gbps=minimum, judged_busbw_gbps=round(measured, 3), source=source,
                    retryable=True, attempts=attempts)
    if measured < minimum:
        twice = "; low again on a second measurement" if attempts > 1 else ""
        return [Finding(name, NODE, Severity.FAIL,
                        f"all-reduce busbw {measured:.4g} GB/s is below the profile's {minimum:g} "
                        f"(sizes >= {compute.size_label(params.judged_from_bytes)}{twice})",
                        Action.REBOOT_NODE, evidence)]
    return [Finding(name, NODE, Severity.OK,
                    f"all-reduce over {len(sweep.labels)} GPUs exact; busbw {measured:.4g} GB/s "
                    f"(profile minimum {minimum:g})", Action.NONE, evidence)]


def worker_failures(run: compute.WorkerRun, cuda: bool, by_uuid: Mapping[str, int]) -> list[Finding]:
    """A rank that died or hung: the dead ones are the cause, the hung ones waited for them."""
    name = NcclCheck.name
    kind = "cuda" if cuda else "cpu"
    out: list[Finding] = []
    dead = [o for o in run.failed if o.state in ("died", "error")]
    hung = [o for o in run.failed if o.state in ("hung", "stuck")]
    for o in dead:
        dev = compute.device_name(o.identity, by_uuid, rank=o.rank, kind=kind)
        if cuda and dev.gpu_index is not None:
            out.append(Finding(name, dev.component, Severity.FAIL,
                               f"all-reduce worker on {dev.label}: {o.describe()}", Action.RESET_GPU,
                               {"phase": o.phase, "error": o.error[-2000:]}))
    if hung and dead:
        why = f"{len(hung)} rank(s) hung after a peer failed"
    elif hung:
        why = f"all-reduce hung on {len(hung)} of {len(run.outcomes)} rank(s)"
    else:
        why = f"{len(dead)} rank(s) failed"
    # a collective that hangs with every rank alive points at the interconnect, not one GPU
    action = (Action.REBOOT_NODE if hung and not dead else Action.RESET_GPU) if cuda else Action.NONE
    severity = Severity.FAIL if cuda or hung else Severity.UNKNOWN
    workers = [{"rank": o.rank, "state": o.state, "phase": o.phase, "device": o.identity.get("device"),
                "seconds": round(o.seconds, 1)} for o in run.outcomes]
    out.append(Finding(name, NODE, severity, f"{why}: " + "; ".join(o.describe() for o in run.failed), action,
                       {"workers": workers, "wall_s": round(run.wall_s, 1)}))
    return out


class NcclCheck(Check):
    name = "nccl"
    phase = Phase.BOOTSTRAP
    description = ("intra-node all-reduce over every GPU (NCCL; gloo on CPU): exact integer sums checked "
                   "element by element, algbw/busbw per size, busbw vs the profile")
    interval = 86400.0
    # seconds a healthy run takes (suite order and ETA), an estimate, not measured:
    # a 1 MiB..16 GiB sweep on 8 GPUs plus start-up
    cost = 30.0
    timeout = 900.0
    Config = NcclConfig

    def supported(self, inventory: Any) -> str | None:
        return compute.torch_missing()

    def run(self, ctx: CheckContext) -> list[Finding]:
        params: NcclConfig = ctx.params or NcclConfig()
        try:
            place = compute.placement(params.cpu.devices, nvml_gpus=len(ctx.inventory.gpus),
                                      simulated=ctx.hw.simulated)
        except compute.NoCudaOnGpuNode as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"GPUs not tested: {exc}")]
        if place.devices < 2:
            return [self.finding(NODE, Severity.SKIPPED,
                                 f"an all-reduce needs at least 2 devices; {place.note}")]
        if place.is_cuda:
            sizes, iterations, warmup = params.sweep(), params.iterations, params.warmup
        else:
            sizes, iterations, warmup = tuple(params.cpu.sizes), params.cpu.iterations, params.cpu.warmup
        by_uuid = compute.gpu_index_by_uuid(ctx.inventory)
        minimum = params.busbw_min_gbps if place.is_cuda else None
        try:
            first = measure(place, sizes, iterations, warmup, params)
            if first.failed:
                return worker_failures(first, place.is_cuda, by_uuid)
            rows = combine(first.results)
            retry: list[SizeRow] | None = None
            measured = judged_busbw(rows, params.judged_from_bytes)
            if minimum is not None and measured is not None and measured < minimum and not _wrong(rows):
                # bandwidth varies run to run: measure the judged sizes once more before failing
                judged = tuple(r.nbytes for r in rows if r.nbytes >= params.judged_from_bytes)
                again = measure(place, judged, iterations, warmup, params)
                if again.failed:
                    return worker_failures(again, place.is_cuda, by_uuid)
                retry = combine(again.results)
        except compute.DevicesBusy as exc:
            return [self.finding(NODE, Severity.UNKNOWN, str(exc))]
        labels = {o.rank: compute.device_name(o.identity, by_uuid, rank=o.rank, kind=place.kind).label
                  for o in first.outcomes}
        sweep = Sweep(rows, place.is_cuda, labels, retry, place.note, first.wall_s,
                      first.waited_for_devices_s)
        return verdict(sweep, params, minimum, ctx.profile.source_of("checks.nccl.busbw_min_gbps"))


def measure(place: compute.Placement, sizes: tuple[int, ...], iterations: int, warmup: int,
            params: NcclConfig) -> compute.WorkerRun:
    """One all-reduce sweep on every device, in a fresh process group (rendezvous file removed after)."""
    store_dir = tempfile.mkdtemp(prefix="gpumon-nccl-")
    try:
        deadline = params.startup_s + params.per_size_s * len(sizes)
        spec = compute.AllReduceSpec(backend="nccl" if place.is_cuda else "gloo",
                                     store_path=os.path.join(store_dir, "store"), sizes=sizes,
                                     iterations=iterations, warmup=warmup, timeout_s=deadline)
        # the first sweep and a retry of the judged sizes both fit in the check's time budget
        budget = 2 * deadline
        return compute.run_workers(compute.allreduce_worker, [spec] * place.devices, kind=place.kind,
                                   timeout_s=deadline, peer_failure_grace_s=params.peer_failure_grace_s,
                                   name=NcclCheck.name,
                                   lock_wait_s=compute.lock_wait(NcclCheck.timeout, budget))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(store_dir)


def _wrong(rows: Sequence[SizeRow]) -> int:
    return sum(r.wrong for r in rows)
