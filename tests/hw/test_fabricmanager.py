"""gpumon.hw.fabricmanager: the real fabric manager logs, and following the file across runs.

Inputs are the real captures in tests/data/fabricmanager (provenance in SOURCES.md there);
synthetic lines are used only for follower mechanics (append, rotate, truncate) and are built
from real lines.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.errors import HwFailure
from gpumon.hw import Hardware
from gpumon.hw.fabricmanager import (
    DEFAULT_LOG_PATH,
    FabricManagerLog,
    FmLogParser,
    NvSwitchError,
    entry_epoch,
    host_timezone,
    nvswitch_error,
    older_than_boot,
    parse_header,
)
from gpumon.hw.kmsg_lines import MAX_LINE_BYTES

DATA = Path(__file__).resolve().parent.parent / "data" / "fabricmanager"
DEC = DATA / "fabricmanager_inband-multicast-team_dec2024.log"
FEB = DATA / "fabricmanager_inband-multicast-team_feb2025.log"
# real lines (DEC line 191, DEC line 1 + its payload line 2)
ERROR_LINE = (b"[Dec 19 2024 19:17:49] [ERROR] [tid 1374] detected NVSwitch non-fatal error 12028 on fid 0 "
              b"on NVSwitch pci bus id 00000000:83:00.0 physical id 0 port 34\n")
INFO_LINES = DEC.read_bytes().split(b"\n", 2)[:2]
INFO = INFO_LINES[0] + b"\n" + INFO_LINES[1] + b"\n"
# a fatal line as quoted in leptonai/gpud components/accelerator/nvidia/fabric-manager/log_matcher.go
# @ 15b320f7d7a67d093825ed7e7b5752e4ae325737
FATAL_LINE = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on "
              "NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 33")


def _log(root: Path, data: bytes | None = None, **kw: Any) -> tuple[FabricManagerLog, Path]:
    path = root / DEFAULT_LOG_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is not None:
        path.write_bytes(data)
    return FabricManagerLog(Hardware(root).fs, **kw), path


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


# --------------------------------------------------------------------------- real captures


def test_dec2024_capture_entries_and_the_18_nvswitch_errors(tmp_path: Path) -> None:
    log, path = _log(tmp_path, DEC.read_bytes())
    res = log.follow(None)
    assert len(res.entries) == 292 and res.orphan_lines == 0 and res.malformed_lines == 0
    assert res.skipped_bytes == 0
    errors = [e for e in res.entries if e.level == "ERROR"]
    assert len(errors) == 18 and {e.level for e in res.entries} == {"INFO", "ERROR"}
    found = [nvswitch_error(e.message) for e in errors]
    assert all(f is not None and f.code == 12028 and not f.fatal and f.fid == 0 for f in found)
    where = [(f.pci, f.physical_id, f.port) for f in found if f is not None]
    expected = [("0000:83:00.0", 0, p) for p in (34, 34)] + \
        [("0000:84:00.0", 1, p) for p in (35, 35, 42, 42)] + \
        [("0000:85:00.0", 2, p) for p in (0, 0, 1, 1, 19, 19, 33, 33)] + \
        [("0000:86:00.0", 3, p) for p in (33, 33, 36, 36)]
    assert where == expected
    assert errors[0].stamp == "Dec 19 2024 19:17:49" and errors[0].tid == 1374
    assert errors[0].when == datetime(2024, 12, 19, 19, 17, 49)
    first = res.entries[0]
    assert first.message.startswith("Received an inband message:") and first.payload == (
        INFO_LINES[1].decode(),)
    # the capture ends mid-line: that line waits for its newline, and is read once it comes
    tail = DEC.read_bytes().rsplit(b"\n", 1)[1]
    assert res.behind_bytes == len(tail) and res.cursor["offset"] == path.stat().st_size - len(tail)
    _append(path, b"\n")
    more = log.follow(res.cursor)
    assert more.entries == [] and more.orphan_lines == 1 and more.behind_bytes == 0


def test_feb2025_capture_has_one_error_entry_at_the_end(tmp_path: Path) -> None:
    log, _ = _log(tmp_path, FEB.read_bytes())
    res = log.follow(None)
    assert len(res.entries) == 54 and res.behind_bytes == 0
    errors = [e for e in res.entries if e.level != "INFO"]
    assert errors == [res.entries[-1]]
    assert nvswitch_error(errors[0].message) == NvSwitchError(12028, False, 0, "0000:86:00.0", 3, 61)
    assert all(nvswitch_error(e.message) is None for e in res.entries[:-1])


# --------------------------------------------------------------------------- line parsing


def test_header_forms() -> None:
    e = parse_header(FATAL_LINE)
    assert e is not None and (e.level, e.tid, e.when) == ("ERROR", 841, datetime(2024, 7, 23, 7, 53, 55))
    assert nvswitch_error(e.message) == NvSwitchError(20034, True, 0, "0000:86:00.0", 3, 33)
    no_tid = parse_header("[Feb 25 2025 13:59:45] [WARNING] something odd")
    assert no_tid is not None
    assert (no_tid.tid, no_tid.level, no_tid.message) == (None, "WARNING", "something odd")
    bad_stamp = parse_header("[Feb 30 2025 13:59:45] [INFO] [tid 1] x")
    assert bad_stamp is not None and bad_stamp.when is None
    assert parse_header("Message payload details:Team release request: Team Handle:99c9f23d49236386") is None
    assert parse_header("") is None and parse_header("[unterminated") is None
    # the parts after the code are optional; a garbled bus id is None, not an exception
    assert nvswitch_error("detected NVSwitch fatal error 22003") == NvSwitchError(22003, True, None, None,
                                                                                   None, None)
    assert nvswitch_error("detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus id zz:zz "
                          "physical id 1") is not None
    assert nvswitch_error("multicast group 1 is allocated.") is None


def test_parser_attaches_payload_and_counts_orphans() -> None:
    p = FmLogParser()
    lines = ["Message payload details: orphan", INFO_LINES[0].decode(), INFO_LINES[1].decode(), "",
             ERROR_LINE.decode().strip()]
    out = p.feed(lines) + p.flush()
    assert p.orphan_lines == 1 and len(out) == 2
    assert out[0].payload == (INFO_LINES[1].decode(),) and out[1].payload == ()
    many = FmLogParser()
    burst = many.feed([INFO_LINES[0].decode()] + ["x" * 1000] * 100) + many.flush()
    assert len(burst[0].payload) == 4  # payload is bounded in characters and lines


def test_entry_epoch_and_boot_filter() -> None:
    e = parse_header(ERROR_LINE.decode())
    assert e is not None
    utc_epoch = entry_epoch(e, timezone.utc)
    assert utc_epoch == datetime(2024, 12, 19, 19, 17, 49, tzinfo=timezone.utc).timestamp()
    assert older_than_boot(utc_epoch, utc_epoch + 10) and not older_than_boot(utc_epoch, utc_epoch + 1)
    assert not older_than_boot(utc_epoch, None) and not older_than_boot(None, 0.0)
    no_time = parse_header("[not a time] [INFO] x")
    assert no_time is not None and entry_epoch(no_time, timezone.utc) is None


def test_host_timezone(tmp_path: Path) -> None:
    fs = Hardware(tmp_path).fs
    assert host_timezone(fs) is None  # no etc/localtime
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/localtime").write_bytes(b"not a TZif file")
    assert host_timezone(fs) is None
    berlin = Path("/usr/share/zoneinfo/Europe/Berlin")
    if not berlin.exists():
        pytest.skip("no tzdata on this machine")
    shutil.copyfile(berlin, tmp_path / "etc/localtime")
    tz = host_timezone(fs)
    e = parse_header(ERROR_LINE.decode())
    assert tz is not None and e is not None
    # 19:17:49 in Berlin (CET, UTC+1) is 18:17:49 UTC
    assert entry_epoch(e, tz) == datetime(2024, 12, 19, 18, 17, 49, tzinfo=timezone.utc).timestamp()


# --------------------------------------------------------------------------- following


def test_missing_then_created_then_appended(tmp_path: Path) -> None:
    log, path = _log(tmp_path)
    assert log.follow(None).missing
    path.write_bytes(INFO)
    first = log.follow(None)
    assert [e.message[:8] for e in first.entries] == ["Received"] and first.skipped_bytes == 0
    _append(path, ERROR_LINE)
    second = log.follow(first.cursor)
    assert [e.level for e in second.entries] == ["ERROR"] and second.bytes_read == len(ERROR_LINE)
    assert log.follow(second.cursor).entries == []


def test_partial_line_waits_for_its_newline(tmp_path: Path) -> None:
    log, path = _log(tmp_path, ERROR_LINE[:40])
    res = log.follow(None)
    assert res.entries == [] and res.cursor["offset"] == 0
    _append(path, ERROR_LINE[40:])
    res = log.follow(res.cursor)
    assert len(res.entries) == 1 and nvswitch_error(res.entries[0].message) is not None


def test_truncation_restarts_at_the_beginning(tmp_path: Path) -> None:
    log, path = _log(tmp_path, INFO + ERROR_LINE)
    cursor = log.follow(None).cursor
    path.write_bytes(ERROR_LINE)  # truncated in place, shorter than before
    res = log.follow(cursor)
    assert res.truncated and [e.level for e in res.entries] == ["ERROR"]


def test_rewritten_in_place_past_the_offset_is_noticed(tmp_path: Path) -> None:
    log, path = _log(tmp_path, INFO)
    cursor = log.follow(None).cursor
    with open(path, "r+b") as fh:  # copytruncate, then the writer grew it past our offset
        fh.truncate(0)
        fh.write(ERROR_LINE + INFO)
    res = log.follow(cursor)
    assert res.replaced and [e.level for e in res.entries] == ["ERROR", "INFO"]


def test_rotation_reads_the_old_tail_then_the_new_file(tmp_path: Path) -> None:
    log, path = _log(tmp_path, INFO)
    cursor = log.follow(None).cursor
    _append(path, ERROR_LINE)  # written after our last read, just before rotation
    os.rename(path, path.with_name("fabricmanager.log.1"))
    path.write_bytes(FATAL_LINE.encode() + b"\n")
    res = log.follow(cursor)
    assert res.replaced and res.rotated_from == "fabricmanager.log.1"
    assert [nvswitch_error(e.message).code for e in res.entries] == [12028, 20034]  # type: ignore[union-attr]
    # rotated away and nothing new under the name yet: missing, not an error
    os.rename(path, path.with_name("fabricmanager.log.2"))
    assert log.follow(res.cursor).missing


def test_first_look_reads_only_the_tail(tmp_path: Path) -> None:
    body = INFO * 200 + ERROR_LINE
    log, _ = _log(tmp_path, body, initial_tail_bytes=len(ERROR_LINE) + 10)
    res = log.follow(None)
    # the partial line the tail starts in is skipped, not parsed as garbage
    assert [e.level for e in res.entries] == ["ERROR"] and res.orphan_lines == 0
    assert res.skipped_bytes == len(body) - len(ERROR_LINE)


def test_reads_are_bounded_and_catch_up(tmp_path: Path) -> None:
    body = ERROR_LINE * 50
    log, _ = _log(tmp_path, body, max_read_bytes=len(ERROR_LINE) * 20 + 5)
    seen = 0
    cursor: dict[str, Any] | None = None
    for _ in range(3):
        res = log.follow(cursor)
        seen += len(res.entries)
        cursor = res.cursor
        assert res.bytes_read <= len(ERROR_LINE) * 20 + 5
    assert seen == 50 and res.behind_bytes == 0


def test_line_longer_than_the_window_does_not_stall(tmp_path: Path) -> None:
    window = 4096
    log, path = _log(tmp_path, b"x" * (window * 3) + b"\n" + ERROR_LINE, max_read_bytes=window)
    cursor: dict[str, Any] | None = None
    levels: list[str] = []
    for _ in range(6):
        res = log.follow(cursor)
        cursor = res.cursor
        levels += [e.level for e in res.entries]
    assert levels == ["ERROR"] and cursor is not None and cursor["offset"] == path.stat().st_size


def test_bad_bytes_never_raise(tmp_path: Path) -> None:
    junk = b"\x00\x00\x00" + b"\xff\xfe[Dec 19 2024 19:17:49] [ERROR] \xc3(\n"
    junk += b"y" * (MAX_LINE_BYTES + 10) + b"\n"
    log, _ = _log(tmp_path, junk + ERROR_LINE)
    res = log.follow(None)
    assert res.malformed_lines >= 2 and [e.level for e in res.entries][-1] == "ERROR"


def test_not_a_regular_file_is_a_failure(tmp_path: Path) -> None:
    log, path = _log(tmp_path)
    path.mkdir()
    with pytest.raises(HwFailure, match=r"fabricmanager\.log"):
        log.follow(None)


@pytest.mark.parametrize("cursor", [
    {}, {"dev": "x"}, {"dev": 1, "ino": 2, "offset": -5, "head_len": 0, "head": ""},
    {"dev": True, "ino": 2, "offset": 0, "head_len": 0, "head": ""}, None])
def test_a_cursor_that_is_not_ours_starts_afresh(tmp_path: Path, cursor: Any) -> None:
    log, _ = _log(tmp_path, ERROR_LINE)
    res = log.follow(cursor)
    assert [e.level for e in res.entries] == ["ERROR"]


# --------------------------------------------------------------------------- properties


_REAL = [line for line in (DEC.read_text() + FEB.read_text()).splitlines() if line]


@given(st.text(max_size=400))
@settings(max_examples=300)
def test_line_parsers_never_raise(text: str) -> None:
    entry = parse_header(text)
    if entry is not None:
        assert entry.level == entry.level.upper()
    nvswitch_error(text)
    p = FmLogParser()
    p.feed(text.splitlines())
    p.flush()


@given(st.sampled_from(_REAL), st.integers(min_value=0, max_value=400))
@settings(max_examples=300)
def test_truncated_real_lines_never_raise(line: str, cut: int) -> None:
    part = line[:cut]
    entry = parse_header(part)
    if entry is not None:
        nvswitch_error(entry.message)


_ONE_LINE = st.text(max_size=80).map(lambda s: s.replace("\n", " "))


@given(lines=st.lists(st.one_of(st.sampled_from(_REAL), _ONE_LINE), min_size=1, max_size=30),
       cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=20))
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reading_in_any_pieces_finds_the_same_entries(tmp_path: Path, lines: list[str],
                                                      cuts: list[int]) -> None:
    """Appending the same bytes in arbitrary pieces (cut mid-line) yields the same headers as one read."""
    data = ("\n".join(lines) + "\n").encode()
    root = tmp_path / f"r{abs(hash((tuple(lines), tuple(cuts))))}"
    whole, _ = _log(root / "whole", data)
    expected = [(e.stamp, e.level, e.message) for e in whole.follow(None).entries]
    log, path = _log(root / "pieces", b"")
    cursor = log.follow(None).cursor
    got: list[tuple[str, str, str]] = []
    pos = 0
    for cut in [*cuts, len(data)]:
        _append(path, data[pos:pos + cut])
        pos = min(len(data), pos + cut)
        res = log.follow(cursor)
        cursor = res.cursor
        got += [(e.stamp, e.level, e.message) for e in res.entries]
    _append(path, data[pos:])
    got += [(e.stamp, e.level, e.message) for e in log.follow(cursor).entries]
    assert got == expected
