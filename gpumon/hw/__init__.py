"""The hardware layer: the only code in gpumon that touches the machine.

``Hardware`` bundles the sources a check may use: ``nvml`` (nvidia-ml-py),
``fs`` (host-root files), ``tools`` (external commands). Every call made
through them is bounded by a timeout.
"""

from __future__ import annotations

from pathlib import Path

from gpumon.hw.calls import BoundedCaller
from gpumon.hw.hostfs import HostFs
from gpumon.hw.nvml import NvmlReadings
from gpumon.hw.tools import ToolRunner


class Hardware:
    def __init__(self, host_root: Path, *, nvml_timeout: float = 5.0, fs_timeout: float = 2.0,
                 tool_timeout: float = 120.0, simulated: bool = False,
                 tool_path: str | None = None) -> None:
        self.caller = BoundedCaller()
        self.host_root = host_root
        self.fs = HostFs(host_root, self.caller, fs_timeout)
        self.nvml = NvmlReadings(self.caller, nvml_timeout, simulated=simulated)
        self.tools = ToolRunner(tool_timeout, tool_path)
        self.simulated = simulated

    def current_call(self, thread_ident: int) -> str | None:
        """What hardware call the given thread is blocked in (for "hung in ..." messages)."""
        return self.caller.current_call(thread_ident) or self.tools.current_call(thread_ident)


__all__ = ["Hardware"]
