"""The p2p check (check.py) and the measurements its workers run (kernels.py)."""

from .check import P2pCheck, P2pConfig

__all__ = ["P2pCheck", "P2pConfig"]
