"""Run canary workloads on every device at once, compare with the golden and across devices.

Each worker is a process of the one worker pool (gpumon/workers.py: its process start method and
its device lock, held while the workers live) owning one device (``cuda:<i>``; on a machine without GPUs, the
CPU, with the worker index standing in for the GPU index). All workers run the same iteration at
the same time, so every GPU is hot while it computes (marginal units fail warm), then the parent
compares:

- with the golden of the worker's key, when there is one;
- with the other workers of the same key: a strict majority names the dissenting workers even
  without a golden; without a strict majority the result is ``unknown`` with the split.

A worker that differs keeps its run's tensors on the device until the parent has decided, so the
failing run (and one agreeing run to compare with) can be written as a replay bundle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import os
import re
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpumon import workers as pool
from gpumon.sdc.bundle import workload_from_bundle, workload_name, write_failure_manifest
from gpumon.sdc.golden import DeviceKey, Diff, Golden, GoldenKey, device_key, first_difference, majority
from gpumon.sdc.inject import FaultInjector, FaultSpec
from gpumon.sdc.workloads import (
    WORKLOAD_NAMES,
    Workload,
    WorkloadRun,
    builtin_workloads,
    deterministic,
    run_workload,
)

log = logging.getLogger("gpumon.sdc")

CHECK = "sdc_canary"


class CanaryError(Exception):
    """The canary could not run (no such workload, bad bundle, no device)."""


@dataclass(frozen=True)
class Options:
    """What to run, where, and what to compare with."""

    workers: int
    iterations: int = 1
    workloads: Sequence[str] = ()  # built-in names; empty: all of them (unless bundles are given)
    bundles: Sequence[Path] = ()  # captured steps (gpumon.sdc.capture) run as workloads too
    # import the bundles' code even where another user could have written it (gpumon.sdc.trust):
    # the caller has looked at them (``--trust``); else each worker checks them before importing
    trust_bundles: bool = False
    golden: Golden | None = None
    inject: FaultSpec | None = None
    # whose fault ``inject`` is, for the bundles: "harness" (``--inject``, a test's fault that no GPU
    # computes again) or "simulated" (a simulated node's ``sdc`` fault: its GPU computes it again)
    inject_origin: str = "harness"
    bundle_dir: Path | None = None  # where failing runs are kept as replay bundles
    device: str = "auto"  # auto | cpu | cuda
    device_indices: Sequence[int] = ()  # GPU indices to use (default 0..workers-1)
    # GPU index -> what NVML says of that GPU (uuid, serial, pci_bus_id, name), from the caller's
    # hardware layer: bundles and findings name the GPU by it, not by the worker that ran on it
    gpu_identity: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    threads: int = 1
    timeout_s: float = 600.0  # per iteration, all workloads
    startup_timeout_s: float = 300.0
    max_bundles: int = 4
    driver: str | None = None  # NVIDIA driver version, from NVML (the key needs it)
    cpu_model: str | None = None  # CPU stand-in's "GPU model"
    keep_tensors: bool = True
    send_tensors_of: frozenset[int] = frozenset()  # workers whose tensors come back (benchmarks)
    keep_runs: bool = True  # keep every iteration's results in the report (False: the last only)
    should_stop: Callable[[], bool] | None = None  # checked between iterations (a job appeared)
    lock_wait_s: float = 0.0  # how long to wait for another compute job to release the devices


@dataclass(frozen=True)
class WorkerInfo:
    index: int  # the worker; its GPU index is Report.gpu_of(index)
    device: str
    key: DeviceKey
    cuda_uuid: str | None = None  # the UUID CUDA gives the worker's device (None on the CPU)


@dataclass
class Mismatch:
    """One worker's run of one workload, one iteration, that differs from what it is compared with."""

    worker: int
    workload: str
    iteration: int
    against: str  # "golden" or "majority of N"
    first_tensor: str
    point_index: int
    expected: str | None  # fingerprint hex
    observed: str | None
    detail: str
    error: str | None = None
    bundle: str | None = None
    flips: list[dict[str, Any]] = field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "workload": self.workload, "iteration": self.iteration, "compared_with": self.against,
            "first_differing_tensor": self.first_tensor, "point_index": self.point_index,
            "expected_fingerprint": self.expected, "observed_fingerprint": self.observed,
        }
        if self.error:
            ev["error"] = self.error
        if self.bundle:
            ev["bundle"] = self.bundle
        return ev


@dataclass
class Split:
    """No strict majority among the workers of one key for one workload and iteration."""

    workload: str
    iteration: int
    groups: list[list[int]]


@dataclass
class Report:
    workers: list[WorkerInfo]
    iterations: dict[int, int]
    workloads: list[str]
    mismatches: list[Mismatch] = field(default_factory=list)
    splits: list[Split] = field(default_factory=list)
    golden_used: dict[str, bool] = field(default_factory=dict)  # workload -> a golden was found
    no_golden: list[dict[str, str]] = field(default_factory=list)  # keys without a golden
    golden_mismatch_agreed: list[Mismatch] = field(default_factory=list)
    worker_failures: dict[int, str] = field(default_factory=dict)  # hung or died
    startup_failures: list[int] = field(default_factory=list)  # of those, before running anything
    stopped_early: str | None = None
    runs: dict[tuple[int, int, str], WorkloadRun] = field(default_factory=dict)
    tensors: dict[tuple[int, int, str], dict[str, torch.Tensor]] = field(default_factory=dict)
    bundles: list[str] = field(default_factory=list)
    seconds: float = 0.0
    gpu_indices: list[int] = field(default_factory=list)  # worker -> GPU index (default: the same)
    gpu_identity: dict[int, dict[str, Any]] = field(default_factory=dict)  # GPU index -> NVML's words

    def gpu_of(self, worker: int) -> int:
        return self.gpu_indices[worker] if worker < len(self.gpu_indices) else worker

    def identity_of(self, worker: int) -> dict[str, Any]:
        """The GPU a worker ran on: its index, NVML's UUID, serial, PCI bus id and name (None where
        not known: CPU workers off a GPU node), the device the worker used, and a note when the
        UUID CUDA gave that device is not NVML's for the index (CUDA_VISIBLE_DEVICES renumbered)."""
        g = self.gpu_of(worker)
        nvml = self.gpu_identity.get(g, {})
        ident: dict[str, Any] = {"index": g, "uuid": nvml.get("uuid"), "serial": nvml.get("serial"),
                                 "pci_bus_id": nvml.get("pci_bus_id"), "name": nvml.get("name")}
        info = next((w for w in self.workers if w.index == worker), None)
        if info is not None:
            ident["device"] = info.device
            if info.cuda_uuid:
                ident["cuda_uuid"] = info.cuda_uuid
                if ident["uuid"] and _uuid_key(ident["uuid"]) != _uuid_key(info.cuda_uuid):
                    owner = next((i for i, v in self.gpu_identity.items()
                                  if _uuid_key(str(v.get("uuid") or "")) == _uuid_key(info.cuda_uuid)), None)
                    ident["identity_note"] = (
                        f"CUDA's {info.device} has UUID {info.cuda_uuid}, which NVML gives "
                        + (f"GPU {owner}" if owner is not None else "no GPU")
                        + f", not GPU {g} ({ident['uuid']}): CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER "
                        "renumbered the devices; trust the UUID")
        return ident


# -- device identity -------------------------------------------------------------------------------

def _uuid_key(uuid: str) -> str:
    """UUIDs compared as NVML and CUDA print them: NVML "GPU-xxxxxxxx-...", torch "xxxxxxxx-..."."""
    return uuid.strip().lower().removeprefix("gpu-").removeprefix("mig-")


def device_for(worker: int, options: Options) -> torch.device:
    want = options.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CanaryError("device cuda asked for, but torch sees no CUDA device")
    indices = list(options.device_indices) or list(range(options.workers))
    return torch.device("cuda", indices[worker])


# -- workloads a worker runs -----------------------------------------------------------------------

def resolve_workloads(names: Sequence[str], bundles: Sequence[Path], device_type: str, *,
                      trust: bool = False) -> list[Workload]:
    builtin = builtin_workloads(device_type)
    chosen = list(names) if names or bundles else list(WORKLOAD_NAMES)
    out: list[Workload] = []
    for name in chosen:
        if name not in builtin:
            raise CanaryError(f"unknown workload {name!r} (built-in: {', '.join(builtin)})")
        out.append(builtin[name])
    out.extend(workload_from_bundle(Path(b), trust=trust) for b in bundles)
    seen: set[str] = set()
    for w in out:
        if w.name in seen:
            raise CanaryError(f"workload {w.name!r} given twice")
        seen.add(w.name)
    return out


# -- the worker process ------------------------------------------------------------------------------

def _worker_main(index: int, conn: multiprocessing.connection.Connection, options: Options,
                 env: Mapping[str, str]) -> None:
    # the pool's server forked this process with the environment it started with: take the caller's
    os.environ.clear()
    os.environ.update(env)
    # Ctrl-C reaches the whole process group: the parent alone decides, and stops its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # EOF or a broken pipe: the parent is gone, nobody to report to
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        _serve(index, conn, options)
    conn.close()
    # skip the interpreter's teardown (~0.5 s per process with torch loaded): nothing is left to
    # flush, and the driver releases a CUDA context with the process
    os._exit(0)


def _serve(index: int, conn: multiprocessing.connection.Connection, options: Options) -> None:
    try:
        # NVML numbers GPUs in PCI order, CUDA fastest-first unless told otherwise (read when CUDA
        # starts, so before anything touches it): in PCI order cuda:N is NVML's GPU N (without
        # CUDA_VISIBLE_DEVICES), and the UUID below checks it
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        deterministic(options.threads)
        device = device_for(index, options)
        cuda_uuid = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
            cuda_uuid = str(uuid) if uuid is not None else None
        key = device_key(device, driver=options.driver, cpu_model=options.cpu_model)
        workloads = resolve_workloads(options.workloads, options.bundles, device.type,
                                      trust=options.trust_bundles)
        base_injector = _injector(options.inject, index)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ready", str(device), key, [w.name for w in workloads], cuda_uuid))
    kept: dict[str, dict[str, torch.Tensor]] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "run":
            kept = {}
            runs = []
            # this iteration's own fault (benchmarks), else the run's (one random stream throughout)
            injector = base_injector if msg[2] == "default" else _injector(msg[2], index)
            for w in workloads:
                run, tensors = run_workload(w, device, injector, keep=options.keep_tensors)
                runs.append(run)
                kept[w.name] = tensors
            conn.send(("result", msg[1], runs))
        elif msg[0] == "dump":
            _, workload, path = msg
            try:
                torch.save({k: v.cpu() for k, v in kept.get(workload, {}).items()}, path)
                conn.send(("dumped", path, None))
            except Exception as exc:
                conn.send(("dumped", path, f"{type(exc).__name__}: {exc}"))
        elif msg[0] == "tensors":
            conn.send(("tensors", {w: {k: v.cpu() for k, v in t.items()} for w, t in kept.items()}))


def _injector(spec: FaultSpec | None, worker: int) -> FaultInjector | None:
    return FaultInjector(spec) if spec is not None and spec.worker == worker else None


# -- the run -------------------------------------------------------------------------------------

class Session:
    """Workers started once, iterations run on demand: ``run()`` uses one, benchmarks drive one.

    ``iterate()`` runs one iteration on every live worker at once, compares, keeps bundles, and
    returns the iteration's number; the results accumulate in ``report``.
    """

    def __init__(self, options: Options) -> None:
        if options.workers < 1:
            raise CanaryError("need at least one worker")
        self.options = options
        self.started = time.monotonic()
        # the workers need neither the golden nor the parent's callbacks (which may not pickle);
        # forkserver children do not see later environment changes: each is handed this one
        shipped = dataclasses.replace(options, golden=None, should_stop=None)
        self.pool = pool.WorkerGroup(CHECK, _worker_main, options.workers, (shipped, dict(os.environ)),
                                     lock_wait_s=options.lock_wait_s, name="gpumon-canary")
        try:
            self.report = self._hello()
        except BaseException:
            self.pool.close()
            raise
        self.next_iteration = 0

    def _hello(self) -> Report:
        pool, options = self.pool, self.options
        hello = pool.gather(range(options.workers), options.startup_timeout_s, "startup")
        pool.startup_failed.update(pool.failed)
        workers: list[WorkerInfo] = []
        names: list[str] = []
        for i in sorted(hello):
            msg = hello[i]
            if msg[0] == "error":
                if any(kind in msg[1] for kind in ("CanaryError", "KeyError", "FileNotFoundError",
                                                   "UntrustedBundle")):
                    raise CanaryError(msg[1].split(": ", 1)[-1])
                pool.failed[i] = f"worker could not start: {msg[1]}"
                pool.startup_failed.add(i)
                continue
            workers.append(WorkerInfo(i, msg[1], msg[2], msg[4] if len(msg) > 4 else None))
            names = msg[3]
        return Report(workers=workers, iterations={w.index: 0 for w in workers}, workloads=names,
                      gpu_indices=list(options.device_indices),
                      gpu_identity={int(k): dict(v) for k, v in options.gpu_identity.items()})

    def iterate(self, inject: FaultSpec | str | None = "default",
                tensors_of: Sequence[int] = ()) -> int:
        """One iteration. ``inject`` replaces ``options.inject`` for this iteration only (None: no
        fault); ``tensors_of``: workers whose tensors come back in ``report.tensors``."""
        report, pool, options = self.report, self.pool, self.options
        it = self.next_iteration
        self.next_iteration += 1
        alive = [w.index for w in report.workers if w.index in pool.alive()]
        for i in alive:
            pool.send(i, ("run", it, inject))
        answers = pool.gather(alive, options.timeout_s, f"iteration {it}")
        if not options.keep_runs:
            report.runs.clear()
            report.tensors.clear()
        runs: dict[int, list[WorkloadRun]] = {}
        for i, msg in answers.items():
            runs[i] = msg[2]
            report.iterations[i] += 1
            for r in msg[2]:
                report.runs[(i, it, r.workload)] = r
        spec = options.inject if inject == "default" else inject
        _compare(report, report.workers, runs, it, options)
        _keep_bundles(report, pool, options, it, spec if isinstance(spec, FaultSpec) else None)
        wanted = [i for i in {*options.send_tensors_of, *tensors_of} if i in runs]
        for i in wanted:
            pool.send(i, ("tensors",))
        for i, msg in pool.gather(wanted, options.timeout_s, "tensor transfer").items():
            for wname, tensors in msg[1].items():
                report.tensors[(i, it, wname)] = tensors
        report.worker_failures = dict(pool.failed)
        report.startup_failures = sorted(pool.startup_failed)
        report.seconds = time.monotonic() - self.started
        return it

    def alive(self) -> bool:
        return any(w.index in self.pool.alive() for w in self.report.workers)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(options: Options) -> Report:
    """Start the workers, run ``options.iterations`` iterations, compare, keep bundles of failures."""
    with Session(options) as session:
        report = session.report
        for it in range(options.iterations):
            if options.should_stop is not None and options.should_stop():
                report.stopped_early = f"stopped before iteration {it}: the GPUs are wanted"
                break
            if not session.alive():
                break
            session.iterate()
        report.worker_failures = dict(session.pool.failed)
        report.startup_failures = sorted(session.pool.startup_failed)
        report.seconds = time.monotonic() - session.started
        return report


def _compare(report: Report, workers: Sequence[WorkerInfo], runs: Mapping[int, list[WorkloadRun]],
             iteration: int, options: Options) -> None:
    by_key: dict[DeviceKey, list[int]] = {}
    for w in workers:
        if w.index in runs:
            by_key.setdefault(w.key, []).append(w.index)
    for key, members in by_key.items():
        for slot, wname in enumerate(report.workloads):
            results = {i: runs[i][slot] for i in members}
            params = results[members[0]].params
            gkey = GoldenKey(wname, params, key)
            golden = options.golden.get(gkey) if options.golden is not None else None
            report.golden_used[wname] = golden is not None
            if golden is None and iteration == 0 and gkey.to_json() not in report.no_golden:
                report.no_golden.append(gkey.to_json())
            value, split = majority((i, r.signature()) for i, r in results.items())
            consensus = results[split[value][0]] if value is not None else None
            if value is None and len(members) > 1 and golden is None:
                report.splits.append(Split(wname, iteration, sorted(split.values(), key=len, reverse=True)))
            for i, r in results.items():
                mismatch = None
                if golden is not None:
                    diff = first_difference(golden, r.points)
                    if diff is None and r.error is not None:
                        diff = Diff(len(r.points), "(end)", None, None)
                    if diff is not None:
                        mismatch = _mismatch(i, r, iteration, "golden", diff)
                        agreeing = len(split[r.signature()])
                        if agreeing > 1 and 2 * agreeing > len(members):
                            # the node's GPUs agree with each other, not with the golden: stale golden
                            # or a key that misses something, not one bad GPU
                            report.golden_mismatch_agreed.append(mismatch)
                            continue
                elif consensus is not None and r.signature() != value:
                    diff = first_difference(consensus.points, r.points) or Diff(
                        len(r.points), "(end)", None, None)
                    mismatch = _mismatch(i, r, iteration, f"majority of {len(split[value])}/{len(members)}",
                                         diff)
                if mismatch is not None:
                    report.mismatches.append(mismatch)


def _mismatch(worker: int, run: WorkloadRun, iteration: int, against: str, diff: Diff) -> Mismatch:
    detail = diff.describe()
    if run.error:
        detail += f"; the run raised {run.error}"
    return Mismatch(worker=worker, workload=run.workload, iteration=iteration, against=against,
                    first_tensor=diff.name, point_index=diff.index,
                    expected=diff.expected.fp.hex() if diff.expected else None,
                    observed=diff.observed.fp.hex() if diff.observed else None,
                    detail=detail, error=run.error, flips=run.flips)


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _keep_bundles(report: Report, group: pool.WorkerGroup, options: Options, iteration: int,
                  inject: FaultSpec | None) -> None:
    if options.bundle_dir is None or not options.keep_tensors:
        return
    fresh = [m for m in report.mismatches if m.iteration == iteration and m.bundle is None]
    for m in fresh:
        if len(report.bundles) >= options.max_bundles:
            return
        stamp = time.strftime("%Y%m%dT%H%M%S")
        # named by the GPU, not the worker: with --gpus 4,5,6,7 (or the idle GPUs only) worker 2 is GPU 6
        gpu_index = report.gpu_of(m.worker)
        folder = options.bundle_dir / _SAFE.sub("_", f"{stamp}-gpu{gpu_index}-{m.workload}-it{iteration}")
        try:
            folder.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            log.warning("cannot keep a replay bundle in %s: %s", folder, exc)
            return
        reference = next((i for i in group.alive() if i != m.worker and not any(
            x.worker == i and x.workload == m.workload and x.iteration == iteration
            for x in report.mismatches)), None)
        asked = {m.worker: folder / "observed.pt"}
        if reference is not None:
            asked[reference] = folder / "reference.pt"
        for i, path in asked.items():
            group.send(i, ("dump", m.workload, str(path)))
        answers = group.gather(list(asked), options.timeout_s, "bundle dump")
        run = report.runs[(m.worker, iteration, m.workload)]
        worker = next(w for w in report.workers if w.index == m.worker)
        gkey = GoldenKey(m.workload, run.params, worker.key)
        golden = options.golden.get(gkey) if options.golden is not None else None
        ref_run = report.runs.get((reference, iteration, m.workload)) if reference is not None else None
        expected = golden if golden is not None else (ref_run.points if ref_run is not None else None)
        capture = next((Path(b) for b in options.bundles if workload_name(Path(b)) == m.workload), None)
        write_failure_manifest(
            folder, mismatch=m, run=run, expected=expected, expected_is_golden=golden is not None,
            reference_worker=reference, key=gkey, capture_bundle=capture,
            inject=inject.to_text() if inject is not None else None, inject_origin=options.inject_origin,
            inject_gpu=report.gpu_of(inject.worker) if inject is not None else None,
            dump_errors={str(i): a[2] for i, a in answers.items() if a[2]},
            gpu=report.identity_of(m.worker),
            reference_gpu=report.gpu_of(reference) if reference is not None else None)
        m.bundle = str(folder)
        report.bundles.append(str(folder))


def summary_json(report: Report) -> dict[str, Any]:
    return {
        "workers": [{"index": w.index, "device": w.device, "key": w.key.describe(),
                     "gpu": {k: v for k, v in report.identity_of(w.index).items() if k != "device"}}
                    for w in report.workers],
        "iterations": {str(k): v for k, v in report.iterations.items()},
        "workloads": report.workloads,
        "no_golden": report.no_golden,
        "splits": [{"workload": s.workload, "iteration": s.iteration, "groups": s.groups}
                   for s in report.splits],
        "bundles": report.bundles,
        "seconds": round(report.seconds, 3),
        "stopped_early": report.stopped_early,
    }


