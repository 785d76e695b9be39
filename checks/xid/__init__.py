"""The xid check: the check itself (``check``), gpumon's reading of NVIDIA's Xid catalog with its
overrides (``catalog``) and NVIDIA's catalog as generated data (``catalog_data``)."""

from .check import XidCheck, XidConfig

__all__ = ["XidCheck", "XidConfig"]
