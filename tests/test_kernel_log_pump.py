"""The daemon's kernel-log pump under a storm (issue 14): each check is handed only what it reads,
its queue is bounded (drops reported as lost records), a repeat waits out the minimum gap between
runs while a new fault runs the check at once, and the watermark stored beside a check's state
moves only when the daemon stores it after a completed run.

A real pump thread following a real file in /dev/kmsg record format, the real xid, nvswitch and
pcie checks; the host is a directory with a boot id and a check-state store (what the pump takes
from the daemon's agent)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.check import Check, CheckContext, KernelLogNeeds
from gpumon.checkstate import CheckStateStore
from gpumon.export.prometheus import FAMILIES, Snapshot, SnapshotHolder, make_registry
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory, PciDevice
from gpumon.hw.kernellog import KernelLogSource
from gpumon.hw.nvml import GpuInfo
from gpumon.hw.nvrm import GpuIdentity, SXidEvent, XidEvent
from gpumon.kernel_pump import KERNEL_LOG_GAP_S, WATERMARK_STATE, KernelLogPump
from gpumon.model import Finding, Severity
from gpumon.profiles import GENERIC
from gpumon_checks.nvswitch import NvswitchCheck
from gpumon_checks.pcie import AerDelta, PcieCheck
from gpumon_checks.xid import XidCheck, XidConfig

BOOT_S = 1_700_000_000.0
PORT = "0000:17:00.0"


def xid(seq: int, code: int = 13, bus: str = "0000:19:00", pid: int = 1234) -> str:
    return f"4,{seq},{seq * 1000},-;NVRM: Xid (PCI:{bus}): {code}, pid={pid}, name=python, Graphics Exception"


def sxid(seq: int) -> str:
    return (f"4,{seq},{seq * 1000},-;nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, "
            "Link 32 egress")


def aer(seq: int, severity: str = "Correctable") -> list[str]:
    return [f"6,{seq},{seq * 1000},-;pcieport {PORT}: AER: Correctable error message received from {PORT}",
            f"4,{seq + 1},{seq * 1000},-;pcieport {PORT}: PCIe Bus Error: severity={severity}, "
            "type=Physical Layer, (Receiver ID)",
            f"4,{seq + 2},{seq * 1000},-;pcieport {PORT}:   device [1000:c030] "
            "error status/mask=00000001/00002000",
            f"4,{seq + 3},{seq * 1000},-;pcieport {PORT}:    [ 0] RxErr                  (First)"]


class _Host:
    """What the pump takes from the daemon: a source of the log, the boot id, the watermarks stored
    beside the checks' state."""

    def __init__(self, root: Path) -> None:
        (root / "proc/sys/kernel/random").mkdir(parents=True)
        (root / "proc/sys/kernel/random/boot_id").write_text("7d6a1d2e-boot\n")
        self.hw = Hardware(root)
        self.kmsg_path = root / "kmsg"
        self.kmsg_path.write_text("")
        self.check_state = CheckStateStore(root / "checks")

    def source(self) -> KernelLogSource:
        return KernelLogSource(self.kmsg_path, boot_time=BOOT_S, poll_interval=0.02, bounded=True)

    def append(self, *lines: str) -> None:
        with open(self.kmsg_path, "a") as fh:
            fh.write("".join(line + "\n" for line in lines))


class _Everything(Check):
    """A kernel-log check that declares nothing more (a third party's): it gets every event and record."""

    name = "everything"
    kernel_log = KernelLogNeeds()

    def run(self, ctx: CheckContext) -> list[Finding]:
        return []


@pytest.fixture
def host(tmp_path: Path) -> _Host:
    return _Host(tmp_path)


def _until(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def pump(host: _Host) -> Iterator[Callable[..., KernelLogPump]]:
    made: list[KernelLogPump] = []

    def start(*checks: Check, **kwargs: Any) -> KernelLogPump:
        subscribers = list(checks) or [XidCheck(), NvswitchCheck(), PcieCheck()]
        p = KernelLogPump(host.source, threading.Event(), subscribers,
                          boot=host.hw.fs.boot_id(), marks=host.check_state.get(WATERMARK_STATE), **kwargs)
        p.start()
        assert p.first_read.wait(5.0)
        made.append(p)
        return p

    yield start
    for p in made:
        p.close()


def _read(p: KernelLogPump, records: int) -> None:
    assert _until(lambda: p.records >= records), f"the pump read {p.records} of {records} records"


def test_each_check_is_handed_only_what_it_reads(host: _Host, pump: Callable[..., KernelLogPump]) -> None:
    host.append(xid(1), sxid(2), *aer(3), "6,7,7000,-;usb 1-1: new high-speed USB device number 2",
                "6,8,8000,-;NVRM: GPU at PCI:0000:19:00: GPU-3c7b2c2a-1f0e-4b1e-9d6c-0123456789ab")
    p = pump(XidCheck(), NvswitchCheck(), PcieCheck(), _Everything())
    _read(p, 8)
    log, _ = p.take("xid")
    assert [type(e) for e in log.events] == [XidEvent, GpuIdentity]
    assert list(log.records) == [] and log.folded is None
    log, _ = p.take("nvswitch")
    assert [type(e) for e in log.events] == [SXidEvent] and list(log.records) == []
    log, _ = p.take("pcie")
    assert list(log.events) == [] and list(log.records) == []
    assert isinstance(log.folded, AerDelta) and log.folded.kmsg[PORT]["correctable"]["count"] == 1
    log, _ = p.take("everything")  # declared nothing: everything, as before
    assert len(log.events) == 3 and [r.seq for r in log.records] == list(range(1, 9))
    # taken: nothing left for anyone
    assert all(not (lg.events or lg.records or lg.folded)
               for lg, _ in (p.take(n) for n in ("xid", "nvswitch", "pcie", "everything")))


def test_a_queue_is_bounded_and_what_it_drops_is_reported_lost(host: _Host,
                                                                  pump: Callable[..., KernelLogPump]) -> None:
    p = pump(XidCheck(), NvswitchCheck(), queue_max=100)
    host.append(*(xid(i, pid=i) for i in range(1, 301)))  # 300 different lines: none a repeat
    _read(p, 300)
    log, _ = p.take("xid")
    assert [e.record.seq for e in log.events] == list(range(201, 301))  # the newest are kept
    assert log.lost_records == 200 and log.records_read == 300
    log, _ = p.take("nvswitch")  # kept nothing of it: lost nothing
    assert log.lost_records == 0 and list(log.events) == []
    host.append(xid(301))
    _read(p, 301)
    log, _ = p.take("xid")
    assert len(log.events) == 1 and log.lost_records == 200  # a count since the daemon started


def test_a_repeat_waits_out_the_gap_and_a_new_fault_runs_at_once(host: _Host,
                                                                 pump: Callable[..., KernelLogPump]) -> None:
    p = pump()
    p.take("xid")
    host.append(xid(1))  # Xid 13 on 19:00: not seen lately, at once
    assert _until(lambda: p.has_pending("xid"), 2.0)
    p.take("xid")
    taken = time.monotonic()
    host.append(xid(2))  # the same again: waits until KERNEL_LOG_GAP_S after that take
    _read(p, 2)
    due = p.next_due()
    if time.monotonic() < taken + KERNEL_LOG_GAP_S - 0.05:
        assert not p.has_pending("xid")
        assert due is not None and abs(due - (taken + KERNEL_LOG_GAP_S)) < 0.05
    assert _until(lambda: p.has_pending("xid"), 2.0)
    log, _ = p.take("xid")
    assert [e.record.seq for e in log.events] == [2]
    host.append(xid(3, code=79, bus="0000:3b:00"))  # a new fault right after a take: at once
    _read(p, 3)
    assert p.has_pending("xid")
    assert not p.has_pending("nvswitch")  # nothing for it


def test_corrected_aer_reports_never_run_pcie_an_uncorrectable_one_at_once(
        host: _Host, pump: Callable[..., KernelLogPump]) -> None:
    p = pump()
    host.append(*(line for i in range(50) for line in aer(1 + 4 * i)))
    _read(p, 200)
    time.sleep(KERNEL_LOG_GAP_S + 0.1)
    assert not p.has_pending("pcie") and p.next_due() is None
    host.append(*aer(201, "Uncorrected (Fatal)"))
    _read(p, 204)
    assert p.has_pending("pcie")
    log, mark = p.take("pcie")
    entry = log.folded.kmsg[PORT]
    assert (entry["correctable"]["count"], entry["fatal"]["count"]) == (50, 1)
    assert mark is not None and mark["seq"] == 204


def test_take_leaves_the_stored_watermark_alone_and_a_restart_skips_only_what_was_stored(
        host: _Host, pump: Callable[..., KernelLogPump]) -> None:
    host.append(xid(1, pid=1), xid(2, pid=2), xid(3, pid=3))  # different lines: not counted as repeats
    p = pump()
    _read(p, 3)
    log, mark = p.take("xid")
    assert [e.record.seq for e in log.events] == [1, 2, 3]
    assert mark == {"boot": "7d6a1d2e-boot", "seq": 3, "us": 3000}
    # handing records out stores nothing: the daemon stores a mark once the run that counted
    # them has completed and the check's state is saved (Daemon._store_watermark)
    assert host.check_state.get(WATERMARK_STATE) == {}
    p.close()
    # a restart after a run that counted up to seq 2 was stored: the ring is read again
    host.check_state.get(WATERMARK_STATE)["xid"] = {"boot": "7d6a1d2e-boot", "seq": 2, "us": 2000}
    again = pump()
    _read(again, 3)
    log, _ = again.take("xid")
    assert [e.record.seq for e in log.events] == [3]
    # a mark of another boot is not this boot's
    again.close()
    host.check_state.get(WATERMARK_STATE)["xid"] = {"boot": "another-boot", "seq": 2, "us": 2000}
    other = pump()
    _read(other, 3)
    assert [e.record.seq for e in other.take("xid")[0].events] == [1, 2, 3]


def test_a_log_rewritten_with_the_old_lines_is_not_handed_over_twice(
        host: _Host, pump: Callable[..., KernelLogPump]) -> None:
    host.append(xid(1, pid=1), xid(2, pid=2))
    p = pump()
    _read(p, 2)
    assert len(p.take("xid")[0].events) == 2
    source = p.source
    assert source is not None and source.opens == 1
    # the file replaced by a copy that holds the old lines too: the new one is read from its start
    new = host.kmsg_path.with_name("kmsg.new")
    new.write_text("".join(line + "\n" for line in (xid(1, pid=1), xid(2, pid=2), xid(3, pid=3))))
    os.replace(new, host.kmsg_path)
    assert _until(lambda: source.opens == 2 and p.records >= 5)
    log, mark = p.take("xid")
    assert [e.record.seq for e in log.events] == [3]
    assert mark is not None and mark["seq"] == 3


def _xid_run(tmp_path: Path, log: Any, pcis: list[str], now: float) -> dict[str, Finding]:
    """The xid check's run on what the pump handed it, on a node whose GPUs sit at ``pcis``."""
    gpus = [GpuInfo(i, f"GPU-{i}", None, bus, "NVIDIA H100 80GB HBM3", "hopper", 18, i)
            for i, bus in enumerate(pcis)]
    inventory = Inventory(gpus=gpus, pci_devices=[PciDevice(b, "0x10de", "0x2330", "0x030200") for b in pcis])
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=inventory, profile=GENERIC, options=XidConfig(),
                       state={}, kernel_log=log, clock=lambda: now)
    return {f.component: f for f in XidCheck().run(ctx)}


def test_a_storm_of_one_line_is_counted_not_queued_and_a_distinct_xid_inside_it_is_judged(
        tmp_path: Path, host: _Host, pump: Callable[..., KernelLogPump]) -> None:
    """Issue 23 point 7: 3,000 copies of one Xid 13 line within 0.3 s, an Xid 79 on another GPU in
    the middle, and a queue bound of 100: the repeats are one event with their count (nothing
    pushed out), the Xid 79 reaches the check, and the check counts all 3,000."""
    lines = [f"4,{i},{i * 100},-;NVRM: Xid (PCI:0000:19:00): 13, pid=1234, name=python, Graphics Exception"
             for i in range(1, 3002) if i != 1500]
    lines.insert(1499, "4,1500,150000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
                       "GPU has fallen off the bus.")
    p = pump(XidCheck(), NvswitchCheck(), PcieCheck(), queue_max=100)
    host.append(*lines)
    _read(p, 3001)
    log, mark = p.take("xid")
    assert [(e.code, e.repeats) for e in log.events] == [(13, 3000), (79, 1)]
    storm = log.events[0]
    assert (storm.record.seq, storm.last_record.seq) == (1, 3001) and mark is not None and mark["seq"] == 3001
    assert log.lost_records == 0
    stats = p.stats()
    assert stats["merged"]["xid"] == 2999 and stats["dropped"][("xid", "queue_full")] == 0
    found = _xid_run(tmp_path, log, ["0000:19:00.0", "0000:3b:00.0"], BOOT_S + 10)
    assert found["gpu/0"].evidence["count"] == 3000 and "(3000 events)" in found["gpu/0"].message
    assert found["gpu/0"].evidence["first_seen"] == BOOT_S + 0.0001
    assert found["gpu/0"].evidence["last_seen"] == pytest.approx(BOOT_S + 0.3001)
    assert (found["gpu/1"].severity, found["gpu/1"].action.value) == (Severity.FAIL, "reboot_node")


def test_repeats_are_counted_together_only_within_a_second(host: _Host,
                                                           pump: Callable[..., KernelLogPump]) -> None:
    """A line repeated more than a second after the one it would be counted on is an event of its
    own: the check dates each burst by its own lines (a burst of Xid 13 is a verdict input)."""
    text = "NVRM: Xid (PCI:0000:19:00): 13, pid=1234, name=python, Graphics Exception"
    p = pump(XidCheck())
    host.append(f"4,1,0,-;{text}", f"4,2,900000,-;{text}", f"4,3,1900000,-;{text}", f"4,4,2000000,-;{text}")
    _read(p, 4)
    log, _ = p.take("xid")
    assert [(e.record.seq, e.repeats, e.last_record.seq if e.last_record else None) for e in log.events] == \
        [(1, 2, 2), (3, 2, 4)]


def test_drops_of_lines_a_check_reads_are_counted_and_on_metrics(host: _Host,
                                                                  pump: Callable[..., KernelLogPump]) -> None:
    """300 different Xid lines into a queue of 100 before the check runs: the 200 pushed out are
    counted as queue_full for xid (not for nvswitch, which reads none of them) and exported."""
    p = pump(XidCheck(), NvswitchCheck(), queue_max=100)
    host.append(*(xid(i, pid=i) for i in range(1, 301)))
    _read(p, 300)
    stats = p.stats()
    assert stats["dropped"][("xid", "queue_full")] == 200
    assert stats["dropped"][("nvswitch", "queue_full")] == 0 and stats["read"] == 300
    holder = SnapshotHolder(Snapshot(node="n", profile="generic", version="0", kernel_log=stats))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(make_registry(holder)).decode())}
    dropped = families["gpumon_kernel_log_lines_dropped"]
    assert dropped.documentation == FAMILIES["gpumon_kernel_log_lines_dropped"]
    values = {(s.labels["check"], s.labels["reason"]): s.value for s in dropped.samples
              if s.name.endswith("_total")}
    assert values[("xid", "queue_full")] == 200 and values[("nvswitch", "queue_full")] == 0
    assert values[("xid", "ring_overrun")] == 0
    read = families["gpumon_kernel_log_lines_read"]
    assert [s.value for s in read.samples if s.name.endswith("_total")] == [300]


def test_an_event_handed_with_its_repeats_is_the_event_with_those_fields_replaced() -> None:
    """The pump copies a queued Xid event with its repeats by one constructor call, not
    dataclasses.replace: every other field as it was, whatever XidEvent holds (issue 23)."""
    from dataclasses import fields, replace

    from gpumon.hw.kmsg_record import KernelRecord
    from gpumon.kernel_pump import _with_repeats

    first, last = KernelRecord("a", "a", 1, 10), KernelRecord("a", "a", 9, 90)
    event = XidEvent(154, "0000:3b:00.0", 7, "python", "m", first, "RLW", True, 3, (1, 2), 45, (4, "Drain"),
                     (1, "Reset"), (5, 6))
    copy = _with_repeats(event, 8, last)
    assert copy == replace(event, repeats=8, last_record=last) and copy is not event
    assert [f.name for f in fields(XidEvent) if getattr(copy, f.name) != getattr(event, f.name)] == \
        ["repeats", "last_record"]
