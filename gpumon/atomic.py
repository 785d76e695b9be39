"""Atomic file replacement: a reader sees the old file or the new one, never half of one, and after
a crash (power loss included) the new one or the old one survives.

Temp file in the same directory, fsync, rename over the target, fsync the directory (the rename
itself is only durable once the directory entry is on disk).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data``; the directory is created when missing. Raises OSError.

    ``durable=False``: atomic for readers but not synced to disk, for files rebuilt at will after a
    crash (a simulated node's ~640 files, rewritten as its scenario runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    # per process and thread: two writers of one path never share (and truncate) one temp file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """fsync a directory, so that a rename in it survives a power loss (not every file system lets a
    directory be opened for that: then the rename is as durable as that system makes it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
