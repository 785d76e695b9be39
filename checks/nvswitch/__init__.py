"""The nvswitch check: the check itself (``check``) and the SXid catalog it acts on (``catalog``)."""

from .check import NvswitchCheck, NvswitchConfig

__all__ = ["NvswitchCheck", "NvswitchConfig"]
