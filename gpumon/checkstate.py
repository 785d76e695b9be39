"""Per-check persisted state (windows, counters, histories) across daemon restarts.

``ctx.state`` is the check's :class:`CheckState`: the store's entry for it. A check that
declares a ``State`` dataclass (``Check.State``, a :class:`gpumon.bootstate.BootState`) reads it
typed with ``ctx.state_as(MyState)``: loaded from the saved JSON and checked once, reset at a
reboot, and written back as JSON when the store saves it. A check without one keeps JSON-friendly
data in the mapping itself. The daemon saves each check's state after its runs (a frequently run
check at most every 10 s), atomically, one file per check under ``<state_dir>/checks/``, so a
restart does not forget an outage or an Xid history. A check whose state just changed in a way a
crash must not lose (an IB port went down or came back) saves it at once with
``ctx.save_state_now()``. A state file that cannot be read is set aside (renamed ``*.corrupt``)
and the check starts afresh; a write that fails is logged and retried on the next run.
A state file that reads but that the check cannot use (valid JSON of another shape: a hand edit,
another release) would make the check raise on every run, forever: a check that raises on its
first two runs with state loaded from disk (a one-off exception must not cost a week of history)
gets that state set aside (:meth:`set_aside`, called by the runner), and its next run starts
afresh. A declared state of another shape is refused when it is loaded (``gpumon.bootstate.
read_state``) and its file copied aside first (:meth:`CheckState.keep_refused`). Set-aside copies carry
the time: a later one never overwrites an earlier.

Every write goes to a temporary file that is fsync'd, renamed over the old one,
and the directory fsync'd: after a crash (``kill -9``, power loss) the file holds
the old state or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

from gpumon.atomic import write_atomic
from gpumon.bootstate import BootState, SavedMapping, dump_state, enter_boot, read_state

log = logging.getLogger("gpumon.checkstate")

B = TypeVar("B", bound=BootState)


class CheckState(SavedMapping):
    """A check's persisted state, as the store keeps it: the JSON mapping that is saved, which
    knows its store (None: kept in memory only, e.g. a test's), and, for a check that declares a
    ``State``, the typed instance loaded from it (:meth:`load`), whose JSON the mapping holds
    once saved (:meth:`sync`)."""

    def __init__(self, data: Mapping[str, Any] | None = None, store: CheckStateStore | None = None,
                 name: str = "") -> None:
        super().__init__(data or {})
        self._store = store
        self.name = name
        self.typed: BootState | None = None

    def load(self, cls: type[B], boot: str | None) -> B:
        """The typed state: read from the mapping the first time (or after the store set it
        aside), then kept; reset when ``boot`` is not the state's boot (a reboot; saved at once
        when the reset kept something, such as an outage closed by it)."""
        typed = self.typed
        if not (isinstance(cls, type) and issubclass(cls, BootState)):
            raise TypeError(f"{cls!r} is not a check's State (a gpumon.bootstate.BootState dataclass)")
        if typed is not None and not isinstance(typed, cls):
            raise TypeError(f"check state is {type(typed).__name__}, not {cls.__name__}")
        if typed is None:
            typed = self.typed = read_state(cls, self, check=self.name or cls.__name__,
                                            refused=self.keep_refused)
        if enter_boot(typed, boot):
            self.save_now()
        return typed

    def sync(self) -> None:
        """The mapping follows the typed state (nothing without one)."""
        if self.typed is not None:
            data = dump_state(self.typed)
            self.clear()
            self.update(data)

    def save_now(self) -> bool:
        return self._store.save(self.name) if self._store is not None else False

    def keep_refused(self) -> Path | None:
        """The store's copy of its file (``<check>.refused-<UTC time>``), None when it is not a
        store's or there is no file."""
        return self._store.keep_refused(self.name) if self._store is not None else None


def _aside(path: Path, why: str) -> Path:
    """Where a state file set aside for a post-mortem goes: beside it, named for why and when."""
    return path.with_name(f"{path.stem}.{why}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")


def save_now(state: MutableMapping[str, Any]) -> bool:
    """Write ``state`` to disk now (atomically, fsync'd) when it is a store's state; False when
    it is not persisted (a one-shot ``gpumon check``, a test's plain dict) or the write failed.
    Call it from the check's own run, where nothing else changes the state meanwhile."""
    return state.save_now() if isinstance(state, CheckState) else False


class CheckStateStore:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._states: dict[str, CheckState] = {}
        self._saved: dict[str, str] = {}
        # checks run on threads of their own and two may save one shared state (kernel-log
        # watermarks) at once: one writer at a time, or both would write the same .tmp file
        self._lock = threading.Lock()
        self.last_error: str | None = None
        # per check whose state came from a file and has not yet carried a run to its end: the
        # runs that raised on it so far
        self._unproven: dict[str, int] = {}

    def _path(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{name}.json"

    def get(self, name: str) -> CheckState:
        got = self._states.get(name)
        if got is not None:
            return got
        state: dict[str, Any] = {}
        path = self._path(name)
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(loaded, dict):
                    raise ValueError("not a JSON object")
                state = loaded
                self._unproven[name] = 0
            except (OSError, ValueError) as exc:
                log.warning("state of check %s unreadable (%s): starting afresh", name, exc)
                with contextlib.suppress(OSError):  # set aside for a post-mortem
                    os.replace(path, path.with_suffix(".corrupt"))
        self._states[name] = got = CheckState(state, self, name)
        return got

    def keep_refused(self, name: str) -> Path | None:
        path = self._path(name)
        if path is None or not path.is_file():
            return None
        copy = _aside(path, "refused")
        try:
            shutil.copy2(path, copy)
        except OSError as exc:
            log.warning("cannot keep a copy of %s: %s", path, exc)
            return None
        log.warning("refused state of check %s kept as %s", name, copy)
        return copy

    def proven(self, name: str) -> None:
        """The check completed a run with its state: what it loaded from disk was usable."""
        self._unproven.pop(name, None)

    def set_aside(self, name: str, why: str) -> Path | None:
        """The check raised on state loaded from disk before any run completed with it. Once is
        not proof (a one-off bug, an odd kernel line); a second time in a row, the state is the
        likely cause (it reads, but not as this check expects): the file is set aside
        (``<check>.corrupt-<UTC time>``) and the state emptied in place, so that the next run
        starts afresh. Returns where the file went; None while it is kept (not from disk, a
        check that raises on fresh state being a bug that no reset cures; or the first raise)."""
        raised = self._unproven.get(name)
        if raised is None:
            return None
        if raised < 1:
            self._unproven[name] = raised + 1
            return None
        del self._unproven[name]
        with self._lock:
            path = self._path(name)
            moved = None if path is None else _aside(path, "corrupt")
            log.warning("state of check %s set aside (%s): the next run starts afresh", name, why)
            if path is not None and moved is not None:
                try:
                    os.replace(path, moved)
                except OSError as exc:
                    log.warning("cannot set aside %s: %s", path, exc)
                    moved = None
            state = self._states.get(name)
            if state is not None:
                state.clear()
                state.typed = None
            self._saved.pop(name, None)
            return moved

    def save(self, name: str) -> bool:
        with self._lock:
            return self._save(name)

    def _save(self, name: str) -> bool:
        path = self._path(name)
        if path is None or name not in self._states:
            return False
        try:
            state = self._states[name]
            state.sync()
            text = json.dumps(state, separators=(",", ":"), default=str)
            if self._saved.get(name) == text:
                return True  # unchanged: a 1 s check must not fsync every second for nothing
            # a full disk leaves no temp file behind (write_atomic removes it)
            write_atomic(path, text)
            self._saved[name] = text
            self.last_error = None
            return True
        except (OSError, TypeError, ValueError, RuntimeError) as exc:
            # RuntimeError: the state changed size while it was serialized (a check still running)
            self.last_error = f"cannot save state of {name} to {path}: {exc}"
            log.warning("%s", self.last_error)
            return False
