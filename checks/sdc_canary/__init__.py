"""The sdc_canary check (check.py) and the verdict it draws from a canary run (verdict.py)."""

from .check import SdcCanaryCheck, SdcCanaryConfig

__all__ = ["SdcCanaryCheck", "SdcCanaryConfig"]
