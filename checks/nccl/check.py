"""nccl: intra-node all-reduce over every local device, checked element by element and timed.

One process per device joins a torch.distributed process group (NCCL on GPUs, gloo on CPU
stand-ins) and runs a sweep of all-reduce (sum) sizes (kernels.py ``allreduce_worker``):

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
- **nccl-tests**: with ``nccl_tests`` (``auto``: on CUDA nodes where ``all_reduce_perf`` is on the
  tool path), the tool measures instead and its rows are judged by the same ``verdict``; its ``-b``
  is chosen so that its x``step_factor`` series ends on ``max_bytes``. A tool that ends without a
  result to judge (a rank died, its output was cut off) leaves the node to the torch sweep, with
  the tool's failure in every finding's evidence; a hung tool fails the node. Never on a simulated
  node (it would measure the machine's real GPUs). On GPUs with a profile minimum, a sweep with no
  size of at least ``judged_from_bytes`` (the tool lowered its maxBytes for memory) is unknown.
- **simulated nodes**: one gloo rank per simulated GPU; a GPU whose device model corrupts its
  all-reduce results (the placement's fault model) is the only rank with wrong sums, and is named.
- **hangs**: a rank that does not finish within the check's own deadline is killed and named
  with the phase it hung in; once one rank has died or failed, the others (stuck in a collective
  that can no longer complete) get ``peer_failure_grace_s`` before they are killed too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon import workers
from gpumon.check import Check, CheckContext, condition_finding
from gpumon.errors import HwTimeout
from gpumon.hw import nccltests, placement
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

NCCL_TESTS_MODES = ("auto", "always", "never")


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
    # nccl-tests' all_reduce_perf is NVIDIA's own reference for these figures (the profile's busbw
    # floor was measured with it). It still needs torch in the agent: the check is gated on torch
    # (supported()) and torch's CUDA count is the tool's -g. The torch sweep stays for nodes without
    # the tool, for CPU stand-ins and simulated nodes (the tool would measure the machine's real
    # GPUs), and as the fallback when the tool fails without a verdict (a dead rank is named there)
    nccl_tests: str = field(default="auto", metadata={
        "choices": NCCL_TESTS_MODES,
        "source": "auto: all_reduce_perf when torch sees CUDA devices and the tool is on the tool path, "
                  "else the torch sweep; always: the tool whenever it is found (skipped when it is not); "
                  "with either, the torch sweep when the tool fails without a result to judge (not when "
                  "it hangs or counts wrong elements) and on a simulated node, where the tool never runs; "
                  "never: the torch sweep only"})

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


def combine(reports: Sequence[kernels.AllReduceReport]) -> list[SizeRow]:
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
                            busbw=kernels.busbw(algbw, world),
                            wrong=sum(p.wrong for p in points),
                            wrong_by_rank={rep.rank: rep.sizes[i].wrong for rep in reports},
                            checked=sum(p.checked for p in points)))
    return rows


def table(rows: Sequence[SizeRow]) -> list[str]:
    """The sweep as all_reduce_perf prints it (size, time, algbw, busbw, #wrong), for the report."""
    out = [f"{'size':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>8}"]
    for r in rows:
        out.append(f"{kernels.size_label(r.nbytes):>10} {r.seconds * 1e6:>10.1f} {r.algbw:>12.2f} "
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
    as_gpu: bool = False  # the devices are GPUs (real or simulated): GPU components and remedies
    gpu_of: dict[int, int] = field(default_factory=dict)  # rank -> NVML index of its GPU


def verdict(sweep: Sweep, options: NcclConfig, minimum: float | None, source: str | None) -> list[Finding]:
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
        "readings": [reading("nccl_allreduce_busbw_bytes_per_second", rows[-1].busbw * 1e9,
                             message_bytes=rows[-1].nbytes)],
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
        sizes = ", ".join(kernels.size_label(r.nbytes) for r in rows if r.wrong)
        checked = sum(r.checked for r in rows)
        gpus = sweep.cuda or sweep.as_gpu
        message = (f"all-reduce gave {wrong} wrong element(s) of {checked} checked exact integer sums "
                   f"(at {sizes}); seen on {', '.join(sorted(by_device))}")
        component = NODE
        ranks = {rank for r in rows for rank, n in r.wrong_by_rank.items() if n}
        if len(ranks) == 1 and len(sweep.labels) > 2:
            message += " only; every other rank's sums were exact"
            rank = next(iter(ranks))
            sizes_wrong = sum(1 for r in rows if r.wrong_by_rank.get(rank))
            # Only this GPU received wrong sums, again and again: the fault is on its side (its memory
            # or its receive path). Once is not enough: in a ring the last hop's data goes no further,
            # so one flip on the link into this GPU, or in its neighbour's send path, also shows here
            # alone.
            if gpus and sizes_wrong >= 2 and rank in sweep.gpu_of:
                component = gpu(sweep.gpu_of[rank])
            else:
                message += (f" (at {sizes_wrong} size(s): too few to tell this GPU from the link into it)"
                            if gpus else "")
        return [Finding(name, component, Severity.FAIL, message,
                        Action.INSPECT_HARDWARE if gpus else Action.NONE,
                        {**evidence, "wrong": wrong, "checked": checked, "wrong_by_device": by_device,
                         "retryable": False})]
    top = rows[-1]
    measured = judged_busbw(rows, options.judged_from_bytes)
    if sweep.retry is not None:
        again = judged_busbw(sweep.retry, options.judged_from_bytes)
        if again is not None and (measured is None or again > measured):
            measured = again
    if sweep.cuda and minimum is not None and measured is None:
        # a floor that was never measured against is no pass: the tool lowered its largest size for
        # lack of memory, or the configured sweep stops below the size the floor is for
        judged = kernels.size_label(options.judged_from_bytes)
        largest = max(r.nbytes for r in [*rows, *(sweep.retry or [])])
        evidence.update(busbw_min_gbps=minimum, judged_from_bytes=options.judged_from_bytes, source=source)
        return [Finding(name, NODE, Severity.UNKNOWN,
                        f"all-reduce over {len(sweep.labels)} GPUs exact, but busbw not judged: the "
                        f"profile's minimum {minimum:g} GB/s is for sizes >= {judged} and the largest size "
                        f"measured was {kernels.size_label(largest)}", Action.NONE, evidence)]
    if not sweep.cuda or minimum is None or measured is None:
        why = ("CPU stand-ins: no profile reference" if not sweep.cuda
               else "no busbw_min_gbps in the profile")
        return [Finding(name, NODE, Severity.OK,
                        f"all-reduce over {len(sweep.labels)} device(s) exact; busbw {top.busbw:.4g} GB/s at "
                        f"{kernels.size_label(top.nbytes)} (not judged: {why})", Action.NONE, evidence)]
    attempts = 2 if sweep.retry is not None else 1
    evidence.update(busbw_min_gbps=minimum, judged_busbw_gbps=round(measured, 3), source=source,
                    retryable=True, attempts=attempts)
    if measured < minimum:
        twice = "; low again on a second measurement" if attempts > 1 else ""
        return [Finding(name, NODE, Severity.FAIL,
                        f"all-reduce busbw {measured:.4g} GB/s is below the profile's {minimum:g} "
                        f"(sizes >= {kernels.size_label(options.judged_from_bytes)}{twice})",
                        Action.REBOOT_NODE, evidence)]
    return [Finding(name, NODE, Severity.OK,
                    f"all-reduce over {len(sweep.labels)} GPUs exact; busbw {measured:.4g} GB/s "
                    f"(profile minimum {minimum:g})", Action.NONE, evidence)]


def worker_failures(run: workers.WorkerRun, cuda: bool, by_uuid: Mapping[str, int]) -> list[Finding]:
    """A rank that died or hung: the dead ones are the cause, the hung ones waited for them."""
    name = NcclCheck.name
    kind = "cuda" if cuda else "cpu"
    out: list[Finding] = []
    dead = [o for o in run.failed if o.state in ("died", "error")]
    hung = [o for o in run.failed if o.state in ("hung", "stuck")]
    for o in dead:
        dev = workers.device_name(o.identity, by_uuid, rank=o.rank, kind=kind)
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
    ranks = [{"rank": o.rank, "state": o.state, "phase": o.phase, "device": o.identity.get("device"),
              "seconds": round(o.seconds, 1)} for o in run.outcomes]
    out.append(Finding(name, NODE, severity, f"{why}: " + "; ".join(o.describe() for o in run.failed), action,
                       {"workers": ranks, "wall_s": round(run.wall_s, 1)}))
    return out


class NcclCheck(Check):
    name = "nccl"
    phase = Phase.BOOTSTRAP
    description = ("intra-node all-reduce over every GPU (NCCL; gloo on CPU): exact integer sums checked "
                   "element by element, algbw/busbw per size, busbw vs the profile")
    readings = (
        ReadingSpec(
            "nccl_allreduce_busbw_bytes_per_second", "gauge",
            "All-reduce bus bandwidth over every local GPU at the largest size of the last nccl run (label "
            "message_bytes: that message size in bytes); busbw = algbw x 2(n-1)/n as nccl-tests defines it.",
            unit=UNIT_BYTES_PER_SECOND,
            source="gpumon's torch.distributed all-reduce sweep, or nccl-tests' all_reduce_perf where it is "
                   "used",
            labels=("message_bytes",)),
    )
    # seconds a healthy run takes (suite order and ETA), an estimate, not measured:
    # a 1 MiB..16 GiB sweep on 8 GPUs plus start-up
    cost = 30.0
    timeout = 900.0
    Config = NcclConfig

    def supported(self, inventory: Inventory) -> str | None:
        return workers.torch_missing()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(NcclConfig)
        started = time.monotonic()
        by_tool = nccl_tests_findings(ctx, options)
        if isinstance(by_tool, list):
            return by_tool
        if by_tool is not None:
            # a tool that failed late leaves too little of the check's budget for a full torch sweep
            # and its retry: say so rather than be killed as hung half-way through
            spent = time.monotonic() - started
            need = 2 * (options.startup_s + options.per_size_s * len(options.sweep()))
            if spent + need > self.timeout - 30.0:
                return by_tool.annotate([Finding(
                    self.name, NODE, Severity.UNKNOWN,
                    f"all-reduce not measured: nccl-tests failed after {spent:.0f} s and a torch sweep "
                    f"(up to {need:.0f} s) would not fit the check's {self.timeout:.0f} s budget",
                    Action.NONE, {})])
        found = torch_findings(ctx, options)
        return found if by_tool is None else by_tool.annotate(found)


def torch_findings(ctx: CheckContext, options: NcclConfig) -> list[Finding]:
    """The torch sweep: one process per device, the judged sizes measured again before a low busbw fails."""
    name = NcclCheck.name
    try:
        place = ctx.hw.devices.place(ctx.inventory, options.cpu.devices)
    except placement.NoCudaOnGpuNode as exc:
        return [Finding(name, NODE, Severity.UNKNOWN, f"GPUs not tested: {exc}", Action.NONE, {})]
    if place.devices < 2:
        return [Finding(name, NODE, Severity.SKIPPED, f"an all-reduce needs at least 2 devices; {place.note}",
                        Action.NONE, {})]
    if place.is_cuda:
        sizes, iterations, warmup = options.sweep(), options.iterations, options.warmup
    else:
        sizes, iterations, warmup = tuple(options.cpu.sizes), options.cpu.iterations, options.cpu.warmup
    by_uuid = workers.gpu_index_by_uuid(ctx.inventory)
    minimum = options.busbw_min_gbps if place.is_cuda else None
    try:
        first = measure(place, sizes, iterations, warmup, options)
        if first.failed:
            return worker_failures(first, place.is_cuda, by_uuid)
        rows = combine(first.results)
        retry: list[SizeRow] | None = None
        measured = judged_busbw(rows, options.judged_from_bytes)
        if minimum is not None and measured is not None and measured < minimum and not _wrong(rows):
            # bandwidth varies run to run: measure the judged sizes once more before failing
            judged = tuple(r.nbytes for r in rows if r.nbytes >= options.judged_from_bytes)
            again = measure(place, judged, iterations, warmup, options)
            if again.failed:
                return worker_failures(again, place.is_cuda, by_uuid)
            retry = combine(again.results)
    except workers.DevicesBusy as exc:
        return [Finding(name, NODE, Severity.UNKNOWN, str(exc), Action.NONE, {})]
    labels = {o.rank: workers.device_name(o.identity, by_uuid, rank=o.rank, kind=place.kind).label
              for o in first.outcomes}
    gpu_of = {o.rank: n.gpu_index for o in first.outcomes
              if (n := workers.device_name(o.identity, by_uuid, rank=o.rank, kind=place.kind)).gpu_index
              is not None}
    sweep = Sweep(rows, place.is_cuda, labels, retry, place.note, first.wall_s,
                  first.waited_for_devices_s, as_gpu=place.names_gpus, gpu_of=gpu_of)
    return verdict(sweep, options, minimum, ctx.profile.source_of("checks.nccl.busbw_min_gbps"))


def measure(place: placement.Placement, sizes: tuple[int, ...], iterations: int, warmup: int,
            options: NcclConfig) -> workers.WorkerRun:
    """One all-reduce sweep on every device, in a fresh process group (rendezvous file removed after)."""
    store_dir = tempfile.mkdtemp(prefix="gpumon-nccl-")
    try:
        deadline = options.startup_s + options.per_size_s * len(sizes)
        spec = kernels.AllReduceSpec(backend="nccl" if place.is_cuda else "gloo",
                                     store_path=os.path.join(store_dir, "store"), sizes=sizes,
                                     iterations=iterations, warmup=warmup, timeout_s=deadline)
        # the first sweep and a retry of the judged sizes both fit in the check's time budget
        budget = 2 * deadline
        return workers.run_workers(kernels.allreduce_worker, [spec] * place.devices, kind=place.kind,
                                   timeout_s=deadline, peer_failure_grace_s=options.peer_failure_grace_s,
                                   name=NcclCheck.name,
                                   lock_wait_s=workers.lock_wait(NcclCheck.timeout, budget),
                                   stand_ins=place.stand_ins, faults=place.faults)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(store_dir)


def _wrong(rows: Sequence[SizeRow]) -> int:
    return sum(r.wrong for r in rows)


# ------------------------------------------------------------------ nccl-tests' all_reduce_perf

MEASURED_BY_TOOL = "nccl-tests all_reduce_perf"
TOOL = nccltests.ALL_REDUCE_PERF


@dataclass(frozen=True)
class TorchInstead:
    """The torch sweep measures although ``nccl_tests`` chose the tool: why, for the torch findings."""

    evidence: dict[str, Any]
    message: str = ""  # said after the node finding's own message

    def annotate(self, findings: Sequence[Finding]) -> list[Finding]:
        """Every finding gets the evidence; the node finding (else every finding) the message."""
        has_node = any(f.component == NODE for f in findings)
        out = []
        for f in findings:
            message = f.message
            if self.message and (f.component == NODE or not has_node):
                message = f"{message} ({self.message})"
            out.append(dataclasses.replace(f, message=message, evidence={**f.evidence, **self.evidence}))
        return out


def nccl_tests_findings(ctx: CheckContext, options: NcclConfig) -> list[Finding] | TorchInstead | None:
    """The check measured with ``all_reduce_perf`` as ``nccl_tests`` says, or None (TorchInstead:
    with the reason to give): torch measures.

    The tool's figures go through the same judgement as the torch sweep's (``verdict``): its rows
    become ``SizeRow`` records, the judged sizes are measured once more (a second run of the tool
    over just those sizes) before a low busbw fails. Wrong elements (``#wrong``, or the
    ``Out of bounds values`` footer of builds without that column) fail at once, and a hung tool
    fails the node; a tool that ends without a result to judge (a rank died on a CUDA error, the
    output was cut off) leaves the measurement to the torch sweep, which names a dead rank's GPU.
    """
    mode = options.nccl_tests
    if mode == "never":
        return None
    if mode not in NCCL_TESTS_MODES:
        return [_tool_finding(Severity.UNKNOWN, f"checks.nccl.nccl_tests must be one of "
                              f"{', '.join(NCCL_TESTS_MODES)}; got {mode!r}")]
    if not ctx.hw.devices.tools_measure_gpus:
        # the tool would run on this machine's own GPUs and be judged as the node's GPUs (CPU
        # workers stand in for those)
        return None if mode == "auto" else TorchInstead({"nccl_tests_not_used": (
            f"checks.nccl.nccl_tests is 'always', but {TOOL} is not used on a {ctx.hw.devices.describe()}: "
            "it would measure this machine's real GPUs; the torch sweep's stand-ins for the "
            f"{ctx.hw.devices.describe().split()[0]} GPUs measured")})
    if ctx.hw.tools.which(TOOL) is None:
        if mode == "auto":
            return None
        return [_tool_finding(Severity.SKIPPED, f"nccl-tests' {TOOL} is not installed (not found on the "
                              "tool path) and checks.nccl.nccl_tests is 'always': all-reduce not measured")]
    gpus = _tool_gpus(ctx, options, mode)
    if gpus is None:
        return None
    count, note = gpus
    if count == 1:
        return [_tool_finding(Severity.SKIPPED, f"an all-reduce needs at least 2 devices; {note}")]
    start, start_note = nccltests.sweep_start(options.min_bytes, options.max_bytes, options.step_factor)
    # no GPU seen at all ('always'): nccl-tests' own default of one GPU, so that the tool says in
    # its own words why it cannot run here
    spec = nccltests.PerfSpec(start, options.max_bytes, options.step_factor, max(count, 1),
                              options.iterations, options.warmup)
    try:
        # the tool loads every GPU: not while another compute check runs
        with workers.devices_held(NcclCheck.name, workers.lock_wait(NcclCheck.timeout,
                                                                   2 * _tool_deadline(options, spec))):
            found = measure_with_tool(ctx, options, spec, note)
    except workers.DevicesBusy as exc:
        return [NcclCheck().finding(NODE, Severity.UNKNOWN, str(exc))]
    if start_note is None:
        return found
    if isinstance(found, TorchInstead):
        return dataclasses.replace(found, evidence={**found.evidence, "sweep_start_note": start_note})
    return [dataclasses.replace(f, evidence={**f.evidence, "sweep_start_note": start_note}) for f in found]


def _tool_gpus(ctx: CheckContext, options: NcclConfig, mode: str) -> tuple[int, str] | None:
    """How many GPUs to give the tool (``-g``) and why; None where 'auto' leaves it to torch.

    CUDA's count first: the tool sees the same CUDA devices (CUDA_VISIBLE_DEVICES included),
    which NVML's count ignores. Only where the tool measures the GPUs NVML reports.
    """
    nvml = len(ctx.inventory.gpus)
    try:
        place = ctx.hw.devices.place(ctx.inventory, options.cpu.devices)
    except placement.NoCudaOnGpuNode as exc:
        # 'auto': the torch path says the same as an unknown finding
        return None if mode == "auto" else (nvml, str(exc))
    if place.is_cuda:
        return place.devices, place.note
    if mode == "auto":
        return None
    return 0, "no GPU seen by torch or NVML"


def _tool_deadline(options: NcclConfig, spec: nccltests.PerfSpec) -> float:
    # the torch sweep's budget for the same sizes: start-up, then each size
    return options.startup_s + options.per_size_s * max(1, len(spec.sizes()))


def measure_with_tool(ctx: CheckContext, options: NcclConfig, spec: nccltests.PerfSpec,
                      note: str) -> list[Finding] | TorchInstead:
    """Run the sweep (and, when busbw is low, the judged sizes again) and judge it as ``verdict`` does;
    TorchInstead where a run gave nothing that can be judged."""
    first = nccltests.run_all_reduce_perf(ctx.hw.tools, spec, timeout=_tool_deadline(options, spec))
    rows = tool_rows(first, spec)
    if isinstance(rows, Finding):
        return _fall_back(rows, first) if rows.severity is Severity.UNKNOWN else [rows]
    minimum = options.busbw_min_gbps
    retry: list[SizeRow] | None = None
    again: nccltests.PerfRun | None = None
    measured = judged_busbw(rows, options.judged_from_bytes)
    if minimum is not None and measured is not None and measured < minimum:
        # bandwidth varies run to run: measure the judged sizes once more before failing
        judged = [r.nbytes for r in rows if r.nbytes >= options.judged_from_bytes]
        again_spec = dataclasses.replace(spec, min_bytes=min(judged), max_bytes=max(judged))
        again = nccltests.run_all_reduce_perf(ctx.hw.tools, again_spec,
                                              timeout=_tool_deadline(options, again_spec))
        retried = tool_rows(again, again_spec, first=first)
        if isinstance(retried, Finding):
            return _fall_back(retried, again, first) if retried.severity is Severity.UNKNOWN else [retried]
        retry = retried
    assert first.result is not None  # tool_rows answered a Finding otherwise
    labels = tool_labels(first.result, ctx, spec.gpus)
    sweep = Sweep(rows, True, labels, retry, f"all_reduce_perf -g {spec.gpus}: {note}", first.seconds)
    extra = _tool_evidence(first, again)
    if len(labels) != spec.gpus:
        extra["ranks_note"] = f"the tool ran {len(labels)} rank(s) where -g asked for {spec.gpus}"
    reduced = first.result.reduced_max_bytes
    if reduced is not None:
        extra["nccl_tests_reduced_max_bytes"] = reduced
    found = verdict(sweep, options, minimum, ctx.profile.source_of("checks.nccl.busbw_min_gbps"))
    return [dataclasses.replace(f, evidence={**f.evidence, **extra}, message=f.message + (
                f" ({TOOL} lowered its largest size to {kernels.size_label(reduced)} for lack of GPU "
                "memory: 'Reducing maxBytes ... due to memory limitation')"
                if reduced is not None and f.severity is Severity.UNKNOWN else ""))
            for f in found]


def _fall_back(failed: Finding, run: nccltests.PerfRun,
               first: nccltests.PerfRun | None = None) -> TorchInstead:
    """The tool ran but gave nothing to judge (a rank died, its output was cut off): torch measures,
    and every torch finding carries what the tool said."""
    said: dict[str, Any] = {"message": failed.message, "command": run.command, "exit_status": run.returncode,
                            "last_lines": list(run.tail)}
    if first is not None:  # the re-measurement failed: the sweep it re-measured, too
        said.update(first_command=first.command, first_nccl_tests_table=list(first.table))
    return TorchInstead({"nccl_tests_failed": said},
                        f"nccl-tests' {TOOL} failed, so the torch sweep measured instead: {failed.message}")


def tool_rows(run: nccltests.PerfRun, spec: nccltests.PerfSpec,
              first: nccltests.PerfRun | None = None) -> list[SizeRow] | Finding:
    """The run's rows as the torch sweep's records, or the finding that stops it from being judged.

    An ``unknown`` finding means the tool gave nothing that can be judged (cut off, a failing exit
    status, no table, could not start, no correctness counts): ``measure_with_tool`` then leaves the
    node to the torch sweep. A hang and wrong elements are verdicts (``fail``), fewer than two
    ranks is ``skipped``. ``first``: the sweep this run re-measures (its evidence goes with a
    failure of the retry).
    """
    evidence = _tool_evidence(first, run) if first is not None else _tool_evidence(run, None)
    again = " (re-measuring the judged sizes)" if first is not None else ""
    cond = run.condition
    if isinstance(cond, HwTimeout):
        # as a hung torch collective with every rank alive: the interconnect, not one GPU
        return _tool_finding(Severity.FAIL, f"{TOOL} hung{again}: {cond}",
                             Action.REBOOT_NODE, call=cond.call, timeout_s=cond.seconds, **evidence)
    if cond is not None:
        found = condition_finding(NcclCheck.name, cond, NODE)
        return dataclasses.replace(found, evidence={**found.evidence, **evidence})
    result = run.result
    if result is not None:
        wrong = tool_wrong(result)
        if wrong is not None:
            return _tool_finding(Severity.FAIL, f"{TOOL} found {wrong}{again}",
                                 Action.INSPECT_HARDWARE, retryable=False, **evidence)
    if result is None or run.problem is not None:
        return _tool_finding(Severity.UNKNOWN, f"{TOOL} gave no result that can be "
                             f"judged{again}: {run.problem}", **evidence)
    if result.settings.get("validation") == "0" or (not result.legacy and result.wrong_elements is None):
        return _tool_finding(Severity.UNKNOWN, f"{TOOL} did not check its results (#wrong is N/A "
                             "although -c 1 was given): correctness not known", **evidence)
    ranks = len(result.ranks) or spec.gpus
    if ranks < 2:
        return _tool_finding(Severity.SKIPPED, f"an all-reduce needs at least 2 devices; "
                             f"{TOOL} ran on {ranks}", **evidence)
    rows: list[SizeRow] = []
    for row in result.rows:
        size_row = _size_row(row)
        if size_row is None:
            return _tool_finding(Severity.UNKNOWN, f"{TOOL} printed no usable time and bandwidth "
                                 f"for {kernels.size_label(row.size)}{again}", **evidence)
        rows.append(size_row)
    return rows


def tool_wrong(result: nccltests.NcclResult) -> str | None:
    """Words for the wrong elements the tool counted, or None when it counted none."""
    rows = result.wrong_elements or 0
    oob = result.out_of_bounds or 0
    if not rows and not oob and result.out_of_bounds_ok is not False:
        return None
    sizes = ", ".join(kernels.size_label(r.size) for r in result.rows if r.wrong)
    parts = [f"{max(rows, oob)} wrong element(s) in the all-reduce results"]
    if sizes:
        parts.append(f"at {sizes}")
    if result.out_of_bounds is not None:
        parts.append(f"'Out of bounds values : {result.out_of_bounds} "
                     f"{'OK' if result.out_of_bounds_ok else 'FAILED'}'")
    return parts[0] + (f" ({'; '.join(parts[1:])})" if parts[1:] else "")


def _size_row(row: nccltests.NcclRow) -> SizeRow | None:
    """One row as a sweep point: the better half (in-place and out-of-place cross the same links)."""
    best: tuple[float, float, float] | None = None
    for half in (row.out_of_place, row.in_place):
        if half.time_us is None or half.algbw_gbs is None or half.busbw_gbs is None:
            continue
        if min(half.time_us, half.algbw_gbs, half.busbw_gbs) < 0:
            return None
        if best is None or half.busbw_gbs > best[2]:
            best = (half.time_us / 1e6, half.algbw_gbs, half.busbw_gbs)
    if best is None:
        return None
    seconds, algbw, busbw = best
    # nccl-tests names no rank and prints no count of checked elements
    return SizeRow(row.size, seconds, algbw, busbw, row.wrong or 0, {}, 0)


def _bus_key(bus_id: str) -> tuple[int, int, int] | None:
    """``0000:04:00`` (nccl-tests) and ``00000000:04:00.0`` (NVML) as one key."""
    parts = bus_id.strip().lower().split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return domain, bus, device


def tool_labels(result: nccltests.NcclResult, ctx: CheckContext, gpus: int) -> dict[int, str]:
    """Rank -> the GPU NVML knows at the bus id the tool printed (one host), else the tool's words."""
    by_bus = {_bus_key(g.pci_bus_id): g.index for g in ctx.inventory.gpus}
    one_host = len({r.host for r in result.ranks}) == 1
    out: dict[int, str] = {}
    for r in result.ranks:
        index = by_bus.get(_bus_key(r.bus_id)) if one_host else None
        out[r.rank] = (f"GPU {index}" if index is not None
                       else f"{r.host} cuda:{r.device} [{r.bus_id}] {r.name}".strip())
    return out or {rank: f"cuda:{rank}" for rank in range(gpus)}


def _tool_evidence(run: nccltests.PerfRun, again: nccltests.PerfRun | None) -> dict[str, Any]:
    ev: dict[str, Any] = {"measured_by": MEASURED_BY_TOOL, "command": run.command,
                          "nccl_tests_table": list(run.table)}
    if run.result is not None:
        ev.update(nccl_tests_version=run.result.version, nccl_tests_avg_busbw_gbps=run.result.avg_busbw_gbs,
                  out_of_bounds=run.result.out_of_bounds)
    if run.returncode is not None:
        ev["exit_status"] = run.returncode
    if again is not None:
        ev.update(retry_command=again.command, retry_nccl_tests_table=list(again.table))
    return ev


def _tool_finding(severity: Severity, message: str, action: Action = Action.NONE, **evidence: Any) -> Finding:
    return Finding(NcclCheck.name, NODE, severity, message, action,
                   {"measured_by": MEASURED_BY_TOOL, **evidence})
