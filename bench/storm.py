"""Kernel-log storm: what 2,000 lines/s cost ``gpumon daemon``, and how fast an Xid still shows.

Runs the real daemon as a child process on a simulated 8xH100 node (its kernel
log is the regular file ``<sim-dir>/host/dev/kmsg`` in /dev/kmsg record format,
followed like ``tail -F``) and samples it with psutil:

1. warm-up (imports, the first run of every check), not measured;
2. idle for ``--idle`` s: CPU share of one core (user+system time of the daemon
   process / wall) and RSS; then one Xid 79 on a quiet GPU, timed from the
   append to the first ``/metrics`` scrape that shows its finding;
3. a storm of ``--rate`` lines/s for ``--storm`` s, appended every 10 ms:
   PCIe AER corrected-error reports on the switch port above one GPU (the shape
   of a real HGX H100, tests/data/pcie-aer: CESta RxErr+ BadTLP+ BadDLLP+
   Timeout+ on the PEX890xx port above 19:00.0; line wording from the kernel
   captures quoted in tests/checks/test_pcie.py) and an Xid 13 storm on another
   GPU (the lines of tests/data/kmsg-xid/dmesg-decode-iso_xid13-storm_then_xid43.log).
   Bus ids and the port's device id are read from the rendered host tree. At
   ``--probes`` (fractions of the storm) one Xid 79 on yet another GPU is appended
   and ``/metrics`` polled every ``--poll-ms`` until its finding shows;
4. ``--after`` s after the storm (the backlog, if the daemon fell behind).

CPU is given with and without the probe windows (while /metrics is polled every
few ms the daemon also serves scrapes, which a 15 s Prometheus scrape does not
cost). Then, with the daemon stopped, the same storm lines go through the
kernel-log parse loop (gpumon.hw.kmsg_* / gpumon.hw.nvrm / gpumon.hw.pci, as the
daemon's pump and checks call them), through the daemon's KernelLogPump itself
(its thread's CPU time) and through a bare prefilter + one regex loop, side by
side, with the same-run ratio of the daemon all-in to the bare loop. The daemon's
kernel-log counters (gpumon_kernel_log_lines_{read,dropped,merged}_total) are
printed as /metrics had them at the end. Issue 23's goal is ``--rate 20000``.

``--py-spy FILE`` records the daemon with py-spy during the storm (raw collapsed
stacks, per thread, 100 Hz, non-blocking) and prints where the samples went; the
CPU figures of such a run include py-spy's own cost to the daemon.

    .venv/bin/python bench/storm.py [--rate 2000] [--storm 30] [--idle 20] [--warmup 15]
        [--after 5] [--probes 0.25,0.5,0.75] [--xid-share 0.5] [--py-spy /tmp/storm.txt]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from _flame import summarize  # noqa: E402
from _machine import describe  # noqa: E402

from gpumon.hw.kmsg_follow import KernelLogFollower  # noqa: E402
from gpumon.hw.kmsg_parse import parse_line  # noqa: E402
from gpumon.hw.nvrm import NvrmParser  # noqa: E402
from gpumon.hw.pci import parse_aer_message  # noqa: E402

XID13_CAPTURE = REPO / "tests" / "data" / "kmsg-xid" / "dmesg-decode-iso_xid13-storm_then_xid43.log"
TICK_S = 0.010  # the storm is appended in 10 ms slices, as a busy kernel's printk bursts
# the simulated node's kernel clock (gpumon.sim.render.UPTIME_AT_START_S): boot = start_wall - this
UPTIME_AT_START_S = 3600.0

# One corrected-error report as kernel 6.x prints it (tests/checks/test_pcie.py, POP_3363), one per
# first error of the bits latched on the real HGX H100 switch port (RxErr, BadTLP, BadDLLP, Timeout):
# (type, agent, status, [(bit, name)])
_AER_REPORTS = [
    ("Physical Layer", "Receiver ID", 0x00000001, [(0, "RxErr")]),
    ("Data Link Layer", "Receiver ID", 0x00000040, [(6, "BadTLP")]),
    ("Data Link Layer", "Receiver ID", 0x00000080, [(7, "BadDLLP")]),
    ("Data Link Layer", "Transmitter ID", 0x00001000, [(12, "Timeout")]),
    ("Data Link Layer", "Receiver ID", 0x000000c0, [(6, "BadTLP"), (7, "BadDLLP")]),
]


@dataclass
class Node:
    """What the benchmark needs of the rendered simulated node."""

    root: Path
    kmsg: Path
    gpus: list[str]  # bus ids by NVML index, "0000:19:00.0"
    port_above: dict[str, str]  # GPU bus id -> the switch port it hangs off
    port_ids: dict[str, str]  # port bus id -> "1000:c030"
    boot: float  # epoch seconds of the node's boot (usec field 0)
    seq: int  # next kernel sequence number


def _read_node(sim_dir: Path) -> Node:
    sim = json.loads((sim_dir / "sim.json").read_text())
    host = sim_dir / "host"
    gpus = [line.split()[1] for line in (sim_dir / "nvml-state.txt").read_text().splitlines()
            if line.startswith("pci ")]
    gpus = [f"{b.split(':', 1)[0][-4:]}:{b.split(':', 1)[1]}".lower() for b in gpus]
    devices = host / "sys" / "bus" / "pci" / "devices"
    port_above: dict[str, str] = {}
    port_ids: dict[str, str] = {}
    for bus in gpus:
        target = (devices / bus).resolve()
        port = target.parent
        port_above[bus] = port.name
        ids = [(port / f).read_text().strip().removeprefix("0x") for f in ("vendor", "device")]
        port_ids[port.name] = ":".join(ids)
    kmsg = host / "dev" / "kmsg"
    seq = int(sim["seq"])
    for line in kmsg.read_text(encoding="utf-8", errors="replace").splitlines():
        rec = parse_line(line)
        if rec.seq is not None:
            seq = max(seq, rec.seq + 1)
    return Node(sim_dir, kmsg, gpus, port_above, port_ids, float(sim["start_wall"]) - UPTIME_AT_START_S, seq)


def _xid_bus(bus: str) -> str:
    """``0000:19:00.0`` -> ``0000:19:00``, as Xid lines print it."""
    return bus.rsplit(".", 1)[0]


def _xid13_messages(bus: str) -> list[str]:
    """The Xid 13 messages of the real storm capture, moved onto ``bus``."""
    out = []
    for line in XID13_CAPTURE.read_text(encoding="utf-8").splitlines():
        text = parse_line(line).text
        if "): 13," in text:
            out.append(re.sub(r"PCI:[0-9a-fA-F:]+\)", f"PCI:{_xid_bus(bus)})", text, count=1))
    if not out:
        raise SystemExit(f"no Xid 13 line in {XID13_CAPTURE}")
    return out


def _aer_messages(port: str, ids: str) -> Iterator[list[tuple[int, str]]]:
    """Corrected-error reports on ``port``, forever: each a list of (priority, message)."""
    for kind, agent, status, bits in itertools.cycle(_AER_REPORTS):
        report = [
            (6, f"pcieport {port}: AER: Correctable error message received from {port}"),
            (4, f"pcieport {port}: PCIe Bus Error: severity=Correctable, type={kind}, ({agent})"),
            (4, f"pcieport {port}:   device [{ids}] error status/mask={status:08x}/00002000"),
        ]
        for i, (bit, name) in enumerate(bits):
            report.append((4, f"pcieport {port}:    [{bit:2d}] {name:<22}{' (First)' if i == 0 else ''}"))
        yield report


def storm_messages(node: Node, aer_gpu: int, xid_gpu: int, xid_share: float) -> Iterator[tuple[int, str]]:
    """(priority, message) forever: AER reports and Xid 13 lines interleaved, ``xid_share`` of lines Xid."""
    aer_bus = node.gpus[aer_gpu]
    port = node.port_above[aer_bus]
    aer = _aer_messages(port, node.port_ids[port])
    xid = itertools.cycle(_xid13_messages(node.gpus[xid_gpu]))
    n_aer = n_xid = 0
    while True:
        if xid_share >= 1.0 or (xid_share > 0.0 and n_xid < xid_share * (n_aer + n_xid + 1)):
            yield 4, next(xid)
            n_xid += 1
        else:
            for prio, msg in next(aer):
                yield prio, msg
                n_aer += 1


class KmsgWriter:
    """Appends /dev/kmsg records to the simulated node's log, numbered and stamped like the kernel."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.seq = node.seq
        self.fh = open(node.kmsg, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.lock = threading.Lock()
        self.written = 0

    def write(self, messages: Sequence[tuple[int, str]]) -> None:
        with self.lock:
            usec = int((time.time() - self.node.boot) * 1e6)
            out = []
            for prio, msg in messages:
                out.append(f"{prio},{self.seq},{usec},-;{msg}\n")
                self.seq += 1
            self.fh.write("".join(out))
            self.fh.flush()
            self.written += len(out)

    def close(self) -> None:
        self.fh.close()


@dataclass
class Sampler:
    """CPU and RSS of the daemon over one window."""

    proc: psutil.Process
    rss: list[int] = field(default_factory=list)
    t0: float = 0.0
    c0: float = 0.0
    excluded_cpu: float = 0.0
    excluded_wall: float = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.c0 = self.cpu()
        self.rss = [self.proc.memory_info().rss]

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return float(t.user + t.system)

    def sample(self) -> None:
        self.rss.append(self.proc.memory_info().rss)

    def result(self) -> tuple[float, float, float, float]:
        """(wall s, cpu s, cpu % of a core, cpu % without the excluded windows)."""
        wall = time.monotonic() - self.t0
        cpu = self.cpu() - self.c0
        rest_wall = wall - self.excluded_wall
        rest = 100 * (cpu - self.excluded_cpu) / rest_wall if rest_wall > 0 else float("nan")
        return wall, cpu, 100 * cpu / wall, rest


def _thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) per thread id, from /proc/PID/task/TID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def _thread_names(path: Path) -> dict[int, str]:
    names: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"thread \((\d+)\): ([^;]+);", line)
        if m is not None:
            names[int(m.group(1))] = m.group(2)
    return names


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_daemon(daemon: subprocess.Popen[bytes]) -> None:
    """SIGTERM as systemd would, SIGKILL if it is still there 30 s later."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _scrape(url: str) -> str:
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        return str(resp.read().decode("utf-8", "replace"))


def _xid_shown(text: str, component: str) -> bool:
    key = f'gpumon_finding_severity{{check="xid",component="{component}"}} '
    at = text.find(key)
    return at >= 0 and float(text[at + len(key) :].split("\n", 1)[0]) >= 3.0  # warn or fail


def probe(writer: KmsgWriter, node: Node, gpu_index: int, url: str, poll_s: float,
          timeout_s: float = 30.0) -> float:
    """Append one Xid 79 on ``gpu_index``; seconds until ``/metrics`` shows the xid finding (inf: never)."""
    msg = (f"NVRM: Xid (PCI:{_xid_bus(node.gpus[gpu_index])}): 79, pid='<unknown>', name=<unknown>, "
           "GPU has fallen off the bus.")
    component = f"gpu/{gpu_index}"
    start = time.perf_counter()
    writer.write([(4, msg)])
    while time.perf_counter() - start < timeout_s:
        try:
            if _xid_shown(_scrape(url), component):
                return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(poll_s)
    return float("inf")


def run_storm(writer: KmsgWriter, messages: Iterator[tuple[int, str]], rate: float, seconds: float,
              stop: threading.Event) -> tuple[int, float]:
    """Append ``rate`` lines/s for ``seconds`` (10 ms slices, catching up when late): (lines, wall s)."""
    start = time.monotonic()
    done = ticks = 0
    while not stop.is_set():
        elapsed = time.monotonic() - start
        if elapsed >= seconds:
            break
        due = int(rate * min(elapsed + TICK_S, seconds))
        if due > done:
            writer.write(list(itertools.islice(messages, due - done)))
            done = due
        ticks += 1
        time.sleep(max(0.0, start + ticks * TICK_S - time.monotonic()))
    return done, time.monotonic() - start


# -- the parse loop against a bare prefilter + regex ------------------------------------------------

_BARE_XID = re.compile(r"Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
_BARE_AER = re.compile(r"(\w{4}:\w\w:\w\w\.\w): (?:AER: )?PCIe Bus Error: severity=(\w+)")


def _bare(lines: Sequence[str]) -> int:
    found = 0
    for line in lines:
        if "Xid (" in line:
            if _BARE_XID.search(line) is not None:
                found += 1
        elif "PCIe Bus Error" in line and _BARE_AER.search(line) is not None:
            found += 1
    return found


def _parse_only(lines: Sequence[str]) -> int:
    for line in lines:
        parse_line(line)
    return 0


def _pump(lines: Sequence[str]) -> int:
    """What the daemon's kernel-log pump does per line: parse the record, feed the NVRM parser."""
    parser = NvrmParser()
    feed = parser.feed
    n = 0
    for line in lines:
        n += len(feed(parse_line(line)))
    return n + len(parser.flush())


def _pump_and_pcie(lines: Sequence[str]) -> int:
    """The pump plus the pcie check's pass over the records (split lines, match AER messages)."""
    parser = NvrmParser()
    n = 0
    for line in lines:
        rec = parse_line(line)
        n += len(parser.feed(rec))
        for part in rec.text.splitlines():
            if parse_aer_message(part) is not None:
                n += 1
    return n


def _pump_and_fold(lines: Sequence[str]) -> int:
    """The pump as the daemon runs it now: each record also folded for pcie (AerFold.add, dated)."""
    from gpumon.check import KernelLog
    from gpumon_checks.pcie import AerFold

    parser = NvrmParser()
    fold = AerFold()
    dating = KernelLog(boot_time=1.7e9)
    now = time.time()
    n = 0
    for line in lines:
        rec = parse_line(line)
        n += len(parser.feed(rec))
        fold.add(rec, dating.time_of(rec, now))
    fold.take()
    return n


def _rate(fn: Callable[[Sequence[str]], int], lines: Sequence[str], min_s: float) -> tuple[float, int]:
    gc.collect()
    done = found = 0
    start = time.thread_time()
    while True:
        found = fn(lines)
        done += len(lines)
        elapsed = time.thread_time() - start
        if elapsed >= min_s:
            return done / elapsed, found


def _follower_rate(lines: Sequence[str], tmp: Path) -> float:
    path = tmp / "kmsg"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    gc.collect()
    start = time.thread_time()
    with KernelLogFollower(path, boot_time=None) as follower:
        records = follower.read_available()
        parser = NvrmParser()
        for rec in records:
            parser.feed(rec)
        parser.flush()
    secs = time.thread_time() - start
    if len(records) != len(lines):
        print(f"    (follower returned {len(records)} records of {len(lines)} lines)")
    return len(lines) / secs


def _pump_rate(lines: Sequence[str], tmp: Path) -> tuple[float, dict[str, object]]:
    """The daemon's kernel-log pump itself (gpumon.kernel_pump.KernelLogPump, on its own thread, with
    the xid, nvswitch and pcie checks subscribed: read, split, parse, hand over, fold, count
    repeats) through ``lines`` appended to a followed file, in 10 ms slices of 200 lines as the storm
    writes them: lines per second of that thread's CPU time, and the pump's counters."""
    from gpumon.hw.kernellog import KernelLogSource
    from gpumon.kernel_pump import KernelLogPump
    from gpumon_checks.nvswitch import NvswitchCheck
    from gpumon_checks.pcie import PcieCheck
    from gpumon_checks.xid import XidCheck

    path = tmp / "pump-kmsg"
    path.write_text("")
    pump = KernelLogPump(lambda: KernelLogSource(path, boot_time=1.7e9, poll_interval=0.01, bounded=True),
                         threading.Event(), [XidCheck(), NvswitchCheck(), PcieCheck()], boot="bench",
                         marks={})
    pump.start()
    pump.first_read.wait(5.0)
    ident = pump.thread.ident
    assert ident is not None
    clock = time.pthread_getcpuclockid(ident)
    gc.collect()
    start = time.clock_gettime(clock)
    with open(path, "a", encoding="utf-8") as fh:
        for i in range(0, len(lines), 200):
            fh.write("".join(line + "\n" for line in lines[i:i + 200]))
            fh.flush()
            if i % 4000 == 0:  # the checks take what is queued for them, as their runs would
                for name in ("xid", "nvswitch", "pcie"):
                    pump.take(name)
            time.sleep(0.002)
    deadline = time.monotonic() + 60
    while pump.records < len(lines) and time.monotonic() < deadline:
        time.sleep(0.01)
    secs = time.clock_gettime(clock) - start
    stats = pump.stats()
    pump.close()
    return len(lines) / secs, stats


def parse_comparison(lines: Sequence[str], rate: float, min_s: float, daemon_us: float | None = None) -> None:
    print(f"== kernel-log path on the same storm lines ({len(lines):,} /dev/kmsg records, daemon stopped, "
          f">= {min_s:g} s of this thread's CPU time per figure, so other load on the machine does not "
          "count)")
    _rate(_pump, lines[:2000], 0.2)  # warm-up: regex caches, allocator
    rows: list[tuple[str, float]] = []
    bare, bare_found = _rate(_bare, lines, min_s)
    rows.append(("bare prefilter + one regex (Xid / AER header)", bare))
    rows.append(("parse_line", _rate(_parse_only, lines, min_s)[0]))
    pump, pump_found = _rate(_pump, lines, min_s)
    rows.append(("parse_line + NvrmParser.feed (the pump)", pump))
    rows.append(("pump + pcie's splitlines + parse_aer_message", _rate(_pump_and_pcie, lines, min_s)[0]))
    rows.append(("pump + pcie's fold (AerFold.add: the daemon's pump since issue 14)",
                 _rate(_pump_and_fold, lines, min_s)[0]))
    with tempfile.TemporaryDirectory(prefix="gpumon-storm-") as tmp:
        rows.append(("KernelLogFollower.read_available + NvrmParser (read, decode, split, assemble, parse)",
                     _follower_rate(lines, Path(tmp))))
        pump_rate, stats = _pump_rate(lines, Path(tmp))
        rows.append(("the daemon's KernelLogPump (xid, nvswitch, pcie subscribed), its thread's CPU",
                     pump_rate))
    for what, r in rows:
        print(f"    {what:<92} {r:>10,.0f} lines/s  {1e6 / r:6.2f} us/line  "
              f"{100 * rate / r:5.2f} % of a core at {rate:,.0f} lines/s  ({bare / r:4.1f}x bare)")
    if daemon_us is not None and daemon_us > 0:
        what = "the daemon all-in during the storm (CPU above idle per line appended, measured above)"
        print(f"    {what:<92} {1e6 / daemon_us:>10,.0f} lines/s  {daemon_us:6.2f} us/line  "
              f"{100 * rate * daemon_us / 1e6:5.2f} % of a core at {rate:,.0f} lines/s  "
              f"({bare / (1e6 / daemon_us):4.1f}x bare)")
    print(f"    matches: bare {bare_found:,} (Xid lines + AER headers), pump {pump_found:,} NVRM events")
    print(f"    KernelLogPump counters: {stats}")
    if daemon_us is not None and daemon_us > 0:
        print(f"    same-run ratio, the daemon all-in to the bare prefilter + regex: "
              f"{bare * daemon_us / 1e6:.1f}x; the pump thread alone to it: {bare / pump_rate:.1f}x")


# -- main --------------------------------------------------------------------------------------------


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} / {b:.2f} / {c:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=2000.0, help="storm lines per second")
    ap.add_argument("--storm", type=float, default=30.0, help="storm seconds")
    ap.add_argument("--idle", type=float, default=20.0, help="idle seconds measured before the storm")
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--after", type=float, default=5.0, help="seconds measured after the storm")
    ap.add_argument("--probes", default="0.25,0.5,0.75",
                    help="when to append an Xid 79 on a quiet GPU, as fractions of the storm (at most 5)")
    ap.add_argument("--poll-ms", type=float, default=20.0, help="/metrics polling while a probe waits")
    ap.add_argument("--xid-share", type=float, default=0.5, help="share of storm lines that are Xid 13")
    ap.add_argument("--aer-gpu", type=int, default=0, help="GPU whose switch port logs corrected errors")
    ap.add_argument("--xid-gpu", type=int, default=1, help="GPU with the Xid 13 storm")
    ap.add_argument("--scenario", default="healthy-8xh100")
    ap.add_argument("--sim-dir", help="keep the simulated node here (default: a temporary directory)")
    ap.add_argument("--parse-lines", type=int, default=60_000, help="storm lines for the parse comparison")
    ap.add_argument("--parse-seconds", type=float, default=1.0)
    ap.add_argument("--py-spy", metavar="FILE", help="record the daemon with py-spy during the storm")
    args = ap.parse_args(argv)
    fractions = sorted(float(x) for x in args.probes.split(",") if x.strip())
    quiet = [i for i in range(8) if i not in (args.aer_gpu, args.xid_gpu)]
    if len(fractions) > len(quiet) - 1:
        ap.error(f"at most {len(quiet) - 1} probes (one quiet GPU each, one kept for the idle probe)")

    print(f"machine: {describe()}")
    load_before = _load()
    tmp = tempfile.TemporaryDirectory(prefix="gpumon-storm-")
    sim_dir = Path(args.sim_dir) if args.sim_dir else Path(tmp.name) / "sim"
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    total = args.warmup + args.idle + args.storm + args.after + 120
    log_path = Path(tmp.name) / "daemon.log"
    cmd = [sys.executable, "-m", "gpumon", "daemon", "--simulate", args.scenario, "--sim-dir", str(sim_dir),
           "--listen", f"127.0.0.1:{port}", "--duration", str(total)]
    with open(log_path, "wb") as log_fh:
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_fh, cwd=REPO)
    proc = psutil.Process(daemon.pid)
    me = psutil.Process()
    writer: KmsgWriter | None = None
    try:
        deadline = time.monotonic() + 120
        while True:
            if daemon.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                print(f"gpumon daemon exited early (code {daemon.returncode}):\n{tail}", file=sys.stderr)
                return 1
            try:
                _scrape(url)
                break
            except OSError:
                if time.monotonic() > deadline:
                    print("gpumon daemon never served /metrics", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        time.sleep(args.warmup)
        node = _read_node(sim_dir)
        writer = KmsgWriter(node)
        messages = storm_messages(node, args.aer_gpu, args.xid_gpu, args.xid_share)

        # -- idle ---------------------------------------------------------------------------------
        idle = Sampler(proc)
        idle.start()
        end = time.monotonic() + args.idle
        while time.monotonic() < end:
            time.sleep(0.5)
            idle.sample()
        idle_wall, idle_cpu, idle_pct, _ = idle.result()
        idle_probe = probe(writer, node, quiet[-1], url, args.poll_ms / 1000)
        time.sleep(2.0)  # let the idle probe's own work settle before the storm

        # -- storm --------------------------------------------------------------------------------
        spy: subprocess.Popen[bytes] | None = None
        if args.py_spy:
            exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
            if exe is None:
                print("py-spy not found (.venv/bin/pip install py-spy)", file=sys.stderr)
                return 1
            spy_cmd = [exe, "record", "--pid", str(daemon.pid), "--rate", "100", "--nonblocking", "--threads",
                       "--format", "raw", "--duration", str(int(args.storm)), "--output", args.py_spy]
            spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)
        storm = Sampler(proc)
        stop = threading.Event()
        result: list[tuple[int, float]] = []
        me_cpu0 = me.cpu_times()
        threads0 = _thread_cpu(proc)
        storm.start()
        storm_writer = writer

        def write_storm() -> None:
            result.append(run_storm(storm_writer, messages, args.rate, args.storm, stop))

        thread = threading.Thread(target=write_storm, name="storm-writer", daemon=True)
        t0 = time.monotonic()
        thread.start()
        latencies: list[tuple[float, int, float]] = []
        pending = list(zip(fractions, quiet, strict=False))
        while thread.is_alive():
            now = time.monotonic() - t0
            if pending and now >= pending[0][0] * args.storm:
                _, gpu_index = pending.pop(0)
                c, w = storm.cpu(), time.monotonic()
                latencies.append((now, gpu_index, probe(writer, node, gpu_index, url, args.poll_ms / 1000)))
                storm.excluded_cpu += storm.cpu() - c
                storm.excluded_wall += time.monotonic() - w
            storm.sample()
            time.sleep(0.25)
        thread.join()
        storm_wall, storm_cpu, storm_pct, storm_rest = storm.result()
        per_thread = _thread_cpu(proc)
        for tid, cpu in threads0.items():
            per_thread[tid] = per_thread.get(tid, 0.0) - cpu
        me_cpu1 = me.cpu_times()
        lines, wall = result[0]

        # -- after --------------------------------------------------------------------------------
        after = Sampler(proc)
        after.start()
        end = time.monotonic() + args.after
        while time.monotonic() < end:
            time.sleep(0.5)
            after.sample()
        after_wall, after_cpu, after_pct, _ = after.result()
        threads = proc.num_threads()
        try:  # what the daemon's kernel-log pump counted (read, dropped by reason, merged repeats)
            counters = [line for line in _scrape(url).splitlines()
                        if line.startswith("gpumon_kernel_log_lines_") and not line.startswith("#")]
        except OSError as exc:
            counters = [f"(scrape failed: {exc})"]
        load_after = _load()
    finally:
        if writer is not None:
            writer.close()
        stop_daemon(daemon)
    log_lines = log_path.read_text(errors="replace").splitlines()
    warnings = sum(" WARNING " in line or "WARNING" in line.split(":", 1)[0] for line in log_lines)

    print(f"conditions: gpumon daemon --simulate {args.scenario}, default config, kernel log = regular file "
          f"polled every 0.2 s; {args.warmup:g} s warm-up, {args.idle:g} s idle, {args.storm:g} s storm at "
          f"{args.rate:,.0f} lines/s ({args.xid_share:.0%} Xid 13 on gpu/{args.xid_gpu} "
          f"{node.gpus[args.xid_gpu]}, the rest PCIe AER corrected-error reports on switch port "
          f"{node.port_above[node.gpus[args.aer_gpu]]} above gpu/{args.aer_gpu}), {args.after:g} s after; "
          f"psutil every 0.25-0.5 s; load average (1/5/15 min) before {load_before}, after {load_after}")
    mine = (me_cpu1.user + me_cpu1.system) - (me_cpu0.user + me_cpu0.system)
    print(f"storm writer: {lines:,} lines in {wall:.2f} s = {lines / wall:,.0f} lines/s "
          f"(bench process CPU while writing: {100 * mine / wall:.1f} % of a core)")
    print()
    print(f"{'':26}{'idle':>22}{'storm':>22}{'after storm':>22}")
    print(f"{'cpu, % of one core':26}{idle_pct:>21.2f}%{storm_pct:>21.2f}%{after_pct:>21.2f}%")
    print(f"{'  without probe windows':26}{idle_pct:>21.2f}%{storm_rest:>21.2f}%{after_pct:>21.2f}%")
    print(f"{'cpu seconds / wall':26}{f'{idle_cpu:.2f} / {idle_wall:.0f} s':>22}"
          f"{f'{storm_cpu:.2f} / {storm_wall:.0f} s':>22}{f'{after_cpu:.2f} / {after_wall:.0f} s':>22}")
    print(f"{'rss max':26}{_mib(max(idle.rss)):>22}{_mib(max(storm.rss)):>22}{_mib(max(after.rss)):>22}")
    print(f"{'rss at the end':26}{_mib(idle.rss[-1]):>22}{_mib(storm.rss[-1]):>22}{_mib(after.rss[-1]):>22}")
    last = len(storm.rss) - 1
    marks = [storm.rss[round(q * last)] for q in (0, 0.25, 0.5, 0.75, 1)]
    print(f"rss through the storm (start, 25 %, 50 %, 75 %, end): {', '.join(_mib(m) for m in marks)}")
    extra = storm_cpu - storm.excluded_cpu - idle_pct / 100 * (storm_wall - storm.excluded_wall)
    print(f"storm cost above idle: {1e6 * extra / lines:.0f} us of daemon CPU per line "
          f"({storm_rest - idle_pct:.2f} % of a core at {lines / wall:,.0f} lines/s, probe windows left out: "
          f"{storm.excluded_wall:.1f} s, {storm.excluded_cpu:.2f} s CPU while /metrics was polled every "
          f"{args.poll_ms:g} ms)")
    print(f"Xid 79 -> /metrics (finding_severity >= warn), polled every {args.poll_ms:g} ms:")
    print(f"    idle daemon, gpu/{quiet[-1]}: {idle_probe * 1000:.0f} ms")
    for at, gpu_index, lat in latencies:
        print(f"    storm t={at:5.1f} s, gpu/{gpu_index}: {lat * 1000:.0f} ms")
    if latencies:
        worst = max(lat for _, _, lat in latencies)
        median = statistics.median(lat for _, _, lat in latencies)
        print(f"    storm worst {worst * 1000:.0f} ms, median {median * 1000:.0f} ms")
    print(f"daemon: {threads} threads at the end; {len(log_lines)} log lines ({warnings} warnings) on stderr")
    print("daemon's kernel-log counters on /metrics at the end: " + "; ".join(counters))
    print()

    if spy is not None:
        try:
            _, err = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        print(f"== py-spy profile of the daemon during the storm ({args.py_spy}; CPU figures above include "
              "py-spy's sampling)")
        if spy.returncode != 0 or not Path(args.py_spy).exists():
            print(f"  py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
        else:
            print(summarize(Path(args.py_spy)))
            names = _thread_names(Path(args.py_spy))
            print("  daemon CPU per thread during the storm (psutil; names from py-spy; threads that ended "
                  "during the storm are missing):")
            for tid, cpu in sorted(per_thread.items(), key=lambda kv: -kv[1])[:12]:
                print(f"    {100 * cpu / storm_wall:6.2f} % of a core  {names.get(tid, f'thread {tid}')}")
        print()

    sample = list(itertools.islice(storm_messages(node, args.aer_gpu, args.xid_gpu, args.xid_share),
                                   args.parse_lines))
    usec = int((time.time() - node.boot) * 1e6)
    records = [f"{prio},{node.seq + i},{usec + i * 500},-;{msg}" for i, (prio, msg) in enumerate(sample)]
    parse_comparison(records, args.rate, args.parse_seconds, 1e6 * extra / lines if lines else None)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
