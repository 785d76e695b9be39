"""Runs the remediation policy on its own thread inside the daemon.

Scheduler API calls can take seconds (apiserver, slurmctld); they never run on
a check's thread or under the daemon's lock. The thread steps the policy every
``interval_s`` and whenever the node's health changes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from gpumon.config import RemediationSettings
from gpumon.distribution import ExtraMissing, require
from gpumon.errors import ConfigError, StartupError
from gpumon.health import Health
from gpumon.hw.tools import ToolRunner
from gpumon.model import Action
from gpumon.remediate.base import Mode, SchedulerBackend
from gpumon.remediate.policy import PolicyResult, RemediationPolicy
from gpumon.schema import Source

log = logging.getLogger("gpumon.remediate")


def make_backend(settings: RemediationSettings, node_name: str | None, tools: ToolRunner,
                 src: Source | None = None) -> SchedulerBackend:
    """``src``: where the settings were read (the config's layers), for an error naming the file and
    line that chose the backend."""
    if settings.backend == "kubernetes":
        try:
            require("kubernetes", extra="kubernetes", library="the kubernetes client", needed_by="kubernetes")
        except ExtraMissing as exc:
            if src is None:
                raise ConfigError(str(exc), key="remediation.backend") from None
            raise src.error(("remediation", "backend"), str(exc)) from None
        from gpumon.remediate.kubernetes import KubernetesBackend, KubernetesError

        k = settings.kubernetes
        name = k.node_name or os.environ.get("NODE_NAME") or node_name or socket.gethostname()
        try:
            return KubernetesBackend(name, kubeconfig=k.kubeconfig, node_selector=k.node_selector,
                                     request_timeout_s=k.request_timeout_s)
        except KubernetesError as exc:
            raise StartupError(f"remediation.kubernetes: {exc}") from None
    if settings.backend == "slurm":
        from gpumon.remediate.slurm import SlurmBackend

        s = settings.slurm
        name = s.node_name or node_name or socket.gethostname().split(".")[0]
        return SlurmBackend(name, tools, scontrol=s.scontrol, sinfo=s.sinfo, timeout_s=s.timeout_s,
                            slurm_conf=s.slurm_conf)
    raise StartupError(f"no remediation backend {settings.backend!r}")


class RemediationLoop:
    def __init__(self, policy: RemediationPolicy, interval_s: float) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.ready = threading.Event()  # set once every check has reported: no decision before
        self.last: PolicyResult | None = None
        self.errors = 0
        self.thread = threading.Thread(target=self._loop, name="gpumon-remediate", daemon=True)

    @classmethod
    def build(cls, settings: RemediationSettings, health: Health, node_name: str | None,
              tools: ToolRunner, src: Source | None = None) -> RemediationLoop | None:
        if settings.backend == "none":
            return None
        backend = make_backend(settings, node_name, tools, src)
        policy = RemediationPolicy(backend, health, mode=Mode(settings.mode),
                                   breaker_share=settings.breaker.share,
                                   breaker_window_s=settings.breaker.window_s,
                                   take_out_actions=[Action(a) for a in settings.take_out_actions])
        return cls(policy, settings.interval_s)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(self.interval_s)
            self.wake.clear()
            if self.stop.is_set():
                return
            if not self.ready.is_set():
                continue
            result = self.policy.step()
            if result.error:
                self.errors += 1
                log.warning("remediation: %s", result.error)
            elif result.changed or result.would_change:
                log.warning("remediation (%s): %s %s: %s", result.mode.value, result.decision.value,
                            result.action.value, "; ".join(result.outcome.changes if result.outcome else []))
            self.last = result

    def close(self, timeout: float) -> None:
        self.stop.set()
        self.wake.set()
        self.thread.join(timeout=timeout)

    def snapshot(self) -> dict[str, Any]:
        last = self.last
        # the scheduler backend's own name (kubernetes, slurm), as remediation.backend configures it
        return {"mode": self.policy.mode.value, "backend": self.policy.backend.name,
                "breaker_open": bool(last and last.breaker_open), "errors_total": self.errors,
                "decision": last.decision.value if last else None,
                "error": bool(last and last.error), "time": last.time if last else None,
                "share": last.share.share if last and last.share else None}
