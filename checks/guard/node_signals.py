"""What this node's hardware says of a GPU a job called a straggler, added to the verdict's finding."""

from __future__ import annotations

from typing import Any

from gpumon.check import CheckContext
from gpumon.hw.nvml import CLOCK_EVENT_REASONS


def signals(ctx: CheckContext, index: int) -> dict[str, Any]:
    """What this node's hardware says of a GPU a job called slow: throttle reasons, temperature,
    PCIe link against its maximum, NVLink links up. Each reading bounded; one that fails says why."""
    nvml = ctx.hw.nvml

    def reasons() -> list[str]:
        mask = nvml.clocks_event_reasons(index)
        return [n for n, bit in CLOCK_EVENT_REASONS.items() if mask & bit and n != "gpu_idle"]

    def pcie() -> dict[str, Any]:
        link = nvml.pcie_link(index)
        return {"generation": link.generation, "max_generation": link.max_generation, "width": link.width,
                "max_width": link.max_width,
                "degraded": link.width < link.max_width or link.generation < link.max_generation}

    def nvlink() -> str:
        n = nvml.nvlink_count(index)
        return f"{sum(nvml.nvlink_state(index, i) for i in range(n))}/{n}"

    out: dict[str, Any] = {}
    for key, fn in (("clock_event_reasons", reasons), ("temperature_c", lambda: nvml.temperature_c(index)),
                    ("pcie_link", pcie), ("nvlink_up", nvlink)):
        try:
            out[key] = fn()
        except Exception as exc:  # a signal that cannot be read is said, never a crash of the check
            out[key] = f"unreadable: {type(exc).__name__}: {exc}"
    return out
