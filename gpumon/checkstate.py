"""Per-check persisted state (windows, counters, histories) across daemon restarts.

A check keeps JSON-friendly data in ``ctx.state``; the daemon saves it after
each run, atomically, one file per check under ``<state_dir>/checks/``, so a
restart does not forget an outage or an Xid history. A state file that cannot
be read is set aside (renamed ``*.corrupt``) and the check starts afresh; a
write that fails is logged and retried on the next run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("gpumon.checkstate")


class CheckStateStore:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._states: dict[str, dict[str, Any]] = {}
        self._saved: dict[str, str] = {}
        # checks run on threads of their own and two may save one shared state (kernel-log
        # watermarks) at once: one writer at a time, or both would write the same .tmp file
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def _path(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{name}.json"

    def get(self, name: str) -> dict[str, Any]:
        state = self._states.get(name)
        if state is not None:
            return state
        state = {}
        path = self._path(name)
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(loaded, dict):
                    raise ValueError("not a JSON object")
                state = loaded
            except (OSError, ValueError) as exc:
                log.warning("state of check %s unreadable (%s): starting afresh", name, exc)
                with contextlib.suppress(OSError):  # set aside for a post-mortem
                    os.replace(path, path.with_suffix(".corrupt"))
        self._states[name] = state
        return state

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
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            self._saved[name] = text
            self.last_error = None
            return True
        except (OSError, TypeError, ValueError, RuntimeError) as exc:
            # RuntimeError: the state changed size while it was serialized (a check still running)
            self.last_error = f"cannot save state of {name} to {path}: {exc}"
            log.warning("%s", self.last_error)
            return False
