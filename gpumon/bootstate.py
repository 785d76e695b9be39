"""What every stateful check shares: its state lives for one boot, a fault that comes back after
the reboot meant to cure it escalates, and its saved state is read back typed.

**Boot.** A check's state is persisted across daemon restarts, but most of what a check keeps
(counter baselines, open windows, de-duplication ledgers) describes one boot. A check's declared
``State`` (a dataclass subclassing :class:`BootState`) is reset by the framework when
``/proc/sys/kernel/random/boot_id`` changed (:func:`enter_boot`, :meth:`BootState.new_boot`),
keeping the fields it names in ``keep_across_boots``. A check without a ``State`` keeps a plain
mapping; :func:`start_boot` clears it, keeping only the keys the check names.

**Repeat after reboot.** The rule, one for every check: *a fault that needs a reboot escalates to
``inspect_hardware`` when the same fault (the same component and code) was also recorded in an
earlier boot within the last W seconds*; W is the check's ``repeat_window_s`` option, default
:data:`REPEAT_WINDOW_S` (7 days). A reboot is the remedy for such a fault; one that survives it is
the hardware. :class:`RepeatHistory` keeps, per fault, the boots that saw it and when they last did,
inside the check's own state so that it survives restarts and reboots.

**Typed state.** :func:`load_state` reads a check's saved JSON mapping into the check's own state
dataclass, checking every field against its annotation (and the dataclass's ``__post_init__``);
:func:`dump_state` writes it back as the same JSON (a field declared with :func:`omit_default` is
left out while it holds its default). State of another shape (another release, a hand edit, a
truncated file) raises :class:`StateError` with the path of what is wrong; :func:`read_state`
(and :func:`restore`, for a mapping) logs that reason and starts fresh, never failing the check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union

log = logging.getLogger("gpumon.bootstate")

#: The default W of the repeat-after-reboot rule: a week. gpumon's judgement of "the same fault
#: returning after the reboot meant to clear it" (NVIDIA's Fabric Manager guide says a fatal SXid
#: that returns after the reset means inspect the NVSwitch, and gives no window).
REPEAT_WINDOW_S = 7 * 86400.0
REPEAT_WINDOW_SOURCE = (
    "gpumon design choice, one rule for every check (gpumon.bootstate): a fault that needs a reboot "
    "and was also seen in another boot within a week has survived the reboot remedy, so the next "
    "remedy is hardware inspection (NVIDIA Fabric Manager user guide: a fatal SXid that returns "
    "after the reset means inspect the NVSwitch; it gives no window)")
# Boots kept per fault: only whether another boot saw it within W matters, so a few recent ones
# are enough, and a node rebooting in a loop cannot grow the state.
_MAX_BOOTS = 8


def start_boot(state: MutableMapping[str, Any], boot: str | None, *, keep: Iterable[str] = ()) -> bool:
    """Start ``state`` afresh when the boot changed (``boot``: the current boot id, None when it
    cannot be read), keeping only the keys in ``keep``; True when it did."""
    if state.get("boot_id") == boot:
        return False
    kept = {k: state[k] for k in keep if k in state}
    state.clear()
    state["boot_id"] = boot
    state.update(kept)
    return True


#: ``field(metadata=OMIT_DEFAULT)``: the field is left out of the saved JSON while it holds its
#: default (and read back as the default when absent), so that the JSON keeps the keys an older
#: release wrote and reads.
OMIT_DEFAULT: Mapping[str, Any] = types.MappingProxyType({"gpumon_omit_default": True})


@dataclass
class BootState:
    """Base of a check's declared ``State``: a dataclass whose fields are JSON types, lists, dicts
    with string keys, fixed tuples and nested dataclasses (what :func:`load_state` checks). The
    framework loads it from the check's saved JSON, refuses state of another shape, saves it after
    the runs and resets it at a reboot (``boot_id``).

    ``keep_across_boots`` names the fields a reboot keeps (a history across boots); override
    :meth:`new_boot` for more than that (ib closes an outage open at the reboot rather than drop
    it), and :meth:`salvage` to drop damaged parts of the saved JSON before it is read as a whole
    (one damaged record need not cost the rest of the state)."""

    boot_id: str | None = None

    keep_across_boots: ClassVar[tuple[str, ...]] = ()

    def new_boot(self) -> bool:
        """Keep of this state what outlives a reboot (by default the fields ``keep_across_boots``
        names; every other field back to its default); True when that changed anything worth
        saving at once."""
        for f in dataclasses.fields(self):
            if f.name == "boot_id" or f.name in self.keep_across_boots or not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                setattr(self, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                setattr(self, f.name, f.default_factory())
        return False

    @classmethod
    def salvage(cls, raw: MutableMapping[str, Any], check: str) -> None:
        """Drop (and log) the parts of the saved JSON ``raw`` that do not read back, before it is
        read as a whole; by default nothing."""


def enter_boot(state: BootState, boot: str | None) -> bool:
    """``start_boot`` for a typed state: on a boot other than the state's, let it keep what outlives
    the reboot (``new_boot``) and stamp it with ``boot``; True when that changed anything."""
    if state.boot_id == boot:
        return False
    changed = state.new_boot()
    state.boot_id = boot
    return changed


class RepeatHistory:
    """Per fault key, the boots that recorded it and when they last did:
    ``{key: {boot_id: epoch seconds}}``, kept in a mapping of the check's state (so it survives
    restarts and reboots), bounded in keys and in boots per key."""

    def __init__(self, data: MutableMapping[str, Any], *, max_keys: int = 512) -> None:
        self._data = data
        self._max_keys = max_keys

    def record(self, key: str, boot: str | None, now: float, window_s: float) -> bool:
        """Record fault ``key`` in this boot at ``now``; True when an earlier boot recorded it
        within ``window_s`` (the fault came back after a reboot). Without a boot id (None) nothing
        can be told apart: nothing is recorded, and the answer is False."""
        if boot is None:
            return False
        boots = _boots(self._data.get(key), now, window_s)
        earlier = any(b != boot for b in boots)
        boots.pop(boot, None)
        boots[boot] = now
        self._data[key] = dict(list(boots.items())[-_MAX_BOOTS:])
        if len(self._data) > self._max_keys:
            newest = {k: max((t for t in v.values() if _finite(t)), default=0.0)
                      if isinstance(v, dict) else 0.0 for k, v in self._data.items()}
            for stale in sorted(newest, key=newest.__getitem__)[:len(self._data) - self._max_keys]:
                del self._data[stale]
        return earlier

    def forget(self, now: float, window_s: float) -> None:
        """Drop what is older than ``window_s``: it can no longer escalate anything."""
        for key in list(self._data):
            boots = _boots(self._data[key], now, window_s)
            if boots:
                self._data[key] = boots
            else:
                del self._data[key]


def _boots(raw: Any, now: float, window_s: float) -> dict[str, float]:
    """A fault's boots within the window; a list of [boot, time] pairs (nvswitch's older JSON form)
    is read as well, so an upgraded node keeps its history."""
    if isinstance(raw, list):
        raw = {str(p[0]): p[1] for p in raw if isinstance(p, list) and len(p) == 2}
    if not isinstance(raw, dict):
        return {}
    return {str(b): t for b, t in raw.items() if _recent(t, now, window_s)}


def _finite(t: Any) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)


def _recent(t: Any, now: float, window_s: float) -> bool:
    return _finite(t) and now - t <= window_s


# -- typed state ---------------------------------------------------------------------------------

S = TypeVar("S")
B = TypeVar("B", bound=BootState)


class StateError(ValueError):
    """Saved state that does not fit the check's state type; the message says where and why."""


def load_state(cls: type[S], raw: Mapping[str, Any]) -> S:
    """``raw`` (JSON: dicts, lists, str, int, float, bool, None) as an instance of the dataclass
    ``cls``. Fields are checked against their annotations: ``int``, ``float`` (an int is accepted,
    a bool or a non-finite number is not), ``str``, ``bool``, ``None``, unions of these, ``list[X]``,
    ``dict[str, X]``, fixed ``tuple[X, Y]`` (a JSON list), nested dataclasses and ``Any``. A missing
    field takes its default; an unknown key, a wrong type or a ``ValueError`` from the dataclass's
    ``__post_init__`` raises :class:`StateError`."""
    return typing.cast(S, _load(cls, raw, "state"))


def dump_state(obj: Any) -> dict[str, Any]:
    """A state dataclass as the JSON mapping :func:`load_state` reads back (tuples as lists)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"{type(obj).__name__} is not a dataclass")
    out: dict[str, Any] = _dump(obj)
    return out


def read_state(cls: type[B], raw: Mapping[str, Any], *, check: str,
               refused: Callable[[], object] | None = None) -> B:
    """A check's declared state from its saved JSON ``raw`` (left unchanged): ``cls.salvage`` on a
    copy, then :func:`load_state`; a fresh ``cls()`` when ``raw`` is empty or does not fit. A
    refused state is logged with its reason and ``refused`` called first (the store copies the
    file aside: the next save overwrites it)."""
    if not raw:
        return cls()
    data = dict(raw)
    cls.salvage(data, check)
    try:
        return load_state(cls, data)
    except StateError as exc:
        log.warning("saved state of check %s refused, starting afresh: %s", check, exc)
        if refused is not None:
            refused()
        return cls()


class SavedMapping(dict[str, Any]):
    """A check's saved state as the JSON mapping that is written, which may have a file behind it
    (``gpumon.checkstate.CheckState``, the store's). Here so that :func:`restore` can have a refused
    state's file copied aside: the store builds on this module, so this one cannot import it."""

    def keep_refused(self) -> Path | None:
        """Copy the file behind this state aside before the check that refused its content starts
        afresh and the next save overwrites it; the copy, or None when there is no file."""
        return None


def restore(cls: type[S], raw: MutableMapping[str, Any], *, check: str) -> S:
    """:func:`load_state` of a mapping, or a fresh ``cls()`` when ``raw`` is empty or does not fit;
    a refused state is logged with its reason, its file copied aside (:meth:`SavedMapping.
    keep_refused`), and ``raw`` overwritten with the fresh state."""
    if raw:
        try:
            return load_state(cls, raw)
        except StateError as exc:
            log.warning("saved state of check %s refused, starting afresh: %s", check, exc)
            if isinstance(raw, SavedMapping):
                raw.keep_refused()  # the next save overwrites it: a copy for the post-mortem
    fresh = cls()
    raw.clear()
    raw.update(dump_state(fresh))
    return fresh


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    got = _HINTS.get(cls)
    if got is None:
        got = _HINTS[cls] = typing.get_type_hints(cls)
    return got


def _load(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is type(None) or tp is None:
        if value is not None:
            raise StateError(f"{path}: expected null, got {_show(value)}")
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise StateError(f"{path}: expected a boolean, got {_show(value)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise StateError(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if not _finite(value):
            raise StateError(f"{path}: expected a finite number, got {_show(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise StateError(f"{path}: expected a string, got {_show(value)}")
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        errors = []
        for arg in args:
            try:
                return _load(arg, value, path)
            except StateError as exc:
                errors.append(str(exc).removeprefix(f"{path}: "))
        raise StateError(f"{path}: {' / '.join(errors)}")
    if origin is list:
        if not isinstance(value, list):
            raise StateError(f"{path}: expected a list, got {_show(value)}")
        return [_load(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise StateError(f"{path}: expected a list of {len(args)}, got {_show(value)}")
        return tuple(_load(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise StateError(f"{path}: expected a mapping, got {_show(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateError(f"{path}: key {_show(k)} is not a string")
            out[k] = _load(args[1], v, f"{path}[{k!r}]")
        return out
    raise TypeError(f"{path}: state type {tp!r} is not supported")


def _load_dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise StateError(f"{path}: expected a mapping, got {_show(value)}")
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in value if k not in fields)
    if unknown:
        raise StateError(f"{path}: unknown key(s) {', '.join(unknown)}")
    kwargs = {name: _load(hints[name], value[name], f"{path}.{name}") for name in fields if name in value}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a field without a default is missing
        raise StateError(f"{path}: {exc}") from None
    except ValueError as exc:
        raise StateError(f"{path}: {exc}") from None


_SCALARS = (str, int, float, bool, type(None))
# per dataclass: its fields, and (name, default) of those left out while at their default
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]:
    fields = dataclasses.fields(cls)
    omitted = tuple((f.name, f.default) for f in fields
                    if f.metadata.get("gpumon_omit_default") and f.default is not dataclasses.MISSING)
    got = _FIELDS[cls] = (tuple(f.name for f in fields), omitted)
    return got


def _dump(value: Any) -> Any:
    # a check that samples every second dumps its state every second: the common cases first
    cls = type(value)
    if cls in _SCALARS:
        return value
    if cls is list or cls is tuple:
        return [v if type(v) in _SCALARS else _dump(v) for v in value]
    if cls is dict:
        return {k: v if type(v) in _SCALARS else _dump(v) for k, v in value.items()}
    known = _FIELDS.get(cls)
    if known is None:
        if not dataclasses.is_dataclass(cls):
            return value
        known = _fields_of(cls)
    names, omitted = known
    out = {}
    for name in names:
        v = getattr(value, name)
        out[name] = v if type(v) in _SCALARS else _dump(v)
    for name, default in omitted:
        if out[name] == default:
            del out[name]
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
