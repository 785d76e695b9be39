"""gpumon.hw.infiniband: sysfs port attributes into typed records.

Real input: tests/data/ibstat-sysfs/sys-class-infiniband_h100 (a copy of an H100
host's /sys/class/infiniband, provenance in tests/data/ibstat-sysfs/SOURCES.md).
Expected values were read off those files by hand.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumon.errors import HwCondition, HwFailure, HwTimeout, NotSupported
from gpumon.hw import Hardware
from gpumon.hw.calls import LaneHung
from gpumon.hw.infiniband import (
    PHYS_STATE_NAMES,
    SAMPLE_COUNTERS,
    STATE_NAMES,
    IbAttrError,
    IbPort,
    LinkRate,
    PortState,
    is_saturated,
    list_devices,
    list_ports,
    parse_counter,
    parse_link_layer,
    parse_rate,
    parse_state,
    read_port,
    read_ports,
)

TREE = Path(__file__).resolve().parents[1] / "data" / "ibstat-sysfs" / "sys-class-infiniband_h100"
IB_NDR = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host root with the real H100 tree at sys/class/infiniband."""
    shutil.copytree(TREE, tmp_path / "sys" / "class" / "infiniband")
    return tmp_path


def _attr(host: Path, dev: str, attr: str) -> Path:
    return host / "sys" / "class" / "infiniband" / dev / "ports" / "1" / attr


# -- parsers on the kernel's own formats ----------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("4: ACTIVE\n", PortState(4, "ACTIVE")),   # every port of the real tree
    ("1: DOWN", PortState(1, "DOWN")),          # ibstatus/kernel wording of a down port
    ("2: INIT", PortState(2, "INIT")),
    ("5: ACTIVE_DEFER", PortState(5, "ACTIVE_DEFER")),
    ("7: UNKNOWN", PortState(7, "UNKNOWN")),    # state_show() for a code it has no name for
])
def test_parse_state(text: str, want: PortState) -> None:
    assert parse_state(text) == want


@pytest.mark.parametrize(("text", "want"), [
    ("5: LinkUp", PortState(5, "LinkUp")),     # every port of the real tree
    ("3: Disabled", PortState(3, "Disabled")),
    ("2: Polling", PortState(2, "Polling")),
    ("7: Phy Test", PortState(7, "Phy Test")),
    ("0: <unknown>", PortState(0, "<unknown>")),
])
def test_parse_phys_state(text: str, want: PortState) -> None:
    assert parse_state(text, names=PHYS_STATE_NAMES) == want


@pytest.mark.parametrize("text", ["", "ACTIVE", "4", "4:", ": ACTIVE", "four: ACTIVE", "4: ACTIVE extra!",
                                  "4: DOWN", "1: ACTIVE", "4: ACTIV\x00E", "-1: DOWN", "4;ACTIVE",
                                  "4: ACTIVE\n5: LinkUp"])
def test_parse_state_rejects_garbage(text: str) -> None:
    with pytest.raises(IbAttrError):
        parse_state(text)


@pytest.mark.parametrize(("text", "want"), [
    ("400 Gb/sec (4X NDR)\n", LinkRate(400.0, 4, "NDR")),  # mlx5_0..9 of the real tree
    ("200 Gb/sec (2X NDR)", LinkRate(200.0, 2, "NDR")),    # mlx5_bond_0 (BlueField-3, Ethernet)
    ("200 Gb/sec (4X HDR)", LinkRate(200.0, 4, "HDR")),
    ("100 Gb/sec (4X EDR)", LinkRate(100.0, 4, "EDR")),
    ("2.5 Gb/sec (1X SDR)", LinkRate(2.5, 1, "SDR")),       # rate_show() prints ".5" for SDR
    ("56 Gb/sec (4X FDR)", LinkRate(56.0, 4, "FDR")),
    ("40 Gb/sec (4X FDR10)", LinkRate(40.0, 4, "FDR10")),
    ("10 Gb/sec", LinkRate(10.0)),
])
def test_parse_rate(text: str, want: LinkRate) -> None:
    assert parse_rate(text) == want


@pytest.mark.parametrize("text", ["", "fast", "400", "400 Gb/s", "Gb/sec (4X NDR)", "400 Gb/sec (0X NDR)",
                                  "400 Gb/sec (4X NDR", "400 Gb/sec (4X)", "-400 Gb/sec (4X NDR)",
                                  "400 Mb/sec (4X NDR)", "4 0 0 Gb/sec"])
def test_parse_rate_rejects_garbage(text: str) -> None:
    with pytest.raises(IbAttrError):
        parse_rate(text)


@pytest.mark.parametrize(("text", "want"), [("0", 0), ("255\n", 255), ("230442669431839", 230442669431839)])
def test_parse_counter(text: str, want: int) -> None:
    assert parse_counter(text) == want


@pytest.mark.parametrize("text", ["", "-1", "0x10", "1e3", "12a", "1 2", "N/A", "١٢"])
def test_parse_counter_rejects_garbage(text: str) -> None:
    with pytest.raises(IbAttrError):
        parse_counter(text)


def test_parse_link_layer() -> None:
    assert parse_link_layer("InfiniBand\n") == "InfiniBand"
    assert parse_link_layer("Ethernet") == "Ethernet"
    with pytest.raises(IbAttrError):
        parse_link_layer("Infini")


def test_saturation_follows_the_kernel_counter_widths() -> None:
    assert is_saturated("link_downed", 255) and not is_saturated("link_downed", 254)
    assert is_saturated("symbol_error", 65535) and not is_saturated("symbol_error", 65534)
    assert is_saturated("link_error_recovery", 255)
    assert not is_saturated("port_xmit_data", 2**63)  # 64-bit data counters are not watched for this


# -- hypothesis: any text is a typed record or IbAttrError, nothing else ---------


def _either(fn: object, text: str) -> None:
    try:
        fn(text)  # type: ignore[operator]
    except IbAttrError as exc:
        assert isinstance(exc, HwFailure)


@given(st.text(max_size=60))
def test_parsers_never_raise_anything_else(text: str) -> None:
    for fn in (parse_state, parse_rate, parse_counter, parse_link_layer):
        _either(fn, text)
    _either(lambda s: parse_state(s, names=PHYS_STATE_NAMES), text)


@given(st.binary(max_size=40).map(lambda b: b.decode("utf-8", errors="replace")))
def test_parsers_on_random_bytes(text: str) -> None:
    for fn in (parse_state, parse_rate, parse_counter):
        _either(fn, text)


@given(st.sampled_from(sorted(STATE_NAMES.items())), st.text(alphabet=" \n\t", max_size=3))
def test_state_round_trip(item: tuple[int, str], pad: str) -> None:
    code, name = item
    assert parse_state(f"{code}: {name}{pad}") == PortState(code, name)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_counter_round_trip(value: int) -> None:
    assert parse_counter(f"{value}\n") == value


@given(st.integers(min_value=1, max_value=1600), st.sampled_from([1, 2, 4, 8, 12]),
       st.sampled_from(["SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR"]))
def test_rate_round_trip(gbps: int, lanes: int, speed: str) -> None:
    assert parse_rate(f"{gbps} Gb/sec ({lanes}X {speed})\n") == LinkRate(float(gbps), lanes, speed)


@pytest.mark.parametrize(("line", "parse"), [
    ("4: ACTIVE", parse_state), ("5: LinkUp", lambda s: parse_state(s, names=PHYS_STATE_NAMES)),
    ("400 Gb/sec (4X NDR)", parse_rate), ("InfiniBand", parse_link_layer), ("255", parse_counter),
])
def test_truncated_real_lines_parse_or_raise(line: str, parse: object) -> None:
    """A read cut short (a prefix of a real line) is a record or IbAttrError, never a crash."""
    rejected = 0
    for cut in range(len(line)):
        try:
            parse(line[:cut])  # type: ignore[operator]
        except IbAttrError:
            rejected += 1
    assert rejected >= 1


# -- reading the real tree -------------------------------------------------------


def test_real_h100_tree(host: Path) -> None:
    fs = Hardware(host).fs
    assert list_devices(fs) == [*IB_NDR, "mlx5_bond_0"]
    ports = {dev: read_port(fs, dev, 1) for dev in list_devices(fs)}
    for dev in IB_NDR:
        p = ports[dev]
        assert list_ports(fs, dev) == [1]
        assert (p.up, p.is_infiniband, p.rate, p.errors) == (True, True, LinkRate(400.0, 4, "NDR"), {})
        assert p.counters["symbol_error"] == 0 and p.counters["link_error_recovery"] == 0
    assert ports["mlx5_0"].counters == {"link_downed": 0, "symbol_error": 0, "link_error_recovery": 0,
                                        "port_rcv_errors": 14}
    assert ports["mlx5_1"].counters["link_downed"] == 255
    assert ports["mlx5_1"].saturated() == ["link_downed"]
    assert ports["mlx5_0"].saturated() == []
    bond = ports["mlx5_bond_0"]
    assert (bond.up, bond.link_layer, bond.rate) == (True, "Ethernet", LinkRate(200.0, 2, "NDR"))


def test_state_only_sample(host: Path) -> None:
    _attr(host, "mlx5_4", "rate").write_text("garbage")  # not read by a state-only sample
    p = read_port(Hardware(host).fs, "mlx5_1", 1, SAMPLE_COUNTERS, details=False)
    assert (p.up, p.complete, p.rate, p.counters, p.errors) == (True, False, None, {"link_downed": 255}, {})
    assert read_port(Hardware(host).fs, "mlx5_4", 1, SAMPLE_COUNTERS, details=False).errors == {}


def test_garbage_state_raises_typed_error(host: Path) -> None:
    _attr(host, "mlx5_4", "state").write_text("4: ACT")
    with pytest.raises(IbAttrError) as err:
        read_port(Hardware(host).fs, "mlx5_4", 1)
    assert err.value.component == "ib/mlx5_4/1" and "state" in err.value.call


def test_garbage_rate_and_counters_are_listed_not_guessed(host: Path) -> None:
    _attr(host, "mlx5_5", "rate").write_text("\x00\x00")
    _attr(host, "mlx5_5", "counters/symbol_error").write_text("lots")
    (_attr(host, "mlx5_5", "counters/link_downed")).unlink()
    p = read_port(Hardware(host).fs, "mlx5_5", 1)
    assert p.rate is None and p.up
    assert set(p.errors) == {"rate", "counters/symbol_error", "counters/link_downed"}
    assert "symbol_error" not in p.counters and "link_downed" not in p.counters


def test_vanished_port_is_not_supported(host: Path) -> None:
    shutil.rmtree(host / "sys/class/infiniband/mlx5_6/ports/1")
    fs = Hardware(host).fs
    assert list_ports(fs, "mlx5_6") == []
    with pytest.raises(NotSupported):
        read_port(fs, "mlx5_6", 1)


def test_odd_port_folder_name_is_garbage(host: Path) -> None:
    (host / "sys/class/infiniband/mlx5_7/ports/x1").mkdir()
    with pytest.raises(IbAttrError):
        list_ports(Hardware(host).fs, "mlx5_7")


def test_no_infiniband_class_is_an_empty_list(tmp_path: Path) -> None:
    assert list_devices(Hardware(tmp_path).fs) == []


# -- several ports in one bounded call (the 1 s sampler) -------------------------------


def _outcome(fn: Callable[[], IbPort]) -> IbPort | tuple[type, str, str, str]:
    try:
        return fn()
    except HwCondition as cond:
        return (type(cond), str(cond), cond.call, cond.component)


def _as_outcome(r: IbPort | HwCondition) -> IbPort | tuple[type, str, str, str]:
    return r if isinstance(r, IbPort) else (type(r), str(r), r.call, r.component)


def test_read_ports_reads_each_port_as_read_port(host: Path) -> None:
    # garbage and missing files too: each port must come out exactly as read_port gives it
    _attr(host, "mlx5_4", "state").write_text("4: ACT")
    _attr(host, "mlx5_5", "rate").write_text("\x00\x00")
    _attr(host, "mlx5_5", "counters/link_downed").unlink()
    _attr(host, "mlx5_7", "phys_state").unlink()
    shutil.rmtree(host / "sys/class/infiniband/mlx5_6/ports/1")
    fs = Hardware(host).fs
    devices = list_devices(fs)
    for details in (True, False):
        got = read_ports(fs, [(dev, 1, details) for dev in devices])
        assert list(got) == [(dev, 1) for dev in devices]
        for dev in devices:
            one = (functools.partial(read_port, fs, dev, 1) if details
                   else functools.partial(read_port, fs, dev, 1, SAMPLE_COUNTERS, details=False))
            assert _as_outcome(got[(dev, 1)]) == _outcome(one), (dev, details)
        assert isinstance(got[("mlx5_6", 1)], NotSupported)
        assert isinstance(got[("mlx5_4", 1)], IbAttrError)
        assert isinstance(got[("mlx5_7", 1)], NotSupported)
        assert isinstance(got[("mlx5_0", 1)], IbPort) and got[("mlx5_0", 1)].complete is details


def test_read_ports_of_nothing_reads_nothing(tmp_path: Path) -> None:
    assert read_ports(Hardware(tmp_path).fs, []) == {}


def test_read_ports_hung_port_costs_only_that_port(host: Path) -> None:
    """Issue 14 #3: the ports before and after the one whose read hangs are read."""
    stuck = _attr(host, "mlx5_5", "counters/link_downed")
    stuck.unlink()
    os.mkfifo(stuck)  # nobody writes: the read blocks, as behind a dead device
    try:
        fs = Hardware(host, fs_timeout=0.3).fs
        start = time.monotonic()
        got = read_ports(fs, [(dev, 1, False) for dev in IB_NDR])
        assert time.monotonic() - start < 1.0
        before, hung, after = IB_NDR[:3], "mlx5_5", IB_NDR[4:]
        read_before = [got[(d, 1)] for d in before]
        assert all(isinstance(p, IbPort) and p.up for p in read_before)
        cond = got[(hung, 1)]
        # a hang is the port's condition, not one unreadable counter among others
        assert isinstance(cond, HwTimeout) and cond.component == "ib/mlx5_5/1"
        assert cond.call == "read(sys/class/infiniband/mlx5_5/ports/1/counters/link_downed)"
        read_after = [got[(d, 1)] for d in after]
        assert all(isinstance(p, IbPort) and p.up for p in read_after), read_after
        # sampled again while the read is still stuck: that port refused at once, the rest read
        start = time.monotonic()
        again = read_ports(fs, [(dev, 1, False) for dev in IB_NDR])
        assert time.monotonic() - start < 0.2
        still = again[(hung, 1)]
        assert isinstance(still, LaneHung) and still.call == cond.call and still.component == "ib/mlx5_5/1"
        assert all(isinstance(again[(d, 1)], IbPort) for d in IB_NDR if d != hung)
    finally:
        with contextlib.suppress(OSError):  # ENXIO: no reader waits
            os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))  # let the worker go
