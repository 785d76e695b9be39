"""Bounded hardware calls.

A C call into NVML, a read of a sysfs file behind a dead PCIe link, or an
external tool can block forever, and Python cannot interrupt a thread stuck
in C. So every call runs on a worker thread owned by a *lane* (one per GPU,
one for sysfs, ...), and the caller waits at most its timeout. A lane whose
worker is still stuck answers later calls at once with ``HwTimeout`` instead
of piling up threads; when the stuck call finally returns the lane recovers.

The caller's thread records which call it is in, so the runner can say
"hung after N s in nvmlDeviceGetTemperature(gpu/3)".
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from gpumon.errors import HwTimeout

T = TypeVar("T")


@dataclass
class _Job:
    fn: Callable[[], Any]
    future: Future[Any]
    label: str


class _Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.busy_with: str | None = None
        self.busy_since = 0.0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, name=f"gpumon-hw-{name}", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            with self.lock:
                self.busy_with, self.busy_since = job.label, time.monotonic()
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:
                job.future.set_exception(exc)
            finally:
                with self.lock:
                    self.busy_with = None


class BoundedCaller:
    """Runs hardware calls on per-lane worker threads with a deadline."""

    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._activity: dict[int, str] = {}

    def _lane(self, name: str) -> _Lane:
        with self._lock:
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = _Lane(name)
            return lane

    def call(self, lane: str, label: str, fn: Callable[[], T], timeout: float,
             component: str = "node") -> T:
        worker = self._lane(lane)
        with worker.lock:
            stuck, since = worker.busy_with, worker.busy_since
        if stuck is not None and time.monotonic() - since > timeout:
            raise HwTimeout(f"{label} not attempted: {stuck} has been hung for "
                            f"{time.monotonic() - since:.0f} s", call=stuck, component=component,
                            seconds=timeout)
        future: Future[T] = Future()
        me = threading.get_ident()
        self._activity[me] = label
        try:
            worker.jobs.put(_Job(fn, future, label))
            try:
                return future.result(timeout=timeout)
            except FutureTimeout:
                future.cancel()
                raise HwTimeout(f"{label} did not return within {timeout:g} s", call=label,
                                component=component, seconds=timeout) from None
        finally:
            self._activity.pop(me, None)

    def current_call(self, thread_ident: int) -> str | None:
        """The hardware call the given thread is waiting on, if any."""
        return self._activity.get(thread_ident)

    def hung_lanes(self, older_than: float) -> dict[str, str]:
        now = time.monotonic()
        out: dict[str, str] = {}
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            with lane.lock:
                if lane.busy_with is not None and now - lane.busy_since > older_than:
                    out[lane.name] = lane.busy_with
        return out
