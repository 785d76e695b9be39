"""The nvswitch check's declared state (``NvswitchCheck.State``), loaded and saved by the framework.

The JSON is the untyped state file's, key for key, so that state saved by an older release loads
unchanged (and this release's state loads in that one: a key it expects is never written as null).
State of another shape (a hand edit, another release, a bit flip that still parses) is refused
when it is loaded (:func:`gpumon.bootstate.read_state`), with its reason logged, and the check
starts afresh instead of raising on every run. Each ``__post_init__`` refuses what the
annotations cannot say and the check could not judge (a finding for a component name that is not
one, a group that counts no event).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.bootstate import OMIT_DEFAULT, BootState
from gpumon.model import is_component


@dataclass
class OpenEvent:
    """The SXid event whose lines are still arriving (see sxid._add_sxid_line)."""

    t: float
    headed: bool  # its Fatal/Non-fatal line was seen
    engine: int | None


@dataclass
class SxidGroup:
    """SXid lines of one switch and code this boot, folded into events."""

    switch: int
    pci: str | None
    code: int
    lines: int
    events: int
    fatal_events: int
    nonfatal_events: int
    unsaid_events: int
    links: list[int]
    first: float
    last: float
    samples: list[str]
    open: OpenEvent | None

    def __post_init__(self) -> None:
        if self.switch < 0:
            raise ValueError(f"switch {self.switch} is not an NVSwitch number")


@dataclass
class SxidMark:
    """The last kernel record folded this boot (sxid._Watermark): /dev/kmsg sequence number,
    kernel uptime in microseconds."""

    seq: int | None
    mono: int | None


@dataclass
class FmSwitchGroup:
    """"detected NVSwitch ... error" entries of the fabric manager log, per switch and code."""

    kind: str
    component: str
    code: int
    pci: str | None
    fatal: int
    nonfatal: int
    ports: dict[str, int]  # port number (as text: a JSON key) -> entries
    physical_ids: list[int]
    first_stamp: str
    last_stamp: str
    seen: float
    samples: list[str]

    def __post_init__(self) -> None:
        if self.kind != "nvswitch":
            raise ValueError(f"kind {self.kind!r} is not 'nvswitch'")
        if not is_component(self.component):
            raise ValueError(f"component {self.component!r} is not a component name")
        if not all(k.isdecimal() for k in self.ports):
            raise ValueError("a port that is not a number")
        if not (self.fatal or self.nonfatal):
            raise ValueError("a group that counts no entry")


@dataclass
class FmOtherGroup:
    """Other [ERROR]/[CRITICAL] entries of the fabric manager log."""

    kind: str
    count: int
    levels: list[str]
    first_stamp: str
    last_stamp: str
    seen: float
    samples: list[str]

    def __post_init__(self) -> None:
        if self.kind != "other":
            raise ValueError(f"kind {self.kind!r} is not 'other'")


@dataclass
class FmStats:
    """What was read of the fabric manager log this boot (the node finding's evidence, in this order)."""

    entries: int = 0
    older_boot: int = 0
    orphan_lines: int = 0
    malformed: int = 0
    skipped_bytes: int = 0
    rotations: int = 0
    truncations: int = 0


@dataclass
class FmState:
    groups: dict[str, FmSwitchGroup | FmOtherGroup] = field(default_factory=dict)
    # FabricManagerLog's cursor (device, inode, offset, head of the file), opaque here: the reader
    # checks it and starts from the log's tail on anything it did not write. None: not followed
    # yet, or the log was missing at the last run.
    cursor: dict[str, Any] | None = None
    # None until the log was first found (not written then: an older release expects the key to
    # hold the counts when it is there)
    stats: FmStats | None = field(default=None, metadata=OMIT_DEFAULT)


@dataclass
class NvswitchState(BootState):
    # RepeatHistory's mapping, {"<pci or switch>|<code>": {boot: epoch}}: fatal SXids across boots.
    # Its inner shape is RepeatHistory's to read, tolerantly (an entry it cannot read is no
    # repeat), so that junk in one entry does not cost the cursor and the rest of the state.
    history: dict[str, Any] = field(default_factory=dict)
    sxid: dict[str, SxidGroup] = field(default_factory=dict)  # "<switch>|<code>" -> lines folded
    switch_pci: dict[str, int] = field(default_factory=dict)  # PCI bus id -> switch number in SXid lines
    sxid_mark: SxidMark | None = field(default=None, metadata=OMIT_DEFAULT)  # older files have no key
    fm: FmState = field(default_factory=FmState)

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.switch_pci.values()):
            raise ValueError("switch_pci: a negative switch number")
        # a group is made by its first line, which counts its event: one that counts none has no
        # verdict (checked here, not in SxidGroup, which the check makes before that line counts)
        empty = [k for k, g in self.sxid.items()
                 if not (g.fatal_events or g.nonfatal_events or g.unsaid_events)]
        if empty:
            raise ValueError(f"sxid group(s) {', '.join(map(repr, empty))} count no event")

    # A reboot clears what the kernel log and fabric manager said in the last boot; the history
    # across boots is what the repeat-after-reboot rule reads, and stays.
    keep_across_boots = ("history",)
