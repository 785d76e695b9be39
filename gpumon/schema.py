"""Strict YAML -> dataclass loading that remembers where every key came from.

Every config, profile and scenario file goes through here, so a typo, a wrong
type or a bad value is reported as ``file:line: key: reason`` (healthagent's
``extra="allow"`` let typos pass silently; we forbid unknown keys at every
level).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

from gpumon.errors import ConfigError

KeyPath = tuple[str | int, ...]
T = TypeVar("T")


@dataclasses.dataclass
class Source:
    """Where a document came from: file name and the line of each key path."""

    file: str
    lines: dict[KeyPath, int] = dataclasses.field(default_factory=dict)
    # dotted key -> source note, filled for fields marked ``sourced``
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def line(self, path: KeyPath) -> int | None:
        # Fall back to the nearest enclosing key that has a line.
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get(())

    def error(self, path: KeyPath, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, line=self.line(path), key=dotted(path) or None)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One document of a layered configuration: what it is (``site``, ``flags``, ``profile``),
    where it came from, and what it sets."""

    what: str
    source: Source
    data: Mapping[str, Any]


@dataclasses.dataclass
class LayeredSource(Source):
    """Documents merged key by key, later wins, built into a dataclass once: an error names the
    layer that wrote the key (its file and line), and ``origin`` says which layer set a value.
    A value no layer sets is the declared default."""

    file: str = "declared defaults"
    layers: tuple[Layer, ...] = ()
    merged: dict[str, Any] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for layer in self.layers:
            self.merged = deep_merge(self.merged, layer.data)

    def add(self, layer: Layer, *, below: bool = False) -> LayeredSource:
        """These layers and ``layer``, on top (or, ``below``, beneath every other)."""
        return LayeredSource(layers=(layer, *self.layers) if below else (*self.layers, layer))

    def set_by(self, path: KeyPath) -> Layer | None:
        """The layer whose value of ``path`` won; None: the declared default."""
        return next((layer for layer in reversed(self.layers) if _holds(layer.data, path)), None)

    def origin(self, path: KeyPath) -> Layer | None:
        """The layer whose value of ``path`` won, else the top layer that set a key above it."""
        for depth in range(len(path), 0, -1):
            for layer in reversed(self.layers):
                if _holds(layer.data, path[:depth]):
                    return layer
        return None

    def line(self, path: KeyPath) -> int | None:
        layer = self.origin(path)
        return layer.source.line(path) if layer is not None else None

    def error(self, path: KeyPath, message: str) -> ConfigError:
        layer = self.origin(path)
        if layer is None:
            return ConfigError(message, file=self.file, key=dotted(path) or None)
        return layer.source.error(path, message)


def _holds(data: Any, path: KeyPath) -> bool:
    for part in path:
        if isinstance(data, Mapping):
            if part not in data:
                return False
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return False
    return True


def dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


# Bounds on what a config, web-config, profile or scenario file may cost to load.
# The largest file gpumon ships is under 25 KB; 1 MiB leaves room for any real
# site file and refuses a 50 MB one, which would take half a minute and most of a GB.
MAX_FILE_BYTES = 1 << 20
# YAML aliases share a node; turning the document into Python data copies it once
# per alias, so nine aliases of nine aliases ... (a "billion laughs") is 9**9 nodes
# from a few hundred bytes. The copies are counted while composing, before anything
# is copied; sharing a block of settings a few times stays far below this.
MAX_ALIAS_NODES = 10_000
# Composing (and converting) recurses per level: bound it well below Python's
# recursion limit so that "[[[[..." is a ConfigError, not a RecursionError.
MAX_DEPTH = 64


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses alias bombs, recursive aliases and deep nesting."""

    def __init__(self, text: str, file: str) -> None:
        super().__init__(text)
        self.file = file
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to, aliases included
        self._aliased = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # unannotated in types-PyYAML
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:  # an undefined alias is the composer's own error
                size = self._sizes.get(id(target))
                if size is None:  # the anchored node is still open: it contains itself
                    raise ConfigError(f"recursive YAML alias *{event.anchor}", file=self.file, line=line)
                self._aliased += size
                if self._aliased > MAX_ALIAS_NODES:
                    raise ConfigError(f"YAML aliases expand to more than {MAX_ALIAS_NODES} nodes "
                                      "(an alias bomb?); write the repeated settings out",
                                      file=self.file, line=line)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", file=self.file, line=line)
        node = super().compose_node(parent, index)
        self._depth -= 1
        size = 1
        if isinstance(node, yaml.SequenceNode):
            size += sum(self._sizes[id(child)] for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            size += sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
        self._sizes[id(node)] = size
        return node


def load_yaml(text: str, file: str) -> tuple[Any, Source]:
    """Parse YAML, returning plain Python data and the line of every key."""
    src = Source(file)
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES >> 20} MiB; not a settings file", file=file)
    loader = _BoundedLoader(text, file)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML: {problem}", file=file, line=line) from None
    finally:
        loader.dispose()
    if node is None:
        return {}, src
    return _convert(node, (), src), src


def load_yaml_file(path: Path) -> tuple[Any, Source]:
    try:
        # Read one byte past the limit, never the whole file: /dev/zero or a
        # runaway log passed as --config must not be loaded into memory first.
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES >> 20} MiB; not a settings file", file=str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason}", file=str(path)) from None
    return load_yaml(text, str(path))


def _convert(node: yaml.Node, path: KeyPath, src: Source) -> Any:
    src.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError("keys must be plain scalars", file=src.file,
                                  line=key_node.start_mark.line + 1, key=dotted(path) or None)
            key = str(_scalar(key_node, src, path))
            if key in out:
                raise ConfigError("duplicate key", file=src.file, line=key_node.start_mark.line + 1,
                                  key=dotted((*path, key)))
            src.lines[path + (key,)] = key_node.start_mark.line + 1  # noqa: RUF005 (3.10 syntax)
            out[key] = _convert(value_node, (*path, key), src)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), src) for i, item in enumerate(node.value)]
    return _scalar(node, src, path)


def _scalar(node: yaml.Node, src: Source, path: KeyPath) -> Any:
    # A fresh constructor per scalar: SafeConstructor keeps per-document state.
    try:
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except yaml.YAMLError as exc:  # an unknown tag, a merge key (<<)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML: {problem}", file=src.file, line=node.start_mark.line + 1,
                          key=dotted(path) or None) from None
    except (ArithmeticError, AttributeError, KeyError, TypeError, ValueError):
        # what PyYAML's constructors raise for an explicit tag on a value that is
        # not one (!!float foo, !!timestamp foo, !!bool foo)
        kind = node.tag.rpartition(":")[2]
        raise ConfigError(f"invalid YAML value: {node.value!r} is not a valid !!{kind}",
                          file=src.file, line=node.start_mark.line + 1, key=dotted(path) or None) from None


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else in ``override`` replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build(cls: type[T], data: Any, src: Source, path: KeyPath = ()) -> T:
    """Build dataclass ``cls`` from ``data``, strictly.

    Field metadata understood: ``min``, ``max`` (numbers), ``choices``,
    ``sourced`` (the value is written ``{value: X, source: "..."}`` and the
    source is required), ``allow_inf`` (``.inf``/``-.inf`` accepted, for a
    threshold where infinity means "never"; NaN never is). A dataclass
    ``__post_init__`` raising ValueError is reported against the dataclass's
    own key.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise src.error(path, f"expected a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        raise src.error((*path, key), f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise src.error(path, f"missing required key {name!r}")
            continue
        kwargs[name] = _value(hints[name], data[name], src, (*path, name), f.metadata)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise src.error(path, str(exc)) from None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _value(tp: Any, value: Any, src: Source, path: KeyPath, meta: Mapping[str, Any]) -> Any:
    if meta.get("sourced"):
        if not isinstance(value, Mapping) or set(value) != {"value", "source"}:
            raise src.error(path, "a number here needs a source note: write {value: N, source: \"...\"}")
        note = value["source"]
        if not isinstance(note, str) or len(note.strip()) < 8:
            raise src.error((*path, "source"), "source note must name where the number comes from")
        src.sources[dotted(path)] = note
        meta = {k: v for k, v in meta.items() if k != "sourced"}
        return _value(tp, value["value"], src, (*path, "value"), meta)
    out = _typed(tp, value, src, path, bool(meta.get("allow_inf")))
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        if "min" in meta and out < meta["min"]:
            raise src.error(path, f"must be >= {meta['min']}, got {out}")
        if "max" in meta and out > meta["max"]:
            raise src.error(path, f"must be <= {meta['max']}, got {out}")
    if "choices" in meta and out not in meta["choices"]:
        raise src.error(path, f"must be one of {', '.join(map(str, meta['choices']))}; got {out!r}")
    return out


def _typed(tp: Any, value: Any, src: Source, path: KeyPath, allow_inf: bool = False) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _typed(arg, value, src, path, allow_inf)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else src.error(path, f"unexpected {_kind(value)}")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return build(tp, value, src, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise src.error(path, f"must be one of {', '.join(str(m.value) for m in tp)}; "
                                  f"got {value!r}") from None
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise src.error(path, f"expected a list, got {_kind(value)}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_typed(item_tp, v, src, (*path, i), allow_inf) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise src.error(path, f"expected a mapping, got {_kind(value)}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {str(k): _typed(val_tp, v, src, (*path, str(k)), allow_inf) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise src.error(path, f"expected true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise src.error(path, f"expected an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise src.error(path, f"expected a number, got {_kind(value)}")
        # NaN compares false with every bound, so .nan passed min/max and then
        # stopped a check for good (interval_s) or failed far from its line;
        # infinity is refused too where it is not a documented "never".
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise src.error(path, f"must be a finite number, got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise src.error(path, f"expected a string, got {_kind(value)}")
        return value
    raise TypeError(f"schema type {tp!r} not supported (at {dotted(path)})")
