"""gpumon: GPU node health-check agent."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpumon")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
