"""``gpumon why --metrics-file PATH``: a Prometheus counter of post-mortems by verdict, kept in a
node_exporter textfile-collector file (``why`` is a command, not a daemon: nothing of its own
serves metrics, so the count lives in the file the host's node_exporter already exports).

The file is read, incremented and replaced under an exclusive lock on ``PATH.lock`` (two epilogs
finishing at once must not lose a count), atomically (node_exporter never reads half a file). A
count that cannot be read back (the file is not ours, or mangled) starts again from 0: a counter
reset, which ``rate()`` and ``increase()`` handle. Every verdict is written, 0 or not, so that a
query for one that never happened finds a 0, not nothing.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from gpumon.atomic import write_atomic

METRIC = "gpumon_why_verdicts_total"
VERDICTS = ("infrastructure", "no_infrastructure_evidence", "inconclusive", "cannot_answer")
_LINE = re.compile(rf'^{METRIC}\{{verdict="([a-z_]+)"\}} ([0-9]+(?:\.0+)?)\s*$')


def read_counts(path: Path) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return counts
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in counts:
            counts[m.group(1)] = int(float(m.group(2)))
    return counts


def render(counts: dict[str, int]) -> str:
    lines = [f"# HELP {METRIC} Post-mortems of jobs by gpumon why, by verdict (infrastructure: a suspect "
             "found; no_infrastructure_evidence; inconclusive: nodes unreachable; cannot_answer).",
             f"# TYPE {METRIC} counter"]
    lines += [f'{METRIC}{{verdict="{v}"}} {counts[v]}' for v in VERDICTS]
    return "\n".join(lines) + "\n"


def count_verdict(path: Path, verdict: str) -> dict[str, int]:
    """Add one post-mortem of ``verdict`` to the counter in ``path``; the new counts. Raises OSError."""
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        counts = read_counts(path)
        counts[verdict] += 1
        write_atomic(path, render(counts), durable=False)
        return counts
    finally:
        os.close(fd)
