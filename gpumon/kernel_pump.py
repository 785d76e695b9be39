"""The daemon's kernel-log pump: follows the kernel log (``gpumon.hw.kernellog``) on its own
thread and hands each check that reads it what it declared, once, with a watermark per check.

The source (open, follow, parse) is the hw layer's; what is here is the distribution: per-check
queues (:class:`_Queue`) bounded in size, the minimum gap between two runs of a check for what the
log brings (a new key runs it at once), and the marks that say how far each check has been handed
the log, so that a restarted daemon neither skips nor repeats lines.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import fields, replace
from operator import attrgetter
from typing import Any

from gpumon.check import Check, KernelLog, KernelLogNeeds
from gpumon.errors import HwCondition
from gpumon.hw.kernellog import FedCheck, KernelLogFeed, KernelLogSource
from gpumon.hw.nvrm import XidEvent

log = logging.getLogger("gpumon.daemon")
# kept beside the checks' own state (a check may clear its state on a new boot)
WATERMARK_STATE = "kernel-log-watermarks"
# How long a kernel-log check waits, at daemon start, for the pump's first read of the log.
_FIRST_READ_WAIT_S = 2.0
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
# For a check that counts repeats (KernelLogNeeds.repeats), an Xid line whose text is already
# queued for it, logged at most this long (kernel time) after the queued one, is counted on it
# (XidEvent.repeats) instead of queued: a storm of the same few lines is a few events per run.
KERNEL_LOG_REPEAT_US = 1_000_000
# Why a line a check reads did not reach it (gpumon_kernel_log_lines_dropped_total{reason}):
# pushed out of the check's bounded queue before its run (its counts are short by this many), or
# overwritten in the kernel's ring before gpumon read it (/dev/kmsg EPIPE: what they were is lost).
DROP_QUEUE_FULL = "queue_full"
DROP_RING_OVERRUN = "ring_overrun"


def _last_stamps(records: Sequence[Any]) -> tuple[int | None, int | None]:
    """The sequence number and the kernel time of the last records that have one."""
    seq = next((r.seq for r in reversed(records) if r.seq is not None), None)
    us = next((r.monotonic_us for r in reversed(records) if r.monotonic_us is not None), None)
    return seq, us


# XidEvent's fields but the last two (repeats, last_record), read in one call: a copy of an event
# with its repeats is then one constructor call (0.9 us here against 3.5 us for
# dataclasses.replace, once per queued Xid line that later lines were counted on: thousands per
# run in a storm of distinct lines)
_XID_FIELDS = [f.name for f in fields(XidEvent)]
if _XID_FIELDS[-2:] != ["repeats", "last_record"]:
    raise ImportError(f"XidEvent's last fields are not repeats, last_record: {_XID_FIELDS}")
_xid_head = attrgetter(*_XID_FIELDS[:-2])


def _with_repeats(event: Any, repeats: int, last: Any) -> Any:
    """``replace(event, repeats=repeats, last_record=last)``, cheaper."""
    if type(event) is not XidEvent:
        return replace(event, repeats=repeats, last_record=last)
    return XidEvent(*_xid_head(event), repeats, last)  # type: ignore[call-arg]


def _dater(dating: KernelLog, wall: float) -> Callable[[Any], float]:
    """``dating.time_of(record, wall)`` as one call (a fold dates each of its lines of a storm):
    a record with kernel time only, the common one, is dated here."""
    boot, time_of = dating.boot_time, dating.time_of
    if boot is None:
        return lambda rec: time_of(rec, wall)

    def when(rec: Any) -> float:
        usec = getattr(rec, "monotonic_us", None)
        if usec is not None and getattr(rec, "wall_time", None) is None:
            return float(boot + usec / 1e6)
        return time_of(rec, wall)

    return when


def _event_key(event: Any) -> Hashable:
    """What makes an NVRM event new to a check: its kind, device and code (an Xid 79 on a GPU)."""
    return (type(event).__name__, getattr(event, "pci", None), getattr(event, "code", None))


class _Queue:
    """What the pump keeps for one check between its runs: only what the check reads
    (``Check.kernel_log``: its event types, else every event and record; its fold)."""

    def __init__(self, check: Check, needs: KernelLogNeeds, mark: Mapping[str, Any] | None, cap: int) -> None:
        self.types = needs.events
        self.want_records = needs.events is None
        self.fold = check.kernel_log_fold()
        self.events: deque[Any] = deque()
        self.records: deque[Any] = deque(maxlen=cap)
        self.cap = cap
        self.dropped = 0  # lines this check reads that were pushed out before its run (cumulative)
        # repeats (KernelLogNeeds.repeats): text -> the queued Xid event that later copies of the
        # same line are counted on; id(event) -> [lines it stands for, the last of them]
        self.repeats = needs.repeats
        self.merge: dict[str, list[Any]] = {}
        self.extra: dict[int, list[Any]] = {}  # id(event) -> its merge entry, once a line is counted on it
        self.calls = 0
        self.merged = 0  # lines counted on an earlier identical one (cumulative; none lost)
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

    def push_events(self, items: Sequence[Any], *, counts: bool = True) -> list[Hashable]:
        """Queue NVRM events; with ``repeats``, an Xid line already queued within
        KERNEL_LOG_REPEAT_US is counted on the queued one. Beyond ``cap`` the oldest go, counted
        (with every line counted on them) in ``dropped`` when ``counts``. Returns the events'
        keys (_event_key), once for all the lines counted on one event."""
        queue, merge, extra, cap = self.events, self.merge, self.extra, self.cap
        keys: list[Hashable] = []
        repeats = self.repeats
        self.calls = call = self.calls + 1  # marks the heads that lines of this call were counted on
        merged = 0
        for event in items:
            if repeats and type(event) is XidEvent:
                rec = event.record
                us = rec.monotonic_us
                if us is not None:
                    text = rec.text
                    head = merge.get(text)
                    # head: [the queued event, its kernel time, lines it stands for, the last of
                    # them, the call that last counted a line on it]
                    if head is not None and 0 <= us - head[1] <= KERNEL_LOG_REPEAT_US:
                        head[2] += 1
                        head[3] = rec
                        merged += 1
                        if head[2] == 2:
                            extra[id(head[0])] = head
                        if head[4] != call:
                            head[4] = call
                            keys.append(_event_key(head[0]))
                        continue
                    merge[text] = [event, us, 1, None, 0]
            if len(queue) >= cap:
                old = queue.popleft()
                more = extra.pop(id(old), None)
                record = getattr(old, "record", None)
                if record is not None:
                    head = merge.get(record.text)
                    if head is not None and head[0] is old:
                        del merge[record.text]
                if counts:
                    self.dropped += 1 if more is None else more[2]
            queue.append(event)
            keys.append(_event_key(event))
        self.merged += merged
        return keys

    def take_events(self) -> list[Any]:
        """The queued events (each Xid event that later lines were counted on carries them in
        ``repeats``/``last_record``), and the queue emptied."""
        extra = self.extra
        if extra:
            events = [e if (more := extra.get(id(e))) is None
                      else _with_repeats(e, more[2], more[3]) for e in self.events]
        else:
            events = list(self.events)
        self.events.clear()
        self.merge.clear()
        extra.clear()
        return events

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


class KernelLogPump(KernelLogFeed):
    """Follows the kernel log on its own thread and hands each subscribed check what it reads:
    the daemon's :class:`~gpumon.hw.kernellog.KernelLogFeed` (``for_check`` at each run).

    Every check that reads the kernel log gets what it declared (``Check.kernel_log``, see
    gpumon.check.KernelLogNeeds), once: two checks reading the kernel log (xid,
    nvswitch) do not steal each other's lines, and a check keeps nothing it does not read until
    its next run (nvswitch, run every 60 s, kept every record of a storm). A check runs for what
    it reads at most every KERNEL_LOG_GAP_S, at once for a key it has not seen lately.

    A log that cannot be read (missing, a directory, permission denied, vanished) is handed
    over as unavailable with the reason, so those checks say ``unknown``, never ``ok``; the pump
    keeps trying, and a failure of its own thread is reported the same way instead of ending
    the daemon.

    Watermarks: ``take`` also returns the mark of the last record handled for the check (what it
    hands over includes everything of interest up to it; after ``for_check``, ``handed_mark``
    gives it). The daemon stores it beside the
    check's state once a run that used it has completed and that state is saved, never before,
    so a daemon that dies mid-run reads those lines again rather than skipping them; a new pump
    drops what is at or before the stored mark.
    """

    def __init__(self, source: Callable[[], KernelLogSource], wake: threading.Event,
                 subscribers: Sequence[Check], *, boot: str | None, marks: Mapping[str, Any],
                 queue_max: int = KERNEL_LOG_QUEUE_MAX) -> None:
        """``source`` makes a new source of the log (again after a failure of the pump);
        ``subscribers``: the checks, of which those that declare ``kernel_log`` are subscribed;
        ``boot``: this boot's id; ``marks``: the watermarks stored by the daemon (check name -> mark)."""
        self._new_source = source
        self.wake = wake
        self.lock = threading.Lock()
        self.boot = boot
        self.queues: dict[str, _Queue] = {}
        for check in subscribers:
            needs = check.kernel_log
            if needs is None:
                continue
            mark = marks.get(check.name)
            if not isinstance(mark, dict) or mark.get("boot") != self.boot:
                mark = None
            self.queues[check.name] = _Queue(check, needs, mark, queue_max)
        # check name -> the watermark of what for_check last handed it (see handed_mark)
        self._handed: dict[str, dict[str, Any] | None] = {}
        self.records = 0
        self.error: str | None = None
        self.source: KernelLogSource | None = None
        self._first: KernelLogSource | None = source()  # opened by the pump's thread
        self.path = self._first.path
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
        while not self.stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # the pump outlives any one failure
                log.exception("kernel-log reader failed")
                self.error = f"kernel-log reader failed: {type(exc).__name__}: {exc}"
                self.first_read.set()
                if self.source is not None:
                    self.source.close()
                    self.source = None  # a new one, with a new parser, at the next turn
                self.stop.wait(1.0)

    def _turn(self) -> None:
        if self.source is None:
            source, self._first = self._first or self._new_source(), None
            try:
                source.open()
            except (OSError, HwCondition) as exc:
                self.error = f"cannot open {source.path}: {exc}"
                self.first_read.set()
                self.stop.wait(5.0)
                return
            self.source = source
        source = self.source
        batch = source.read(1.0 if self.first_read.is_set() else 0.0)
        records, events = batch.records, batch.events
        if batch.reopened:
            # (re)opened: read from its start again, what each check was handed is dropped
            with self.lock:
                for queue in self.queues.values():
                    queue.floor_seq, queue.floor_us = queue.seq, queue.us
        if batch.error is not None:
            if self.error is None:
                log.warning("kernel log unreadable: %s", batch.error)
            self.error = batch.error
        elif self.error is not None:
            log.info("kernel log %s readable again", source.path)
            self.error = None
        anchor = batch.boot_anchor
        if records and anchor is not None and (self.boot_anchor is None or anchor < self.boot_anchor):
            # fixed once known; moved only earlier, when the follower found a record that it
            # would otherwise date in the future
            self.boot_anchor = anchor
        woken = False
        if records or events:
            dating = KernelLog(boot_time=self.boot_anchor)
            wall, now = time.time(), time.monotonic()
            last_seq, last_us = _last_stamps(records)
            kinds = frozenset(map(type, events))
            with self.lock:
                self.records += len(records)
                for queue in self.queues.values():
                    woken = self._hand(queue, records, events, dating, wall, now, last_seq, last_us,
                                       kinds) or woken
        self.first_read.set()
        if woken:
            self.wake.set()

    def _hand(self, queue: _Queue, records: list[Any], events: list[Any], dating: KernelLog, wall: float,
              now: float, last_seq: int | None, last_us: int | None,
              kinds: frozenset[type] = frozenset()) -> bool:
        """One turn's records and events for one check (under the lock); True: it is due sooner.
        ``kinds``: the types of ``events`` (or more), to take or leave them whole when the check
        reads all of those types or none (a storm's batch is one or two types)."""
        if queue.floor_seq is not None or queue.floor_us is not None:
            fresh = [r for r in records if not queue.seen(r)]
            if len(fresh) != len(records):
                kept = {id(r) for r in fresh}
                events = [e for e in events if getattr(e, "record", None) is None or id(e.record) in kept]
                records = fresh
                last_seq, last_us = _last_stamps(records)
        keys: list[Hashable] = []
        relevant = False
        types = queue.types
        if types is None:
            mine = events
        elif not types or not events:
            mine = []
        else:
            wanted = [issubclass(kind, types) for kind in kinds]
            if wanted and all(wanted):
                mine = events
            elif kinds and not any(wanted):
                mine = []
            else:
                mine = [e for e in events if isinstance(e, types)]
        if mine:
            keys.extend(queue.push_events(mine, counts=not queue.want_records))
            # a check that reads every record runs for the records (below)
            relevant = not queue.want_records
        if queue.want_records and records:
            queue.push(queue.records, records)
            relevant = True
        if queue.fold is not None:
            said = queue.fold.add_many(records, _dater(dating, wall))
            if said:
                keys.extend(said)
                relevant = True
        if last_seq is not None:
            queue.seq = last_seq
        if last_us is not None:
            queue.us = last_us
        return relevant and queue.schedule(keys, now)

    def take(self, name: str) -> tuple[KernelLog, dict[str, Any] | None]:
        """What the check ``name`` reads of the log since its last take, and the watermark to
        store once a run that used it has completed (None: nothing to store)."""
        # the first read is one non-blocking pass over what the log holds: normally milliseconds;
        # waited for once (by the first run of a check that reads the log), not at every take
        waited, self._waited = self._waited, True
        source = str(self.path)
        if not self.first_read.wait(0.0 if waited else _FIRST_READ_WAIT_S):
            return KernelLog(available=False, source=source,
                             error=f"{self.path} not read yet (still reading it after "
                                   f"{_FIRST_READ_WAIT_S:g} s)"), None
        queue = self.queues.get(name)
        if queue is None:
            return KernelLog(available=False, source=source, error="not subscribed to the kernel log"), None
        with self.lock:
            events, records = queue.take_events(), list(queue.records)
            queue.records.clear()
            folded = queue.fold.take() if queue.fold is not None else None
            mark = {"boot": self.boot, "seq": queue.seq, "us": queue.us}
            queue.due_at = None
            queue.last_take = time.monotonic()
            dropped = queue.dropped
            total = self.records
        reader = self.source
        lost = (reader.lost_records if reader is not None else 0) + dropped
        error = self.error
        if error is None and self.thread.ident is not None and not self.thread.is_alive() \
                and not self.stop.is_set():
            error = "the kernel-log reader thread has stopped"
        if error is not None and not (events or records or folded is not None):
            return KernelLog(available=False, error=error, source=source), mark
        return KernelLog(events=events, records=records, available=True, source=source,
                         records_read=total, lost_records=lost, boot_time=self.boot_anchor,
                         folded=folded), mark

    def for_check(self, check: FedCheck) -> KernelLog:
        """``take`` for the check at the start of its run; its watermark is kept for ``handed_mark``."""
        log, mark = self.take(check.name)
        self._handed[check.name] = mark
        return log

    def handed_mark(self, name: str) -> dict[str, Any] | None:
        """The watermark of what ``for_check`` last handed the check ``name`` (None: nothing, or
        nothing to store), forgotten once asked: the daemon stores it once that run has completed.
        Asked on the thread of the check's run, one run of a check at a time."""
        return self._handed.pop(name, None)

    def stats(self) -> dict[str, Any]:
        """Counters since the pump started, for /metrics: records read; per check, lines it
        reads that did not reach it, by reason (DROP_*), and lines counted on an earlier
        identical one (KERNEL_LOG_REPEAT_US; none lost)."""
        reader = self.source
        ring = reader.lost_records if reader is not None else 0
        with self.lock:
            dropped = {(name, reason): n for name, queue in self.queues.items()
                       for reason, n in ((DROP_QUEUE_FULL, queue.dropped), (DROP_RING_OVERRUN, ring))}
            merged = {name: queue.merged for name, queue in self.queues.items()}
            return {"read": self.records, "dropped": dropped, "merged": merged}

    def has_pending(self, name: str) -> bool:
        """Something this check reads has arrived since its last run, and it is time to run it."""
        with self.lock:
            queue = self.queues.get(name)
            return queue is not None and queue.due_at is not None and queue.due_at <= time.monotonic()

    def next_due(self) -> float | None:
        """The soonest monotonic time at which a check that waits out KERNEL_LOG_GAP_S is due."""
        now = time.monotonic()
        with self.lock:
            return min((f.due_at for f in self.queues.values() if f.due_at is not None and f.due_at > now),
                       default=None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2.0)
        if self.source is not None and not self.thread.is_alive():
            self.source.close()

