"""Run the real ``gpumon`` CLI with one rank under the SDC fault-injection harness (tests only).

``GPUMON_TEST_FAULT`` holds a ``gpumon.sdc.inject.FaultSpec`` (its ``worker`` is the faulty rank, read
from the launcher's ``RANK`` or ``SLURM_PROCID``); every other rank runs gpumon untouched. gpumon
itself has no hook for this: the harness is a torch dispatch mode wrapped around the whole command.

    python faulty_rank.py probe-fabric --json ...
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    from gpumon.cli import main as gpumon_main

    spec_text = os.environ.get("GPUMON_TEST_FAULT", "")
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or -1)
    if not spec_text:
        return gpumon_main(sys.argv[1:])
    from gpumon.sdc.inject import FaultInjector, FaultSpec

    spec = FaultSpec.parse(spec_text)
    if spec.worker != rank:
        return gpumon_main(sys.argv[1:])
    with FaultInjector(spec):
        return gpumon_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
