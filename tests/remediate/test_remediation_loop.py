"""The remediation loop's snapshot, which the exporter publishes as ``gpumon_remediation_info``: its
``backend`` label names the scheduler backend (kubernetes, slurm), not the policy class."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from prometheus_client import generate_latest

from gpumon.config import RemediationSettings, SlurmSettings
from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
from gpumon.health import Health
from gpumon.hw.tools import ToolRunner
from gpumon.remediate.base import Mode
from gpumon.remediate.kubernetes import KubernetesBackend
from gpumon.remediate.policy import RemediationPolicy
from gpumon.remediate.runner import RemediationLoop


@pytest.fixture
def health(tmp_path: Path) -> Iterator[Health]:
    h = Health.open(tmp_path / "state", boot_id="boot-1")
    try:
        yield h
    finally:
        h.close()


def _info(loop: RemediationLoop) -> list[str]:
    snap = Snapshot("n1", "p", "v", remediation=loop.snapshot())
    text = generate_latest(make_registry(SnapshotHolder(snap))).decode()
    return [line for line in text.splitlines() if line.startswith("gpumon_remediation_info")]


def test_a_slurm_loop_built_from_the_configuration_names_slurm(health: Health) -> None:
    settings = RemediationSettings(backend="slurm", mode="enforce", slurm=SlurmSettings(node_name="gpu01"))
    loop = RemediationLoop.build(settings, health, None, ToolRunner(default_timeout=5))
    assert loop is not None  # built, never started: no scheduler is asked anything
    snap = loop.snapshot()
    assert (snap["backend"], snap["mode"]) == ("slurm", "enforce")
    assert _info(loop) == ['gpumon_remediation_info{backend="slurm",mode="enforce"} 1.0']


def test_a_kubernetes_loop_names_kubernetes(health: Health) -> None:
    backend = KubernetesBackend("n1", client.ApiClient(client.Configuration()))
    loop = RemediationLoop(RemediationPolicy(backend, health, mode=Mode.OBSERVE), 60.0)
    assert loop.snapshot()["backend"] == "kubernetes"
    assert _info(loop) == ['gpumon_remediation_info{backend="kubernetes",mode="observe"} 1.0']
