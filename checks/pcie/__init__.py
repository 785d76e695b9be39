"""The pcie check: the check itself (``check``), its options (``options``), the judging of one
watched function's AER counters, link and kernel-log entry (``judge``), the AER lines of the
kernel log folded as they come, the daemon's pump included (``aer_log``), and its saved state,
typed (``state``)."""

# _ingest and _ingest_summary: the line-by-line ingest that tests/checks/test_pcie_fold.py holds
# the fold to
from .aer_log import AerDelta, AerFold, _ingest, _ingest_summary
from .check import PcieCheck
from .options import PcieConfig

__all__ = ["AerDelta", "AerFold", "PcieCheck", "PcieConfig", "_ingest", "_ingest_summary"]
