"""``Health``: the daemon's health state, folded in memory, every event stored first (``store``).

A store that cannot be written, is full or is corrupt does not stop it: the state goes on in memory
and the store's fault is the ``health_store`` finding (``store_finding``); with ``recover`` (the
daemon) a corrupt store is set aside and a fresh one started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon.health.state import (
    Event,
    HealthPolicy,
    HealthState,
    HealthView,
    remediation_event,
    retest_passed_event,
    set_healthy_event,
)
from gpumon.health.state import boot_event as _boot_event
from gpumon.health.state import quarantine_event as _quarantine_event
from gpumon.health.state import release_event as _release_event
from gpumon.health.store import DB_NAME, Appended, EventStore, finite_time, state_from
from gpumon.health.store_file import DEFAULT_MAX_PENDING, StoreError
from gpumon.model import NODE, Action, Finding, Severity, is_component

if TYPE_CHECKING:
    from gpumon.model import CheckRun

log = logging.getLogger("gpumon.health")

# the check name of the finding that reports the store itself
STORE_CHECK = "health_store"
DAY_S = 86400.0
DEFAULT_RETENTION_DAYS = 30.0
# Transitions only are stored, so a healthy node writes a few rows a day; this
# cap bounds a flapping one (~500 B a row: ~100 MB).
DEFAULT_MAX_EVENTS = 200_000
# How long the health_store finding warns after a corrupt store was replaced.
REPLACED_WARN_S = DAY_S
# Message refreshes (same severity and action, new words) reach the file within this;
# last_seen alone within Health.touch_interval_s.
REFRESH_INTERVAL_S = 10.0


class Health:
    """The daemon's health state: folded in memory, every event stored first.

    Thread-safe: check runs finish on their own threads, the exporter reads
    ``view()`` from its own. Use ``Health.open``.
    """

    def __init__(self, store: EventStore, *, boot_id: str | None, clock: Callable[[], float] = time.time,
                 policy: HealthPolicy | None = None, retention_days: float = DEFAULT_RETENTION_DAYS,
                 max_events: int | None = DEFAULT_MAX_EVENTS, touch_interval_s: float = 60.0,
                 compact_interval_s: float = 3600.0, refresh_interval_s: float = REFRESH_INTERVAL_S,
                 recover: bool = False) -> None:
        self.store = store
        self.boot_id = boot_id or ""
        self.clock = clock
        self.policy = policy or HealthPolicy()
        self.retention_s = retention_days * DAY_S
        self.max_events = max_events
        self.touch_interval_s = touch_interval_s
        self.compact_interval_s = compact_interval_s
        self.refresh_interval_s = refresh_interval_s
        # set a corrupt store aside and start afresh (the daemon; not the CLI, which must not
        # swap the file under a running daemon)
        self.recover = recover
        self.state = HealthState(self.policy)
        # what readers get: replaced (one reference assignment) after every change, so a
        # scrape never waits for the lock while a check's events are being fsync'd
        self._published = self.state.view()
        self._lock = threading.RLock()
        self._loaded = False
        self._last_id = 0
        self._error: StoreError | None = None
        self._touches: dict[int, float] = {}
        # event id -> the newest words of the finding behind it ({time, message, evidence})
        self._latest: dict[int, dict[str, Any]] = {}
        self._words_changed = False  # a message in _latest changed: written within refresh_interval_s
        # a corrupt store set aside: {moved_to, reason, at}; the health_store finding warns a day
        self._replaced: dict[str, Any] | None = None
        self._replacing = False
        self._room_at: float | None = None  # last compaction to make room in a full store
        now = clock()
        self._touched_at = now
        self._compacted_at = now

    @classmethod
    def open(cls, state_dir: Path | str, *, boot_id: str | None, clock: Callable[[], float] = time.time,
             policy: HealthPolicy | None = None, retention_days: float = DEFAULT_RETENTION_DAYS,
             max_events: int | None = DEFAULT_MAX_EVENTS, max_bytes: int | None = None,
             max_pending: int = DEFAULT_MAX_PENDING, recover: bool = False) -> Health:
        """Load the state from ``<state_dir>/health.db`` and record the boot if it is new.

        Never raises for a store it cannot use: the state then starts empty in
        memory, ``error`` says why (logged at once), and the store is retried on
        every write. With ``recover`` (the daemon), the file is first checked
        (SQLite quick_check), and a corrupt one is set aside as
        ``health.db.corrupt-<UTC time>`` with its -wal/-shm and a fresh store
        started: logged at once, and a ``health_store`` warning for a day.
        """
        store = EventStore(Path(state_dir) / DB_NAME, max_bytes=max_bytes, max_pending=max_pending)
        health = cls(store, boot_id=boot_id, clock=clock, policy=policy, retention_days=retention_days,
                     max_events=max_events, recover=recover)
        with health._lock:
            if not health._reload(check=recover):
                error = health._error
                if error is not None and not (recover and error.corrupt and health._replace(error)):
                    log.error("%s: keeping the health state in memory until the store can be read "
                              "(gpumon status cannot show it meanwhile)", error)
            if health._replaced is None:
                # replaced by an earlier run less than a day ago: its warning goes on
                fault = health.state.fault((STORE_CHECK, NODE, ""))
                replaced = fault.evidence.get("replaced") if fault is not None else None
                if isinstance(replaced, Mapping) and isinstance(replaced.get("at"), (int, float)):
                    health._replaced = dict(replaced)
            if health.boot_id and health.boot_id != health.state.boot_id:
                health._write([_boot_event(health.boot_id, time=clock(), previous=health.state.boot_id)])
            if health._replaced is not None:
                health._record(STORE_CHECK, [health.store_finding()], complete=True, now=clock())
            health._publish()
        return health

    # -- plumbing ---------------------------------------------------------------------------

    def _reload(self, *, check: bool = False) -> bool:
        try:
            if check:
                self.store.quick_check()
            loaded = self.store.load()
            state = state_from(loaded, self.policy, self.store.path)
        except StoreError as exc:
            self._error = exc
            return False
        # what this process has not managed to store yet comes after what is stored
        for event in self.store.pending:
            state.apply(event)
        self.state = state
        self._last_id = max([loaded.upto_id, *(e.id or 0 for e in loaded.events)])
        self._loaded = True
        return True

    def _sync(self) -> None:
        """Fold what another process (``gpumon set-healthy``) stored since we last looked."""
        if not self._loaded:
            self._reload()
            return
        try:
            if self.store.max_id() <= self._last_id:
                return
            foreign = self.store.events(self._last_id)
        except StoreError:
            return  # the write that follows reports it
        for event in foreign:
            self.state.apply(event)
            self._last_id = max(self._last_id, event.id or 0)

    def _append(self, events: Sequence[Event]) -> tuple[Appended, list[Event]]:
        """Append; when the store is full, fold old events away (at most once a minute: on a
        full disk each try fails and costs a fold of the whole store) and write the queue."""
        try:
            # before the state is loaded there is nothing to catch up with: it is reloaded whole
            result = self.store.append_many(events, after_id=self._last_id if self._loaded else None)
            return result, result.stored
        except StoreError as exc:
            if not exc.full:
                raise
            full = exc
        # ``events`` are queued now: make room, then write the queue (ours are its tail)
        now = self.clock()
        if self._room_at is not None and 0 <= now - self._room_at < 60.0:
            raise full
        self._room_at = now
        try:
            self._compact(now)
        except StoreError as exc:
            if self._error is None:
                log.warning("compaction to make room failed: %s", exc)
        result = self.store.flush(after_id=self._last_id if self._loaded else None)
        return result, result.flushed[len(result.flushed) - len(events):] if events else []

    def _write(self, events: Sequence[Event]) -> StoreError | None:
        try:
            result, fresh = self._append(events)
        except StoreError as exc:
            for event in events:
                self.state.apply(event)
            if exc.corrupt and self.recover and self._replace(exc):
                return self._error
            if self._error is None or self._error.reason != exc.reason:
                log.error("%s: keeping the health state in memory (%d events queued)", exc,
                          len(self.store.pending))
            self._error = exc
            return exc
        if self._error is not None:
            log.warning("health store %s writable again: %d queued events written", self.store.path,
                        len(result.flushed))
        self._error = None
        self._room_at = None
        if not self._loaded:
            self._reload()  # the store was unreadable at start: it has everything now
            return None
        for event in (*result.foreign, *fresh):
            self.state.apply(event)
        self._last_id = max([self._last_id, *(e.id or 0 for e in (*result.foreign, *result.flushed,
                                                                   *result.stored))])
        return None

    def _replace(self, exc: StoreError) -> bool:
        """The store is corrupt: set it aside (forensics) and start a fresh one from the state in
        memory. False when that failed too (the caller reports ``exc`` as usual)."""
        if self._replacing:
            return False
        self._replacing = True
        try:
            now = self.clock()
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(finite_time(now)))
            try:
                moved = self.store.set_aside(stamp)
            except StoreError as err:
                log.error("%s (%s)", err, exc.reason)
                return False
            self._replaced = {"moved_to": str(moved), "reason": exc.reason, "at": now}
            log.error("health store %s is corrupt (%s): moved aside to %s (with its -wal/-shm, for "
                      "forensics); a fresh store starts now%s", self.store.path, exc.reason, moved,
                      " from the state in memory" if self._loaded
                      else ": the health state stored before is lost")
            self._touches.clear()
            self._latest.clear()
            self._error = None
            if self._loaded:
                # the state in memory has every event, the queued ones too: it is the fresh
                # store's snapshot (fault event ids named rows of the old file)
                snap = self.state.to_snapshot()
                for fault in snap["faults"]:
                    fault["event_id"] = None
                snap["last_event_id"] = None
                self.store.drop_pending()
                try:
                    self.store.compact(0, snap, time=now)
                except StoreError as err:
                    self._error = err
                    log.error("%s: keeping the health state in memory", err)
                    return True
                self._last_id = 0
            self._reload()
            self._write([])  # what was queued for the old file (a failure is reported as usual)
            return True
        finally:
            self._replacing = False

    def _emit(self, event: Event) -> Event:
        with self._lock:
            self._sync()
            error = self._write([event])
            self._publish()
            if error is not None:
                raise error
            return event

    def _compact(self, now: float) -> int:
        self._compacted_at = now
        self._flush_touches(now, force=True)
        upto = self.store.compaction_point(now - self.retention_s, self.max_events)
        if upto is None:
            return 0
        old = state_from(self.store.load(upto_id=upto), self.policy, self.store.path)
        deleted = self.store.compact(upto, old.to_snapshot(), time=now)
        log.info("health store %s: %d events older than %g days folded into the snapshot",
                 self.store.path, deleted, self.retention_s / DAY_S)
        return deleted

    def _flush_touches(self, now: float, *, force: bool = False) -> None:
        """Write ``last_seen`` refreshes every ``touch_interval_s``, new words of a standing fault
        within ``refresh_interval_s`` (so ``gpumon status`` says what the exporter says), all
        at ``force``."""
        if not self._touches and not self._latest:
            return
        waited = now - self._touched_at
        if not force and waited < self.touch_interval_s and not (
                self._words_changed and waited >= self.refresh_interval_s):
            return
        try:
            self.store.touch(self._touches, self._latest)
        except StoreError:
            return  # kept for the next try
        self._touches.clear()
        self._latest.clear()
        self._words_changed = False
        self._touched_at = now

    def _record(self, check: str, findings: Sequence[Finding], *, complete: bool, now: float) -> list[Event]:
        obs = self.state.observe(check, findings, complete=complete, time=now, boot_id=self.boot_id)
        if obs.events:
            self._write(obs.events)
        for fid in obs.seen:
            before = self.state.fault(fid)
            ident = self.state.touch(fid, now, obs.words.get(fid))
            after = self.state.fault(fid)
            if ident is None or before is None or after is None:
                continue
            self._touches[ident] = now
            if after.message != before.message or after.evidence != before.evidence:
                self._latest[ident] = {"time": now, "message": after.message,
                                       "evidence": dict(after.evidence)}
                self._words_changed = self._words_changed or after.message != before.message
        return obs.events

    # -- the daemon's calls -----------------------------------------------------------------

    def record_run(self, run: CheckRun) -> list[Event]:
        """Fold one check run into the state; returns the events it added.

        Never raises for the store: a store fault becomes the ``health_store``
        finding (and is folded into the state like any other finding).
        """
        return self.record_findings(run.check, run.findings, complete=run.outcome == "completed")

    def record_findings(self, check: str, findings: Sequence[Finding], *, complete: bool) -> list[Event]:
        """``record_run`` for findings that did not come from the runner (bootstrap, canary)."""
        with self._lock:
            now = self.clock()
            self._sync()
            events = self._record(check, findings, complete=complete, now=now)
            events += self._record(STORE_CHECK, [self.store_finding()], complete=True, now=now)
            self._flush_touches(now)
            self._publish()
            return events

    def sync(self) -> bool:
        """Fold what another process (``gpumon set-healthy``) stored since we last looked; True
        when there was something (the view is then new)."""
        with self._lock:
            before = (self._loaded, self._last_id)
            self._sync()
            if (self._loaded, self._last_id) == before:
                return False
            self._publish()
            return True

    def tick(self) -> None:
        """Housekeeping, cheap to call every loop: retry a failed store, write ``last_seen``
        refreshes, compact once per ``compact_interval_s``."""
        with self._lock:
            now = self.clock()
            if self._error is not None or self.store.pending:
                self._sync()
                self._write([])
                self._record(STORE_CHECK, [self.store_finding()], complete=True, now=now)
            self._flush_touches(now)
            if now - self._compacted_at >= self.compact_interval_s:
                try:
                    self._compact(now)
                except StoreError as exc:
                    log.warning("compaction failed: %s", exc)
            self._publish()

    def compact(self) -> int:
        """Fold events older than the retention (or beyond ``max_events``) into the snapshot."""
        with self._lock:
            return self._compact(self.clock())

    def flush(self) -> None:
        """Write queued events and ``last_seen`` refreshes now. Raises ``StoreError``."""
        with self._lock:
            error = self._write([])
            self._publish()
            if error is not None:
                raise error
            self._flush_touches(self.clock(), force=True)

    def close(self) -> None:
        with self._lock:
            try:
                self.flush()
            except StoreError as exc:
                log.error("closing with %d health events not stored: %s", len(self.store.pending), exc)
            self.store.close()

    # -- remediation and operator calls (raise StoreError if the event is only in memory) ---

    def retest_passed(self, component: str = NODE, *, check: str = "", by: str = "",
                      detail: str = "") -> Event:
        """A retest passed: the bootstrap suite (``component`` node, ``check`` empty) or one check's."""
        return self._emit(retest_passed_event(component, time=self.clock(), boot_id=self.boot_id,
                                              check=check, by=by, detail=detail))

    def remediation(self, action: Action, component: str = NODE, *, by: str, detail: str = "") -> Event:
        """A remedy was carried out (a GPU reset: ``Action.RESET_GPU`` on ``gpu/N``)."""
        return self._emit(remediation_event(action, component, time=self.clock(), boot_id=self.boot_id,
                                            by=by, detail=detail))

    def set_healthy(self, component: str = NODE, *, who: str, reason: str) -> Event:
        """Operator override: close every fault of ``component`` (all of them for ``node``)."""
        if not is_component(component):
            raise ValueError(f"not a component name: {component!r}")
        if not reason.strip():
            raise ValueError("set-healthy needs a reason")
        return self._emit(set_healthy_event(component, time=self.clock(), boot_id=self.boot_id, who=who,
                                            reason=reason))

    def quarantine(self, *, by: str, reason: str, action: Action = Action.NONE) -> Event:
        return self._emit(_quarantine_event(time=self.clock(), boot_id=self.boot_id, by=by, reason=reason,
                                            action=action))

    def release(self, *, by: str, reason: str) -> Event:
        return self._emit(_release_event(time=self.clock(), boot_id=self.boot_id, by=by, reason=reason))

    # -- reading ----------------------------------------------------------------------------

    def view(self) -> HealthView:
        """The current state, immutable; takes no lock and does no work (scrapes call it)."""
        return self._published

    def _publish(self) -> None:
        self._published = self.state.view()

    @property
    def error(self) -> StoreError | None:
        return self._error

    def store_finding(self) -> Finding:
        """The store's own health, as a finding: warn while events are only in memory, and for
        ``REPLACED_WARN_S`` after a corrupt store was set aside (the state stored before it may
        have held open faults that are now forgotten)."""
        error = self._error
        path = str(self.store.path)
        replaced = self._replaced
        if replaced is not None and not 0 <= self.clock() - float(replaced["at"]) < REPLACED_WARN_S:
            replaced = None
        evidence: dict[str, Any] = {"path": path}
        if replaced is not None:
            evidence["replaced"] = dict(replaced)
        if error is None and not self.store.pending:
            if replaced is None:
                return Finding(STORE_CHECK, NODE, Severity.OK, f"health store {path} writable", Action.NONE,
                               evidence)
            at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(finite_time(float(replaced["at"]))))
            return Finding(STORE_CHECK, NODE, Severity.WARN,
                           f"health store {path} was corrupt ({replaced['reason']}) and was moved aside "
                           f"to {replaced['moved_to']} at {at}; a fresh store started then, so faults "
                           "recorded before it are forgotten (re-run the bootstrap suite to re-test the "
                           "node)", Action.NONE, evidence)
        # the message stays the same while the fault does (counts go in the evidence),
        # so a failing store adds one event, not one per run
        reason = error.reason if error is not None else "events queued"
        return Finding(STORE_CHECK, NODE, Severity.WARN,
                       f"cannot write the health store {path} ({reason}); health state kept in memory",
                       Action.NONE, {**evidence, "pending": len(self.store.pending),
                                     "dropped": self.store.dropped})
