"""nccl-tests output (``all_reduce_perf`` and the other ``*_perf`` binaries of NVIDIA/nccl-tests).

Shapes (captures in tests/data/nccl-tests):

- settings: ``# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5
  iters: 20 agg iters: 1 validation: 1 graph: 0`` (2.19 adds ``unalign: 0`` and is preceded by
  ``# nccl-tests version 2.19.6 ...`` and ``# Collective test starting: all_reduce_perf``);
- ranks: ``#  Rank  0 Group  0 Pid   6899 on host device  0 [0000:04:00] NVIDIA H100 80GB HBM3``;
- rows, two formats:

  * modern (13 fields): ``size count type redop root | time algbw busbw #wrong`` out-of-place, then
    the same four in place; ``#wrong`` is the number of wrong elements (an integer, ``N/A`` with
    validation off);
  * legacy (2020 and before, 11 fields): ``size count type | time algbw busbw error`` twice, where
    ``error`` is the largest deviation found (``0e+00``), not a count; some 2.x builds print a
    ``redop`` column without ``root`` (12 fields). Rows are read from the right, so all three parse.

- footer: ``# Out of bounds values : 0 OK`` (``FAILED`` with a count above 0) and
  ``# Avg bus bandwidth    : 70.742``;
- ``# Reducing maxBytes to <n> due to memory limitation`` (src/common.cu, after the rank list) when
  the GPUs lack memory for ``-e``: the sweep then stops below the size asked for.

Bandwidths are GB/s as nccl-tests prints them (10^9 bytes/s). A cut-off output (a paste, or a run
killed mid-sweep) still parses: :attr:`NcclResult.problem` says what is missing, so a check can
answer ``unknown`` with that reason. Nothing recognisable at all is a :class:`NcclParseError`.

:func:`run_all_reduce_perf` runs one sweep of ``all_reduce_perf`` on this node's GPUs through the
:class:`~gpumon.hw.tools.ToolRunner` (an argv list, bounded, the process group killed on timeout)
and returns the parsed result together with what stops it from being judged, in the tool's words.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpumon.errors import HwCondition
from gpumon.hw.tools import ToolResult, ToolRunner


class NcclParseError(ValueError):
    """Text that holds no nccl-tests output."""


@dataclass(frozen=True)
class NcclPoint:
    """One half of a row (out-of-place or in-place). None where nccl-tests printed ``N/A``."""

    time_us: float | None
    algbw_gbs: float | None
    busbw_gbs: float | None
    wrong: int | None = None  # modern: wrong elements
    error: float | None = None  # legacy: largest deviation


@dataclass(frozen=True)
class NcclRow:
    size: int
    count: int
    dtype: str
    redop: str | None
    root: int | None
    out_of_place: NcclPoint
    in_place: NcclPoint

    @property
    def wrong(self) -> int | None:
        """Wrong elements over both halves; None when this format has no count (legacy) or N/A."""
        counts = [p.wrong for p in (self.out_of_place, self.in_place)]
        if any(c is None for c in counts):
            return None
        return sum(c for c in counts if c is not None)

    @property
    def busbw_gbs(self) -> float | None:
        """The better of the two halves: in-place and out-of-place measure the same links."""
        values = [v for v in (self.out_of_place.busbw_gbs, self.in_place.busbw_gbs) if v is not None]
        return max(values) if values else None


@dataclass(frozen=True)
class NcclRank:
    rank: int
    host: str
    device: int
    bus_id: str
    name: str


@dataclass(frozen=True)
class NcclResult:
    collective: str | None
    version: str | None
    settings: Mapping[str, str]
    ranks: tuple[NcclRank, ...]
    rows: tuple[NcclRow, ...]
    legacy: bool  # rows carry an ``error`` deviation instead of a ``#wrong`` count
    out_of_bounds: int | None
    out_of_bounds_ok: bool | None
    avg_busbw_gbs: float | None
    # the "# Avg bus bandwidth" footer was seen: the sweep ran to its end
    complete: bool
    malformed: tuple[str, ...] = ()
    reduced_max_bytes: int | None = None  # the tool lowered -e for lack of GPU memory

    @property
    def wrong_elements(self) -> int | None:
        """Wrong elements over every row, or None when no row carries a count."""
        counts = [r.wrong for r in self.rows if r.wrong is not None]
        return sum(counts) if counts else None

    @property
    def peak_busbw_gbs(self) -> float | None:
        values = [b for r in self.rows if (b := r.busbw_gbs) is not None]
        return max(values) if values else None

    def busbw_at(self, size: int) -> float | None:
        for row in self.rows:
            if row.size == size:
                return row.busbw_gbs
        return None

    @property
    def problem(self) -> str | None:
        """Why this result cannot be judged as a whole, or None."""
        if self.malformed:
            return (f"{len(self.malformed)} row(s) that do not have nccl-tests' shape, "
                    f"e.g. {self.malformed[0]!r}")
        if not self.rows:
            where = "the rank list" if self.ranks else "the settings line" if self.settings else "the start"
            return f"no result rows (the output ends after {where})"
        if not self.complete:
            return (f"no '# Avg bus bandwidth' footer after {len(self.rows)} row(s): the output was cut off "
                    f"at {self.rows[-1].size} bytes")
        return None


_SETTINGS_WORDS = re.compile(r"\b(nThread|nGpus|minBytes|maxBytes)\s+(\S+)")
_SETTINGS_COLON = re.compile(r"\b(warmup iters|agg iters|iters|step|validation|graph|unalign|check):\s*(\S+)")
_RANK_RE = re.compile(r"^#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+"
                      r"\[([^\]]*)\]\s*(.*?)\s*$")
_VERSION_RE = re.compile(r"^#\s*nccl-tests version\s+(\S+)")
_STARTING_RE = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s+(\w+)")
_AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_REDUCED_RE = re.compile(r"^#\s*Reducing maxBytes to\s+(\d+)")
_PERF_BIN_RE = re.compile(r"(?:^|[/\s])(\w+_perf)\b")
_INT_RE = re.compile(r"^-?\d+$")
_NUM_RE = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def _num(token: str) -> float | None:
    if token == "N/A":
        return None
    if not _NUM_RE.match(token) or not math.isfinite(float(token)):
        raise ValueError(token)
    return float(token)


def _point(tokens: list[str], legacy: bool | None) -> tuple[NcclPoint, bool]:
    time_us, algbw, busbw, last = tokens
    t, a, b = _num(time_us), _num(algbw), _num(busbw)
    if last == "N/A":
        return NcclPoint(t, a, b), bool(legacy)
    is_legacy = legacy if legacy is not None else not _INT_RE.match(last)
    if is_legacy:
        error = _num(last)
        return NcclPoint(t, a, b, error=error), True
    if not _INT_RE.match(last):
        raise ValueError(last)
    return NcclPoint(t, a, b, wrong=int(last)), False


def parse_row(line: str, legacy: bool | None = None) -> tuple[NcclRow, bool] | None:
    """One result row, read from the right; None when the line is not a row at all.

    ``legacy``: what the table header said (``error`` vs ``#wrong``), None when no header was seen.
    """
    tokens = line.split()
    if len(tokens) not in (11, 12, 13) or not _INT_RE.match(tokens[0]) or not _INT_RE.match(tokens[1]):
        return None
    head, oop, inp = tokens[:-8], tokens[-8:-4], tokens[-4:]
    dtype = head[2]
    if not re.match(r"^[A-Za-z][A-Za-z0-9_]*$", dtype):
        return None
    redop: str | None = None
    root: int | None = None
    for extra in head[3:]:
        if _INT_RE.match(extra):
            root = int(extra)
        else:
            redop = extra
    try:
        out_of_place, legacy_a = _point(oop, legacy)
        in_place, legacy_b = _point(inp, legacy)
    except ValueError:
        return None
    row = NcclRow(int(tokens[0]), int(tokens[1]), dtype, redop, root, out_of_place, in_place)
    return row, legacy_a or legacy_b


@dataclass
class _Builder:
    collective: str | None = None
    version: str | None = None
    settings: dict[str, str] = field(default_factory=dict)
    ranks: list[NcclRank] = field(default_factory=list)
    rows: list[NcclRow] = field(default_factory=list)
    legacy: bool | None = None
    legacy_rows: bool = False
    oob: int | None = None
    oob_ok: bool | None = None
    avg: float | None = None
    complete: bool = False
    malformed: list[str] = field(default_factory=list)
    reduced_max_bytes: int | None = None

    @property
    def started(self) -> bool:
        return bool(self.settings or self.ranks or self.rows or self.version or self.complete)

    @property
    def finished_table(self) -> bool:
        return bool(self.rows or self.complete)

    def result(self) -> NcclResult:
        return NcclResult(self.collective, self.version, dict(self.settings), tuple(self.ranks),
                          tuple(self.rows), self.legacy_rows, self.oob, self.oob_ok, self.avg, self.complete,
                          tuple(self.malformed), self.reduced_max_bytes)


def parse_all(text: str) -> list[NcclResult]:
    """Every test in the text (one ``*_perf`` run after another); NcclParseError when there is none."""
    results: list[NcclResult] = []
    cur = _Builder()
    pending_collective: str | None = None

    def new() -> _Builder:
        nonlocal pending_collective
        if cur.started:
            results.append(cur.result())
        fresh = _Builder(collective=pending_collective)
        pending_collective = None
        return fresh

    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            if m := _VERSION_RE.match(stripped):
                if cur.started:
                    cur = new()
                cur.version = m.group(1)
            elif m := _STARTING_RE.match(stripped):
                if cur.finished_table:
                    cur = new()
                cur.collective = m.group(1)
            elif "nThread" in stripped and "nGpus" in stripped:
                if cur.finished_table or cur.settings:
                    cur = new()
                cur.settings.update(_SETTINGS_WORDS.findall(stripped))
                cur.settings.update(_SETTINGS_COLON.findall(stripped))
            elif m := _RANK_RE.match(stripped):
                cur.ranks.append(NcclRank(int(m.group(1)), m.group(2), int(m.group(3)), m.group(4),
                                          m.group(5)))
            elif m := _OOB_RE.match(stripped):
                cur.oob, cur.oob_ok = int(m.group(1)), m.group(2).upper() == "OK"
            elif m := _AVG_RE.match(stripped):
                cur.avg = float(m.group(1))
                cur.complete = True
            elif m := _REDUCED_RE.match(stripped):
                cur.reduced_max_bytes = int(m.group(1))
            elif re.search(r"\bsize\b.*\bcount\b.*\btype\b", stripped):
                cur.legacy = "#wrong" not in stripped and bool(re.search(r"\berror\b", stripped))
            continue
        parsed = parse_row(stripped, cur.legacy)
        if parsed is not None:
            if cur.complete:
                cur = new()
            row, legacy_row = parsed
            cur.rows.append(row)
            cur.legacy_rows = cur.legacy_rows or legacy_row
            continue
        if cur.started and not cur.complete and (re.match(r"^\d+\s+\d+\s", stripped) or (
                re.match(r"^\d+\s", stripped) and len(stripped.split()) >= 8)):
            # starts like a row but is not one: a mangled line inside the table (a row's size
            # followed by anything but its count is one too; NCCL's own log lines start with
            # host:pid:tid, never with a bare number)
            cur.malformed.append(stripped[:120])
            continue
        if m := _PERF_BIN_RE.search(stripped):
            # a command line (./broadcast_perf -b 8 ..., mpirun ... all_reduce_perf): names what follows
            pending_collective = m.group(1)
            if cur.finished_table:
                cur = new()
            elif not cur.collective:
                cur.collective = pending_collective
                pending_collective = None
    if cur.started:
        results.append(cur.result())
    if not results:
        raise NcclParseError("no nccl-tests output found (no settings line, rank list or result row)")
    return results


def parse(text: str) -> NcclResult:
    """The first test of the text (an ``all_reduce_perf`` run prints one)."""
    return parse_all(text)[0]


# --------------------------------------------------------------------------- running all_reduce_perf

ALL_REDUCE_PERF = "all_reduce_perf"
# nccl-tests exits 1 when its average busbw is below this (common.cu); the check judges busbw itself
# against the profile, at its own sizes, so a site's value must not turn into a second verdict
_MIN_BW_ENV = "NCCL_TESTS_MIN_BW"
_WORDS = ("failure", "failed", "error", "warn", "invalid", "unable", "cannot", "no cuda")


@dataclass(frozen=True)
class PerfSpec:
    """One ``all_reduce_perf`` sweep on this node's GPUs, in one process (``-g`` GPUs, one thread)."""

    min_bytes: int
    max_bytes: int
    step_factor: int
    gpus: int
    iterations: int
    warmup: int
    binary: str = ALL_REDUCE_PERF

    def argv(self) -> list[str]:
        # NVIDIA/nccl-tests README.md "Arguments": -b/--minbytes, -e/--maxbytes, -f/--stepfactor,
        # -g/--ngpus (GPUs per thread), -n/--iters, -w/--warmup_iters, -c/--check <check iteration
        # count> (1: the results are checked once, which fills the #wrong columns)
        return [self.binary, "-b", str(self.min_bytes), "-e", str(self.max_bytes),
                "-f", str(self.step_factor), "-g", str(self.gpus), "-n", str(self.iterations),
                "-w", str(self.warmup), "-c", "1"]

    def sizes(self) -> tuple[int, ...]:
        """What the tool measures: ``for (size = minbytes; size <= maxbytes; size *= stepfactor)``
        (nccl-tests src/common.cu), so ``max_bytes`` itself only when the factor reaches it
        (``sweep_start`` gives a start that does)."""
        out = []
        size = self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            if self.step_factor < 2:
                break
            size *= self.step_factor
        return tuple(out)


def sweep_start(min_bytes: int, max_bytes: int, factor: int) -> tuple[int, str | None]:
    """The ``-b`` whose series ends exactly on ``max_bytes``, and why it is above ``min_bytes``, if it is.

    nccl-tests measures ``for (size = minbytes; size <= maxbytes; size *= stepfactor)``: from any
    other start the series can stop short of ``-e`` (1 MiB x8 steps ends at 4 GiB under 16 GiB), and
    the size the profile is judged at is then never measured. So the start is ``max_bytes / factor^k``
    for the largest k that keeps it at least ``min_bytes``, dividing only while the division is exact.
    """
    if factor < 2 or not 0 < min_bytes <= max_bytes:
        raise ValueError(f"no x{factor} sweep from {min_bytes} to {max_bytes} bytes")
    start = max_bytes
    while start // factor >= min_bytes:
        if start % factor:
            return start, (f"the sweep starts at {start} bytes, not at min_bytes {min_bytes}: {start} is not "
                           f"a multiple of the step factor {factor}, so no smaller size reaches max_bytes "
                           f"{max_bytes} in x{factor} steps")
        start //= factor
    return start, None


@dataclass(frozen=True)
class PerfRun:
    """One run of the tool: its parsed result, or why there is none."""

    argv: tuple[str, ...]
    result: NcclResult | None = None
    # why the result cannot be judged as a whole (cut off, not parseable, a failing exit status),
    # with the tool's own words; a result with wrong elements is still returned alongside
    problem: str | None = None
    condition: HwCondition | None = None  # not installed, hung (killed), could not start
    returncode: int | None = None
    seconds: float = 0.0
    table: tuple[str, ...] = ()  # the tool's own table lines, for the report
    tail: tuple[str, ...] = ()  # its last output lines (stdout, then stderr's marked), for a failure

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def tool_words(result: ToolResult, limit: int = 3) -> str:
    """What the tool said about a failure: its error lines (CUDACHECK/NCCLCHECK print
    ``<host>: Test CUDA failure common.cu:N '...'`` on stdout), else its last line."""
    lines = [ln.strip() for ln in (result.stderr + "\n" + result.stdout).splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith("#") and any(w in ln.lower() for w in _WORDS)]
    if not said:
        said = lines[-1:]
    return "; ".join(ln[:200] for ln in said[:limit])


def table_lines(text: str, limit: int = 200) -> tuple[str, ...]:
    """The result table as the tool printed it: column header to the bandwidth footer."""
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not out and not re.search(r"^#.*\b(out-of-place|size)\b", line):
            continue
        out.append(line)
        if _AVG_RE.match(line.strip()) or len(out) >= limit:
            break
    return tuple(out)


def output_tail(result: ToolResult, limit: int = 20) -> tuple[str, ...]:
    """The last lines it printed: where a rank died, its CUDA/NCCL error is among them."""
    out = [ln.rstrip()[:300] for ln in result.stdout.splitlines() if ln.strip()][-limit:]
    err = [f"[stderr] {ln.rstrip()[:300]}" for ln in result.stderr.splitlines() if ln.strip()][-limit:]
    return tuple(out + err)


def judge_output(argv: tuple[str, ...], result: ToolResult) -> PerfRun:
    """A finished run's output: the parsed result and, where it cannot be judged, why."""
    words = tool_words(result)
    parsed: NcclResult | None = None
    try:
        parsed = parse(result.stdout)
        problem = parsed.problem
        if problem is None and result.returncode != 0:
            problem = f"exit status {result.returncode} after a complete sweep"
    except NcclParseError as exc:
        problem = f"exit status {result.returncode}: {exc}"
    if problem is not None and words and (result.returncode != 0 or parsed is None):
        problem += f"; it said: {words}"
    return PerfRun(argv, parsed, problem, returncode=result.returncode, seconds=result.seconds,
                   table=table_lines(result.stdout), tail=output_tail(result))


def run_all_reduce_perf(tools: ToolRunner, spec: PerfSpec, *, timeout: float) -> PerfRun:
    """Run the sweep through the bounded tool runner; a missing or hung tool is ``condition``."""
    argv = tuple(spec.argv())
    env = {k: v for k, v in os.environ.items() if k != _MIN_BW_ENV}
    try:
        result = tools.run(list(argv), timeout=timeout, env=env)
    except HwCondition as cond:
        return PerfRun(argv, condition=cond)
    return judge_output(argv, result)
