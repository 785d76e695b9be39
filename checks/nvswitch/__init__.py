"""The nvswitch check: the check itself (``check``), its readings (``sxid``, ``fabric_state``, ``fm_log``,
and ``evidence``, what they share), its options (``options``), its saved state (``state``) and the SXid
catalog it acts on (``catalog``)."""

from .check import NvswitchCheck
from .options import NvswitchConfig

__all__ = ["NvswitchCheck", "NvswitchConfig"]
