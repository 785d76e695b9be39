"""Follow the live kernel log: :class:`KernelLogFollower`.

It follows ``<host-root>/dev/kmsg`` (a character device) or a regular file (read, then followed
like ``tail -F``), returning only records of the current boot. It needs no thread. The same class
reads a saved log judged on purpose (``gpumon check --kmsg-file``): with no ``boot_time`` it
keeps the file's last boot, and with ``all_boots`` every record in it. The records are
gpumon.hw.kmsg_record's, the lines are made records by gpumon.hw.kmsg_lines.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gpumon.hw.kmsg_lines import BOOT_TIME_SLACK_S, Assembler, LineBuffer
from gpumon.hw.kmsg_parse import parse_line
from gpumon.hw.kmsg_record import KernelRecord, parse_kmsg_block

__all__ = ["KernelLogFollower", "Opener", "Reader"]

# A read() on /dev/kmsg must be given a buffer that holds a whole record or it
# fails with EINVAL; 64 KiB is far above the kernel's 8 KiB record limit.
_KMSG_READ_SIZE = 64 * 1024
# A regular file is read in slices of at most this (a read() of n bytes allocates n bytes
# whatever it returns: the slice is min(what the file holds beyond our offset, this)).
_FILE_READ_SIZE = 64 * 1024
# A follower made with ``bounded=True`` (the daemon's) returns at most about this much per
# call once the first read is done, so that a backlog (a storm, a log that grew while the
# daemon was stopped) is worked through in turns of bounded memory, not one huge list.
# A turn's buffers (the chunks, their text, the joined block, the records) raise the
# allocator's heap to their peak, which stays resident: bench/storm.py at 20,000 lines/s
# peaked at 55.2 MiB RSS with these sizes against 57.0-57.2 MiB with 1 MiB reads and turns of
# 1 MiB / 5,000 records, at the same CPU (2026-12-03, 2-core Intel Xeon VM).
_TURN_BYTES = 256 * 1024
_TURN_RECORDS = 2000

_MAX_POLL_S = 3600.0

Opener = Callable[[str, int], int]
Reader = Callable[[int, int], bytes]


def _device_records(chunks: list[bytes]) -> list[KernelRecord]:
    """The records of ``chunks``, each what one read() of ``/dev/kmsg`` returned: decoded in one
    call and made by parse_kmsg_block when each is one line ending in a newline (no dictionary lines),
    else each parsed as :func:`parse_line` parses it. The same records either way."""
    if not chunks:
        return []
    block = b"".join(chunks)
    if block.count(b"\n") == len(chunks) and all(c[-1:] == b"\n" for c in chunks):
        lines = block.decode("utf-8", "replace").split("\n")
        lines.pop()  # after the last newline
        made = parse_kmsg_block(lines)
        if made is not None:
            return made
    return [parse_line(c.decode("utf-8", "replace")) for c in chunks]


class KernelLogFollower:
    """Follow the kernel log at ``path``; return only records of the current boot.

    * A character device (``/dev/kmsg``) or socket is read one record per
      ``read()``, non-blocking; ``wait()`` sleeps in ``poll()``. EPIPE (the ring
      overwrote records we had not read) is counted in ``lost_records`` from the
      sequence gap, and reading goes on. Everything in it is the current boot.
    * Anything else is read as text lines: first everything, then what is
      appended, like ``tail -F`` (truncation restarts at offset 0, a replaced
      file is reopened, a missing file is waited for); a partial last line waits
      for its newline. Records whose ``wall_time`` is before ``boot_time``
      (epoch seconds, /proc/stat btime; None = unknown) are dropped, and in the
      first read everything before the last backwards jump of the monotonic
      clock (or of the kmsg sequence) that the records after it confirm, or a
      journal ``-- Boot`` marker, is dropped as an older boot. A FIFO is read the
      same way; one with no writer is an error (nothing feeds it).
    * A directory or a block device is not a kernel log: an error, never an
      empty log.

    ``read_available()`` and ``wait()`` never raise for I/O problems: what went
    wrong in the latest ``read_available()`` (the path cannot be opened, is a
    directory, vanished, a read failed) is in ``last_error``, None when it read
    fine; the open is retried on the next call. A caller must treat a log with
    ``last_error`` set as unreadable, not as a quiet one.

    ``boot_anchor`` dates records that carry only kernel time (``monotonic_us``):
    ``boot_time`` when known (/proc/stat btime), else ``clock() - uptime_s``
    (/proc/uptime) taken when the follower was made, else ``clock()`` minus the
    newest kernel time of the first read that had one; a derived anchor is moved
    earlier if a record would otherwise be dated in the future. Records are then
    dated by their own kernel time, so intervals between them hold whatever the
    anchor's error.
    Not thread-safe: use it from one thread (``wait()`` returns within its
    timeout, so that thread can check a stop flag and call ``close()`` itself).
    If the log goes quiet, ``NvrmParser.flush()`` emits a block still waiting
    for its next line.
    ``opener``/``reader`` default to ``os.open``/``os.read``; tests substitute
    them to hand in a socket or to inject EPIPE.

    ``all_boots`` turns the boot filter off: every record of a regular file is
    returned, whatever boot it came from (a saved log judged on purpose;
    ``boot_time`` then only dates records). The live log is never read this way.

    ``bounded`` (the daemon's follower) makes each call after the first read of a
    file return at most about 256 KiB / 2,000 records; the rest comes with the next
    calls, at once (``wait()`` does not sleep while more is there). The first read of
    a file stays whole: its boot filter needs every line of it.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        boot_time: float | None = None,
        uptime_s: float | None = None,
        poll_interval: float = 0.2,
        opener: Opener = os.open,
        reader: Reader = os.read,
        clock: Callable[[], float] = time.time,
        all_boots: bool = False,
        bounded: bool = False,
    ) -> None:
        self.path = Path(path)
        self.all_boots = all_boots
        self.bounded = bounded
        self.boot_time = boot_time
        self.poll_interval = poll_interval
        self.lost_records = 0
        self.last_error: OSError | None = None
        self._clock = clock
        self._anchor: float | None = boot_time
        if boot_time is None and uptime_s is not None and uptime_s >= 0:
            self._anchor = clock() - uptime_s
        self._opener = opener
        self._reader = reader
        self._fd: int | None = None
        self._record_mode = False
        self._regular = False
        self._fifo = False
        self._ident: tuple[int, int] | None = None
        self._offset = 0
        self._opened_before = False
        self._initial = False
        self._closed = False
        self._lines = LineBuffer()
        self._assembler = Assembler(None if all_boots else boot_time)
        self._record_malformed = 0
        self._last_seq: int | None = None
        self._epipe = False
        self._poller: select.poll | None = None
        # how many times the log was opened: a log opened again (a replaced file, a device
        # after a read error) is read from its start, and its reader may want to skip what
        # it had already
        self.opens = 0

    # -- public --------------------------------------------------------------

    @property
    def malformed_lines(self) -> int:
        """Lines that needed repair: undecodable bytes, NUL bytes (counted per
        read chunk), over-long lines, and device records without a kmsg header."""
        return self._lines.malformed + self._record_malformed

    @property
    def boot_anchor(self) -> float | None:
        """Epoch seconds to add to a record's ``monotonic_us`` to date it (see the class doc)."""
        return self._anchor

    def read_available(self) -> list[KernelRecord]:
        """Everything new since the last call, without blocking."""
        if self._closed:
            return []
        self.last_error = None
        if self._fd is None and not self._open():
            return []
        records = self._read_records() if self._record_mode else self._read_file()
        if records and self.boot_time is None:
            self._anchor_to(records)
        return records

    def _anchor_to(self, records: list[KernelRecord]) -> None:
        newest = max((r.monotonic_us for r in records if r.monotonic_us is not None), default=None)
        if newest is None:
            return
        latest = self._clock() - newest / 1e6
        # a record cannot have been logged after now: an anchor that says so (no uptime, or an
        # uptime that is not the kernel's, e.g. a container's) is moved back to fit it
        if self._anchor is None or self._anchor > latest + BOOT_TIME_SLACK_S:
            self._anchor = latest

    def wait(self, timeout: float) -> list[KernelRecord]:
        """Return as soon as records arrive, or ``[]`` after ``timeout`` seconds."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            records = self.read_available()
            if records:
                return records
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return []
            if self._record_mode and self._poller is not None:
                try:
                    # capped so an infinite timeout cannot overflow poll()'s milliseconds
                    events = self._poller.poll(min(remaining, _MAX_POLL_S) * 1000.0)
                except InterruptedError:
                    events = []
                if events:
                    records = self.read_available()
                    if records:
                        return records
                    # Woken without data (hang-up, error, duplicate): do not spin.
                    remaining = deadline - time.monotonic()
                    if remaining > 0:
                        time.sleep(min(self.poll_interval, remaining))
            else:
                time.sleep(min(self.poll_interval, remaining))

    def close(self) -> None:
        self._closed = True
        self._close_fd()

    def __enter__(self) -> KernelLogFollower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- opening -------------------------------------------------------------

    def _open(self) -> bool:
        try:
            fd = self._opener(str(self.path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self.last_error = e
            return False
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory, not a kernel log", str(self.path))
            if stat.S_ISBLK(st.st_mode):
                raise OSError(errno.EINVAL, "is a block device, not a kernel log", str(self.path))
            record_mode = stat.S_ISCHR(st.st_mode) or stat.S_ISSOCK(st.st_mode)
            if record_mode:
                os.set_blocking(fd, False)
        except OSError as e:
            os.close(fd)
            self.last_error = e
            return False
        self._fd = fd
        self._record_mode = record_mode
        self._regular = stat.S_ISREG(st.st_mode)
        self._fifo = stat.S_ISFIFO(st.st_mode)
        self._ident = (st.st_dev, st.st_ino)
        self._offset = 0
        if record_mode:
            self._poller = select.poll()
            self._poller.register(fd, select.POLLIN | select.POLLPRI)
        else:
            self._poller = None
            self._initial = not self._opened_before
            self._lines.reset()
        self._opened_before = True
        self.opens += 1
        return True

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._poller = None
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- character device ------------------------------------------------------

    def _read_records(self) -> list[KernelRecord]:
        # One read() is one record (the device's contract); the records of a turn are read
        # first and parsed together (_device_records), which in a storm costs less than parsing
        # each as it comes (bench/storm_device.py at 20,000 lines/s: 4.7-5.2 us a line, 5.3 before).
        chunks: list[bytes] = []
        gaps: set[int] = set()  # indices of chunks read right after an EPIPE
        limit = _TURN_RECORDS if self.bounded else None
        while self._fd is not None and (limit is None or len(chunks) < limit):
            try:
                data = self._reader(self._fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except BrokenPipeError:
                # The ring overwrote records we had not read; the next read
                # returns the oldest survivor and its seq tells how many.
                gaps.add(len(chunks))
                continue
            except OSError as e:
                self.last_error = e
                self._close_fd()  # reopen on the next call; seq dedup below skips the replay
                break
            if not data:
                break
            chunks.append(data)
        out: list[KernelRecord] = []
        for i, rec in enumerate(_device_records(chunks)):
            if gaps and i in gaps:
                self._epipe = True
            seq = rec.seq
            if seq is None:
                self._record_malformed += 1
            else:
                last = self._last_seq
                if last is not None:
                    if seq <= last:
                        continue
                    self.lost_records += seq - last - 1
                elif self._epipe:
                    self.lost_records += 1  # a lower bound: nothing read yet to measure the gap from
                self._last_seq = seq
            self._epipe = False
            out.append(rec)
        if gaps and len(chunks) in gaps:  # an EPIPE after the last record read: the next one's
            self._epipe = True
        return out

    # -- regular file ----------------------------------------------------------

    def _read_file(self) -> list[KernelRecord]:
        initial, self._initial = self._initial, False
        lines: list[str] = []
        if self._regular and self._fd is not None:
            try:
                size = os.fstat(self._fd).st_size
                if size < self._offset:  # truncated in place (copytruncate, > file)
                    os.lseek(self._fd, 0, os.SEEK_SET)
                    self._offset = 0
                    self._lines.reset()
            except OSError as e:
                self.last_error = e
        behind = self._drain(lines, bounded=self.bounded and not initial)
        records = self._assembler.add(lines, initial=initial and not self.all_boots)
        # a replaced file is left only once what was appended to the old one is all read
        if self._regular and not behind and self._replaced():
            partial = self._lines.take_partial()
            tail = [partial] if partial is not None else []
            records.extend(self._assembler.add(tail, initial=False))
            self._close_fd()
            if self._open():
                self._initial = False
                if self._record_mode:  # the path now names a device (host root remounted)
                    records.extend(self._read_records())
                else:
                    more: list[str] = []
                    self._drain(more, bounded=self.bounded)
                    records.extend(self._assembler.add(more, initial=False))
        return records

    def _drain(self, lines: list[str], *, bounded: bool = False) -> bool:
        """Read what is there into ``lines``; True when ``bounded`` stopped it (after about
        _TURN_BYTES / _TURN_RECORDS) with more to read, False at the end or on an error."""
        done = 0
        while self._fd is not None:
            size = _FILE_READ_SIZE
            if self._regular:
                # ask for no more than the file holds: read() allocates what it is asked for,
                # and a read at the end costs a call that returns nothing
                try:
                    left = os.fstat(self._fd).st_size - self._offset
                except OSError as e:
                    self.last_error = e
                    return False
                if left == 0 and self._offset > 0:
                    return False
                if left > 0:  # else truncated meanwhile, or a size of 0 that says nothing: read
                    size = min(size, left)
            try:
                chunk = self._reader(self._fd, size)
            except BlockingIOError:  # a FIFO with a writer but no data
                return False
            except InterruptedError:
                continue
            except OSError as e:
                self.last_error = e
                return False
            if not chunk:
                if self._fifo:
                    # O_NONBLOCK: EAGAIN while a writer is attached, end-of-file when none is
                    self.last_error = OSError(errno.EPIPE, "a FIFO with no writer: nothing feeds it",
                                              str(self.path))
                return False
            self._offset += len(chunk)
            lines.extend(self._lines.feed(chunk))
            done += len(chunk)
            if bounded and (done >= _TURN_BYTES or len(lines) >= _TURN_RECORDS):
                return True
        return False

    def _replaced(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError as e:
            # gone for now: keep the old descriptor until a new file appears (what was
            # appended to it is still read), but say so: nothing new will be logged there
            self.last_error = e
            return False
        return (st.st_dev, st.st_ino) != self._ident
