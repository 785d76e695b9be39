"""Assembles one gpumon instance from a Config: hardware, inventory, profile, runner.

Used by every CLI command. Startup failures are ``StartupError`` (exit 3);
nothing here exits the process.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gpumon.check import Check, KernelLog
from gpumon.checkstate import CheckStateStore
from gpumon.config import Config, with_profile
from gpumon.errors import HwCondition, NvmlUnavailable, StartupError
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory, collect
from gpumon.hw.kmsg import KernelLogFollower
from gpumon.hw.nvrm import NvrmParser
from gpumon.model import Phase
from gpumon.profiles import Profile, all_profiles, select_profile
from gpumon.runner import CheckRun, Runner
from gpumon.sim.render import SimNode
from gpumon.sim.scenario import Scenario

T = TypeVar("T")


@dataclass
class Simulation:
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

    def clock(self) -> float:
        """The wall clock of the node at its scenario time (what a replay's checks read)."""
        return self.node.start_wall + self.at_s

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

    def advance(self, t: float) -> None:
        # Re-render only when the scenario changes: the simulator must not be
        # what a footprint benchmark of the agent measures.
        if self.scenario.changes_between(self.at_s, t):
            self.node.render(t)
        self.at_s = t

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


@dataclass
class Agent:
    config: Config
    checks: dict[str, type[Check]]
    simulation: Simulation | None = None
    # only the daemon keeps check state across runs; one-shot commands start clean
    persist_state: bool = False
    hw: Hardware = field(init=False)
    inventory: Inventory = field(init=False)
    profile: Profile = field(init=False)
    node: str = field(init=False)
    runner: Runner = field(init=False)
    check_state: CheckStateStore = field(init=False)

    def start(self) -> None:
        host_root = Path(self.config.host_root)
        if self.simulation is not None:
            host_root = self.simulation.node.host_root
        if not host_root.is_dir():
            raise StartupError(f"host root {host_root} is not a directory")
        if not (host_root / "sys").is_dir() and not (host_root / "proc").is_dir():
            raise StartupError(f"host root {host_root} has neither sys/ nor proc/: is the host "
                               "mounted there?")
        t = self.config.timeouts
        self.hw = Hardware(host_root, nvml_timeout=t.nvml_call_s, fs_timeout=t.sysfs_read_s,
                           tool_timeout=t.tool_default_s, simulated=self.simulation is not None)
        try:
            self.hw.nvml.init()
        except NvmlUnavailable:
            raise
        self.inventory = collect(self.hw.nvml, self.hw.fs)
        if self.inventory.nvml_error and not self.inventory.gpus:
            raise NvmlUnavailable(self.inventory.nvml_error)
        profiles = all_profiles([Path(d) for d in self.config.profile_dirs])
        self.profile = select_profile(profiles, self.inventory.gpu_names, self.config.profile)
        self.config = with_profile(self.config, self.checks, self.profile)
        self.node = self.config.node_name or (
            f"sim-{self.simulation.scenario.name}" if self.simulation else socket.gethostname())
        self.check_state = CheckStateStore(self.state_dir / "checks" if self.persist_state else None)
        self.runner = Runner(self.hw, self.inventory, self.profile, self.config, node=self.node,
                             state=self.check_state.get, state_dir=self.state_dir)

    def stop(self) -> None:
        self.hw.nvml.shutdown()

    @property
    def state_dir(self) -> Path:
        if self.simulation is not None:
            return self.simulation.node.root / "state"
        return Path(self.config.state_dir)

    @property
    def kmsg_path(self) -> Path:
        if self.simulation is not None:
            return self.simulation.node.kmsg_path
        if self.config.kmsg_path:
            return Path(self.config.kmsg_path)
        return self.hw.host_root / "dev" / "kmsg"

    def open_kernel_log(self, *, bounded: bool = False) -> KernelLogFollower:
        """A follower of the kernel log. Records that carry only kernel time are dated from
        /proc/stat btime, else from /proc/uptime, else from the newest record
        (``KernelLogFollower.boot_anchor``). ``bounded``: see ``KernelLogFollower`` (the
        daemon's pump reads a backlog in bounded turns)."""
        boot_time = self.hw.fs.boot_time()
        uptime: float | None = None
        if boot_time is None:
            try:
                uptime = float(self.hw.fs.read_text("proc/uptime").split()[0])
            except (HwCondition, IndexError, ValueError):
                uptime = None
        return KernelLogFollower(self.kmsg_path, boot_time=boot_time, uptime_s=uptime,
                                 poll_interval=self.config.daemon.kernel_log_poll_s, bounded=bounded)

    def kernel_log_snapshot(self, saved: Path | None = None, *, all_boots: bool = False) -> KernelLog:
        """Everything the kernel log holds for the current boot, parsed; ``available`` False,
        with the reason, when it cannot be read (missing, a directory, permission denied...).

        ``saved``: judge this saved log (dmesg, ``journalctl -k``, kern.log, a /dev/kmsg dump) on
        purpose instead of the live one (``gpumon check --kmsg-file``). It is its own boot: not
        compared with this host's boot time; only its last boot is kept (journal ``-- Boot``
        markers, the kernel clock stepping back), every record with ``all_boots``. Records are
        dated by their own clock (kernel time only: as if the log ended now), and the log is
        judged at its newest record (``SavedKernelLog.judged_at``). The daemon never reads a log
        this way."""
        path = saved if saved is not None else self.kmsg_path
        if not path.exists():
            return KernelLog(available=False, error=f"{path} does not exist", source=str(path))
        if not os.access(path, os.R_OK):
            return KernelLog(available=False, error=f"{path} is not readable (permission denied)",
                             source=str(path))
        follower = (KernelLogFollower(path, all_boots=all_boots) if saved is not None
                    else self.open_kernel_log())
        try:
            records = follower.read_available()
            lost = follower.lost_records
            failed = follower.last_error
            anchor = follower.boot_anchor
        except OSError as exc:
            failed = exc
        finally:
            follower.close()
        if failed is not None:
            return KernelLog(available=False, error=kernel_log_error(path, failed), source=str(path))
        parser = NvrmParser()
        events: list[object] = []
        for rec in records:
            events.extend(parser.feed(rec))
        events.extend(parser.flush())
        if saved is not None:
            log = SavedKernelLog(events=events, records=records, available=True, source=str(path),
                                 records_read=len(records), lost_records=lost, boot_time=anchor,
                                 all_boots=all_boots)
            t = now()
            log.judged_at = max((log.time_of(r, t) for r in records), default=t)
            return log
        return KernelLog(events=events, records=records, available=True, source=str(path),
                         records_read=len(records), lost_records=lost, boot_time=anchor)

    def selected(self, phase: Phase, names: Sequence[str] = ()) -> list[Check]:
        chosen = []
        for name, cls in self.checks.items():
            if names and name not in names:
                continue
            if not names and (cls.phase is not phase or not self.config.settings(cls).enabled):
                continue
            chosen.append(cls())
        return chosen

    def run_once(self, checks: Sequence[Check]) -> list[CheckRun]:
        log = self.kernel_log_snapshot() if any(c.uses_kernel_log for c in checks) else None
        return self.runner.run(checks, log)


@dataclass
class SavedKernelLog(KernelLog):
    """A saved kernel log judged on purpose (``Agent.kernel_log_snapshot(saved=...)``), not this
    boot's live log. Checks that date verdicts (the xid check) judge it at ``judged_at``, the
    time of its newest record, as the node would have been judged when the log ended."""

    judged_at: float = 0.0
    all_boots: bool = False


def kernel_log_error(path: Path, exc: OSError) -> str:
    """Why the kernel log at ``path`` cannot be read, in words."""
    return f"reading {path}: {exc.strerror or exc}"


def now() -> float:
    return time.time()
