"""Narrow exceptions. Only ``cli.py`` turns them into exit codes."""

from __future__ import annotations


class GpumonError(Exception):
    """Base of every error gpumon raises on purpose."""


class ConfigError(GpumonError):
    """A bad configuration, profile or scenario file: names the file, line and key."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        self.file = file
        self.line = line
        self.key = key
        self.reason = message
        # no file: a flag or a built-in value, named by its key alone (a literal "<config>:" told
        # the reader nothing)
        parts = []
        if file:
            parts.append(file if line is None else f"{file}:{line}")
        if key:
            parts.append(key)
        super().__init__(": ".join([*parts, message]))


class StartupError(GpumonError):
    """gpumon cannot run at all here (no NVML and no simulation, unusable host root)."""


class NvmlUnavailable(StartupError):
    """The NVML library or the driver behind it is missing."""


class HwCondition(GpumonError):
    """A typed answer from the hardware layer that is not a reading.

    Checks may catch these to word their own finding; whatever they do not
    catch the runner turns into a finding for ``component``.
    """

    def __init__(self, message: str, *, call: str, component: str = "node") -> None:
        self.call = call
        self.component = component
        super().__init__(message)


class GpuLost(HwCondition):
    """NVML_ERROR_GPU_IS_LOST: the GPU no longer answers; a node reboot is needed."""


class NotSupported(HwCondition):
    """The device or driver does not offer this reading; the capability is off."""


class HwTimeout(HwCondition):
    """A hardware call did not return within its bound. A hung call is a finding."""

    def __init__(self, message: str, *, call: str, component: str = "node", seconds: float) -> None:
        self.seconds = seconds
        super().__init__(message, call=call, component=component)


class HwFailure(HwCondition):
    """Any other hardware-call error (NVML error code, unreadable file, tool failure)."""


class ToolMissing(HwCondition):
    """An external tool (dcgmi, ib_write_bw, ...) is not installed."""
