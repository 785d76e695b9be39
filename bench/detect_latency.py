"""Detection latency: an Xid line appended to the kernel log -> the finding available in the daemon.

Runs the real daemon in-process on a simulated 8xH100 node (kernel log = a
regular file followed like ``tail -F``, polled every ``daemon.kernel_log_poll_s``),
appends N Xid lines one at a time, and times how long until the daemon's
latest xid result counts the new line. Prints p50/p90/p99/max.

    .venv/bin/python bench/detect_latency.py [--events 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import describe

from gpumon.agent import Agent
from gpumon.config import load_config
from gpumon.daemon import Daemon
from gpumon.registry import load_checks
from gpumon.sim.scenario import load_scenario
from gpumon.sim.simulation import Simulation


def _count(daemon: Daemon) -> int:
    run = daemon.latest.get("xid")
    if run is None:
        return 0
    return sum(int(f.evidence.get("count", 0)) for f in run.findings if f.component == "gpu/2")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1000)
    args = ap.parse_args()
    checks = load_checks()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "gpumon.yaml"
        cfg.write_text("checks:\n  xid:\n    interval_s: 3600\n")
        config = load_config(cfg, checks, site_file=Path(tmp) / "none")
        sim = Simulation.start(load_scenario("healthy-8xh100"), 0.0, Path(tmp) / "sim")
        agent = Agent(config, checks, sim, persist_state=False)
        agent.start()
        daemon = Daemon(agent)
        thread = threading.Thread(target=daemon.serve, kwargs={"duration": 10_000}, daemon=True)
        thread.start()
        time.sleep(1.0)
        kmsg = sim.node.kmsg_path
        latencies: list[float] = []
        seq = 100_000
        rng = random.Random(1)
        with open(kmsg, "a", encoding="utf-8") as log:
            for i in range(args.events):
                before = _count(daemon)
                seq += 1
                usec = int((3700 + i) * 1e6)
                line = (f"4,{seq},{usec},-;NVRM: Xid (PCI:0000:4c:00): 31, pid={1000 + i}, name=python3, "
                        "Ch 0000003b, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_1 faulted @ "
                        "0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ\n")
                # lines arrive at random moments, not in step with the follower's polling
                time.sleep(rng.uniform(0.0, 0.25))
                start = time.perf_counter()
                log.write(line)
                log.flush()
                deadline = start + 10.0
                while _count(daemon) <= before and time.perf_counter() < deadline:
                    time.sleep(0.001)
                latencies.append(time.perf_counter() - start)
        daemon.stop.set()
        daemon.wake.set()
        thread.join(timeout=10)
        sim.close()
    q = statistics.quantiles(latencies, n=100)
    print(f"machine: {describe()}")
    print(f"conditions: simulated 8xH100, default config (kernel log polled every "
          f"{config.daemon.kernel_log_poll_s:g} s as a regular file), {args.events} Xid lines appended one "
          "at a time at random moments (0-250 ms apart after the previous detection)")
    print(f"detection latency: p50 {q[49] * 1000:.0f} ms, p90 {q[89] * 1000:.0f} ms, "
          f"p99 {q[98] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
