"""The pcie check's persisted state: what the previous release saved still loads and gives the same
verdicts, a restart between runs changes nothing, and saved state of another shape is refused
(logged once) instead of making the check raise on every run.

``tests/data/checkstate/pcie-release.json`` is the state and findings the release before typed
state (commit 4c66f69) gave for :func:`_scenario`, run by that release's code. The kernel-log lines
are the real ones of tests/checks/test_pcie.py (rwth-i6/returnn#1500, pop-os/pop#3363), on the bus
ids of this tree.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pci_tree import add_function

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.nvml import GpuInfo
from gpumon.model import Finding
from gpumon.profiles import GENERIC
from gpumon_checks.pcie import AerFold, PcieCheck, PcieConfig

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = TESTS / "data" / "checkstate" / "pcie-release.json"
PORT, GPU, NIC_PORT, NIC = "0000:00:03.0", "0000:03:00.0", "0000:00:01.0", "0000:01:00.0"
T0 = 1.8e9

_FATAL = [  # rwth-i6/returnn#1500
    f"nvidia {GPU}: AER: can't recover (no error_detected callback)",
    f"pcieport {PORT}: AER: Multiple Uncorrected (Fatal) error received: {PORT}",
    f"pcieport {PORT}: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)",
    f"pcieport {PORT}:   device [8086:6f08] error status/mask=00004020/00000000",
    f"pcieport {PORT}:    [ 5] SDES                  ",
]
_CORRECTED = [  # pop-os/pop#3363
    f"pcieport {NIC_PORT}: AER: Multiple Correctable error message received from {NIC}",
    f"pcieport {NIC_PORT}: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)",
    f"pcieport {NIC_PORT}:   device [1022:1453] error status/mask=000011c0/00006000",
    f"pcieport {NIC_PORT}:    [ 6] BadTLP                ",
    f"nvidia {GPU}: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)",
]
_CORRECTED_TAIL = [  # the rest of the GPU's report, in the next batch
    f"nvidia {GPU}:   device [10de:2184] error status/mask=00001000/0000a000",
    f"nvidia {GPU}:    [12] Timeout               ",
    f"pcieport {PORT}:    [14] CmpltTO                (First)",
]

# each step: (boot id, seconds after T0, kernel-log lines, handed over folded (the daemon's pump) or
# as records, AER counters written before the run: bus id -> kind -> (error name, count))
_STEPS: list[tuple[str, float, list[str], bool, dict[str, dict[str, tuple[str, int]]]]] = [
    ("boot-a", 0, _FATAL + _CORRECTED, False, {GPU: {"nonfatal": ("CmpltTO", 1)}}),
    ("boot-a", 120, _CORRECTED_TAIL, True, {GPU: {"nonfatal": ("CmpltTO", 1), "fatal": ("DLP", 2)},
                                           NIC_PORT: {"correctable": ("RxErr", 30)}}),
    ("boot-a", 400, _CORRECTED, False, {GPU: {"nonfatal": ("CmpltTO", 1), "fatal": ("DLP", 2)},
                                       NIC_PORT: {"correctable": ("RxErr", 900)}}),
    ("boot-a", 700, [], True, {GPU: {"nonfatal": ("CmpltTO", 0)}, NIC_PORT: {"correctable": ("RxErr", 950)}}),
    ("boot-b", 3600, _CORRECTED_TAIL, False, {}),
]


def _tree(root: Path) -> None:
    add_function(root, f"pci0000:00/{PORT}", "0x8086", "0x060400", device="0x6f08")
    add_function(root, f"pci0000:00/{PORT}/{GPU}", "0x10de", "0x030200", device="0x2330")
    add_function(root, f"pci0000:00/{NIC_PORT}", "0x8086", "0x060400", device="0x352a")
    add_function(root, f"pci0000:00/{NIC_PORT}/{NIC}", "0x15b3", "0x020000", device="0x101d")


def _counters(root: Path, counters: dict[str, dict[str, tuple[str, int]]]) -> None:
    for bdf in (PORT, GPU, NIC_PORT, NIC):
        fn = (root / "sys/bus/pci/devices" / bdf).resolve()
        for kind, (name, total) in pcihw.AER_FILES.items():
            err, n = counters.get(bdf, {}).get(kind, ("RxErr" if kind == "correctable" else "DLP", 0))
            (fn / name).write_text(f"{err} {n}\n{total} {n}\n")


def _boot(root: Path, boot: str) -> None:
    path = root / "proc/sys/kernel/random/boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot + "\n")


def _finding(f: Finding) -> dict[str, Any]:
    return {"component": f.component, "severity": f.severity.value, "action": f.action.value,
            "message": f.message, "evidence": f.evidence}


def _log(lines: list[str], folded: bool, seq: int) -> KernelLog:
    records = [parse_line(f"4,{seq + i},{(seq + i) * 1000},-;{line}") for i, line in enumerate(lines)]
    if not folded:
        return KernelLog(records=records, source="test", boot_time=1.7e9)
    fold = AerFold()  # the daemon's pump: a fold of its own, handed over at the run
    dating = KernelLog(boot_time=1.7e9)
    for rec in records:
        fold.add(rec, dating.time_of(rec, T0))
    return KernelLog(folded=fold.take(), source="test", boot_time=1.7e9)


def _ctx(root: Path, hw: Hardware, state: dict[str, Any], log: KernelLog, now: float) -> CheckContext:
    inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, GPU, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)])
    return CheckContext(hw=hw, inventory=inv, profile=GENERIC, options=PcieConfig(), state=state,
                        kernel_log=log, clock=lambda: now)


def _scenario(root: Path, *, restart: bool = False, first: dict[str, Any] | None = None,
              start: int = 0) -> list[dict[str, Any]]:
    """Run the check over :data:`_STEPS` (from ``start``): per step, the state after it (as JSON)
    and its findings. ``restart``: every step on a fresh check instance, with the saved state read
    back from JSON. ``first``: the state to start from."""
    _tree(root)
    hw = Hardware(root)
    check = PcieCheck()
    state: dict[str, Any] = json.loads(json.dumps(first)) if first is not None else {}
    out = []
    seq = 1 + sum(len(step[2]) for step in _STEPS[:start])  # the kernel's record numbers go on
    for boot, dt, lines, folded, counters in _STEPS[start:]:
        _boot(root, boot)
        _counters(root, counters)
        if restart:
            state = json.loads(json.dumps(state))
            check = PcieCheck()
        ctx = _ctx(root, hw, state, _log(lines, folded, seq), T0 + dt)
        seq += len(lines)
        findings = run_on_json(check, ctx)
        state = ctx.state
        out.append({"state": json.loads(json.dumps(state)),
                    "findings": json.loads(json.dumps([_finding(f) for f in findings]))})
    return out


def test_the_previous_release_state_and_findings_are_reproduced(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert _scenario(tmp_path / "a") == golden  # the same JSON on disk, the same findings
    assert _scenario(tmp_path / "b", restart=True) == golden  # a restart between every run


def test_state_saved_by_the_previous_release_loads_and_gives_the_same_findings(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    for start in range(1, len(_STEPS)):
        run = _scenario(tmp_path / str(start), first=golden[start - 1]["state"], start=start)
        assert run == golden[start:]


# --------------------------------------------------------------------------- malformed state

_DEVICE = {"is": "gpu/0", "totals": {"correctable": 0, "nonfatal": 0, "fatal": 0},
           "names": {"nonfatal": {}, "fatal": {}}, "before_watch": {}, "events": {}, "resets": 0,
           "cor": [[T0 - 60, 0]]}
_ENTRY = {"samples": [], "fatal": {"count": 1, "first": T0, "last": T0, "errors": []}, "current": "fatal"}

MALFORMED: list[Any] = [
    {"boot_id": "boot-a", "devices": 5},  # the reproduction: AttributeError every run
    {"boot_id": ["boot-a"]},
    {"boot_id": "boot-a", "devices": {GPU: []}},
    {"boot_id": "boot-a", "devices": {GPU: {"is": 3}}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, totals={"fatal": "0"})}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, totals={"correctable": 0})}},
    {"boot_id": "boot-a", "devices": {GPU: {k: v for k, v in _DEVICE.items() if k != "cor"}}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, cor=[[T0]])}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, events={"fatal": {"count": 1}})}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, names={"fatal": {"DLP": None}})}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, cor_rate="fast")}},
    {"boot_id": "boot-a", "devices": {GPU: dict(_DEVICE, colour="blue")}},
    {"boot_id": "boot-a", "kmsg": []},
    {"boot_id": "boot-a", "kmsg": {PORT: {"samples": [], "current": "fatal"}}},
    {"boot_id": "boot-a", "kmsg": {PORT: {"samples": [], "current": None}}},
    {"boot_id": "boot-a", "kmsg": {PORT: dict(_ENTRY, samples="x")}},
    {"boot_id": "boot-a", "kmsg": {PORT: dict(_ENTRY, fatal={"count": "1", "first": T0, "last": T0,
                                                              "errors": []})}},
    {"boot_id": "boot-a", "kmsg": {PORT: dict(_ENTRY, fatal=None)}},
    {"boot_id": "boot-a", "kmsg": {PORT: dict(_ENTRY, summary={"fatal": {"count": 1}})}},
    {"boot_id": "boot-a", "kmsg": {PORT: dict(_ENTRY, not_recovered=[])}},
    {"boot_id": "boot-a", "kmsg_source": {PORT: 1}},
    {"boot_id": "boot-a", "kmsg_source": "x"},
    {"boot_id": "boot-a", "extra": True},
]


def test_the_malformed_shapes_differ_from_a_valid_state_only_where_they_say(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The base the malformed states above are made from loads: each is refused for its change."""
    _tree(tmp_path)
    _boot(tmp_path, "boot-a")
    state = {"boot_id": "boot-a", "devices": {GPU: json.loads(json.dumps(_DEVICE))},
             "kmsg": {PORT: json.loads(json.dumps(_ENTRY))}, "kmsg_source": {PORT: PORT}}
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        found = {f.component: f for f in run_on_json(PcieCheck(), _ctx(tmp_path, Hardware(tmp_path), state,
                                                              KernelLog(source="test"), T0))}
    assert not caplog.records
    assert found[f"pci/{PORT}"].evidence["kernel_log"]["fatal"]["count"] == 1
    assert found[f"pci/{GPU}"].evidence["correctable_per_hour"] == 0.0


@pytest.mark.parametrize("saved", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_saved_state_is_refused_and_the_check_runs(tmp_path: Path, saved: Any,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    fresh = _scenario(tmp_path / "fresh")
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        run = _scenario(tmp_path / "bad", first=saved)
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "pcie" in refused[0].getMessage()
    assert run == fresh  # started afresh: what a fresh start gives, run after run

