"""Per-SKU profiles: what "healthy" means for one GPU model on its reference node.

Every number in a profile is written ``{value: N, source: "..."}``; the loader
refuses a number without a source note.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gpumon.errors import ConfigError
from gpumon.schema import Source, build, load_yaml, load_yaml_file

_S = {"sourced": True}


@dataclass(frozen=True)
class GpuSpec:
    count: int | None = field(default=None, metadata={**_S, "min": 1})
    memory_gib: float | None = field(default=None, metadata={**_S, "min": 1})
    tdp_w: float | None = field(default=None, metadata={**_S, "min": 1})


@dataclass(frozen=True)
class NvlinkSpec:
    generation: int | None = field(default=None, metadata={**_S, "min": 1})
    links_per_gpu: int | None = field(default=None, metadata={**_S, "min": 0})
    bandwidth_gbps_per_gpu: float | None = field(default=None, metadata={**_S, "min": 0})


@dataclass(frozen=True)
class PcieSpec:
    generation: int | None = field(default=None, metadata={**_S, "min": 1, "max": 7})
    width: int | None = field(default=None, metadata={**_S, "min": 1, "max": 32})


@dataclass(frozen=True)
class ThermalSpec:
    gpu_max_operating_c: float | None = field(default=None, metadata={**_S, "min": 20, "max": 150})
    hbm_max_operating_c: float | None = field(default=None, metadata={**_S, "min": 20, "max": 150})
    hbm_core_gradient_warn_c: float | None = field(default=None, metadata={**_S, "min": 0, "max": 100})


@dataclass(frozen=True)
class NetworkSpec:
    ib_ports: int | None = field(default=None, metadata={**_S, "min": 0})
    ib_rate_gbps: float | None = field(default=None, metadata={**_S, "min": 0})


@dataclass(frozen=True)
class MemorySpec:
    remapped_rows_uncorrectable_limit: int | None = field(default=None, metadata={**_S, "min": 1})


@dataclass(frozen=True)
class BootstrapSpec:
    # the bootstrap checks a node of this SKU must have run to pass the suite (a list of names,
    # not a number: its reasons are in the profile's comments and docs/operators/configuration.md)
    required: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    match: list[str] = field(default_factory=list)
    architecture: str | None = field(
        default=None, metadata={"choices": ("volta", "ampere", "hopper", "ada", "blackwell")})
    pci_device_ids: list[str] = field(default_factory=list)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    nvlink: NvlinkSpec = field(default_factory=NvlinkSpec)
    pcie: PcieSpec = field(default_factory=PcieSpec)
    thermal: ThermalSpec = field(default_factory=ThermalSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    bootstrap: BootstrapSpec = field(default_factory=BootstrapSpec)
    sources: dict[str, str] = field(default_factory=dict)
    # SKU-specific check thresholds: {check: {option: {value: X, source: "..."}}}, validated
    # against the check's own options when the agent starts (the registry is known then)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    # dotted key -> source note of every number, filled by the loader
    notes: dict[str, str] = field(default_factory=dict, compare=False)
    origin: Source | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for pattern in self.match:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"match pattern {pattern!r} is not a valid regex: {exc}") from None
        for pid in self.pci_device_ids:
            if not re.fullmatch(r"0x[0-9a-fA-F]{4}", pid):
                raise ValueError(f"pci_device_ids entry {pid!r} must look like 0x2330")

    def matches(self, gpu_name: str) -> bool:
        return any(re.search(p, gpu_name, re.IGNORECASE) for p in self.match)

    def source_of(self, key: str) -> str | None:
        return self.notes.get(key)


# A GPU whose SKU no profile knows still has to compute right before it takes work.
GENERIC = Profile(name="generic", description="no SKU profile matched: profile comparisons are skipped",
                  bootstrap=BootstrapSpec(required=["burnin"]))


def _from_data(data: Any, src: Source, expect_name: str | None) -> Profile:
    profile = build(Profile, data, src)
    if expect_name is not None and profile.name != expect_name:
        raise src.error(("name",), f"profile name {profile.name!r} must equal the file name {expect_name!r}")
    notes = {k.removesuffix(".value"): v for k, v in src.sources.items()}
    for check, options in profile.checks.items():
        if not isinstance(options, dict):
            raise src.error(("checks", check), "expected a mapping of check options")
        for key, value in options.items():
            path = ("checks", check, key)
            if not isinstance(value, dict) or set(value) != {"value", "source"}:
                raise src.error(path, 'a threshold here needs a source note: write {value: X, source: "..."}')
            if not isinstance(value["source"], str) or len(value["source"].strip()) < 8:
                raise src.error((*path, "source"), "source note must name where the number comes from")
            notes[f"checks.{check}.{key}"] = value["source"]
    return Profile(**{**profile.__dict__, "notes": notes, "origin": src})


def load_profile_file(path: Path) -> Profile:
    data, src = load_yaml_file(path)
    return _from_data(data, src, path.stem)


def builtin_profiles() -> dict[str, Profile]:
    return dict(_builtin_profiles())


@functools.lru_cache(maxsize=1)
def _builtin_profiles() -> dict[str, Profile]:
    # the shipped files do not change while the process runs
    out: dict[str, Profile] = {}
    root = resources.files("gpumon_config").joinpath("profiles")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        stem = entry.name.removesuffix(".yaml")
        data, src = load_yaml(entry.read_text(encoding="utf-8"), f"config/profiles/{entry.name}")
        out[stem] = _from_data(data, src, stem)
    return out


def all_profiles(extra_dirs: list[Path] | None = None) -> dict[str, Profile]:
    """Built-in profiles, then site ones (a site file of the same name replaces the built-in)."""
    out = builtin_profiles()
    for d in extra_dirs or []:
        if d.is_dir():
            for path in sorted(d.glob("*.yaml")):
                out[path.stem] = load_profile_file(path)
    return out


def select_profile(profiles: dict[str, Profile], gpu_names: list[str], forced: str | None) -> Profile:
    """``--profile`` wins; else the first profile (file-name order) whose pattern matches the GPU name."""
    if forced and forced != "auto":
        if forced == GENERIC.name:
            return GENERIC
        if forced not in profiles:
            raise ConfigError(f"unknown profile {forced!r} (known: {', '.join(sorted(profiles))})",
                              key="profile")
        return profiles[forced]
    names = sorted(set(gpu_names))
    for profile in profiles.values():
        if names and all(profile.matches(n) for n in names):
            return profile
    return GENERIC
