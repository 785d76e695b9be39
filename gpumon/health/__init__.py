"""Health state: findings become events, events fold into a reboot-aware state per component and node.

``state`` is the pure fold (no I/O, no clock); ``store`` keeps the events in
SQLite (``store_file``: the file opened, its errors in words) and ``Health``
(``keeper``) ties the two together for the daemon and the CLI.
"""

from gpumon.health.keeper import Health
from gpumon.health.state import (
    Accepted,
    ComponentHealth,
    Event,
    EventKind,
    Fault,
    FaultId,
    HealthPolicy,
    HealthState,
    HealthView,
    Level,
    NodeHealth,
    Observation,
    Quarantine,
    fold,
)
from gpumon.health.store import DB_NAME, EventStore, load_view
from gpumon.health.store_file import StoreError

__all__ = [
    "DB_NAME",
    "Accepted",
    "ComponentHealth",
    "Event",
    "EventKind",
    "EventStore",
    "Fault",
    "FaultId",
    "Health",
    "HealthPolicy",
    "HealthState",
    "HealthView",
    "Level",
    "NodeHealth",
    "Observation",
    "Quarantine",
    "StoreError",
    "fold",
    "load_view",
]
