"""SQLite event store for the health state, and ``Health``: the fold in memory, its events on disk.

One writer (the daemon) and any number of readers (``gpumon status``, the
exporter) share ``<state_dir>/health.db``:

- **WAL** so readers never block the writer, and a **busy timeout** so the
  rare second writer (``gpumon set-healthy`` while the daemon runs) waits
  instead of failing.
- **Durable before ``append`` returns**: every append is one transaction with
  ``synchronous=FULL``. NORMAL would survive a kill -9 but not a power cut, and
  a node that dies right after an Xid 79 is exactly the node whose last events
  matter. Writes are rare (only changes are stored), so the fsync is cheap.
- **Bounded without a manual VACUUM**: ``compact()`` folds events older than the
  retention (default 30 days), or beyond ``max_events``, into one snapshot row
  and deletes them; ``auto_vacuum=INCREMENTAL`` + ``incremental_vacuum`` give the
  pages back, and a WAL checkpoint truncates the log. Folding instead of just
  deleting is what keeps retention from forgetting a fault that is still open
  (an unrepaired Xid 79 from 31 days ago must not turn into "healthy").
- **A store that cannot be written** (read-only or full disk, a path that is not
  a file): ``append`` raises ``StoreError`` and keeps the events in a bounded
  queue, written first by the next append that succeeds. ``Health`` goes on with
  the in-memory state and reports the fault as a ``health_store`` finding.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gpumon.errors import GpumonError
from gpumon.health.state import (
    Event,
    EventKind,
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
from gpumon.model import NODE, Action, Finding, Severity, is_component

if TYPE_CHECKING:
    from gpumon.runner import CheckRun

log = logging.getLogger("gpumon.health")

DB_NAME = "health.db"
SCHEMA_VERSION = 1
# the check name of the finding that reports the store itself
STORE_CHECK = "health_store"
DAY_S = 86400.0
DEFAULT_RETENTION_DAYS = 30.0
# Transitions only are stored, so a healthy node writes a few rows a day; this
# cap bounds a flapping one (~500 B a row: ~100 MB).
DEFAULT_MAX_EVENTS = 200_000
# Events kept in memory while the store cannot be written; past this the
# oldest are dropped (and counted): the in-memory state has them anyway.
DEFAULT_MAX_PENDING = 10_000
_SQLITE_FULL = 13

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: readers follow ids
    time REAL NOT NULL,
    boot_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    component TEXT NOT NULL,
    check_name TEXT NOT NULL,
    payload TEXT NOT NULL,
    last_seen REAL
);
CREATE INDEX IF NOT EXISTS events_time ON events (time);
CREATE TABLE IF NOT EXISTS snapshot (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    upto_id INTEGER NOT NULL,  -- the state after every event with id <= upto_id
    time REAL NOT NULL,
    payload TEXT NOT NULL
);
"""


class StoreError(GpumonError):
    """The health store cannot be opened, read or written.

    ``full``: the disk (or the ``max_bytes`` cap) is full; ``pending``: events
    kept in memory to be written later; ``dropped``: events lost from that queue.
    """

    def __init__(self, message: str, *, path: Path, full: bool = False, pending: int = 0,
                 dropped: int = 0) -> None:
        self.path = path
        self.reason = message
        self.full = full
        self.pending = pending
        self.dropped = dropped
        super().__init__(f"health store {path}: {message}")


@dataclass(frozen=True)
class Appended:
    foreign: list[Event]  # written by another process since ``after_id``: fold them first
    flushed: list[Event]  # queued earlier, written now
    stored: list[Event]  # the events just appended, with their ids


@dataclass(frozen=True)
class Loaded:
    snapshot: Mapping[str, Any] | None
    upto_id: int  # ids <= this are in the snapshot
    events: list[Event]


class EventStore:
    """Append-only SQLite log of health events (plus one snapshot row)."""

    def __init__(self, path: Path | str, *, readonly: bool = False, busy_timeout_s: float = 5.0,
                 max_bytes: int | None = None, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.busy_timeout_s = busy_timeout_s
        self.max_bytes = max_bytes
        self._pending: deque[Event] = deque()
        self.max_pending = max_pending
        self.dropped = 0
        self._conn: sqlite3.Connection | None = None

    # -- connection -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        try:
            if self.readonly:
                if not self.path.is_file():
                    raise StoreError("no health store here (has the daemon run?)", path=self.path)
                conn = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True,
                                       timeout=self.busy_timeout_s, isolation_level=None,
                                       check_same_thread=False)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s,
                                       isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as exc:
            raise self._error(exc) from exc
        try:
            if not self.readonly:
                # must come before the first table exists to take effect
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
                if mode is None or str(mode[0]).lower() != "wal":
                    raise sqlite3.OperationalError(f"cannot use WAL (journal mode {mode})")
                conn.execute("PRAGMA synchronous=FULL")
                if self.max_bytes is not None:
                    page = int(conn.execute("PRAGMA page_size").fetchone()[0])
                    conn.execute(f"PRAGMA max_page_count={max(16, self.max_bytes // page)}")
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                if version == 0:
                    # one transaction; IF NOT EXISTS makes a race with a second opener harmless
                    conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA
                                       + f"PRAGMA user_version={SCHEMA_VERSION};COMMIT;")
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version != SCHEMA_VERSION:
                raise StoreError(f"schema version {version}, this gpumon reads {SCHEMA_VERSION}",
                                 path=self.path)
        except StoreError:
            conn.close()
            raise
        except (sqlite3.Error, OSError) as exc:
            conn.close()
            raise self._error(exc) from exc
        self._conn = conn
        return conn

    def _error(self, exc: BaseException) -> StoreError:
        code = getattr(exc, "sqlite_errorcode", None)
        full = code == _SQLITE_FULL or "full" in str(exc).lower()
        return StoreError(str(exc) or type(exc).__name__, path=self.path, full=full,
                          pending=len(self._pending), dropped=self.dropped)

    def _reset(self) -> None:
        """Forget the connection: the next call opens afresh (the directory may be back)."""
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._reset()

    @property
    def pending(self) -> list[Event]:
        """Events appended while the store could not be written, oldest first."""
        return list(self._pending)

    # -- writing ----------------------------------------------------------------------------

    def append(self, event: Event) -> Event:
        """Store one event; committed (fsync'd) when this returns. Raises ``StoreError``."""
        return self.append_many([event]).stored[0]

    def append_many(self, events: Sequence[Event], *, after_id: int | None = None) -> Appended:
        """Store queued events, then ``events``, in one transaction.

        With ``after_id``, also returns the events another writer stored after
        that id (read inside the same write transaction, so none slips between).
        On failure every event is queued (bounded) and ``StoreError`` raised.
        """
        if self.readonly:
            raise StoreError("opened read-only", path=self.path)
        todo = [*self._pending, *events]
        if not todo:
            return Appended([], [], [])
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            foreign = self._read(conn, after_id) if after_id is not None else []
            written: list[Event] = []
            for e in todo:
                cur = conn.execute(
                    "INSERT INTO events (time, boot_id, kind, component, check_name, payload, last_seen)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (_real(e.time), e.boot_id, e.kind.value, e.component, e.check,
                     json.dumps(dict(e.payload), separators=(",", ":"), default=str, allow_nan=False),
                     None if e.last_seen is None else _real(e.last_seen)))
                written.append(replace(e, id=cur.lastrowid))
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._reset()
            self._queue(events)
            raise self._error(exc) from exc
        except StoreError as exc:
            self._queue(events)
            raise StoreError(exc.reason, path=self.path, full=exc.full, pending=len(self._pending),
                             dropped=self.dropped) from exc
        n_old = len(self._pending)
        self._pending.clear()
        return Appended(foreign, written[:n_old], written[n_old:])

    def _queue(self, events: Iterable[Event]) -> None:
        self._pending.extend(events)
        over = len(self._pending) - self.max_pending
        for _ in range(max(0, over)):
            self._pending.popleft()
            self.dropped += 1
        if over > 0:
            log.error("health store %s: %d events dropped while it cannot be written", self.path,
                      self.dropped)

    def flush(self, *, after_id: int | None = None) -> Appended:
        """Write the queued events, if any."""
        return self.append_many([], after_id=after_id)

    def touch(self, last_seen: Mapping[int, float]) -> None:
        """Refresh ``last_seen`` of stored events (a finding seen again), in one transaction."""
        if not last_seen or self.readonly:
            return
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("UPDATE events SET last_seen = max(coalesce(last_seen, time), ?) WHERE id = ?",
                             [(_real(t), i) for i, t in last_seen.items()])
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc

    # -- reading ----------------------------------------------------------------------------

    def _read(self, conn: sqlite3.Connection, after_id: int, upto_id: int | None = None) -> list[Event]:
        sql = ("SELECT id, time, boot_id, kind, component, check_name, payload, last_seen FROM events"
               " WHERE id > ?")
        args: tuple[int, ...] = (after_id,)
        if upto_id is not None:
            sql += " AND id <= ?"
            args = (after_id, upto_id)
        out: list[Event] = []
        for row in conn.execute(sql + " ORDER BY id", args):
            event = _decode(row)
            if event is not None:
                out.append(event)
        return out

    def load(self, *, upto_id: int | None = None) -> Loaded:
        """The snapshot and the events after it (up to ``upto_id``), read consistently."""
        try:
            conn = self._connect()
            conn.execute("BEGIN")
            row = conn.execute("SELECT upto_id, payload FROM snapshot WHERE id = 1").fetchone()
            snap = None if row is None else json.loads(row[1])
            base = 0 if row is None else int(row[0])
            events = self._read(conn, base, upto_id)
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._reset()
            raise self._error(exc) from exc
        return Loaded(snap, base, events)

    def events(self, after_id: int = 0) -> list[Event]:
        try:
            return self._read(self._connect(), after_id)
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc

    def max_id(self) -> int:
        """The highest id ever given (AUTOINCREMENT keeps it after deletes)."""
        try:
            row = self._connect().execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc
        return 0 if row is None else int(row[0])

    def count(self) -> int:
        try:
            return int(self._connect().execute("SELECT count(*) FROM events").fetchone()[0])
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc

    def size_bytes(self) -> int:
        """The database, its WAL and shared-memory files together."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            p = self.path.with_name(self.path.name + suffix)
            if p.is_file():
                total += p.stat().st_size
        return total

    # -- compaction -------------------------------------------------------------------------

    def compaction_point(self, before: float, max_events: int | None) -> int | None:
        """The last id to fold away: events older than ``before``, and all but the newest
        ``max_events``. None when there is nothing to do."""
        try:
            conn = self._connect()
            row = conn.execute("SELECT max(id) FROM events WHERE time < ?", (_real(before),)).fetchone()
            upto = None if row is None or row[0] is None else int(row[0])
            if max_events is not None:
                row = conn.execute("SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?",
                                   (max(0, max_events),)).fetchone()
                if row is not None:
                    upto = max(upto or 0, int(row[0]))
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc
        return upto

    def compact(self, upto_id: int, snapshot: Mapping[str, Any], *, time: float) -> int:
        """Replace every event with id <= ``upto_id`` by ``snapshot`` (the state after them),
        then give the freed pages back. Returns the number of events deleted."""
        if self.readonly:
            raise StoreError("opened read-only", path=self.path)
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            # delete first: on a full store the snapshot row reuses the freed pages
            deleted = conn.execute("DELETE FROM events WHERE id <= ?", (upto_id,)).rowcount
            conn.execute("INSERT OR REPLACE INTO snapshot (id, upto_id, time, payload) VALUES (1, ?, ?, ?)",
                         (upto_id, _real(time), json.dumps(dict(snapshot), separators=(",", ":"))))
            conn.execute("COMMIT")
            # Outside the transaction: free pages go back to the file system, and the
            # checkpoint moves them into the main file and truncates the WAL.
            # executescript steps the pragma to the end: execute() frees one page per step
            conn.executescript("PRAGMA incremental_vacuum;")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._reset()
            raise self._error(exc) from exc
        return int(deleted)


def _real(value: float) -> float:
    # SQLite stores NaN as NULL: a clock that says NaN must not break a NOT NULL column
    return value if math.isfinite(value) else 0.0


def _decode(row: tuple[Any, ...]) -> Event | None:
    ident, t, boot_id, kind, component, check, payload, last_seen = row
    try:
        data = json.loads(payload)
        event_kind = EventKind(kind)
    except ValueError as exc:
        # a row from a newer gpumon, or damaged: skip it and say so, do not stop reading
        log.warning("health event %s skipped: %s", ident, exc)
        return None
    return Event(float(t), event_kind, str(component), str(check), str(boot_id),
                 data if isinstance(data, dict) else {}, int(ident),
                 None if last_seen is None else float(last_seen))


def _state_from(loaded: Loaded, policy: HealthPolicy | None, path: Path) -> HealthState:
    try:
        state = (HealthState(policy) if loaded.snapshot is None
                 else HealthState.from_snapshot(loaded.snapshot, policy))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        # refuse rather than start healthy: a lost snapshot may hold open faults
        raise StoreError(f"snapshot unreadable ({type(exc).__name__}: {exc})", path=path) from exc
    for event in loaded.events:
        state.apply(event)
    return state


class Health:
    """The daemon's health state: folded in memory, every event stored first.

    Thread-safe: check runs finish on their own threads, the exporter reads
    ``view()`` from its own. Use ``Health.open``.
    """

    def __init__(self, store: EventStore, *, boot_id: str | None, clock: Callable[[], float] = time.time,
                 policy: HealthPolicy | None = None, retention_days: float = DEFAULT_RETENTION_DAYS,
                 max_events: int | None = DEFAULT_MAX_EVENTS, touch_interval_s: float = 60.0,
                 compact_interval_s: float = 3600.0) -> None:
        self.store = store
        self.boot_id = boot_id or ""
        self.clock = clock
        self.policy = policy or HealthPolicy()
        self.retention_s = retention_days * DAY_S
        self.max_events = max_events
        self.touch_interval_s = touch_interval_s
        self.compact_interval_s = compact_interval_s
        self.state = HealthState(self.policy)
        # what readers get: replaced (one reference assignment) after every change, so a
        # scrape never waits for the lock while a check's events are being fsync'd
        self._published = self.state.view()
        self._lock = threading.RLock()
        self._loaded = False
        self._last_id = 0
        self._error: StoreError | None = None
        self._touches: dict[int, float] = {}
        now = clock()
        self._touched_at = now
        self._compacted_at = now

    @classmethod
    def open(cls, state_dir: Path | str, *, boot_id: str | None, clock: Callable[[], float] = time.time,
             policy: HealthPolicy | None = None, retention_days: float = DEFAULT_RETENTION_DAYS,
             max_events: int | None = DEFAULT_MAX_EVENTS, max_bytes: int | None = None,
             max_pending: int = DEFAULT_MAX_PENDING) -> Health:
        """Load the state from ``<state_dir>/health.db`` and record the boot if it is new.

        Never raises for a store it cannot use: the state then starts empty in
        memory, ``error`` says why, and the store is retried on every write.
        """
        store = EventStore(Path(state_dir) / DB_NAME, max_bytes=max_bytes, max_pending=max_pending)
        health = cls(store, boot_id=boot_id, clock=clock, policy=policy, retention_days=retention_days,
                     max_events=max_events)
        with health._lock:
            health._reload()
            if health.boot_id and health.boot_id != health.state.boot_id:
                health._write([_boot_event(health.boot_id, time=clock(), previous=health.state.boot_id)])
            health._publish()
        return health

    # -- plumbing ---------------------------------------------------------------------------

    def _reload(self) -> bool:
        try:
            loaded = self.store.load()
            state = _state_from(loaded, self.policy, self.store.path)
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
        """Append; when the store is full, fold old events away once and write the queue."""
        try:
            # before the state is loaded there is nothing to catch up with: it is reloaded whole
            result = self.store.append_many(events, after_id=self._last_id if self._loaded else None)
            return result, result.stored
        except StoreError as exc:
            if not exc.full:
                raise
        # ``events`` are queued now: make room, then write the queue (ours are its tail)
        try:
            self._compact(self.clock())
        except StoreError as exc:
            log.warning("compaction to make room failed: %s", exc)
        result = self.store.flush(after_id=self._last_id if self._loaded else None)
        return result, result.flushed[len(result.flushed) - len(events):] if events else []

    def _write(self, events: Sequence[Event]) -> StoreError | None:
        try:
            result, fresh = self._append(events)
        except StoreError as exc:
            if self._error is None or self._error.reason != exc.reason:
                log.error("%s: keeping the health state in memory (%d events queued)", exc,
                          len(self.store.pending))
            self._error = exc
            for event in events:
                self.state.apply(event)
            return exc
        if self._error is not None:
            log.warning("health store %s writable again: %d queued events written", self.store.path,
                        len(result.flushed))
        self._error = None
        if not self._loaded:
            self._reload()  # the store was unreadable at start: it has everything now
            return None
        for event in (*result.foreign, *fresh):
            self.state.apply(event)
        self._last_id = max([self._last_id, *(e.id or 0 for e in (*result.foreign, *result.flushed,
                                                                   *result.stored))])
        return None

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
        old = _state_from(self.store.load(upto_id=upto), self.policy, self.store.path)
        deleted = self.store.compact(upto, old.to_snapshot(), time=now)
        log.info("health store %s: %d events older than %g days folded into the snapshot",
                 self.store.path, deleted, self.retention_s / DAY_S)
        return deleted

    def _flush_touches(self, now: float, *, force: bool = False) -> None:
        if not self._touches or (not force and now - self._touched_at < self.touch_interval_s):
            return
        try:
            self.store.touch(self._touches)
        except StoreError:
            return  # kept for the next try
        self._touches.clear()
        self._touched_at = now

    def _record(self, check: str, findings: Sequence[Finding], *, complete: bool, now: float) -> list[Event]:
        obs = self.state.observe(check, findings, complete=complete, time=now, boot_id=self.boot_id)
        if obs.events:
            self._write(obs.events)
        for fid in obs.seen:
            ident = self.state.touch(fid, now)
            if ident is not None:
                self._touches[ident] = now
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
        """The store's own health, as a finding (warn while events are only in memory)."""
        error = self._error
        path = str(self.store.path)
        if error is None and not self.store.pending:
            return Finding(STORE_CHECK, NODE, Severity.OK, f"health store {path} writable", Action.NONE,
                           {"path": path})
        # the message stays the same while the fault does (counts go in the evidence),
        # so a failing store adds one event, not one per run
        reason = error.reason if error is not None else "events queued"
        return Finding(STORE_CHECK, NODE, Severity.WARN,
                       f"cannot write the health store {path} ({reason}); health state kept in memory",
                       Action.NONE, {"path": path, "pending": len(self.store.pending),
                                     "dropped": self.store.dropped})


def load_view(state_dir: Path | str, *, policy: HealthPolicy | None = None) -> HealthView:
    """The state as the daemon stored it, for ``gpumon status`` (read-only; raises ``StoreError``)."""
    store = EventStore(Path(state_dir) / DB_NAME, readonly=True)
    try:
        return _state_from(store.load(), policy, store.path).view()
    finally:
        store.close()
