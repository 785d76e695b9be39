"""The ib check: the check itself (``check``), its saved state, typed (``state``), and the outage
arithmetic that folds each port's samples into outages and error rates (``outages``)."""

from .check import IbCheck, IbConfig
from .state import IbState

__all__ = ["IbCheck", "IbConfig", "IbState"]
