"""The collective_hang check: the check itself (``check``) and its saved state, typed, with the run
of signature samples per GPU (``state``)."""

from .check import CollectiveHangCheck, CollectiveHangConfig
from .state import CollectiveHangState, Run

__all__ = ["CollectiveHangCheck", "CollectiveHangConfig", "CollectiveHangState", "Run"]
