"""The in-job pace of this node's GPUs, from the pace files that guarded jobs write into the spool."""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator
from pathlib import Path

from gpumon.guard import verdict as vf
from gpumon.hw.placement import normalize_uuid


def pace_scores(directory: Path, by_uuid: dict[str | None, int], now: float,
          max_age_s: float, max_scan: int) -> list[tuple[int, float]]:
    """(GPU index, pace score) of this node's GPUs from fresh pace files (the newest file per GPU);
    at most 200 files, the first by name among at most ``max_scan`` entries (any job can write there)."""
    if not directory.is_dir():
        return []
    newest: dict[int, tuple[float, float]] = {}

    def names() -> Iterator[str]:
        with os.scandir(directory) as entries:
            for i, entry in enumerate(entries):
                if i >= max_scan:
                    return
                # a regular file only: opening a FIFO would wait for a writer
                if entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
                    yield entry.name

    try:
        files = [directory / name for name in heapq.nsmallest(200, names())]
    except OSError:
        return []
    for path in files:
        try:
            when, _, rows = vf.read_pace(path)
        except (vf.VerdictError, OSError):
            continue
        if now - when > max_age_s:
            continue
        for row in rows:
            index = by_uuid.get(normalize_uuid(row.gpu_uuid)) if row.gpu_uuid else None
            if index is not None and (index not in newest or newest[index][0] < when):
                newest[index] = (when, row.pace)
    return [(i, score) for i, (_, score) in newest.items()]
