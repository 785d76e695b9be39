"""The pcie check: the check itself (``check``, with the kernel-log fold the daemon's pump runs) and
its saved state, typed (``state``)."""

# _ingest and _ingest_summary: the line-by-line ingest that tests/checks/test_pcie_fold.py holds
# the fold to
from .check import AerDelta, AerFold, PcieCheck, PcieConfig, _ingest, _ingest_summary

__all__ = ["AerDelta", "AerFold", "PcieCheck", "PcieConfig", "_ingest", "_ingest_summary"]
