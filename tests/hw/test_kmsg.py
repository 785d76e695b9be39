"""gpumon.hw.kmsg_record, kmsg_parse, kmsg_lines, kmsg_follow: wrappers of real captures, and
following files and /dev/kmsg-like devices.

Inputs are the real captures in tests/data/kmsg-xid (provenance in SOURCES.md
there); synthetic lines are used only for follower mechanics (append, rotate,
truncate) and are built from real lines where the content matters.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.hw.kmsg_follow import KernelLogFollower, _device_records
from gpumon.hw.kmsg_lines import MAX_LINE_BYTES, LineBuffer, records_from_bytes
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord

DATA = Path(__file__).resolve().parent.parent / "data" / "kmsg-xid"
CAPTURES = sorted(DATA.glob("*.log"))
UTC = timezone.utc


def _lines(name: str) -> list[str]:
    return (DATA / name).read_text(encoding="utf-8").splitlines()


def _real_lines() -> list[str]:
    return [line for p in CAPTURES for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


REAL_LINES = _real_lines()


# --------------------------------------------------------------------------- parse_line, per wrapper


def test_captures_are_present() -> None:
    assert len(CAPTURES) == 20
    sources = (DATA / "SOURCES.md").read_text(encoding="utf-8")
    for p in CAPTURES:
        assert f"`kmsg-xid/{p.name}`" in sources, p.name


def test_dev_kmsg_record() -> None:
    line = _lines("dev-kmsg-raw_nvswitch-open.log")[0]
    r = parse_line(line)
    assert r == KernelRecord(
        text="nvidia-nvswitch2: open (major=510)",
        raw=line,
        seq=3964,
        monotonic_us=206764307,
        priority=6,
    )


def test_dev_kmsg_record_with_dictionary_lines() -> None:
    # What one read() of /dev/kmsg returns for a device message (Documentation/ABI/testing/dev-kmsg).
    rec = (
        "6,3973,227996636,-;nvidia-peermem nv_get_p2p_free_callback:127 ERROR\n"
        " SUBSYSTEM=pci\n DEVICE=+pci:0000:38:00.0\n"
    )
    r = parse_line(rec)
    assert r.text == "nvidia-peermem nv_get_p2p_free_callback:127 ERROR"
    assert (r.seq, r.monotonic_us, r.priority) == (3973, 227996636, 6)
    assert r.raw == rec.rstrip("\n")


def test_dev_kmsg_escaped_multiline_record() -> None:
    # /dev/kmsg escapes the newlines of a multi-line printk as \x0a (and a backslash as \x5c).
    r = parse_line(
        r"3,812,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\x0aNVRM: (PCI ID: 10de:26b5) a\x5cb"
    )
    assert r.text == "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) a\\b"
    assert r.priority == 3


def test_dev_kmsg_priority_is_the_level() -> None:
    # facility user (1) << 3 | level notice (5) = 13, as systemd writes to /dev/kmsg
    assert parse_line("13,5,10,-;systemd[1]: hello").priority == 5
    # caller-id / extra header fields after the flags
    r = parse_line("4,77,123,-,caller=T42;NVRM: x")
    assert (r.text, r.seq, r.priority) == ("NVRM: x", 77, 4)


def test_dmesg_monotonic() -> None:
    lines = _lines("issue_nvsentinel-155_fallen-off-bus-no-xid_570.158.01.log")
    r = parse_line(lines[0])
    assert r.text == "NVRM: The NVIDIA GPU 0000:b3:00.0"
    assert r.monotonic_us == 1843308145
    assert (r.wall_time, r.seq, r.priority, r.host, r.continuation) == (None, None, None, None, False)
    cont = parse_line(lines[1])
    assert cont.text == "NVRM: (PCI ID: 10de:26b5) installed in this system has"
    assert cont.continuation
    assert (cont.monotonic_us, cont.wall_time) == (None, None)
    small = parse_line(_lines("issue_open-gpu-kernel-modules-1030_xid31-with-pid-name_595.71.05.log")[0])
    assert small.monotonic_us == 2329368
    assert small.text.startswith("NVRM: loading NVIDIA UNIX Open Kernel Module")
    # CONFIG_PRINTK_CALLER adds a second bracket; `dmesg -r` puts the raw <prio> first
    assert parse_line("[    1.234567] [    T1] x: y").text == "x: y"
    r = parse_line("<4>[  365.969681] NVRM: Xid")
    assert (r.text, r.monotonic_us, r.priority) == ("NVRM: Xid", 365969681, 4)


def test_dmesg_ctime() -> None:
    r = parse_line(_lines("dmesg-ctime_xid119_gsp-rpc-timeout.log")[2])
    assert r.text.startswith("NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380")
    assert r.wall_time == datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC)
    assert r.monotonic_us is None
    # day of month padded with a space
    assert parse_line("[Wed Aug  5 03:12:01 2026] NVRM: x").wall_time == datetime(
        2026, 8, 5, 3, 12, 1, tzinfo=UTC
    )


def test_dmesg_decode_iso() -> None:
    r = parse_line(_lines("dmesg-decode-iso_xid13-storm_then_xid43.log")[0])
    assert r.text.startswith("NVRM: Xid (PCI:0000:38:00): 13, pid='<unknown>'")
    assert r.wall_time == datetime(2025, 1, 21, 2, 21, 33, 498559, tzinfo=UTC)
    assert r.priority == 4
    err = parse_line(_lines("issue_gpud-338_dmesg-decode-iso_sxid12028-data.log")[0])
    assert err.priority == 3
    assert err.text.startswith("nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data {")
    daemon = parse_line(
        "daemon:info  : 2025-01-17T15:37:17,129413+00:00 systemd[1]: Inserted module 'autofs4'"
    )
    assert (daemon.text, daemon.priority) == ("systemd[1]: Inserted module 'autofs4'", 6)
    # --decode with the default (monotonic) time format
    r = parse_line("kern  :err   : [ 1843.308145] NVRM: x")
    assert (r.text, r.priority, r.monotonic_us) == ("NVRM: x", 3, 1843308145)


def test_dmesg_iso_without_decode_and_offsets() -> None:
    r = parse_line("2024-11-15T05:39:15,491363+00:00 nvidia-peermem nv_get_p2p_free_callback:127 ERROR")
    assert r.text == "nvidia-peermem nv_get_p2p_free_callback:127 ERROR"
    assert r.wall_time == datetime(2024, 11, 15, 5, 39, 15, 491363, tzinfo=UTC)
    ist = parse_line("2025-01-21T08:00:00,000001+05:30 NVRM: x").wall_time
    assert ist is not None and ist.utcoffset() == timedelta(hours=5, minutes=30)
    assert ist == datetime(2025, 1, 21, 2, 30, 0, 1, tzinfo=UTC)
    assert parse_line("2025-01-21T02:30:00-0800 h kernel: x").wall_time == datetime(
        2025, 1, 21, 10, 30, tzinfo=UTC
    )


def test_journalctl_short_infers_year() -> None:
    line = _lines("issue_dxvk-1799_journalctl-k_xid31_450.80.02.log")[1]
    r = parse_line(line, now=datetime(2020, 12, 1, tzinfo=UTC))
    assert r.text.startswith("NVRM: Xid (PCI:0000:c1:00): 31, pid=12890, Ch 0000003b")
    assert r.host == "zeus"
    assert r.wall_time == datetime(2020, 11, 29, 11, 28, 11, tzinfo=UTC)
    # in January a "Nov 29" line is from last year
    assert parse_line(line, now=datetime(2021, 1, 5, tzinfo=UTC)).wall_time == datetime(
        2020, 11, 29, 11, 28, 11, tzinfo=UTC
    )
    # rsyslog kern.log carries the kernel's own timestamp after "kernel:"
    r = parse_line(
        "Nov 29 11:28:11 zeus kernel: [ 1234.567890] NVRM: x", now=datetime(2020, 12, 1, tzinfo=UTC)
    )
    assert (r.text, r.monotonic_us, r.host) == ("NVRM: x", 1234567890, "zeus")
    # Feb 29 only exists in leap years
    leap = parse_line("Feb 29 01:02:03 h kernel: x", now=datetime(2026, 3, 1, tzinfo=UTC)).wall_time
    assert leap == datetime(2024, 2, 29, 1, 2, 3, tzinfo=UTC)


def test_journalctl_short_iso() -> None:
    r = parse_line(_lines("journalctl-k-short-iso_peermem.log")[-1])
    assert r.text == (
        "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, "
        "skipping further processing"
    )
    assert r.host == "exp03-ft-896z-1-lan.exp03-ft-896z-job-svc"
    assert r.wall_time == datetime(2025, 1, 17, 17, 39, 30, tzinfo=UTC)


def test_bare_kernel_prefix() -> None:
    r = parse_line(_lines("issue_open-gpu-kernel-modules-1150_xid45-caused-by-xid149-145_590.48.01.log")[0])
    assert (
        r.text
        == "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149"
    )
    assert (r.seq, r.monotonic_us, r.wall_time, r.priority, r.host) == (None, None, None, None, None)


def test_talos_wrapper_9_and_8_digit_fractions() -> None:
    lines = _lines(
        "issue_open-gpu-kernel-modules-1118_talos-kern-warning_a100sxm4_gsp-rpc-history_FRAGMENT.log"
    )
    first = parse_line(lines[0])
    assert first.host == "192.168.11.119"
    assert first.priority == 4
    assert first.wall_time == datetime(2026, 4, 22, 21, 27, 51, 288830, tzinfo=UTC)
    assert first.text.startswith("NVRM:      0    76   GSP_RM_CONTROL")
    eight = parse_line(lines[4])  # "...51.28885631Z": a trailing zero trimmed
    assert eight.wall_time == datetime(2026, 4, 22, 21, 27, 51, 288856, tzinfo=UTC)
    assert eight.text.endswith("104us")  # trailing spaces stripped


def test_no_wrapper_and_unknown_shapes() -> None:
    line = _lines("gb200_xid145-rlw-xid149-netir_with-pid-name_nots.log")[0]
    assert parse_line(line) == KernelRecord(text=line, raw=line)
    for odd in (
        "random text: with [brackets]",
        "12345 not a record",
        "[not a time] x",
        "-- Boot 0123abcd --",
    ):
        r = parse_line("  " + odd + "  ") if odd.startswith("12") else parse_line(odd)
        assert r.text == odd.strip()
        assert (r.seq, r.monotonic_us, r.wall_time, r.priority, r.host) == (None,) * 5
    assert parse_line("") == KernelRecord(text="", raw="")
    assert parse_line("\r\n").text == ""
    assert parse_line("[ 1.5] a\x00b\r\n").text == "ab"


def test_bad_dates_keep_the_message() -> None:
    r = parse_line("kern  :warn  : 2025-13-45T99:00:00,000000+00:00 NVRM: x")
    assert (r.text, r.wall_time, r.priority) == ("NVRM: x", None, 4)
    assert parse_line("2025-01-01T00:00:00+99:00 NVRM: y").wall_time is None


def test_every_wrapper_in_the_captures_is_recognised() -> None:
    """Every non-blank line of every capture gets the metadata its wrapper carries."""
    expect: dict[str, Callable[[KernelRecord], bool]] = {
        "dev-kmsg-raw": lambda r: r.seq is not None and r.monotonic_us is not None and r.priority is not None,
        "dmesg-ctime": lambda r: r.wall_time is not None,
        "dmesg-decode-iso": lambda r: r.wall_time is not None and r.priority is not None,
        "issue_gpud-338": lambda r: r.wall_time is not None and r.priority is not None,
        "issue_gpud-46": lambda r: r.wall_time is not None,
        "dmesg_xid79": lambda r: r.monotonic_us is not None,
        "gb200_xid149": lambda r: r.monotonic_us is not None,
        "issue_dxvk-1799": lambda r: r.wall_time is not None and r.host == "zeus",
        "issue_open-gpu-kernel-modules-1030": lambda r: r.monotonic_us is not None,
        "issue_open-gpu-kernel-modules-1118": lambda r: r.wall_time is not None and r.host is not None,
        "journalctl-k-short-iso": lambda r: r.wall_time is not None and r.host is not None,
        "issue_open-gpu-kernel-modules-1150": lambda r: r.raw.startswith("kernel: ") and r.text == r.raw[8:],
        "issue_nccl-2241": lambda r: r.raw.startswith("kernel: ") and r.text == r.raw[8:],
        "issue_nvsentinel-155": lambda r: r.monotonic_us is not None or r.continuation,
        "gb200_xid145": lambda r: r.text == r.raw,
    }
    seen = set()
    for path in CAPTURES:
        checks = [v for k, v in expect.items() if path.name.startswith(k)]
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert lines
        if path.name.startswith("issue_dxvk-1027"):
            # the reporter's first line lost its timestamp; the rest have one
            assert parse_line(lines[0]).monotonic_us is None
            assert all(parse_line(line).monotonic_us is not None for line in lines[1:])
            seen.add(path.name)
            continue
        assert len(checks) == 1, path.name
        for line in lines:
            assert checks[0](parse_line(line)), (path.name, line)
        seen.add(path.name)
    assert len(seen) == len(CAPTURES)


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_every_capture_reads_through_the_follower(path: Path, tmp_path: Path) -> None:
    data = path.read_bytes()
    target = tmp_path / "kern.log"
    target.write_bytes(data)
    with KernelLogFollower(target) as f:
        records = f.read_available()
        assert f.malformed_lines == 0
        assert f.read_available() == []
    # several captures end without a newline: the follower waits for it
    complete = data[: data.rfind(b"\n") + 1]
    assert records == records_from_bytes(complete)
    assert records
    assert all(r.text for r in records)


# --------------------------------------------------------------------------- hypothesis


@given(st.text())
def test_parse_line_never_raises(s: str) -> None:
    r = parse_line(s)
    assert isinstance(r.text, str)
    assert "\x00" not in r.text


@given(st.binary(max_size=300))
def test_records_from_arbitrary_bytes_never_raise(data: bytes) -> None:
    for r in records_from_bytes(data):
        assert "\x00" not in r.text


@given(st.sampled_from(REAL_LINES), st.data())
def test_parse_line_on_truncated_real_lines(line: str, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(line)))
    end = data.draw(st.integers(start, len(line)))
    junk = data.draw(st.sampled_from(["", "\x00", "\ufffd", "\\x0", "\\x0a", "[", "]", ";", "\n ", " "]))
    for s in (line[:end], line[start:end], line[:start] + junk + line[end:]):
        parse_line(s)
        records_from_bytes(s.encode("utf-8", "surrogatepass"))


_RECORD_PREFIXES = st.sampled_from(
    ["6,1,2,-;", "[ 1.0] ", "kern  :warn  : ", "kernel: ", "x: kern: err: [", "<3>"]
)


@given(_RECORD_PREFIXES, st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_parse_line_on_wrapper_prefixes_with_junk(prefix: str, tail: str) -> None:
    parse_line(prefix + tail)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 20000), min_size=1, max_size=12))
def test_follower_is_independent_of_write_boundaries(tmp_path: Path, cuts: list[int]) -> None:
    data = (DATA / "dmesg-decode-iso_xid13-storm_then_xid43.log").read_bytes()[:60000]
    target = tmp_path / f"k{len(cuts)}-{cuts[0]}.log"
    target.write_bytes(b"")
    got: list[KernelRecord] = []
    with KernelLogFollower(target) as f:
        pos = 0
        for cut in [*cuts, len(data)]:
            with target.open("ab") as w:
                w.write(data[pos : pos + cut])
            pos += cut
            got.extend(f.read_available())
            if pos >= len(data):
                break
        if pos < len(data):
            with target.open("ab") as w:
                w.write(data[pos:])
            got.extend(f.read_available())
    target.unlink()
    expected = records_from_bytes(data)
    # the unterminated last line is still waiting for its newline in the follower
    assert got == (expected if data.endswith(b"\n") else expected[:-1])


# --------------------------------------------------------------------------- regular files


def _append(path: Path, data: str | bytes) -> None:
    with path.open("ab") as w:
        w.write(data.encode() if isinstance(data, str) else data)


ISO = (
    "kern  :warn  : 2025-01-21T02:21:{:02d},000000+00:00 "
    "NVRM: Xid (PCI:0000:38:00): 13, pid='<unknown>', name=<unknown>, n{}\n"
)


def test_follow_appended_data_wakes_wait(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(ISO.format(1, 1) + ISO.format(2, 2))
    with KernelLogFollower(log, poll_interval=0.05) as f:
        assert [r.text[-2:] for r in f.read_available()] == ["n1", "n2"]
        assert f.wait(0.05) == []
        appended_at: list[float] = []

        def write() -> None:
            appended_at.append(time.monotonic())
            _append(log, ISO.format(3, 3))

        timer = threading.Timer(0.1, write)
        timer.start()
        try:
            got = f.wait(5.0)
        finally:
            timer.join()
        assert time.monotonic() - appended_at[0] < 0.5
        assert [r.text[-2:] for r in got] == ["n3"]


def test_follow_partial_line_completed_later(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    with KernelLogFollower(log) as f:
        assert f.read_available() == []
        _append(log, "[ 1843.308145] NVRM: Xid (PCI:0000:b3")
        assert f.read_available() == []
        _append(log, ":00): 79, GPU has fallen off the bus.\n")
        (r,) = f.read_available()
        assert r.text == "NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus."
        assert r.monotonic_us == 1843308145


def test_follow_truncation_restarts_from_zero(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(ISO.format(1, 1) + ISO.format(2, 2) + ISO.format(3, 3) + "[ 9.0] partial")
    with KernelLogFollower(log) as f:
        assert len(f.read_available()) == 3
        log.write_text(ISO.format(4, 4))  # copytruncate / "> file": same inode, shorter
        assert [r.text[-2:] for r in f.read_available()] == ["n4"]
        _append(log, ISO.format(5, 5))
        assert [r.text[-2:] for r in f.read_available()] == ["n5"]


def test_follow_rotation_reopens_new_file(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(ISO.format(1, 1))
    with KernelLogFollower(log) as f:
        assert len(f.read_available()) == 1
        _append(log, ISO.format(2, 2) + ISO.format(3, 3).rstrip("\n"))  # last line never finished
        log.rename(tmp_path / "kern.log.1")
        assert [r.text[-2:] for r in f.read_available()] == ["n2"]  # old file, kept open
        log.write_text(ISO.format(4, 4))
        assert [r.text[-2:] for r in f.read_available()] == ["n3", "n4"]
        _append(log, ISO.format(5, 5))
        _append(tmp_path / "kern.log.1", ISO.format(6, 6))  # the old file is no longer followed
        assert [r.text[-2:] for r in f.read_available()] == ["n5"]


def test_follow_file_that_does_not_exist_yet(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    with KernelLogFollower(log, poll_interval=0.02) as f:
        assert f.read_available() == []
        assert isinstance(f.last_error, FileNotFoundError)
        assert f.wait(0.05) == []
        log.write_text(ISO.format(1, 1))
        assert [r.text[-2:] for r in f.wait(1.0)] == ["n1"]


def test_unusable_sources_are_errors_not_an_empty_log(tmp_path: Path) -> None:
    """Issue 14 bad input #4: a directory (or a FIFO nobody writes to, or a log that vanished)
    read as an empty log made every kernel-log check ok. ``last_error`` says what is wrong with
    the latest read, and is cleared once the log reads fine again."""
    log = tmp_path / "kmsg"
    log.mkdir()
    with KernelLogFollower(log, poll_interval=0.02) as f:
        assert f.read_available() == [] and isinstance(f.last_error, IsADirectoryError)
        assert f.wait(0.05) == [] and isinstance(f.last_error, IsADirectoryError)
        log.rmdir()
        log.write_text(ISO.format(1, 1))
        assert [r.text[-2:] for r in f.read_available()] == ["n1"] and f.last_error is None
        log.unlink()  # vanished: what was appended to the open file is still read, but it is said
        assert f.read_available() == [] and isinstance(f.last_error, FileNotFoundError)
        log.write_text(ISO.format(2, 2))
        assert [r.text[-2:] for r in f.read_available()] == ["n2"] and f.last_error is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with KernelLogFollower(fifo) as f:
        assert f.read_available() == []
        assert f.last_error is not None and "no writer" in str(f.last_error)
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            assert f.read_available() == [] and f.last_error is None  # a writer, quiet for now
            os.write(writer, ISO.format(3, 3).encode())
            assert [r.text[-2:] for r in f.read_available()] == ["n3"] and f.last_error is None
        finally:
            os.close(writer)
        assert f.read_available() == [] and "no writer" in str(f.last_error)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked"
        locked.write_text(ISO.format(4, 4))
        locked.chmod(0)
        with KernelLogFollower(locked) as f:
            assert f.read_available() == [] and isinstance(f.last_error, PermissionError)


def test_boot_anchor_dates_kernel_time_without_btime(tmp_path: Path) -> None:
    """Issue 14 #6: without /proc/stat btime, records that carry only kernel time are dated by
    it from one anchor: now - /proc/uptime, else now - the newest record's kernel time."""
    now = 2_000_000_000.0
    log = tmp_path / "kmsg"
    log.write_text("6,1,1000000000,-;NVRM: a\n6,2,1300000000,-;NVRM: b\n")
    with KernelLogFollower(log, boot_time=now - 5000) as f:
        assert f.boot_anchor == now - 5000  # btime: taken as it is
        f.read_available()
        assert f.boot_anchor == now - 5000
    with KernelLogFollower(log, uptime_s=1400.0, clock=lambda: now) as f:
        assert f.boot_anchor == now - 1400
        assert len(f.read_available()) == 2 and f.boot_anchor == now - 1400
        _append(log, "6,3,1500000000,-;NVRM: c\n")  # 100 s "in the future": the anchor moves back
        f.read_available()
        assert f.boot_anchor == now - 1500
    with KernelLogFollower(log, clock=lambda: now) as f:
        assert f.boot_anchor is None
        f.read_available()
        assert f.boot_anchor == now - 1500  # the newest record is taken as logged now
        # the clock here stands still: a newer record would be dated in the future, so it moves
        _append(log, "6,4,1600000000,-;NVRM: d\n")
        f.read_available()
        assert f.boot_anchor == now - 1600


def test_boot_filter_by_wall_time(tmp_path: Path) -> None:
    boot = datetime(2025, 1, 21, 2, 21, 30, tzinfo=UTC).timestamp()
    log = tmp_path / "kern.log"
    log.write_text(
        ISO.format(10, 1)
        + "               NVRM: continuation of a dropped record\n"
        + ISO.format(40, 2)
        + "               NVRM: continuation of a kept record\n"
    )
    with KernelLogFollower(log, boot_time=boot) as f:
        got = f.read_available()
        assert [r.text[-2:] for r in got] == ["n2", "rd"]
        cont = got[1]
        assert cont.continuation
        assert cont.wall_time == got[0].wall_time  # inherits the header's metadata
        _append(log, ISO.format(5, 3) + ISO.format(50, 4))  # an appended stale line is dropped too
        assert [r.text[-2:] for r in f.read_available()] == ["n4"]


def test_boot_filter_keeps_unknown_times(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:01:00): 31, no timestamp\n" + ISO.format(10, 1))
    with KernelLogFollower(log, boot_time=None) as f:
        assert len(f.read_available()) == 2
    with KernelLogFollower(log, boot_time=2e9) as f:
        assert [r.text for r in f.read_available()] == ["NVRM: Xid (PCI:0000:01:00): 31, no timestamp"]


def test_boot_filter_by_monotonic_reset(tmp_path: Path) -> None:
    older = _lines("dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log")  # ~6781741 s uptime
    current = _lines("issue_nvsentinel-155_fallen-off-bus-no-xid_570.158.01.log")  # 1843 s uptime
    log = tmp_path / "dmesg.txt"
    log.write_text("\n".join(older + current) + "\n")
    with KernelLogFollower(log) as f:
        got = f.read_available()
        assert [r.raw for r in got] == current
        assert got[1].monotonic_us == 1843308145  # continuation inherits
        # appended after the initial read: current boot by definition, even if it steps back
        _append(log, "[   10.000000] NVRM: late\n")
        assert [r.text for r in f.read_available()] == ["NVRM: late"]
    # printk reordering between CPUs steps back by microseconds: not a reboot
    log.write_text("[  100.000500] a\n[  100.000100] b\n[  100.000600] c\n")
    with KernelLogFollower(log) as f:
        assert [r.text for r in f.read_available()] == ["a", "b", "c"]


def test_boot_filter_by_kmsg_seq_reset_and_journal_marker(tmp_path: Path) -> None:
    log = tmp_path / "kmsg.txt"
    log.write_text("6,900,5000000,-;old\n6,901,5000001,-;old2\n6,1,5000002,-;new\n6,2,5000003,-;new2\n")
    with KernelLogFollower(log) as f:
        assert [r.text for r in f.read_available()] == ["new", "new2"]
    log.write_text(
        "Nov 28 10:00:00 h kernel: old\n-- Boot 0123456789abcdef --\nNov 29 11:28:11 h kernel: new\n"
    )
    with KernelLogFollower(log) as f:
        assert [r.text for r in f.read_available()] == ["new"]


def test_all_boots_keeps_every_record_of_a_saved_log(tmp_path: Path) -> None:
    """``gpumon check --kmsg-file FILE --all-boots`` (issue 11): a saved log judged on purpose keeps
    every boot in it; without ``all_boots`` (and without this host's boot time) only its last boot."""
    older = _lines("dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log")  # ~6781741 s uptime
    current = _lines("issue_nvsentinel-155_fallen-off-bus-no-xid_570.158.01.log")  # 1843 s uptime
    log = tmp_path / "dmesg.txt"
    log.write_text("\n".join(older + current) + "\n")
    with KernelLogFollower(log) as f:
        assert [r.raw for r in f.read_available()] == current
    with KernelLogFollower(log, all_boots=True) as f:
        assert [r.raw for r in f.read_available()] == older + current
    journal = tmp_path / "journal.txt"
    journal.write_text(ISO.format(10, 1) + "-- Boot 0123456789abcdef --\n" + ISO.format(40, 2))
    with KernelLogFollower(journal) as f:
        assert [r.text[-2:] for r in f.read_available()] == ["n2"]
    # all boots: neither the journal's boot marker nor a boot time drops anything
    boot = datetime(2025, 1, 21, 2, 21, 30, tzinfo=UTC).timestamp()
    with KernelLogFollower(journal, boot_time=boot, all_boots=True) as f:
        assert [r.text[-2:] for r in f.read_available()] == ["n1", "n2"]


def test_one_out_of_order_record_is_not_a_reboot(tmp_path: Path) -> None:
    """A record with a lower sequence number and kernel time after an Xid (a replayed or misfiled
    line) does not make the Xid an "older boot" record: a boot change is the clock stepping back
    and staying back, not one record that the next one steps over again."""
    xid = "6,501,9000000000,-;NVRM: Xid (PCI:0000:38:00): 13, pid=1, name=python, Graphics Exception"
    stray = "6,3,2000000,-;an older record, filed late"
    log = tmp_path / "kmsg.txt"
    for text, want in (
            # in the middle: the next record continues the clock of the Xid
            (f"6,500,8000000000,-;before\n{xid}\n{stray}\n6,502,9000000100,-;after\n",
             ["before", xid.split(";", 1)[1], stray.split(";", 1)[1], "after"]),
            # last in the file: nothing confirms a new boot
            (f"6,500,8000000000,-;before\n{xid}\n{stray}\n",
             ["before", xid.split(";", 1)[1], stray.split(";", 1)[1]]),
            # the same with dmesg's [seconds] stamps only
            ("[ 8000.000000] before\n[ 9000.000000] NVRM: Xid 13\n[    2.000000] stray\n"
             "[ 9000.000100] after\n", ["before", "NVRM: Xid 13", "stray", "after"]),
            # a real reboot: the clock steps back and the records after it go on from there
            (f"6,500,8000000000,-;before\n{xid}\n6,0,0,-;Linux version 6.8.0\n6,1,1000,-;Command line\n",
             ["Linux version 6.8.0", "Command line"]),
            # two reboots in one file: the last boot only
            ("[ 9000.000000] boot1\n[    1.000000] boot2\n[    2.000000] boot2b\n"
             "[    0.500000] boot3\n[    0.600000] boot3b\n", ["boot3", "boot3b"]),
    ):
        log.write_text(text)
        with KernelLogFollower(log) as f:
            assert [r.text for r in f.read_available()] == want, text


def test_kmsg_dictionary_lines_in_a_file_belong_to_the_record(tmp_path: Path) -> None:
    log = tmp_path / "kmsg.txt"
    log.write_text(
        "6,10,100,-;NVRM: Xid (PCI:0000:38:00): 13, x\n SUBSYSTEM=pci\n DEVICE=+pci:0000:38:00.0\n"
        "6,11,101,-;next\n"
    )
    with KernelLogFollower(log) as f:
        assert [r.text for r in f.read_available()] == ["NVRM: Xid (PCI:0000:38:00): 13, x", "next"]
        assert f.malformed_lines == 0


@pytest.mark.parametrize("size", [1, 7, 4096, 65536, 1 << 20])
def test_the_lines_and_their_malformed_count_do_not_depend_on_how_the_reads_cut_them(size: int) -> None:
    """A NUL run, an over-long line and an undecodable one each count once, whatever the size of
    the reads that carry them (the daemon reads a file in 64 KiB slices)."""
    data = (b"[ 1.0] ok\n" + b"\x00" * 150000 + b"[ 2.0] after\n" + b"B" * (MAX_LINE_BYTES + 5000) + b"\n"
            + b"[ 3.0] \xff bad\n" + b"\x00\x00[ 4.0] nul\x00s inside\n" + b"\x00" * 70000)
    buf = LineBuffer()
    lines = [line for i in range(0, len(data), size) for line in buf.feed(data[i:i + size])]
    assert [line[:9] for line in lines] == ["[ 1.0] ok", "[ 2.0] af", "B" * 9, "[ 3.0] \ufffd ", "[ 4.0] nu"]
    assert len(lines[2]) == MAX_LINE_BYTES
    # the first NUL run, the over-long line, the undecodable one, the two runs of line 4, the last run
    assert buf.malformed == 6


def test_robust_against_long_lines_bad_bytes_and_nuls(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_bytes(
        b"[ 1.0] " + b"A" * (MAX_LINE_BYTES * 2) + b"\n"
        b"[ 2.0] caf\xc3\xa9 \xff\xfe ok\n" + b"\x00" * 200000 + b"[ 3.0] NVRM: after a NUL run\n"
    )
    with KernelLogFollower(log) as f:
        got = f.read_available()
        assert [len(got[0].raw), got[0].monotonic_us] == [MAX_LINE_BYTES, 1000000]
        assert got[1].text == "caf\u00e9 \ufffd\ufffd ok"
        assert got[2].text == "NVRM: after a NUL run"
        assert len(got) == 3
        assert f.malformed_lines == 3  # over-long, undecodable, NUL bytes
        # an over-long line arriving in pieces is cut once, and the next line is intact
        _append(log, b"x" * (MAX_LINE_BYTES + 10))
        (cut,) = f.read_available()
        assert len(cut.raw) == MAX_LINE_BYTES
        _append(log, b"y" * (MAX_LINE_BYTES + 10))
        assert f.read_available() == []
        _append(log, b"z\n[ 4.0] next\n")
        assert [r.text for r in f.read_available()] == ["next"]
        assert f.malformed_lines == 4


def test_closed_follower_returns_nothing(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(ISO.format(1, 1))
    f = KernelLogFollower(log)
    f.close()
    assert f.read_available() == []
    assert f.wait(0.01) == []


# --------------------------------------------------------------------------- character devices


@pytest.fixture
def seqpacket() -> Iterator[tuple[socket.socket, socket.socket]]:
    # SOCK_SEQPACKET keeps message boundaries and is pollable: one send() is one
    # read(), which is exactly the /dev/kmsg contract.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _device_follower(sock: socket.socket, reader: Callable[[int, int], bytes] = os.read) -> KernelLogFollower:
    def opener(path: str, flags: int) -> int:
        assert path == "/host/dev/kmsg"
        assert flags & os.O_NONBLOCK
        return os.dup(sock.fileno())

    return KernelLogFollower(Path("/host/dev/kmsg"), opener=opener, reader=reader, poll_interval=0.05)


def test_a_turn_of_device_records_parsed_together_is_what_each_parses_to_alone() -> None:
    """_device_records (a turn's reads parsed in one block) gives parse_line's records, whether the
    block path takes them (plain records) or not (a record with dictionary lines, a NUL)."""
    plain = [(line + "\n").encode() for line in _lines("dev-kmsg-raw_nvswitch-open.log") if line]
    assert len(plain) > 3
    dictionary = b"4,3967,206764400,-;NVRM: Xid (PCI:0000:38:00): 13, x\n SUBSYSTEM=pci\n"
    for chunks in (plain, [*plain[:2], dictionary, *plain[2:]], [*plain[:1], b"6,9,10,-;a\x00b\n"]):
        assert _device_records(chunks) == [parse_line(c.decode("utf-8", "replace")) for c in chunks]
    assert _device_records([]) == []


def test_device_records(seqpacket: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = seqpacket
    raw = _lines("dev-kmsg-raw_nvswitch-open.log")
    for line in raw[:3]:
        writer.send(line.encode() + b"\n")
    writer.send(
        b"4,3967,206764400,-;NVRM: Xid (PCI:0000:38:00): 13, x\n SUBSYSTEM=pci\n DEVICE=+pci:0000:38:00.0\n"
    )
    with _device_follower(reader) as f:
        got = f.read_available()
        assert [r.seq for r in got] == [3964, 3965, 3966, 3967]
        assert got[0].text == "nvidia-nvswitch2: open (major=510)"
        assert got[3].text == "NVRM: Xid (PCI:0000:38:00): 13, x"
        assert got[3].priority == 4
        assert f.read_available() == []
        assert f.lost_records == 0
        # a sequence gap is records the ring lost before we read them
        writer.send(b"6,3970,206764500,-;after a gap\n")
        assert [r.text for r in f.read_available()] == ["after a gap"]
        assert f.lost_records == 2
        writer.send(b"garbage without a header\n")
        assert [r.text for r in f.read_available()] == ["garbage without a header"]
        assert f.malformed_lines == 1


def test_device_wait_returns_when_a_record_arrives(seqpacket: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = seqpacket
    with _device_follower(reader) as f:
        assert f.wait(0.05) == []
        sent_at: list[float] = []

        def send() -> None:
            sent_at.append(time.monotonic())
            writer.send(b"3,5,1843308145,-;NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.\n")

        timer = threading.Timer(0.1, send)
        timer.start()
        try:
            t0 = time.monotonic()
            got = f.wait(5.0)
        finally:
            timer.join()
        assert [r.seq for r in got] == [5]
        assert time.monotonic() - sent_at[0] < 0.5
        assert time.monotonic() - t0 < 1.0
        # the writer went away: wait() must time out, not spin or raise
        writer.close()
        t1 = time.monotonic()
        assert f.wait(0.2) == []
        assert 0.15 < time.monotonic() - t1 < 1.0


def test_device_epipe_counts_lost_records(seqpacket: tuple[socket.socket, socket.socket]) -> None:
    # A socket cannot produce EPIPE on read, so this one errno path uses a read
    # function that fails once, as /dev/kmsg does after the ring overwrote
    # unread records (the next read returns the oldest surviving record).
    writer, reader = seqpacket
    for seq in (1, 2, 7, 8):
        writer.send(f"6,{seq},{seq * 1000},-;r{seq}\n".encode())
    calls = 0

    def read_with_epipe(fd: int, n: int) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise BrokenPipeError(32, "Broken pipe")
        return os.read(fd, n)

    with _device_follower(reader, reader=read_with_epipe) as f:
        assert [r.text for r in f.read_available()] == ["r1", "r2", "r7", "r8"]
        assert f.lost_records == 4


def test_device_epipe_before_any_record_counts_at_least_one(
    seqpacket: tuple[socket.socket, socket.socket],
) -> None:
    writer, reader = seqpacket
    writer.send(b"6,40,1,-;first survivor\n")
    failed = False

    def read_with_epipe(fd: int, n: int) -> bytes:
        nonlocal failed
        if not failed:
            failed = True
            raise BrokenPipeError(32, "Broken pipe")
        return os.read(fd, n)

    with _device_follower(reader, reader=read_with_epipe) as f:
        assert [r.seq for r in f.read_available()] == [40]
        assert f.lost_records == 1


def _kmsg_readable() -> bool:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.skipif(not _kmsg_readable(), reason="/dev/kmsg not readable here (no CAP_SYSLOG or no device)")
def test_real_dev_kmsg() -> None:
    with KernelLogFollower(Path("/dev/kmsg")) as f:
        got = f.read_available()
        assert got, "the ring buffer always holds the boot messages"
        seqs = [r.seq for r in got if r.seq is not None]
        assert len(seqs) == len(got)
        assert seqs == sorted(seqs)
        assert all(r.monotonic_us is not None and r.priority is not None for r in got)
        assert f.malformed_lines == 0
        t0 = time.monotonic()
        f.wait(0.1)
        assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "line",
    [
        "[" * MAX_LINE_BYTES,
        "[ 1." + "1" * MAX_LINE_BYTES,
        "<1>" * 20000,
        "1,2," * 16000,
        "6,1,2," + "-" * MAX_LINE_BYTES,
        "6,1,2,-;" + "\\x0" * 20000 + "\\x0a" * 1000,
        "kern  :" * 9000,
        "Nov 29 11:28:11 " + "x" * MAX_LINE_BYTES,
        "2025-01-17T17:10:43+0000 " + "h" * MAX_LINE_BYTES,
        "host: kern: warning: [" + ": [" * 20000,
        " " * MAX_LINE_BYTES + "x",
        "-- " + "Logs begin at " * 4000,
    ],
)
def test_adversarial_lines_parse_quickly(line: str) -> None:
    """Lines up to the follower's cap must not make a wrapper regex backtrack for long."""
    t0 = time.perf_counter()
    parse_line(line)
    records_from_bytes(line.encode() + b"\n" + line.encode())
    assert time.perf_counter() - t0 < 0.5


# --------------------------------------------------------------------------- issue 14: storms


# what a /dev/kmsg record can hold, and what only looks like one (a digit first: ISO time, talos)
_KMSG_PIECES = st.lists(st.sampled_from([
    "6", "4", "12", "0", "99999999999", "٣", "-", ",", ";", "\n", " SUBSYSTEM=pci", "\\x0a", "\\x5c", "\x00",
    "c", "-,caller=T1", "NVRM: Xid (PCI:0000:19:00): 13, x", " ", "\t", "\u2028", "2025-01-21T02:21:01+00:00",
    "1843.308145", "é", "[", "]"]), max_size=14).map("".join)


@settings(max_examples=1000, deadline=None)
@given(st.one_of(
    _KMSG_PIECES,
    st.builds(lambda p, s, u, flags, msg: f"{p},{s},{u},{flags};{msg}", st.integers(0, 10**11),
              st.integers(0, 10**21), st.integers(-(10**21), 10**21), st.sampled_from(["-", "c", "-,x", ""]),
              _KMSG_PIECES)))
def test_the_dev_kmsg_fast_path_parses_as_the_general_path(line: str) -> None:
    """parse_line takes a /dev/kmsg record apart with find/split (the daemon's line after line);
    whatever it accepts is what the wrapper regexes give."""
    from gpumon.hw.kmsg_parse import _parse_wrapped
    from gpumon.hw.kmsg_record import parse_kmsg_record

    raw = line.rstrip("\r\n")
    fast = parse_kmsg_record(raw) if "0" <= raw[:1] <= "9" else None
    assert parse_line(line) == (fast if fast is not None else _parse_wrapped(raw, None))
    if fast is not None:
        assert fast == _parse_wrapped(raw, None)


def test_every_real_kmsg_record_takes_the_fast_path_to_the_same_record() -> None:
    from gpumon.hw.kmsg_parse import _parse_wrapped
    from gpumon.hw.kmsg_record import parse_kmsg_record

    raw = [line for line in REAL_LINES if "0" <= line[:1] <= "9"]
    fast = [(line, parse_kmsg_record(line)) for line in raw]
    assert sum(rec is not None for _, rec in fast) >= 20
    for line, rec in fast:
        if rec is not None:
            assert rec == _parse_wrapped(line, None)


def test_a_bounded_follower_reads_a_backlog_in_turns_of_about_a_mib(tmp_path: Path) -> None:
    """The daemon's follower: the first read is whole (its boot filter needs every line), then a
    backlog comes at most ~1 MiB / 5,000 records per call, every record once, in order."""
    log = tmp_path / "kmsg"
    log.write_text("".join(f"6,{i},{i * 10},-;first boot line {i}\n" for i in range(1, 12_001)))
    with KernelLogFollower(log, bounded=True) as f:
        assert len(f.read_available()) == 12_000
        body = "x" * 150
        _append(log, "".join(f"4,{i},{i * 10},-;{body}\n" for i in range(12_001, 32_001)))
        sizes = []
        seqs: list[int | None] = []
        while batch := f.read_available():
            sizes.append(len(batch))
            seqs.extend(r.seq for r in batch)
        assert seqs == list(range(12_001, 32_001))
        assert len(sizes) >= 3 and max(sizes) <= 8_000
        # wait() returns the next slice at once, without sleeping between slices
        _append(log, "".join(f"4,{i},{i * 10},-;{body}\n" for i in range(32_001, 52_001)))
        start = time.monotonic()
        got = 0
        while got < 20_000:
            got += len(f.wait(5.0))
        assert got == 20_000 and time.monotonic() - start < 5.0
    with KernelLogFollower(log) as whole:  # not bounded: everything at once, as before
        assert len(whole.read_available()) == 52_000


# ------------------------------------------------------------------------- issue 23: storms ten times larger


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(
    st.builds(lambda p, s, u, msg: f"{p},{s},{u},-;{msg}", st.sampled_from(["6", "4", "12", "0", "٣"]),
              st.integers(0, 10**6), st.sampled_from(["-1", "0", "1843308145", "-"]),
              st.sampled_from(["NVRM: Xid (PCI:0000:19:00): 13, x", "", " ", "-- Boot 0a --", "a\\x0ab",
                               "é", "x\r", "x\x00y", "c;d"])),
    _KMSG_PIECES), min_size=1, max_size=6), st.integers(0, 3))
def test_a_read_of_kmsg_records_is_built_as_line_by_line(lines: list[str], split: int) -> None:
    """Outside a first read, a list of lines that are all plain /dev/kmsg records is made into
    records from one block (parse_kmsg_block); any list gives what the line-by-line path gives,
    continuation lines after it included."""
    from gpumon.hw.kmsg_lines import Assembler

    block, by_line = Assembler(None), Assembler(None)
    got = block.add(lines[:split], initial=False) + block.add(lines[split:], initial=False)
    want = by_line.add(iter(lines[:split]), initial=False) + by_line.add(iter(lines[split:]), initial=False)
    assert got == want
    tail = ["  continued", " SUBSYSTEM=pci"]
    assert block.add(tail, initial=False) == by_line.add(iter(tail), initial=False)


def test_a_storm_read_takes_the_block_path() -> None:
    from gpumon.hw.kmsg_record import parse_kmsg_block

    lines = [f"4,{i},{i * 50},-;NVRM: Xid (PCI:0000:19:00): 13, pid=1, name=x, e {i % 7}" for i in range(500)]
    block = parse_kmsg_block(lines)
    assert block is not None and block == [parse_line(line) for line in lines]
    assert parse_kmsg_block([*lines, "   a continuation"]) is None
    assert parse_kmsg_block([*lines, "6,1,-5,-;"]) is None  # blank, no kernel time: skipped line by line
