"""perftest's ``ib_write_bw`` (linux-rdma/perftest): its output, and a host-loopback run of it.

Output shape (captures in tests/data/perftest, three perftest generations):

- a header block of ``Key : Value`` settings, two per line on some versions, separated by
  tabs or by runs of spaces (``Dual-port       : OFF\\t\\tDevice         : mlx5_0``);
- a result header ``#bytes  #iterations  BW peak[Gb/sec]  BW average[Gb/sec]  MsgRate[Mpps]``
  (``iterations`` without ``#`` on some builds; ``[MB/sec]`` without ``--report_gbits``);
- one row per message size, numbers printed with mixed precision and alignment (``0.042350``
  next to ``0.17``, tabs inside a row), closed by a dashed rule.

Units: perftest divides bytes/s by ``format_factor = (report_fmt == MBS) ? 0x100000 : 125000000``
(perftest src/perftest_parameters.c, ``print_report_bw``): MB/sec is 2^20 bytes/s and Gb/sec is
10^9 bits/s. Both are converted to Gb/s here so that a profile's link rate compares directly.

Anything else (no result header, a row that is not numbers) is a :class:`PerftestParseError` naming
what was found: the check turns it into ``unknown``, never into a bandwidth.

The loopback runner starts the server and the client of one measurement on this host, pinned to one
RDMA device (``-d mlx5_N``), through the :class:`~gpumon.hw.tools.ToolRunner` (argv lists, bounded,
process groups killed on timeout).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpumon.errors import HwCondition
from gpumon.hw.tools import ToolResult, ToolRunner

GBPS = "Gb/sec"
MBPS = "MB/sec"
# perftest's MB/sec is 0x100000 bytes per second (format_factor, see the module docstring)
MB_PER_S_IN_GBPS = float(1 << 20) * 8 / 1e9
_UNITS = {GBPS: 1.0, MBPS: MB_PER_S_IN_GBPS}

_SETTING_RE = re.compile(r"([^\t:]+?)\s*:\s*(\S+)")
_COLUMN_RE = re.compile(r"#?bytes|#?iterations|BW peak\[[^\]]*\]|BW average\[[^\]]*\]|MsgRate\[[^\]]*\]")
_RULE_RE = re.compile(r"^\s*-{10,}\s*$")
_ERROR_WORDS = ("couldn't", "could not", "unable", "failed", "error", "unrecognized", "invalid")


class PerftestParseError(ValueError):
    """Output that holds no bandwidth result table (or a broken one)."""


@dataclass(frozen=True)
class BwRow:
    """One message size. Bandwidths in Gb/s whatever unit perftest printed; ``peak_gbps`` is None
    when the build prints no peak column."""

    size: int
    iterations: int
    peak_gbps: float | None
    average_gbps: float
    msg_rate_mpps: float | None


@dataclass(frozen=True)
class BwReport:
    test: str | None  # "RDMA_Write BW Test", "RDMA_Write Post List BW Test", ...
    settings: Mapping[str, str]
    unit: str  # the unit perftest printed: Gb/sec or MB/sec
    rows: tuple[BwRow, ...]
    # the dashed rule after the rows was seen: the table was printed to its end
    complete: bool

    @property
    def device(self) -> str | None:
        return self.settings.get("Device")

    @property
    def link_type(self) -> str | None:
        return self.settings.get("Link type")

    def at_size(self, size: int) -> BwRow | None:
        for row in self.rows:
            if row.size == size:
                return row
        return None

    @property
    def largest(self) -> BwRow:
        """The row of the largest message: the one that measures bandwidth rather than latency."""
        return max(self.rows, key=lambda r: r.size)


def _reason(lines: Sequence[str]) -> str:
    for line in lines:
        low = line.lower()
        if any(w in low for w in _ERROR_WORDS):
            return line.strip()[:200]
    return ""


def parse_bw(text: str) -> BwReport:
    """Parse ``ib_*_bw`` output; PerftestParseError when it holds no result table."""
    lines = text.splitlines()
    settings: dict[str, str] = {}
    test: str | None = None
    header: list[str] | None = None
    rows: list[BwRow] = []
    complete = False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if header is None:
            if "#bytes" in line or re.match(r"^\s*bytes\s+#?iterations", line):
                header = _COLUMN_RE.findall(line)
                if not any(c.startswith("BW average") for c in header):
                    raise PerftestParseError(f"line {number}: result header without a 'BW average' column: "
                                             f"{stripped[:120]!r}")
                continue
            if stripped.endswith("BW Test") and ":" not in stripped:
                test = stripped
            elif ":" in line and "address:" not in line and not _RULE_RE.match(line):
                for key, value in _SETTING_RE.findall(line):
                    settings.setdefault(key.strip(), value.strip())
            continue
        if _RULE_RE.match(line):
            complete = bool(rows)
            break
        if not stripped:
            continue
        fields = stripped.split()
        try:
            numbers = [float(f) for f in fields]
        except ValueError:
            # the run ended mid-table (an error message, a shell prompt): what came before stands
            break
        if not all(math.isfinite(n) and n >= 0 for n in numbers):
            raise PerftestParseError(f"line {number}: a value that is not a finite, non-negative number: "
                                     f"{stripped[:120]!r}")
        if len(numbers) != len(header):
            raise PerftestParseError(f"line {number}: {len(numbers)} numbers where the header has "
                                     f"{len(header)} columns: {stripped[:120]!r}")
        rows.append(_row(header, numbers))
    if header is None:
        why = _reason(lines)
        raise PerftestParseError("no bandwidth table in the output (no '#bytes' header)"
                                 + (f"; perftest said: {why!r}" if why else ""))
    if not rows:
        raise PerftestParseError("bandwidth table header but no result rows"
                                 + (f"; perftest said: {_reason(lines)!r}" if _reason(lines) else ""))
    unit = next(c for c in header if c.startswith("BW average"))[len("BW average["):-1]
    if unit not in _UNITS:
        raise PerftestParseError(f"unknown bandwidth unit {unit!r} (expected Gb/sec or MB/sec)")
    factor = _UNITS[unit]
    converted = tuple(BwRow(r.size, r.iterations, None if r.peak_gbps is None else r.peak_gbps * factor,
                            r.average_gbps * factor, r.msg_rate_mpps) for r in rows)
    return BwReport(test, settings, unit, converted, complete)


def _row(header: Sequence[str], numbers: Sequence[float]) -> BwRow:
    values = dict(zip(header, numbers, strict=True))

    def col(prefix: str) -> float | None:
        for name, value in values.items():
            if name.lstrip("#").startswith(prefix):
                return value
        return None

    size, iters, avg = col("bytes"), col("iterations"), col("BW average")
    if size is None or iters is None or avg is None:  # header checked above; kept for the type checker
        raise PerftestParseError("result row without bytes, iterations or BW average")
    return BwRow(int(size), int(iters), col("BW peak"), avg, col("MsgRate"))


# --------------------------------------------------------------------------- loopback runs


@dataclass(frozen=True)
class LoopbackSpec:
    """One host-loopback measurement: server and client on this host, on one RDMA device."""

    device: str
    ib_port: int = 1
    tcp_port: int = 18515
    size: int = 8 << 20
    iterations: int = 2000
    qps: int = 1
    cuda: int | None = None  # --use_cuda=<CUDA device index> for GPUDirect RDMA
    numa_node: int | None = None
    gid_index: int | None = None  # RoCE ports need a GID index (-x)
    binary: str = "ib_write_bw"

    def argv(self, *, client: bool) -> list[str]:
        argv = [self.binary, "-d", self.device, "-i", str(self.ib_port), "-p", str(self.tcp_port),
                "-s", str(self.size), "-n", str(self.iterations), "-q", str(self.qps), "-F",
                "--report_gbits"]
        if self.gid_index is not None:
            argv += ["-x", str(self.gid_index)]
        if self.cuda is not None:
            argv.append(f"--use_cuda={self.cuda}")
        if client:
            argv.append("localhost")
        return argv


@dataclass
class LoopbackRun:
    spec: LoopbackSpec
    report: BwReport | None = None
    # why there is no report: the tool's condition (missing, hung) or its own error text
    error: str | None = None
    condition: HwCondition | None = None
    client: ToolResult | None = None
    server: ToolResult | None = None
    attempts: int = 0
    argv: list[str] = field(default_factory=list)


# what a client prints when the server is not listening yet (perftest_communication.c)
_NOT_LISTENING = ("couldn't connect", "unable to open file descriptor for socket connection",
                  "unable to init the socket connection")


def _wrap(tools: ToolRunner, spec: LoopbackSpec, argv: list[str]) -> list[str]:
    # Azure's health checks pin both ends to the NIC's NUMA node (numactl -N/-m): a run whose
    # buffers sit on the far socket measures the inter-socket link, not the NIC.
    if spec.numa_node is not None and spec.numa_node >= 0 and tools.which("numactl"):
        return ["numactl", f"--cpunodebind={spec.numa_node}", f"--membind={spec.numa_node}", *argv]
    return argv


def run_loopback(tools: ToolRunner, spec: LoopbackSpec, *, timeout: float = 60.0,
                 connect_window_s: float = 10.0) -> LoopbackRun:
    """Server, then client (retried while the server is not listening yet), both bounded."""
    out = LoopbackRun(spec)
    env = dict(os.environ)
    # --use_cuda takes a CUDA device index; CUDA numbers GPUs fastest-first unless told to follow
    # the PCI bus order, which is NVML's order (and so gpumon's gpu/<index>)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    component = f"ib/{spec.device}/{spec.ib_port}"
    server_argv = _wrap(tools, spec, spec.argv(client=False))
    client_argv = _wrap(tools, spec, spec.argv(client=True))
    out.argv = client_argv
    server_box: dict[str, ToolResult | HwCondition] = {}

    def serve() -> None:
        try:
            server_box["result"] = tools.run(server_argv, timeout=timeout + connect_window_s,
                                             component=component, env=env)
        except HwCondition as cond:
            server_box["result"] = cond

    server = threading.Thread(target=serve, name=f"gpumon-perftest-server-{spec.device}", daemon=True)
    server.start()
    deadline = time.monotonic() + connect_window_s
    time.sleep(0.1)  # the server opens the device before it listens; the client retries meanwhile
    try:
        while True:
            out.attempts += 1
            client = tools.run(client_argv, timeout=timeout, component=component, env=env)
            text = (client.stdout + "\n" + client.stderr).lower()
            retry = (client.returncode != 0 and any(s in text for s in _NOT_LISTENING)
                     and server.is_alive() and time.monotonic() < deadline)
            if not retry:
                break
            time.sleep(0.3)
    except HwCondition as cond:
        out.condition = cond
        out.error = str(cond)
        server.join(timeout + connect_window_s)
        return out
    out.client = client
    server.join(timeout + connect_window_s)
    served = server_box.get("result")
    if isinstance(served, ToolResult):
        out.server = served
    try:
        out.report = parse_bw(client.stdout)
    except PerftestParseError as exc:
        err_lines = [ln.strip() for ln in client.stderr.splitlines() if ln.strip()]
        detail = _reason(err_lines) or (err_lines[-1][:200] if err_lines else "")
        out.error = f"exit {client.returncode}: {exc}" + (f" (stderr: {detail})" if detail else "")
    return out


def run_loopbacks(tools: ToolRunner, specs: Sequence[LoopbackSpec], *, parallel: bool = True,
                  timeout: float = 60.0, connect_window_s: float = 10.0) -> list[LoopbackRun]:
    """Run several loopbacks, at once or one after another; results in the order of ``specs``.
    The caller keeps two runs on one NIC (or one GPU) out of the same parallel batch."""
    if not specs:
        return []
    if not parallel or len(specs) == 1:
        return [run_loopback(tools, s, timeout=timeout, connect_window_s=connect_window_s) for s in specs]
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="gpumon-perftest") as pool:
        futures = [pool.submit(run_loopback, tools, s, timeout=timeout, connect_window_s=connect_window_s)
                   for s in specs]
        return [f.result() for f in futures]


def supports_cuda(tools: ToolRunner, binary: str = "ib_write_bw", timeout: float = 10.0) -> bool:
    """Whether this perftest build was compiled with CUDA (its usage text lists ``--use_cuda``)."""
    try:
        result = tools.run([binary, "--help"], timeout=timeout)
    except HwCondition:
        return False
    return "use_cuda" in result.stdout + result.stderr
