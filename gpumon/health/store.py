"""SQLite event store for the health state: ``EventStore``, the events on disk (``Health``, the fold in
memory, is in ``keeper``; opening the file and its errors in words, in ``store_file``).

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

import json
import logging
import math
import os
import sqlite3
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpumon.health.state import Event, EventKind, HealthPolicy, HealthState, HealthView
from gpumon.health.store_file import StoreError, StoreFile

log = logging.getLogger("gpumon.health")

DB_NAME = "health.db"


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


class EventStore(StoreFile):
    """Append-only SQLite log of health events (plus one snapshot row)."""

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
                    (finite_time(e.time), e.boot_id, e.kind.value, e.component, e.check,
                     json.dumps(dict(e.payload), separators=(",", ":"), default=str, allow_nan=False),
                     None if e.last_seen is None else finite_time(e.last_seen)))
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
                             [(finite_time(t), i) for i, t in last_seen.items()])
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
            row = conn.execute("SELECT max(id) FROM events WHERE time < ?", (finite_time(before),)).fetchone()
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
                         (upto_id, finite_time(time), json.dumps(dict(snapshot), separators=(",", ":"))))
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


def finite_time(value: float) -> float:
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


def state_from(loaded: Loaded, policy: HealthPolicy | None, path: Path) -> HealthState:
    try:
        state = (HealthState(policy) if loaded.snapshot is None
                 else HealthState.from_snapshot(loaded.snapshot, policy))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        # refuse rather than start healthy: a lost snapshot may hold open faults
        raise StoreError(f"snapshot unreadable ({type(exc).__name__}: {exc})", path=path) from exc
    for event in loaded.events:
        state.apply(event)
    return state


def load_view(state_dir: Path | str, *, policy: HealthPolicy | None = None) -> HealthView:
    """The state as the daemon stored it, for ``gpumon status`` (read-only; raises ``StoreError``)."""
    store = EventStore(Path(state_dir) / DB_NAME, readonly=True)
    try:
        # a truncated file can read "fine" up to its first lost page: a partial state (perhaps a
        # healthy-looking one) must not pass for the state
        store.quick_check()
        return state_from(store.load(), policy, store.path).view()
    finally:
        store.close()
