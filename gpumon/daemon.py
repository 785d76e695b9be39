"""``gpumon daemon``: continuous checks on jittered schedules, kernel log event-driven.

Startup -> main loop -> bounded shutdown, with signal handlers restored on
the way out (uvicorn's server shape). Checks that read the kernel log run as
soon as a new record arrives; the others run every ``interval_s`` +- jitter.
A check still running from its previous turn is not started twice; a hung
one is reported by the runner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
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
from gpumon.agent import Agent, kernel_log_error
from gpumon.atomic import write_atomic
from gpumon.check import Check, KernelLog
from gpumon.config import split_listen
from gpumon.errors import HwCondition, StartupError
from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder
from gpumon.export.webserver import load_web_config, serve_metrics
from gpumon.health import Health, HealthView
from gpumon.hw.kmsg import KernelLogFollower
from gpumon.hw.nvrm import NvrmParser
from gpumon.model import Phase, Severity
from gpumon.remediate.runner import RemediationLoop
from gpumon.report import json_report
from gpumon.runner import CheckRun, Worker
from gpumon.sim.scenario import Scenario

log = logging.getLogger("gpumon.daemon")
# kept beside the checks' own state (a check may clear its state on a new boot)
WATERMARK_STATE = "kernel-log-watermarks"
# A simulated node's clock: how often it re-renders while a counter ramps, and the longest
# it sleeps otherwise (a wall clock stepped back or forth is caught up within that).
SIM_TICK_S = 0.25
SIM_MAX_SLEEP_S = 5.0
# How long a kernel-log check waits, at daemon start, for the pump's first read of the log.
_FIRST_READ_WAIT_S = 2.0
# report.json follows what /metrics exports: rewritten when that changes (or a finding's words,
# or the health state), at most once per REPORT_MIN_INTERVAL_S, at least once per
# REPORT_MAX_AGE_S (its "time" says the daemon is alive), and at exit.
REPORT_MIN_INTERVAL_S = 1.0
REPORT_MAX_AGE_S = 60.0


def sim_wait(scenario: Scenario, t: float) -> float:
    """Seconds from scenario time ``t`` to the next moment the simulated node looks different
    (``Scenario.changes_between``), found to 5 ms: SIM_TICK_S while a counter ramps, at most
    SIM_MAX_SLEEP_S. Asking every 0.25 s instead cost a healthy simulated node, where nothing
    ever changes, ~0.05 % of a core (each timed wake-up of a thread costs ~0.1 ms of CPU)."""
    if scenario.changes_between(t, t):  # only a counter ramping at t makes that true
        return SIM_TICK_S
    if not scenario.changes_between(t, t + SIM_MAX_SLEEP_S):
        return SIM_MAX_SLEEP_S
    # With nothing ramping at t, "changed by t + x" only turns true as x grows (a ramp
    # running at t + x started after t): bisect for where it does.
    lo, hi = 0.0, SIM_MAX_SLEEP_S
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        if scenario.changes_between(t, t + mid):
            hi = mid
        else:
            lo = mid
    return hi


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


def _os_error(exc: OSError) -> str:
    """An OSError in words; a full disk said as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({exc.strerror})"
    return exc.strerror or str(exc)


def _health_map(view: HealthView) -> dict[str, tuple[str, str]]:
    """component -> (state, recommended action), for the exporter's snapshot."""
    health = {name: (comp.level.value, comp.action.value) for name, comp in view.components.items()}
    # last: the components map has a "node" entry for findings filed on the node
    # itself, which is not the node's overall state
    health["node"] = (view.node.level.value, view.node.action.value)
    return health


class KernelLogPump:
    """Follows the kernel log on its own thread and hands parsed events to each subscribed check.

    Every subscriber gets every event once: two checks reading the kernel log
    (xid, nvswitch) do not steal each other's lines. A log that cannot be read (missing,
    a directory, permission denied, vanished) is handed over as unavailable with the
    reason, so those checks say ``unknown``, never ``ok``; the pump keeps trying, and a
    failure of its own thread is reported the same way instead of ending the daemon.
    """

    def __init__(self, agent: Agent, wake: threading.Event, subscribers: dict[str, tuple[str, ...]]) -> None:
        self.agent = agent
        self.wake = wake
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[list[Any], list[Any]]] = {n: ([], []) for n in subscribers}
        self.match = subscribers
        self.due: set[str] = set()
        self.records = 0
        self.error: str | None = None
        self.follower: KernelLogFollower | None = None
        # epoch seconds of this boot for records with kernel time only: fixed once known
        self.boot_anchor: float | None = None
        # set once the log has been read (or failed to be) for the first time: until then a
        # check must not be handed an empty log as if it had been read
        self.first_read = threading.Event()
        self._waited = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="gpumon-kmsg", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        parser = NvrmParser()
        while not self.stop.is_set():
            try:
                self._turn(parser)
            except Exception as exc:  # the pump outlives any one failure
                log.exception("kernel-log reader failed")
                self.error = f"kernel-log reader failed: {type(exc).__name__}: {exc}"
                self.first_read.set()
                if self.follower is not None:
                    self.follower.close()
                    self.follower = None
                parser = NvrmParser()
                self.stop.wait(1.0)

    def _turn(self, parser: NvrmParser) -> None:
        path = self.agent.kmsg_path
        if self.follower is None:
            try:
                self.follower = self.agent.open_kernel_log()
            except (OSError, HwCondition) as exc:
                self.error = f"cannot open {path}: {exc}"
                self.first_read.set()
                self.stop.wait(5.0)
                return
        follower = self.follower
        records = follower.wait(1.0) if self.first_read.is_set() else follower.read_available()
        failed = follower.last_error
        if failed is not None:
            if self.error is None:
                log.warning("kernel log unreadable: %s", kernel_log_error(path, failed))
            self.error = kernel_log_error(path, failed)
        elif self.error is not None:
            log.info("kernel log %s readable again", path)
            self.error = None
        anchor = follower.boot_anchor
        if records and anchor is not None and (self.boot_anchor is None or anchor < self.boot_anchor):
            # fixed once known; moved only earlier, when the follower found a record that it
            # would otherwise date in the future
            self.boot_anchor = anchor
        events: list[Any] = []
        for rec in records:
            events.extend(parser.feed(rec))
        events.extend(parser.flush())
        woken = False
        with self.lock:
            self.records += len(records)
            for name, (queued_events, queued_records) in self.pending.items():
                queued_events.extend(events)
                queued_records.extend(records)
                words = self.match[name]
                if records and (not words or any(w in r.text for r in records for w in words)):
                    self.due.add(name)
                    woken = True
        self.first_read.set()
        if woken:
            self.wake.set()

    def take(self, name: str) -> KernelLog:
        # the first read is one non-blocking pass over what the log holds: normally milliseconds;
        # waited for once (this runs on the daemon's main loop), not at every take
        waited, self._waited = self._waited, True
        if not self.first_read.wait(0.0 if waited else _FIRST_READ_WAIT_S):
            return KernelLog(available=False, source=str(self.agent.kmsg_path),
                             error=f"{self.agent.kmsg_path} not read yet (still reading it after "
                                   f"{_FIRST_READ_WAIT_S:g} s)")
        with self.lock:
            events, records = self.pending.get(name, ([], []))
            self.pending[name] = ([], [])
            self.due.discard(name)
            total = self.records
        lost = self.follower.lost_records if self.follower is not None else 0
        error = self.error
        if error is None and self.thread.ident is not None and not self.thread.is_alive() \
                and not self.stop.is_set():
            error = "the kernel-log reader thread has stopped"
        if error is not None and not records:
            return KernelLog(available=False, error=error, source=str(self.agent.kmsg_path))
        events, records = self._after_watermark(name, events, records)
        return KernelLog(events=events, records=records, available=True,
                         source=str(self.agent.kmsg_path), records_read=total, lost_records=lost,
                         boot_time=self.boot_anchor)

    def _after_watermark(self, name: str, events: list[Any],
                         records: list[Any]) -> tuple[list[Any], list[Any]]:
        """Drop what this check already saw before a daemon restart.

        A restarted daemon reads the kernel ring from its start again, while the
        check's persisted state already counts those lines. The watermark (kernel
        sequence number, else kernel time) of the last record handed to each check
        is kept in that check's state, boot by boot.
        """
        marks = self.agent.check_state.get(WATERMARK_STATE)
        boot = self.agent.hw.fs.boot_id()
        mark = marks.get(name)
        if not isinstance(mark, dict) or mark.get("boot") != boot:
            mark = {"boot": boot, "seq": None, "us": None}

        def seen(rec: Any) -> bool:
            if rec.seq is not None and mark["seq"] is not None:
                return bool(rec.seq <= mark["seq"])
            if rec.monotonic_us is not None and mark["us"] is not None:
                return bool(rec.monotonic_us <= mark["us"])
            return False

        fresh = [r for r in records if not seen(r)]
        if len(fresh) != len(records):
            kept = {id(r) for r in fresh}
            events = [e for e in events if getattr(e, "record", None) is None or id(e.record) in kept]
        for r in fresh:
            if r.seq is not None:
                mark["seq"] = r.seq
            if r.monotonic_us is not None:
                mark["us"] = r.monotonic_us
        marks[name] = mark
        return events, fresh

    def has_pending(self, name: str) -> bool:
        """A record this check cares about has arrived since its last run."""
        with self.lock:
            return name in self.due

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2.0)
        if self.follower is not None and not self.thread.is_alive():
            self.follower.close()


class Daemon:
    def __init__(self, agent: Agent, *, rng: random.Random | None = None) -> None:
        self.agent = agent
        self.rng = rng or random.Random()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.latest: dict[str, CheckRun] = {}
        self._last_severity: dict[tuple[str, str], Severity] = {}
        self._lock = threading.Lock()
        # per check, the thread that runs it (waits for it within its deadline) and records
        # what it found, kept between runs (see gpumon.runner.Worker)
        self._workers: dict[str, Worker] = {}
        self._saved_at: dict[str, float] = {}
        self._report_at = 0.0
        self._report_due = threading.Event()
        self._report_stop = threading.Event()
        self._report_lock = threading.Lock()
        self._report_view: HealthView | None = None
        self._report_error: str | None = None
        self._folded: dict[str, tuple[tuple[Any, ...], float]] = {}
        self.remediation: RemediationLoop | None = None
        self._exposition: CachedExposition | None = None
        self._content_changed = threading.Event()
        self._check_names: set[str] = set()
        self._node_said: tuple[str, str] | None = None
        self._health_of: tuple[HealthView, Mapping[str, tuple[str, str]]] | None = None
        self.health: Health | None = None
        self.snapshots: SnapshotHolder | None = None
        self._server: Any = None

    def next_delay(self, interval: float) -> float:
        j = self.agent.config.daemon.jitter
        return float(interval * (1.0 + self.rng.uniform(-j, j)))

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def handle(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: shutting down", signum)
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

    def _start_exporter(self) -> None:
        settings = self.agent.config.exporter
        if not settings.enabled:
            return
        web = load_web_config(Path(settings.web_config_file)) if settings.web_config_file else None
        host, port = split_listen(settings.listen)
        try:
            holder = self.snapshots or SnapshotHolder(self._snapshot())
            self._exposition = CachedExposition(holder)
            self._server, _ = serve_metrics(self._exposition, host, port, web)
            threading.Thread(target=self._prerender, name="gpumon-render", daemon=True).start()
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {settings.listen}: {exc.strerror or exc}") from None
        log.info("metrics on http%s://%s:%d/metrics", "s" if web and web.tls_server_config else "",
                 host, self._server.server_port)

    def _prerender(self) -> None:
        # Scrapes must stay fast even right after the node's state changed: render the new
        # content here, at most once a second, instead of in the scrape that first sees it.
        rendered = -1
        while not self.stop.is_set():
            self._content_changed.wait(5.0)
            self._content_changed.clear()
            if self.stop.wait(1.0) or self._exposition is None or self.snapshots is None:
                continue
            if self.snapshots.version != rendered:
                rendered = self.snapshots.version
                self._exposition.prerender()

    def _snapshot(self) -> Snapshot:
        health: Mapping[str, tuple[str, str]] = {}
        if self.health is not None:
            view = self.health.view()
            # the view is a new object only when the health state changed (most runs leave
            # it as it was): the same view, the same map, which the snapshot holder then
            # need not compare item by item
            if self._health_of is None or self._health_of[0] is not view:
                self._health_of = (view, _health_map(view))
            health = self._health_of[1]
        runs = dict(self.latest)
        if self.health is not None:
            # a store that cannot write is a finding like any other (read-only or full state dir)
            store = self.health.store_finding()
            runs[store.check] = CheckRun(store.check, [store], time.time(), 0.0, "completed")
        return Snapshot(node=self.agent.node, profile=self.agent.profile.name, version=__version__,
                        runs=runs, health=health,
                        remediation=self.remediation.snapshot() if self.remediation else None)

    def serve(self, duration: float | None = None) -> int:
        # SDC canaries run in the daemon too, on their own (long) interval, never at startup:
        # a daemon restart must not start a heavy run on GPUs that may be busy
        canaries = self.agent.selected(Phase.CANARY)
        checks = self.agent.selected(Phase.CONTINUOUS) + canaries
        # the daemon sets a corrupt health.db aside and starts afresh (gpumon.health.store)
        self.health = Health.open(self.agent.state_dir, boot_id=self.agent.hw.fs.boot_id(), recover=True)
        self.remediation = RemediationLoop.build(self.agent.config.remediation, self.health,
                                                 self.agent.config.node_name, self.agent.hw.tools)
        self._check_names = {c.name for c in checks if c.phase is Phase.CONTINUOUS}
        if self.remediation is not None:
            self.remediation.start()
        self.snapshots = SnapshotHolder(self._snapshot())
        self._start_exporter()
        reporter = threading.Thread(target=self._report_loop, name="gpumon-report", daemon=True)
        reporter.start()
        pump = KernelLogPump(self.agent, self.wake,
                             {c.name: c.kernel_log_match for c in checks if c.uses_kernel_log})
        sim_thread = self._start_simulation_clock()
        start = time.monotonic()
        due = {c.name: start for c in checks}
        for c in canaries:
            due[c.name] = start + self.next_delay(self.agent.config.settings(type(c)).interval_s)
        with self._signals():
            pump.start()
            log.info("gpumon daemon on %s: profile %s, %d GPUs, checks: %s", self.agent.node,
                     self.agent.profile.name, len(self.agent.inventory.gpus),
                     ", ".join(c.name for c in checks))
            sd_notify("READY=1\nSTATUS=running checks")
            last_watchdog = 0.0
            while not self.stop.is_set():
                now = time.monotonic()
                if duration is not None and now - start >= duration:
                    break
                if now - last_watchdog >= 5.0:
                    sd_notify("WATCHDOG=1")
                    last_watchdog = now
                    if self.health is not None:
                        self.health.tick()
                for check in checks:
                    event_driven = check.uses_kernel_log and pump.has_pending(check.name)
                    if (now >= due[check.name] or event_driven) and self._idle(check.name):
                        interval = self.agent.config.settings(type(check)).interval_s
                        due[check.name] = now + self.next_delay(interval)
                        klog = pump.take(check.name) if check.uses_kernel_log else None
                        self._launch(check, klog)
                wait = min(due.values(), default=now + 1.0) - time.monotonic()
                self.wake.wait(timeout=max(0.01, min(wait, 1.0)))
                self.wake.clear()
            sd_notify("STOPPING=1")
            grace = self.agent.config.daemon.shutdown_grace_s
            deadline = time.monotonic() + grace
            for worker in list(self._workers.values()):
                worker.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            for name in (*self._saved_at, WATERMARK_STATE):
                self.agent.check_state.save(name)
            pump.close()
            if sim_thread is not None:
                self.stop.set()
                sim_thread.join(timeout=2.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._report_stop.set()
        self._report_due.set()
        reporter.join(timeout=10.0)
        self._write_report()
        if self.remediation is not None:
            self.remediation.close(timeout=30.0)
        if self.health is not None:
            self.health.close()
        self.agent.stop()
        return 0

    def _idle(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is None or not worker.busy

    def _launch(self, check: Check, klog: KernelLog | None) -> None:
        def work() -> None:
            for run in self.agent.runner.run([check], klog):
                now = time.monotonic()
                # A 1 s check (ib) changes its state every second; fsyncing that every
                # second is most of the daemon's I/O. At most every 10 s, and at exit.
                if run.outcome == "completed" and now - self._saved_at.get(run.check, 0.0) >= 10.0:
                    self.agent.check_state.save(run.check)
                    if check.uses_kernel_log:
                        self.agent.check_state.save(WATERMARK_STATE)
                    self._saved_at[run.check] = now
                self._record(run)

        worker = self._workers.get(check.name)
        if worker is None or not worker.submit(work):
            # none yet, or it ended (idle for a while, or the last run raised): a new one
            worker = self._workers[check.name] = Worker(f"gpumon-run-{check.name}")
            worker.submit(work)

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
                        log.warning("%s %s: %s -> %s: %s (action %s)", f.check, f.component,
                                    before.value if before else "new", f.severity.value, f.message,
                                    f.action.value)
            if self.health is not None:
                # A 1 s check (ib) repeats itself every second: fold it only when what it
                # says changed, or once a minute so the store's last_seen stays fresh.
                said = tuple((f.component, f.severity, f.action, f.message) for f in run.findings)
                now_m = time.monotonic()
                last_said, last_at = self._folded.get(run.check, ((), 0.0))
                if said != last_said or run.outcome != "completed" or now_m - last_at >= 60.0:
                    self.health.record_run(run)
                    self._folded[run.check] = (said, now_m)
                if said != last_said or self.health.view() is not self._report_view:
                    self._report_due.set()
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
                self.snapshots.set(self._snapshot())
                if self.snapshots.version != version:
                    self._content_changed.set()
                    self._report_due.set()
            if changed:
                self._report_due.set()

    def _report_loop(self) -> None:
        """Writes report.json on its own thread (see REPORT_MIN_INTERVAL_S), so that a slow
        disk never holds up a check run."""
        while not self._report_stop.is_set():
            self._report_due.wait(timeout=REPORT_MAX_AGE_S)
            wait = self._report_at + REPORT_MIN_INTERVAL_S - time.monotonic()
            if self._report_stop.is_set() or (wait > 0 and self._report_stop.wait(wait)):
                return  # the last one is written at exit
            self._report_due.clear()
            try:
                self._write_report()
            except Exception:  # the reporter outlives any one failure
                log.exception("writing report.json failed")

    def _write_report(self) -> None:
        """report.json, atomically (a reader sees the old file or the new one; a failed write
        leaves no temporary file)."""
        with self._report_lock:
            self._report_at = time.monotonic()
            self._write_report_now()

    def _write_report_now(self) -> None:
        state_dir = self.agent.state_dir
        extra: dict[str, Any] = {}
        with self._lock:
            latest = list(self.latest.values())
        if self.health is not None:
            view = self.health.view()
            self._report_view = view
            if self.remediation is not None and self.remediation.last is not None:
                extra["remediation"] = self.remediation.last.to_json()
            extra["health"] = {"node": view.node.to_json(),
                               "components": {n: c.to_json() for n, c in view.components.items()
                                              if c.level.value != "healthy"}}
            store = self.health.store_finding()
            runs = [*latest, CheckRun(store.check, [store], time.time(), 0.0, "completed")]
        else:
            runs = latest
        doc = json_report(runs, node=self.agent.node, profile=self.agent.profile.name, extra=extra)
        try:
            write_atomic(state_dir / "report.json", json.dumps(doc, indent=2))
        except OSError as exc:
            why = f"cannot write {state_dir / 'report.json'}: {_os_error(exc)}"
            if why != self._report_error:
                log.warning("%s (tried again at the next change, at least once a minute)", why)
            self._report_error = why
            return
        if self._report_error is not None:
            log.info("%s written again", state_dir / "report.json")
        self._report_error = None

    def _start_simulation_clock(self) -> threading.Thread | None:
        sim = self.agent.simulation
        if sim is None:
            return None

        def tick() -> None:
            wait = sim_wait(sim.scenario, time.time() - sim.node.start_wall)
            while not self.stop.wait(wait):
                t = time.time() - sim.node.start_wall
                sim.advance(t)
                wait = sim_wait(sim.scenario, t)

        t = threading.Thread(target=tick, name="gpumon-sim-clock", daemon=True)
        t.start()
        return t
