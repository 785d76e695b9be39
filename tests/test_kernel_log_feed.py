"""Issue 22 points 3 and 7: a check declares what it reads of the kernel log in one member
(``Check.kernel_log``, a ``KernelLogNeeds``), and the log reaches it one way: the runner asks a
``KernelLogFeed`` for each check's log (``ReadOnce`` for a snapshot, a saved log, a replay's step;
the daemon's ``KernelLogPump``). Optional members (after-suite step, canary judging) are declared
with defaults on ``Check``."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from gpumon.agent import Agent
from gpumon.check import Check, CheckContext, KernelLog, KernelLogNeeds
from gpumon.config import CheckSettings, Config
from gpumon.errors import GpumonError
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.hw.kernellog import FedCheck, KernelLogFeed, KernelLogSource, ReadOnce
from gpumon.hw.nvrm import XidEvent
from gpumon.kernel_pump import KernelLogPump
from gpumon.model import NODE, Finding
from gpumon.profiles import GENERIC
from gpumon.runner import Runner
from gpumon_checks.nvswitch import NvswitchCheck
from gpumon_checks.pcie import PcieCheck
from gpumon_checks.pcie_topology import PcieTopologyCheck
from gpumon_checks.sdc_canary import SdcCanaryCheck
from gpumon_checks.xid import XidCheck

XID = "4,{seq},{us},-;NVRM: Xid (PCI:0000:19:00): 13, pid={seq}, name=python, Graphics Exception"


class _Reads(Check):
    """Says what it was handed: how many events, or why the log was not available."""

    name = "reads"
    kernel_log = KernelLogNeeds(events=(XidEvent,))

    def run(self, ctx: CheckContext) -> list[Finding]:
        log = ctx.kernel_log
        said = f"{len(log.events)} events" if log.available else f"unavailable: {log.error}"
        return [self.ok(NODE, said)]


class _ReadsNothing(_Reads):
    name = "reads_nothing"
    kernel_log = None


class _ReadsToo(_Reads):
    name = "reads_too"


class _ReadsButNotHere(_Reads):
    name = "reads_not_here"

    def supported(self, inventory: Inventory) -> str | None:
        return "not on this node"


class _Counting(KernelLogFeed):
    """A feed that hands one Xid event to each check and remembers who asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def for_check(self, check: FedCheck) -> KernelLog:
        self.asked.append(check.name)
        return KernelLog(events=[XidEvent(13, "0000:19:00.0", 1, "python", "m", None)], source="test")


def _runner(tmp_path: Path) -> Runner:
    names = ("reads", "reads_too", "reads_nothing", "reads_not_here")
    config = Config(check_settings={n: CheckSettings(timeout_s=5.0) for n in names})
    return Runner(Hardware(tmp_path), Inventory(), GENERIC, config, node="test")


def test_the_runner_asks_the_feed_once_per_run_of_each_check_that_declares_it(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    feed = _Counting()
    runs = {r.check: r for r in runner.run([_Reads(), _ReadsNothing(), _ReadsButNotHere()], feed)}
    assert runs["reads"].findings[0].message == "1 events"
    # no declaration: handed an unavailable log, and the feed is not asked for it
    assert runs["reads_nothing"].findings[0].message == "unavailable: kernel log not read in this run"
    # asked before the gate: what the daemon's pump kept for it is taken, as at every launch
    assert runs["reads_not_here"].outcome == "skipped"
    assert feed.asked == ["reads", "reads_not_here"]
    # no feed at all: not read in this run
    [run] = runner.run([_Reads()])
    assert run.findings[0].message == "unavailable: kernel log not read in this run"


def test_read_once_reads_at_the_first_check_that_asks_and_hands_every_check_that_read(
        tmp_path: Path) -> None:
    reads: list[int] = []

    def read() -> KernelLog:
        reads.append(1)
        return KernelLog(events=[XidEvent(13, "0000:19:00.0", 1, "python", "m", None)], source="test")

    runner = _runner(tmp_path)
    once = ReadOnce(read)
    runner.run([_ReadsNothing()], once)
    assert reads == []  # no check asked: nothing read
    runs = runner.run([_Reads(), _ReadsToo()], once)
    assert reads == [1] and [r.findings[0].message for r in runs] == ["1 events", "1 events"]


def test_the_daemons_pump_is_a_feed_and_keeps_the_mark_of_what_it_handed(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text("".join(XID.format(seq=i, us=i * 1000) + "\n" for i in (1, 2)))
    pump = KernelLogPump(lambda: KernelLogSource(path, boot_time=1.7e9, poll_interval=0.02, bounded=True),
                         threading.Event(), [XidCheck(), _ReadsNothing()], boot="b", marks={})
    pump.start()
    try:
        assert pump.first_read.wait(5.0)
        deadline = time.monotonic() + 5.0
        while pump.records < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # only the checks that declare kernel_log are subscribed
        assert set(pump.queues) == {"xid"}
        log = pump.for_check(XidCheck())
        assert [e.record.seq for e in log.events] == [1, 2]
        assert pump.handed_mark("xid") == {"boot": "b", "seq": 2, "us": 2000}
        assert pump.handed_mark("xid") is None  # forgotten once asked
        assert pump.handed_mark("reads_nothing") is None
    finally:
        pump.close()


def test_kernel_log_use_is_one_declaration_with_only_what_a_check_uses() -> None:
    assert [f.name for f in dataclasses.fields(KernelLogNeeds)] == ["events", "fold", "repeats"]
    assert Check.kernel_log is None and Check().kernel_log_fold() is None
    assert XidCheck.kernel_log is not None and XidCheck.kernel_log.repeats
    assert NvswitchCheck.kernel_log is not None and NvswitchCheck.kernel_log.events is not None
    assert type(PcieCheck().kernel_log_fold()).__name__ == "AerFold"
    for gone in ("uses_kernel_log", "kernel_log_events", "kernel_log_records", "kernel_log_match",
                 "kernel_log_repeats"):
        assert not hasattr(Check, gone), gone


def test_after_suite_is_a_base_class_member_run_by_the_runner(tmp_path: Path) -> None:
    assert not Check.has_after_suite() and Check().after_suite(None) == []  # type: ignore[arg-type]
    assert PcieTopologyCheck.has_after_suite() and not XidCheck.has_after_suite()

    class Hook(Check):
        name = "reads"

        def run(self, ctx: CheckContext) -> list[Finding]:
            raise AssertionError("the after-suite step runs, not run")

        def after_suite(self, ctx: CheckContext) -> list[Finding]:
            return [self.ok(NODE, f"after, same state {ctx.state.get('x')}")]

    runner = _runner(tmp_path)
    runner.states.get("reads")["x"] = 1
    [run] = runner.run([Hook()], after_suite=True)
    assert type(run.findings[0]).__name__ == "Finding" and run.findings[0].message == "after, same state 1"


def test_canary_judging_is_a_base_class_member() -> None:
    from gpumon.sdc.cli import _judge

    assert SdcCanaryCheck.judges_canaries() and not XidCheck.judges_canaries()

    class NotAJudge(Check):
        name = "sdc_canary"

    with pytest.raises(GpumonError, match="is what judges a canary run"):
        _judge(Agent(Config(), {"sdc_canary": NotAJudge}))
    judge = _judge(Agent(Config(), {"sdc_canary": SdcCanaryCheck}))
    assert judge.__func__ is SdcCanaryCheck.canary_verdict  # type: ignore[attr-defined]
