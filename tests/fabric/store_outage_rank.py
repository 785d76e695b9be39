"""Run the real ``gpumon`` CLI with one rank's rendezvous path cut for a moment (tests only).

``GPUMON_TEST_STORE_OUTAGE=RANK:CALL:SECONDS``: as rank RANK's CALL-th all_gather returns, its
network namespace stops sending to the rendezvous store (TCP to ``MASTER_PORT``: a blackhole
``ip rule``) for SECONDS; every other rank runs gpumon untouched. The data path stays up, as NCCL's
on InfiniBand does when a GPU node's Ethernet flaps. Cut there, what the rank sends next is its value
for an agreement of the sweep (after a size's third timed call, ``gpumon.fabric.sweep``), so the
others wait on it in that agreement every run; a link flap lands on one only by chance. gpumon has no
hook for this: the wrapper counts torch.distributed's calls around the whole command.

    python store_outage_rank.py probe-fabric --json ...
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

SBIN = os.pathsep.join((os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"))


def _rule(verb: str) -> None:
    ip = shutil.which("ip", path=SBIN) or "ip"
    subprocess.run([ip, "rule", verb, "ipproto", "tcp", "dport", os.environ["MASTER_PORT"], "blackhole"],
                   check=True, capture_output=True, timeout=10)


def _cut_after(call: int, seconds: float) -> None:
    import torch.distributed as dist

    calls = 0
    lock = threading.Lock()

    def heal() -> None:
        time.sleep(seconds)  # the outage's length
        _rule("del")

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            out = fn(*args, **kwargs)
            with lock:
                calls += 1
                if calls == call:
                    _rule("add")
                    threading.Thread(target=heal, daemon=True).start()
            return out
        return counted

    # the one the probe calls (gpumon.fabric.sweep: the first of the two that this torch has)
    name = "all_gather_single" if getattr(dist, "all_gather_single", None) else "all_gather_into_tensor"
    setattr(dist, name, wrap(getattr(dist, name)))


def main() -> int:
    from gpumon.cli import main as gpumon_main

    spec = os.environ.get("GPUMON_TEST_STORE_OUTAGE", "")
    rank = int(os.environ.get("RANK") or -1)
    if spec:
        who, call, seconds = spec.split(":")
        if int(who) == rank:
            _cut_after(int(call), float(seconds))
    return gpumon_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
