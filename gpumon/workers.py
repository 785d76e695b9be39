"""The worker pool: one process per compute device, bounded, under the node's device lock.

The only pool of gpumon's compute: the bootstrap compute checks and the SDC canaries start their
processes here. torch is imported inside functions, so that gpumon works without torch installed (a
compute check then says ``skipped``: ``TORCH_MISSING``).

**Devices.** ``Hardware.devices`` (gpumon/hw/placement.py) says where the workers run: ``cuda`` when
torch sees CUDA devices; otherwise N CPU "devices" (one worker process each, one thread each) stand in
for GPUs, so that CI runs the same code path with device ``cpu`` and the gloo backend (DESIGN.md, "CPU
stand-ins for GPU compute").

**Workers.** ``run_workers`` starts one process per rank and waits for all of them within a
deadline. A worker that has not answered by then is killed and reported as ``hung``, with the
last phase it reported (``WorkerContext.progress``), so a hang names the worker and where it
hung. A worker that exits without an answer (segfault, OOM kill) is ``died``; one that raised
is ``error`` with its traceback. Processes come from the ``forkserver`` start method
(``mp_context``): like ``spawn`` the children start from a clean interpreter (no CUDA state or
threads of the agent are inherited, which a CUDA child forked from a CUDA parent cannot survive),
but torch is imported once, in the server, instead of once per worker: starting 4 workers that
import torch took 6.6 s with ``spawn`` and 0.04 s with a warm ``forkserver`` (1.1 s for the first,
which starts the server) on the 2-core development VM, measured 2026-11-30.

**The device lock** (``devices_held``): one compute job on the devices at a time.

The measurements the workers run live with their checks (checks/<name>/kernels.py) and return
plain, picklable records.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from gpumon.distribution import install_hint
from gpumon.errors import GpumonError
from gpumon.hw.placement import DeviceFaults, StandIn, normalize_uuid

if TYPE_CHECKING:
    from gpumon.hw.inventory import Inventory

A = TypeVar("A")
R = TypeVar("R")

TORCH_MISSING = f"torch not installed ({install_hint('compute')})"


def torch_missing() -> str | None:
    """``TORCH_MISSING`` when torch cannot be imported here, else None (torch is not imported)."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else TORCH_MISSING


def gpu_index_by_uuid(inventory: Inventory) -> dict[str, int]:
    """Normalized GPU UUID -> NVML index, to name a CUDA device by the GPU NVML calls it."""
    out: dict[str, int] = {}
    for info in inventory.gpus:
        key = normalize_uuid(info.uuid)
        if key:
            out[key] = info.index
    return out


def timing_event() -> Any:
    """A CUDA event that times device work."""
    import torch

    # torch.cuda.Event's constructor is unannotated in torch's own stubs
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


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
                 faults: DeviceFaults | None = None) -> None:
        self.rank = rank
        self.world = world
        self.kind = kind
        self.device = device
        self._faults = faults
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
        """Copies inside the block go from device ``src`` to ``dst``: through the placement's fault
        model when it has one (a slow link); on real devices this changes nothing."""
        if self._faults is not None:
            return self._faults.link(src, dst)
        return contextlib.nullcontext()


def mp_context() -> Any:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("forkserver")
    # Effective when the server starts (the first run); the same list every time.
    ctx.set_forkserver_preload(["torch", "gpumon.workers"])
    return ctx


def cuda_identity(index: int) -> dict[str, Any]:
    """Name and UUID of CUDA device ``index`` as seen inside a worker."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return {"index": index, "name": props.name, "uuid": normalize_uuid(str(props.uuid)),
            "sm_count": props.multi_processor_count}


def _entry(fn: Callable[[WorkerContext, Any], Any], rank: int, world: int, kind: str, bind: bool,
           threads: int, env: Mapping[str, str], barrier: Any, arg: Any, conn: Any,
           stand_ins: Sequence[StandIn] = (), faults: DeviceFaults | None = None) -> None:
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
                identity = _stand_in(stand_ins, rank if bind else None, faults)
        conn.send(("ident", identity))
        ctx = WorkerContext(rank, world, kind, device, conn, barrier, faults)
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


def _stand_in(stand_ins: Sequence[StandIn], rank: int | None, faults: DeviceFaults | None) -> dict[str, Any]:
    """Install the fault model of the GPUs this worker stands in for; its identity (as a CUDA worker's)."""
    if rank is None:
        if faults is not None:
            faults.install(None)
        return {"device": "cpu", "devices": [{"index": i, "uuid": s.uuid, "name": s.name}
                                             for i, s in enumerate(stand_ins)]}
    own = stand_ins[rank]
    if faults is not None:
        faults.install(own.index)
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
                stand_ins: Sequence[StandIn] = (), faults: DeviceFaults | None = None) -> WorkerRun:
    """Run ``fn(ctx, args[rank])`` in one process per rank; every worker answers within ``timeout_s``.

    ``fn`` must be a module-level function (it is pickled by name). ``bind``: rank r uses CUDA
    device r. ``barrier``: workers may call ``ctx.barrier()``. ``on_tick(progress by rank)`` is
    called about every ``tick_s`` while the workers run (readings during a burn). With
    ``peer_failure_grace_s``, once a worker has failed the others get that long and are then
    killed (ranks of a collective hang forever when a peer dies). ``lock_wait_s``: how long to
    wait for another compute job to release the devices before raising ``DevicesBusy``.
    ``stand_ins`` (``kind="cpu"``, ``Placement.stand_ins``): the GPUs the workers stand in for, rank
    r for ``stand_ins[r]`` (with ``bind=False`` one worker for all of them), applying ``faults``
    (``Placement.faults``).
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
                           grace=peer_failure_grace_s, name=name, waited=waited, stand_ins=tuple(stand_ins),
                           faults=faults)


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
                grace: float | None, name: str, waited: float, stand_ins: tuple[StandIn, ...],
                faults: DeviceFaults | None) -> WorkerRun:
    mp = mp_context()
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
                                    stand_ins, faults))
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


class WorkerGroup:
    """Worker processes kept for a conversation over their pipes (the SDC canary's session: workers
    started once, iterations asked for on demand), where ``run_workers`` runs one function to its
    end. Every wait is bounded; a worker that dies or does not answer is marked failed, with why.
    The node's devices are held from the start of the workers to their end: work beside a compute
    check would measure it.

    ``target(index, conn, *args)`` runs in each worker and answers on ``conn``; a ``("stop",)``
    message asks it to return."""

    def __init__(self, holder: str, target: Callable[..., None], count: int, args: tuple[Any, ...], *,
                 lock_wait_s: float = 0.0, name: str = "gpumon-worker") -> None:
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        self.procs: dict[int, Any] = {}
        self.failed: dict[int, str] = {}
        self.startup_failed: set[int] = set()
        held = devices_held(holder, lock_wait_s)
        held.__enter__()
        self._held: contextlib.AbstractContextManager[float] | None = held
        try:
            ctx = mp_context()
            for i in range(count):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(i, child, *args), daemon=True, name=f"{name}-{i}")
                proc.start()
                child.close()
                self.conns[i], self.procs[i] = parent, proc
        except BaseException:
            self.close()
            raise

    def alive(self) -> list[int]:
        return [i for i in self.conns if i not in self.failed]

    def gather(self, workers: Sequence[int], timeout: float, what: str) -> dict[int, Any]:
        """One message from each worker, within ``timeout``; the others are marked failed."""
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        pending = set(workers)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = multiprocessing.connection.wait([self.conns[i] for i in pending], timeout=left)
            for conn in ready:
                i = next(k for k, c in self.conns.items() if c is conn)
                try:
                    out[i] = self.conns[i].recv()
                except (EOFError, OSError):
                    code = self.procs[i].exitcode
                    self.procs[i].join(timeout=5)
                    self.failed[i] = f"worker died during {what} (exit code {self.procs[i].exitcode or code})"
                pending.discard(i)
        for i in pending:
            self.failed[i] = f"hung: no answer within {timeout:g} s during {what}"
        return out

    def send(self, worker: int, msg: Any) -> None:
        try:
            self.conns[worker].send(msg)
        except (BrokenPipeError, OSError):
            self.failed[worker] = "worker gone (pipe closed)"

    def close(self) -> None:
        try:
            for i in self.alive():
                self.send(i, ("stop",))
            for i, proc in self.procs.items():
                proc.join(timeout=10 if i not in self.failed else 0.1)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        finally:
            # whatever interrupted the stop, the device lock is not left held: every later
            # compute check would say "devices busy"
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
            for conn in self.conns.values():
                conn.close()
            self.conns.clear()
            if self._held is not None:
                self._held.__exit__(None, None, None)
                self._held = None


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
