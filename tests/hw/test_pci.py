"""gpumon.hw.pci: PCI functions, AER counter files, link attributes and kernel AER lines.

AER file texts are the kernel's (drivers/pci/pcie/aer.c ``aer_stats_dev_attr`` prints
``"%s %llu\\n"`` per named bit, ``<array>_bit[N] %llu`` for an unnamed one, then
``TOTAL_ERR_* %llu``) or quoted verbatim from Documentation/ABI/testing/
sysfs-bus-pci-devices-aer_stats. Kernel-log lines are quoted verbatim from the public issue
threads named above each of them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.errors import HwFailure, NotSupported
from gpumon.hw import Hardware
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.pci import (
    AER_FILES,
    AerParseError,
    infiniband_devices,
    parse_aer,
    parse_aer_message,
    parse_speed,
    parse_width,
    read_aer,
    read_function,
    read_link,
    resolve,
    scan,
)

# The kernel's current bit names, in the order aer.c prints them.
COR_NAMES = ["RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF"]
UNCOR_NAMES = ["Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
               "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked",
               "TLPBlockedErr", "PoisonTLPBlocked"]

# Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats (kernel 4.19 era names, with spaces)
ABI_SAMPLE = """Receiver Error 2
Bad TLP 0
Bad DLLP 0
RELAY_NUM Rollover 0
Replay Timer Timeout 0
Advisory Non-Fatal 0
Corrected Internal Error 0
Header Log Overflow 0
TOTAL_ERR_COR 2
"""


def _render(names: list[str], counts: list[int], total_key: str, total: int) -> str:
    return "".join(f"{n} {c}\n" for n, c in zip(names, counts, strict=True)) + f"{total_key} {total}\n"


# --------------------------------------------------------------------------- AER file parser


def test_parse_aer_kernel_format() -> None:
    text = _render(COR_NAMES, [3, 1, 0, 0, 2, 0, 0, 0], "TOTAL_ERR_COR", 5)
    counts = parse_aer(text, "TOTAL_ERR_COR")
    assert counts.total == 5 and counts.errors["RxErr"] == 3 and counts.errors["Timeout"] == 2


def test_parse_aer_abi_document_sample_with_spaces_in_names() -> None:
    counts = parse_aer(ABI_SAMPLE, "TOTAL_ERR_COR")
    assert counts.total == 2
    assert counts.errors == {"Receiver Error": 2, "Bad TLP": 0, "Bad DLLP": 0, "RELAY_NUM Rollover": 0,
                             "Replay Timer Timeout": 0, "Advisory Non-Fatal": 0,
                             "Corrected Internal Error": 0, "Header Log Overflow": 0}


def test_parse_aer_unnamed_bit_line() -> None:
    text = "Undefined 0\nDLP 1\ndev_fatal_errs_bit[27] 4\nTOTAL_ERR_FATAL 5\n"
    assert parse_aer(text, "TOTAL_ERR_FATAL").errors["dev_fatal_errs_bit[27]"] == 4


@pytest.mark.parametrize("text, why", [
    ("", "no TOTAL_ERR_COR"),
    ("RxErr 1\nBadTLP 0\n", "no TOTAL_ERR_COR"),                 # truncated before the total
    ("RxErr 1\nBadTLP", "expected 'NAME COUNT'"),                # cut inside a line
    ("RxErr 1\nTOTAL_ERR_FATAL 1\n", "where TOTAL_ERR_COR"),     # another file's total
    ("RxErr 1\nRxErr 2\nTOTAL_ERR_COR 3\n", "twice"),
    ("TOTAL_ERR_COR 1\nRxErr 1\n", "after the TOTAL_ERR_COR"),
    ("RxErr -1\nTOTAL_ERR_COR 0\n", "expected 'NAME COUNT'"),
    ("RxErr 0x10\nTOTAL_ERR_COR 0\n", "expected 'NAME COUNT'"),
    ("RxErr 18446744073709551616\nTOTAL_ERR_COR 0\n", "64-bit"),
    ("\x00\x01garbage 1\nTOTAL_ERR_COR 1\n", "expected 'NAME COUNT'"),
])
def test_parse_aer_refuses_malformed(text: str, why: str) -> None:
    with pytest.raises(AerParseError, match=why):
        parse_aer(text, "TOTAL_ERR_COR")


@given(st.text(max_size=400))
def test_parse_aer_any_text_parses_or_raises_aer_parse_error(text: str) -> None:
    try:
        counts = parse_aer(text, "TOTAL_ERR_NONFATAL")
    except AerParseError:
        return
    assert counts.total >= 0 and all(c >= 0 for c in counts.errors.values())


@given(st.lists(st.integers(0, 2**64 - 1), min_size=len(UNCOR_NAMES), max_size=len(UNCOR_NAMES)),
       st.integers(0, 2**64 - 1))
def test_parse_aer_round_trips_the_kernel_format(counts: list[int], total: int) -> None:
    parsed = parse_aer(_render(UNCOR_NAMES, counts, "TOTAL_ERR_NONFATAL", total), "TOTAL_ERR_NONFATAL")
    assert parsed.total == total and list(parsed.errors.values()) == counts


@given(st.lists(st.integers(0, 10**6), min_size=len(COR_NAMES), max_size=len(COR_NAMES)),
       st.integers(0, 10**6), st.data())
def test_parse_aer_truncated_file_is_refused(counts: list[int], total: int, data: st.DataObject) -> None:
    text = _render(COR_NAMES, counts, "TOTAL_ERR_COR", total)
    total_digits_at = text.rindex("TOTAL_ERR_COR ") + len("TOTAL_ERR_COR ")
    cut = data.draw(st.integers(0, total_digits_at))
    with pytest.raises(AerParseError):
        parse_aer(text[:cut], "TOTAL_ERR_COR")


# --------------------------------------------------------------------------- link attributes


@pytest.mark.parametrize("text, gts", [
    ("32.0 GT/s PCIe", 32.0), ("2.5 GT/s PCIe", 2.5), ("16.0 GT/s PCIe", 16.0),
    ("8 GT/s", 8.0), ("5 GT/s", 5.0),          # kernels before 5.x had no " PCIe"
    ("Unknown", None), ("Unknown speed", None),
])
def test_parse_speed(text: str, gts: float | None) -> None:
    assert parse_speed(text) == gts


@pytest.mark.parametrize("text", ["", "32", "32.0 Gb/s", "33.0 GT/s PCIe", "fast", "1e9 GT/s"])
def test_parse_speed_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_speed(text)


@pytest.mark.parametrize("text", ["", "x16", "-1", "64", "١٦", "16 lanes"])
def test_parse_width_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_width(text)


@given(st.text(max_size=40))
def test_link_parsers_raise_only_value_error(text: str) -> None:
    for parse in (parse_speed, parse_width):
        with contextlib.suppress(ValueError):
            parse(text)


# --------------------------------------------------------------------------- the tree


def _function(root: Path, path: str, vendor: str, device: str, cls: str, *, aer: bool = False,
              link: tuple[str, str, str, str] | None = None) -> str:
    """A device directory at ``sys/devices/<path>`` with its sys/bus/pci/devices link."""
    bdf = path.rsplit("/", 1)[-1]
    d = root / "sys/devices" / path
    d.mkdir(parents=True, exist_ok=True)
    for name, value in (("vendor", vendor), ("device", device), ("class", cls)):
        (d / name).write_text(value + "\n")
    if aer:
        for _kind, (name, total) in AER_FILES.items():
            (d / name).write_text(f"RxErr 0\n{total} 0\n")
    if link:
        names = ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width")
        for name, value in zip(names, link, strict=True):
            (d / name).write_text(value + "\n")
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / bdf).symlink_to(f"../../../devices/{path}")
    return bdf


def _hgx_branch(root: Path) -> None:
    """Root port -> switch upstream port -> downstream port -> GPU, as on an HGX H100 board."""
    gen5 = ("32.0 GT/s PCIe", "32.0 GT/s PCIe", "16", "16")
    base = "pci0000:15/0000:15:01.0"
    _function(root, base, "0x8086", "0x352a", "0x060400", aer=True, link=gen5)
    _function(root, f"{base}/0000:16:00.0", "0x1000", "0xc030", "0x060400", aer=True, link=gen5)
    _function(root, f"{base}/0000:16:00.0/0000:17:01.0", "0x1000", "0xc030", "0x060400", aer=True, link=gen5)
    _function(root, f"{base}/0000:16:00.0/0000:17:01.0/0000:19:00.0", "0x10de", "0x2330", "0x030200",
              aer=True, link=gen5)


def test_scan_reads_identity_ancestors_and_port_roles(tmp_path: Path) -> None:
    _hgx_branch(tmp_path)
    tree = scan(Hardware(tmp_path).fs)
    assert not tree.errors
    gpu = tree.functions["0000:19:00.0"]
    assert gpu.is_nvidia_gpu and gpu.vendor == "0x10de" and gpu.device == "0x2330"
    assert gpu.ancestors == ("0000:15:01.0", "0000:16:00.0", "0000:17:01.0")
    assert gpu.path == "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
    roles = {bdf: tree.role(bdf) for bdf in tree.functions}
    assert roles == {"0000:15:01.0": "root_port", "0000:16:00.0": "switch_upstream",
                     "0000:17:01.0": "switch_downstream", "0000:19:00.0": "endpoint"}
    assert tree.link_partner("0000:19:00.0") == "0000:17:01.0"
    assert tree.link_partner("0000:16:00.0") == "0000:15:01.0"
    assert tree.link_partner("0000:17:01.0") is None  # its link faces down, to the GPU
    assert [f.bdf for f in tree.below("0000:16:00.0")] == ["0000:17:01.0", "0000:19:00.0"]


@pytest.mark.parametrize("target", ["/etc", "../../../../../outside/0000:19:00.0"])
def test_a_link_out_of_the_host_root_is_refused(tmp_path: Path, target: str) -> None:
    root = tmp_path / "host"
    outside = tmp_path / "outside" / "0000:19:00.0"
    outside.mkdir(parents=True)
    for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
        (outside / name).write_text(value)
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    (bus / "0000:19:00.0").symlink_to(target)
    fs = Hardware(root).fs
    with pytest.raises(HwFailure, match="outside the host root"):
        resolve(fs, "sys/bus/pci/devices/0000:19:00.0")
    tree = scan(fs)
    assert not tree.functions
    assert "outside the host root" in tree.errors["0000:19:00.0"]


def test_an_attribute_link_out_of_the_host_root_is_refused(tmp_path: Path) -> None:
    _hgx_branch(tmp_path / "host")
    secret = tmp_path / "secret"
    secret.write_text("RxErr 0\nTOTAL_ERR_COR 0\n")
    gpu_dir = tmp_path / "host/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
    (gpu_dir / "aer_dev_correctable").unlink()
    (gpu_dir / "aer_dev_correctable").symlink_to(secret)
    fs = Hardware(tmp_path / "host").fs
    with pytest.raises(HwFailure, match="outside the host root"):
        read_aer(fs, read_function(fs, "0000:19:00.0"))


def test_dangling_and_misnamed_links(tmp_path: Path) -> None:
    bus = tmp_path / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    (bus / "0000:01:00.0").symlink_to("../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0")
    (tmp_path / "sys/devices/pci0000:00/0000:00:02.0").mkdir(parents=True)
    (bus / "0000:02:00.0").symlink_to("../../../devices/pci0000:00/0000:00:02.0")
    (bus / "not-a-bdf").mkdir()
    tree = scan(Hardware(tmp_path).fs)
    assert not tree.functions
    assert "does not exist" in tree.errors["0000:01:00.0"]
    assert "not to a directory named" in tree.errors["0000:02:00.0"]
    assert set(tree.errors) == {"0000:01:00.0", "0000:02:00.0"}


def test_garbage_identity_is_an_error_not_a_function(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:00/0000:00:01.0", "NVIDIA", "0x2330", "0x030200")
    tree = scan(Hardware(tmp_path).fs)
    assert "expected a hex id" in tree.errors["0000:00:01.0"]


def test_infiniband_devices_follow_the_device_link(tmp_path: Path) -> None:
    _function(tmp_path, "pci0000:15/0000:15:01.0/0000:1a:00.0", "0x15b3", "0x1021", "0x020700")
    ib = tmp_path / "sys/class/infiniband"
    (ib / "mlx5_0").mkdir(parents=True)
    (ib / "mlx5_0/device").symlink_to("../../../devices/pci0000:15/0000:15:01.0/0000:1a:00.0")
    (ib / "mlx5_9").mkdir()
    (ib / "mlx5_9/device").symlink_to("/proc")
    found, errors = infiniband_devices(Hardware(tmp_path).fs)
    assert found == {"mlx5_0": "0000:1a:00.0"}
    assert "outside the host root" in errors["mlx5_9"]


def test_read_aer_and_link(tmp_path: Path) -> None:
    _hgx_branch(tmp_path)
    fs = Hardware(tmp_path).fs
    gpu = read_function(fs, "0000:19:00.0")
    stats = read_aer(fs, gpu)
    assert stats is not None and stats.fatal.total == 0 and stats.correctable.errors == {"RxErr": 0}
    link = read_link(fs, gpu)
    assert link is not None
    assert (link.current_gen, link.max_gen, link.current_width, link.max_width) == (5, 5, 16, 16)
    gpu_dir = tmp_path / gpu.path
    (gpu_dir / "aer_dev_fatal").write_text("Undefined 0\nDLP 3\nSDES")
    with pytest.raises(HwFailure, match="aer_dev_fatal"):
        read_aer(fs, gpu)
    (gpu_dir / "aer_dev_fatal").unlink()
    with pytest.raises(HwFailure, match="aer_dev_fatal missing"):
        read_aer(fs, gpu)
    for kind in ("aer_dev_correctable", "aer_dev_nonfatal"):
        (gpu_dir / kind).unlink()
    assert read_aer(fs, gpu) is None  # not AER-capable: no counters, not an error
    (gpu_dir / "current_link_width").write_text("sixteen\n")
    with pytest.raises(HwFailure, match="current_link_width"):
        read_link(fs, gpu)
    for name in ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width"):
        (gpu_dir / name).unlink()
    assert read_link(fs, gpu) is None


def test_missing_pci_tree(tmp_path: Path) -> None:
    tree = scan(Hardware(tmp_path).fs)
    assert not tree.functions and not tree.errors
    with pytest.raises(NotSupported):
        resolve(Hardware(tmp_path).fs, "sys/bus/pci/devices/0000:00:00.0")


# --------------------------------------------------------------------------- kernel AER messages


def _msg(line: str):  # type: ignore[no-untyped-def]
    return parse_aer_message(parse_line(line).text)


def test_aer_lines_kernel_5x_source_device_prefix() -> None:
    # https://github.com/rwth-i6/returnn/issues/1500 (dmesg -H, an NVIDIA GPU behind root port 00:03.0)
    head = _msg("[  +0.000004] pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
                "type=Transaction Layer, (Requester ID)")
    assert head is not None and (head.kind, head.bdf, head.severity, head.error_type) == (
        "header", "0000:00:03.0", "fatal", "Transaction Layer")
    status = _msg("[  +0.000898] pcieport 0000:00:03.0:   device [8086:6f08] error "
                  "status/mask=00004020/00000000")
    assert status is not None
    assert (status.ids, status.status, status.mask) == ("8086:6f08", "00004020", "00000000")
    bit = _msg("[  +0.000894] pcieport 0000:00:03.0:    [14] CmpltTO                (First)")
    assert bit is not None and (bit.bit, bit.name) == (14, "CmpltTO (First)")
    assert _msg("[  +0.000921] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)") is None
    assert _msg("[  +0.000001] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: "
                "0000:00:03.0") is None


def test_aer_lines_kernel_6x_wording_and_driver_prefix() -> None:
    # https://github.com/pop-os/pop/issues/3363 (journal, kernel 6.x "Correctable", nvidia driver prefix)
    head = _msg("Sep 19 16:18:04 bubz kernel: [68185.875295] nvidia 0000:07:00.0: PCIe Bus Error: "
                "severity=Correctable, type=Data Link Layer, (Transmitter ID)")
    assert head is not None and (head.bdf, head.severity) == ("0000:07:00.0", "correctable")
    # https://github.com/minisforum-docs/MS-02-Ultra/issues/10 ("Uncorrectable (Non-Fatal)")
    head = _msg("Sep 22 09:59:09 pve kernel: pcieport 0000:80:1b.4: PCIe Bus Error: "
                "severity=Uncorrectable (Non-Fatal), type=Transaction Layer, (Receiver ID)")
    assert head is not None and (head.bdf, head.severity) == ("0000:80:1b.4", "nonfatal")
    # https://github.com/pop-os/pop/issues/751 ("AER: " after the device prefix)
    head = _msg(" pcieport 0000:00:1d.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, "
                "(Receiver ID)")
    assert head is not None and (head.bdf, head.severity) == ("0000:00:1d.0", "correctable")
    status = _msg(" nvme 0000:03:00.0: AER: device [144d:a808] error status/mask=00000001/0000e000")
    assert status is not None and status.bdf == "0000:03:00.0"


def test_aer_lines_kernel_doc_example_without_driver() -> None:
    # Documentation/PCI/pcieaer-howto.rst, "AER error output"
    head = parse_aer_message("0000:50:00.0: PCIe Bus Error: severity=Uncorrectable (Fatal), "
                             "type=Transaction Layer, (Requester ID)")
    assert head is not None and (head.bdf, head.severity) == ("0000:50:00.0", "fatal")
    bit = parse_aer_message("0000:50:00.0:    [20] UnsupReq               (First)")
    assert bit is not None and (bit.bit, bit.name) == (20, "UnsupReq (First)")


def test_aer_lines_old_kernels_name_the_source_by_id() -> None:
    # https://github.com/ROCm/legacy-rocm-build/issues/32 (kernel 4.4: root port prefix, id=00e4)
    head = _msg("[  942.180239] pcieport 0000:00:1c.4: PCIe Bus Error: severity=Uncorrected (Fatal), "
                "type=Transaction Layer, id=00e4(Receiver ID)")
    assert head is not None and (head.bdf, head.reporter, head.severity) == ("0000:00:1c.4", "0000:00:1c.4",
                                                                              "fatal")
    bit = _msg("[  942.180392] pcieport 0000:00:1c.4:    [18] Malformed TLP          (First)")
    assert bit is not None and bit.name == "Malformed TLP (First)"
    # https://github.com/hirschmann/nbfc/issues/181 (localized syslog date, id=00e5)
    head = _msg("jan. 29 20:50:17 kevin kernel: pcieport 0000:00:1c.5: PCIe Bus Error: severity=Corrected, "
                "type=Physical Layer, id=00e5(Receiver ID)")
    assert head is not None and (head.bdf, head.severity) == ("0000:00:1c.5", "correctable")
    # https://github.com/geerlingguy/raspberry-pi-pcie-devices/issues/64: the id names another function
    head = _msg("[    3.499123] pcieport 0000:00:1d.0: PCIe Bus Error: severity=Corrected, "
                "type=Physical Layer, id=00e8(Receiver ID)")
    assert head is not None and (head.bdf, head.reporter) == ("0000:00:1d.0", "0000:00:1d.0")


def test_old_style_id_decodes_bus_device_function() -> None:
    # constructed: id=0310 is bus 0x03, devfn 0x10 = device 2, function 0
    line = ("pcieport 0000:00:1c.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), "
            "type=Transaction Layer, id=0310(Requester ID)")
    head = parse_aer_message(line)
    assert head is not None and (head.bdf, head.reporter) == ("0000:03:02.0", "0000:00:1c.0")


@given(st.text(max_size=200))
def test_aer_message_parser_never_raises(text: str) -> None:
    parse_aer_message(text)
    parse_aer_message("pcieport 0000:00:01.0: PCIe Bus Error: severity=" + text)
    parse_aer_message("nvidia 0000:19:00.0:    [" + text)


# --------------------------------------------------------------------------- issue 14: storms

_BIT_PIECES = st.lists(st.sampled_from([
    "pcieport ", "nvidia ", "0000:17:00.0", "0000:17:00.8", "10000:3b:00.1", "0000:3B:00.7", ":", ": ",
    "AER:", " AER: ", "AER: ", "  ", "\t", "\u00a0", "[", "]", "[ 0]", "[12]", "[ 7 ]", "[123]", " RxErr",
    " (First)", "Timeout ", "x", "\n", "   ", "device [10de:2330]"]), max_size=12).map("".join)
_WS = st.sampled_from(["", " ", "   ", "\t", "\u00a0", "\n"])
# near misses and hits: <prefix><bdf>:<ws>[AER:<ws>][<ws><bit><ws>]<ws><name>, every piece varied
_BIT_LINES = st.builds(
    lambda pre, bdf, w1, aer, w2, w3, bit, w4, w5, name, post:
        f"{pre}{bdf}:{w1}{aer}{w2}[{w3}{bit}{w4}]{w5}{name}{post}",
    _BIT_PIECES,
    st.sampled_from(["0000:17:00.0", "0000:3B:00.7", "10000:3b:00.1", "0000:17:00.8", "17:00.0"]),
    _WS, st.sampled_from(["", "AER:", "AER: ", "aer:"]), _WS, _WS, st.sampled_from(["0", "12", "123", "x"]),
    _WS, _WS, st.sampled_from(["RxErr", "Timeout (First)", "", "BadTLP  (First)  "]), _BIT_PIECES)


@settings(max_examples=1500, deadline=None)
@given(st.one_of(_BIT_PIECES, _BIT_LINES))
def test_aer_bit_lines_are_found_as_the_regex_search_found_them(text: str) -> None:
    """parse_aer_message finds an error-bit line from each "[" instead of trying the bus-id
    pattern at every offset (most of its cost in a kernel-log storm): the same match."""
    from gpumon.hw.pci import _BIT_RE, _bit_line

    b = _BIT_RE.search(text)
    want = None if b is None else (b.group("bdf").lower(), int(b.group("bit")), b.group("name"))
    assert _bit_line(text) == want
