"""A simulated node as the ``Machine`` gpumon runs on: a scenario rendered into a directory (host
root, kernel log, state), the NVML injection library loaded, CPU workers standing in for its GPUs,
and its own clock (the daemon steps it; a one-shot ``check`` replays the scenario's times)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gpumon.hw import Hardware
from gpumon.hw.placement import ComputeDevices
from gpumon.machine import BackgroundTask, Machine
from gpumon.sim.devices import SimulatedDevices
from gpumon.sim.render import SimNode
from gpumon.sim.scenario import Scenario

T = TypeVar("T")

# A simulated node's clock: how often it re-renders while a counter ramps, and the longest
# it sleeps otherwise (a wall clock stepped back or forth is caught up within that).
SIM_TICK_S = 0.25
SIM_MAX_SLEEP_S = 5.0
# sun_path of a Unix socket holds 108 bytes with the terminating NUL (unix(7))
SOCKET_PATH_BYTES = 107


def sim_wait(scenario: Scenario, t: float) -> float:
    """Seconds from scenario time ``t`` to the next moment the simulated node looks different
    (``Scenario.changes_between``), found to 5 ms: SIM_TICK_S while a counter ramps, at most
    SIM_MAX_SLEEP_S. Asking every 0.25 s instead cost a healthy simulated node, where nothing
    ever changes, ~0.05 % of a core (each timed wake-up of a thread costs ~0.1 ms of CPU)."""
    if scenario.changes_between(t, t):  # only a counter ramping at t makes that true
        return SIM_TICK_S
    if not scenario.changes_between(t, t + SIM_MAX_SLEEP_S):
        return SIM_MAX_SLEEP_S
    # With nothing ramping at t, "changed by t + x" only turns true as x grows (a ramp
    # running at t + x started after t): bisect for where it does.
    lo, hi = 0.0, SIM_MAX_SLEEP_S
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        if scenario.changes_between(t, t + mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class Simulation(Machine):
    """A simulated node rendered into a directory, with the NVML injection library loaded."""

    scenario: Scenario
    node: SimNode
    lib_dir: Path
    at_s: float
    tmp: tempfile.TemporaryDirectory[str] | None = None
    # a one-shot ``check``: the times its checks run at (Scenario.replay_times), the last one
    # the time it reports; empty otherwise
    replay_times: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, scenario: Scenario, at_s: float | None, workdir: Path | None = None,
              live: bool = False, *, new_boot: bool = False, replay: bool = False) -> Simulation:
        """Render ``scenario`` into ``workdir`` (None: a temporary directory, removed by close()).

        - ``live`` (the daemon): at the wall clock's time since the node's start (a resumed node
          keeps its start; ``new_boot`` boots the node in ``workdir`` again, from scenario time 0);
        - ``replay`` (``gpumon check``): at the first of ``replay_times`` up to ``at_s`` (None: after
          every fault); the caller steps through them with :meth:`replay`;
        - else at ``at_s``; None: a node already in ``workdir`` as it is now (its clock runs whether
          or not a daemon does), a new one after every fault.

        A new node is started ``t`` seconds before now, so that what it logs is in the past."""
        from gpumon.sim import nvml_inject
        tmp = None
        if workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="gpumon-sim-")
            workdir = Path(tmp.name)
        node = SimNode(scenario, workdir, resume=not new_boot)
        now = time.time()
        times: list[float] = []
        if live or (at_s is None and node.resumed and not replay):
            t = max(0.0, now - node.start_wall)  # the node's own clock
        else:
            t = scenario.horizon_s if at_s is None else at_s
            if not node.resumed:
                node.start_wall = now - t
            if replay:
                times = scenario.replay_times(t)
                t = times[0]
        node.render(t)
        lib_dir = nvml_inject.build_library()
        os.environ[nvml_inject.STATE_ENV] = str(node.nvml_state_path)
        # Children (tools) find the library through LD_LIBRARY_PATH like any
        # program would; this process read LD_LIBRARY_PATH at startup, so it
        # loads the library by path and pynvml then binds to it by soname.
        paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
        if str(lib_dir) not in paths:
            os.environ["LD_LIBRARY_PATH"] = ":".join([str(lib_dir), *paths])
        nvml_inject.preload(lib_dir)
        return cls(scenario, node, lib_dir, t, tmp, times)

    # -- the Machine -----------------------------------------------------------------------------

    def host_root(self, configured: Path) -> Path:
        return self.node.host_root

    def state_dir(self, configured: Path) -> Path:
        return self.node.root / "state"

    def kmsg_path(self, configured: Path) -> Path:
        return self.node.kmsg_path

    def runtime_path(self, configured: Path) -> Path:
        # The node's /run is the simulated node's own, as its host root is: simulated daemons side
        # by side (a test suite's) do not take each other's socket, and none needs root for /run.
        # A path elsewhere (a test's) is where the configuration says.
        for run in (Path("/run"), Path("/var/run")):
            if configured.is_relative_to(run):
                path = self.node.root / "run" / configured.relative_to(run)
                if len(os.fsencode(str(path))) > SOCKET_PATH_BYTES:
                    # a deep simulated node (a long $XDG_STATE_HOME) gets a short /run of its own:
                    # the same node, the same path again after a restart
                    digest = hashlib.blake2b(str(self.node.root).encode(), digest_size=6).hexdigest()
                    path = Path(tempfile.gettempdir()) / f"gpumon-run-{digest}" / configured.relative_to(run)
                return path
        return configured

    def node_name(self) -> str | None:
        return f"sim-{self.scenario.name}"

    def label(self) -> str | None:
        return self.scenario.name

    def devices(self) -> ComputeDevices:
        return SimulatedDevices(self.node.host_root)

    def cannot_host(self) -> Mapping[str, str]:
        # CPU workers stand in for the GPUs: there is no host-device link to copy over, and
        # host_bandwidth rightly says skipped; its absence must not make every simulated suite
        # INCOMPLETE (a real node without CUDA still is: NoCudaOnGpuNode)
        return {"host_bandwidth": "a simulated node has no host-device link (CPU workers stand in for "
                                  "its GPUs)"}

    @property
    def nvml_complete(self) -> bool:
        # the injection library: a missing entry point is the simulator's bug, not an old driver
        return True

    def clock(self) -> float:
        """The wall clock of the node at its scenario time (what a replay's checks read)."""
        return self.node.start_wall + self.at_s

    @property
    def replays(self) -> bool:
        return bool(self.replay_times)

    def replay(self, step: Callable[[], T]) -> T:
        """``step()`` at each of ``replay_times``, the node rendered at that time; the last result.
        ``step`` runs the checks with :meth:`clock` as their clock, so that what they keep between
        runs (an outage's start, a counter's last reading) is timed in scenario time."""
        result: T | None = None
        for t in self.replay_times or [self.at_s]:
            self.advance(t)
            result = step()
        assert result is not None
        return result

    def background_tasks(self) -> list[BackgroundTask]:
        return [("gpumon-sim-clock", self.run_clock)]

    def run_clock(self, stop: threading.Event) -> None:
        """Step the node along the wall clock until ``stop`` (the daemon's simulation clock)."""
        wait = sim_wait(self.scenario, time.time() - self.node.start_wall)
        while not stop.wait(wait):
            t = time.time() - self.node.start_wall
            self.advance(t)
            wait = sim_wait(self.scenario, t)

    def advance(self, t: float) -> None:
        # Re-render only when the scenario changes: the simulator must not be
        # what a footprint benchmark of the agent measures.
        if self.scenario.changes_between(self.at_s, t):
            self.node.render(t)
        self.at_s = t

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def simulated_hardware(host_root: Path, *, nvml_timeout: float = 5.0) -> Hardware:
    """The hardware layer of a simulated node rendered at ``host_root`` (what ``Agent.start`` builds
    from a ``Simulation``), for code that reads a node without an agent."""
    return Hardware(host_root, nvml_timeout=nvml_timeout, devices=SimulatedDevices(host_root),
                    nvml_complete=True)
