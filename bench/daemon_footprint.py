"""Daemon footprint: CPU share of one core and resident memory of ``gpumon daemon``.

Runs the real daemon as a child process on a simulated 8-GPU node with the
default configuration (every continuous check on its default schedule) and
samples it with psutil. The first ``--warmup`` seconds (imports, the first
run of every check, building the NVML injection library) are reported apart.

    .venv/bin/python bench/daemon_footprint.py [--seconds 600] [--scenario healthy-8xh100]
        [--config FILE]   (e.g. ``checks: {ib: {enabled: false}}`` to see what one check costs)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import describe


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--scenario", default="healthy-8xh100")
    ap.add_argument("--config", help="site config for the daemon (e.g. one that disables a check, to see "
                                     "what that check costs)")
    # any free port: a second daemon (another benchmark, a test) may hold 9426, and a daemon
    # that cannot serve exits at once, which would leave nothing to measure
    ap.add_argument("--listen", default="127.0.0.1:0")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "gpumon", "daemon", "--simulate", args.scenario,
           "--duration", str(args.seconds + args.warmup), "--listen", args.listen,
           *(["--config", args.config] if args.config else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = psutil.Process(proc.pid)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    c0 = p.cpu_times()
    rss: list[int] = []
    while time.monotonic() - t0 < args.seconds and proc.poll() is None:
        rss.append(p.memory_info().rss)
        time.sleep(1.0)
    if proc.poll() is not None:
        print(f"gpumon daemon exited early (code {proc.returncode}): nothing measured", file=sys.stderr)
        return 1
    c1 = p.cpu_times()
    wall = time.monotonic() - t0
    threads = p.num_threads()
    load = os.getloadavg()
    proc.wait(timeout=60)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    print(f"machine: {describe()}")
    print(f"conditions: gpumon daemon --simulate {args.scenario}, "
          f"{'config ' + args.config if args.config else 'default config'}, "
          f"{wall:.0f} s measured after {args.warmup:g} s warm-up, sampled every 1 s; "
          f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)")
    print(f"cpu: {100 * cpu / wall:.2f} % of one core ({cpu:.2f} s CPU in {wall:.0f} s)")
    print(f"rss: max {max(rss) / 2**20:.1f} MiB, median {sorted(rss)[len(rss) // 2] / 2**20:.1f} MiB; "
          f"threads at the end: {threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
