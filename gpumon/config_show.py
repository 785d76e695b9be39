"""``gpumon config``: the configuration a command would run with, as YAML a site file accepts,
each value followed by where it came from (the declared default, the SKU profile, the site file
and line, a flag). ``--defaults`` prints the declared defaults alone: the complete list of options,
written once, on the dataclasses (``gpumon.config`` and each check's ``Config``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from gpumon.check import Check
from gpumon.config import COMMON_SETTINGS, CheckSettings, Config
from gpumon.schema import KeyPath, LayeredSource

# fields of Config that are not settings a file writes (what was built from the checks: section)
_INTERNAL = {"checks", "check_settings", "layers"}

HEADER = """\
# gpumon configuration{what}.
# A site file (/etc/gpumon/gpumon.yaml or --config FILE) sets any of these keys; an unknown key, a
# wrong type or a value out of bounds stops gpumon naming the file, the line and the key. Layers,
# later wins: declared defaults, the SKU profile (the check options it tunes), the site file,
# command-line flags. docs/operators/configuration.md.
"""


def render(config: Config, checks: Mapping[str, type[Check]], *, origins: bool = True,
           profile: str | None = None) -> str:
    """YAML of every setting and every loaded check's options; ``origins``: a comment after each
    value saying which layer set it (``default`` where none did)."""
    what = " with its origins" if origins else ": the declared defaults"
    lines = [HEADER.format(what=what).rstrip("\n")]
    if profile:
        lines.append(f"# SKU profile: {profile}")
    elif origins:
        lines.append("# SKU profile: not applied (the profile is chosen from the GPUs at start; "
                     "--profile NAME shows its values)")
    layers = config.layers if origins else None
    body = [(f.name, getattr(config, f.name), f.metadata) for f in dataclasses.fields(config)
            if f.name not in _INTERNAL]
    lines += _mapping(body, (), 0, layers)
    lines.append("checks:")
    for name, cls in sorted(checks.items()):
        lines.append(f"  {name}:" + (f"  # {_oneline(cls.description)}" if cls.description else ""))
        settings = config.settings(cls)
        lines += _mapping(list(_check_items(settings)), ("checks", name), 4, layers)
    return "\n".join(lines) + "\n"


def _check_items(settings: CheckSettings) -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    for key in COMMON_SETTINGS:
        yield key, getattr(settings, key), {}
    options = settings.options
    if options is not None and dataclasses.is_dataclass(options):
        for f in dataclasses.fields(options):
            if f.init:
                yield f.name, getattr(options, f.name), f.metadata


def _mapping(items: Sequence[tuple[str, Any, Mapping[str, Any]]], path: KeyPath, indent: int,
             layers: LayeredSource | None) -> list[str]:
    out: list[str] = []
    pad = " " * indent
    for key, value, meta in items:
        here = (*path, key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.append(f"{pad}{key}:")
            nested = [(f.name, getattr(value, f.name), f.metadata)
                      for f in dataclasses.fields(value) if f.init]
            out += _mapping(nested, here, indent + 2, layers)
            continue
        notes = [str(meta["help"])] if meta.get("help") else []
        if "choices" in meta:
            notes.append(f"one of {', '.join(map(str, meta['choices']))}")
        if "min" in meta or "max" in meta:
            notes.append(f"{meta.get('min', '')}..{meta.get('max', '')}")
        if layers is not None:
            notes.append(_origin(layers, here))
        comment = f"  # {'; '.join(notes)}" if notes else ""
        out.append(f"{pad}{key}: {_scalar(value)}{comment}")
    return out


def _origin(layers: LayeredSource, path: KeyPath) -> str:
    layer = layers.set_by(path)
    if layer is None:
        return "default"
    if layer.what == "flags":
        return "command line"
    where = f"{layer.source.file}:{layer.source.line(path)}"
    return f"profile, {where}" if layer.what == "profile" else where


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1 << 16, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def _plain(value: Any) -> Any:
    """What YAML can write: enums by value, tuples and sets as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, frozenset, set)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    return value


def _oneline(text: str) -> str:
    return " ".join(text.split())
