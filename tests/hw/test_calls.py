"""BoundedCaller: lanes, hung calls answered at once, workers side by side, per-step bounds.

The calls here block on real threading events (as a C call blocks a thread): nothing in the
caller is patched. The NVML and host-file paths over the same caller are tested end to end in
tests/test_cli.py, tests/test_hung_host_files.py and tests/hw/test_hostfs_batch.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpumon.errors import HwTimeout
from gpumon.hw.calls import BoundedCaller, LaneHung, Step


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Calls blocked on it return when the test ends (their workers do not outlive it)."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hung_gpu_call_is_named_and_later_calls_are_answered_at_once(gate: threading.Event) -> None:
    caller = BoundedCaller()
    start = time.monotonic()
    with pytest.raises(HwTimeout) as first:
        caller.call("gpu4", "nvmlDeviceGetTemperature(gpu/4)", gate.wait, 0.2, "gpu/4")
    assert 0.2 <= time.monotonic() - start < 1.0
    assert not isinstance(first.value, LaneHung)
    assert (first.value.call, first.value.seconds) == ("nvmlDeviceGetTemperature(gpu/4)", 0.2)
    # every later call to that GPU: refused at once, naming the hung call, in the caller's component
    start = time.monotonic()
    for _ in range(5):
        with pytest.raises(LaneHung) as later:
            caller.call("gpu4", "nvmlDeviceGetPowerUsage(gpu/4)", lambda: 1, 0.2, "gpu/4")
        assert (later.value.call, later.value.component, later.value.seconds) == (
            "nvmlDeviceGetTemperature(gpu/4)", "gpu/4", 0.2)
        assert "nvmlDeviceGetPowerUsage(gpu/4) not attempted" in str(later.value)
    assert time.monotonic() - start < 0.5  # five waits of 0.2 s would be 1 s
    assert caller.call("gpu5", "nvmlDeviceGetPowerUsage(gpu/5)", lambda: 5, 0.2) == 5  # other GPUs go on
    # the hung call returns: the lane recovers
    gate.set()
    deadline = time.monotonic() + 2
    while caller.known_hung("gpu4", "x") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert caller.call("gpu4", "nvmlDeviceGetPowerUsage(gpu/4)", lambda: 4, 0.2) == 4


def test_a_call_does_not_wait_behind_another_callers_call_in_progress(gate: threading.Event) -> None:
    """Issue 14 #2: a check's call to GPU 4 must not wait out another check's hung call on it."""
    caller = BoundedCaller()
    outcome: list[BaseException] = []

    def hung() -> None:
        try:
            caller.call("gpu4", "nvmlDeviceGetCurrentClocksEventReasons(gpu/4)", gate.wait, 5.0, "gpu/4")
        except HwTimeout as exc:
            outcome.append(exc)

    t = threading.Thread(target=hung, daemon=True)
    t.start()
    time.sleep(0.1)  # in progress, well within its 5 s bound
    start = time.monotonic()
    assert caller.call("gpu4", "nvmlDeviceRegisterEvents(gpu/4)", lambda: "registered", 5.0) == "registered"
    assert time.monotonic() - start < 0.5
    gate.set()
    t.join(2)
    assert not outcome  # and the first call returned normally


def test_calls_queued_behind_a_call_that_hangs_move_to_another_worker_or_are_refused(
        gate: threading.Event) -> None:
    # one worker: the queued call waits only until the call ahead passes its bound, then is refused
    caller = BoundedCaller()
    errors: list[BaseException] = []

    def ahead() -> None:
        try:
            caller.call("nvml-system", "nvmlDeviceGetCount", gate.wait, 0.3)
        except HwTimeout as exc:
            errors.append(exc)

    t = threading.Thread(target=ahead, daemon=True)
    t.start()
    time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(LaneHung) as refused:
        caller.call("nvml-system", "nvmlSystemGetDriverVersion", lambda: "x", 5.0)
    assert time.monotonic() - start < 1.0 and refused.value.call == "nvmlDeviceGetCount"
    t.join(2)
    assert errors and errors[0].call == "nvmlDeviceGetCount"


def test_each_step_is_bounded_on_its_own(gate: threading.Event) -> None:
    caller = BoundedCaller()

    def slow_steps(step: Step) -> int:
        for i in range(4):  # 4 x 0.15 s: longer than the 0.3 s bound, but each part within it
            step(f"read(part{i})")
            time.sleep(0.15)
        return 4

    assert caller.call_steps("hostfs", "read(batch)", slow_steps, 0.3) == 4

    def stuck_third(step: Step) -> None:
        for i in range(4):
            if not step(f"read(part{i})"):
                return
            if i == 2:
                gate.wait()

    with pytest.raises(HwTimeout) as hung:
        caller.call_steps("hostfs", "read(batch)", stuck_third, 0.3)
    assert hung.value.call == "read(part2)"  # the part that hangs is the call named
    # host files: only that same file is refused; the others are read by another worker
    assert isinstance(caller.known_hung("hostfs", "read(part2)"), LaneHung)
    assert caller.known_hung("hostfs", "read(part3)") is None
    assert caller.call("hostfs", "read(part3)", lambda: "3", 0.3) == "3"


def test_a_lane_keeps_no_more_stuck_workers_than_its_policy(gate: threading.Event) -> None:
    caller = BoundedCaller()
    for i in range(8):  # the host-file lane's eight workers, each stuck in another file
        with pytest.raises(HwTimeout):
            caller.call("hostfs", f"read(fifo{i})", gate.wait, 0.05)
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(LaneHung) as full:
        caller.call("hostfs", "read(regular)", lambda: "x", 0.05)
    assert time.monotonic() - start < 0.2 and threading.active_count() == before
    assert full.value.call == "read(fifo0)"  # the longest-stuck one is named
    gate.set()
    deadline = time.monotonic() + 2
    while caller.known_hung("hostfs", "read(regular)") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert caller.call("hostfs", "read(regular)", lambda: "x", 0.05) == "x"
