"""Whether a GPU is free for gpumon's own active tests (SDC canaries, the fabric probe).

A GPU is idle when NVML lists no compute process on it (this process aside) AND its utilization is
at or below a limit. Processes come first because utilization is a sampled share of time with a
kernel running: a job between steps, loading data or waiting on a collective reads 0 % while its
processes still hold the GPU. Where the driver cannot list processes (NotSupported) utilization
alone decides, and the evidence says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumon.errors import NotSupported

if TYPE_CHECKING:
    from gpumon.hw import Hardware

PIDS_SHOWN = 8  # in a busy GPU's message; the evidence lists them all


@dataclass(frozen=True)
class IdleGate:
    """Whether one GPU may take an active test, and what that was judged on."""

    busy: str | None  # why the GPU is busy; None: idle
    evidence: dict[str, Any]


def idle_gate(hw: Hardware, index: int, max_utilization_pct: int,
              own_pids: Iterable[int] = ()) -> IdleGate:
    """Compute processes first, utilization second. Raises HwCondition on any other NVML error."""
    # a CUDA context of gpumon's own (torch initialised in-process, or a sibling probe rank)
    # must not make its GPU busy
    mine = {os.getpid(), *own_pids}
    evidence: dict[str, Any] = {}
    try:
        procs = [p for p in hw.nvml.compute_processes(index) if p.pid not in mine]
    except NotSupported as cond:
        evidence["compute_processes"] = f"not supported ({cond}): idle judged by utilization only"
    else:
        evidence["compute_processes"] = [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes}
                                         for p in procs]
        if procs:
            pids = ", ".join(str(p.pid) for p in procs[:PIDS_SHOWN])
            more = f" (+{len(procs) - PIDS_SHOWN} more)" if len(procs) > PIDS_SHOWN else ""
            return IdleGate(f"GPU {index} busy: {len(procs)} compute process(es): pids {pids}{more}",
                            evidence)
    util = hw.nvml.utilization_pct(index)
    evidence["utilization_pct"] = util
    if util > max_utilization_pct:
        return IdleGate(f"GPU {index} busy ({util} % utilization)", evidence)
    return IdleGate(None, evidence)
