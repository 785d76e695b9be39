"""The nvswitch check's persisted state: what the previous release saved still loads and gives the
same verdicts, a restart between runs changes nothing, and saved state of another shape is refused
(logged once) instead of making the check raise on every run.

``tests/data/checkstate/nvswitch-release.json`` is the state and findings the release before typed
state (commit 4c66f69) gave for :func:`_scenario`, run by that release's code; cursor device and
inode numbers and the host-root path are masked (they differ per test directory).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw.fabricmanager import DEFAULT_LOG_PATH
from gpumon.hw.inventory import Inventory, PciDevice
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.nvrm import NvrmParser, SXidEvent, parse_file
from gpumon.model import Finding, Severity
from gpumon.profiles import GENERIC
from gpumon_checks.nvswitch import NvswitchCheck, NvswitchConfig

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = TESTS / "data" / "checkstate" / "nvswitch-release.json"
DEC = TESTS / "data" / "fabricmanager" / "fabricmanager_inband-multicast-team_dec2024.log"
SXID20034 = TESTS / "data" / "kmsg-xid" / "dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log"
SWITCHES = [PciDevice(b, "0x10de", "0x22a3", "0x068000")
            for b in ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:85:00.0")]
T0 = 1.74e9


def _sxid(line: str) -> SXidEvent:
    [event] = NvrmParser().feed(parse_line(line))
    assert isinstance(event, SXidEvent)
    return event


def _fm_append(root: Path, text: str) -> None:
    with open(root / DEFAULT_LOG_PATH, "a", encoding="utf-8") as fh:
        fh.write(text)


def _boot(root: Path, boot: str) -> None:
    path = root / "proc/sys/kernel/random/boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot + "\n")


# each step: (boot id, seconds after T0, SXid lines, fabric manager log lines appended before the run)
_STEPS: list[tuple[str, float, list[str], str]] = [
    ("boot-a", 0, [], "[Dec 19 2024 19:17:50] [ERROR] [tid 1374] failed to find the GPU handle "
     "5410063385821516767 in the multicast team request setup 6130285411925746235.\n"),
    ("boot-a", 60, ["nvidia-nvswitch3: SXid (PCI:0000:85:00.0): 20012, Non-fatal, Link 09 CRC",
                    "nvidia-nvswitch3: SXid (PCI:0000:85:00.0): 20012, Severity 0 Engine instance 09 "
                    "Sub-engine",
                    "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 22003, Data {0x1}"],
     "[Dec 19 2024 19:20:00] [ERROR] [tid 1374] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch "
     "pci bus id 00000000:85:00.0 physical id 2 port 33\n"),
    ("boot-b", 86400, ["nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 63 LTSSM Fault Up"],
     "[Dec 20 2024 19:20:00] [ERROR] [tid 1374] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch "
     "pci bus id 00000000:85:00.0 physical id 2 port 33\n"),
    ("boot-b", 86400 + 7200, [], ""),
]


def _finding(f: Finding) -> dict[str, Any]:
    return {"component": f.component, "severity": f.severity.value, "action": f.action.value,
            "message": f.message, "evidence": f.evidence}


def _masked(value: Any, root: Path) -> Any:
    """``value`` as JSON, the host root and the log's device and inode numbers masked."""
    text = json.dumps(value, sort_keys=True).replace(str(root), "<root>")
    out = json.loads(text)
    if isinstance(out, dict) and isinstance((out.get("fm") or {}).get("cursor"), dict):
        out["fm"]["cursor"].update(dev=0, ino=0)
    return out


def _unmasked(state: dict[str, Any], root: Path) -> dict[str, Any]:
    """A masked state made this host's again: the cursor names the log file here."""
    out = copy.deepcopy(state)
    cursor = (out.get("fm") or {}).get("cursor")
    if isinstance(cursor, dict):
        st = os.stat(root / DEFAULT_LOG_PATH)
        cursor.update(dev=st.st_dev, ino=st.st_ino)
    return out


def _scenario(root: Path, *, restart: bool = False, first: dict[str, Any] | None = None
              ) -> list[dict[str, Any]]:
    """Run the check over :data:`_STEPS`: per step, the state after it and its findings (masked).

    ``restart``: every step on a fresh check instance, with the saved state read back from JSON
    (the daemon restarted between the runs). ``first``: the state to start from (masked)."""
    (root / DEFAULT_LOG_PATH).parent.mkdir(parents=True, exist_ok=True)
    (root / DEFAULT_LOG_PATH).write_bytes(DEC.read_bytes() + b"\n")
    hw = Hardware(root)
    check = NvswitchCheck()
    state: dict[str, Any] = {}
    out = []
    for i, (boot, dt, lines, fm) in enumerate(_STEPS):
        _boot(root, boot)
        if fm:
            _fm_append(root, fm)
        events: list[Any] = [_sxid(line) for line in lines]
        if i == 0:
            events = [*parse_file(SXID20034), *events]
        if i == 0 and first is not None:
            state = _unmasked(first, root)
        if restart:
            state = json.loads(json.dumps(state))
            check = NvswitchCheck()
        ctx = CheckContext(hw=hw, inventory=Inventory(pci_devices=SWITCHES), profile=GENERIC,
                           options=NvswitchConfig(), state=state,
                           kernel_log=KernelLog(events=events, source="test", boot_time=1.7e9),
                           clock=lambda dt=dt: T0 + dt)
        findings = run_on_json(check, ctx)
        state = ctx.state
        out.append({"state": _masked(dict(state), root),
                    "findings": _masked([_finding(f) for f in findings], root)})
    return out


def test_the_previous_release_state_and_findings_are_reproduced(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert _scenario(tmp_path / "a") == golden  # the same JSON on disk, the same findings
    # a restart between every run: the same again
    assert _scenario(tmp_path / "b", restart=True) == golden


def test_state_saved_by_the_previous_release_loads_and_gives_the_same_findings(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    # the daemon of this release started on the state the previous release saved after step 2,
    # then runs steps 3 and 4: what the previous release gave
    run = _scenario_from(tmp_path, golden[1]["state"], start=2)
    assert run == golden[2:]


def _scenario_from(root: Path, state: dict[str, Any], *, start: int) -> list[dict[str, Any]]:
    (root / DEFAULT_LOG_PATH).parent.mkdir(parents=True, exist_ok=True)
    data = DEC.read_bytes() + b"\n" + "".join(fm for _, _, _, fm in _STEPS[:start]).encode()
    (root / DEFAULT_LOG_PATH).write_bytes(data)
    hw = Hardware(root)
    live = _unmasked(state, root)
    out = []
    for boot, dt, lines, fm in _STEPS[start:]:
        _boot(root, boot)
        if fm:
            _fm_append(root, fm)
        ctx = CheckContext(hw=hw, inventory=Inventory(pci_devices=SWITCHES), profile=GENERIC,
                           options=NvswitchConfig(), state=live,
                           kernel_log=KernelLog(events=[_sxid(line) for line in lines], source="test",
                                                boot_time=1.7e9),
                           clock=lambda dt=dt: T0 + dt)
        findings = run_on_json(NvswitchCheck(), ctx)
        live = json.loads(json.dumps(ctx.state))
        out.append({"state": _masked(live, root), "findings": _masked([_finding(f) for f in findings], root)})
    return out


# --------------------------------------------------------------------------- malformed state

_GROUP = {"switch": 0, "pci": "0000:05:00.0", "code": 20034, "lines": 1, "events": 1, "fatal_events": 1,
          "nonfatal_events": 0, "unsaid_events": 0, "links": [63], "first": T0, "last": T0,
          "samples": ["Fatal, Link 63"], "open": {"t": T0, "headed": True, "engine": 63}}

_FM_GROUP = {"kind": "nvswitch", "component": "nvswitch/0", "code": 12028, "pci": "0000:05:00.0", "fatal": 0,
             "nonfatal": 1, "ports": {"3": 1}, "physical_ids": [0], "first_stamp": "Dec 19 2024 19:17:49",
             "last_stamp": "Dec 19 2024 19:17:49", "seen": T0, "samples": []}
_VALID = {"boot_id": "boot-a", "history": {}, "sxid": {"0|20034": _GROUP}, "switch_pci": {"0000:05:00.0": 0},
          "sxid_mark": {"seq": None, "mono": 5},
          "fm": {"groups": {"nvswitch/0|12028": _FM_GROUP}, "cursor": None}}

MALFORMED: list[Any] = [
    {"boot_id": "boot-a", "history": [], "sxid": "x"},  # the reproduction: AttributeError every run
    {"boot_id": 7},
    {"boot_id": "boot-a", "sxid": {"0|20034": dict(_GROUP, links="63")}},
    {"boot_id": "boot-a", "sxid": {"0|20034": dict(_GROUP, open={"t": "soon"})}},
    {"boot_id": "boot-a", "sxid": {"0|20034": {k: v for k, v in _GROUP.items() if k != "events"}}},
    {"boot_id": "boot-a", "switch_pci": {"0000:05:00.0": "0"}},
    {"boot_id": "boot-a", "switch_pci": []},
    {"boot_id": "boot-a", "sxid_mark": {"seq": "12"}},
    {"boot_id": "boot-a", "sxid_mark": 5},
    {"boot_id": "boot-a", "fm": []},
    {"boot_id": "boot-a", "fm": {"groups": {"other": {"kind": "other", "count": "1"}}}},
    {"boot_id": "boot-a", "fm": {"groups": {"x": {"kind": "nvswitch", "component": "nvswitch/0"}}}},
    {"boot_id": "boot-a", "fm": {"groups": {}, "stats": {"entries": None}}},
    {"boot_id": "boot-a", "fm": {"groups": {}, "cursor": "start"}},
    {"boot_id": "boot-a", "history": {"0000:05:00.0|20034": "yesterday"}, "unknown": 1},
    {"boot_id": "boot-a", "history": 3},
    {"boot_id": "boot-a", "sxid": {"0|20034": dict(_GROUP, switch=-1)}},  # no component name
    {"boot_id": "boot-a", "sxid": {"0|20034": dict(_GROUP, fatal_events=0)}},  # no verdict
    {"boot_id": "boot-a", "switch_pci": {"0000:05:00.0": -2}},
    {"boot_id": "boot-a", "fm": {"groups": {"nvswitch/0|12028": dict(_FM_GROUP, ports={"three": 1})}}},
    {"boot_id": "boot-a", "fm": {"groups": {"nvswitch/0|12028": dict(_FM_GROUP, component="switch 0")}}},
    {"boot_id": "boot-a", "fm": {"groups": {"nvswitch/0|12028": dict(_FM_GROUP, nonfatal=0)}}},
    {"boot_id": "boot-a", "fm": {"groups": {"nvswitch/0|12028": dict(_FM_GROUP, kind="other")}}},
]


def test_the_malformed_shapes_differ_from_a_valid_state_only_where_they_say(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The base the malformed states above are made from loads: each is refused for its change."""
    _boot(tmp_path, "boot-a")
    state = copy.deepcopy(_VALID)
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=Inventory(pci_devices=SWITCHES), profile=GENERIC,
                       options=NvswitchConfig(), state=state,
                       kernel_log=KernelLog(source="test", boot_time=1.7e9), clock=lambda: T0 + 1)
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        found = {(f.component, f.evidence.get("code")): f for f in run_on_json(NvswitchCheck(), ctx)}
    assert not caplog.records
    assert found["nvswitch/0", 20034].evidence["events"] == 1  # the saved SXid group
    assert found["nvswitch/0", 12028].evidence["count"] == 1  # the saved fabric manager group


@pytest.mark.parametrize("saved", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_saved_state_is_refused_and_the_check_runs(tmp_path: Path, saved: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    fresh = _scenario(tmp_path / "fresh")
    root = tmp_path / "bad"
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        run = _scenario(root, first=saved)
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "nvswitch" in refused[0].getMessage()
    # after the refusal the check started afresh: from then on what a fresh start gives (boot-a's
    # history key aside, the malformed states carry nothing the scenario keeps)
    assert run == fresh


@pytest.mark.parametrize("history", [{"k": "x"}, {"k": {"boot": "t"}}, {"k": [["b", "t"]]},
                                     {"0000:05:00.0|20034": {"boot-0": "yesterday", "boot-1": None}}])
def test_malformed_history_inside_is_read_tolerantly(tmp_path: Path, history: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The history across boots is RepeatHistory's own mapping, read tolerantly: junk inside it is
    no repeat, never a refusal of the whole state (which would lose the cursor). A history that is
    not a mapping at all is refused with the rest (MALFORMED above)."""
    root = tmp_path
    _boot(root, "boot-a")
    ev = _sxid("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 63 LTSSM Fault Up")
    state: dict[str, Any] = {"boot_id": "boot-a", "history": history}
    ctx = CheckContext(hw=Hardware(root), inventory=Inventory(pci_devices=SWITCHES), profile=GENERIC,
                       options=NvswitchConfig(), state=state,
                       kernel_log=KernelLog(events=[ev], source="test", boot_time=1.7e9), clock=lambda: T0)
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        found = [f for f in run_on_json(NvswitchCheck(), ctx) if f.component == "nvswitch/0"]
    assert [(f.severity, f.action.value) for f in found] == [(Severity.FAIL, "reboot_node")]
    assert not caplog.records
    assert ctx.state["history"]["0000:05:00.0|20034"] == {"boot-a": T0}
    json.dumps(ctx.state)

