"""Bootstrap compute on torch: worker processes, one per device, and the measurements they run.

This is the only module of gpumon that imports torch, and it does so inside functions, so that
gpumon works without torch installed (a compute check then says ``skipped``: ``TORCH_MISSING``).

**Devices.** ``cuda`` when torch sees CUDA devices; otherwise N CPU "devices" (one worker process
each, one thread each) stand in for GPUs, so that CI runs the same code path with device ``cpu``
and the gloo backend (DESIGN.md, "CPU stand-ins for GPU compute").

**Workers.** ``run_workers`` starts one process per rank and waits for all of them within a
deadline. A worker that has not answered by then is killed and reported as ``hung``, with the
last phase it reported (``WorkerContext.progress``), so a hang names the worker and where it
hung. A worker that exits without an answer (segfault, OOM kill) is ``died``; one that raised
is ``error`` with its traceback. Processes come from the ``forkserver`` start method: like
``spawn`` the children start from a clean interpreter (no CUDA state or threads of the agent
are inherited, which a CUDA child forked from a CUDA parent cannot survive), but torch is
imported once, in the server, instead of once per worker: starting 4 workers that import torch
took 6.6 s with ``spawn`` and 0.04 s with a warm ``forkserver`` (1.1 s for the first, which starts
the server) on the 2-core development VM, measured 2026-11-30.

**Measurements** run inside the workers and return plain, picklable records; judging them
against the profile is the checks' business (checks/burnin.py, nccl.py, p2p.py,
host_bandwidth.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from gpumon.errors import GpumonError

if TYPE_CHECKING:
    import torch

    from gpumon.hw import Hardware
    from gpumon.hw.inventory import Inventory

A = TypeVar("A")
R = TypeVar("R")

TORCH_MISSING = "torch not installed (pip install 'gpumon[compute]')"

# GEMM dtypes by the name used in config and reports. tf32 is fp32 storage with TF32 tensor-core
# math (CUDA only); fp32 is IEEE fp32 math (TF32 off).
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp64")
CPU_DTYPES = ("bf16", "fp16", "fp32", "fp64")

# Unit roundoff u = 2^-p of each storage format (p = significand bits incl. the implicit one):
# IEEE 754 binary16/32/64 (p = 11, 24, 53), bfloat16 (p = 8), TF32 (p = 11: 10 stored bits,
# NVIDIA A100 Tensor Core GPU Architecture whitepaper, "TF32").
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11, "fp32": 2.0**-24, "fp64": 2.0**-53}


def torch_missing() -> str | None:
    """``TORCH_MISSING`` when torch cannot be imported here, else None (torch is not imported)."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else TORCH_MISSING


def cuda_device_count() -> int:
    """CUDA devices torch sees (0 without CUDA). Imports torch and initializes the CUDA driver in this
    process, but creates no context on any GPU (the workers do that)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def normalize_uuid(uuid: str | None) -> str | None:
    """NVML's ``GPU-1a2b...`` and torch's ``1a2b...`` as one key."""
    if not uuid:
        return None
    text = str(uuid).strip().lower()
    return text.removeprefix("gpu-") or None


def gpu_index_by_uuid(inventory: Inventory) -> dict[str, int]:
    """Normalized GPU UUID -> NVML index, to name a CUDA device by the GPU NVML calls it."""
    out: dict[str, int] = {}
    for info in inventory.gpus:
        key = normalize_uuid(info.uuid)
        if key:
            out[key] = info.index
    return out


def busbw(algbw: float, ranks: int) -> float:
    """All-reduce bus bandwidth: algbw x 2(n-1)/n (nccl-tests doc/PERFORMANCE.md, "AllReduce")."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    return algbw * 2.0 * (ranks - 1) / ranks


def gemm_tolerance(dtype: str, k: int) -> float:
    """Bound on |C - C_exact| / (|A| @ |B|) for one element of an m x k x n GEMM in ``dtype``.

    A deterministic worst-case bound (Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., 3.1: |fl(x.y) - x.y| <= gamma_k |x|.|y|, gamma_k = k u / (1 - k u)), so a result
    outside it is wrong, never merely unlucky rounding:

    - bf16/fp16: inputs exact in fp32, products exact, fp32 accumulation (cuBLAS
      CUBLAS_COMPUTE_32F; reduced-precision reductions are switched off by the worker):
      gamma_k(fp32) plus one rounding of the output to the storage format.
    - tf32: each input rounded to TF32 inside the tensor core (<= 2^-10 relative even when
      truncated, 10 stored bits), so a product is off by <= 2 x 2^-10; then fp32 accumulation.
    - fp32: gamma_k(fp32). fp64: gamma_k(fp64) twice, because the fp64 reference is rounded too.
    """
    u32 = UNIT_ROUNDOFF["fp32"]

    def gamma(u: float) -> float:
        return k * u / (1.0 - k * u)

    if dtype in ("bf16", "fp16"):
        return gamma(u32) + UNIT_ROUNDOFF[dtype]
    if dtype == "tf32":
        return 2.0 * 2.0**-10 + gamma(u32) + u32
    if dtype == "fp32":
        return gamma(u32)
    if dtype == "fp64":
        return 2.0 * gamma(UNIT_ROUNDOFF["fp64"])
    raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")


# --------------------------------------------------------------------------------------- workers


class DevicesBusy(GpumonError):
    """Another compute check holds the devices (a measurement beside another is worthless)."""


# One compute job on the devices at a time: two checks measuring side by side would each see the
# other's load as a slow device. Held only while workers run.
_DEVICES = threading.Lock()
_HOLDER: list[str] = []


def lock_wait(check_timeout_s: float, work_s: float, margin_s: float = 30.0) -> float:
    """How long a check may wait for the devices: what its time budget leaves after its own work.

    The bootstrap suite runs checks one at a time and never waits here; a runner that starts them
    together gets them one after another instead of side by side (or ``DevicesBusy``, when the
    wait would run past the check's own timeout).
    """
    return max(0.0, check_timeout_s - work_s - margin_s)


@dataclass(frozen=True)
class StandIn:
    """A simulated GPU that a CPU worker stands in for, and how it behaves (gpumon/sim/devices.py)."""

    index: int  # the simulated GPU's NVML index
    uuid: str | None  # normalized
    name: str
    model: dict[str, Any] = field(default_factory=dict)  # DeviceModel.to_json(); {} healthy


@dataclass(frozen=True)
class Placement:
    """Where the workers run: ``cuda`` devices, or ``cpu`` stand-ins.

    On a simulated node the CPU workers stand in for the simulated GPUs (``stand_ins``, one worker
    each): findings then name those GPUs with the actions a GPU would get, while sizes and
    thresholds stay the CPU ones (``is_cuda`` is false: nothing is compared with a datasheet).
    """

    kind: str  # "cuda" | "cpu"
    devices: int  # CUDA devices torch sees, or CPU stand-ins configured
    note: str
    stand_ins: tuple[StandIn, ...] = ()

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def names_gpus(self) -> bool:
        """Findings go to GPUs (``gpu/<i>``, GPU actions): real CUDA devices or simulated GPUs."""
        return self.is_cuda or bool(self.stand_ins)


class NoCudaOnGpuNode(GpumonError):
    """NVML sees GPUs but torch sees no CUDA device: a CPU stand-in would prove nothing here."""


def placement(cpu_devices: int, *, nvml_gpus: int = 0, simulated: bool = False,
              stand_ins: Sequence[StandIn] = ()) -> Placement:
    """CUDA devices when torch sees any; else CPU stand-ins: one per simulated GPU in ``stand_ins``,
    or ``cpu_devices`` of them.

    On a real node whose GPUs NVML sees, torch without CUDA (a CPU-only build, an empty
    CUDA_VISIBLE_DEVICES, a broken driver/runtime pair) raises ``NoCudaOnGpuNode``: burning CPUs
    there would report the node healthy without touching a GPU. A simulated node's GPUs are
    NVML-only, so there the CPU stand-ins are the point, even on a machine that has a GPU: a
    simulation must not measure real hardware and report it under simulated GPUs' names.
    """
    count = 0 if simulated else cuda_device_count()
    if count > 0:
        return Placement("cuda", count, f"{count} CUDA device(s) visible to torch")
    if nvml_gpus > 0 and not simulated:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise NoCudaOnGpuNode(f"NVML sees {nvml_gpus} GPU(s) but torch sees no CUDA device{why}: "
                              "a CPU-only torch build or a broken CUDA runtime")
    if simulated and stand_ins:
        return Placement("cpu", len(stand_ins),
                         f"simulated node: {len(stand_ins)} CPU worker processes stand in for the simulated "
                         "GPUs (device cpu)", tuple(stand_ins))
    where = "simulated node" if simulated else "no GPU"
    return Placement("cpu", cpu_devices,
                     f"{where}: {cpu_devices} CPU worker processes stand in for GPUs (device cpu)")


def node_placement(inventory: Inventory, hw: Hardware, cpu_devices: int) -> Placement:
    """``placement`` for this node: on a simulated node, a stand-in for each simulated GPU."""
    stand_ins: list[StandIn] = []
    if hw.simulated:
        models = hw.sim_devices()
        stand_ins = [StandIn(g.index, normalize_uuid(g.uuid), g.name,
                             models[g.index].to_json() if g.index in models else {})
                     for g in sorted(inventory.gpus, key=lambda g: g.index)]
    return placement(cpu_devices, nvml_gpus=len(inventory.gpus), simulated=hw.simulated, stand_ins=stand_ins)


@dataclass(frozen=True)
class DeviceName:
    """How findings name a worker's device: its component and words for messages."""

    component: str  # gpu/<NVML index> for a CUDA device NVML knows, else node
    label: str  # "GPU 3" / "cuda:5 (UUID not known to NVML)" / "cpu worker 2"
    gpu_index: int | None


def device_name(identity: Mapping[str, Any], by_uuid: Mapping[str, int], *, rank: int = 0,
                kind: str = "cuda") -> DeviceName:
    """Name a bound worker's device by the GPU NVML knows under the same UUID.

    CUDA numbers devices fastest-first unless CUDA_DEVICE_ORDER says otherwise, and a scheduler's
    CUDA_VISIBLE_DEVICES renumbers them: only the UUID names the same GPU on both sides.
    """
    uuid = normalize_uuid(identity.get("uuid"))
    if uuid and uuid in by_uuid:
        index = by_uuid[uuid]
        return DeviceName(f"gpu/{index}", f"GPU {index}", index)
    # a worker that died before saying who it is still had a device: the one its rank binds
    device = str(identity.get("device") or (f"cuda:{rank}" if kind == "cuda" else f"cpu worker {rank}"))
    if device.startswith("cuda"):
        return DeviceName("node", f"{device} (UUID not known to NVML)", None)
    return DeviceName("node", device, None)


@dataclass
class Progress:
    """What a worker said last: its phase (free text), since when (monotonic), details, and who it is."""

    phase: str = "starting"
    since: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)


# The phase a worker reports while it waits for the others at the barrier.
WAITING = "waiting for the other devices"


@dataclass(frozen=True)
class WorkerOutcome:
    rank: int
    state: str  # "ok" | "error" | "died" | "hung" | "stuck"
    result: Any = None
    error: str = ""
    phase: str = ""  # the last phase the worker reported
    identity: Mapping[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @property
    def waited_for_peer(self) -> bool:
        """Failed only because another worker did: released from, or stuck at, the start barrier."""
        if self.state == "error":
            return "BrokenBarrierError" in self.error
        return self.state in ("hung", "stuck") and self.phase.startswith(WAITING)

    @property
    def label(self) -> str:
        device = self.identity.get("device")
        return f"worker {self.rank}" + (f" ({device})" if device else "")

    def describe(self) -> str:
        """One line an operator can act on: which worker, what happened, where."""
        where = f" in {self.phase!r}" if self.phase else ""
        if self.state == "hung":
            return f"{self.label} hung{where} after {self.seconds:.0f} s; killed"
        if self.state == "stuck":
            return (f"{self.label} hung{where} after {self.seconds:.0f} s and did not exit when killed "
                    "(blocked in the kernel or driver)")
        if self.state == "died":
            return f"{self.label} died{where} (exit code {self.exitcode}) without an answer"
        if self.state == "error":
            last = self.error.strip().splitlines()[-1] if self.error.strip() else "no traceback"
            return f"{self.label} failed{where}: {last}"
        return f"{self.label} finished in {self.seconds:.1f} s"


@dataclass(frozen=True)
class WorkerRun:
    outcomes: list[WorkerOutcome]
    wall_s: float
    waited_for_devices_s: float = 0.0

    @property
    def failed(self) -> list[WorkerOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def results(self) -> list[Any]:
        return [o.result for o in self.outcomes]


class WorkerContext:
    """Handed to a worker function: its rank, device, and a line back to the parent."""

    def __init__(self, rank: int, world: int, kind: str, device: str, conn: Any, barrier: Any,
                 stand_ins: Sequence[StandIn] = ()) -> None:
        self.rank = rank
        self.world = world
        self.kind = kind
        self.device = device
        self.stand_ins = tuple(stand_ins)
        self._conn = conn
        self._barrier = barrier

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def progress(self, phase: str, **data: Any) -> None:
        """Tell the parent where this worker is (named if it hangs there)."""
        self._conn.send(("progress", phase, data))

    def barrier(self, timeout_s: float) -> None:
        """Wait until every worker got here (all devices start a measurement together)."""
        if self._barrier is None:
            raise RuntimeError("run_workers was not asked for a barrier")
        self._barrier.wait(timeout_s)

    def sync(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize()

    def device_for(self, ordinal: int) -> str:
        """The torch device of device ``ordinal`` in a worker that drives every device (``bind=False``)."""
        return f"cuda:{ordinal}" if self.is_cuda else "cpu"

    def link(self, src: int, dst: int) -> contextlib.AbstractContextManager[None]:
        """Copies inside the block go from device ``src`` to ``dst``: on a simulated node they run
        over that simulated link (gpumon/sim/devices.py); on real devices this changes nothing."""
        if self.stand_ins:
            from gpumon.sim import devices

            return devices.link(src, dst)
        return contextlib.nullcontext()


def _mp_context() -> Any:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("forkserver")
    # Effective when the server starts (the first run); the same list every time.
    ctx.set_forkserver_preload(["torch", "gpumon.compute"])
    return ctx


def cuda_identity(index: int) -> dict[str, Any]:
    """Name and UUID of CUDA device ``index`` as seen inside a worker."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return {"index": index, "name": props.name, "uuid": normalize_uuid(str(props.uuid)),
            "sm_count": props.multi_processor_count}


def _entry(fn: Callable[[WorkerContext, Any], Any], rank: int, world: int, kind: str, bind: bool,
           threads: int, env: Mapping[str, str], barrier: Any, arg: Any, conn: Any,
           stand_ins: Sequence[StandIn] = ()) -> None:
    """A worker process: set up the device, say who it is, run ``fn``, send the answer."""
    try:
        os.environ.update(env)
        if kind == "cuda":
            # CUDA numbers devices fastest-first by default; in PCI order cuda:N is usually NVML's GPU N,
            # which makes the labels read naturally (findings still match GPUs by UUID)
            os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        import torch

        identity: dict[str, Any]
        if kind == "cuda":
            # host-side work (operands, fp64 reference) shares the cores among the workers
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
            if bind:
                torch.cuda.set_device(rank)
                identity = {"device": f"cuda:{rank}", **cuda_identity(rank)}
                device = f"cuda:{rank}"
            else:
                identity = {"device": "cuda",
                            "devices": [cuda_identity(i) for i in range(torch.cuda.device_count())]}
                device = "cuda"
        else:
            # one thread per stand-in: N workers on N cores, not N x cores threads fighting
            torch.set_num_threads(threads)
            identity = {"device": f"cpu worker {rank}", "name": "cpu"}
            device = "cpu"
            if stand_ins:
                identity = _stand_in(stand_ins, rank if bind else None)
        conn.send(("ident", identity))
        ctx = WorkerContext(rank, world, kind, device, conn, barrier, stand_ins)
        result = fn(ctx, arg)
        conn.send(("result", result))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc(limit=8)))
        if barrier is not None:
            # the others would wait for this worker at the barrier until its timeout: release them
            # now (they fail with BrokenBarrierError, which WorkerOutcome.waited_for_peer recognises)
            with contextlib.suppress(Exception):
                barrier.abort()
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _stand_in(stand_ins: Sequence[StandIn], rank: int | None) -> dict[str, Any]:
    """Install the simulated GPUs' device models in this worker; its identity (as a CUDA worker's)."""
    from gpumon.sim import devices

    models = {s.index: devices.DeviceModel.from_json(s.model) for s in stand_ins}
    if rank is None:
        devices.install(models, None)
        return {"device": "cpu", "devices": [{"index": i, "uuid": s.uuid, "name": s.name}
                                             for i, s in enumerate(stand_ins)]}
    own = stand_ins[rank]
    devices.install(models, own.index)
    return {"device": f"cpu worker {rank}", "name": f"{own.name} (CPU stand-in)", "uuid": own.uuid,
            "stands_in_for": own.index}


@dataclass
class _Slot:
    rank: int
    proc: Any
    conn: Any
    started: float
    progress: Progress
    identity: dict[str, Any] = field(default_factory=dict)
    answer: tuple[str, Any] | None = None
    eof: bool = False
    exited: bool = False
    ended: float | None = None

    @property
    def done(self) -> bool:
        return self.answer is not None or self.exited

    def drain(self) -> None:
        """Read whatever the worker sent (never blocks)."""
        while not self.eof:
            try:
                if not self.conn.poll():
                    return
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.eof = True
                return
            kind = msg[0]
            if kind == "ident":
                self.identity = dict(msg[1])
                self.progress.identity = self.identity
            elif kind == "progress":
                self.progress = Progress(str(msg[1]), time.monotonic(), dict(msg[2]), self.identity)
            elif kind in ("result", "error") and self.answer is None:
                self.answer = (kind, msg[1])
                self.ended = time.monotonic()


def run_workers(fn: Callable[[WorkerContext, A], R], args: Sequence[A], *, kind: str, timeout_s: float,
                bind: bool = True, threads: int = 1, env: Mapping[str, str] | None = None,
                barrier: bool = False, on_tick: Callable[[Mapping[int, Progress]], None] | None = None,
                tick_s: float = 1.0, peer_failure_grace_s: float | None = None,
                lock_wait_s: float = 0.0, name: str = "compute",
                stand_ins: Sequence[StandIn] = ()) -> WorkerRun:
    """Run ``fn(ctx, args[rank])`` in one process per rank; every worker answers within ``timeout_s``.

    ``fn`` must be a module-level function (it is pickled by name). ``bind``: rank r uses CUDA
    device r. ``barrier``: workers may call ``ctx.barrier()``. ``on_tick(progress by rank)`` is
    called about every ``tick_s`` while the workers run (readings during a burn). With
    ``peer_failure_grace_s``, once a worker has failed the others get that long and are then
    killed (ranks of a collective hang forever when a peer dies). ``lock_wait_s``: how long to
    wait for another compute job to release the devices before raising ``DevicesBusy``.
    ``stand_ins`` (``kind="cpu"`` on a simulated node): the simulated GPUs the workers stand in
    for, rank r for ``stand_ins[r]`` (with ``bind=False`` one worker for all of them).
    """
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"kind must be cuda or cpu, got {kind!r}")
    if stand_ins and (kind != "cpu" or (bind and len(stand_ins) != len(args))):
        raise ValueError("stand_ins need kind cpu and, with bind, one per worker")
    if not args:
        return WorkerRun([], 0.0)
    with devices_held(name, lock_wait_s) as waited:
        return _run_locked(fn, args, kind=kind, timeout_s=timeout_s, bind=bind, threads=threads,
                           env=dict(env or {}), barrier=barrier, on_tick=on_tick, tick_s=tick_s,
                           grace=peer_failure_grace_s, name=name, waited=waited, stand_ins=tuple(stand_ins))


@contextlib.contextmanager
def devices_held(name: str, lock_wait_s: float = 0.0) -> Iterator[float]:
    """Hold the node's compute devices for ``name`` (yields the seconds waited for them).

    Every compute job of this process takes them, the workers of ``run_workers`` and external
    tools that load the GPUs (nccl-tests) alike: two at once would measure each other.
    ``DevicesBusy`` when another job keeps them longer than ``lock_wait_s``.
    """
    t_lock = time.monotonic()
    if not _DEVICES.acquire(timeout=max(0.0, lock_wait_s)):
        holder = _HOLDER[0] if _HOLDER else "another compute job"
        raise DevicesBusy(f"devices busy: {holder} holds them (waited {lock_wait_s:g} s)")
    _HOLDER[:] = [name]
    try:
        yield time.monotonic() - t_lock
    finally:
        _HOLDER[:] = []
        _DEVICES.release()


def _run_locked(fn: Callable[[WorkerContext, A], R], args: Sequence[A], *, kind: str, timeout_s: float,
                bind: bool, threads: int, env: dict[str, str], barrier: bool,
                on_tick: Callable[[Mapping[int, Progress]], None] | None, tick_s: float,
                grace: float | None, name: str, waited: float, stand_ins: tuple[StandIn, ...]) -> WorkerRun:
    mp = _mp_context()
    world = len(args)
    shared_barrier = mp.Barrier(world) if barrier else None
    start = time.monotonic()
    deadline = start + timeout_s
    slots: list[_Slot] = []
    try:
        for rank, arg in enumerate(args):
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(target=_entry, name=f"gpumon-{name}-{rank}", daemon=True,
                              args=(fn, rank, world, kind, bind, threads, env, shared_barrier, arg, writer,
                                    stand_ins))
            proc.start()
            writer.close()  # the child holds the only writer: EOF when it is gone
            slots.append(_Slot(rank, proc, reader, time.monotonic(), Progress(since=time.monotonic())))
        first_failure: float | None = None
        next_tick = start + tick_s
        while True:
            pending = [s for s in slots if not s.done]
            if not pending:
                break
            now = time.monotonic()
            limit = deadline
            if grace is not None and first_failure is not None:
                limit = min(limit, first_failure + grace)
            if now >= limit:
                break
            until = min(limit, next_tick) if on_tick is not None else limit
            waitables = [s.conn for s in pending if not s.eof] + [s.proc.sentinel for s in pending]
            multiprocessing.connection.wait(waitables, timeout=max(0.0, until - now))
            for s in pending:
                s.drain()
                if s.answer is None and not s.proc.is_alive():
                    s.drain()  # what it wrote before exiting is still in the pipe
                    s.exited = True
                    s.ended = time.monotonic()
                if s.done and first_failure is None and (s.answer is None or s.answer[0] == "error"):
                    first_failure = time.monotonic()
            if on_tick is not None and time.monotonic() >= next_tick:
                on_tick({s.rank: s.progress for s in slots})
                next_tick = time.monotonic() + tick_s
        return WorkerRun([_outcome(s) for s in slots], time.monotonic() - start, waited)
    finally:
        for s in slots:
            _reap(s)


def _reap(s: _Slot) -> None:
    """Make sure the process is gone: answered workers get a moment to exit, hung ones are killed."""
    proc = s.proc
    if s.done:
        proc.join(timeout=5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5.0)
    with contextlib.suppress(OSError):
        s.conn.close()


def _outcome(s: _Slot) -> WorkerOutcome:
    now = time.monotonic()
    seconds = (s.ended or now) - s.started
    if s.answer is not None:
        kind, payload = s.answer
        if kind == "result":
            return WorkerOutcome(s.rank, "ok", result=payload, phase=s.progress.phase, identity=s.identity,
                                 seconds=seconds)
        return WorkerOutcome(s.rank, "error", error=str(payload), phase=s.progress.phase,
                             identity=s.identity, seconds=seconds)
    if s.exited:
        return WorkerOutcome(s.rank, "died", phase=s.progress.phase, identity=s.identity, seconds=seconds,
                             exitcode=s.proc.exitcode)
    # still running at the deadline: kill it here, so the outcome can say whether it went
    s.proc.kill()
    s.proc.join(timeout=5.0)
    state = "stuck" if s.proc.is_alive() else "hung"
    return WorkerOutcome(s.rank, state, phase=s.progress.phase, identity=s.identity, seconds=seconds,
                         exitcode=s.proc.exitcode)


# ---------------------------------------------------------------------------- burn-in: GEMM


@dataclass(frozen=True)
class BurnSpec:
    dtypes: tuple[str, ...]
    size: int  # square GEMM n x n x n
    duration_s: float  # per dtype, all devices together
    seed: int = 20260101
    reference_rows: int = 8
    copy_bytes: int = 1 << 30
    copy_iters: int = 20
    block_s: float = 0.25  # verification and timing granularity
    barrier_timeout_s: float = 300.0


@dataclass(frozen=True)
class GemmResult:
    dtype: str
    size: int
    iterations: int
    gemm_s: float  # device time spent in the timed GEMMs
    tflops: float
    block_tflops: tuple[float, ...]
    fingerprint: str  # sha256 of the first output's bytes
    unstable_iterations: int  # timed GEMMs whose output differed from the first one's
    unstable_elements: int
    reference_checked: int
    reference_bad: int  # checked elements outside the rounding bound
    reference_worst: float  # max |C - ref| / bound over the checked elements (<= 1 is right)
    wall_s: float


@dataclass(frozen=True)
class CopyResult:
    nbytes: int
    iterations: int
    seconds: float
    gbps: float  # (read + write) bytes / s / 1e9, as CUDA's bandwidthTest counts device-to-device
    verified: bool  # the copy equals its source
    attempts: tuple[float, ...] = ()  # GB/s of each measurement; ``gbps`` is the best


@dataclass(frozen=True)
class BurnReport:
    gemms: tuple[GemmResult, ...]
    copy: CopyResult | None


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
            "fp32": torch.float32, "fp64": torch.float64}[name]


def _set_math(name: str, cuda: bool) -> None:
    """TF32 on for tf32 only; no reduced-precision reductions, so the rounding bound holds."""
    import torch

    torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
    if cuda:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def gemm_inputs(size: int, dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands: uniform in [-1, 1), the same bits for a seed on every device and host.

    Drawn on the CPU (torch's CPU generator does not depend on the device), then cast.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(size, size, generator=gen, dtype=torch.float32).mul_(2).sub_(1)
    b = torch.rand(size, size, generator=gen, dtype=torch.float32).mul_(2).sub_(1)
    target = _torch_dtype(dtype)
    return a.to(target), b.to(target)


def fingerprint(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (on the host): equal fingerprints mean bit-identical results."""
    import torch

    flat = t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def reference_check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dtype: str,
                    rows: int) -> tuple[int, int, float]:
    """(checked, outside the bound, worst |C - ref| / bound) for ``rows`` evenly spaced rows of C.

    The reference is an fp64 GEMM on the host of the same (already cast) operands; the bound is
    ``gemm_tolerance`` times ``|A| @ |B|`` (plus the smallest normal number for exact zeros).
    """
    import torch

    n = a.shape[0]
    k = a.shape[1]
    picks = sorted({min(n - 1, (i * n) // max(1, rows)) for i in range(max(1, rows))})
    a_rows = a[picks].to("cpu", torch.float64)
    c_rows = c[picks].to("cpu", torch.float64)
    tol = gemm_tolerance(dtype, k)
    bad = 0
    worst = 0.0
    chunk = 1024  # columns of B at a time: bounds host memory for large n
    b_host = b.to("cpu")
    for j0 in range(0, b.shape[1], chunk):
        b_cols = b_host[:, j0:j0 + chunk].to(torch.float64)
        ref = a_rows @ b_cols
        bound = (a_rows.abs() @ b_cols.abs()).mul_(tol).add_(torch.finfo(torch.float64).tiny)
        ratio = (c_rows[:, j0:j0 + chunk] - ref).abs_().div_(bound)
        # NaN compares false: count it as outside the bound explicitly
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
        bad += int((ratio > 1.0).sum())
        worst = max(worst, float(ratio.max()))
    return len(picks) * b.shape[1], bad, worst


def _timing_event() -> Any:
    import torch

    # torch.cuda.Event's constructor is unannotated in torch's own stubs
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _timed_gemm_block(ctx: WorkerContext, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                      first: torch.Tensor, count: int, bad: torch.Tensor, bad_iters: torch.Tensor) -> float:
    """``count`` GEMMs, each output compared with the first one's on the device; GEMM seconds."""
    import torch

    if ctx.is_cuda:
        marks = [(_timing_event(), _timing_event()) for _ in range(count)]
        for begin, end in marks:
            begin.record()
            torch.matmul(a, b, out=c)
            end.record()
            diff = (c != first).sum()
            bad.add_(diff)
            bad_iters.add_((diff > 0).to(bad_iters.dtype))
        torch.cuda.synchronize()
        return float(sum(begin.elapsed_time(end) for begin, end in marks)) / 1000.0
    # a CPU stand-in's own CPU time, not wall time: N workers time-slice on fewer cores and the
    # wall clock would time the scheduler (torch runs one thread per stand-in: this one)
    spent = 0.0
    for _ in range(count):
        t0 = time.thread_time()
        torch.matmul(a, b, out=c)
        spent += time.thread_time() - t0
        diff = (c != first).sum()
        bad.add_(diff)
        bad_iters.add_((diff > 0).to(bad_iters.dtype))
    return spent


def _burn_dtype(ctx: WorkerContext, spec: BurnSpec, dtype: str) -> GemmResult:
    import torch

    wall0 = time.monotonic()
    n = spec.size
    _set_math(dtype, ctx.is_cuda)
    ctx.progress("prepare", dtype=dtype)
    a_host, b_host = gemm_inputs(n, dtype, spec.seed)
    a = a_host.to(ctx.device)
    b = b_host.to(ctx.device)
    first = torch.matmul(a, b)
    ctx.sync()
    ctx.progress("reference", dtype=dtype)
    checked, ref_bad, ref_worst = reference_check(a_host, b_host, first, dtype, spec.reference_rows)
    digest = fingerprint(first)
    c = torch.empty_like(first)
    bad = torch.zeros((), dtype=torch.int64, device=ctx.device)
    bad_iters = torch.zeros((), dtype=torch.int64, device=ctx.device)
    # calibrate the block length: blocks of ~block_s of wall time (GEMMs and their compares)
    t0 = time.perf_counter()
    _timed_gemm_block(ctx, a, b, c, first, 3, bad, bad_iters)
    per_iter = max((time.perf_counter() - t0) / 3, 1e-6)
    count = max(1, int(spec.block_s / per_iter))
    bad.zero_()
    bad_iters.zero_()
    ctx.progress(WAITING, dtype=dtype)
    ctx.barrier(spec.barrier_timeout_s)  # every device starts the timed burn together
    ctx.progress("burn", dtype=dtype)
    flops = 2.0 * n * n * n
    blocks: list[float] = []
    spent = 0.0
    iterations = 0
    end = time.monotonic() + spec.duration_s
    while True:
        seconds = _timed_gemm_block(ctx, a, b, c, first, count, bad, bad_iters)
        spent += seconds
        iterations += count
        blocks.append(flops * count / seconds / 1e12 if seconds > 0 else 0.0)
        if time.monotonic() >= end:
            break
    ctx.progress("burn done", dtype=dtype)
    tflops = flops * iterations / spent / 1e12 if spent > 0 else 0.0
    return GemmResult(dtype=dtype, size=n, iterations=iterations, gemm_s=spent, tflops=tflops,
                      block_tflops=tuple(round(x, 4) for x in blocks), fingerprint=digest,
                      unstable_iterations=int(bad_iters), unstable_elements=int(bad),
                      reference_checked=checked, reference_bad=ref_bad, reference_worst=ref_worst,
                      wall_s=time.monotonic() - wall0)


def copy_bandwidth(ctx: WorkerContext, nbytes: int, iterations: int) -> CopyResult:
    """Device-to-device copy of ``nbytes``: (read + write) GB/s, and whether the copy is exact."""
    import torch

    words = max(1, nbytes // 4)
    # a pattern, not zeros: a stuck bit or misrouted block shows up in the compare
    src = torch.arange(words, dtype=torch.int32, device=ctx.device).mul_(40503)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up (allocation, first touch)
    ctx.sync()
    if ctx.is_cuda:
        begin, end = _timing_event(), _timing_event()
        begin.record()
        for _ in range(iterations):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        seconds = float(begin.elapsed_time(end)) / 1000.0
    else:
        t0 = time.perf_counter()
        for _ in range(iterations):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    moved = 2.0 * words * 4 * iterations
    return CopyResult(nbytes=words * 4, iterations=iterations, seconds=seconds,
                      gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
                      verified=bool(torch.equal(dst, src)))


def burn_worker(ctx: WorkerContext, spec: BurnSpec) -> BurnReport:
    """Worker: the GEMM burn for each dtype, then the device memory copy bandwidth."""
    gemms = tuple(_burn_dtype(ctx, spec, dtype) for dtype in spec.dtypes)
    copy: CopyResult | None = None
    if spec.copy_bytes > 0 and spec.copy_iters > 0:
        ctx.progress("memory copy")
        # measured twice, judged on the better: bandwidth varies run to run, and a probe should
        # fail only if it stays low on a second try
        tries = [copy_bandwidth(ctx, spec.copy_bytes, spec.copy_iters) for _ in range(2)]
        best = max(tries, key=lambda t: t.gbps)
        copy = CopyResult(nbytes=best.nbytes, iterations=best.iterations, seconds=best.seconds,
                          gbps=best.gbps, verified=all(t.verified for t in tries),
                          attempts=tuple(t.gbps for t in tries))
    return BurnReport(gemms=gemms, copy=copy)


# ------------------------------------------------------------------------ all-reduce (nccl / gloo)


@dataclass(frozen=True)
class AllReduceSpec:
    backend: str  # "nccl" | "gloo"
    store_path: str  # a file the ranks rendezvous through (torch.distributed FileStore)
    sizes: tuple[int, ...]  # bytes per rank, float32 elements
    iterations: int
    warmup: int
    seed: int = 7
    timeout_s: float = 300.0  # the process group's own bound on one collective
    chunk_elems: int = 1 << 26  # the data pattern is written and checked this many elements at a time


@dataclass(frozen=True)
class SizeResult:
    nbytes: int
    elements: int
    seconds: float  # this rank's mean time per all-reduce
    wrong: int  # elements that differ from the exact sum (two checks: before and after the timing)
    checked: int


@dataclass(frozen=True)
class AllReduceReport:
    rank: int
    world: int
    backend: str
    sizes: tuple[SizeResult, ...]


# Data pattern: element i of rank r holds ((i * P + r * Q + seed) mod M) - M // 2, small integers in
# float32, so every sum over up to 2^24 / (M / 2) ranks is exact and any wrong element is a fault.
_PAT_P, _PAT_Q, _PAT_M = 7919, 104729, 1021


def pattern(start: int, stop: int, rank: int, seed: int, device: str) -> torch.Tensor:
    """float32 values rank ``rank`` contributes at elements [start, stop)."""
    import torch

    idx = torch.arange(start, stop, dtype=torch.int64, device=device)
    return ((idx * _PAT_P + (rank * _PAT_Q + seed)) % _PAT_M - _PAT_M // 2).to(torch.float32)


def expected_sum(start: int, stop: int, world: int, seed: int, device: str) -> torch.Tensor:
    """The exact all-reduce sum at elements [start, stop) when every rank used ``seed``."""
    import torch

    total = torch.zeros(stop - start, dtype=torch.float32, device=device)
    for r in range(world):
        total.add_(pattern(start, stop, r, seed, device))
    return total


def _fill(buf: torch.Tensor, rank: int, seed: int, chunk: int, device: str) -> None:
    for s in range(0, buf.numel(), chunk):
        e = min(buf.numel(), s + chunk)
        buf[s:e].copy_(pattern(s, e, rank, seed, device))


def _count_wrong(buf: torch.Tensor, world: int, seed: int, chunk: int, device: str) -> int:
    wrong = 0
    for s in range(0, buf.numel(), chunk):
        e = min(buf.numel(), s + chunk)
        wrong += int((buf[s:e] != expected_sum(s, e, world, seed, device)).sum())
    return wrong


def allreduce_worker(ctx: WorkerContext, spec: AllReduceSpec) -> AllReduceReport:
    """Worker: a size sweep of all-reduce (sum) over every rank, timed and checked element by element."""
    import datetime

    import torch
    import torch.distributed as dist

    ctx.progress("rendezvous", backend=spec.backend)
    # NCCL: bind the group to this rank's GPU now (eager communicator setup, no device guess later)
    device_id = torch.device(ctx.device) if ctx.is_cuda else None
    dist.init_process_group(spec.backend, init_method=f"file://{spec.store_path}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=spec.timeout_s),
                            device_id=device_id)
    results: list[SizeResult] = []
    for nbytes in spec.sizes:
        elems = max(1, nbytes // 4)
        label = size_label(elems * 4)
        buf = torch.empty(elems, dtype=torch.float32, device=ctx.device)
        wrong = 0
        ctx.progress(f"all_reduce {label} check")
        _fill(buf, ctx.rank, spec.seed, spec.chunk_elems, ctx.device)
        dist.all_reduce(buf)
        wrong += _count_wrong(buf, ctx.world, spec.seed, spec.chunk_elems, ctx.device)
        # the timed loop runs on zeros: a sum of zeros stays zero (repeated sums of the
        # pattern would overflow) and the speed of a sum does not depend on the values
        buf.zero_()
        ctx.progress(f"all_reduce {label} timed")
        for _ in range(spec.warmup):
            dist.all_reduce(buf)
        ctx.sync()
        dist.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(spec.iterations):
            dist.all_reduce(buf)
        ctx.sync()
        seconds = (time.perf_counter() - t0) / max(1, spec.iterations)
        ctx.progress(f"all_reduce {label} recheck")
        _fill(buf, ctx.rank, spec.seed, spec.chunk_elems, ctx.device)
        dist.all_reduce(buf)
        wrong += _count_wrong(buf, ctx.world, spec.seed, spec.chunk_elems, ctx.device)
        results.append(SizeResult(nbytes=elems * 4, elements=elems, seconds=seconds, wrong=wrong,
                                  checked=2 * elems))
        del buf
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    # not in a finally: tearing down after a failed collective (a dead peer) can hang, and the error
    # must reach the parent; the process exit releases the communicator then
    ctx.progress("teardown")
    dist.destroy_process_group()
    return AllReduceReport(rank=ctx.rank, world=ctx.world, backend=spec.backend, sizes=tuple(results))


def size_label(nbytes: int) -> str:
    """4294967296 -> "4 GiB"; sizes that are not whole units stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# --------------------------------------------------------------------------- peer copies (P2P)


@dataclass(frozen=True)
class PeerCopySpec:
    pairs: tuple[tuple[int, int], ...]  # (source, destination) CUDA ordinals
    nbytes: int
    iterations: int
    warmup: int = 2


@dataclass(frozen=True)
class PeerCopy:
    src: int
    dst: int
    gbps: float  # bytes copied / s / 1e9 (one direction, as nvbandwidth reports memcpy)
    seconds: float
    peer_access: bool  # torch.cuda.can_device_access_peer(src, dst)
    verified: bool


def peer_copy_worker(ctx: WorkerContext, spec: PeerCopySpec) -> list[PeerCopy]:
    """Worker (one process, every device): copy bandwidth for each ordered pair, one pair at a time."""
    import torch

    def sync(*ordinals: int) -> None:
        if ctx.is_cuda:
            for o in ordinals:
                torch.cuda.synchronize(o)

    # stand-ins: this thread's CPU time (one thread copies), which other processes' load leaves alone
    clock = time.perf_counter if ctx.is_cuda else time.thread_time
    words = max(1, spec.nbytes // 4)
    out: list[PeerCopy] = []
    for src, dst in spec.pairs:
        ctx.progress(f"copy GPU {src} -> GPU {dst}", src=src, dst=dst)
        # stand-ins share one memory: "peer access" is what a copy between them always has
        access = bool(torch.cuda.can_device_access_peer(src, dst)) if ctx.is_cuda else True
        a = torch.arange(words, dtype=torch.int32, device=ctx.device_for(src)).mul_(40503)
        b = torch.empty(words, dtype=torch.int32, device=ctx.device_for(dst))
        with ctx.link(src, dst):
            for _ in range(spec.warmup):
                b.copy_(a)
            sync(src, dst)
            if ctx.is_cuda:
                t0 = clock()
                for _ in range(spec.iterations):
                    b.copy_(a)
                sync(src, dst)
                seconds = clock() - t0
            else:
                # stand-ins: the fastest copy, times the iterations; a stall of this process (another
                # process's turn on the memory bus) is not the link, a slow link is slow every time
                times = []
                for _ in range(spec.iterations):
                    t0 = clock()
                    b.copy_(a)
                    times.append(clock() - t0)
                seconds = min(times) * spec.iterations
        check = torch.arange(words, dtype=torch.int32, device=ctx.device_for(dst)).mul_(40503)
        verified = bool(torch.equal(b, check))
        out.append(PeerCopy(src, dst, words * 4.0 * spec.iterations / seconds / 1e9 if seconds > 0 else 0.0,
                            seconds, access, verified))
        del a, b, check
    return out


# --------------------------------------------------------------------- host <-> device copies


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
    begin, end = _timing_event(), _timing_event()
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
