"""``gpumon daemon``: continuous checks on jittered schedules, kernel log event-driven.

Startup -> main loop -> bounded shutdown (uvicorn's server shape: ``startup``, ``main_loop``,
``shutdown``), under the daemon's signal handlers from the start of startup to the end of shutdown
(restored on the way out). SIGTERM or SIGINT: a graceful stop; a second SIGINT while stopping exits
at once with :data:`FORCED_EXIT` (uvicorn's force exit). A start-up that fails part-way stops what
it had started before the error goes on. Checks that read the kernel log run
as soon as a new record arrives (``gpumon.kernel_pump``); the others run every ``interval_s`` +-
jitter. A check still running from its previous turn is not started twice; a hung one is reported
by the runner. The daemon's middle only hands each run to its sinks (``gpumon.daemon_sinks``), in
order: the health state (``gpumon.health``), the remediation loop's wake-ups, the log of severity
changes, a site's own sinks, ``/metrics`` (``gpumon.export``) and ``report.json``
(``gpumon.daemon_report``); a sink that raises is logged and counted, and the others go on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from gpumon.agent import Agent
from gpumon.check import Check
from gpumon.config import split_listen
from gpumon.daemon_report import ReportSink, ReportWriter
from gpumon.daemon_sinks import PRERENDER_COUNTS_S as PRERENDER_COUNTS_S
from gpumon.daemon_sinks import ChangeLog, ExporterSink, HealthSink, RemediationSink, Sink, Sinks
from gpumon.errors import StartupError
from gpumon.export.api import HistoryApi, identity_of
from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder
from gpumon.export.readings import ReadingCatalog
from gpumon.export.webserver import load_web_config, serve_metrics
from gpumon.health import Health
from gpumon.intake import IntakeReply, IntakeServer, IntakeUnavailable, Peer, dispatch
from gpumon.kernel_pump import WATERMARK_STATE, KernelLogPump
from gpumon.model import CheckRun, Phase
from gpumon.remediate.runner import RemediationLoop
from gpumon.runner import CheckThread

log = logging.getLogger("gpumon.daemon")
# How often the main loop looks for health events another process stored (gpumon set-healthy),
# so that /metrics says what gpumon status says within that, however seldom the checks run.
FOREIGN_S = 1.0
# How often the main loop tells systemd's watchdog it is alive (and ticks the health state).
WATCHDOG_S = 5.0
# The exit status after a second SIGINT: 128 + SIGINT, what a shell reports for a command ended by
# Ctrl-C (systemd stops with SIGTERM and, past TimeoutStopSec, SIGKILL: this is for a person)
FORCED_EXIT = 128 + signal.SIGINT


def sd_notify(message: str) -> bool:
    """Send a systemd notification (READY=1, WATCHDOG=1, STATUS=...) if NOTIFY_SOCKET is set."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)
        return False


class Daemon:
    """``sinks``: a site's own sinks (gpumon.daemon_sinks.Sink), each handed every run after the
    health state has it and before the exporter publishes it."""

    def __init__(self, agent: Agent, *, rng: random.Random | None = None, sinks: Sequence[Sink] = ()) -> None:
        self.agent = agent
        self.rng = rng or random.Random()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.latest: dict[str, CheckRun] = {}
        self._lock = threading.Lock()
        # per check, the thread that runs it (waits for it within its deadline) and records
        # what it found, kept between runs (see gpumon.runner.CheckThread)
        self._workers: dict[str, CheckThread] = {}
        self._saved_at: dict[str, float] = {}
        self._folded: dict[str, tuple[tuple[Any, ...], float]] = {}
        # per kernel-log check, the watermark of its last completed run (see _store_watermark)
        self._marks: dict[str, dict[str, Any]] = {}
        self._marks_lock = threading.Lock()
        self.remediation: RemediationLoop | None = None
        self.health: Health | None = None
        self.report: ReportWriter | None = None
        self._extra_sinks = tuple(sinks)
        self._changes = ChangeLog()
        self.exporter = ExporterSink(lambda: (agent.node, agent.profile.name), self.latest,
                                     lambda: self._pump.stats() if self._pump is not None else None)
        # until startup has the health state and the rest (a test may record runs before it)
        self.sinks = Sinks([self._changes, self.exporter])
        self._server: Any = None
        self._nvhcd: Any = None  # gpumon.export.nvhcd.NvhcdServer when exporter.nvhcd_socket is set
        self._intake: IntakeServer | None = None
        # set by startup
        self._checks: list[Check] = []
        self._due: dict[str, float] = {}
        self._pump: KernelLogPump | None = None
        self._background: list[threading.Thread] = []
        self._signalled = False

    def next_delay(self, interval: float) -> float:
        j = self.agent.config.daemon.jitter
        return float(interval * (1.0 + self.rng.uniform(-j, j)))

    def serve(self, duration: float | None = None) -> int:
        """Run until a signal (SIGTERM, SIGINT) or ``duration`` seconds; the exit code."""
        with self._signals():
            try:
                self.startup()
            except BaseException:
                self._undo_startup()
                raise
            self.main_loop(duration)
            self._stop_checks()
            self.shutdown()
        return 0

    # -- startup ---------------------------------------------------------------------

    def startup(self) -> None:
        """Open the health state, start remediation, the exporter, the report writer, the
        kernel-log pump and the machine's own background tasks; every check is due at once."""
        agent = self.agent
        # SDC canaries run in the daemon too, on their own (long) interval, never at startup:
        # a daemon restart must not start a heavy run on GPUs that may be busy
        canaries = agent.selected(Phase.CANARY)
        self._checks = agent.selected(Phase.CONTINUOUS) + canaries
        # the daemon sets a corrupt health.db aside and starts afresh (gpumon.health.keeper)
        self.health = Health.open(agent.state_dir, boot_id=agent.hw.fs.boot_id(), recover=True)
        self.remediation = RemediationLoop.build(agent.config.remediation, self.health,
                                                 agent.config.node_name, agent.hw.tools, agent.config.layers)
        if self.remediation is not None:
            self.remediation.start()
        self.exporter.health, self.exporter.remediation = self.health, self.remediation
        self.snapshots = SnapshotHolder(self._snapshot())
        self._start_exporter()
        self._start_nvhcd()
        self._start_intake()
        self.report = ReportWriter(agent.state_dir, agent.node, agent.profile.name, self._latest_runs,
                                   self.health, self.remediation)
        self.sinks = self._sinks(self.health, self.remediation, self.report)
        self.exporter.sink_errors = self.sinks.errors
        self.report.start()
        # a check that did not load is reported once, as it stays: /metrics (gpumon_check_outcome
        # {outcome="not-loaded"}, its unknown finding), the health state and report.json
        for run in agent.not_loaded_runs():
            self._record(run)
        self._pump = KernelLogPump(lambda: agent.kernel_log_source(bounded=True), self.wake, self._checks,
                                   boot=agent.hw.fs.boot_id(), marks=agent.check_state.get(WATERMARK_STATE))
        self._background = self._start_background()
        start = time.monotonic()
        self._due = {c.name: start for c in self._checks}
        for c in canaries:
            self._due[c.name] = start + self.next_delay(agent.config.settings(type(c)).interval_s)
        self._pump.start()

    def _undo_startup(self) -> None:
        """Stop what a start-up that failed part-way had started (the pump, the machine's tasks,
        /metrics, the NVRx socket, the intake socket, the report writer, remediation, the health
        state, NVML): the process that goes on, or exits, keeps no thread, port or socket of it."""
        self.stop.set()
        self.exporter.content_changed.set()  # the render thread waits on it: it sees the stop at once
        try:
            if self._pump is not None and self._pump.thread.ident is not None:
                self._pump.close()
            for thread in self._background:
                thread.join(timeout=2.0)
            self.shutdown()
        except Exception:  # the start-up's own error is the one to report
            log.exception("while stopping a failed start-up")

    def _sinks(self, health: Health, remediation: RemediationLoop | None, report: ReportWriter) -> Sinks:
        """The daemon's sinks in their order (gpumon.daemon_sinks): the health state first
        (remediation reads the node's state from it, the exporter publishes it), the exporter
        after a site's own sinks (its snapshot counts their failures in the same run), the
        report after the exporter (report.json follows what /metrics exports)."""
        order: list[Sink] = [HealthSink(health)]
        if remediation is not None:
            continuous = {c.name for c in self._checks if c.phase is Phase.CONTINUOUS}
            order.append(RemediationSink(remediation, health, continuous))
        order += [self._changes, *self._extra_sinks, self.exporter,
                  ReportSink(report, lambda: self.snapshots.version if self.snapshots is not None else None)]
        return Sinks(order)

    @property
    def snapshots(self) -> SnapshotHolder | None:
        """What /metrics and the query API serve (the exporter sink's)."""
        return self.exporter.holder

    @snapshots.setter
    def snapshots(self, holder: SnapshotHolder | None) -> None:
        self.exporter.holder = holder

    @property
    def _exposition(self) -> CachedExposition | None:
        """The exporter sink's cached /metrics (tests set it on a daemon that never started)."""
        return self.exporter.exposition

    @_exposition.setter
    def _exposition(self, exposition: CachedExposition | None) -> None:
        self.exporter.exposition = exposition

    def _start_exporter(self) -> None:
        settings = self.agent.config.exporter
        if not settings.enabled:
            return
        web = load_web_config(Path(settings.web_config_file)) if settings.web_config_file else None
        host, port = split_listen(settings.listen)
        try:
            holder = self.snapshots or SnapshotHolder(self._snapshot())
            # the HELP of each reading: what the checks this daemon loaded declare
            readings = ReadingCatalog.of(self.agent.checks.values())
            self.exporter.exposition = exposition = CachedExposition(holder, readings)
            self._server, _ = serve_metrics(exposition, host, port, web, api=self._history_api(holder))
            threading.Thread(target=self._prerender, name="gpumon-render", daemon=True).start()
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {settings.listen}: {exc.strerror or exc}") from None
        log.info("metrics on http%s://%s:%d/metrics", "s" if web and web.tls_server_config else "",
                 host, self._server.server_port)

    def _start_nvhcd(self) -> None:
        path = self.agent.config.exporter.nvhcd_socket
        if not path:
            return
        from gpumon.export.nvhcd import NvhcdServer, NvhcdUnavailable

        try:
            self._nvhcd = NvhcdServer(path, lambda: self.health.view() if self.health is not None else None,
                                      self.agent.node)
        except (NvhcdUnavailable, OSError) as exc:
            raise StartupError(f"exporter.nvhcd_socket {path}: {exc}") from None
        log.info("NVRx node health check (nvhcd.HealthCheckService) on unix:%s", path)

    def _start_intake(self) -> None:
        """The intake socket (gpumon.intake): documents local processes hand to a check, the sender
        named by the kernel."""
        settings = self.agent.config.daemon
        if not settings.intake_socket:
            return
        path = self.agent.machine.runtime_path(Path(settings.intake_socket))
        agent = self.agent

        def handle(name: str, document: dict[str, Any], peer: Peer) -> IntakeReply:
            return dispatch(self._checks, list(agent.checks), name, document, peer,
                            agent.runner.intake_context)

        try:
            self._intake = IntakeServer(path, handle, per_uid_per_min=settings.intake_per_uid_per_min)
        except (IntakeUnavailable, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(f"daemon.intake_socket {path}: {why} (empty daemon.intake_socket: no intake; "
                               "jobs' guards then write their verdicts to the spool)") from None
        takers = [c.name for c in self._checks if c.accepts_documents()]
        log.info("intake on unix:%s for check(s): %s", path, ", ".join(takers) or "none")

    def _history_api(self, holder: SnapshotHolder) -> HistoryApi:
        """The query API (gpumon.export.api): health.db read-only per request, the current state
        and the latest runs' findings from what the exporter already holds (no hardware call)."""
        agent = self.agent
        identity = identity_of(agent.node, agent.hw.fs.boot_id(), agent.hw.fs.boot_time(), time.time())

        def findings() -> list[dict[str, Any]]:
            return [f.to_json() for run in holder.get().runs.values() for f in run.findings]

        return HistoryApi(agent.state_dir, identity,
                          lambda: self.health.view() if self.health is not None else None, findings)

    def _prerender(self) -> None:
        self.exporter.prerender(self.stop)

    def _snapshot(self) -> Snapshot:
        return self.exporter.snapshot()

    # -- main loop -------------------------------------------------------------------

    def main_loop(self, duration: float | None = None) -> None:
        """Start each check when it is due (its interval, or what the kernel log brought it) and
        idle, until stopped or ``duration`` seconds have passed."""
        pump = self._pump
        assert pump is not None, "startup() first"
        due = self._due
        # said once the signal handlers are in place (serve): "ready" means a SIGTERM now stops it
        agent = self.agent
        log.info("gpumon daemon on %s: profile %s, %d GPUs, checks: %s%s", agent.node, agent.profile.name,
                 len(agent.inventory.gpus), ", ".join(c.name for c in self._checks),
                 f"; NOT loaded: {', '.join(agent.not_loaded)}" if agent.not_loaded else "")
        sd_notify("READY=1\nSTATUS=running checks")
        start = time.monotonic()
        last_watchdog = last_sync = -math.inf
        # What the daemon made to start (modules, configuration, the checks) lives until it stops:
        # kept out of the cyclic collector, whose full passes otherwise walk all of it again and
        # again while a kernel-log storm makes tens of thousands of short-lived records a second
        # (a storm's records are in no cycle: they go by reference counting). Again once every
        # check has run (its state, its caches).
        gc.collect()
        gc.freeze()
        refrozen = False
        while not self.stop.is_set():
            now = time.monotonic()
            if duration is not None and now - start >= duration:
                break
            if not refrozen and len(self.latest) >= len(self._checks) + len(agent.not_loaded):
                refrozen = True
                gc.collect()  # nothing frozen can be collected: cycles that are garbage go first
                gc.freeze()
            if now - last_sync >= FOREIGN_S:
                last_sync = now
                self._foreign_events()
            if now - last_watchdog >= WATCHDOG_S:
                sd_notify("WATCHDOG=1")
                last_watchdog = now
                if self.health is not None:
                    self.health.tick()
            for check in self._checks:
                event_driven = pump.has_pending(check.name)
                if (now >= due[check.name] or event_driven) and self._idle(check.name):
                    interval = self.agent.config.settings(type(check)).interval_s
                    due[check.name] = now + self.next_delay(interval)
                    self._launch(check)
            soonest = min(min(due.values(), default=now + 1.0), pump.next_due() or math.inf)
            wait = soonest - time.monotonic()
            self.wake.wait(timeout=max(0.01, min(wait, 1.0)))
            self.wake.clear()

    # -- shutdown --------------------------------------------------------------------

    def _stop_checks(self) -> None:
        """Wait for running checks within the grace period, store their state and watermarks, stop
        the pump and the background tasks (still under the daemon's signal handlers)."""
        sd_notify("STOPPING=1")
        grace = self.agent.config.daemon.shutdown_grace_s
        deadline = time.monotonic() + grace
        for worker in list(self._workers.values()):
            worker.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
        for name in list(self._saved_at):
            running = self._workers.get(name)
            if running is not None and running.busy:
                continue  # still running past the grace: its state is half-written, keep the saved one
            if self.agent.check_state.save(name):
                self._store_watermark(name, save=False)
        self._store_watermark(None)
        if self._pump is not None:
            self._pump.close()
        if self._background:
            self.stop.set()
            for thread in self._background:
                thread.join(timeout=2.0)

    def shutdown(self) -> None:
        """Stop serving /metrics, write the last report.json, close remediation, the health state
        and the hardware."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._nvhcd is not None:
            self._nvhcd.stop()
        if self._intake is not None:
            self._intake.stop()
            self._intake = None
        if self.report is not None:
            self.report.close()
        if self.remediation is not None:
            self.remediation.close(timeout=30.0)
        if self.health is not None:
            self.health.close()
        self.agent.stop()

    # -- check runs --------------------------------------------------------------------

    def _idle(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is None or not worker.busy

    def _launch(self, check: Check) -> None:
        pump = self._pump

        def work() -> None:
            runs = self.agent.runner.run([check], pump)
            mark = pump.handed_mark(check.name) if pump is not None else None
            for run in runs:
                now = time.monotonic()
                if run.outcome == "completed" and mark is not None:
                    self._marks[run.check] = mark  # what this run was handed is counted in its state
                # A 1 s check (ib) changes its state every second; fsyncing that every
                # second is most of the daemon's I/O. At most every 10 s, and at exit.
                if run.outcome == "completed" and now - self._saved_at.get(run.check, 0.0) >= 10.0:
                    if self.agent.check_state.save(run.check) and check.kernel_log is not None:
                        self._store_watermark(run.check)
                    self._saved_at[run.check] = now
                self._record(run)

        worker = self._workers.get(check.name)
        if worker is None or not worker.submit(work):
            # none yet, or it ended (idle for a while, or the last run raised): a new one
            worker = self._workers[check.name] = CheckThread(f"gpumon-run-{check.name}")
            worker.submit(work)

    def _store_watermark(self, name: str | None, *, save: bool = True) -> None:
        """Store the kernel-log watermark of check ``name`` (None: none, just save): the mark of
        the last record handed to its last completed run, called once that run's state is on
        disk. The stored marks then never run ahead of the stored states: a daemon that dies
        before reads those lines again (the ring is read from its start) rather than skip them
        (the pump used to move a mark when it handed the records out, and any check's save
        stored every check's mark)."""
        with self._marks_lock:
            if name is not None and name in self._marks:
                self.agent.check_state.get(WATERMARK_STATE)[name] = dict(self._marks[name])
            if save:
                self.agent.check_state.save(WATERMARK_STATE)

    def _record(self, run: CheckRun) -> None:
        """The daemon's middle: the run is the check's newest, and goes to every sink, in order
        (gpumon.daemon_sinks), one run at a time."""
        with self._lock:
            self.latest[run.check] = run
            self.sinks.record(run)

    def _foreign_events(self) -> None:
        """Fold what another process stored (gpumon set-healthy) and tell the sinks."""
        if self.health is None or not self.health.sync():
            return
        with self._lock:
            self.sinks.health_changed()

    def _latest_runs(self) -> list[CheckRun]:
        with self._lock:
            return list(self.latest.values())

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def handle(signum: int, frame: FrameType | None) -> None:
            if self._signalled and signum == signal.SIGINT:
                self._force_exit()
            self._signalled = True
            log.info("signal %d: shutting down (a second SIGINT exits at once)", signum)
            self.stop.set()
            self.wake.set()

        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _force_exit(self) -> None:
        """A second SIGINT: exit now, without waiting for running checks (a hung NVML call can hold
        one for its whole deadline) or saving their state; the tool processes checks started are
        killed rather than left running without a parent. The health store is SQLite, whose
        committed events survive an exit at any point."""
        import psutil

        children = psutil.Process().children(recursive=True)
        log.warning("second SIGINT: exiting now (exit %d) without waiting for running checks or "
                    "saving their state%s", FORCED_EXIT,
                    f"; killing {len(children)} child processes" if children else "")
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os._exit(FORCED_EXIT)

    def _start_background(self) -> list[threading.Thread]:
        """The machine's own tasks beside the checks (a simulated node's clock), each given the
        daemon's stop event: they end with the daemon."""
        threads = []
        for name, task in self.agent.machine.background_tasks():
            thread = threading.Thread(target=task, args=(self.stop,), name=name, daemon=True)
            thread.start()
            threads.append(thread)
        return threads
