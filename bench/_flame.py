"""Summarise a py-spy ``--format raw`` profile (collapsed stacks): where the samples went.

Each line of the file is ``frame;frame;...;frame COUNT`` (outermost first); with
``--threads`` the first frame is the thread. A frame reads ``function (file:line)``
or ``function (file)``; lines are dropped here so that one function is one row.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME_RE.match(frame.strip())
    if m is None:
        return frame.strip()
    path = m.group("file")
    for marker in ("/gpumon/", "/checks/", "/site-packages/", "/lib/python3"):
        at = path.rfind(marker)
        if at >= 0:
            path = path[at + 1 :]
            break
    return f"{m.group('func')} ({path})"


def load(path: Path) -> list[tuple[list[str], int]]:
    stacks: list[tuple[list[str], int]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        stacks.append(([_name(f) for f in head.split(";")], int(count)))
    return stacks


def summarize(path: Path, *, top: int = 25, threads: bool = True) -> str:
    """Self and inclusive share of samples per function, and per thread when recorded."""
    stacks = load(path)
    total = sum(n for _, n in stacks)
    if not total:
        return f"  (no samples in {path})"
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    per_thread: Counter[str] = Counter()
    for frames, n in stacks:
        body = frames[1:] if threads and frames and frames[0].startswith(("thread ", "process ")) else frames
        if threads and frames:
            per_thread[frames[0]] += n
        if body:
            own[body[-1]] += n
        for f in set(body):
            incl[f] += n
    lines = [f"  {total} samples in {path.name}"]
    if per_thread:
        lines.append("  per thread (share of all samples):")
        for name, n in per_thread.most_common(12):
            lines.append(f"    {100 * n / total:5.1f} %  {name}")
    lines.append(f"  top {top} by inclusive share (the function and what it calls):")
    for name, n in incl.most_common(top):
        lines.append(f"    {100 * n / total:5.1f} %  {name}")
    lines.append(f"  top {top} by self share (samples in the function itself):")
    for name, n in own.most_common(top):
        lines.append(f"    {100 * n / total:5.1f} %  {name}")
    return "\n".join(lines)
