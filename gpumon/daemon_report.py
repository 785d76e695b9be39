"""The daemon's ``report.json``: what ``/metrics`` exports, as the JSON contract, written atomically
on its own thread so that a slow or full disk never holds up a check run.

Rewritten when that changes (or a finding's words, or the health state), at most once per
REPORT_MIN_INTERVAL_S, at least once per REPORT_MAX_AGE_S (its "time" says the daemon is alive),
and at exit. :class:`ReportSink` is the daemon's sink (gpumon.daemon_sinks) that says when.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumon.atomic import write_atomic
from gpumon.daemon_sinks import Said, Sink, said_of
from gpumon.health import Health, HealthView
from gpumon.model import CheckRun
from gpumon.remediate.runner import RemediationLoop
from gpumon.report import json_report

log = logging.getLogger("gpumon.daemon")
REPORT_MIN_INTERVAL_S = 1.0
REPORT_MAX_AGE_S = 60.0


def _os_error(exc: OSError) -> str:
    """An OSError in words; a full disk said as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({exc.strerror})"
    return exc.strerror or str(exc)


class ReportWriter:
    """Writes ``<state_dir>/report.json`` from ``latest()`` (the newest run of each check) and the
    health state: ``due()`` asks for a new one, ``close()`` writes the last one."""

    def __init__(self, state_dir: Path, node: str, profile: str, latest: Callable[[], list[CheckRun]],
                 health: Health | None, remediation: RemediationLoop | None) -> None:
        self.path = state_dir / "report.json"
        self.node = node
        self.profile = profile
        self.latest = latest
        self.health = health
        self.remediation = remediation
        # the health view the last report was written from (a new view: a new report is due)
        self.view: HealthView | None = None
        self.error: str | None = None
        self._at = 0.0
        self._due = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpumon-report", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def due(self) -> None:
        self._due.set()

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10.0)
        self.write()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._due.wait(timeout=REPORT_MAX_AGE_S)
            wait = self._at + REPORT_MIN_INTERVAL_S - time.monotonic()
            if self._stop.is_set() or (wait > 0 and self._stop.wait(wait)):
                return  # the last one is written at exit
            self._due.clear()
            try:
                self.write()
            except Exception:  # the reporter outlives any one failure
                log.exception("writing report.json failed")

    def write(self) -> None:
        """report.json, atomically (a reader sees the old file or the new one; a failed write
        leaves no temporary file)."""
        with self._lock:
            self._at = time.monotonic()
            self._write()

    def _write(self) -> None:
        extra: dict[str, Any] = {}
        latest = self.latest()
        if self.health is not None:
            view = self.health.view()
            self.view = view
            if self.remediation is not None and self.remediation.last is not None:
                extra["remediation"] = self.remediation.last.to_json()
            extra["health"] = {"node": view.node.to_json(),
                               "components": {n: c.to_json() for n, c in view.components.items()
                                              if c.level.value != "healthy"}}
            store = self.health.store_finding()
            runs = [*latest, CheckRun(store.check, [store], time.time(), 0.0, "completed")]
        else:
            runs = latest
        doc = json_report(runs, node=self.node, profile=self.profile, extra=extra)
        try:
            write_atomic(self.path, json.dumps(doc, indent=2))
        except OSError as exc:
            why = f"cannot write {self.path}: {_os_error(exc)}"
            if why != self.error:
                log.warning("%s (tried again at the next change, at least once a minute)", why)
            self.error = why
            return
        if self.error is not None:
            log.info("%s written again", self.path)
        self.error = None


class ReportSink(Sink):
    """Asks ``writer`` for a new report.json when a run said something new, when the exporter's
    content changed (``version``: the exporter's snapshot version) or when the health state did."""

    name = "report"
    after = ("exporter",)  # report.json follows what /metrics exports: read after it is published

    def __init__(self, writer: ReportWriter, version: Callable[[], int | None]) -> None:
        self.writer = writer
        self.version = version
        self._seen = version()
        self._said: dict[str, Said] = {}

    def record(self, run: CheckRun) -> None:
        said = said_of(run)
        due = said != self._said.get(run.check, ())
        self._said[run.check] = said
        version = self.version()
        if version != self._seen:
            self._seen, due = version, True
        health = self.writer.health
        if due or (health is not None and health.view() is not self.writer.view):
            self.writer.due()

    def health_changed(self) -> None:
        self.writer.due()
