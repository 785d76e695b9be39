"""The host_bandwidth check (check.py) and the measurements its workers run (kernels.py)."""

from .check import HostBandwidthCheck, HostBandwidthConfig

__all__ = ["HostBandwidthCheck", "HostBandwidthConfig"]
