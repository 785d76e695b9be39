"""The guard check: verdicts of training jobs' in-job SDC checks (gpumon.guard) as findings."""

from .check import GuardCheck
from .options import GuardConfig

__all__ = ["GuardCheck", "GuardConfig"]
