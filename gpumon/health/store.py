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
  the in-memory state and reports the fault as a ``health_store`` finding. A full
  disk is said as such (SQLITE_FULL, ENOSPC, or an I/O error with the file
  system out of space), not as "disk I/O error".
- **A corrupt store** (not a database, a truncated file, a malformed page): the
  daemon (``Health.open(recover=True)``) logs it at once, moves the file and its
  -wal/-shm aside as ``health.db.corrupt-<UTC time>`` for forensics, starts a
  fresh store (from the state in memory, if it had one) and reports the
  replacement as a ``health_store`` warning for a day.
- **Refreshes, not rows**: a finding that repeats a fault's severity and action
  refreshes the stored event's ``last_seen`` and ``latest`` (its newest message
  and evidence) in place, in batches; the ``latest`` column was added after
  schema version 1 and is added to older files when the daemon opens them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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
    from gpumon.model import CheckRun

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
# How long the health_store finding warns after a corrupt store was replaced.
REPLACED_WARN_S = DAY_S
# Message refreshes (same severity and action, new words) reach the file within this;
# last_seen alone within Health.touch_interval_s.
REFRESH_INTERVAL_S = 10.0
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_IOERR = 10
_SQLITE_NOTADB = 26
# An I/O error with less free space than this on the store's file system is a full disk
# (SQLite says "disk I/O error" when it cannot create or grow the -shm file).
_LOW_SPACE_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: readers follow ids
    time REAL NOT NULL,
    boot_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    component TEXT NOT NULL,
    check_name TEXT NOT NULL,
    payload TEXT NOT NULL,
    last_seen REAL,
    latest TEXT  -- JSON {time, message, evidence}: the newest words of a repeated finding
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

    ``full``: the disk (or the ``max_bytes`` cap) is full; ``corrupt``: the file is
    not a usable SQLite database (``Health.open(recover=True)`` sets it aside);
    ``pending``: events kept in memory to be written later; ``dropped``: events
    lost from that queue.
    """

    def __init__(self, message: str, *, path: Path, full: bool = False, pending: int = 0,
                 dropped: int = 0, corrupt: bool = False) -> None:
        self.path = path
        self.reason = message
        self.full = full
        self.corrupt = corrupt
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
        self._has_latest = True  # the events table has the ``latest`` column

    # -- connection -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        try:
            if self.readonly:
                if not self.path.is_file():
                    raise StoreError("no health store here (has the daemon run?)", path=self.path)
                try:
                    conn = self._connect_ro(immutable=False)
                except (sqlite3.Error, OSError) as exc:
                    if not (self._error(exc).full and self._wal_empty()):
                        raise
                    # A reader of a WAL file needs its -shm, which a full disk cannot hold. With no
                    # WAL content (the writer is gone and checkpointed all) the main file is the
                    # whole store: read it as a file that cannot change.
                    log.warning("health store %s: %s; reading it without its write-ahead log "
                                "(it has none)", self.path, self._error(exc).reason)
                    conn = self._connect_ro(immutable=True)
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
            self._has_latest = self._columns(conn)
            if not self._has_latest and not self.readonly:
                # a file from before the column: added in place (older gpumon versions name
                # their columns, so they still read and write the file)
                conn.execute("BEGIN IMMEDIATE")
                if not self._columns(conn):
                    conn.execute("ALTER TABLE events ADD COLUMN latest TEXT")
                conn.execute("COMMIT")
                self._has_latest = True
        except StoreError:
            conn.close()
            raise
        except (sqlite3.Error, OSError) as exc:
            conn.close()
            raise self._error(exc) from exc
        self._conn = conn
        return conn

    def _connect_ro(self, *, immutable: bool) -> sqlite3.Connection:
        uri = f"file:{quote(str(self.path))}?mode=ro" + ("&immutable=1" if immutable else "")
        conn = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        try:
            # the first read opens the file for real (and its -wal/-shm): fail here, not later
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except BaseException:
            conn.close()
            raise
        return conn

    def _wal_empty(self) -> bool:
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            return wal.stat().st_size == 0
        except FileNotFoundError:
            return True
        except OSError:
            return False

    @staticmethod
    def _columns(conn: sqlite3.Connection) -> bool:
        """Whether the events table has the ``latest`` column."""
        return any(row[1] == "latest" for row in conn.execute("PRAGMA table_info(events)"))

    def _free_bytes(self) -> int | None:
        """Space left for this process on the store's file system (root may use the reserve)."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return None
        blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
        return int(blocks * st.f_frsize)

    def _error(self, exc: BaseException) -> StoreError:
        """A StoreError that says what happened in words: "disk full" (SQLITE_FULL, ENOSPC/EDQUOT,
        or an I/O error on a file system with no space left), "store full" (the ``max_bytes``
        cap), "corrupt" (not a database, malformed)."""
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        text = str(exc) or type(exc).__name__
        os_errno = exc.errno if isinstance(exc, OSError) else None
        corrupt = primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
        full = primary == _SQLITE_FULL or os_errno in (errno.ENOSPC, errno.EDQUOT)
        free = self._free_bytes() if full or primary == _SQLITE_IOERR or os_errno == errno.EIO else None
        if not full and free is not None and free < _LOW_SPACE_BYTES:
            full = True  # SQLite's "disk I/O error" when the -shm or -wal cannot grow
        if full:
            if free is not None and free >= _LOW_SPACE_BYTES and self.max_bytes is not None:
                message = f"store full: the max_bytes cap of {self.max_bytes} bytes is reached ({text})"
            else:
                left = "" if free is None else f", {free} bytes free"
                message = f"disk full: no space left on the file system of {self.path.parent}{left} ({text})"
        elif corrupt:
            message = f"corrupt: {text}"
        else:
            message = text
        return StoreError(message, path=self.path, full=full, corrupt=corrupt, pending=len(self._pending),
                          dropped=self.dropped)

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
            raise StoreError(exc.reason, path=self.path, full=exc.full, corrupt=exc.corrupt,
                             pending=len(self._pending), dropped=self.dropped) from exc
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

    def drop_pending(self) -> None:
        """Forget the queued events (they are in a snapshot written instead)."""
        self._pending.clear()

    def touch(self, last_seen: Mapping[int, float], latest: Mapping[int, Mapping[str, Any]] | None = None
              ) -> None:
        """Refresh ``last_seen`` of stored events (a finding seen again) and, for those in ``latest``,
        what the finding said then (``{"time", "message", "evidence"}``), in one transaction."""
        latest = latest or {}
        if (not last_seen and not latest) or self.readonly:
            return
        try:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("UPDATE events SET last_seen = max(coalesce(last_seen, time), ?) WHERE id = ?",
                             [(_real(t), i) for i, t in last_seen.items()])
            conn.executemany("UPDATE events SET latest = ? WHERE id = ?",
                             [(json.dumps(dict(words), separators=(",", ":"), default=str,
                                          allow_nan=False), i) for i, words in latest.items()])
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._reset()
            raise self._error(exc) from exc

    # -- reading ----------------------------------------------------------------------------

    def _read(self, conn: sqlite3.Connection, after_id: int, upto_id: int | None = None) -> list[Event]:
        latest = "latest" if self._has_latest else "NULL"
        sql = (f"SELECT id, time, boot_id, kind, component, check_name, payload, last_seen, {latest}"
               " FROM events WHERE id > ?")
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

    def window(self, since: float, until: float, limit: int, *, open_ids: Collection[int] = ()
               ) -> tuple[list[dict[str, Any]], bool, float | None]:
        """Events whose span (``time`` .. ``last_seen``) meets [since, until], oldest first, at most
        ``limit``: (rows, truncated, the time of the oldest event still stored). ``open_ids``: the
        events behind faults still open, whose span runs on to now whatever their stored
        ``last_seen`` says (the caller has checked that now is past ``since``). Rows are plain
        dicts (the query API's), decoded but not folded; a row that cannot be decoded is skipped
        as in ``load``."""
        ids = sorted({int(i) for i in open_ids})
        # a node has tens of open faults, far below SQLite's 32,766 bound parameters
        still_open = f" OR id IN ({','.join('?' * len(ids))})" if ids else ""
        try:
            conn = self._connect()  # sets _has_latest: read the column only where the file has it
            conn.execute("BEGIN")
            # time <= until uses the time index; the last_seen test is on those rows only
            cur = conn.execute(
                f"SELECT id, time, boot_id, kind, component, check_name, payload, last_seen, "
                f"{'latest' if self._has_latest else 'NULL'} FROM events WHERE time <= ? "
                f"AND (coalesce(last_seen, time) >= ?{still_open}) ORDER BY time, id LIMIT ?",
                (until, since, *ids, limit + 1))
            rows = cur.fetchall()
            first = conn.execute("SELECT min(time) FROM events").fetchone()
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc
        out: list[dict[str, Any]] = []
        for row in rows[:limit]:
            event = _decode(row)
            if event is None:
                continue
            out.append({"id": event.id, "time": event.time, "last_seen": event.last_seen,
                        "kind": event.kind.value, "check": event.check, "component": event.component,
                        "boot_id": event.boot_id, "payload": dict(event.payload),
                        "latest": None if event.latest is None else dict(event.latest)})
        history_from = None if first is None or first[0] is None else float(first[0])
        return out, len(rows) > limit, history_from

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

    def quick_check(self) -> None:
        """Raise ``StoreError`` (``corrupt``) unless SQLite's quick_check passes: a truncated
        file may read fine until a lost page is needed."""
        try:
            rows = self._connect().execute("PRAGMA quick_check").fetchall()
        except (sqlite3.Error, OSError) as exc:
            self._reset()
            raise self._error(exc) from exc
        if [str(r[0]) for r in rows] != ["ok"]:
            self._reset()
            raise StoreError("corrupt: integrity check failed (" + "; ".join(str(r[0]) for r in rows[:3])
                             + ")", path=self.path, corrupt=True, pending=len(self._pending),
                             dropped=self.dropped)

    def set_aside(self, stamp: str) -> Path:
        """Close the store and rename its file, -wal and -shm to ``<name>.corrupt-<stamp>``
        (for forensics): the next write starts a fresh file. Returns the new name. Raises
        ``StoreError``."""
        self._reset()
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
        try:
            for suffix in ("-wal", "-shm", ""):  # the main file last: a reader never sees it alone
                p = self.path.with_name(self.path.name + suffix)
                if p.exists():
                    os.replace(p, target.with_name(target.name + suffix))
        except OSError as exc:
            raise StoreError(f"cannot set the corrupt store aside: {exc}", path=self.path) from exc
        return target

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
    ident, t, boot_id, kind, component, check, payload, last_seen, latest = row
    try:
        data = json.loads(payload)
        event_kind = EventKind(kind)
    except ValueError as exc:
        # a row from a newer gpumon, or damaged: skip it and say so, do not stop reading
        log.warning("health event %s skipped: %s", ident, exc)
        return None
    words: Any = None
    if latest is not None:
        try:
            words = json.loads(latest)
        except ValueError as exc:
            # damaged: the event stands as it was stored
            log.warning("health event %s: refresh skipped: %s", ident, exc)
    return Event(float(t), event_kind, str(component), str(check), str(boot_id),
                 data if isinstance(data, dict) else {}, int(ident),
                 None if last_seen is None else float(last_seen),
                 words if isinstance(words, dict) else None)


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
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(_real(now)))
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
        old = _state_from(self.store.load(upto_id=upto), self.policy, self.store.path)
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
            at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_real(float(replaced["at"]))))
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


def load_view(state_dir: Path | str, *, policy: HealthPolicy | None = None) -> HealthView:
    """The state as the daemon stored it, for ``gpumon status`` (read-only; raises ``StoreError``)."""
    store = EventStore(Path(state_dir) / DB_NAME, readonly=True)
    try:
        # a truncated file can read "fine" up to its first lost page: a partial state (perhaps a
        # healthy-looking one) must not pass for the state
        store.quick_check()
        return _state_from(store.load(), policy, store.path).view()
    finally:
        store.close()
