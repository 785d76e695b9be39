"""The ib check's outage arithmetic: one port's samples folded into outage records, counter deltas
and per-minute error buckets, pruned to the windows. Pure: no hardware, no clock of its own.

An outage is measured from the first sample that saw the port down to the first sample that saw it
up again; ``link_downed`` deltas count the outages that began and ended between two samples, with
"at most the gap" as their length; beyond :data:`MAX_RECORDS` records per port the two oldest are
merged, so a port flapping every second cannot grow the persisted state without bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumon.hw.infiniband import IbPort

    from .check import IbConfig
    from .state import Port

# How many outage records one port keeps; beyond it the two oldest are merged.
MAX_RECORDS = 128
RATE_COUNTERS = ("symbol_error", "link_error_recovery")
BUCKET_S = 60.0


@dataclass
class Record:
    """Outages of one port: one measured outage, those seen only through link_downed between two
    samples (``n`` of them, each at most the gap long), or older records merged (``cap``)."""

    start: float
    end: float
    down_s: float
    max_s: float
    longest_s: float
    n: int
    kind: str


def record(start: float, end: float, down_s: float, max_s: float, kind: str, n: int = 1) -> Record:
    # clamped: a wall clock stepped back (NTP) must not make a negative outage
    down_s, max_s = max(0.0, down_s), max(0.0, max_s)
    return Record(start, max(start, end), down_s, max(down_s, max_s), down_s, n, kind)


def close(p: Port, *, end: float, kind: str) -> None:
    start = p.down_since
    assert start is not None  # only an open outage is closed
    prev_up = p.down_prev_up
    p.outages.append(record(start, end, end - start, end - (prev_up if prev_up is not None else start),
                                kind))
    p.down_since = p.down_prev_up = p.last_down_t = None
    cap(p.outages)


def cap(records: list[Record]) -> None:
    while len(records) > MAX_RECORDS:
        a, b = records[0], records.pop(1)
        records[0] = Record(min(a.start, b.start), max(a.end, b.end), a.down_s + b.down_s, a.max_s + b.max_s,
                             max(a.longest_s, b.longest_s), a.n + b.n, "merged")


def sample(p: Port, up: bool, now: float, port: IbPort | None) -> bool:
    """Fold one sample (or a missing port, ``port`` None, counted as down) into the port's state.
    True when an outage opened or closed, or one was seen through link_downed: what a crash
    must not lose (the caller saves the state at once)."""
    prev_t = p.last_t
    opened = closed = counted = False
    if up:
        if p.down_since is not None:
            kind = "missing" if p.missing_since is not None else "state"
            close(p, end=now, kind=kind if p.seen_up else f"{kind} (down at first reading)")
            closed = True
        p.seen_up = True
    else:
        # A port down at its first reading (at boot, at daemon start) is timed from that
        # reading: it has been down at least that long.
        if p.down_since is None:
            opened = True
            p.down_since = now
            p.down_prev_up = prev_t if p.last_up else None
        p.last_down_t = now
    if port is not None:
        deltas = counter_deltas(p, port)
        extra = deltas.get("link_downed", 0) - (1 if opened else 0)
        if extra > 0 and prev_t is not None:
            # Outages that began and ended between two samples: the counter saw them,
            # the state never did. Their length is unknown, at most the gap.
            p.outages.append(record(prev_t, now, 0.0, (now - prev_t) * extra, "link_downed", extra))
            cap(p.outages)
            counted = True
        for counter in RATE_COUNTERS:
            if deltas.get(counter, 0) > 0:
                add_bucket(p.buckets[counter], now, deltas[counter])
    p.last_t = now
    p.last_up = up
    return opened or closed or counted


def counter_deltas(p: Port, port: IbPort) -> dict[str, int]:
    """Increase of each counter since the last sample; the first reading is a baseline and a
    counter that went backwards was reset (driver reload, perfquery -R): no delta either way."""
    out: dict[str, int] = {}
    last: dict[str, int] = p.counters
    for name, value in port.counters.items():
        prev = last.get(name)
        if prev is not None and value >= prev:
            out[name] = value - prev
        elif prev is not None:
            p.resets += 1
        last[name] = value
    return out


def add_bucket(buckets: list[list[float]], now: float, count: int) -> None:
    start = math.floor(now / BUCKET_S) * BUCKET_S
    if buckets and buckets[-1][0] == start:
        buckets[-1][1] += count
    else:
        buckets.append([start, float(count)])


def prune(p: Port, now: float, options: IbConfig) -> None:
    p.outages = [r for r in p.outages if r.end > now - options.window_s]
    for counter in RATE_COUNTERS:
        p.buckets[counter] = [b for b in p.buckets[counter]
                                 if b[0] + BUCKET_S > now - options.rate_window_s]


def per_hour(p: Port, counter: str, now: float, options: IbConfig) -> float:
    total = sum(b[1] for b in p.buckets[counter] if b[0] + BUCKET_S > now - options.rate_window_s)
    return float(total * 3600.0 / options.rate_window_s)
