"""CPU cgroups with a CFS quota for the straggler tests: a real limit on a rank's CPU, outside the guard.

Every rank of a straggler scenario runs capped at half a CPU (1 ms of every 2 ms), so three ranks fit
in a 2-core machine with room for the rest and no healthy rank is slowed by sharing a core with another
(uncapped, on a 2-core CI machine, one of three ranks became a real and consistent straggler: the
CFS balancer paired it with a neighbour). The slowed rank moves into ``slow``, capped at 20 % (1 ms of
every 5 ms; a quota is at least 1 ms): 0.4 of its healthy pace. A rank moves itself by writing its pid
to ``cgroup.procs`` (``join``).

The group as a whole has the largest CPU weight the kernel takes (``cpu.shares`` 262144, ``cpu.weight``
10000), so its ranks get their quotas whatever else the machine runs: they stand in for GPUs, which no
neighbour shares. At the default weight a busy neighbour took the healthy ranks' share too (two CPU
hogs on a 2-core machine left the group about a third of a core): every rank slowed towards the
capped one, and the slowed rank read pace 0.9, then 0.6, then 0.45, named a window late. What is
left to the rest of the machine is at least 0.8 of a CPU (two ranks at half a CPU, the slowed at 20 %).

The periods are short beside a step (~15 ms of CPU, pace_ranks.py): a step that ends just after its
period's quota ran out waits for the next period, so a period comparable to a step makes healthy
steps' times jump by a whole period (with 5 ms periods and 3 ms steps, a CI run read a healthy rank
at pace 0.65 in 2 of 3 windows).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

SHARE = (1000, 2000)  # (quota, period) µs: half a CPU
SLOW = (1000, 5000)  # 20 %: a quota is at least 1 ms, so a 5 ms period
V1_MAX_SHARES = 262144  # the kernel's MAX_SHARES (kernel/sched/sched.h)
V2_MAX_WEIGHT = 10000  # CGROUP_WEIGHT_MAX (include/linux/cgroup.h)


def make(name: str, children: Iterable[str]) -> Path:
    """A CPU cgroup ``name`` with ``children`` at half a CPU each and ``slow`` at 20 % (v1 or v2)."""
    shares = {**{c: SHARE for c in children}, "slow": SLOW}
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() or (v1 / "tasks").exists():
        top = v1 / name
        top.mkdir(exist_ok=True)
        (top / "cpu.shares").write_text(f"{V1_MAX_SHARES}\n")
        for child, (quota, period) in shares.items():
            d = top / child
            d.mkdir(exist_ok=True)
            (d / "cpu.cfs_period_us").write_text(f"{period}\n")
            (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        return top
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
            (v2 / "cgroup.subtree_control").write_text("+cpu\n")
        top = v2 / name
        top.mkdir(exist_ok=True)
        (top / "cpu.weight").write_text(f"{V2_MAX_WEIGHT}\n")
        (top / "cgroup.subtree_control").write_text("+cpu\n")
        for child, (quota, period) in shares.items():
            d = top / child
            d.mkdir(exist_ok=True)
            (d / "cpu.max").write_text(f"{quota} {period}\n")
        return top
    raise OSError("no CPU cgroup controller mounted")


def remove(top: Path) -> None:
    for child in top.iterdir():
        if child.is_dir():
            child.rmdir()
    top.rmdir()


@contextmanager
def cgroups(name: str, children: Iterable[str]) -> Iterator[Path]:
    """``make`` for a test (root and a CPU controller: skipped without them, failed in CI), then removed."""
    import pytest  # the rank scripts import this module too

    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the straggler test needs root (a CPU cgroup)")
        pytest.skip("needs root: a CPU cgroup slows one rank")
    try:
        top = make(f"{name}-{os.getpid()}", children)
    except OSError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no CPU cgroup: {exc}")
        pytest.skip(f"no CPU cgroup: {exc}")
    try:
        yield top
    finally:
        remove(top)


def join(cgroup: Path) -> None:
    """Move this process into ``cgroup``."""
    (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
