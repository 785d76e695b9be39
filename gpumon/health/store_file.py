"""The health store's SQLite file: ``StoreFile`` opens it (WAL, a busy timeout, ``synchronous=FULL``, the
schema and its version, the ``latest`` column added to an older file, a read-only open without its
write-ahead log on a full disk) and says what went wrong in words (``StoreError``: disk full, store
full, corrupt). ``EventStore`` (``store``) is the event log built on it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from collections import deque
from pathlib import Path
from urllib.parse import quote

from gpumon.errors import GpumonError
from gpumon.health.state import Event

log = logging.getLogger("gpumon.health")

SCHEMA_VERSION = 1
# Events kept in memory while the store cannot be written; past this the
# oldest are dropped (and counted): the in-memory state has them anyway.
DEFAULT_MAX_PENDING = 10_000
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


class StoreFile:
    """The store's SQLite file: its connection, opened on first use and reset after an error, and its
    errors in words; the events not yet written (``pending``) are kept here too."""

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
