"""What a job's own log says about its failure: PyTorch's NCCL watchdog, NCCL's warnings, its settings.

Formats, as PyTorch and NCCL print them (real examples are the fixtures of tests/why):

- ProcessGroupNCCL's watchdog (PyTorch >= 2.0; older ones lack NumelIn/NumelOut)::

    [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective
    operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168,
    Timeout(ms)=600000) ran for 600060 milliseconds before timing out.
    ... [PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580, last
    enqueued NCCL work: 1582, last completed NCCL work: 1579.

- NCCL's own lines (``NCCL_DEBUG=INFO``/``WARN``)::

    NCCL version 2.18.5+cuda12.2
    host:986:1338 [6] NCCL INFO NCCL_IB_TIMEOUT set by environment to 18.
    host:2200689:2200706 [3] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote
    peer gpu004.example.com<55693>
    host:25146:25854 [0] ib_plugin.c:1105 NCCL WARN NET/IB : Got completion from peer 10.0.35.1<49189>
    with status=12 ...

The glog time stamp of the watchdog line has neither year nor zone, so it is not used to place the
failure: the job's end (Slurm, or ``--end``) does that; ``ran for`` says how long before it the stuck
collective was enqueued.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WATCHDOG = re.compile(
    r"(?:\[Rank (?P<rank>\d+)\]\s*)?Watchdog caught collective operation timeout: "
    r"WorkNCCL\((?P<fields>[^)]*?Timeout\(ms\)=\d+[^)]*)\) ran for (?P<ran>\d+) milliseconds")
_FIELD = re.compile(r"(\w+)=([^,]+)")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)")
_AT_WORK = re.compile(r"Rank (?P<rank>\d+)\] Exception \(either an error or timeout\) detected by watchdog "
                      r"at work: (?P<work>\d+), last enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL "
                      r"work: (?P<done>-?\d+)")
_PEER_CLOSED = re.compile(r"Connection closed by remote peer (?P<peer>[^\s<]+)(?:<\d+>)?", re.IGNORECASE)
_IB_COMPLETION = re.compile(r"NET/IB : Got completion from peer (?P<peer>[^\s<]+)(?:<\d+>)?\s+with "
                            r"(?:status=|error )(?P<status>\d+)")
_VERSION = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)")
_SET_BY_ENV = re.compile(r"NCCL INFO (?P<name>NCCL_[A-Z_]+) set by environment to (?P<value>[^\s.]+)")
# a line can be a whole log of one rank glued together: nothing beyond this is read per line
_MAX_LINE = 64 << 10
MAX_LOG_BYTES = 256 << 20


@dataclass(frozen=True)
class Timeout:
    rank: int | None
    seq: int | None
    op: str | None
    timeout_ms: int
    ran_ms: int
    fields: dict[str, str]
    line: int


@dataclass
class JobLog:
    path: str
    timeouts: list[Timeout] = field(default_factory=list)
    # rank -> (work at which the watchdog fired, last enqueued, last completed)
    progress: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    peers_closed: dict[str, int] = field(default_factory=dict)  # remote peer -> lines
    ib_completions: dict[str, list[int]] = field(default_factory=dict)  # peer -> statuses
    nccl_version: str | None = None
    nccl_env: dict[str, str] = field(default_factory=dict)
    lines: int = 0

    @property
    def watchdog_timeout_s(self) -> float | None:
        values = {t.timeout_ms for t in self.timeouts}
        return max(values) / 1000.0 if values else None

    @property
    def stuck(self) -> Timeout | None:
        """The collective the watchdog gave up on: the lowest sequence number timed out (the
        first one stuck; later ones queued behind it)."""
        if not self.timeouts:
            return None
        return min(self.timeouts, key=lambda t: (t.seq if t.seq is not None else 1 << 62, t.line))

    def to_json(self) -> dict[str, Any]:
        stuck = self.stuck
        return {"path": self.path, "lines": self.lines,
                "watchdog_timeout_s": self.watchdog_timeout_s,
                "stuck_collective": None if stuck is None else {
                    "op": stuck.op, "seq": stuck.seq, "timeout_ms": stuck.timeout_ms,
                    "ran_ms": stuck.ran_ms, "fields": stuck.fields},
                "ranks_timed_out": sorted({t.rank for t in self.timeouts if t.rank is not None}),
                "progress": {str(r): {"work": w, "last_enqueued": e, "last_completed": d}
                             for r, (w, e, d) in sorted(self.progress.items())},
                "peers_closed": dict(sorted(self.peers_closed.items())),
                "ib_completion_errors": {p: sorted(set(s)) for p, s in sorted(self.ib_completions.items())},
                "nccl_version": self.nccl_version, "nccl_env": dict(sorted(self.nccl_env.items()))}


def parse_lines(lines: Iterable[str], path: str = "-") -> JobLog:
    log = JobLog(path)
    for n, raw in enumerate(lines, 1):
        log.lines = n
        line = raw[:_MAX_LINE]
        if "NCCL" not in line and "Watchdog" not in line and "peer" not in line:
            continue
        for m in _WATCHDOG.finditer(line):
            fields = {k: v.strip() for k, v in _FIELD.findall(m.group("fields"))}
            tm = _TIMEOUT_MS.search(m.group("fields"))
            seq = fields.get("SeqNum")
            log.timeouts.append(Timeout(
                rank=int(m.group("rank")) if m.group("rank") else None,
                seq=int(seq) if seq and seq.isdigit() else None, op=fields.get("OpType"),
                timeout_ms=int(tm.group(1)) if tm else 0, ran_ms=int(m.group("ran")),
                fields={k: v for k, v in fields.items() if k != "Timeout"}, line=n))
        if (w := _AT_WORK.search(line)) is not None:
            log.progress[int(w.group("rank"))] = (int(w.group("work")), int(w.group("enq")),
                                                  int(w.group("done")))
        if (p := _PEER_CLOSED.search(line)) is not None:
            log.peers_closed[p.group("peer")] = log.peers_closed.get(p.group("peer"), 0) + 1
        if (c := _IB_COMPLETION.search(line)) is not None:
            log.ib_completions.setdefault(c.group("peer"), []).append(int(c.group("status")))
        if log.nccl_version is None and (v := _VERSION.search(line)) is not None:
            log.nccl_version = v.group("v")
        if (e := _SET_BY_ENV.search(line)) is not None:
            log.nccl_env[e.group("name")] = e.group("value")
    return log


def parse_file(path: Path) -> JobLog:
    """Raises OSError; a log larger than MAX_LOG_BYTES is read from its end (where a failure is)."""
    with path.open("rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - MAX_LOG_BYTES))
        text = fh.read().decode("utf-8", errors="replace")
    return parse_lines(text.splitlines(), str(path))
