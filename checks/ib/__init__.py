"""The ib check: the check itself (``check``), its options (``options``), its saved state, typed,
with the outage records (``state``), and the arithmetic that folds each port's samples into
outages and error rates (``outages``)."""

from .check import IbCheck
from .options import IbConfig
from .state import IbState

__all__ = ["IbCheck", "IbConfig", "IbState"]
