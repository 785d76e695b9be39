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

    sudo .venv/bin/python bench/storm_device.py [--rate 20000] [--seconds 10]
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
from storm import _read_node, storm_messages  # noqa: E402

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
for i in range(0, len(lines), tick):
    for b in lines[i:i + tick]:
        os.write(fd, b)
    pause = t0 + (i + tick) / rate - time.monotonic()
    if pause > 0:
        time.sleep(pause)
print(time.monotonic() - t0)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
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
            wall = float(out.strip() or (time.monotonic() - t0))
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
            KNOB.write_text("on\n")
            fd = os.open(KMSG, os.O_WRONLY)
            for i in range(50_000):  # the storm's fake Xids out of the ring
                os.write(fd, f"<6>gpumon bench: ring flush {i}".encode())
            os.close(fd)
            KNOB.write_text(old + "\n")
    print(f"machine: {describe()}")
    print(f"conditions: {len(msgs):,} lines written to {KMSG} at {args.rate:,.0f} lines/s from a separate "
          f"process ({len(msgs) / wall:,.0f}/s achieved over {wall:.1f} s); KernelLogPump (xid, nvswitch, "
          f"pcie) on its own thread; load average before {load:.2f}")
    print(f"records read {read:,}, overwritten in the ring before they were read {lost:,}, "
          f"merged repeats {stats['merged']}")
    print(f"pump thread: {cpu:.2f} s CPU = {1e6 * cpu / max(read, 1):.2f} us a line = "
          f"{100 * cpu / wall:.1f} % of a core at the rate achieved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
