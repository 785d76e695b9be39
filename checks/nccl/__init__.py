"""The nccl check (check.py) and the measurements its workers run (kernels.py)."""

from .check import NcclCheck, NcclConfig

__all__ = ["NcclCheck", "NcclConfig"]
