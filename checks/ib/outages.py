"""The ib check's outage arithmetic: one port's samples folded into outage records, counter deltas
and per-minute error buckets, pruned to the windows. Pure: no hardware, no clock of its own.

An outage is measured from the first sample that saw the port down to the first sample that saw it
up again; ``link_downed`` deltas count the outages that began and ended between two samples, with
"at most the gap" as their length. The records themselves, and the closing of an outage, are the
state's (``state``: its reset at a reboot closes an open outage too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .state import RATE_COUNTERS, Port, cap, close, record

if TYPE_CHECKING:
    from gpumon.hw.infiniband import IbPort

    from .options import IbConfig

BUCKET_S = 60.0


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
