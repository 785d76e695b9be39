"""Other projects' kernel-log test lines through gpumon's parser and checks (issue 11).

tests/data/peer-fixtures (byte-for-byte copies of shared/realdata/peer-fixtures, provenance in
SOURCES.md there) holds the lines gpud, NVSentinel, gcm, sichek and the kernel's AER howto wrote
into their own tests, each case with what that project expects and what NVIDIA's Xid catalog says
(``expectations.jsonl``). Every case runs through the parser (its code and bus) and through the
check that owns it (xid; pcie for AER lines; nvswitch for SXid lines), and gpumon's verdict is
asserted against ``gpumon-verdicts.jsonl``, which keeps NVIDIA's and the peer's verdicts next to
it as comparison columns. Where gpumon's action is not one NVIDIA's catalog accepts, the row names
the documented departure (an entry of ``gpumon_checks.xid.catalog.OVERRIDES``), and nothing else may differ.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pci_tree import add_function

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory, PciDevice
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord
from gpumon.hw.nvml import GpuInfo
from gpumon.hw.nvrm import FallenOffBus, NvrmEvent, NvrmParser, SXidEvent, XidEvent, canonical_pci
from gpumon.model import NODE, Finding, Severity
from gpumon.profiles import GENERIC
from gpumon_checks.nvswitch import NvswitchCheck
from gpumon_checks.pcie import PcieCheck
from gpumon_checks.xid import XidCheck
from gpumon_checks.xid.catalog import OVERRIDES

DATA = Path(__file__).resolve().parents[1] / "data" / "peer-fixtures"
PEER_FILES = ("gpud.txt", "nvsentinel.txt", "gcm.txt", "sichek.txt", "linux-docs.txt")
BOOT = 1_700_000_000.0


def _jsonl(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line]


CASES = {c["id"]: c for c in _jsonl("expectations.jsonl")}
VERDICTS = {v["id"]: v for v in _jsonl("gpumon-verdicts.jsonl")}


@cache
def _peer_file_cases() -> dict[str, list[str]]:
    """The ``#== <id> | ...`` cases of the peer .txt files: id -> lines."""
    out: dict[str, list[str]] = {}
    for name in PEER_FILES:
        current: list[str] | None = None
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            if line.startswith("#== "):
                current = out.setdefault(line[4:].split(" | ")[0].strip(), [])
            elif current is not None and not line.startswith("# "):
                current.append(line)
    return out


def _bus(case: dict[str, Any]) -> str | None:
    raw = case["expected_bus"]
    return canonical_pci(raw) if raw else None


def _parse(lines: list[str]) -> tuple[list[KernelRecord], list[NvrmEvent]]:
    records = [parse_line(line) for line in lines]
    parser = NvrmParser()
    events: list[NvrmEvent] = []
    for rec in records:
        events.extend(parser.feed(rec))
    events.extend(parser.flush())
    return records, events


def _now(log: KernelLog) -> float:
    return max((log.time_of(r, BOOT) for r in log.records), default=BOOT) + 60


def _picked(findings: list[Finding], code: int | None, component: str | None = None) -> dict[str, Any]:
    """gpumon's verdict on one case: the finding for its code (else the node's)."""
    mine = [f for f in findings if f.evidence.get("code") == code] if code is not None else [
        f for f in findings if f.component != NODE]
    if component is not None:
        mine = [f for f in mine if f.component == component]
    if not mine:
        node = [f for f in findings if f.component == NODE]
        worst = max((f.severity for f in node), default=Severity.OK)
        return {"reported": False, "component": None, "severity": worst.value, "action": "none"}
    f = max(mine, key=lambda f: (f.severity, f.action))
    return {"reported": True, "component": f.component, "severity": f.severity.value,
            "action": f.action.value}


def _xid(case: dict[str, Any], records: list[KernelRecord], events: list[NvrmEvent],
         tmp_path: Path) -> dict[str, Any]:
    bus = _bus(case)
    gpus = [GpuInfo(0, "GPU-0", None, bus, "NVIDIA GB200", "blackwell", 18, 0)] if bus else []
    inv = Inventory(gpus=gpus, pci_devices=[PciDevice(bus, "0x10de", "0x2941", "0x030200")] if bus else [])
    log = KernelLog(events=events, records=records, source=case["id"], boot_time=BOOT)
    now = _now(log)
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=inv, profile=GENERIC, options=None, state={},
                       kernel_log=log, clock=lambda: now)
    return _picked(run_on_json(XidCheck(), ctx), case["expected_code"])


def _sxid(case: dict[str, Any], records: list[KernelRecord], events: list[NvrmEvent],
          tmp_path: Path) -> dict[str, Any]:
    bus = _bus(case) or "0000:00:00.0"
    inv = Inventory(pci_devices=[PciDevice(bus, "0x10de", "0x22a3", "0x068000")])
    log = KernelLog(events=events, records=records, source=case["id"], boot_time=BOOT)
    now = _now(log)
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=inv, profile=GENERIC, options=None, state={},
                       kernel_log=log, clock=lambda: now)
    return _picked(run_on_json(NvswitchCheck(), ctx), case["expected_code"])


# the link speed of the test trees (a Gen5 root port and GPU)
GEN5 = "32.0 GT/s PCIe"


# AER cases: the PCI path each line is on (root port, then the GPU below it), from the line's ids
AER_TREES = {
    "gcm-aer-corr": ("0000:00:01.0", "0000:01:00.0"),
    "gcm-aer-nonfatal": ("0000:00:02.0", "0000:02:00.0"),
    "gcm-aer-fatal": ("0000:00:03.0", "0000:03:00.0"),
    "gcm-aer-cantrecover": ("0000:00:01.0", "0000:01:00.0"),
    "linux-aer-doc": ("0000:50:00.0", "0000:51:00.0"),  # the howto's [8086:0329] is a bridge
}


def _aer(case: dict[str, Any], records: list[KernelRecord], tmp_path: Path) -> dict[str, Any]:
    port, gpu = AER_TREES[case["id"]]
    add_function(tmp_path, f"pci0000:00/{port}", "0x8086", "0x060400", device="0x0329", speed=GEN5)
    add_function(tmp_path, f"pci0000:00/{port}/{gpu}", "0x10de", "0x030200", device="0x2330", speed=GEN5)
    inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, gpu, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)])
    log = KernelLog(records=records, source=case["id"], boot_time=BOOT)
    now = _now(log)
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=inv, profile=GENERIC, options=None, state={},
                       kernel_log=log, clock=lambda: now)
    bus = _bus(case)
    bad = [f for f in run_on_json(PcieCheck(), ctx) if f.severity is not Severity.OK]
    return _picked(bad, None, f"pci/{bus}")


def gpumon_verdict(case: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """gpumon's verdict on one case, through the parser and the check that owns its lines."""
    records, events = _parse(case["lines"])
    if case["kind"] == "aer":
        return _aer(case, records, tmp_path)
    if case["kind"] == "sxid":
        return _sxid(case, records, events, tmp_path)
    return _xid(case, records, events, tmp_path)


# --------------------------------------------------------------------------- the data


def test_every_case_has_a_gpumon_verdict_and_the_lines_of_its_peer_file() -> None:
    assert len(CASES) == 149
    assert set(VERDICTS) == set(CASES)
    files = _peer_file_cases()
    for cid, case in CASES.items():
        # the case's lines are the peer file's (the file joins a multi-line literal one line per row)
        assert [line.strip() for line in case["lines"]] == [line.strip() for line in files[cid]], cid


# --------------------------------------------------------------------------- the parser


@pytest.mark.parametrize("cid", sorted(CASES))
def test_parser_finds_the_code_and_bus(cid: str) -> None:
    case = CASES[cid]
    _, events = _parse(case["lines"])
    code, bus = case["expected_code"], _bus(case)
    kind = case["kind"]
    if kind == "none":
        assert not [e for e in events if isinstance(e, (XidEvent, SXidEvent, FallenOffBus))], events
    elif kind == "aer":
        assert not [e for e in events if isinstance(e, (XidEvent, FallenOffBus))]
    elif kind == "sxid":
        sx = [e for e in events if isinstance(e, SXidEvent)]
        assert sx and sx[0].code == code and sx[0].pci == bus, events
    elif kind == "fob":
        fob = [e for e in events if isinstance(e, FallenOffBus)]
        assert fob and fob[0].pci == bus and not [e for e in events if isinstance(e, XidEvent)], events
    else:
        xids = [e for e in events if isinstance(e, XidEvent)]
        assert xids and xids[0].code == code and xids[0].pci == bus, events


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("cid", sorted(CASES))
def test_check_verdict_is_gpumons_and_departs_from_nvidia_only_by_a_documented_override(
        cid: str, tmp_path: Path) -> None:
    case, recorded = CASES[cid], VERDICTS[cid]
    got = gpumon_verdict(case, tmp_path)
    assert got == recorded["gpumon"], (cid, got)
    nvidia = case["nvidia_catalog"] or {}
    accepts = nvidia.get("accepts")
    if accepts is None:
        assert recorded["agrees_with_nvidia"] is None and recorded["departure"] is None
        return
    agrees = got["action"] in accepts
    assert recorded["agrees_with_nvidia"] is agrees, cid
    if agrees:
        assert recorded["departure"] is None, cid
    else:
        # the one table of deliberate departures, with its reason
        departure = recorded["departure"]
        assert departure is not None and departure.startswith("OVERRIDES["), cid
        code = int(departure.removeprefix("OVERRIDES[").removesuffix("]"))
        assert code == case["expected_code"] and code in OVERRIDES and OVERRIDES[code].reason, cid
        assert (OVERRIDES[code].severity.value, OVERRIDES[code].action.value) == (got["severity"],
                                                                                got["action"])


def test_comparison_columns_are_the_fixture_data() -> None:
    for cid, v in VERDICTS.items():
        case = CASES[cid]
        assert v["nvidia"] == case["nvidia_catalog"], cid
        assert v["peer"] == {"peer": case["peer"], "expects": case["peer_expectation"],
                             "asserts": case["peer_asserts"], "reported": case["expected_reported"],
                             "accepts_actions": case["peer_accepts_gpumon_actions"],
                             "accepts_severities": case["peer_accepts_gpumon_severities"]}, cid
