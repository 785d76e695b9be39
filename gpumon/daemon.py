"""``gpumon daemon``: continuous checks on jittered schedules, kernel log event-driven.

Startup -> main loop -> bounded shutdown (uvicorn's server shape: ``startup``, ``main_loop``,
``shutdown``), under the daemon's signal handlers from the start of startup to the end of shutdown
(restored on the way out). SIGTERM or SIGINT: a graceful stop; a second SIGINT while stopping exits
at once with :data:`FORCED_EXIT` (uvicorn's force exit). A start-up that fails part-way stops what
it had started before the error goes on. Checks that read the kernel log run
as soon as a new record arrives (``gpumon.kernel_pump``); the others run every ``interval_s`` +-
jitter. A check still running from its previous turn is not started twice; a hung one is reported
by the runner. What the daemon found goes to ``/metrics`` (``gpumon.export``), the health state
(``gpumon.health``) and ``report.json`` (``gpumon.daemon_report``); the remediation loop is woken
when the node's state changes.
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
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from gpumon import __version__
from gpumon.agent import Agent
from gpumon.check import GPU_LOST, Check
from gpumon.config import split_listen
from gpumon.daemon_report import ReportWriter
from gpumon.errors import StartupError
from gpumon.export.api import HistoryApi, identity_of
from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder
from gpumon.export.webserver import load_web_config, serve_metrics
from gpumon.health import Health, HealthView
from gpumon.kernel_pump import WATERMARK_STATE, KernelLogPump
from gpumon.model import CheckRun, Finding, Phase, Severity
from gpumon.remediate.runner import RemediationLoop
from gpumon.runner import Worker

log = logging.getLogger("gpumon.daemon")
# /metrics: the content part is re-rendered off the scrape path at once (after a second) when the
# health state or a finding's severity changed, and at most every PRERENDER_COUNTS_S when only
# counts and readings did (a storm changes an Xid count at every run). A scrape of content that
# changed since the last render renders it itself: it never sees stale figures.
PRERENDER_COUNTS_S = 10.0
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


def _health_map(view: HealthView) -> dict[str, tuple[str, str]]:
    """component -> (state, recommended action), for the exporter's snapshot."""
    health = {name: (comp.level.value, comp.action.value) for name, comp in view.components.items()}
    # last: the components map has a "node" entry for findings filed on the node
    # itself, which is not the node's overall state
    health["node"] = (view.node.level.value, view.node.action.value)
    return health


def _accepted(view: HealthView) -> frozenset[tuple[str, str]]:
    """(check, component) of the findings the health state accepted that checks still repeat."""
    return frozenset((a.check, a.component) for comp in view.components.values() for a in comp.accepted)


class Daemon:
    def __init__(self, agent: Agent, *, rng: random.Random | None = None) -> None:
        self.agent = agent
        self.rng = rng or random.Random()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.latest: dict[str, CheckRun] = {}
        self._last_severity: dict[tuple[str, str], Severity] = {}
        # component -> the checks whose latest finding says the GPU is lost, first first (see _say)
        self._lost: dict[str, dict[str, None]] = {}
        self._lock = threading.Lock()
        # per check, the thread that runs it (waits for it within its deadline) and records
        # what it found, kept between runs (see gpumon.runner.Worker)
        self._workers: dict[str, Worker] = {}
        self._saved_at: dict[str, float] = {}
        self._folded: dict[str, tuple[tuple[Any, ...], float]] = {}
        # per kernel-log check, the watermark of its last completed run (see _store_watermark)
        self._marks: dict[str, dict[str, Any]] = {}
        self._marks_lock = threading.Lock()
        # per check, the severities of its findings (what makes /metrics re-render at once)
        self._severities: dict[str, tuple[tuple[str, Severity], ...]] = {}
        self._render_now = threading.Event()
        self.remediation: RemediationLoop | None = None
        self._exposition: CachedExposition | None = None
        self._content_changed = threading.Event()
        self._check_names: set[str] = set()
        self._node_said: tuple[str, str] | None = None
        self._health_of: tuple[HealthView, Mapping[str, tuple[str, str]],
                               frozenset[tuple[str, str]]] | None = None
        self.health: Health | None = None
        self.snapshots: SnapshotHolder | None = None
        self.report: ReportWriter | None = None
        self._server: Any = None
        self._nvhcd: Any = None  # gpumon.export.nvhcd.NvhcdServer when exporter.nvhcd_socket is set
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
        # the daemon sets a corrupt health.db aside and starts afresh (gpumon.health.store)
        self.health = Health.open(agent.state_dir, boot_id=agent.hw.fs.boot_id(), recover=True)
        self.remediation = RemediationLoop.build(agent.config.remediation, self.health,
                                                 agent.config.node_name, agent.hw.tools)
        self._check_names = {c.name for c in self._checks if c.phase is Phase.CONTINUOUS}
        if self.remediation is not None:
            self.remediation.start()
        self.snapshots = SnapshotHolder(self._snapshot())
        self._start_exporter()
        self._start_nvhcd()
        self.report = ReportWriter(agent.state_dir, agent.node, agent.profile.name, self._latest_runs,
                                   self.health, self.remediation)
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
        /metrics, the NVRx socket, the report writer, remediation, the health state, NVML): the
        process that goes on, or exits, keeps no thread, port or socket of it."""
        self.stop.set()
        self._content_changed.set()  # the render thread waits on it: it sees the stop at once
        try:
            if self._pump is not None and self._pump.thread.ident is not None:
                self._pump.close()
            for thread in self._background:
                thread.join(timeout=2.0)
            self.shutdown()
        except Exception:  # the start-up's own error is the one to report
            log.exception("while stopping a failed start-up")

    def _start_exporter(self) -> None:
        settings = self.agent.config.exporter
        if not settings.enabled:
            return
        web = load_web_config(Path(settings.web_config_file)) if settings.web_config_file else None
        host, port = split_listen(settings.listen)
        try:
            holder = self.snapshots or SnapshotHolder(self._snapshot())
            self._exposition = CachedExposition(holder)
            self._server, _ = serve_metrics(self._exposition, host, port, web, api=self._history_api(holder))
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
        # Scrapes must stay fast even right after the node's state changed: render the new
        # content here instead of in the scrape that first sees it: at most once a second, and
        # at most every PRERENDER_COUNTS_S while only counts change (an Xid storm changes a count
        # at every run of xid; rendering each was a fifth of the daemon's CPU in bench/storm.py).
        # A scrape in between renders what changed itself (CachedExposition renders on a new
        # snapshot version).
        rendered, at = -1, -math.inf
        while not self.stop.is_set():
            self._content_changed.wait(5.0)
            if self.stop.wait(1.0) or self._exposition is None or self.snapshots is None:
                continue
            self._content_changed.clear()
            if self.snapshots.version == rendered:
                continue
            wait = at + PRERENDER_COUNTS_S - time.monotonic()
            if wait > 0 and not self._render_now.wait(wait) and self.stop.is_set():
                return
            self._render_now.clear()
            rendered, at = self.snapshots.version, time.monotonic()
            self._exposition.prerender()

    def _snapshot(self) -> Snapshot:
        health: Mapping[str, tuple[str, str]] = {}
        accepted: frozenset[tuple[str, str]] = frozenset()
        if self.health is not None:
            view = self.health.view()
            # the view is a new object only when the health state changed (most runs leave
            # it as it was): the same view, the same map, which the snapshot holder then
            # need not compare item by item
            if self._health_of is None or self._health_of[0] is not view:
                self._health_of = (view, _health_map(view), _accepted(view))
            health, accepted = self._health_of[1], self._health_of[2]
        runs = dict(self.latest)
        if self.health is not None:
            # a store that cannot write is a finding like any other (read-only or full state dir)
            store = self.health.store_finding()
            runs[store.check] = CheckRun(store.check, [store], time.time(), 0.0, "completed")
        return Snapshot(node=self.agent.node, profile=self.agent.profile.name, version=__version__,
                        runs=runs, health=health, accepted=accepted,
                        remediation=self.remediation.snapshot() if self.remediation else None,
                        kernel_log=self._pump.stats() if self._pump is not None else None)

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
            worker = self._workers[check.name] = Worker(f"gpumon-run-{check.name}")
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
        with self._lock:
            self.latest[run.check] = run
            changed = False
            for f in run.findings:
                key = (f.check, f.component)
                before = self._last_severity.get(key)
                if before != f.severity:
                    changed = True
                    self._last_severity[key] = f.severity
                    if before is not None or f.severity is not Severity.OK:
                        self._say(f, before)
                self._lost_by(f)
            if self.health is not None:
                # A 1 s check (ib) repeats itself every second: fold it only when what it
                # says changed, or once a minute so the store's last_seen stays fresh.
                said = tuple((f.component, f.severity, f.action, f.message) for f in run.findings)
                now_m = time.monotonic()
                last_said, last_at = self._folded.get(run.check, ((), 0.0))
                if said != last_said or run.outcome != "completed" or now_m - last_at >= 60.0:
                    self.health.record_run(run)
                    self._folded[run.check] = (said, now_m)
                if said != last_said or self.health.view() is not (self.report.view if self.report else None):
                    self._report_due()
            if self.remediation is not None and self.health is not None:
                view = self.health.view()
                node_said = (view.node.level.value, view.node.action.value)
                if self._check_names <= set(self.latest):
                    self.remediation.ready.set()
                if node_said != self._node_said:
                    self._node_said = node_said
                    self.remediation.wake.set()
            if self.snapshots is not None:
                version = self.snapshots.version
                health = self._health_of[1] if self._health_of is not None else None
                self.snapshots.set(self._snapshot())
                if self.snapshots.version != version:
                    severities = tuple((f.component, f.severity) for f in run.findings)
                    # (a new health view need not be a new health state: a standing fault's
                    # newest words are refreshed in place, a new view each time)
                    if (severities != self._severities.get(run.check)
                            or (self._health_of[1] if self._health_of is not None else None) != health):
                        self._render_now.set()  # not only counts: render at once
                    self._severities[run.check] = severities
                    self._content_changed.set()
                    self._report_due()
            if changed:
                self._report_due()

    def _say(self, f: Finding, before: Severity | None) -> None:
        """Log a change of a finding's severity: at WARNING, but a GPU's loss once (its first
        finding that says the GPU is lost, gpumon.check.GPU_LOST); the other checks' findings of
        the same loss at INFO, naming the check that reported it."""
        level, note = logging.WARNING, ""
        if f.severity is Severity.SKIPPED and before in (None, Severity.OK):
            # a check that does not apply here (no fabric probe yet, no IB) is no problem: said
            # once at INFO, its reason stays in the finding
            level = logging.INFO
        elif f.severity is Severity.FAIL and f.evidence.get(GPU_LOST) is True:
            others = [c for c in self._lost.get(f.component, {}) if c != f.check]
            if others:
                level, note = logging.INFO, f"; the loss of {f.component} was reported by {others[0]}"
        log.log(level, "%s %s: %s -> %s: %s (action %s%s)", f.check, f.component,
                before.value if before else "new", f.severity.value, f.message, f.action.value, note)

    def _lost_by(self, f: Finding) -> None:
        """Keep, per component, the checks whose latest finding says the GPU is lost, in the order
        they first said it."""
        if f.severity is Severity.FAIL and f.evidence.get(GPU_LOST) is True:
            self._lost.setdefault(f.component, {}).setdefault(f.check, None)
        elif f.component in self._lost:
            self._lost[f.component].pop(f.check, None)

    def _foreign_events(self) -> None:
        if self.health is None or not self.health.sync():
            return
        with self._lock:
            if self.remediation is not None:
                view = self.health.view()
                node_said = (view.node.level.value, view.node.action.value)
                if node_said != self._node_said:
                    self._node_said = node_said
                    self.remediation.wake.set()
            if self.snapshots is not None:
                self.snapshots.set(self._snapshot())
                self._render_now.set()
                self._content_changed.set()
            self._report_due()

    def _latest_runs(self) -> list[CheckRun]:
        with self._lock:
            return list(self.latest.values())

    def _report_due(self) -> None:
        if self.report is not None:
            self.report.due()

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
