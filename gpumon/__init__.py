"""gpumon: GPU node health-check agent."""

from importlib.metadata import PackageNotFoundError, version

from gpumon.distribution import DISTRIBUTION

try:
    # the distribution's name, not the import package's: they differ (gpumon/distribution.py)
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
