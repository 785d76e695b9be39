"""The runner: deadlines, hung checks, exceptions, capability gates."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpumon.check import Check, CheckContext
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
