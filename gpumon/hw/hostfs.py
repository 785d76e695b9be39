"""Files of the host: sysfs, procfs and /dev, always under the host root.

gpumon may run in a container with the host mounted at /host, and tests point
it at a directory tree, so no code outside this module builds a path to
/sys or /proc. Reads are bounded: a sysfs attribute behind a dead PCIe link
can block in the kernel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpumon.errors import HwCondition, HwFailure, HwTimeout, NotSupported
from gpumon.hw.calls import BoundedCaller

MAX_ATTR_BYTES = 1 << 20
# A sysfs attribute is at most one page (Documentation/filesystems/sysfs.rst).
_CHUNK = 4096


def read_attr(path: str) -> bytes:
    """At most MAX_ATTR_BYTES of a file, read until end of file, as ``open(path, "rb").read(
    MAX_ATTR_BYTES)`` reads it, at a quarter of its CPU for a small attribute: a buffered
    read(MAX_ATTR_BYTES) allocates (then shrinks) a 1 MiB buffer per file, which costs more
    than the open, read and close of a sysfs attribute (bench: ~21 vs ~4.3 us a file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, _CHUNK)
        if not data:
            return data
        chunks = [data]
        size = len(data)
        # a short read is not end of file everywhere (procfs seq_files return a record at a time)
        while size < MAX_ATTR_BYTES:
            more = os.read(fd, min(_CHUNK, MAX_ATTR_BYTES - size))
            if not more:
                break
            chunks.append(more)
            size += len(more)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


class HostFs:
    # (label, file) of the last read_batch that hung, until a batch completes again
    _hung_batch: tuple[str, str] | None = None

    def __init__(self, root: Path, caller: BoundedCaller, timeout: float) -> None:
        self.root = root
        self._root = str(root).rstrip("/")
        self._caller = caller
        self._timeout = timeout

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def _abs(self, rel: str) -> str:
        # plain strings: pathlib costs more than the read itself on the 1 s sampling path
        return f"{self._root}/{rel.lstrip('/')}"

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def listdir(self, rel: str) -> list[str]:
        p = self.path(rel)
        try:
            return sorted(self._caller.call("hostfs", f"listdir({rel})", lambda: os.listdir(p),
                                            self._timeout))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise HwFailure(f"cannot list {p}: {exc.strerror}", call=f"listdir({rel})") from None

    def read_text(self, rel: str, component: str = "node") -> str:
        """The stripped text of a file; NotSupported if it is absent, HwFailure if unreadable."""
        p = self.path(rel)
        label = f"read({rel})"

        def read() -> bytes:
            return read_attr(str(p))

        try:
            data = self._caller.call("hostfs", label, read, self._timeout, component)
        except FileNotFoundError:
            raise NotSupported(f"{p} does not exist", call=label, component=component) from None
        except OSError as exc:
            raise HwFailure(f"cannot read {p}: {exc.strerror}", call=label,
                            component=component) from None
        return data.decode("utf-8", errors="replace").strip()

    def read_many(self, rels: list[str], component: str = "node") -> dict[str, str | HwCondition]:
        """Several small files in ONE bounded call: text, or the condition reading it raised.

        Each bounded call is a hand-off to a worker thread; a check sampling dozens
        of sysfs attributes every second should pay for one, not dozens.
        """
        label = f"read({rels[0]} +{len(rels) - 1} more)" if rels else "read()"

        def read_all() -> dict[str, bytes | OSError]:
            out: dict[str, bytes | OSError] = {}
            for rel in rels:
                try:
                    out[rel] = read_attr(self._abs(rel))
                except OSError as exc:
                    out[rel] = exc
            return out

        raw = self._caller.call("hostfs", label, read_all, self._timeout, component)
        return {rel: self._text_or_condition(rel, data, component) for rel, data in raw.items()}

    def _text_or_condition(self, rel: str, data: bytes | OSError, component: str) -> str | HwCondition:
        """A file's stripped text, or the condition its read ended in (absent: NotSupported)."""
        if isinstance(data, FileNotFoundError):
            return NotSupported(f"{self._abs(rel)} does not exist", call=f"read({rel})", component=component)
        if isinstance(data, OSError):
            return HwFailure(f"cannot read {self._abs(rel)}: {data.strerror}", call=f"read({rel})",
                             component=component)
        return data.decode("utf-8", errors="replace").strip()

    def read_batch(self, rels: Sequence[str], components: Mapping[str, str] | None = None, *,
                   label: str | None = None) -> dict[str, str | HwCondition]:
        """``read_many`` for a sampler that reads dozens of attributes every second: every
        file of ``rels`` in ONE bounded call, each read as cheaply as a small sysfs attribute
        allows (see :func:`read_attr`), the condition of each file in its own component
        (``components[rel]``, default "node").

        A read that does not return within the timeout costs only the files from it on:
        those read before it keep their text, the stuck one is ``HwTimeout`` naming that
        file, and the ones after it ``HwTimeout`` "not attempted" (the worker stops there
        once the stuck read returns). A lane still stuck from an earlier call makes every
        file ``HwTimeout``, as ``read_many`` would raise.
        """
        comps = components or {}
        label = label or (f"read({rels[0]} +{len(rels) - 1} more)" if rels else "read()")
        done: dict[str, bytes | OSError] = {}
        # [started, stop]: plain flags, set by one thread and read by the other (an Event
        # costs more than reading a file, and nobody waits on these)
        flags = [False, False]

        def read_all() -> None:
            flags[0] = True
            for rel in rels:
                if flags[1]:
                    return
                try:
                    done[rel] = read_attr(self._abs(rel))
                except OSError as exc:
                    done[rel] = exc

        got, timeout, started = done, None, True
        try:
            self._caller.call("hostfs", label, read_all, self._timeout,
                              comps.get(rels[0], "node") if rels else "node")
        except HwTimeout as exc:
            # started is read before stop is set: a worker that starts after this returns at once
            started = flags[0]
            flags[1] = True
            got, timeout = dict(done), exc  # a copy: the stuck worker may still add to ``done``
        stuck = self._stuck_file(rels, label, got, timeout, started=started)
        result: dict[str, str | HwCondition] = {}
        for rel in rels:
            comp = comps.get(rel, "node")
            data = got.get(rel)
            if data is None:
                assert timeout is not None  # once read_all has returned, every file is in ``done``
                result[rel] = self._not_read(rel, comp, timeout, stuck, hung_now=started)
            else:
                result[rel] = self._text_or_condition(rel, data, comp)
        return result

    def _stuck_file(self, rels: Sequence[str], label: str, got: Mapping[str, object],
                    timeout: HwTimeout | None, *, started: bool) -> str | None:
        """The file a timed-out batch hangs in: the first one it did not get; for a batch
        that never started because the lane is still stuck in an earlier batch, the file
        that one hung in (remembered, since the lane only knows the batch's label)."""
        if timeout is None:
            self._hung_batch = None
            return None
        if started:
            stuck = next((rel for rel in rels if rel not in got), None)
            if stuck is not None:
                self._hung_batch = (label, stuck)
            return stuck
        if self._hung_batch is not None and self._hung_batch[0] == timeout.call:
            return self._hung_batch[1]
        return None

    @staticmethod
    def _not_read(rel: str, comp: str, exc: HwTimeout, stuck: str | None, *, hung_now: bool) -> HwTimeout:
        """Why ``read_batch`` has no text for ``rel``: it hung in this file, or was not
        attempted because of the file that hung (now, or in an earlier call)."""
        if stuck is None:
            return HwTimeout(str(exc), call=exc.call, component=comp, seconds=exc.seconds)
        if hung_now and rel == stuck:
            return HwTimeout(f"read({rel}) did not return within {exc.seconds:g} s", call=f"read({rel})",
                             component=comp, seconds=exc.seconds)
        return HwTimeout(f"read({rel}) not attempted: read({stuck}) has not returned ({exc})",
                         call=f"read({stuck})", component=comp, seconds=exc.seconds)

    def read_int(self, rel: str, component: str = "node", base: int = 0) -> int:
        text = self.read_text(rel, component)
        try:
            return int(text.split()[0], base) if text else int("")
        except ValueError:
            raise HwFailure(f"{self.path(rel)}: expected an integer, read {text[:40]!r}",
                            call=f"read({rel})", component=component) from None

    def boot_id(self) -> str | None:
        try:
            return self.read_text("proc/sys/kernel/random/boot_id") or None
        except (NotSupported, HwFailure):
            return None

    def boot_time(self) -> float | None:
        """Boot time (epoch seconds) from /proc/stat ``btime``; None when unknown."""
        try:
            text = self.read_text("proc/stat")
        except (NotSupported, HwFailure):
            return None
        for line in text.splitlines():
            if line.startswith("btime "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None
