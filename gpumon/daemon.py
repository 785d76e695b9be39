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
import math
import os
import random
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
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
# A check that reads the kernel log runs for what the log brings at most once per
# KERNEL_LOG_GAP_S (a storm would otherwise run it at every turn of the pump, ~5 times a
# second), unless a batch holds a key it has not seen for KERNEL_LOG_NEW_KEY_S (an Xid code on a
# GPU, an uncorrectable error on a device): that runs it at once, so a new fault is still seen
# within one poll of the log.
KERNEL_LOG_GAP_S = 0.5
KERNEL_LOG_NEW_KEY_S = 60.0
# What the pump keeps for one check between two of its runs, at most (events, records): beyond
# that the oldest go, counted in the check's lost_records (a check stuck until its timeout in a
# storm). 20,000 Xid events with their records are ~12 MB.
KERNEL_LOG_QUEUE_MAX = 20_000
# /metrics: the content part is re-rendered off the scrape path at once (after a second) when the
# health state or a finding's severity changed, and at most every PRERENDER_COUNTS_S when only
# counts and readings did (a storm changes an Xid count at every run). A scrape of content that
# changed since the last render renders it itself: it never sees stale figures.
PRERENDER_COUNTS_S = 10.0


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


def _last_stamps(records: Sequence[Any]) -> tuple[int | None, int | None]:
    """The sequence number and the kernel time of the last records that have one."""
    seq = next((r.seq for r in reversed(records) if r.seq is not None), None)
    us = next((r.monotonic_us for r in reversed(records) if r.monotonic_us is not None), None)
    return seq, us


def _event_key(event: Any) -> Hashable:
    """What makes an NVRM event new to a check: its kind, device and code (an Xid 79 on a GPU)."""
    return (type(event).__name__, getattr(event, "pci", None), getattr(event, "code", None))


class _Feed:
    """What the pump keeps for one check between its runs: only what the check reads
    (``Check.kernel_log_events`` / ``kernel_log_records`` / ``kernel_log_fold``)."""

    def __init__(self, check: Check, mark: Mapping[str, Any] | None, cap: int) -> None:
        self.types = check.kernel_log_events
        self.want_records = check.kernel_log_records
        self.words = check.kernel_log_match
        self.fold = check.kernel_log_fold()
        self.events: deque[Any] = deque(maxlen=cap)
        self.records: deque[Any] = deque(maxlen=cap)
        self.dropped = 0
        seq = mark.get("seq") if mark else None
        us = mark.get("us") if mark else None
        # the last record handled for this check (queued, folded, or of no interest to it), by
        # kernel sequence number, else kernel time; at the start, the last one that a completed
        # run counted before the daemon restarted
        self.seq: int | None = seq if isinstance(seq, int) else None
        self.us: int | None = us if isinstance(us, int) else None
        # when the log is (re)opened it is read from its start again (the ring after a restart,
        # a new follower after a failure of the pump, a replaced file that repeats the old lines):
        # what is at or before this floor is not handed over again; set from the mark at each
        # opening, gone once a record beyond it arrives
        self.floor_seq: int | None = None
        self.floor_us: int | None = None
        self.due_at: float | None = None  # monotonic time from which it is to run
        self.last_take = -math.inf
        self.keys: dict[Hashable, float] = {}  # key -> when it was last seen (monotonic)

    def seen(self, rec: Any) -> bool:
        """Handed over already, before the log was (re)opened: at or before the floor."""
        seq = rec.seq
        if seq is not None and self.floor_seq is not None:
            if seq <= self.floor_seq:
                return True
        else:
            us = rec.monotonic_us
            if us is None or self.floor_us is None:
                return False  # nothing to compare it with
            if us <= self.floor_us:
                return True
        # beyond it: the log is read in order, so what follows is new too
        self.floor_seq = self.floor_us = None
        return False

    def push(self, queue: deque[Any], items: Sequence[Any], *, counts: bool = True) -> None:
        over = len(queue) + len(items) - (queue.maxlen or 0)
        if over > 0 and counts:
            self.dropped += over
        queue.extend(items)

    def schedule(self, keys: Sequence[Hashable], now: float) -> bool:
        """Something this check reads arrived: when is it to run? True if that is sooner than
        it was going to."""
        fresh = False
        for key in keys:
            last = self.keys.get(key)
            self.keys[key] = now
            if last is None or now - last > KERNEL_LOG_NEW_KEY_S:
                fresh = True
        if len(self.keys) > 4096:  # keys come from the log: bounded
            self.keys = {k: t for k, t in self.keys.items() if now - t <= KERNEL_LOG_NEW_KEY_S}
        at = now if fresh else max(now, self.last_take + KERNEL_LOG_GAP_S)
        if self.due_at is None or at < self.due_at:
            self.due_at = at
            return True
        return False


class KernelLogPump:
    """Follows the kernel log on its own thread and hands each subscribed check what it reads.

    Every subscriber gets what it declared (``Check.kernel_log_events``, ``kernel_log_records``,
    ``kernel_log_fold``; see gpumon.check), once: two checks reading the kernel log (xid,
    nvswitch) do not steal each other's lines, and a check keeps nothing it does not read until
    its next run (nvswitch, run every 60 s, kept every record of a storm). A check runs for what
    it reads at most every KERNEL_LOG_GAP_S, at once for a key it has not seen lately.

    A log that cannot be read (missing, a directory, permission denied, vanished) is handed
    over as unavailable with the reason, so those checks say ``unknown``, never ``ok``; the pump
    keeps trying, and a failure of its own thread is reported the same way instead of ending
    the daemon.

    Watermarks: ``take`` also returns the mark of the last record handled for the check (what it
    hands over includes everything of interest up to it). The daemon stores it beside the
    check's state once a run that used it has completed and that state is saved, never before,
    so a daemon that dies mid-run reads those lines again rather than skipping them; a new pump
    drops what is at or before the stored mark.
    """

    def __init__(self, agent: Agent, wake: threading.Event, subscribers: Sequence[Check], *,
                 queue_max: int = KERNEL_LOG_QUEUE_MAX) -> None:
        self.agent = agent
        self.wake = wake
        self.lock = threading.Lock()
        self.boot = agent.hw.fs.boot_id()
        marks = agent.check_state.get(WATERMARK_STATE)
        self.feeds: dict[str, _Feed] = {}
        for check in subscribers:
            mark = marks.get(check.name)
            if not isinstance(mark, dict) or mark.get("boot") != self.boot:
                mark = None
            self.feeds[check.name] = _Feed(check, mark, queue_max)
        self.records = 0
        self.error: str | None = None
        self.follower: KernelLogFollower | None = None
        # epoch seconds of this boot for records with kernel time only: fixed once known
        self.boot_anchor: float | None = None
        # set once the log has been read (or failed to be) for the first time: until then a
        # check must not be handed an empty log as if it had been read
        self.first_read = threading.Event()
        self._waited = False
        self._opens = 0  # openings of the log by the follower, as last seen
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
                self.follower = self.agent.open_kernel_log(bounded=True)
                self._opens = 0
            except (OSError, HwCondition) as exc:
                self.error = f"cannot open {path}: {exc}"
                self.first_read.set()
                self.stop.wait(5.0)
                return
        follower = self.follower
        records = follower.wait(1.0) if self.first_read.is_set() else follower.read_available()
        if follower.opens != self._opens:
            # (re)opened: read from its start again, what each check was handed is dropped
            self._opens = follower.opens
            with self.lock:
                for feed in self.feeds.values():
                    feed.floor_seq, feed.floor_us = feed.seq, feed.us
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
        if records or events:
            dating = KernelLog(boot_time=self.boot_anchor)
            wall, now = time.time(), time.monotonic()
            last_seq, last_us = _last_stamps(records)
            with self.lock:
                self.records += len(records)
                for feed in self.feeds.values():
                    woken = self._hand(feed, records, events, dating, wall, now, last_seq, last_us) or woken
        self.first_read.set()
        if woken:
            self.wake.set()

    def _hand(self, feed: _Feed, records: list[Any], events: list[Any], dating: KernelLog, wall: float,
              now: float, last_seq: int | None, last_us: int | None) -> bool:
        """One turn's records and events for one check (under the lock); True: it is due sooner."""
        if feed.floor_seq is not None or feed.floor_us is not None:
            fresh = [r for r in records if not feed.seen(r)]
            if len(fresh) != len(records):
                kept = {id(r) for r in fresh}
                events = [e for e in events if getattr(e, "record", None) is None or id(e.record) in kept]
                records = fresh
                last_seq, last_us = _last_stamps(records)
        keys: list[Hashable] = []
        relevant = False
        if feed.types is None:
            mine = events
        else:
            mine = [e for e in events if isinstance(e, feed.types)] if feed.types else []
        if mine:
            keys.extend(_event_key(e) for e in mine)
            feed.push(feed.events, mine, counts=not feed.want_records)
            # a check that reads every record runs for the records it matches (below)
            relevant = feed.types is not None or not feed.want_records
        if feed.want_records and records:
            feed.push(feed.records, records)
            words = feed.words
            if not words or any(w in r.text for r in records for w in words):
                relevant = True
        if feed.fold is not None:
            for rec in records:
                said = feed.fold.add(rec, dating.time_of(rec, wall))
                if said:
                    keys.extend(said)
                    relevant = True
        if last_seq is not None:
            feed.seq = last_seq
        if last_us is not None:
            feed.us = last_us
        return relevant and feed.schedule(keys, now)

    def take(self, name: str) -> tuple[KernelLog, dict[str, Any] | None]:
        """What the check ``name`` reads of the log since its last take, and the watermark to
        store once a run that used it has completed (None: nothing to store)."""
        # the first read is one non-blocking pass over what the log holds: normally milliseconds;
        # waited for once (this runs on the daemon's main loop), not at every take
        waited, self._waited = self._waited, True
        source = str(self.agent.kmsg_path)
        if not self.first_read.wait(0.0 if waited else _FIRST_READ_WAIT_S):
            return KernelLog(available=False, source=source,
                             error=f"{self.agent.kmsg_path} not read yet (still reading it after "
                                   f"{_FIRST_READ_WAIT_S:g} s)"), None
        feed = self.feeds.get(name)
        if feed is None:
            return KernelLog(available=False, source=source, error="not subscribed to the kernel log"), None
        with self.lock:
            events, records = list(feed.events), list(feed.records)
            feed.events.clear()
            feed.records.clear()
            folded = feed.fold.take() if feed.fold is not None else None
            mark = {"boot": self.boot, "seq": feed.seq, "us": feed.us}
            feed.due_at = None
            feed.last_take = time.monotonic()
            dropped = feed.dropped
            total = self.records
        lost = (self.follower.lost_records if self.follower is not None else 0) + dropped
        error = self.error
        if error is None and self.thread.ident is not None and not self.thread.is_alive() \
                and not self.stop.is_set():
            error = "the kernel-log reader thread has stopped"
        if error is not None and not (events or records or folded is not None):
            return KernelLog(available=False, error=error, source=source), mark
        return KernelLog(events=events, records=records, available=True, source=source,
                         records_read=total, lost_records=lost, boot_time=self.boot_anchor,
                         folded=folded), mark

    def has_pending(self, name: str) -> bool:
        """Something this check reads has arrived since its last run, and it is time to run it."""
        with self.lock:
            feed = self.feeds.get(name)
            return feed is not None and feed.due_at is not None and feed.due_at <= time.monotonic()

    def next_due(self) -> float | None:
        """The soonest monotonic time at which a check that waits out KERNEL_LOG_GAP_S is due."""
        now = time.monotonic()
        with self.lock:
            return min((f.due_at for f in self.feeds.values() if f.due_at is not None and f.due_at > now),
                       default=None)

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
        pump = KernelLogPump(self.agent, self.wake, [c for c in checks if c.uses_kernel_log])
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
                        klog, mark = pump.take(check.name) if check.uses_kernel_log else (None, None)
                        self._launch(check, klog, mark)
                soonest = min(min(due.values(), default=now + 1.0), pump.next_due() or math.inf)
                wait = soonest - time.monotonic()
                self.wake.wait(timeout=max(0.01, min(wait, 1.0)))
                self.wake.clear()
            sd_notify("STOPPING=1")
            grace = self.agent.config.daemon.shutdown_grace_s
            deadline = time.monotonic() + grace
            for worker in list(self._workers.values()):
                worker.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            for name in list(self._saved_at):
                if self.agent.check_state.save(name):
                    self._store_watermark(name, save=False)
            self._store_watermark(None)
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

    def _launch(self, check: Check, klog: KernelLog | None, mark: dict[str, Any] | None = None) -> None:
        def work() -> None:
            for run in self.agent.runner.run([check], klog):
                now = time.monotonic()
                if run.outcome == "completed" and mark is not None:
                    self._marks[run.check] = mark  # what this run was handed is counted in its state
                # A 1 s check (ib) changes its state every second; fsyncing that every
                # second is most of the daemon's I/O. At most every 10 s, and at exit.
                if run.outcome == "completed" and now - self._saved_at.get(run.check, 0.0) >= 10.0:
                    if self.agent.check_state.save(run.check) and check.uses_kernel_log:
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
