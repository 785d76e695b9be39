"""The node gpumon runs on, as the edge (the CLI) hands it in.

``Machine`` is this machine: its host root, state directory and kernel log are the config's, its
clock is the wall clock, its compute devices are the ones torch sees. What differs on another kind
of node (the simulator's) is handed in as a subclass that overrides these answers; the
agent, the daemon and the checks only ask them and never learn what kind of node it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from gpumon.hw.placement import ComputeDevices

T = TypeVar("T")

# A task the daemon runs beside its checks until the stop event is set (named for thread listings).
BackgroundTask = tuple[str, Callable[[threading.Event], None]]


class Machine:
    """This machine, as the config describes it."""

    def host_root(self, configured: Path) -> Path:
        return configured

    def state_dir(self, configured: Path) -> Path:
        return configured

    def kmsg_path(self, configured: Path) -> Path:
        return configured

    def runtime_path(self, configured: Path) -> Path:
        """Where a socket the daemon serves lies (the intake's, under /run)."""
        return configured

    def node_name(self) -> str | None:
        """The node's name when the machine has its own (None: the config's, else the hostname)."""
        return None

    def label(self) -> str | None:
        """What reports say the node is, beside its name (None: a real node, said nowhere)."""
        return None

    def devices(self) -> ComputeDevices:
        """Who places the compute checks' workers on this machine's devices."""
        return ComputeDevices()

    def cannot_host(self) -> Mapping[str, str]:
        """Bootstrap checks this kind of machine cannot run by its nature, and why: the suite does
        not require them here (a real node can host every check: none)."""
        return {}

    @property
    def nvml_complete(self) -> bool:
        """The NVML library implements every entry point gpumon calls (``Hardware``)."""
        return False

    def clock(self) -> float:
        """The time the checks judge by."""
        return time.time()

    def replay(self, step: Callable[[], T]) -> T:
        """A one-shot ``gpumon check``: ``step()`` runs the checks once. A machine with a history to
        replay runs it at each of its times, the last result the report."""
        return step()

    @property
    def replays(self) -> bool:
        """``replay`` runs ``step`` at more than one time (the checks keep state between the runs)."""
        return False

    def background_tasks(self) -> list[BackgroundTask]:
        """What the daemon runs beside its checks while this machine is in use."""
        return []

    def close(self) -> None:
        """Release what the machine holds (nothing, for this one)."""
