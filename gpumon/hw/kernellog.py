"""The kernel log as a source: this boot's records, followed, and the NVRM events parsed from them.

One pipeline for every reader: the daemon's kernel-log pump (``gpumon.kernel_pump``) follows it
in bounded turns, ``gpumon check`` and the bootstrap suite take a snapshot of it, ``gpumon check
--kmsg-file`` judges a saved log, ``gpumon check --simulate`` follows it from run to run, and the
tests read a simulated node's log the same way.

- :class:`KernelLogFeed` is the one way the log reaches a check: the runner asks it for each
  check's :class:`KernelLog` at the start of the check's run (``for_check``). :class:`ReadOnce`
  (one read made when the first check of a run asks, handed to each: a snapshot, a saved log, a
  followed log's next step) and the daemon's ``gpumon.kernel_pump.KernelLogPump`` (what each
  check declared, since its last run) implement it.

- :class:`KernelLogSource` opens the log (``/dev/kmsg`` or a file, :class:`KernelLogFollower`),
  dates records that carry only kernel time (/proc/stat btime, else /proc/uptime, else the newest
  record: ``KernelLogFollower.boot_anchor``) and parses them through one :class:`NvrmParser`, so
  that a block of lines split across two reads is still one event.
- :class:`KernelLog` is what a check is handed (``CheckContext.kernel_log``); one that could not
  be read is ``available=False`` with the reason, never an empty log.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gpumon.errors import HwCondition
from gpumon.hw.hostfs import HostFs
from gpumon.hw.kmsg_follow import KernelLogFollower
from gpumon.hw.kmsg_record import KernelRecord
from gpumon.hw.nvrm import NvrmParser


@dataclass
class KernelLog:
    """Kernel-log events handed to a check: NVRM events parsed by the hw layer.

    ``available`` is False when the log could not be read; the check must then
    say ``unknown`` with ``error`` rather than report a clean log.
    """

    events: Sequence[Any] = ()
    # the raw kernel records (gpumon.hw.kmsg_record.KernelRecord), for checks that read non-NVRM lines
    records: Sequence[Any] = ()
    available: bool = True
    error: str | None = None
    source: str = ""
    records_read: int = 0
    lost_records: int = 0
    # epoch seconds of this boot, to date records that carry only kernel uptime
    boot_time: float | None = None
    # what the check's kernel_log_fold gathered from the records since its last run, when the
    # daemon's pump folded them as they came (those records are then not in ``records``)
    folded: Any = None

    def time_of(self, record: Any, now: float) -> float:
        """When a record was logged: its wall clock, else boot time + kernel uptime, else ``now``.

        ``boot_time`` is /proc/stat btime or, without it, the kernel-log follower's anchor
        (now - /proc/uptime, else now - the newest record's kernel time; see
        ``KernelLogFollower.boot_anchor``): records with kernel time are then dated by their
        own stamps, so intervals between them are right whatever the anchor's error. Only a
        record with no timestamp at all is dated ``now``."""
        wall = getattr(record, "wall_time", None)
        if wall is not None:
            return float(wall.timestamp())
        usec = getattr(record, "monotonic_us", None)
        if usec is not None and self.boot_time is not None:
            return float(self.boot_time + usec / 1e6)
        return now


@dataclass
class SavedKernelLog(KernelLog):
    """A saved kernel log judged on purpose (:func:`read_saved`), not this boot's live log. Checks
    that date verdicts (the xid check) judge it at ``judged_at``, the time of its newest record, as
    the node would have been judged when the log ended."""

    judged_at: float = 0.0
    all_boots: bool = False


class FedCheck(Protocol):
    """A check as a feed knows it: by its name, under which the daemon's pump keeps what each check
    reads. Not ``gpumon.check.Check``: the check protocol sits above this layer and hands checks
    the :class:`KernelLog` defined here."""

    @property
    def name(self) -> str: ...


class KernelLogFeed(ABC):
    """Where the checks of a run get their kernel log. The runner calls ``for_check`` once per run
    of each check that declares ``Check.kernel_log`` (a check that does not is handed an
    unavailable log without asking), before its capability gate and on the thread that starts
    the runs, the checks of one run one after the other."""

    @abstractmethod
    def for_check(self, check: FedCheck) -> KernelLog:
        """The log ``check`` is handed for this run (``available`` False, with the reason, when it
        could not be read)."""
        raise NotImplementedError


class ReadOnce(KernelLogFeed):
    """One read of the log, made when the first check of a run asks, and handed to every check of
    that run: ``gpumon check``'s snapshot, the bootstrap suite's (one per check run), a saved log
    (``--kmsg-file``), a followed log's next step (``gpumon check --simulate``). Nothing is read
    when no check asks."""

    def __init__(self, read: Callable[[], KernelLog]) -> None:
        self._read = read
        self._log: KernelLog | None = None

    def for_check(self, check: FedCheck) -> KernelLog:
        if self._log is None:
            self._log = self._read()
        return self._log


def kernel_log_error(path: Path, exc: OSError) -> str:
    """Why the kernel log at ``path`` cannot be read, in words."""
    return f"reading {path}: {exc.strerror or exc}"


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read at all (checked before a follower is made, which would wait for
    a missing file rather than say so); None: it can be tried."""
    if not path.exists():
        return f"{path} does not exist"
    if not os.access(path, os.R_OK):
        return f"{path} is not readable (permission denied)"
    return None


@dataclass
class KernelLogBatch:
    """What one read of the log brought."""

    records: list[KernelRecord]
    events: list[Any]
    # the log was (re)opened since the last read, and read from its start again (a replaced file,
    # a device after a read error): a reader that keeps a position may skip what it had
    reopened: bool
    # why the log could not be read this time (None: it was); the source tries again next read
    error: str | None
    # epoch seconds of this boot for records with kernel time only (KernelLogFollower.boot_anchor)
    boot_anchor: float | None


@dataclass
class KernelLogSource:
    """The kernel log at ``path`` followed from its start: this boot's records (all of a saved
    log's last boot, every boot with ``all_boots``), parsed into NVRM events.

    ``fs``: the host whose /proc/stat btime (else /proc/uptime) dates records that carry only
    kernel time; ``boot_time`` gives that time instead (a simulated node's), and with neither the
    newest record does (a saved log). ``bounded``: see ``KernelLogFollower`` (the daemon's pump
    reads a backlog in bounded turns). Not thread-safe, as the follower it wraps.
    """

    path: Path
    fs: HostFs | None = None
    boot_time: float | None = None
    poll_interval: float = 0.2
    bounded: bool = False
    all_boots: bool = False
    _follower: KernelLogFollower | None = field(default=None, init=False, repr=False)
    _parser: NvrmParser = field(default_factory=NvrmParser, init=False, repr=False)
    _opens: int = field(default=0, init=False, repr=False)

    def open(self) -> KernelLogFollower:
        """The follower, made at the first read. Raises ``OSError``/``HwCondition`` when the host's
        boot time cannot be read; the log itself not being readable is a batch's ``error``."""
        if self._follower is None:
            boot_time, uptime = self.boot_time, None
            if boot_time is None and self.fs is not None:
                boot_time = self.fs.boot_time()
                if boot_time is None:
                    try:
                        uptime = float(self.fs.read_text("proc/uptime").split()[0])
                    except (HwCondition, IndexError, ValueError):
                        uptime = None
            self._follower = KernelLogFollower(self.path, boot_time=boot_time, uptime_s=uptime,
                                               poll_interval=self.poll_interval, bounded=self.bounded,
                                               all_boots=self.all_boots)
            self._opens = 0
        return self._follower

    def read(self, wait: float = 0.0) -> KernelLogBatch:
        """What is new since the last read; with ``wait``, up to that many seconds for something."""
        follower = self.open()
        records = follower.wait(wait) if wait > 0 else follower.read_available()
        reopened = follower.opens != self._opens
        self._opens = follower.opens
        failed = follower.last_error
        events: list[Any] = []
        for rec in records:
            events.extend(self._parser.feed(rec))
        events.extend(self._parser.flush())
        return KernelLogBatch(records, events, reopened,
                              None if failed is None else kernel_log_error(self.path, failed),
                              follower.boot_anchor)

    def read_log(self) -> KernelLog:
        """What is new since the last read, as a check is handed it (``available`` False, with the
        reason, when it could not be read)."""
        try:
            batch = self.read()
        except OSError as exc:
            return KernelLog(available=False, error=kernel_log_error(self.path, exc), source=str(self.path))
        if batch.error is not None:
            return KernelLog(available=False, error=batch.error, source=str(self.path))
        return KernelLog(events=batch.events, records=batch.records, available=True, source=str(self.path),
                         records_read=len(batch.records), lost_records=self.lost_records,
                         boot_time=batch.boot_anchor)

    @property
    def opens(self) -> int:
        """How many times the log was opened (again after a replaced file, a read error)."""
        return self._follower.opens if self._follower is not None else 0

    @property
    def lost_records(self) -> int:
        """Records the kernel's ring overwrote before they were read (``/dev/kmsg``)."""
        return self._follower.lost_records if self._follower is not None else 0

    def close(self) -> None:
        if self._follower is not None:
            self._follower.close()


def snapshot(source: KernelLogSource) -> KernelLog:
    """Everything ``source`` holds (the current boot's log), read once and closed; ``available``
    False, with the reason, when it cannot be read (missing, a directory, permission denied...)."""
    why = _unreadable(source.path)
    if why is not None:
        return KernelLog(available=False, error=why, source=str(source.path))
    try:
        return source.read_log()
    finally:
        source.close()


def read_saved(path: Path, *, all_boots: bool = False) -> KernelLog:
    """A saved log (dmesg, ``journalctl -k``, kern.log, a /dev/kmsg dump) judged on purpose
    (``gpumon check --kmsg-file``). It is its own boot: not compared with this host's boot time;
    only its last boot is kept (journal ``-- Boot`` markers, the kernel clock stepping back), every
    record with ``all_boots``. Records are dated by their own clock (kernel time only: as if the log
    ended now), and the log is judged at its newest record (``SavedKernelLog.judged_at``). The
    daemon never reads a log this way."""
    log = snapshot(KernelLogSource(path, all_boots=all_boots))
    if not log.available:
        return log
    saved = SavedKernelLog(events=log.events, records=log.records, available=True, source=log.source,
                           records_read=log.records_read, lost_records=log.lost_records,
                           boot_time=log.boot_time, all_boots=all_boots)
    now = time.time()
    saved.judged_at = max((saved.time_of(r, now) for r in saved.records), default=now)
    return saved
