"""The burnin check (check.py) and the measurements its workers run (kernels.py)."""

from .check import BurninCheck, BurninConfig

__all__ = ["BurninCheck", "BurninConfig"]
