"""What the nvswitch check's readings share in building their findings: the reading's tag on a
hardware condition, bounded samples and links, the catalog's words for a code, and the
repeat-after-reboot rule for a switch's fatal code."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpumon.bootstate import RepeatHistory
from gpumon.model import Finding

from .catalog import NAME_PREFIX, SXidInfo
from .state import NvswitchState

MAX_SAMPLES = 5
MAX_LINKS = 64  # links of an SXid group, ports of a fabric manager group
MAX_HISTORY_KEYS = 64


def tagged(finding: Finding, reading: str) -> Finding:
    """A hardware-condition finding, marked with the reading it interrupted."""
    return dataclasses.replace(finding, evidence={**finding.evidence, "reading": reading})


def sample(samples: list[str], text: str) -> None:
    if len(samples) < MAX_SAMPLES:
        samples.append(text[:200])


def repeated(state: NvswitchState, key: str, now: float, window: float) -> bool:
    """Record a fatal (switch, code) for this boot; True if an earlier boot had it within ``window``."""
    return RepeatHistory(state.history, max_keys=MAX_HISTORY_KEYS).record(key, state.boot_id, now, window)


def catalog_evidence(info: SXidInfo | None) -> dict[str, Any]:
    if info is None:
        return {"catalog": "not in NVIDIA's SXid tables"}
    return {"name": info.name, "nvidia_action": info.nvidia_action,
            "catalog_class": "fatal" if info.fatal else "non-fatal",
            "catalog_class_source": info.class_source, "fm_guide_table": info.fmg_table}


def short_name(info: SXidInfo | None) -> str:
    if info is None:
        return "(not in NVIDIA's SXid tables)"
    return info.name.removeprefix(NAME_PREFIX) or "(unnamed)"
