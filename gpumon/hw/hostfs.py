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
from gpumon.hw.calls import BoundedCaller, LaneHung, Step

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


LANE = "hostfs"


class HostFs:
    """Host files under the root, every read bounded (``timeout`` per file).

    Reads run on the ``hostfs`` lane of the bounded caller: several workers, so a file that
    never answers (a sysfs attribute behind a dead device; a FIFO in a test) holds one worker
    and costs only the readings of that file. Until that read returns, reading the same file
    again answers at once with ``LaneHung`` naming it; other files are read as usual.
    """

    def __init__(self, root: Path, caller: BoundedCaller, timeout: float) -> None:
        self.root = root
        self._root = str(root).rstrip("/")
        self._caller = caller
        self._timeout = timeout
        self._boot_id: str | None = None

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
            return sorted(self._caller.call(LANE, f"listdir({rel})", lambda: os.listdir(p),
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
            data = self._caller.call(LANE, label, read, self._timeout, component)
        except FileNotFoundError:
            raise NotSupported(f"{p} does not exist", call=label, component=component) from None
        except OSError as exc:
            raise HwFailure(f"cannot read {p}: {exc.strerror}", call=label,
                            component=component) from None
        return data.decode("utf-8", errors="replace").strip()

    def read_many(self, rels: list[str], component: str = "node") -> dict[str, str | HwCondition]:
        """Several small files in one bounded call: text, or the condition reading it raised.

        Each bounded call is a hand-off to a worker thread; a check sampling dozens
        of sysfs attributes every second should pay for one, not dozens. Each file is
        bounded on its own, as in :meth:`read_batch`.
        """
        label = f"read({rels[0]} +{len(rels) - 1} more)" if rels else "read()"
        return self.read_batch(rels, dict.fromkeys(rels, component), label=label)

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

        Each file is bounded on its own: a read that does not return within the timeout is
        ``HwTimeout`` naming that file, and the files after it are read on another worker
        (another timeout only if another file hangs too). A file whose earlier read is still
        stuck is ``LaneHung`` naming it, at once, without a new attempt. Only when every
        worker of the lane is stuck are the remaining files ``LaneHung`` ("not attempted").
        """
        comps = components or {}
        label = label or (f"read({rels[0]} +{len(rels) - 1} more)" if rels else "read()")
        result: dict[str, str | HwCondition] = {}
        todo = list(rels)
        while todo:
            fresh: list[str] = []
            for rel in todo:
                refusal = self._caller.known_hung(LANE, f"read({rel})", comps.get(rel, "node"))
                if refusal is None:
                    fresh.append(rel)
                else:
                    result[rel] = refusal
            if not fresh:
                break
            todo = self._read_files(fresh, comps, label, result)
        return {rel: result[rel] for rel in rels}

    def _read_files(self, rels: list[str], comps: Mapping[str, str], label: str,
                    result: dict[str, str | HwCondition]) -> list[str]:
        """Read ``rels`` in one bounded call into ``result``; the files still to read (those
        after one that hung)."""
        done: dict[str, bytes | OSError] = {}

        def read_all(step: Step) -> None:
            for rel in rels:
                if not step(f"read({rel})"):
                    return  # the caller gave up on an earlier file: the rest is read elsewhere
                try:
                    done[rel] = read_attr(self._abs(rel))
                except OSError as exc:
                    done[rel] = exc

        rest: list[str] = []
        try:
            self._caller.call_steps(LANE, label, read_all, self._timeout, comps.get(rels[0], "node"))
            got = done
        except LaneHung as exc:
            # every worker of the lane is stuck: nothing more can be read now
            got = {}
            for rel in rels:
                result[rel] = LaneHung(f"read({rel}) not attempted: every {LANE} worker is stuck "
                                       f"(the longest in {exc.call})", call=exc.call,
                                       component=comps.get(rel, "node"), seconds=exc.seconds)
        except HwTimeout as exc:
            got = dict(done)  # a copy: the stuck worker adds the stuck file when (if) it returns
            stuck = next((i for i, rel in enumerate(rels) if rel not in got), None)
            if stuck is not None:  # (None: the last read returned just as its bound passed)
                rel = rels[stuck]
                result[rel] = HwTimeout(f"read({rel}) did not return within {exc.seconds:g} s",
                                        call=f"read({rel})", component=comps.get(rel, "node"),
                                        seconds=exc.seconds)
                rest = rels[stuck + 1:]
        for rel, data in got.items():
            result[rel] = self._text_or_condition(rel, data, comps.get(rel, "node"))
        return rest

    def read_int(self, rel: str, component: str = "node", base: int = 0) -> int:
        text = self.read_text(rel, component)
        try:
            return int(text.split()[0], base) if text else int("")
        except ValueError:
            raise HwFailure(f"{self.path(rel)}: expected an integer, read {text[:40]!r}",
                            call=f"read({rel})", component=component) from None

    def boot_id(self) -> str | None:
        """This boot's id; None when the host has none. A read that hangs gives the id read last
        (the boot does not change under a running process): many things key their state on the
        boot id, and a hung read must not look like a reboot, nor fail them."""
        try:
            boot = self.read_text("proc/sys/kernel/random/boot_id") or None
        except HwTimeout:
            return self._boot_id
        except (NotSupported, HwFailure):
            return None
        self._boot_id = boot
        return boot

    def boot_time(self) -> float | None:
        """Boot time (epoch seconds) from /proc/stat ``btime``; None when unknown."""
        try:
            text = self.read_text("proc/stat")
        except HwCondition:
            return None
        for line in text.splitlines():
            if line.startswith("btime "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None
