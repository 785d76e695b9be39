"""Assembles one gpumon instance from a Config: hardware, inventory, profile, runner.

Used by every CLI command. Startup failures are ``StartupError`` (exit 3);
nothing here exits the process.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpumon.check import Check
from gpumon.checkstate import CheckStateStore
from gpumon.config import Config, with_profile
from gpumon.errors import NvmlUnavailable, StartupError
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory, collect
from gpumon.hw.kernellog import KernelLogFeed, KernelLogSource, ReadOnce, read_saved, snapshot
from gpumon.machine import Machine
from gpumon.model import CheckRun, Phase
from gpumon.profiles import Profile, all_profiles, select_profile
from gpumon.registry import NotLoaded
from gpumon.runner import Runner


@dataclass
class Agent:
    config: Config
    checks: dict[str, type[Check]]
    # the node it runs on, handed in by the CLI (a simulated node's ``Machine`` with --simulate)
    machine: Machine = field(default_factory=Machine)
    # only the daemon keeps check state across runs; one-shot commands start clean
    persist_state: bool = False
    # the entry points that gave no check (gpumon.registry): reported by every command that runs
    # the checks, as an ``unknown`` finding each
    not_loaded: dict[str, NotLoaded] = field(default_factory=dict)
    hw: Hardware = field(init=False)
    inventory: Inventory = field(init=False)
    profile: Profile = field(init=False)
    node: str = field(init=False)
    runner: Runner = field(init=False)
    check_state: CheckStateStore = field(init=False)

    def start(self, *, require_nvml: bool = True) -> None:
        """``require_nvml``: False for the commands that also run where there is no NVML (the
        canary and the fabric probe on a CPU machine); the inventory's ``nvml_error`` says why."""
        host_root = self.machine.host_root(Path(self.config.host_root))
        if not host_root.is_dir():
            raise StartupError(f"host root {host_root} is not a directory")
        if not (host_root / "sys").is_dir() and not (host_root / "proc").is_dir():
            raise StartupError(f"host root {host_root} has neither sys/ nor proc/: is the host "
                               "mounted there?")
        t = self.config.timeouts
        self.hw = Hardware(host_root, nvml_timeout=t.nvml_call_s, fs_timeout=t.sysfs_read_s,
                           tool_timeout=t.tool_default_s, devices=self.machine.devices(),
                           nvml_complete=self.machine.nvml_complete)
        try:
            self.hw.nvml.init()
        except NvmlUnavailable as exc:
            if require_nvml:
                raise
            self.inventory = collect(None, self.hw.fs, str(exc))
        else:
            self.inventory = collect(self.hw.nvml, self.hw.fs)
            if self.inventory.nvml_error and not self.inventory.gpus and require_nvml:
                raise NvmlUnavailable(self.inventory.nvml_error)
        profiles = all_profiles([Path(d) for d in self.config.profile_dirs])
        self.profile = select_profile(profiles, self.inventory.gpu_names, self.config.profile)
        self.config = with_profile(self.config, self.checks, self.profile, not_loaded=self.not_loaded)
        self.node = self.config.node_name or self.machine.node_name() or socket.gethostname()
        self.check_state = CheckStateStore(self.state_dir / "checks" if self.persist_state else None)
        self.runner = Runner(self.hw, self.inventory, self.profile, self.config, node=self.node,
                             states=self.check_state, state_dir=self.state_dir)

    def stop(self) -> None:
        self.hw.nvml.shutdown()

    @property
    def state_dir(self) -> Path:
        return self.machine.state_dir(Path(self.config.state_dir))

    @property
    def kmsg_path(self) -> Path:
        configured = self.hw.host_root / "dev" / "kmsg"
        if self.config.kmsg_path:
            configured = Path(self.config.kmsg_path)
        return self.machine.kmsg_path(configured)

    def kernel_log_source(self, *, bounded: bool = False) -> KernelLogSource:
        """This boot's kernel log, followed (gpumon.hw.kernellog); ``bounded``: the daemon's pump
        reads a backlog in bounded turns."""
        return KernelLogSource(self.kmsg_path, self.hw.fs, poll_interval=self.config.daemon.kernel_log_poll_s,
                               bounded=bounded)

    def kernel_log_snapshot(self, saved: Path | None = None, *, all_boots: bool = False) -> KernelLogFeed:
        """For one run of checks: everything the kernel log holds for the current boot, parsed
        (``available`` False, with the reason, when it cannot be read), read when the first check
        that reads it asks; ``saved``: judge this saved log instead (``gpumon check --kmsg-file``,
        see ``gpumon.hw.kernellog.read_saved``)."""
        if saved is not None:
            return ReadOnce(lambda: read_saved(saved, all_boots=all_boots))
        return ReadOnce(lambda: snapshot(self.kernel_log_source()))

    def selected(self, phase: Phase, names: Sequence[str] = ()) -> list[Check]:
        chosen = []
        for name, cls in self.checks.items():
            if names and name not in names:
                continue
            if not names and (cls.phase is not phase or not self.config.settings(cls).enabled):
                continue
            chosen.append(cls())
        return chosen

    def not_loaded_runs(self, names: Sequence[str] = ()) -> list[CheckRun]:
        """A run per check that did not load (only those in ``names``, when given)."""
        return [bad.run() for name, bad in self.not_loaded.items() if not names or name in names]

    def run_once(self, checks: Sequence[Check]) -> list[CheckRun]:
        return self.runner.run(checks, self.kernel_log_snapshot())
