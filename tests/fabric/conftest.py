"""Fixtures for multi-node tests: test hosts in network namespaces, and a Slurm cluster on them.

tests/fabric is a package (it has an ``__init__.py``): a second top-level ``conftest`` module would
replace ``tests/conftest.py`` in ``sys.modules`` and break the suite's ``from conftest import ...``.
Import the harness relatively (``from .netns import TestNet``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .netns import TestNet
from .slurm_cluster import SlurmCluster, require_slurm

SLURM_NODES = 3


@pytest.fixture
def testnet() -> Iterator[Callable[..., TestNet]]:
    """``testnet(n, **kw)`` -> a TestNet of n hosts (see TestNet for kw), closed at teardown."""
    made: list[TestNet] = []

    def make(n: int, **kw: Any) -> TestNet:
        net = TestNet(n, **kw)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """slurmctld + slurmd node0..node2 on a TestNet of 3 hosts, for the module. A test that drains a
    node resumes it (``slurm_cluster.resume(name)``) in a finally."""
    require_slurm()
    with TestNet(SLURM_NODES) as net, SlurmCluster(net) as cluster:
        yield cluster
