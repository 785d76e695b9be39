"""Issue 14 #3: a host file that never answers costs only the readings of that file.

A real FIFO nobody writes stands in for a sysfs attribute behind a dead device (``open``
blocks in the kernel). The node is rendered by the simulator into a host-root tree and
served by the NVML injection library; the FIFO replaces one file after rendering, and
``gpumon`` runs as a child process against that tree with ``--host-root`` (a re-render
would replace the FIFO).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env
from gpumon.sim import nvml_inject
from gpumon.sim.render import SimNode
from gpumon.sim.scenario import load_scenario

GPU0 = "0000:19:00.0"  # gpumon.sim.render.GPU_BUSES[0]


@dataclass
class HostTree:
    node: SimNode
    config: Path
    state: Path
    env: dict[str, str]

    @property
    def root(self) -> Path:
        return self.node.host_root

    def gpumon(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpumon", "--config", str(self.config), "--host-root",
                               str(self.root), *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout)


def _release(fifo: Path) -> None:
    """Let readers blocked on ``fifo`` go (they read end of file); nothing if none waits."""
    for _ in range(4):
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader
            return
        os.close(fd)


@pytest.fixture
def tree(tmp_path: Path, inject_lib_dir: Path) -> Iterator[HostTree]:
    scenario = tmp_path / "node.yaml"
    scenario.write_text("name: fifo\nsku: h100-sxm\ngpus: 8\nfaults: []\n")
    node = SimNode(load_scenario(str(scenario)), tmp_path / "node")
    node.render(0.0)
    state = tmp_path / "state"
    config = tmp_path / "gpumon.yaml"
    # the daemon of a host tree serves its intake beside the tree, not in this machine's /run
    config.write_text(f"state_dir: {state}\ndaemon:\n  intake_socket: {tmp_path / 'run' / 'intake.sock'}\n"
                      "timeouts:\n  sysfs_read_s: 1\n")
    env = nvml_inject.subprocess_env(inject_lib_dir, node.nvml_state_path, base=clean_env())
    yield HostTree(node, config, state, env)
    for path in node.host_root.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_fifo():
                _release(path)


def _fifo(tree: HostTree, rel: str) -> Path:
    path = tree.root / rel
    assert path.is_file(), path
    path.unlink()
    os.mkfifo(path)
    return path


READ_BOUND_S = 1.0  # timeouts.sysfs_read_s of the tree's configuration


@pytest.fixture
def healthy(tree: HostTree) -> dict[str, float]:
    """Each check's seconds on the tree before a file is stuck: the baseline of this machine now."""
    runs, _, _ = _run(tree)
    return {name: float(r["seconds"]) for name, r in runs.items()}


def _run(tree: HostTree) -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Any]], float]:
    start = time.monotonic()
    proc = tree.gpumon("check", "--json", "-v")
    elapsed = time.monotonic() - start
    assert proc.returncode in (0, 1, 2), proc.stderr  # never 3: one stuck file does not stop gpumon
    doc = json.loads(proc.stdout)
    runs = {c["check"]: c for c in doc["checks"]}
    assert {r["outcome"] for r in runs.values()} <= {"completed", "skipped"}, runs  # none hung
    return runs, {(f["check"], f["component"]): f for f in doc["findings"]}, elapsed


def _check(tree: HostTree, healthy: dict[str, float]
           ) -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Any]], float]:
    runs, found, elapsed = _run(tree)
    # nothing waited behind the stuck read: a check that reads the stuck file waits one read bound;
    # one that waited behind it would wait two or more. Each check against its own healthy run
    # (twice that, for a busy machine's noise) plus one read bound and half of one
    slow = {name: (r["seconds"], healthy.get(name)) for name, r in runs.items()
            if r["seconds"] > 2 * healthy.get(name, 0.0) + 1.5 * READ_BOUND_S}
    assert not slow, f"check: (seconds now, seconds on the healthy tree): {slow}"
    return runs, found, elapsed


def _not_ok(found: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {k: f["message"] for k, f in found.items() if f["severity"] not in ("ok", "skipped")}


def test_a_stuck_infiniband_file_fails_only_its_port(tree: HostTree, healthy: dict[str, float]) -> None:
    _fifo(tree, "sys/class/infiniband/mlx5_2/ports/1/state")
    _, found, _ = _check(tree, healthy)
    port = found[("ib", "ib/mlx5_2/1")]
    assert (port["severity"], port["message"]) == (
        "fail", "hung after 1 s in read(sys/class/infiniband/mlx5_2/ports/1/state)")
    for dev in ("mlx5_0", "mlx5_1", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"):
        assert found[("ib", f"ib/{dev}/1")]["severity"] == "ok", found[("ib", f"ib/{dev}/1")]
    # no other check is blamed for it (the boot id, PCI listing and NVML readings go on)
    blamed = {k: m for k, m in _not_ok(found).items() if k[0] != "ib"}
    assert blamed == {}, blamed


def test_a_stuck_pci_identity_file_is_that_functions_finding_and_gpumon_runs(
        tree: HostTree, healthy: dict[str, float]) -> None:
    """Exited 3 before ("listdir(sys/class/infiniband) not attempted: read(.../vendor) has been
    hung"): the inventory read of a GPU's vendor file hung and took every later read with it."""
    _fifo(tree, f"sys/bus/pci/devices/{GPU0}/vendor")
    _, found, _ = _check(tree, healthy)
    presence = found[("gpu_presence", f"pci/{GPU0}")]
    assert (presence["severity"], presence["message"]) == (
        "fail", f"hung after 1 s in read(sys/bus/pci/devices/{GPU0}/vendor)")
    count = found[("gpu_presence", "node")]
    assert count["severity"] == "unknown" and GPU0 in count["message"], count
    pcie = found[("pcie", f"pci/{GPU0}")]
    assert pcie["severity"] == "unknown" and f"{GPU0}/vendor) did not return within 1 s" in pcie["message"]
    # every other reading came through: the other GPUs' PCI functions, IB ports, NVML checks
    expected = {("gpu_presence", f"pci/{GPU0}"), ("gpu_presence", "node"), ("pcie", f"pci/{GPU0}")}
    others = {k: m for k, m in _not_ok(found).items() if k not in expected}
    assert others == {}, others
    assert found[("pcie", "pci/0000:3b:00.0")]["severity"] == "ok"
    assert all(found[("ib", f"ib/mlx5_{i}/1")]["severity"] == "ok" for i in range(8))


def test_a_stuck_aer_counter_is_unknown_for_its_function_only(
        tree: HostTree, healthy: dict[str, float]) -> None:
    _fifo(tree, f"sys/bus/pci/devices/{GPU0}/aer_dev_correctable")
    _, found, _ = _check(tree, healthy)
    assert set(_not_ok(found)) == {("pcie", f"pci/{GPU0}")}, _not_ok(found)
    gpu0 = found[("pcie", f"pci/{GPU0}")]
    assert gpu0["severity"] == "unknown"
    assert "aer_dev_correctable) did not return within 1 s" in gpu0["message"]
    assert "link attributes" not in gpu0["message"]  # read after the stuck file: still read


def _wait_report(tree: HostTree, proc: subprocess.Popen[str], err: Path,
                 want: Callable[[dict[tuple[str, str], dict[str, Any]]], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the daemon exited {proc.returncode}:\n{err.read_text()[-3000:]}"
        try:
            report = json.loads((tree.state / "report.json").read_text())
            if want({(f["check"], f["component"]): f for f in report["findings"]}):
                return
        except (OSError, ValueError):
            pass  # not written yet
        assert time.monotonic() < deadline, f"{what}: not within 120 s\n{err.read_text()[-3000:]}"
        time.sleep(0.2)


def test_the_daemon_survives_a_stuck_infiniband_file(tree: HostTree) -> None:
    """Exited 3 before after ~60 s ("read(proc/sys/kernel/random/boot_id) not attempted:
    read(sys/class/infiniband ...) has been hung"): the boot-id read behind the stuck one, asked
    when a kernel-log record arrived. Here a record arrives while the file is stuck."""
    fifo = _fifo(tree, "sys/class/infiniband/mlx5_2/ports/1/state")
    tree.config.write_text(tree.config.read_text().replace("sysfs_read_s: 1", "sysfs_read_s: 0.5")
                           + "checks:\n  xid:\n    interval_s: 1\n")
    err_path = tree.state.parent / "daemon.err"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", "--config", str(tree.config), "--host-root",
                                 str(tree.root), "daemon", "--duration", "300", "--listen", "127.0.0.1:0"],
                                stdout=subprocess.DEVNULL, stderr=err_file, text=True, env=tree.env)
    try:
        # the record arrives once the ib check has hit the FIFO, and the daemon stops once it took it in
        _wait_report(tree, proc, err_path, lambda f: ("ib", "ib/mlx5_2/1") in f
                     and f[("ib", "ib/mlx5_2/1")]["severity"] == "fail", "the ib check hung on the FIFO")
        with open(tree.node.kmsg_path, "a") as log:
            log.write("4,90001,4200000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, "
                      "Graphics SM Warp Exception\n")
        _wait_report(tree, proc, err_path, lambda f: ("xid", "gpu/1") in f, "the Xid taken in")
        proc.terminate()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        _release(fifo)
    err = err_path.read_text(errors="replace")
    assert proc.returncode == 0, err[-3000:]
    report = json.loads((tree.state / "report.json").read_text())
    found = {(f["check"], f["component"]): f for f in report["findings"]}
    port = found[("ib", "ib/mlx5_2/1")]
    assert port["severity"] == "fail" and "read(sys/class/infiniband/mlx5_2/ports/1/state)" in port["message"]
    assert found[("xid", "gpu/1")]["evidence"]["code"] == 13  # the record was taken in
    blamed = {k: f["message"] for k, f in found.items()
              if k[0] not in ("ib", "xid") and f["severity"] not in ("ok", "skipped")}
    assert blamed == {}, blamed
