"""Run gpumon with its wall clock shifted: ``python skewed_clock.py SECONDS gpumon-args...``.

A node whose clock runs SECONDS ahead (negative: behind), for issue 35's post-mortem tests: NTP drift
of seconds is ordinary, a minute not rare after a BMC reset. Everything the process reads from
``time.time``/``time.time_ns`` is shifted (checks stamping findings, the health store, the query
API's ``now``, the simulated node's own clock, from which its kernel log and ``/proc/stat``'s boot
time are rendered), so the node is consistently ahead, as a real one is. ``time.monotonic`` is not
shifted (nor is it on a real node whose wall clock is off), and neither are child processes.

A test helper only: gpumon itself has no way to shift its clock.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    skew = float(sys.argv[1])
    real, real_ns = time.time, time.time_ns
    # before gpumon is imported, so that no module holds the real function under another name
    time.time = lambda: real() + skew
    time.time_ns = lambda: real_ns() + round(skew * 1e9)
    sys.argv = ["gpumon", *sys.argv[2:]]
    from gpumon.cli import main as gpumon

    sys.exit(gpumon())


if __name__ == "__main__":
    main()
