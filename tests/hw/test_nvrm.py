"""gpumon.hw.nvrm on the real captures in tests/data/kmsg-xid (provenance in SOURCES.md there).

Expectations were read off the capture files by hand; where a line is quoted
inline it is verbatim from xid-catalog.md "Kernel log line formats" and its
source is named next to it.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord
from gpumon.hw.nvrm import (
    FallenOffBus,
    GpuIdentity,
    NvrmEvent,
    NvrmParser,
    SXidEvent,
    XidEvent,
    canonical_pci,
    parse_file,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "kmsg-xid"
CAPTURES = sorted(DATA.glob("*.log"))
UTC = timezone.utc


def _events(name: str) -> tuple[list[NvrmEvent], NvrmParser]:
    parser = NvrmParser()
    events: list[NvrmEvent] = []
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        events.extend(parser.feed(parse_line(line)))
    events.extend(parser.flush())
    assert events == parse_file(DATA / name)
    return events, parser


def _feed(*lines: str) -> tuple[list[NvrmEvent], NvrmParser]:
    parser = NvrmParser()
    events: list[NvrmEvent] = []
    for line in lines:
        events.extend(parser.feed(parse_line(line)))
    return events, parser


def _xids(events: list[NvrmEvent]) -> list[XidEvent]:
    return [e for e in events if isinstance(e, XidEvent)]


@pytest.mark.parametrize(
    ("given_", "want"),
    [
        ("0000:38:00", "0000:38:00.0"),
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0008:01:00", "0008:01:00.0"),
        ("PCI:0000:9B:00", "0000:9b:00.0"),
        ("0000:06:00.0", "0000:06:00.0"),
        ("38:00.1", "0000:38:00.1"),
        (" 0019:01:00 ", "0019:01:00.0"),
        ("...", None),
        ("PCI:...", None),
        ("", None),
        ("0000:38", None),
        ("0000:38:20.0", None),  # device numbers stop at 0x1f
        ("0000:38:00.8", None),
        ("zzzz:38:00", None),
        ("0000:38:00:00", None),
    ],
)
def test_canonical_pci(given_: str, want: str | None) -> None:
    assert canonical_pci(given_) == want


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_every_capture_parses(path: Path) -> None:
    parse_file(path)


def test_xid13_storm_then_xid43() -> None:
    events, parser = _events("dmesg-decode-iso_xid13-storm_then_xid43.log")
    assert all(isinstance(e, XidEvent) for e in events)
    xids = _xids(events)
    assert [e.code for e in xids].count(13) == 629
    assert [e.code for e in xids].count(43) == 7
    assert len(xids) == 636
    assert {e.pci for e in xids} == {"0000:38:00.0"}
    for e in xids:
        if e.code == 13:
            assert (e.pid, e.process) == (None, None)  # pid='<unknown>', name=<unknown>
        else:
            assert isinstance(e.pid, int) and e.process == "pt_main_thread"
            assert e.message == "Ch 00000008"
    assert xids[0].code == 13  # each Xid 43 follows the burst of Xid 13 it closes
    assert all(xids[i - 1].code == 13 for i, e in enumerate(xids) if e.code == 43)
    first = xids[0]
    assert first.message == "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address"
    assert first.record.wall_time == datetime(2025, 1, 21, 2, 21, 33, 498559, tzinfo=UTC)
    assert xids[15].code == 43 and xids[15].pid == 2815167
    assert parser.unparsed_nvrm_lines == 0


def test_legacy_format_without_pid_and_name() -> None:
    events, parser = _events("issue_dxvk-1027_geforce_xid31-xid13-xid32_legacy-format.log")
    assert [type(e).__name__ for e in events] == ["XidEvent", "GpuIdentity"] + ["XidEvent"] * 6
    first = events[0]
    assert isinstance(first, XidEvent)
    # the reporter's first line has no timestamp at all
    assert (first.record.monotonic_us, first.record.wall_time) == (None, None)
    assert (first.code, first.pci, first.pid, first.process) == (31, "0000:01:00.0", None, None)
    assert first.message.startswith("Ch 0000005a, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_1")
    ident = events[1]
    assert ident == GpuIdentity(
        "0000:01:00.0", "GPU-8a47641b-dff6-f09f-618c-c3eb58fb430d", None, ident.record
    )
    assert ident.record.monotonic_us == 31543449440
    xids = _xids(events)
    assert [e.code for e in xids] == [31, 31, 13, 13, 13, 13, 32]
    assert all(e.pid is None and e.process is None and e.pci == "0000:01:00.0" for e in xids)
    assert xids[2].message == "Graphics Exception: Class 0x0 Subchannel 0x0 Mismatch"
    assert xids[6].message == "Channel ID 00000052 intr 02000000"
    assert parser.unparsed_nvrm_lines == 0


def test_pid_without_name_journal() -> None:
    events, _ = _events("issue_dxvk-1799_journalctl-k_xid31_450.80.02.log")
    ident, a, b = events
    assert isinstance(ident, GpuIdentity)
    assert (ident.pci, ident.uuid, ident.serial) == ("0000:c1:00.0", None, None)  # "GPU-<uuid redacted>"
    for e in (a, b):
        assert isinstance(e, XidEvent)
        assert (e.code, e.pci, e.pid, e.process) == (31, "0000:c1:00.0", 12890, None)
        assert e.record.host == "zeus"
    assert isinstance(a, XidEvent) and a.message.startswith("Ch 0000003b, intr 00000000. MMU Fault")


def test_xid119_with_pid_and_name_and_identity() -> None:
    events, parser = _events("dmesg-ctime_xid119_gsp-rpc-timeout.log")
    ident = events[0]
    assert isinstance(ident, GpuIdentity)
    assert (ident.pci, ident.uuid, ident.serial) == (
        "0000:9b:00.0",
        "GPU-509665ad-b600-ac93-3616-d754b23d636d",
        "1650124014249",
    )
    xids = _xids(events)
    assert len(events) == 1 + len(xids)
    assert [(e.code, e.pid, e.process) for e in xids] == [
        (119, 2024380, "nvidia-smi"),
        (119, 2024380, "nvidia-smi"),
        (119, 2024380, "nvidia-smi"),
        (119, 1263500, "cache_mgr_main"),
        (119, 1240590, "gpud"),
    ]
    assert xids[0].message == (
        "Timeout after 6s of waiting for RPC response from GPU4 GSP! "
        "Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4)."
    )
    assert xids[4].record.wall_time == datetime(2025, 2, 23, 16, 30, 13, tzinfo=UTC)
    assert parser.unparsed_nvrm_lines == 0


def test_xid31_with_pid_name_identity_serial_zero() -> None:
    events, _ = _events("issue_open-gpu-kernel-modules-1030_xid31-with-pid-name_595.71.05.log")
    ident, xid = events
    assert isinstance(ident, GpuIdentity) and isinstance(xid, XidEvent)
    assert (ident.pci, ident.uuid, ident.serial) == (
        "0000:01:00.0",
        "GPU-4e391288-897c-ba5d-6944-dfbea55ebcfa",
        "0",
    )
    assert (xid.code, xid.pid, xid.process) == (31, 13705, "UnrealEditor")
    assert xid.message.startswith("channel 0x0000000c, intr 00000000.")


def test_xid79_identity_fallen_off_and_sxid20034() -> None:
    events, parser = _events("dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log")
    ident, xid79, fob, serial, *sxids = events
    assert isinstance(ident, GpuIdentity)
    assert (ident.pci, ident.uuid, ident.serial) == (
        "0000:91:00.0",
        "GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
        "1653723052734",
    )
    assert ident.record.monotonic_us == 6781741548768
    assert isinstance(xid79, XidEvent)
    assert (xid79.code, xid79.pci, xid79.pid, xid79.process, xid79.message) == (
        79,
        "0000:91:00.0",
        None,
        None,
        "GPU has fallen off the bus.",
    )
    assert isinstance(fob, FallenOffBus) and fob.pci == "0000:91:00.0"
    assert isinstance(serial, GpuIdentity)
    assert (serial.pci, serial.uuid, serial.serial) == ("0000:91:00.0", None, "1653723052734")
    assert all(isinstance(e, SXidEvent) for e in sxids)
    got = [(e.switch, e.pci, e.code, e.fatal, e.link) for e in sxids if isinstance(e, SXidEvent)]
    assert got == [
        (1, "0000:06:00.0", 20034, True, 48),
        (0, "0000:05:00.0", 20034, True, 63),
        (2, "0000:07:00.0", 20034, None, None),
        (0, "0000:05:00.0", 20034, None, None),
        (2, "0000:07:00.0", 20034, True, 37),
        (0, "0000:05:00.0", 20034, True, 62),
        (2, "0000:07:00.0", 20034, None, None),
        (0, "0000:05:00.0", 20034, None, None),
    ]
    messages = [e.message for e in sxids if isinstance(e, SXidEvent)]
    assert messages[0] == "Fatal, Link 48 LTSSM Fault Up"
    assert messages[2] == "Severity 1 Engine instance 60 Sub-engine instance 00"
    assert messages[3].startswith("Data {0x10000000, 0x10000000, 0x00000000,")
    assert parser.unparsed_nvrm_lines == 0


def test_sxid12028_iso_data_line() -> None:
    (e,), _ = _events("issue_gpud-338_dmesg-decode-iso_sxid12028-data.log")
    assert isinstance(e, SXidEvent)
    assert (e.switch, e.pci, e.code, e.fatal, e.link) == (1, "0000:84:00.0", 12028, None, None)
    assert e.message.startswith("Data {0x000001c0, 0x00bd5c8a,")
    assert e.record.priority == 3
    assert e.record.wall_time == datetime(2025, 1, 25, 10, 34, 54, 859532, tzinfo=UTC)


def test_sxid_non_fatal_form() -> None:
    # gpud test input quoted in xid-catalog.md section 6
    (e,), _ = _feed(
        "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, "
        "Non-fatal, Link 32 egress non-posted PRIV error (First)"
    )
    assert isinstance(e, SXidEvent)
    assert (e.switch, e.pci, e.code, e.fatal, e.link) == (3, "0000:05:00.0", 12028, False, 32)
    assert e.message == "Non-fatal, Link 32 egress non-posted PRIV error (First)"


def test_nvlink5_xid145_149_units_links_words() -> None:
    events, parser = _events("gb200_xid145-rlw-xid149-netir_with-pid-name_nots.log")
    xids = _xids(events)
    assert len(xids) == len(events) == 14
    got = [(e.pci, e.code, e.pid, e.process, e.nvlink_unit, e.nvlink_fatal, e.nvlink_link) for e in xids]
    assert got == [
        ("0008:01:00.0", 145, None, None, "RLW_SRC_TRACK", False, 12),
        ("0008:01:00.0", 145, None, None, "RLW_SRC_TRACK", False, 16),
        ("0008:01:00.0", 145, 11436, "cache_mgr_main", "RLW_SRC_TRACK", False, 3),
        ("0008:01:00.0", 149, None, None, "NETIR", True, -1),
        ("0008:01:00.0", 149, None, None, "NETIR_BER_EVENT", False, 1),
        ("0008:01:00.0", 149, None, None, "NETIR_LINK_EVT", True, 8),
        ("0018:01:00.0", 145, 876767, "ray::WorkerDict", "RLW_RXPIPE", False, 13),
        ("0018:01:00.0", 145, 922932, "acctg", "RLW_SRC_TRACK", False, 3),
        ("0018:01:00.0", 149, None, None, "NETIR", True, -1),
        ("0018:01:00.0", 149, None, None, "NETIR_BER_EVENT", False, 3),
        ("0018:01:00.0", 149, None, None, "NETIR_LINK_EVT", True, 9),
        ("0019:01:00.0", 145, None, None, "RLW_SRC_TRACK", False, 12),
        ("0019:01:00.0", 145, 876766, "ray::WorkerDict", "RLW_RXPIPE", False, 12),
        ("0019:01:00.0", 149, None, None, "NETIR", True, -1),
    ]
    assert xids[6].nvlink_words == (0x0409A0C2, 0x00000008, 0x00000001, 0x00000000, 0x00100000, 0x00000004)
    assert xids[3].nvlink_words == (0x000FE406, 0, 0, 0, 0, 0)
    assert xids[6].message.startswith("RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2")
    assert all(len(e.nvlink_words) == 6 for e in xids)
    assert parser.unparsed_nvrm_lines == 0


def test_xid149_double_spaces_and_xid154_recovery() -> None:
    events, parser = _events("gb200_xid149-netir-link-evt_xid154-recovery-action.log")
    xids = _xids(events)
    assert [(e.pci, e.code) for e in xids] == [
        ("0009:01:00.0", 149),
        ("0009:01:00.0", 154),
        ("0008:01:00.0", 149),
        ("0019:01:00.0", 154),
        ("0009:01:00.0", 149),
        ("0009:01:00.0", 149),
        ("0008:01:00.0", 149),
        ("0018:01:00.0", 154),
        ("0008:01:00.0", 154),
    ]
    first = xids[0]
    assert (first.nvlink_unit, first.nvlink_fatal, first.nvlink_link) == ("NETIR_LINK_EVT", True, 1)
    assert first.nvlink_words == (0x021425C6, 0, 0, 0, 0, 0)
    assert first.record.monotonic_us == 171167620236
    assert [e.nvlink_link for e in xids if e.code == 149] == [1, 1, 0, 15, 14]
    assert (xids[1].recovery_from, xids[1].recovery_to) == ((0x0, "None"), (0x4, "Drain and Reset"))
    for e in (xids[3], xids[7], xids[8]):
        assert (e.recovery_from, e.recovery_to) == ((0x4, "Drain and Reset"), (0x1, "GPU Reset Required"))
    assert all(e.recovery_from is None for e in xids if e.code == 149)
    assert parser.unparsed_nvrm_lines == 0


def test_xid45_caused_by_previous_xid() -> None:
    events, _ = _events("issue_open-gpu-kernel-modules-1150_xid45-caused-by-xid149-145_590.48.01.log")
    xids = _xids(events)
    assert [(e.code, e.cause_xid) for e in xids] == [
        (45, 149),
        (45, 145),
        (45, 145),
        (45, 145),
        (45, 149),
        (45, 145),
        (45, 145),
    ]
    assert [e.pci for e in xids[:4]] == ["0000:dc:00.0", "0000:ed:00.0", "0000:ba:00.0", "0000:97:00.0"]
    assert (xids[0].pid, xids[0].process, xids[0].message) == (
        1818990,
        "python3",
        "Ch 00000001 caused by previous Xid 149",
    )


def test_redacted_b200_lines_keep_the_code() -> None:
    events, parser = _events("issue_nccl-2241_b200_xid145-rlw-rxpipe_xid137.log")
    a, b = _xids(events)
    assert len(events) == 2
    assert (a.code, a.pci, a.nvlink_unit, a.nvlink_fatal, a.nvlink_link, a.nvlink_words) == (
        145,
        None,
        "RLW_RXPIPE",
        False,
        11,
        (),
    )
    assert (b.code, b.pci, b.message) == (
        137,
        None,
        "RLW_RXPIPE interrupt hit on link 11 on GPU0: PRIV Error",
    )
    assert parser.unparsed_nvrm_lines == 2


def test_fallen_off_bus_without_xid() -> None:
    events, parser = _events("issue_nvsentinel-155_fallen-off-bus-no-xid_570.158.01.log")
    (fob,) = events
    assert isinstance(fob, FallenOffBus)
    assert fob.pci == "0000:b3:00.0"
    assert fob.record.monotonic_us == 1843308145
    assert fob.record.text == "NVRM: The NVIDIA GPU 0000:b3:00.0"
    assert parser.unparsed_nvrm_lines == 0


def test_fallen_off_bus_forms() -> None:
    # single-line forms quoted in xid-catalog.md section 5 (Bumblebee-Project/Bumblebee#554, gpud sxid README)
    events, _ = _feed(
        "NVRM: GPU at 0000:01:00.0 has fallen off the bus.",
        "[6781741.548783] NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.",
    )
    assert [(type(e), getattr(e, "pci", None)) for e in events] == [
        (FallenOffBus, "0000:01:00.0"),
        (FallenOffBus, "0000:91:00.0"),
    ]
    # the same block as one /dev/kmsg record: the newlines arrive escaped
    events, _ = _feed(
        r"3,812,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\x0aNVRM: (PCI ID: 10de:26b5) installed "
        r"in this system has\x0aNVRM: fallen off the bus and is not responding to commands."
    )
    assert [(type(e), getattr(e, "pci", None)) for e in events] == [(FallenOffBus, "0000:b3:00.0")]
    # without a PCI domain (leptonai/gpud kmsg_test.go TestMatch, tests/data/peer-fixtures gpud-kmsg-09):
    # domain 0000, like an Xid line's "0000:18:00"
    events, _ = _feed("NVRM: GPU 18:00.0: GPU has fallen off the bus.",
                      "NVRM: The NVIDIA GPU 29:00.0",
                      "NVRM: (PCI ID: 10de:2901) installed in this system has",
                      "NVRM: fallen off the bus and is not responding to commands.")
    assert [(type(e), getattr(e, "pci", None)) for e in events] == [
        (FallenOffBus, "0000:18:00.0"), (FallenOffBus, "0000:29:00.0")]
    # no bus id at all (gpud-kmsg-10): nothing
    events, _ = _feed("NVRM: The NVIDIA GPU invalid-bdf.0",
                      "NVRM: fallen off the bus and is not responding to commands.")
    assert events == []
    # cut off by an unrelated line: not enough to say the GPU fell off
    events, _ = _feed(
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "[ 1843.308146] usb 1-1: new device",
        "               NVRM: fallen off the bus and is not responding to commands.",
    )
    assert events == []


def test_identity_block_cut_off_and_flush() -> None:
    events, parser = _feed("[1.0] NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b")
    assert events == []
    (ident,) = parser.flush()
    assert isinstance(ident, GpuIdentity) and ident.serial is None
    assert parser.flush() == []
    events, _ = _feed(
        "[1.0] NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
        "[1.1] pci 0000:00:01.0: something else",
        "[1.2] NVRM: GPU Board Serial Number: 1653723052734",  # nobody to attach it to
    )
    assert [(type(e), e.serial) for e in events if isinstance(e, GpuIdentity)] == [(GpuIdentity, None)]


def test_xid74_register_words() -> None:
    (e,), _ = _feed(
        "NVRM: Xid (PCI:0000:b9:00): 74, NVLink: fatal error detected on link 6(0x10000 ,0x0,  0x0)"
    )
    assert isinstance(e, XidEvent) and e.register_words == (0x10000, 0, 0) and e.nvlink_link == 6
    # NVIDIA/NVSentinel docs quote this Hopper Xid 74 line (xid-catalog.md WORKFLOW_NVLINK_ERR)
    (e,), parser = _feed(
        "[449410.332316] NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', name=<unknown>, "
        "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"
    )
    assert isinstance(e, XidEvent)
    assert (e.code, e.pci, e.nvlink_link) == (74, "0003:00:00.0", 14)
    assert e.register_words == (0, 0, 0x10000, 0, 0, 0, 0)
    assert parser.unparsed_nvrm_lines == 0


def test_xid_variants_and_damage() -> None:
    events, parser = _feed(
        "NVRM: Xid (0000:03:00): 14, Channel 00000001",  # pasted without "PCI:" (gpud kmsg_test.go)
        "NVRM: Xid (PCI:0000:04:00): 79",  # no message at all
        "NVRM: Xid (PCI:0000:04:00): 13, pid=\u00b2, name=<unknown>, odd pid",  # "²".isdigit() is True
        "NVRM: Xid (PCI:0000:01:00): ",  # truncated before the code
        "NVRM: Xid (PCI:0000:01:00): 31x, junk",
        "NVRM: Xid (PCI:0008:01:00): 145, RLW_SRC_TRACK",  # NVLink5 detail cut off
        "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from",
        # a wrapper we do not know (some log shipper's): the driver's text is still found
        "2025-01-21 02:21:33.498 node7 kern.warning kernel[0]: NVRM: Xid (PCI:0000:38:00): 13, x",
    )
    got = [(e.code, e.pci, e.message) for e in _xids(events)]
    assert got == [
        (14, "0000:03:00.0", "Channel 00000001"),
        (79, "0000:04:00.0", ""),
        (13, "0000:04:00.0", "odd pid"),
        (145, "0008:01:00.0", "RLW_SRC_TRACK"),
        (154, "0009:01:00.0", "GPU recovery action changed from"),
        (13, "0000:38:00.0", "x"),
    ]
    assert parser.unparsed_nvrm_lines == 4


def test_prefilter_ignores_noise() -> None:
    parser = NvrmParser()
    for line in (DATA / "dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log").read_text().splitlines():
        assert parser.feed(parse_line(line)) == []
    assert parser.flush() == []
    assert parser.unparsed_nvrm_lines == 0


# --------------------------------------------------------------------------- hypothesis

REAL_NVRM_LINES = [
    line
    for p in CAPTURES
    for line in p.read_text(encoding="utf-8").splitlines()
    if "NVRM" in line or "nvswitch" in line
]


@given(st.lists(st.text(), max_size=6))
def test_parser_never_raises_on_arbitrary_text(texts: list[str]) -> None:
    parser = NvrmParser()
    for t in texts:
        parser.feed(KernelRecord(text=t, raw=t))
        parser.feed(parse_line(t))
    parser.flush()


_NVRM_JUNK = st.sampled_from(
    [
        "NVRM: ",
        "NVRM: Xid (",
        "SXid (",
        "nvidia-nvswitch",
        "PCI:",
        "pid=",
        "name=",
        "Link ",
        "(",
        ")",
        ",",
        "\n",
    ]
)


@given(st.lists(st.one_of(_NVRM_JUNK, st.text(max_size=8)), max_size=20))
def test_parser_never_raises_on_nvrm_shaped_junk(parts: list[str]) -> None:
    text = "".join(parts)
    parser = NvrmParser()
    parser.feed(KernelRecord(text=text, raw=text))
    parser.flush()


@given(
    st.lists(
        st.tuples(st.sampled_from(REAL_NVRM_LINES), st.integers(0, 400), st.integers(0, 400)), max_size=8
    )
)
def test_parser_never_raises_on_truncated_real_lines(cuts: list[tuple[str, int, int]]) -> None:
    parser = NvrmParser()
    for line, a, b in cuts:
        lo, hi = sorted((a, b))
        for piece in (line[:hi], line[lo:hi], line[lo:]):
            for event in parser.feed(parse_line(piece)):
                if isinstance(event, (XidEvent, SXidEvent)):
                    assert event.pci is None or canonical_pci(event.pci) == event.pci
    parser.flush()


@pytest.mark.parametrize(
    "body",
    [
        "NVRM: Xid (PCI:0000:01:00): 74, NVLink: fatal error detected on link 1(" + "0x0 " * 8000,
        "NVRM: Xid (PCI:0000:01:00): 74, NVLink: fatal error detected on link 1(" + "0x0, " * 8000,
        "NVRM: Xid (PCI:0008:01:00): 145, " + "RLW " * 8000,
        "NVRM: Xid (PCI:0008:01:00): 154, " + "from 0x1 (" * 5000,
        "NVRM: Xid (" + "PCI:0" * 8000,
        "nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, " + "Fatal, Link " * 4000,
        "NVRM: GPU at PCI:" + "0:" * 16000,
        "NVRM: GPU " + "0:" * 16000 + " GPU serial number is " + "9" * 1000,
        "2025-01-17T17:10:43+0000 " + "x" * 30000 + " kernel: " + "NVRM: " * 3000,
        "h: kern: warn: [" + "]: [" * 8000,
    ],
)
def test_adversarial_long_lines_stay_linear(body: str) -> None:
    """A 32-64 KiB line (the follower's cap) must not make a regex backtrack for long."""
    t0 = time.perf_counter()
    parser = NvrmParser()
    parser.feed(parse_line(body))
    parser.feed(KernelRecord(text=body, raw=body))
    parser.flush()
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------------- issue 23: storms ten times larger


_STORM_TEXTS = [
    "NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x50e648=0x1",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics Exception: ESR 0x50e648=0x1",
    "NVRM: Xid (PCI:REDACTED): 79, pid=1, name=x, GPU has fallen off the bus.",  # damaged: counted
    "NVRM: Xid (PCI:0000:3b:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link -1 (0x0 0x0)",  # damaged NVLink5
    "NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
    "NVRM: GPU Board Serial Number: 1653723052734",
    "NVRM: The NVIDIA GPU 0000:b3:00.0",
    "NVRM: fallen off the bus and is not responding to commands.",
    "nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 12028, Non-fatal, Link 23 egress non-posted PRIV error",
    "pcieport 0000:17:00.0: AER: Correctable error message received from 0000:17:00.0",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x50e648=0x1"
    "\nNVRM: Xid (PCI:0000:3b:00): 43, pid=1, name=x, Ch 00000008",  # one record, two lines
]


def test_an_xid_record_looked_up_by_its_text_gives_what_parsing_it_gives() -> None:
    """The parser keeps what a one-line Xid record's text parsed to (a storm repeats a few texts):
    whatever came before (a block pending, the same text seen, memos emptied), the events and the
    count of damaged lines are those of a parse from scratch."""
    from gpumon.hw import nvrm

    rng = __import__("random").Random(23)
    texts = [rng.choice(_STORM_TEXTS) for _ in range(3000)]

    def run(memo: bool) -> tuple[list[tuple[str, object, object]], int]:
        nvrm._XID_TEXT_MEMO.clear()
        nvrm._XID_MEMO.clear()
        parser = NvrmParser()
        out: list[tuple[str, object, object]] = []
        for i, text in enumerate(texts):
            if not memo:
                nvrm._XID_TEXT_MEMO.clear()
            record = KernelRecord(text=text, raw=text, seq=i)
            out.extend((type(e).__name__, e, e.record.seq) for e in parser.feed(record))
        out.extend((type(e).__name__, e, e.record.seq) for e in parser.flush())
        return out, parser.unparsed_nvrm_lines

    fresh, fresh_unparsed = run(memo=False)
    looked_up, unparsed = run(memo=True)
    assert looked_up == fresh and unparsed == fresh_unparsed
    kinds = {name for name, _, _ in fresh}
    assert fresh_unparsed > 0 and kinds >= {"XidEvent", "GpuIdentity", "FallenOffBus", "SXidEvent"}
    # a text parsed while a block was pending is not looked up while one is: the identity first
    events, _ = _feed(_STORM_TEXTS[0], _STORM_TEXTS[4], _STORM_TEXTS[0])
    assert [type(e).__name__ for e in events] == ["XidEvent", "GpuIdentity", "XidEvent"]
