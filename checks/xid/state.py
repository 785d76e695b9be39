"""The xid check's declared state (``XidCheck.State``), loaded and saved by the framework.

The JSON keeps the shape of the untyped state files, key for key, so that a node upgraded mid-boot
keeps its Xid history and an older release can still read what this one wrote:

``{"boot_id", "groups": {"<component>|<code>": group}, "identities": {pci: {"uuid", "serial"}},
"kernel_unmatched": [[gpu, code, when, group key]], "nvml_unmatched": [[gpu, code, lo, hi, group
key]]}``.

Saved state of another shape (a hand edit, another release, a bit flip that still parses) is
refused when it is loaded (:func:`gpumon.bootstate.read_state`), which logs why; the check then
starts afresh instead of raising on every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumon.bootstate import OMIT_DEFAULT, BootState
from gpumon.model import Action, Severity, is_component


@dataclass
class XidDetail:
    """The verdict of a group's worst decoded line (Xid 74 registers, NVLink5 decode sheet)."""

    severity: str
    action: str
    basis: str
    resolution: str = ""

    def __post_init__(self) -> None:
        # read back as enums at every verdict: a value no enum knows would raise there, every run
        Severity(self.severity)
        Action(self.action)


# kw_only: the fields keep the order (and so the JSON the order) of the untyped state files,
# required ones among them
@dataclass(kw_only=True)
class XidGroup:
    """The events of one (component, root code) in this boot."""

    component: str
    code: int
    pci: str | None
    count: int = 0
    first: float
    last: float
    bursts: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    via: list[int] = field(default_factory=list)
    recovery_to: tuple[int, str] | None = None  # Xid 154: the new recovery action (value, name)
    sources: list[str] = field(default_factory=list)
    detail: XidDetail | None = None
    # Set only for the codes whose lines carry them (NVLink5 144-150, Xid 74); None is "not set",
    # and is left out of the JSON, where the untyped state files have no key.
    nvlink_unit: str | None = field(default=None, metadata=OMIT_DEFAULT)
    nvidia_resolution: str | None = field(default=None, metadata=OMIT_DEFAULT)
    nvidia_investigatory: str | None = field(default=None, metadata=OMIT_DEFAULT)
    error_status: str | None = field(default=None, metadata=OMIT_DEFAULT)
    nvlink_classes: list[str] | None = field(default=None, metadata=OMIT_DEFAULT)
    register_words: list[str] | None = field(default=None, metadata=OMIT_DEFAULT)
    x74_lines: dict[str, int] | None = field(default=None, metadata=OMIT_DEFAULT)


@dataclass
class XidState(BootState):
    """``{"boot_id", "groups", "identities", "kernel_unmatched", "nvml_unmatched"}``; a reboot
    clears every Xid and renumbers nothing worth keeping: nothing outlives it (``new_boot``)."""

    groups: dict[str, XidGroup] = field(default_factory=dict)
    identities: dict[str, dict[str, str]] = field(default_factory=dict)  # PCI bus id -> uuid, serial
    # kernel lines not (yet) matched by an NVML event: (gpu, code, when, group key)
    kernel_unmatched: list[tuple[int, int, float, str]] = field(default_factory=list)
    # NVML events not (yet) matched by a kernel line: (gpu, code, poll lo, poll hi, group key)
    nvml_unmatched: list[tuple[int, int, float, float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Checked here, where only a state read back (or a fresh one) passes, not on each group
        # made in a storm: a finding refuses a malformed component, and a GPU's index is read
        # back from it, so such a group would make every run raise.
        bad = [g.component for g in self.groups.values() if not is_component(g.component)]
        if bad:
            raise ValueError(f"group component(s) {', '.join(map(repr, bad))} are not component names")
