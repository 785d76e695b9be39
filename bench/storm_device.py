"""The kernel-log pump on this machine's real ``/dev/kmsg``: what a storm costs on the path a GPU
node's daemon reads (a character device, one record per ``read()``, woken by ``poll()``), which
bench/storm.py's simulated node (a regular file) does not take.

Writes bench/storm.py's storm lines (half Xid 13 from the real capture, half PCIe AER
corrected-error reports) into the kernel's ring at ``--rate`` lines/s from a separate process, in
10 ms slices, while gpumon's KernelLogPump (xid, nvswitch and pcie subscribed, as in the daemon)
follows ``/dev/kmsg`` on its own thread; prints that thread's CPU per line, the records read, and
those the ring overwrote before they were read.

**It writes into this host's kernel log** (as root): ``kernel.printk_devkmsg`` is set to ``on``
for the run (user-space writes are rate-limited otherwise) and restored after, the lines carry
fake Xids on the simulated node's bus ids (at level 5, not printed on the console), and the ring
is then flushed with harmless lines so that nothing else reads them. Run it on a test machine, never
on a node in service.

    sudo .venv/bin/python bench/storm_device.py [--rate 20000] [--seconds 10] [--daemon]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _machine import describe  # noqa: E402
from storm import (  # noqa: E402
    _bare,
    _free_port,
    _rate,
    _read_node,
    _scrape,
    _xid_bus,
    _xid_shown,
    storm_messages,
)

from gpumon.hw.kernellog import KernelLogSource  # noqa: E402
from gpumon.kernel_pump import KernelLogPump  # noqa: E402

KNOB = Path("/proc/sys/kernel/printk_devkmsg")
KMSG = Path("/dev/kmsg")
WRITER = r"""
import json, os, sys, time
lines = [l.encode() for l in json.load(open(sys.argv[1]))]
rate = float(sys.argv[2])
fd = os.open("/dev/kmsg", os.O_WRONLY)
tick = max(1, int(rate / 100))
t0 = time.monotonic()
print(t0, flush=True)
for i in range(0, len(lines), tick):
    for b in lines[i:i + tick]:
        os.write(fd, b)
    pause = t0 + (i + tick) / rate - time.monotonic()
    if pause > 0:
        time.sleep(pause)
print(time.monotonic() - t0)
"""


PROBE_GPU = 5  # a GPU the storm does not touch (its lines are on gpu/0 and gpu/1)


def _lines_read(text: str) -> int:
    """gpumon_kernel_log_lines_read_total from a /metrics page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("gpumon_kernel_log_lines_read_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0

def _flush(old: str) -> None:
    """The storm's fake Xids out of the ring; the knob as it was."""
    KNOB.write_text("on\n")
    fd = os.open(KMSG, os.O_WRONLY)
    for i in range(50_000):
        os.write(fd, f"<6>gpumon bench: ring flush {i}".encode())
    os.close(fd)
    KNOB.write_text(old + "\n")


def _daemon(args: argparse.Namespace, sim: Path, lines: Path, count: int, load: float) -> int:
    """The whole daemon on the device: CPU of every thread and RSS over the writing."""
    import psutil

    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    # A simulated node reads its own host tree, never a configured path (a node's site file must
    # not point a simulation at the real log): its dev/kmsg becomes the real device.
    node = _read_node(sim)
    node_log = sim / "host" / "dev" / "kmsg"
    node_log.unlink()
    node_log.symlink_to(KMSG)
    # an Xid 79 on a quiet GPU half-way through the storm: how soon /metrics shows it
    texts = json.loads(lines.read_text())
    half = len(texts) // 2
    texts.insert(half, f"<4>NVRM: Xid (PCI:{_xid_bus(node.gpus[PROBE_GPU])}): 79, pid='<unknown>', "
                       "name=<unknown>, GPU has fallen off the bus.")
    lines.write_text(json.dumps(texts))
    count = len(texts)
    log = sim.parent / "daemon.log"
    cmd = [sys.executable, "-m", "gpumon", "daemon", "--simulate", "healthy-8xh100",
           "--sim-dir", str(sim), "--listen", f"127.0.0.1:{port}", "--duration", str(args.seconds + 180)]
    with open(log, "wb") as fh:
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        proc = psutil.Process(daemon.pid)
        deadline = time.monotonic() + 120
        while True:
            try:
                _scrape(url)
                break
            except OSError:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print(f"gpumon daemon did not serve /metrics:\n{log.read_text()[-2000:]}",
                          file=sys.stderr)
                    return 1
                time.sleep(0.2)
        time.sleep(15.0)  # warm-up: the first read of the ring, the checks' first runs
        idle0, t_idle = proc.cpu_times(), time.monotonic()
        time.sleep(10.0)
        idle1 = proc.cpu_times()
        idle = (idle1.user + idle1.system - idle0.user - idle0.system) / (time.monotonic() - t_idle)
        rss: list[int] = []
        read0 = _lines_read(_scrape(url))
        c0 = proc.cpu_times()
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(lines), str(args.rate)],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None
        start = float(writer.stdout.readline())
        written_at = start + half / args.rate  # the writer keeps to its rate (10 ms slices)
        seen_at = None
        probe_cpu = probe_wall = 0.0  # the /metrics polling's own cost, left out as bench/storm.py does
        next_rss = 0.0
        while writer.poll() is None:
            if time.monotonic() >= next_rss:
                rss.append(proc.memory_info().rss)
                next_rss = time.monotonic() + 0.25
            if seen_at is None and time.monotonic() >= written_at - 0.05:
                p0, w0 = proc.cpu_times(), time.monotonic()
                while seen_at is None and time.monotonic() < written_at + 5.0:
                    if _xid_shown(_scrape(url), f"gpu/{PROBE_GPU}"):
                        seen_at = time.monotonic()
                    else:
                        time.sleep(0.02)
                p1 = proc.cpu_times()
                probe_cpu += p1.user + p1.system - p0.user - p0.system
                probe_wall += time.monotonic() - w0
            time.sleep(0.05)
        out, _ = writer.communicate()
        c1 = proc.cpu_times()
        wall = float(out.split()[-1])
        # and until the daemon has read every line (its CPU so far: none of the storm left over)
        deadline = time.monotonic() + 30
        read = 0
        while time.monotonic() < deadline:
            text = _scrape(url)
            read = _lines_read(text) - read0
            if seen_at is None and _xid_shown(text, f"gpu/{PROBE_GPU}"):
                seen_at = time.monotonic()
            if read >= count:
                break
            time.sleep(0.05)
        c2 = proc.cpu_times()
        final = _scrape(url)
        shown = _xid_shown(final, "gpu/1")
        dropped = sum(int(float(line.rsplit(" ", 1)[1])) for line in final.splitlines()
                      if line.startswith("gpumon_kernel_log_lines_dropped_total"))
    finally:
        daemon.terminate()
        daemon.wait(30)
    cpu = c1.user + c1.system - c0.user - c0.system
    cpu_all = c2.user + c2.system - c0.user - c0.system
    print(f"machine: {describe()}")
    print(f"conditions: {count:,} lines written to {KMSG} at {args.rate:,.0f} lines/s from a separate "
          f"process ({count / wall:,.0f}/s achieved over {wall:.1f} s); gpumon daemon --simulate "
          f"healthy-8xh100, its dev/kmsg a link to {KMSG} (default checks); load average before {load:.2f}")
    print(f"daemon idle before the storm: {100 * idle:.2f} % of a core")
    bare = (cpu - probe_cpu) / max(wall - probe_wall, 1e-9)
    print(f"daemon during the writing (every thread, until the writer ended): {cpu:.2f} s CPU = "
          f"{100 * cpu / wall:.1f} % of a core with the probe window ({probe_wall:.2f} s of /metrics polled "
          f"every 20 ms), {100 * bare:.1f} % without it = {1e6 * bare / args.rate:.2f} us a line; RSS max "
          f"{max(rss) / 2**20:.1f} MiB ({max(rss) / 1e6:.1f} MB)")
    print(f"lines the daemon read (gpumon_kernel_log_lines_read): {read:,} of {count:,}; its CPU until then "
          f"{cpu_all:.2f} s; dropped (gpumon_kernel_log_lines_dropped_total, every check and reason) "
          f"{dropped:,}")
    print(f"Xid 79 on gpu/{PROBE_GPU} half-way through the storm -> /metrics: "
          + (f"{1e3 * (seen_at - written_at):.0f} ms" if seen_at is not None else "NOT SHOWN"))
    print(f"Xid 13 on gpu/1 on /metrics after the storm: {'yes' if shown else 'NO'}")
    unit = bare_us(json.loads(lines.read_text()))
    print(f"bare prefilter + one regex over the same lines: {unit:.3f} us a line; the daemon without the "
          f"probe window: {1e6 * bare / args.rate / unit:.1f}x that")
    return 0

def bare_us(messages: list[str]) -> float:
    """This thread's CPU per line for a bare prefilter + one regex over the same lines (bench/
    storm.py's yardstick): the per-line figures above divided by it travel between machines of
    other speeds, as storm.py's same-run ratio does."""
    return 1e6 / _rate(_bare, messages, 1.0)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--daemon", action="store_true",
                    help="measure a whole `gpumon daemon` (a simulated node reading /dev/kmsg) instead "
                         "of the pump alone: its CPU (every thread) and RSS over the writing")
    args = ap.parse_args()
    if os.geteuid() != 0 or not KNOB.exists():
        print("needs root and /proc/sys/kernel/printk_devkmsg", file=sys.stderr)
        return 2
    from gpumon_checks.nvswitch import NvswitchCheck
    from gpumon_checks.pcie import PcieCheck
    from gpumon_checks.xid import XidCheck

    with tempfile.TemporaryDirectory(prefix="gpumon-storm-dev-") as tmp:
        sim = Path(tmp) / "sim"
        subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", "healthy-8xh100", "--sim-dir",
                        str(sim)], capture_output=True, timeout=120)
        node = _read_node(sim)
        msgs = list(itertools.islice(storm_messages(node, 0, 1, 0.5), int(args.rate * args.seconds)))
        # the writer's level 5 at least: below it the console prints each line (slow, and noisy)
        lines = Path(tmp) / "lines.json"
        lines.write_text(json.dumps([f"<{max(prio, 5)}>{msg}" for prio, msg in msgs]))
        load = os.getloadavg()[0]
        old = KNOB.read_text().strip()
        KNOB.write_text("on\n")
        if args.daemon:
            try:
                return _daemon(args, sim, lines, len(msgs), load)
            finally:
                _flush(old)
        try:
            pump = KernelLogPump(lambda: KernelLogSource(KMSG, bounded=True), threading.Event(),
                                 [XidCheck(), NvswitchCheck(), PcieCheck()], boot="bench", marks={})
            pump.start()
            pump.first_read.wait(10)
            time.sleep(1.0)
            assert pump.thread.ident is not None
            clock = time.pthread_getcpuclockid(pump.thread.ident)
            read0, lost0 = pump.records, pump.source.lost_records if pump.source else 0
            cpu0, t0 = time.clock_gettime(clock), time.monotonic()
            writer = subprocess.Popen([sys.executable, "-c", WRITER, str(lines), str(args.rate)],
                                      stdout=subprocess.PIPE, text=True)
            while writer.poll() is None:
                for name in ("xid", "nvswitch", "pcie"):  # as the checks' runs take what is queued
                    pump.take(name)
                time.sleep(0.5)
            out, _ = writer.communicate()
            # the writing itself (the writer's own clock, without its start), and the pump's CPU
            # until it has read everything: the CPU share is over the writing
            wall = float(out.split()[-1]) if out.strip() else time.monotonic() - t0
            deadline = time.monotonic() + 30
            lost = 0
            while time.monotonic() < deadline:
                lost = (pump.source.lost_records if pump.source else 0) - lost0
                if pump.records - read0 + lost >= len(msgs):
                    break
                time.sleep(0.05)
            cpu = time.clock_gettime(clock) - cpu0
            read = pump.records - read0
            stats = pump.stats()
            pump.close()
        finally:
            _flush(old)
    print(f"machine: {describe()}")
    print(f"conditions: {len(msgs):,} lines written to {KMSG} at {args.rate:,.0f} lines/s from a separate "
          f"process ({len(msgs) / wall:,.0f}/s achieved over {wall:.1f} s); KernelLogPump (xid, nvswitch, "
          f"pcie) on its own thread; load average before {load:.2f}")
    print(f"records read {read:,}, overwritten in the ring before they were read {lost:,}, "
          f"merged repeats {stats['merged']}")
    print(f"pump thread: {cpu:.2f} s CPU = {1e6 * cpu / max(read, 1):.2f} us a line = "
          f"{100 * cpu / wall:.1f} % of a core at the rate achieved")
    unit = bare_us([msg for _, msg in msgs])
    print(f"bare prefilter + one regex over the same lines: {unit:.3f} us a line; the pump thread: "
          f"{1e6 * cpu / max(read, 1) / unit:.1f}x that")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
