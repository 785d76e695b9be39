"""Per-check persisted state (windows, counters, histories) across daemon restarts.

A check keeps JSON-friendly data in ``ctx.state``; the daemon saves it after
each run (a frequently run check at most every 10 s), atomically, one file per
check under ``<state_dir>/checks/``, so a restart does not forget an outage or
an Xid history. A check whose state just changed in a way a crash must not lose
(an IB port went down or came back) saves it at once with :func:`save_now`. A
state file that cannot be read is set aside (renamed ``*.corrupt``) and the
check starts afresh; a write that fails is logged and retried on the next run.
A state file that reads but that the check cannot use (valid JSON of another shape: a hand edit,
another release) would make the check raise on every run, forever: a check that raises on its
first run with state loaded from disk gets that state set aside the same way (:meth:`set_aside`,
called by the runner), and its next run starts afresh.

Every write goes to a temporary file that is fsync'd, renamed over the old one,
and the directory fsync'd: after a crash (``kill -9``, power loss) the file holds
the old state or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from gpumon.atomic import write_atomic

log = logging.getLogger("gpumon.checkstate")


class CheckState(dict[str, Any]):
    """A check's persisted state: a plain dict that knows which store saves it."""

    def __init__(self, data: dict[str, Any], store: CheckStateStore, name: str) -> None:
        super().__init__(data)
        self._store = store
        self._name = name

    def save_now(self) -> bool:
        return self._store.save(self._name)


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
        # checks whose state came from a file and has not yet carried a run to its end
        self._unproven: set[str] = set()

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
                self._unproven.add(name)
            except (OSError, ValueError) as exc:
                log.warning("state of check %s unreadable (%s): starting afresh", name, exc)
                with contextlib.suppress(OSError):  # set aside for a post-mortem
                    os.replace(path, path.with_suffix(".corrupt"))
        self._states[name] = got = CheckState(state, self, name)
        return got

    def proven(self, name: str) -> None:
        """The check completed a run with its state: what it loaded from disk was usable."""
        self._unproven.discard(name)

    def set_aside(self, name: str, why: str) -> Path | None:
        """The check raised on its first run with state loaded from disk: that state is the likely
        cause (it reads, but not as this check expects). Set the file aside (``*.corrupt``) and
        empty the state in place, so that the next run starts afresh. Returns where the file went;
        None when the state did not come from disk (a check that raises on fresh state is a bug,
        which no reset cures)."""
        if name not in self._unproven:
            return None
        self._unproven.discard(name)
        with self._lock:
            path = self._path(name)
            moved = None if path is None else path.with_suffix(".corrupt")
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
            text = json.dumps(self._states[name], separators=(",", ":"), default=str)
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
