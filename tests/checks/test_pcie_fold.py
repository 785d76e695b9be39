"""The pcie check's kernel-log fold (issue 14, storms): the daemon's pump folds AER lines into a
small per-device delta as they arrive and hands it over at the check's run. Folding in batches and
merging the deltas must give the state that ingesting the lines one by one gives (the check's way
before the fold), whatever the batches; only an uncorrectable report asks for a run at once.

Line shapes are those of the kernel captures quoted in tests/checks/test_pcie.py and
tests/checks/test_pcie_aer_summary.py (headers with and without ``AER:``, an old kernel's
``id=`` source, status and bit lines, summary and not-recovered lines)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_on_json
from gpumon.check import CheckContext, KernelLog
from gpumon.hw import Hardware
from gpumon.hw import pci as pcihw
from gpumon.hw.inventory import Inventory
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord
from gpumon.hw.nvml import GpuInfo
from gpumon.profiles import GENERIC
from gpumon_checks.pcie import AerDelta, AerFold, PcieCheck, _ingest, _ingest_summary

FUNCS = ["0000:17:00.0", "0000:19:00.0", "0000:3b:00.0"]
SEVERITIES = ["Corrected", "Correctable", "Uncorrected (Fatal)", "Uncorrectable (Non-Fatal)",
              "Uncorrected (Non-Fatal)", "Bogus"]
NAMES = ["RxErr", "BadTLP", "BadDLLP", "Timeout", "DLP", "SDES", "CmpltTO", "UnsupReq"]


def _prefix(fn: str) -> str:
    return f"pcieport {fn}: " if fn != FUNCS[2] else f"nvidia {fn}: "


_FN = st.sampled_from(FUNCS)
_LINE = st.one_of(
    st.builds(lambda fn, sev, aer: f"{_prefix(fn)}{'AER: ' if aer else ''}PCIe Bus Error: severity={sev}, "
                                   "type=Physical Layer, (Receiver ID)", _FN, st.sampled_from(SEVERITIES),
              st.booleans()),
    # an old kernel names the source by id= (bus << 8 | devfn) in the header only
    st.builds(lambda fn, sev, src: f"{_prefix(fn)}PCIe Bus Error: severity={sev}, type=Transaction Layer, "
                                   f"id={int(src[5:7], 16) << 8:04x}(Requester ID)",
              _FN, st.sampled_from(SEVERITIES), _FN),
    st.builds(lambda fn, status: f"{_prefix(fn)}  device [10de:2330] error status/mask={status:08x}/00002000",
              _FN, st.integers(0, 0xFFFF)),
    st.builds(lambda fn, bit, name, first:
              f"{_prefix(fn)}   [{bit:2d}] {name:<22}{' (First)' if first else ''}",
              _FN, st.integers(0, 31), st.sampled_from(NAMES), st.booleans()),
    st.builds(lambda fn, multi, kind, tail: f"{_prefix(fn)}AER: {'Multiple ' if multi else ''}{kind} error "
                                            f"received{tail}", _FN, st.booleans(),
              st.sampled_from(["Corrected", "Correctable", "Uncorrected (Fatal)",
                               "Uncorrectable (Non-Fatal)"]),
              st.sampled_from(["", f": {FUNCS[1]}", f" from {FUNCS[0]}", ": id=1900"])),
    st.builds(lambda fn, what: f"{_prefix(fn)}AER: {what}", _FN,
              st.sampled_from(["can't recover (no error_detected callback)", "device recovery failed"])),
    st.sampled_from(["NVRM: Xid (PCI:0000:19:00): 13, pid=1, name=x, Graphics Exception",
                     "usb 1-1: new high-speed USB device number 2", ""]),
)
# a record: one line, or a multi-line printk in one /dev/kmsg record
_RECORD = st.one_of(_LINE, st.lists(_LINE, min_size=2, max_size=3).map("\n".join))


def _records(texts: list[str]) -> list[tuple[KernelRecord, float]]:
    return [(KernelRecord(text=t, raw=t), 1_700_000_000.0 + i * 0.25) for i, t in enumerate(texts)]


def _one_by_one(records: list[tuple[KernelRecord, float]], state: dict[str, Any]) -> None:
    """What the check did before the fold: every line ingested into the state, in order."""
    kmsg = state.setdefault("kmsg", {})
    last_header = state.setdefault("kmsg_source", {})
    for rec, when in records:
        for line in rec.text.splitlines():
            msg = pcihw.parse_aer_message(line)
            if msg is not None:
                _ingest(kmsg, last_header, msg, line, when)
            elif "AER:" in line:
                _ingest_summary(kmsg, line, when)


def _batches(records: list[Any], cuts: list[int]) -> list[list[Any]]:
    at = sorted({min(c, len(records)) for c in cuts})
    return [records[a:b] for a, b in zip([0, *at], [*at, len(records)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(st.lists(_RECORD, max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_folded_batches_merge_to_what_line_by_line_ingest_gives(texts: list[str], cuts: list[int]) -> None:
    records = _records(texts)
    expected: dict[str, Any] = {}
    _one_by_one(records, expected)
    # the daemon: one fold for the daemon's life, a delta handed over at each of the check's runs
    fold = AerFold()
    state: dict[str, Any] = {}
    # the check's own path (gpumon check, a replay): a fold per run, given the state's sources
    runs: dict[str, Any] = {}
    for batch in _batches(records, cuts):
        for rec, when in batch:
            fold.add(rec, when)
        delta = fold.take()
        if delta is not None:
            delta.merge(state.setdefault("kmsg", {}), state.setdefault("kmsg_source", {}))
        own = AerFold(runs.get("kmsg_source"))
        for rec, when in batch:
            own.add(rec, when)
        mine = own.take()
        if mine is not None:
            mine.merge(runs.setdefault("kmsg", {}), runs.setdefault("kmsg_source", {}))
    assert state.get("kmsg", {}) == expected["kmsg"]
    assert state.get("kmsg_source", {}) == expected["kmsg_source"]
    assert runs.get("kmsg", {}) == expected["kmsg"]
    assert runs.get("kmsg_source", {}) == expected["kmsg_source"]


@settings(max_examples=200, deadline=None)
@given(st.lists(_RECORD, max_size=30))
def test_only_uncorrectable_reports_ask_for_a_run_at_once(texts: list[str]) -> None:
    fold = AerFold()
    for rec, when in _records(texts):
        keys = fold.add(rec, when)
        urgent = []
        for line in rec.text.splitlines():
            msg = pcihw.parse_aer_message(line)
            if msg is not None and msg.kind == "header" and msg.severity in ("fatal", "nonfatal"):
                urgent.append((msg.bdf, msg.severity))
            elif msg is None and "AER:" in line:
                said = _ingest_summary({}, line, when)
                if said is not None and said[1] != "correctable":
                    urgent.append(said)
        assert keys == urgent


def test_a_corrected_error_storm_folds_into_one_small_entry() -> None:
    port = FUNCS[0]
    report = [f"pcieport {port}: AER: Correctable error message received from {port}",
              f"pcieport {port}: PCIe Bus Error: severity=Correctable, type=Physical Layer, (Receiver ID)",
              f"pcieport {port}:   device [1000:c030] error status/mask=00000001/00002000",
              f"pcieport {port}:    [ 0] RxErr                  (First)"]
    fold = AerFold()
    keys = [k for i in range(5000) for k in fold.add(KernelRecord(text=report[i % 4], raw=""), 1.7e9 + i)]
    assert keys == []  # corrected reports never run the check at once
    delta = fold.take()
    assert isinstance(delta, AerDelta) and list(delta.kmsg) == [port]
    entry = delta.kmsg[port]
    assert entry["correctable"]["count"] == 1250 and entry["correctable"]["errors"] == ["RxErr (First)"]
    assert entry["summary"]["correctable"]["count"] == 1250 and entry["samples"] == []
    assert fold.take() is None
    bad = (f"pcieport {port}: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, "
           "(Receiver ID)")
    assert fold.add(KernelRecord(text=bad, raw=bad), 1.8e9) == [(port, "fatal")]


# --------------------------------------------------------------------------- the check's verdict

PORT, GPU = "0000:00:03.0", "0000:03:00.0"
LINES = [
    f"pcieport {PORT}: AER: Corrected error received: {GPU}",
    f"nvidia {GPU}: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
    f"nvidia {GPU}:   device [10de:2330] error status/mask=00000001/0000e000",
    f"nvidia {GPU}:    [ 0] RxErr                  (First)",
    f"pcieport {PORT}: AER: Uncorrected (Non-Fatal) error received: {GPU}",
    f"nvidia {GPU}: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)",
    f"nvidia {GPU}:   device [10de:2330] error status/mask=00004000/00000000",
    f"nvidia {GPU}:    [14] CmpltTO                (First)",
    f"nvidia {GPU}: AER: can't recover (no error_detected callback)",
]


def _tree(root: Path) -> None:
    for path, vendor, cls in ((f"pci0000:00/{PORT}", "0x8086", "0x060400"),
                              (f"pci0000:00/{PORT}/{GPU}", "0x10de", "0x030200")):
        d = root / "sys/devices" / path
        d.mkdir(parents=True)
        files = {"vendor": vendor, "device": "0x2330", "class": cls,
                 "current_link_speed": "16.0 GT/s PCIe", "max_link_speed": "16.0 GT/s PCIe",
                 "current_link_width": "16", "max_link_width": "16",
                 "aer_dev_correctable": "RxErr 0\nTOTAL_ERR_COR 0",
                 "aer_dev_nonfatal": "DLP 0\nTOTAL_ERR_NONFATAL 0",
                 "aer_dev_fatal": "DLP 0\nTOTAL_ERR_FATAL 0"}
        for name, text in files.items():
            (d / name).write_text(text + "\n")
        bus = root / "sys/bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / path.rsplit("/", 1)[-1]).symlink_to(f"../../../devices/{path}")


def _check(root: Path, log: KernelLog) -> list[tuple[str, str, str, Any]]:
    inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, GPU, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)])
    ctx = CheckContext(hw=Hardware(root), inventory=inv, profile=GENERIC, options=None, state={},
                       kernel_log=log, clock=lambda: 1.8e9)
    return [(f.component, f.severity.value, f.message, f.evidence) for f in run_on_json(PcieCheck(), ctx)]


def test_the_check_says_the_same_from_the_pumps_fold_as_from_the_records(tmp_path: Path) -> None:
    _tree(tmp_path)
    records = [parse_line(f"4,{i + 1},{(i + 1) * 1000},-;{line}") for i, line in enumerate(LINES)]
    direct = _check(tmp_path, KernelLog(records=records, source="test", boot_time=1.7e9))
    fold = PcieCheck().kernel_log_fold()
    # what the pump does: each record dated as KernelLog.time_of does, in batches
    dating = KernelLog(boot_time=1.7e9)
    for rec in records[:3]:
        fold.add(rec, dating.time_of(rec, 1.8e9))
    first = fold.take()
    for rec in records[3:]:
        fold.add(rec, dating.time_of(rec, 1.8e9))
    second = fold.take()
    # two runs, as the daemon would make them: state carried over
    root_state: dict[str, Any] = {}
    inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, GPU, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)])
    out = []
    for delta in (first, second):
        log = KernelLog(folded=copy.deepcopy(delta), source="test", boot_time=1.7e9)
        ctx = CheckContext(hw=Hardware(tmp_path), inventory=inv, profile=GENERIC, options=None,
                           state=root_state, kernel_log=log, clock=lambda: 1.8e9)
        out = [(f.component, f.severity.value, f.message, f.evidence) for f in run_on_json(PcieCheck(), ctx)]
    assert out == direct
    gpu = {c: (sev, msg) for c, sev, msg, _ in out}[f"pci/{GPU}"]
    assert gpu[0] == "fail" and "not recovered" in gpu[1] and "CmpltTO (First)" in gpu[1]
