"""The pcie check's declared state (``PcieCheck.State``), loaded and saved by the framework.

The JSON is the untyped state file's, key for key, so that state saved by an older release loads
unchanged (and this release's loads in that one). State of another shape (a hand edit, another
release, a bit flip that still parses) is refused when it is loaded
(:func:`gpumon.bootstate.read_state`), with its reason logged, and the check starts afresh instead
of raising on every run.

A device and a kernel-log entry stay JSON mappings in memory: a device's record has an "is" key (a
Python keyword, so no dataclass field) and its counters' keys appear only after its first reading,
and the entries are what AerFold's deltas merge into (tests/checks/test_pcie_fold.py compares them
with line-by-line ingest). When the state is read back they are checked against the dataclasses
below, which say their shape; nothing but that check builds these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.bootstate import BootState, StateError, load_state
from gpumon.hw import pci as pcihw
from gpumon.model import is_component, pci

_KINDS = frozenset(pcihw.AER_FILES)  # correctable, nonfatal, fatal


@dataclass
class _AerEvent:
    """Uncorrectable errors of one kind counted since gpumon started watching (``judge._compare``)."""

    count: int
    first: float
    last: float
    errors: dict[str, int]


@dataclass
class _AerBaseline:
    """A device's AER counters as ``judge.judge_counters`` keeps them, from its first reading of the boot."""

    totals: dict[str, int]
    names: dict[str, dict[str, int]]
    before_watch: dict[str, int]
    events: dict[str, _AerEvent]
    resets: int
    cor: list[tuple[float, int]]  # [time, correctable total] samples of the rate window
    cor_rate: float | None = None  # absent until the second reading

    def __post_init__(self) -> None:
        missing = [k for k in ("fatal", "nonfatal") if k not in self.totals]  # what judge._compare reads
        if missing:
            raise ValueError(f"totals lacks {', '.join(missing)}")


@dataclass
class _Report:
    """Reports of one severity in the kernel log (``aer_log._ingest``)."""

    count: int
    first: float
    last: float
    errors: list[str]
    device_ids: str | None = None
    status_mask: str | None = None


@dataclass
class _Counted:
    """Summary or not-recovered lines of one kind (``aer_log._ingest_summary``)."""

    count: int
    first: float
    last: float


@dataclass
class _KmsgEntry:
    """The AER lines of one function (``kmsg`` in the state)."""

    samples: list[str]
    current: str | None = None  # the severity of the report its next detail line belongs to
    reported_by: str | None = None
    correctable: _Report | None = None
    nonfatal: _Report | None = None
    fatal: _Report | None = None
    summary: dict[str, _Counted] | None = None
    not_recovered: dict[str, _Counted] | None = None

    def __post_init__(self) -> None:
        if self.current is not None and (self.current not in _KINDS or getattr(self, self.current) is None):
            raise ValueError(f"current names {self.current!r}, which holds no report")


def _check_device(bdf: str, ds: dict[str, Any]) -> None:
    where = f"devices[{bdf!r}]"
    if not is_component(pci(bdf)):  # a device that vanished is reported as pci/<bus id>
        raise ValueError(f"{where}: not a PCI bus id")
    if not isinstance(ds.get("is", ""), str):
        raise ValueError(f"{where}.is: expected a string, got {type(ds['is']).__name__}")
    counters = {k: v for k, v in ds.items() if k != "is"}
    if counters:  # none before the device's AER counters were first read
        _check(_AerBaseline, counters, where)


def _check_entry(bdf: str, entry: dict[str, Any]) -> None:
    where = f"kmsg[{bdf!r}]"
    # the fold tests for a key, not for a value: a key that is there must hold one
    nulls = sorted(k for k, v in entry.items() if v is None)
    if nulls:
        raise ValueError(f"{where}: null {', '.join(nulls)}")
    _check(_KmsgEntry, entry, where)


def _check(cls: type, raw: dict[str, Any], where: str) -> None:
    try:
        load_state(cls, raw)
    except StateError as exc:
        raise ValueError(where + str(exc).removeprefix("state")) from None


@dataclass
class PcieState(BootState):
    """The check's declared state. AER counters and kernel-log reports are per boot: a reboot
    starts everything afresh (``new_boot``)."""

    # bus id -> "is" (what the function is) and, from the first reading, its AER baseline
    # (_AerBaseline's keys)
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    kmsg: dict[str, dict[str, Any]] = field(default_factory=dict)  # bus id -> _KmsgEntry's keys
    kmsg_source: dict[str, str] = field(default_factory=dict)  # reporter -> function of its last header

    def __post_init__(self) -> None:
        for bdf, ds in self.devices.items():
            _check_device(bdf, ds)
        for bdf, entry in self.kmsg.items():
            _check_entry(bdf, entry)
