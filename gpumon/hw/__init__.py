"""The hardware layer: the only code in gpumon that touches the machine.

``Hardware`` bundles the sources a check may use: ``nvml`` (nvidia-ml-py),
``fs`` (host-root files), ``tools`` (external commands), ``devices`` (which compute
device stands for which GPU). Every call made through the first three is bounded by a timeout.
"""

from __future__ import annotations

from pathlib import Path

from gpumon.hw.calls import BoundedCaller
from gpumon.hw.hostfs import HostFs
from gpumon.hw.nvml import NvmlReadings
from gpumon.hw.placement import ComputeDevices
from gpumon.hw.tools import ToolRunner


class Hardware:
    def __init__(self, host_root: Path, *, nvml_timeout: float = 5.0, fs_timeout: float = 2.0,
                 tool_timeout: float = 120.0, tool_path: str | None = None,
                 devices: ComputeDevices | None = None, nvml_complete: bool = False) -> None:
        """``devices``: who places the compute workers (default: this machine's devices, as torch sees
        them). ``nvml_complete``: the NVML library implements every entry point gpumon calls, so a
        missing one is gpumon's bug rather than an old driver (the simulator's injection library)."""
        self.caller = BoundedCaller()
        self.host_root = host_root
        self.fs = HostFs(host_root, self.caller, fs_timeout)
        self.nvml = NvmlReadings(self.caller, nvml_timeout, complete=nvml_complete)
        self.tools = ToolRunner(tool_timeout, tool_path)
        self.devices = devices if devices is not None else ComputeDevices()

    def current_call(self, thread_ident: int) -> str | None:
        """What hardware call the given thread is blocked in (for "hung in ..." messages)."""
        return self.caller.current_call(thread_ident) or self.tools.current_call(thread_ident)


def local_cpu_model() -> str:
    """This host's CPU model name (/proc/cpuinfo), for code that runs outside an agent: a training
    job capturing a step for the SDC canary keys its golden by the CPU that replayed it."""
    from gpumon.errors import HwCondition

    try:
        cpuinfo = HostFs(Path("/"), BoundedCaller(), 2.0).read_text("proc/cpuinfo")
    except HwCondition:
        return "unknown CPU"
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


__all__ = ["Hardware", "local_cpu_model"]
