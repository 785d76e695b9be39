"""The hardware layer: the only code in gpumon that touches the machine.

``Hardware`` bundles the sources a check may use: ``nvml`` (nvidia-ml-py),
``fs`` (host-root files), ``tools`` (external commands). Every call made
through them is bounded by a timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpumon.errors import HwFailure, NotSupported
from gpumon.hw.calls import BoundedCaller
from gpumon.hw.hostfs import HostFs
from gpumon.hw.nvml import NvmlReadings
from gpumon.hw.tools import ToolRunner
from gpumon.sim.devices import SIM_DEVICES_FILE, DeviceModel


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

    def sim_devices(self) -> dict[int, DeviceModel]:
        """A simulated node's GPU device models by index (gpumon/sim/devices.py); {} on a real node.

        On a simulated node the compute checks' CPU workers stand in for the simulated GPUs and
        behave as these models say (a slow GPU, a corrupting all-reduce, a slow link).
        """
        if not self.simulated:
            return {}
        try:
            text = self.fs.read_text(SIM_DEVICES_FILE)
        except NotSupported:
            return {}  # not rendered: every simulated GPU healthy
        try:
            data = json.loads(text)
            return {int(k): DeviceModel.from_json(v) for k, v in dict(data).items()}
        except (ValueError, TypeError) as exc:
            raise HwFailure(f"simulated device models {SIM_DEVICES_FILE}: {exc}",
                            call=f"read {SIM_DEVICES_FILE}") from exc

    def current_call(self, thread_ident: int) -> str | None:
        """What hardware call the given thread is blocked in (for "hung in ..." messages)."""
        return self.caller.current_call(thread_ident) or self.tools.current_call(thread_ident)


__all__ = ["Hardware"]
