"""The runner: deadlines, hung checks, exceptions, capability gates."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import ClassVar

from gpumon.check import Check, CheckContext
from gpumon.checkstate import CheckStateStore
from gpumon.config import CheckSettings, Config
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Finding, Severity
from gpumon.profiles import GENERIC
from gpumon.runner import Runner


class Quick(Check):
    name = "quick"

    def run(self, ctx: CheckContext) -> list[Finding]:
        return [self.ok(NODE, "fine")]


class Sleeper(Check):
    name = "sleeper"
    release = threading.Event()

    def run(self, ctx: CheckContext) -> list[Finding]:
        self.release.wait(30)
        return [self.ok(NODE, "woke")]


class HangsInHostRead(Check):
    """Blocks inside a bounded hardware call (a FIFO with no writer blocks open())."""

    name = "fifo"

    def run(self, ctx: CheckContext) -> list[Finding]:
        ctx.hw.fs.read_text("sys/stuck")
        return [self.ok(NODE, "read")]


class Boom(Check):
    name = "boom"

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise KeyError("missing")


class Silent(Check):
    name = "silent"

    def run(self, ctx: CheckContext) -> list[Finding]:
        return []


class NotHere(Check):
    name = "nothere"

    def supported(self, inventory: Inventory) -> str | None:
        return "no NVLink on this SKU"

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise AssertionError("must not run")


def _runner(tmp_path: Path, timeouts: dict[str, float], fs_timeout: float = 2.0) -> Runner:
    settings = {name: CheckSettings(timeout_s=t) for name, t in timeouts.items()}
    config = Config(check_settings=settings)
    hw = Hardware(tmp_path, fs_timeout=fs_timeout)
    return Runner(hw, Inventory(), GENERIC, config, node="test")


def test_hung_check_reported_within_timeout_plus_one_while_others_finish(tmp_path: Path) -> None:
    runner = _runner(tmp_path, {"sleeper": 1.0, "quick": 5.0})
    start = time.monotonic()
    runs = runner.run([Sleeper(), Quick()])
    elapsed = time.monotonic() - start
    try:
        assert elapsed < 2.0
        by = {r.check: r for r in runs}
        assert by["quick"].outcome == "completed"
        # its own run time, not when it was collected (after the hung check's earlier deadline)
        assert by["quick"].seconds < 0.5
        hung = by["sleeper"].findings[0]
        assert by["sleeper"].outcome == "hung" and hung.severity is Severity.FAIL
        assert hung.message == "hung after 1 s in check code (no hardware call in progress)"
        # not started twice while still stuck
        again = runner.run([Sleeper()])
        assert again[0].outcome == "still-hung"
    finally:
        Sleeper.release.set()


def test_hang_names_the_hardware_call(tmp_path: Path) -> None:
    import os
    (tmp_path / "sys").mkdir()
    os.mkfifo(tmp_path / "sys" / "stuck")
    runner = _runner(tmp_path, {"fifo": 1.0, "quick": 5.0}, fs_timeout=30.0)
    start = time.monotonic()
    runs = runner.run([HangsInHostRead(), Quick()])
    assert time.monotonic() - start < 2.0
    finding = runs[0].findings[0]
    assert finding.message == "hung after 1 s in read(sys/stuck)"
    # unblock the worker thread so it does not outlive the test
    fd = os.open(tmp_path / "sys" / "stuck", os.O_WRONLY)
    os.close(fd)


def test_bounded_read_times_out_as_finding(tmp_path: Path) -> None:
    import os
    (tmp_path / "sys").mkdir()
    os.mkfifo(tmp_path / "sys" / "stuck")
    runner = _runner(tmp_path, {"fifo": 10.0}, fs_timeout=0.3)
    runs = runner.run([HangsInHostRead()])
    f = runs[0].findings[0]
    assert f.severity is Severity.FAIL and f.message == "hung after 0.3 s in read(sys/stuck)"
    fd = os.open(tmp_path / "sys" / "stuck", os.O_WRONLY)
    os.close(fd)


def test_exception_and_empty_result_are_unknown(tmp_path: Path) -> None:
    runs = _runner(tmp_path, {}).run([Boom(), Silent(), Quick()])
    by = {r.check: r.findings[0] for r in runs}
    assert by["boom"].severity is Severity.UNKNOWN and "KeyError" in by["boom"].message
    assert by["silent"].severity is Severity.UNKNOWN and "no findings" in by["silent"].message
    assert by["quick"].severity is Severity.OK


def test_capability_gate_gives_skipped_with_reason(tmp_path: Path) -> None:
    runs = _runner(tmp_path, {}).run([NotHere()])
    f = runs[0].findings[0]
    assert (f.severity, f.message) == (Severity.SKIPPED, "no NVLink on this SKU")


class WhereAmI(Check):
    """Records the thread each run ran on."""

    name = "whereami"
    threads: ClassVar[list[int]] = []

    def run(self, ctx: CheckContext) -> list[Finding]:
        self.threads.append(threading.get_ident())
        return [self.ok(NODE, "here")]


def test_a_check_run_again_runs_on_its_kept_thread(tmp_path: Path) -> None:
    runner = _runner(tmp_path, {})
    WhereAmI.threads = []
    for _ in range(3):
        assert runner.run([WhereAmI()])[0].outcome == "completed"
    assert len(WhereAmI.threads) == 3 and len(set(WhereAmI.threads)) == 1
    assert threading.get_ident() not in WhereAmI.threads


def test_a_check_whose_kept_thread_is_busy_runs_on_a_thread_of_its_own(tmp_path: Path) -> None:
    # the window in which a check has returned but its thread has not yet taken up the next job
    runner = _runner(tmp_path, {})
    WhereAmI.threads = []
    runner.run([WhereAmI()])
    gate = threading.Event()
    assert runner._threads["whereami"].submit(lambda: gate.wait(5))
    try:
        start = time.monotonic()
        assert runner.run([WhereAmI()])[0].outcome == "completed"
        assert time.monotonic() - start < 1.0  # not queued behind the busy thread
    finally:
        gate.set()
    assert len(set(WhereAmI.threads)) == 2


def test_a_hung_check_keeps_its_thread_and_the_next_run_after_it_returns_completes(tmp_path: Path) -> None:
    runner = _runner(tmp_path, {"sleeper": 0.5, "quick": 5.0})
    Sleeper.release.clear()
    try:
        start = time.monotonic()
        by = {r.check: r for r in runner.run([Sleeper(), Quick()])}
        assert time.monotonic() - start < 1.5
        assert (by["sleeper"].outcome, by["quick"].outcome) == ("hung", "completed")
        assert runner.run([Sleeper()])[0].outcome == "still-hung"
    finally:
        Sleeper.release.set()
    deadline = time.monotonic() + 5
    runs = runner.run([Sleeper()])
    while runs[0].outcome == "still-hung" and time.monotonic() < deadline:
        time.sleep(0.02)  # the released run is winding up
        runs = runner.run([Sleeper()])
    assert runs[0].outcome == "completed" and runs[0].findings[0].message == "woke"
    Sleeper.release.clear()


def test_worker_ends_when_idle_and_after_a_job_that_raises() -> None:
    from gpumon.runner import CheckThread

    done = threading.Event()
    idle = CheckThread("idle", idle_s=0.1)
    assert idle.submit(done.set) and done.wait(2)
    assert idle.idle.wait(2)
    idle.thread.join(2)
    assert not idle.thread.is_alive() and not idle.alive
    assert not idle.submit(done.set)  # an ended worker takes nothing: the caller makes a new one

    seen: list[type[BaseException]] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_type)
    try:
        boom = CheckThread("boom")
        assert boom.submit(lambda: {}["missing"])
        boom.thread.join(2)
    finally:
        threading.excepthook = hook
    # as a thread of its own would: the exception is reported and the thread ends
    assert seen == [KeyError] and not boom.alive and not boom.busy and boom.idle.is_set()


def test_worker_takes_one_job_at_a_time() -> None:
    from gpumon.runner import CheckThread

    gate, ran = threading.Event(), threading.Event()
    w = CheckThread("one")
    assert w.submit(lambda: gate.wait(5))
    assert w.busy and not w.idle.is_set()
    assert not w.submit(ran.set)  # busy: not queued behind the stuck job
    gate.set()
    assert w.idle.wait(2) and not w.busy
    assert w.submit(ran.set) and ran.wait(2)


class Counts(Check):
    """Keeps a run counter in its persisted state, trusting its shape as a check of an older
    release would (the state is JSON the daemon saved)."""

    name = "counts"

    def run(self, ctx: CheckContext) -> list[Finding]:
        ctx.state["runs"] = ctx.state.get("runs", 0) + 1
        return [self.ok(NODE, f"run {ctx.state['runs']}")]


def _persisted_runner(tmp_path: Path, states: CheckStateStore) -> Runner:
    config = Config(check_settings={"counts": CheckSettings(timeout_s=5.0)})
    return Runner(Hardware(tmp_path), Inventory(), GENERIC, config, node="test", states=states)


def test_saved_state_the_check_cannot_use_is_set_aside_and_the_next_run_starts_afresh(tmp_path: Path) -> None:
    store_dir = tmp_path / "checks"
    first = CheckStateStore(store_dir)
    runner = _persisted_runner(tmp_path, first)
    assert [f.message for f in runner.run([Counts()])[0].findings] == ["run 1"]
    assert first.save("counts")
    # valid JSON of another shape (a hand edit, another release): the check raises on it
    (store_dir / "counts.json").write_text('{"runs": "seven"}')
    restarted = CheckStateStore(store_dir)
    runner = _persisted_runner(tmp_path, restarted)
    once = runner.run([Counts()])[0]  # once is no proof: kept
    assert once.outcome == "error" and "set aside" not in once.findings[0].message
    assert (store_dir / "counts.json").exists()
    run = runner.run([Counts()])[0]
    assert run.outcome == "error"
    (f,) = run.findings
    assert f.severity is Severity.UNKNOWN and "set aside" in f.message
    (aside,) = store_dir.glob("counts.corrupt-*")
    assert aside.read_text() == '{"runs": "seven"}' and f.evidence["state_set_aside"] == str(aside)
    assert not (store_dir / "counts.json").exists()
    assert [f.message for f in runner.run([Counts()])[0].findings] == ["run 1"]  # afresh, for good
    assert restarted.save("counts") and (store_dir / "counts.json").read_text() == '{"runs":1}'


class FailsOnce(Counts):
    """Raises on its first run only (an odd input line, a bug on a path taken once)."""

    failed = False

    def run(self, ctx: CheckContext) -> list[Finding]:
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "an odd line")
        return super().run(ctx)


def test_a_one_off_exception_right_after_a_restart_keeps_the_saved_state(tmp_path: Path) -> None:
    store_dir = tmp_path / "checks"
    store_dir.mkdir()
    (store_dir / "counts.json").write_text('{"runs": 41}')
    store = CheckStateStore(store_dir)
    runner = _persisted_runner(tmp_path, store)
    assert runner.run([FailsOnce()])[0].outcome == "error"
    assert [f.message for f in runner.run([FailsOnce()])[0].findings] == ["run 42"]
    assert not list(store_dir.glob("counts.corrupt*"))


def test_state_the_check_ran_with_is_kept_when_it_raises_later(tmp_path: Path) -> None:
    """Only the first run on loaded state can blame the state: once a run completed with it, a
    later exception is the check's own (kept state, say, of an outage in progress, is not lost)."""
    store_dir = tmp_path / "checks"
    store_dir.mkdir()
    (store_dir / "counts.json").write_text('{"runs": 3}')
    store = CheckStateStore(store_dir)
    runner = _persisted_runner(tmp_path, store)
    assert [f.message for f in runner.run([Counts()])[0].findings] == ["run 4"]
    store.get("counts")["runs"] = "broken by the check itself"
    for _ in range(2):
        run = runner.run([Counts()])[0]
        assert run.outcome == "error" and "set aside" not in run.findings[0].message
    assert store.get("counts")["runs"] == "broken by the check itself"
    assert not list(store_dir.glob("counts.corrupt*"))
