"""Bounded hardware calls.

A C call into NVML, a read of a sysfs file behind a dead PCIe link, or an
external tool can block forever, and Python cannot interrupt a thread stuck
in C. So every call runs on a worker thread of a *lane* (a GPU, the host
files, ...), and the caller waits at most its timeout.

A call that does not return within its timeout is declared *hung* by the
caller that gave up on it, and its worker is left to it. From then until that
call returns, the lane answers at once with ``LaneHung`` (an ``HwTimeout``
naming the hung call) instead of making anyone wait again or piling up
threads: for a GPU lane every call (a GPU whose NVML calls hang is itself the
fault), for the host-file lane only a read of the same file (one file that
never answers must cost only the readings of that file). When the stuck call
finally returns, the lane recovers.

A lane runs calls on up to ``LanePolicy.workers`` threads, so a call never
waits behind another caller's call that is still within its bound (a check
asking GPU 4 for its Xid events must not wait out another check's call that
hangs on GPU 4). Extra workers end after ``IDLE_S`` without work.

A call made of steps (``call_steps``: a batch of file reads) is bounded per
step: a batch that keeps making progress is not cut short, and the step that
hangs is the call that is named and remembered.

The caller's thread records which call it is waiting on, so the runner can say
"hung after N s in nvmlDeviceGetTemperature(gpu/3)".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gpumon.errors import HwTimeout

T = TypeVar("T")

# A step of a call: ``step(label)`` before each part, so that the part that hangs is the one
# named; False once the caller has given up (the job should return without doing more).
Step = Callable[[str], bool]

# Extra workers (beyond a lane's first) end after this long without work.
IDLE_S = 30.0


@dataclass(frozen=True)
class LanePolicy:
    # calls of different callers run side by side on up to this many threads
    workers: int = 1
    # a hung call refuses only later calls with the same label (a host file), not the whole lane
    per_call: bool = False


# Lanes are named "<family><n>" ("gpu3") or by family alone ("hostfs"); unknown families get one worker.
DEFAULT_POLICIES: Mapping[str, LanePolicy] = {
    # One GPU, several checks asking it at once: each gets a worker of its own, so none waits
    # behind a call of another check; four covers the NVML checks that run at the same moment in
    # one-shot `gpumon check` (bounded: a GPU whose calls all hang keeps at most four threads).
    "gpu": LanePolicy(workers=4),
    # Host files: a FIFO-like file that never answers costs one worker and only its own reads;
    # eight stuck files at once and the host-file lane answers "not attempted" for everything.
    "hostfs": LanePolicy(workers=8, per_call=True),
}


class LaneHung(HwTimeout):
    """A call not attempted: the call it would have waited behind is known to hang. Raised at once.

    ``call`` names the hung call, ``seconds`` its bound: as a finding this reads "hung after 5 s
    in nvmlDeviceGetTemperature(gpu/4)", the same as the caller that gave up on that call reported.
    """


class _Job:
    __slots__ = ("component", "error", "fn", "label", "result", "state", "step", "stop", "timeout",
                 "worker")

    def __init__(self, fn: Callable[[Step], Any], label: str, component: str, timeout: float) -> None:
        self.fn = fn
        self.label = label
        self.component = component
        self.timeout = timeout
        self.state = "queued"  # queued | running | done
        self.result: Any = None
        self.error: BaseException | None = None
        # (label, monotonic start) of the part running now; one assignment, read without the lock
        self.step: tuple[str, float] = (label, 0.0)
        self.stop = False
        self.worker: _Worker | None = None

    def mark(self, label: str) -> bool:
        self.step = (label, time.monotonic())
        return not self.stop


@dataclass(frozen=True)
class _Hung:
    label: str
    since: float
    timeout: float


class _Worker:
    def __init__(self, lane: _Lane, index: int, lock: threading.Lock) -> None:
        self.lane = lane
        self.index = index
        self.jobs: deque[_Job] = deque()
        self.current: _Job | None = None
        self.hung: _Hung | None = None
        self.wake = threading.Condition(lock)
        self.thread: threading.Thread | None = None


class _Lane:
    def __init__(self, name: str, policy: LanePolicy) -> None:
        self.name = name
        self.policy = policy
        self.workers: list[_Worker] = []
        self.spawned = 0


class BoundedCaller:
    """Runs hardware calls on per-lane worker threads with a deadline."""

    def __init__(self, policies: Mapping[str, LanePolicy] | None = None) -> None:
        self._policies = dict(DEFAULT_POLICIES if policies is None else policies)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified whenever a job ends or a lane hangs
        self._lanes: dict[str, _Lane] = {}
        self._waiting: dict[int, _Job] = {}
        # helper thread -> the thread it calls for (``on_behalf_of``: a check reading its GPUs at once)
        self._delegates: dict[int, int] = {}

    # -- calls -----------------------------------------------------------

    def call(self, lane: str, label: str, fn: Callable[[], T], timeout: float,
             component: str = "node") -> T:
        """``fn()`` on a worker of ``lane``; HwTimeout if it does not return within ``timeout``,
        LaneHung at once if the lane (or, for host files, this same call) is known to hang."""
        result: T = self._run(lane, label, lambda step: fn(), timeout, component)
        return result

    def call_steps(self, lane: str, label: str, fn: Callable[[Step], T], timeout: float,
                   component: str = "node") -> T:
        """``fn(step)``, each step bounded by ``timeout`` from its start; the step that hangs is
        the call named in the HwTimeout (and remembered as hung, see ``known_hung``)."""
        result: T = self._run(lane, label, fn, timeout, component)
        return result

    def known_hung(self, lane: str, label: str, component: str = "node") -> LaneHung | None:
        """The condition a call ``label`` on ``lane`` would be refused with now, or None."""
        with self._lock:
            return self._refusal(lane, label, component)

    def current_call(self, thread_ident: int) -> str | None:
        """The hardware call the given thread is waiting on, if any (or one of the threads that
        call on its behalf is: the longest-running of them)."""
        job = self._waiting.get(thread_ident)
        if job is None:
            helpers = [j for t, j in list(self._waiting.items()) if self._delegates.get(t) == thread_ident]
            job = min(helpers, key=lambda j: j.step[1], default=None)
        return job.step[0] if job is not None else None

    @contextlib.contextmanager
    def on_behalf_of(self, parent: int) -> Iterator[None]:
        """The calls this thread makes inside are named as ``parent``'s in ``current_call``."""
        me = threading.get_ident()
        self._delegates[me] = parent
        try:
            yield
        finally:
            self._delegates.pop(me, None)

    def _run(self, lane_name: str, label: str, fn: Callable[[Step], Any], timeout: float,
             component: str) -> Any:
        job = _Job(fn, label, component, timeout)
        me = threading.get_ident()
        with self._lock:
            refusal = self._refusal(lane_name, label, component)
            if refusal is not None:
                raise refusal
            self._assign(self._lane(lane_name), job)
            self._waiting[me] = job
            try:
                self._wait(job)
            finally:
                self._waiting.pop(me, None)
        if job.error is not None:
            raise job.error
        return job.result

    def _wait(self, job: _Job) -> None:
        """Until ``job`` is done (lock held); HwTimeout when its running step passes its bound."""
        while job.state != "done":
            now = time.monotonic()
            worker = job.worker
            assert worker is not None
            if job.state == "running":
                label, since = job.step
                if now - since >= job.timeout:
                    self._declare(worker, job)
                    raise HwTimeout(f"{label} did not return within {job.timeout:g} s", call=label,
                                    component=job.component, seconds=job.timeout)
                self._done.wait(since + job.timeout - now)
                continue
            ahead = worker.current
            if ahead is None:  # the worker is about to take it
                self._done.wait(job.timeout)
                continue
            label, since = ahead.step
            if now - since >= ahead.timeout:
                # the call ahead of ours is past its bound: declared hung, ours moves on or is refused
                self._declare(worker, ahead)
                continue
            self._done.wait(since + ahead.timeout - now)

    # -- lanes (lock held) -------------------------------------------------

    def _lane(self, name: str) -> _Lane:
        lane = self._lanes.get(name)
        if lane is None:
            family = name.rstrip("0123456789") or name
            policy = self._policies.get(name) or self._policies.get(family) or LanePolicy()
            lane = self._lanes[name] = _Lane(name, policy)
        return lane

    def _refusal(self, name: str, label: str, component: str) -> LaneHung | None:
        lane = self._lanes.get(name)
        if lane is None:
            return None
        hung = [w.hung for w in lane.workers if w.hung is not None]
        if not hung:
            return None
        match: _Hung | None
        if lane.policy.per_call:
            match = next((h for h in hung if h.label == label), None)
            if match is None and len(hung) >= lane.policy.workers:
                match = min(hung, key=lambda h: h.since)  # every worker is stuck
        else:
            match = min(hung, key=lambda h: h.since)
        if match is None:
            return None
        return LaneHung(f"{label} not attempted: {match.label} has been hung for "
                        f"{time.monotonic() - match.since:.0f} s", call=match.label, component=component,
                        seconds=match.timeout)

    def _assign(self, lane: _Lane, job: _Job) -> None:
        live = [w for w in lane.workers if w.hung is None]
        worker = next((w for w in live if w.current is None and not w.jobs), None)
        if worker is None and len(lane.workers) < lane.policy.workers:
            worker = self._spawn(lane)
        if worker is None:
            if not live:
                refusal = self._refusal(lane.name, job.label, job.component)
                assert refusal is not None  # every worker is hung
                raise refusal
            worker = min(live, key=lambda w: len(w.jobs) + (w.current is not None))
        job.worker = worker
        worker.jobs.append(job)
        worker.wake.notify()

    def _spawn(self, lane: _Lane) -> _Worker:
        worker = _Worker(lane, lane.spawned, self._lock)
        lane.spawned += 1
        lane.workers.append(worker)
        worker.thread = threading.Thread(target=self._work, args=(worker,),
                                         name=f"gpumon-hw-{lane.name}-{worker.index}", daemon=True)
        worker.thread.start()
        return worker

    def _declare(self, worker: _Worker, job: _Job) -> None:
        """``job`` (running on ``worker``) is past its bound: the worker is left to it, and the calls
        queued behind it go to another worker or are refused."""
        if worker.hung is None:
            label, since = job.step
            worker.hung = _Hung(label, since, job.timeout)
        job.stop = True
        queued = [q for q in worker.jobs if q.state == "queued"]
        worker.jobs.clear()
        for q in queued:
            refusal = self._refusal(worker.lane.name, q.label, q.component)
            if refusal is None:
                try:
                    self._assign(worker.lane, q)
                    continue
                except LaneHung as exc:
                    refusal = exc
            q.error, q.state = refusal, "done"
        self._done.notify_all()

    def _work(self, worker: _Worker) -> None:
        lane = worker.lane
        with self._lock:
            while True:
                if not worker.jobs:
                    first = worker is lane.workers[0]
                    woken = worker.wake.wait(None if first else IDLE_S)
                    if not woken and not worker.jobs and worker.current is None and worker.hung is None:
                        lane.workers.remove(worker)
                        return
                    continue
                job = worker.jobs.popleft()
                if job.state != "queued":
                    continue
                job.state = "running"
                job.step = (job.label, time.monotonic())
                worker.current = job
                result: Any = None
                error: BaseException | None = None
                self._lock.release()
                try:
                    result = job.fn(job.mark)
                except BaseException as exc:  # handed to the caller, whatever it is
                    error = exc
                finally:
                    self._lock.acquire()
                worker.current = None
                worker.hung = None  # the stuck call returned: the lane recovers
                job.result, job.error, job.state = result, error, "done"
                self._done.notify_all()
